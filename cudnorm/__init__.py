"""cudnorm: LayerNorm, RMSNorm and adaptive LayerNorm/RMSNorm on NVIDIA cuDNN graphs, for PyTorch.

On a CUDA tensor the ops run cached cuDNN-frontend graphs; elsewhere (CPU tensors, no cuDNN,
a configuration cuDNN declines) the same calls run PyTorch's kernels.
"""

from . import _native  # noqa: F401 - the native launch path, tried at the first CUDA call
# cudnorm.diffusers: diffusers-compatible AdaLN classes (not in __all__: a star import must not
# shadow the diffusers package)
from . import _sharding, diffusers
from ._info import cache_info, clear_cache, info, serving_decisions, serving_path, share_decisions
from ._plan_store import clear_plan_store, install_default_store, plan_store_info
from ._settings import Config, config, get_config
from ._version import __version__
from .ada_layer_norm import ada_layer_norm
from .ada_rms_norm import ada_rms_norm
from .gated_ada_layer_norm import gated_ada_layer_norm
from .layer_norm import layer_norm
from .modules import (AdaLayerNorm, AdaLayerNormContinuous, AdaLayerNormZero, AdaRMSNorm, FusedAddLayerNorm,
                      FusedAddRMSNorm, LayerNorm, RMSNorm)
from .patching import PatchReport, patch
from .rms_norm import rms_norm
from .warmup import record_specs, warmup


install_default_store()
_sharding.install()  # DTensor's sharding rules for the ops, once torch.distributed.tensor is imported

__all__ = [
    "AdaLayerNorm",
    "AdaLayerNormContinuous",
    "AdaLayerNormZero",
    "AdaRMSNorm",
    "Config",
    "FusedAddLayerNorm",
    "FusedAddRMSNorm",
    "LayerNorm",
    "PatchReport",
    "RMSNorm",
    "__version__",
    "ada_layer_norm",
    "ada_rms_norm",
    "cache_info",
    "clear_cache",
    "clear_plan_store",
    "config",
    "gated_ada_layer_norm",
    "get_config",
    "info",
    "layer_norm",
    "patch",
    "plan_store_info",
    "record_specs",
    "rms_norm",
    "serving_decisions",
    "serving_path",
    "share_decisions",
    "warmup",
]
