"""What the fused diffusers block forwards (:mod:`cudnorm._diffusers_blocks`) share: whether a
norm's call is observed, whether a block's norms can be read instead of called, and a norm with
its per-sample modulation as one op (:func:`modulated`: a LayerNorm on
:func:`cudnorm.ada_layer_norm`, :func:`rms_modulated`: a weightless RMSNorm on
:func:`cudnorm.ada_rms_norm`; :func:`gated_modulated`: a gated residual add and the next
modulated LayerNorm on :func:`cudnorm.gated_ada_layer_norm`). The forwards call these through
the module (``ops.modulated``), so the tests can count the fused calls."""

from __future__ import annotations

import torch

from . import _candidates, _decisions
from ._diffusers_forwards import _modulated_layer_norm
from .ada_layer_norm import ada_layer_norm
from .ada_rms_norm import ada_rms_norm
from .gated_ada_layer_norm import gated_ada_layer_norm
from .diffusers import _norm_kind, layer_norm_class

# torch's module-global hook registries (dicts mutated in place, never rebound): module calls
# run their hooks while any holds one
GLOBAL_HOOKS = tuple(getattr(torch.nn.modules.module, name) for name in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))


def observed(child: torch.nn.Module) -> bool:
    """Whether a call of ``child`` is observed: hooks on it, an instance ``forward`` (accelerate's
    offloading hook, which must load its weights) or global module hooks. A forward that reads
    ``child``'s parameters instead of calling it must then call the original forward. The test is
    ``nn.Module.__call__``'s own: attribute and dict reads, on every call."""
    return bool(child._forward_hooks or child._forward_pre_hooks or child._backward_hooks
                or child._backward_pre_hooks or "forward" in child.__dict__ or any(GLOBAL_HOOKS))


def fusable(*norms) -> bool:
    """The norms a fused forward reads instead of calling: LayerNorms over the last dim
    (:func:`cudnorm.diffusers.layer_norm_class`: ``nn.LayerNorm``'s is an identity test, on
    every call of every block), unobserved."""
    for norm in norms:
        if not layer_norm_class(type(norm)) or len(norm.normalized_shape) != 1 or observed(norm):
            return False
    return True


def why_not_layer_norms(norms) -> str | None:
    """A fused forward's ``why_not``: None where every norm it modulates is a LayerNorm over the
    last dim (what :func:`modulated` reads), else the reason it cannot run."""
    if all(_norm_kind(norm) == "layer_norm" for norm in norms):
        return None
    return "a norm it modulates is not a LayerNorm over the last dim"


def why_not_weightless_rms_norms(norms) -> str | None:
    """:func:`why_not_layer_norms` for the RMSNorms :func:`rms_modulated` reads."""
    if all(_norm_kind(norm) == "rms_norm" and norm.weight is None for norm in norms):
        return None
    return "a norm it modulates is not a weightless RMSNorm over the last dim"


def modulated(norm: torch.nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``norm(x) * (1 + scale[:, None]) + shift[:, None]`` as one op for ``x [B, S, D]`` and
    per-sample chunks ``scale``/``shift`` ``[B, D]`` (or ``[B, 1, D]``), ``norm`` a LayerNorm
    read, not called. The blocks' own case (no affine parameters, one dtype) goes straight to
    :func:`cudnorm.ada_layer_norm`; any other, :func:`cudnorm._diffusers_forwards._modulated_layer_norm`."""
    # the checks inline: this runs in every block of a host-bound step (tests/test_patch_blocks.py
    # counts its Python calls)
    weight, bias, b, d = norm.weight, norm.bias, x.shape[0], x.shape[-1]
    if (weight is None and bias is None and x.dtype is scale.dtype and shift.dtype is scale.dtype and x.dim() == 3
            and scale.shape[0] == b and scale.shape[-1] == d and scale.numel() == b * d and shift.shape == scale.shape):
        return ada_layer_norm(x, scale, shift, norm.eps, one_plus_scale=True)
    if scale.dim() == 2:  # diffusers' formula indexes [B, D] chunks as [B, 1, D]
        scale, shift = scale[:, None], shift[:, None]
    return _modulated_layer_norm(x, scale, shift, norm.eps, weight, bias)


def gated_modulated(norm: torch.nn.Module, residual: torch.Tensor, gate: torch.Tensor, branch: torch.Tensor,
                    scale: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + gate[:, None] * branch``, then :func:`modulated` of ``h``: ``(that, h)``,
    for a block's gated residual add followed by its next modulated norm (Flux's). The blocks'
    own case (a LayerNorm without affine parameters, one dtype, ``[B, D]`` chunks) is one
    :func:`cudnorm.gated_ada_layer_norm`; any other, the two steps."""
    # the checks inline, no generators: this runs in every block of a host-bound step
    # (tests/test_patch_blocks.py counts its Python calls)
    dtype, shape = residual.dtype, (residual.shape[0], residual.shape[-1])
    if (norm.weight is None and norm.bias is None and residual.dim() == 3 and branch.shape == residual.shape
            and branch.dtype is dtype and gate.dtype is dtype and scale.dtype is dtype and shift.dtype is dtype
            and gate.shape == shape and scale.shape == shape and shift.shape == shape):
        return gated_ada_layer_norm(residual, branch, gate, scale, shift, norm.eps, one_plus_scale=True)
    h = residual + gate.unsqueeze(1) * branch
    return modulated(norm, h, scale, shift), h


def fusable_rms(*norms) -> bool:
    """diffusers' RMSNorms without a weight (LTX-Video's blocks), unobserved: what
    :func:`cudnorm.ada_rms_norm` normalises."""
    return all(_norm_kind(norm) == "rms_norm" and norm.weight is None and not observed(norm) for norm in norms)


def rms_modulated(norm: torch.nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift`` for a weightless RMSNorm: one :func:`cudnorm.ada_rms_norm`
    where ``scale``/``shift`` are per sample (``[B, 1, D]``, x's dtype) and the fused op serves
    (:func:`_fused_rms_serves`), else the formula (the block's own: also a modulation per
    token, LTX-Video's conditioning frames)."""
    b, d = x.shape[0], x.shape[-1]
    if (x.dim() == 3 and scale.dtype is x.dtype and shift.dtype is x.dtype and scale.shape[0] == b
            and scale.shape[-1] == d and scale.numel() == b * d and shift.shape == scale.shape
            and _fused_rms_serves(x, scale, shift)):
        return ada_rms_norm(x, scale, shift, norm.eps, one_plus_scale=True)
    return norm(x) * (1 + scale) + shift


def _fused_rms_serves(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> bool:
    """Whether the fused adaptive RMSNorm serves a per-sample call rather than the block's own
    formula: the measured decision of op ``"modulated_rms_norm"`` (cudnorm's kernels against the
    formula in x's dtype, both through autograd) for an eager CUDA call under ``policy="auto"``;
    the fused op elsewhere (:func:`cudnorm._decisions.serves` answers ``"cudnn"`` there). The fused
    op's own decision weighs its kernels against its fp32 formula only: with it LTX-Video's
    training step ran 6-11% slower than under the plain patch (docs/patching.md)."""
    training = torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad or shift.requires_grad)
    return _decisions.serves(_candidates.MODULATED_RMS, x, x.shape[-1], scale, shift, training) != "torch"
