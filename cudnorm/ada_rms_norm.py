"""Adaptive RMSNorm: the public function, its argument checks and which implementation serves a call.

A non-affine RMSNorm modulated per sample, as diffusers' ``*RMSNormZero`` norms and DiT-style
``modulate`` write it: ``y = x * rstd * (1 + scale[b]) + shift[b]``. The implementations
(PyTorch's fp32 formula, cudnorm's Triton kernels) are :mod:`cudnorm._ada_rms`; CPU, float64,
small and traced calls take the formula (:mod:`cudnorm._policy`'s rules 0-3), and an eager
CUDA call the measured decision between the two (rule 4, :mod:`cudnorm._decisions`).
"""

from __future__ import annotations

import torch

from . import _ada_rms, _checks, _decisions, _entry, _ops, _policy, _token_entry

_OP = "ada_rms_norm"
_F32 = torch.float32


def _check_modulation(arg: str, value, input: torch.Tensor) -> None:
    """scale/shift: ``[B, D]`` or ``[B, 1, ..., 1, D]``, fp32 or the input's dtype (float64 only
    with a float64 input)."""
    _checks.check_tensor(_OP, arg, value, dtypes=_checks.param_dtypes(input.dtype))
    b, d, shape = input.shape[0], input.shape[-1], tuple(value.shape)
    if len(shape) < 2 or shape[0] != b or shape[-1] != d or any(n != 1 for n in shape[1:-1]):
        raise ValueError(f"cudnorm.{_OP}: argument '{arg}' has shape {_checks.dims(shape)}; expected [B, D] or "
                         f"[B, 1, D] with B={int(b)}, D={int(d)} from input of shape {_checks.dims(input.shape)}")
    _checks.check_same_device(_OP, arg, value, input)


def _check_call(input, scale, shift, eps, one_plus_scale) -> float:
    """Validate a call; return eps as a float. Raises cudnorm's error naming the argument."""
    _checks.check_input(_OP, input)
    if input.dim() < 2:
        raise ValueError(f"cudnorm.{_OP}: argument 'input' must be [B, *, D], got shape {_checks.dims(input.shape)}")
    _check_modulation("scale", scale, input)
    if shift is not None:
        _check_modulation("shift", shift, input)
    eps = _checks.check_eps(_OP, eps)
    if not isinstance(one_plus_scale, bool):
        raise TypeError(f"cudnorm.{_OP}: argument 'one_plus_scale' must be a bool, got {type(one_plus_scale).__name__}")
    return eps


def ada_rms_norm(input: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None = None, eps: float = 1e-6, *,
                 one_plus_scale: bool = True) -> torch.Tensor:
    """Adaptive RMSNorm: a non-affine RMSNorm over the last dim, modulated per sample or per token.

    ``y = x / sqrt(mean(x^2) + eps) * gain[b] + shift[b]`` for each token ``x`` of sample ``b``,
    computed in fp32 and rounded once to ``input.dtype``.

    Args:
        input: ``[B, *, D]`` (e.g. ``[B, S, D]`` tokens), float16/bfloat16/float32 (float64
            runs PyTorch's ops).
        scale: ``[B, D]`` or ``[B, 1, D]``, float32 or ``input.dtype``; broadcast over the
            tokens of each sample. Or per token: the input's shape (a chunk of a Linear's
            output is read in place; its gradients are per token, nothing summed).
        shift: like ``scale``, or ``None`` (no shift, as diffusers' ``*RMSNormZero``).
        eps: added to the mean square.
        one_plus_scale: ``True`` (the default, DiT's ``modulate``): ``gain = 1 + scale``, summed
            in fp32; ``False``: ``gain = scale``.

    Returns:
        ``input``-shaped tensor in ``input.dtype``. Gradients flow to input, scale and shift;
        ``dscale``/``dshift`` are sums over each sample's tokens, accumulated in fp32 and
        returned in the dtype of ``scale``/``shift``. CPU, small and ``torch.compile``-traced
        calls run PyTorch's ops; an eager CUDA call runs PyTorch's ops or cudnorm's Triton
        kernel, whichever measured faster for its signature (:mod:`cudnorm._policy`).
    """
    if _token_entry.is_per_token(input, scale):  # a modulation per token: its own kernels and formula
        return _token_entry.call(input, scale, shift, eps, one_plus_scale, rms=True)
    if _entry.is_compiling():  # a mistake raises cudnorm's error when the compiled code runs
        error = _checks.traced_error(_check_call, input, input, scale, shift, eps, one_plus_scale)
        if error is not None:
            return error
    eps = _check_call(input, scale, shift, eps, one_plus_scale)
    if input.dtype is not torch.float64 and input.is_cuda and input.numel() and _ops.eager(input) and (
            not _policy.torch_serves(input, scale, shift)):
        training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, scale, shift))
        serves = _decisions.serves(_OP, input, input.shape[-1], scale, shift, training)
        # "cudnn" (policy="cudnn"): cudnorm's own path, which for this op is the kernel
        if serves != "torch" and _ada_rms.supports(
                input.shape[-1], input.dtype, scale.dtype, None if shift is None else shift.dtype):
            return _ada_rms.kernel(input, scale, shift, eps, one_plus_scale)
    return _ada_rms.formula(input, scale, shift, eps, one_plus_scale)
