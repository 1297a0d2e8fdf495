"""A gated residual into an adaptive LayerNorm: the public function, its argument checks and which
implementation serves a call (:mod:`cudnorm._gated` holds both)."""

from __future__ import annotations

import torch

from . import _candidates, _checks, _decisions, _entry, _gated, _policy
from .ada_layer_norm import ada_layer_norm

_OP = "gated_ada_layer_norm"
_TENSOR = torch.Tensor  # a plain tensor, as the native entry serves it (its subclasses are not)


def _check_call(residual, branch, gate, scale, shift, eps, one_plus_scale) -> float:
    """Validate a call; return eps as a float. Raises cudnorm's error naming the argument."""
    _checks.check_tensor(_OP, "residual", residual, dtypes=_checks.INPUT_DTYPES)
    if residual.dim() != 3:
        raise ValueError(f"cudnorm.{_OP}: argument 'residual' must be [B, S, D], got shape "
                         f"{_checks.dims(residual.shape)}")
    _checks.check_tensor(_OP, "branch", branch, dtypes=(residual.dtype,))
    if branch.shape != residual.shape:
        raise ValueError(f"cudnorm.{_OP}: argument 'branch' has shape {_checks.dims(branch.shape)}; expected the "
                         f"residual's {_checks.dims(residual.shape)}")
    _checks.check_same_device(_OP, "branch", branch, residual)
    b, d = residual.shape[0], residual.shape[-1]
    for arg, value in (("gate", gate), ("scale", scale), ("shift", shift)):
        _checks.check_tensor(_OP, arg, value, dtypes=(residual.dtype,))
        if tuple(value.shape) not in ((b, d), (b, 1, d)):
            raise ValueError(f"cudnorm.{_OP}: argument '{arg}' has shape {_checks.dims(value.shape)}; expected "
                             f"[B, D] or [B, 1, D] with B={int(b)}, D={int(d)}")
        _checks.check_same_device(_OP, arg, value, residual)
    eps = _checks.check_eps(_OP, eps)
    if not isinstance(one_plus_scale, bool):
        raise TypeError(f"cudnorm.{_OP}: argument 'one_plus_scale' must be a bool, got {type(one_plus_scale).__name__}")
    return eps


def gated_ada_layer_norm(residual: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor,
                         shift: torch.Tensor, eps: float = 1e-6, one_plus_scale: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A sublayer's output added to the residual stream through a per-sample gate, then the next
    adaptive LayerNorm: ``h = residual + gate * branch``, ``y = norm(h) * (1 + scale) + shift``
    (``one_plus_scale=False``: ``* scale``), as DiT-style blocks write it between sublayers.

    Args:
        residual: ``[B, S, D]`` (the residual stream), float16/bfloat16/float32 (float64 runs
            PyTorch's ops).
        branch: ``[B, S, D]`` of ``residual``'s dtype (e.g. the attention's output).
        gate: ``[B, D]`` or ``[B, 1, D]`` of ``residual``'s dtype, one row per sample.
        scale: like ``gate``.
        shift: like ``gate``.
        eps: added to the variance.
        one_plus_scale: ``True`` (the default, DiT's ``modulate``) or ``False``.

    Returns:
        ``(y, h)``, both ``[B, S, D]`` in ``residual``'s dtype; gradients flow to all five
        tensors (the modulation's summed over each sample's tokens in fp32). CPU, small and
        ``torch.compile``-traced calls run the formula in PyTorch's ops; an eager CUDA call that
        trains runs the formula or cudnorm's fused op (its backward one kernel), whichever
        measured faster for its signature (:mod:`cudnorm._policy`; under ``policy="cudnn"`` the
        fused op); without grad, one multiply-add and :func:`cudnorm.ada_layer_norm`.
    """
    # a plain tensor's call goes to C++ first while the native path serves (csrc/entry.cpp: these
    # rules and the decision, without the Python in front of them); it hands back what it does not serve
    if _entry.native and type(residual) is _TENSOR and not _entry.is_compiling():
        try:
            out = _entry.gated_ada_layer_norm(residual, branch, gate, scale, shift, eps, one_plus_scale)
        except (TypeError, RuntimeError):  # the entry refused an argument: cudnorm's error names it
            _check_call(residual, branch, gate, scale, shift, eps, one_plus_scale)
            raise
        if out is not None:
            return out
    if _entry.is_compiling():  # a mistake raises cudnorm's error when the compiled code runs
        error = _checks.traced_error(_check_call, residual, residual, branch, gate, scale, shift, eps, one_plus_scale)
        if error is not None:
            return error, error
    eps = _check_call(residual, branch, gate, scale, shift, eps, one_plus_scale)
    if residual.dtype is torch.float64 or not residual.numel() or _policy.torch_serves(residual, gate, scale, shift):
        return _gated.formula(residual, branch, gate, scale, shift, eps, one_plus_scale)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (residual, branch, gate, scale, shift))
    if not training:
        b, d = residual.shape[0], residual.shape[-1]
        h = torch.addcmul(residual, gate.reshape(b, 1, d), branch)
        return ada_layer_norm(h, scale, shift, eps, one_plus_scale), h
    if _gated.supports(residual, gate, scale, shift) and _decisions.serves(
            _candidates.GATED, residual, residual.shape[-1], scale, shift, True) != "torch":
        return _gated.fused(residual, branch, gate, scale, shift, eps, one_plus_scale)
    return _gated.formula(residual, branch, gate, scale, shift, eps, one_plus_scale)
