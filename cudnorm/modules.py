"""Drop-in ``nn.Module`` front ends of the functional ops.

``LayerNorm``/``RMSNorm`` subclass PyTorch's own modules, so constructor arguments,
parameters, ``state_dict`` keys and ``repr`` are exactly PyTorch's: a checkpoint saved from
``torch.nn.LayerNorm`` loads into ``cudnorm.LayerNorm`` and back.
"""

from __future__ import annotations

import torch

from .layer_norm import layer_norm
from .rms_norm import rms_norm


class LayerNorm(torch.nn.LayerNorm):
    """:class:`torch.nn.LayerNorm` running :func:`cudnorm.layer_norm`.

    Input ``[*, *normalized_shape]`` in fp16/bf16/fp32; parameters may be fp32 while the
    input is bf16/fp16 (mixed precision keeps fp32 master weights and fp32 gradients).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """:class:`torch.nn.RMSNorm` running :func:`cudnorm.rms_norm` (``eps=None`` means
    ``torch.finfo(input.dtype).eps``, as in PyTorch)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return rms_norm(input, self.normalized_shape, self.weight, self.eps)
