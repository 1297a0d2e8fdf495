"""The ``limit`` provider: the same model with its norms and its AdaLN modules' modulation
costing nothing, the ceiling of what faster norms could gain.

:func:`free_norms` changes, in place:

* every norm module (``nn.LayerNorm``, ``nn.RMSNorm`` and every class the patch table registers
  under a formula without modulation: diffusers' ``RMSNorm`` and ``FP32LayerNorm``, Llama's,
  Gemma's, Krea 2's, Stable Audio 3's RMSNorms, ...) into one returning its input: no statistics,
  no weight, no bias;
* diffusers' AdaLN modules (``AdaLayerNormZero``, ``AdaLayerNormZeroSingle``,
  ``SD35AdaLayerNormZeroX``, ``AdaLayerNormContinuous``) into ones that still run the GEMM
  producing the modulation (``linear(silu(emb))``, and DiT's timestep/label embedding) and
  return its gates, but return ``x`` where the module returns ``norm(x) * (1 + scale) + shift``.

Left as the model runs it: modulation written in the blocks' own forwards, outside any norm
module (diffusers' ``BasicTransformerBlock``: DiT's ``norm3(x) * (1 + scale_mlp) + shift_mlp``,
PixArt's ``scale_shift_table`` arithmetic around ``norm1``/``norm2``; SD3's and Flux's
``norm2(x) * (1 + scale_mlp) + shift_mlp``), since no module swap reaches it, nor
``cudnorm.patch``. Each class keeps its identity otherwise (a subclass, like the patch's), so
the model's code that unpacks the modules' outputs runs unchanged.
"""

from __future__ import annotations

import functools

import torch

from ... import _patch_table
from ..._patch_table import qualified_name

_NORMALIZATION = "diffusers.models.normalization"
#: the patch table's formulas of one input and one output of its shape (no modulation): a class
#: registered under one is a norm the limit frees, so a model whose norms the patch swaps has them
#: free in its limit too
PLAIN_FORMULAS = ("llama_rms_norm", "gemma_rms_norm", "fp32_rms_norm", "t5_rms_norm", "stable_audio3_rms_norm",
                  "cohere_layer_norm", "fp32_layer_norm")
_NORMS = frozenset(("torch.nn.modules.normalization.LayerNorm", "torch.nn.modules.normalization.RMSNorm",
                    *(name for formula in PLAIN_FORMULAS for name in _patch_table.CLASSES[formula])))


def _free_norm(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return x


def _modulation(self, emb: torch.Tensor, chunks: int) -> tuple[torch.Tensor, ...]:
    return self.linear(self.silu(emb)).chunk(chunks, dim=1)


def _free_ada_zero(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
    """diffusers' ``AdaLayerNormZero``: ``(x, gate_msa, shift_mlp, scale_mlp, gate_mlp)``."""
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = _modulation(self, emb, 6)
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _free_ada_zero_single(self, x, emb=None):
    """``AdaLayerNormZeroSingle``: ``(x, gate_msa)``."""
    return x, _modulation(self, emb, 3)[2]


def _free_sd35_ada_zero_x(self, hidden_states, emb=None):
    """``SD35AdaLayerNormZeroX``: ``(x, gate_msa, shift_mlp, scale_mlp, gate_mlp, x, gate_msa2)``."""
    _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp, _, _, gate_msa2 = _modulation(self, emb, 9)
    return hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, hidden_states, gate_msa2


def _free_ada_continuous(self, x, conditioning_embedding):
    """``AdaLayerNormContinuous``: ``x`` (its modulation GEMM still runs, unused: a GEMM of
    ``[B, D]`` rows, negligible beside the blocks')."""
    _modulation(self, self.silu(conditioning_embedding).to(x.dtype), 2)
    return x


_ADALN = {
    f"{_NORMALIZATION}.AdaLayerNormZero": _free_ada_zero,
    f"{_NORMALIZATION}.AdaLayerNormZeroSingle": _free_ada_zero_single,
    f"{_NORMALIZATION}.SD35AdaLayerNormZeroX": _free_sd35_ada_zero_x,
    f"{_NORMALIZATION}.AdaLayerNormContinuous": _free_ada_continuous,
}


@functools.cache  # one subclass per class
def _free_class(cls: type, forward) -> type:
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "forward": forward, "_bench_free": True})


def free_norms(model: torch.nn.Module) -> int:
    """Make the norms and AdaLN modules of ``model`` cost nothing, in place (see the module
    docstring); returns how many modules were changed. A norm inside a freed AdaLN module is
    left as it is: its caller no longer calls it."""
    changed = 0
    for module in list(model.modules()):
        cls = type(module)
        if getattr(cls, "_bench_free", False):
            continue
        name = qualified_name(cls)
        forward = _ADALN.get(name, _free_norm if name in _NORMS else None)
        if forward is not None:
            module.__class__ = _free_class(cls, forward)
            changed += 1
    return changed
