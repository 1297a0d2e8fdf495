"""LayerNorm on cuDNN graphs: the public function and the ``cudnorm::layer_norm_*`` custom ops.

Math, per row ``x`` of ``N`` elements::

    mean = sum(x) / N,  rstd = 1 / sqrt(sum((x - mean)^2) / N + eps)
    y = (x - mean) * rstd * weight + bias

The implementation, shared with RMSNorm, is :mod:`cudnorm._norm` (cuDNN or PyTorch fallback,
autograd) on ``[rows, N]`` views; :func:`layer_norm` flattens leading dims. Eager calls run the
implementation directly (through an ``autograd.Function`` when grad is needed); traced calls go
through the custom ops. Statistics are fp32 ``[2, ceil4(M)]``: mean in row 0, rstd in row 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import _checks, _decisions, _entry, _fused_add, _norm, _norm_kernel, _ops, _policy

_OP = _norm.LAYER_NORM.name
_TENSOR = torch.Tensor  # a plain tensor, as the native entry serves it (its subclasses are not)
_IMPL = _norm.implement(_norm.LAYER_NORM)
# module names of the implementation: the eager path calls _infer, the host benchmarks
# (cudnorm._bench.host_overhead, benchmarks/host_profile.py) time _forward and _backward_impl
_forward, _infer, _backward_impl = _IMPL.forward, _IMPL.infer, _IMPL.backward

layer_norm_fwd, layer_norm_bwd = _norm.define_ops(
    _norm.LAYER_NORM, _IMPL, "(Tensor x, Tensor? weight, Tensor? bias, float eps, bool training) -> (Tensor, Tensor)",
    "(Tensor dy, Tensor x, Tensor? weight, Tensor stats) -> (Tensor, Tensor, Tensor)")
_LayerNormFunction = _ops.eager_autograd("_LayerNormFunction", _IMPL.forward, _IMPL.setup_context,
                                              _IMPL.make_backward(_IMPL.backward))


def layer_norm(input: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *,
               residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Layer normalisation over the trailing ``normalized_shape`` dims, like
    :func:`torch.nn.functional.layer_norm`.

    Args:
        input: ``[*, *normalized_shape]``, float16/bfloat16/float32, any strides.
        normalized_shape: the trailing dims to normalise over.
        weight: ``normalized_shape``-shaped, float32 or ``input.dtype``, or ``None``.
        bias: like ``weight``.
        eps: added to the variance; finite and >= 0.
        residual: the pre-norm residual stream, like ``input``: the op then normalises
            ``h = input + residual`` and returns ``(y, h)``, the add fused into the norm's
            graph (:mod:`cudnorm._fused_add`); ``input`` and ``residual`` get the same gradient.

    Returns:
        ``input``-shaped tensor in ``input.dtype``. With grad enabled and any argument
        requiring grad the training graph runs (it saves fp32 mean/rstd for backward);
        otherwise the cheaper inference graph runs. Small calls and calls traced by
        ``torch.compile`` run PyTorch's own op instead (:mod:`cudnorm._policy`).

    With bf16/fp16 ``input`` and fp32 ``weight``/``bias`` the forward rounds the parameters
    to ``input.dtype`` (what ``torch.autocast`` does) while gradients stay fp32-accurate.
    """
    # the native path: C++ from here on. A tensor subclass (a DTensor) goes straight to the Python
    # implementation, which the C++ entry would hand it back to through the dispatcher
    if _entry.native and type(input) is _TENSOR and not _entry.is_compiling():
        shape = (normalized_shape,) if type(normalized_shape) is int else normalized_shape
        try:
            if residual is None:
                return _entry.layer_norm(input, shape, weight, bias, eps)
            return _entry.add_layer_norm(input, residual, shape, weight, bias, eps)
        except (TypeError, RuntimeError):  # the op's schema refused an argument: cudnorm's error names it
            _check_call(input, normalized_shape, weight, bias, eps, residual)
            raise
    if _entry.pending and _entry.try_native(input):
        return layer_norm(input, normalized_shape, weight, bias, eps, residual=residual)
    return python_layer_norm(input, normalized_shape, weight, bias, eps, residual)


def _check_call(input, normalized_shape, weight, bias, eps, residual) -> tuple[int, float]:
    """``(N, eps)`` of a valid call; raises cudnorm's error naming a malformed argument."""
    n, eps = _checks.norm_call(_OP, input, normalized_shape, {"weight": weight, "bias": bias}, eps)
    if residual is not None:
        _checks.check_residual(_OP, residual, input)
    return n, eps


def python_layer_norm(input, normalized_shape, weight, bias, eps, residual=None):
    """:func:`layer_norm` in Python: the path without the native launch path, and the one the
    native entry point hands back every call it does not serve itself."""
    if _entry.is_compiling():  # cudnorm's checks first: a mistake raises their error, not Dynamo's
        error = _checks.traced_error(_check_call, input, input, normalized_shape, weight, bias, eps, residual)
        if error is not None:
            return error if residual is None else (error, error)
    if residual is None and type(eps) is float and 0.0 <= eps < math.inf:
        # PyTorch's op where the policy prefers it, before cudnorm's checks (CPU calls cost what
        # PyTorch's do): it refuses every mistake the checks find but an eps, checked here, so
        # the checks run only where it raised, to name the mistake. Not on meta tensors, whose
        # kernels check no dtypes
        try:
            if not input.is_meta and _policy.torch_serves(input, weight, bias):
                return torch.layer_norm(input, (normalized_shape,) if type(normalized_shape) is int
                                        else normalized_shape, weight, bias, eps)
        except Exception:  # noqa: BLE001 - cudnorm's checks below raise the error that names the argument
            pass
    n, eps = _check_call(input, normalized_shape, weight, bias, eps, residual)
    if residual is not None:
        return _fused_add.call(input, residual, normalized_shape, n, weight, bias, eps, False)
    if _policy.torch_serves(input, weight, bias):  # small or compiled calls: PyTorch's own op
        shape = (normalized_shape,) if type(normalized_shape) is int else normalized_shape
        return torch.layer_norm(input, shape, weight, bias, eps)
    flat = input.dim() == 2 and input.shape[1] == n  # the common case needs no reshapes
    x = input if flat else _checks.rows(_OP, "input", input, n)
    w = weight if weight is None or flat else weight.reshape(n)
    b = bias if bias is None or flat else bias.reshape(n)
    training = torch.is_grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad)
                                            or (bias is not None and bias.requires_grad))
    if not _ops.eager(input):
        y = layer_norm_fwd(x, w, b, eps, training)[0]
        return y if flat else y.view(input.shape)
    serves = _decisions.serves(_OP, input, n, weight, bias, training)
    if serves == "torch":  # measured faster for this signature
        return torch.layer_norm(input, (normalized_shape,) if type(normalized_shape) is int else normalized_shape,
                                weight, bias, eps)
    if serves == "kernel":
        y = _norm_kernel.norm(x, w, b, eps, False)
    elif training:
        y = _LayerNormFunction.apply(x, w, b, eps, training, 0.0)
    else:
        y = _infer(x, w, b, eps)
    return y if flat else y.view(input.shape)
