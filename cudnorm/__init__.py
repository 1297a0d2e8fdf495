"""cudnorm: LayerNorm, RMSNorm and adaptive LayerNorm on NVIDIA cuDNN graphs, for PyTorch.

On a CUDA tensor the ops run cached cuDNN-frontend graphs; elsewhere (CPU tensors, no cuDNN,
a configuration cuDNN declines) the same calls run PyTorch's kernels.
"""

from ._info import cache_info, clear_cache, info, serving_path
from .layer_norm import layer_norm
from .modules import LayerNorm, RMSNorm
from .rms_norm import rms_norm

__version__ = "0.1.0"

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "__version__",
    "cache_info",
    "clear_cache",
    "info",
    "layer_norm",
    "rms_norm",
    "serving_path",
]
