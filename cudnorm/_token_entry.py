"""A norm modulated per token, as :func:`cudnorm.ada_layer_norm` and :func:`cudnorm.ada_rms_norm`
take it: the argument checks and which implementation serves the call.

A modulation per token has the input's own shape (``[B, S, D]`` scale and shift for
``[B, S, D]`` tokens), where a per-sample one is ``[B, D]``. CPU, float64, small and traced
calls run the formula (PyTorch's ops, :mod:`cudnorm._policy`'s rules 0-3); an eager CUDA call
runs the formula or cudnorm's kernels (:mod:`cudnorm._token_ada`), whichever measured faster
for its signature (rule 4: ops ``"token_ada_layer_norm"``, ``"token_ada_rms_norm"``).
"""

from __future__ import annotations

import torch

from . import _candidates, _checks, _decisions, _entry, _ops, _policy, _token_ada


_TENSOR = torch.Tensor  # a plain tensor, as the native entry serves it (its subclasses are not)


def _name(rms: bool) -> str:
    """The public function's name, for errors."""
    return "ada_rms_norm" if rms else "ada_layer_norm"


def is_per_token(input, scale) -> bool:
    """Whether ``scale`` modulates ``input`` per token: more than one row in its second-last dim
    (a per-sample ``[B, 1, D]`` or ``[B, D]`` has one). Attribute reads: runs on every call."""
    return isinstance(scale, torch.Tensor) and scale.dim() > 2 and scale.shape[-2] != 1


def _check_modulation(fn: str, arg: str, value, input: torch.Tensor) -> None:
    """A per-token scale/shift: the input's shape, fp32 or the input's dtype, on its device."""
    _checks.check_tensor(fn, arg, value, dtypes=_checks.param_dtypes(input.dtype))
    if tuple(value.shape) != tuple(input.shape):
        raise ValueError(f"cudnorm.{fn}: argument '{arg}' has shape {_checks.dims(value.shape)}; a modulation per "
                         f"token has the input's shape {_checks.dims(input.shape)} (per sample: [B, D] or [B, 1, D])")
    _checks.check_same_device(fn, arg, value, input)


def _check_call(fn: str, input, scale, shift, eps, one_plus_scale) -> float:
    _checks.check_input(fn, input)
    _check_modulation(fn, "scale", scale, input)
    if shift is not None:
        _check_modulation(fn, "shift", shift, input)
    eps = _checks.check_eps(fn, eps)
    if not isinstance(one_plus_scale, bool):
        raise TypeError(f"cudnorm.{fn}: argument 'one_plus_scale' must be a bool, got {type(one_plus_scale).__name__}")
    return eps


def call(input: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, eps: float,
         one_plus_scale: bool, rms: bool) -> torch.Tensor:
    """``norm(input) * gain + shift`` with ``scale``/``shift`` of the input's shape, in the
    input's dtype. While the native path serves, C++ takes a plain tensor's call (checks,
    decision, launches, autograd node: csrc/entry.cpp) and hands back what it does not serve."""
    # a tensor subclass (a DTensor) goes straight to Python, which C++ would hand it back to
    if _entry.native and type(input) is _TENSOR and not _entry.is_compiling():
        try:
            return _entry.token_ada_norm(input, scale, shift, eps, one_plus_scale, rms)
        except (TypeError, RuntimeError):  # the entry refused an argument: cudnorm's error names it
            _check_call(_name(rms), input, scale, shift, eps, one_plus_scale)
            raise
    if _entry.pending and _entry.try_native(input):
        return call(input, scale, shift, eps, one_plus_scale, rms)
    return python_call(input, scale, shift, eps, one_plus_scale, rms)


def python_call(input: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, eps: float,
                one_plus_scale: bool, rms: bool) -> torch.Tensor:
    """:func:`call` in Python: the path without the native launch path, and the one the native
    entry hands back every call it does not serve itself."""
    fn = _name(rms)
    if _entry.is_compiling():  # a mistake raises cudnorm's error when the compiled code runs
        error = _checks.traced_error(_check_call, input, fn, input, scale, shift, eps, one_plus_scale)
        if error is not None:
            return error
    eps = _check_call(fn, input, scale, shift, eps, one_plus_scale)
    if input.dtype is not torch.float64 and input.is_cuda and input.numel() and _ops.eager(input) and (
            not _policy.torch_serves(input, scale, shift)):
        training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, scale, shift))
        op = _candidates.TOKEN_RMS_NORM if rms else _candidates.TOKEN_LAYER_NORM
        serves = _decisions.serves(op, input, input.shape[-1], scale, shift, training)
        # "cudnn" (policy="cudnn"): cudnorm's own path, which for these ops is the kernel
        if serves != "torch" and _token_ada.supports(
                input.shape[-1], input.dtype, scale.dtype, None if shift is None else shift.dtype):
            return _token_ada.kernel(input, scale, shift, eps, rms, one_plus_scale)
    return _token_ada.formula(input, scale, shift, eps, rms, one_plus_scale)
