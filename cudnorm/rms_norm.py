"""RMSNorm on cuDNN graphs: the public function and the ``cudnorm::rms_norm_*`` custom ops.

Math, per row ``x`` of ``N`` elements::

    rstd = 1 / sqrt(sum(x^2) / N + eps),  y = x * rstd * (weight + offset)

``offset`` is 0 except for Gemma-style norms (``1 + weight``, weights stored around zero);
the cuDNN graphs add it in fp32 inside the graph (:attr:`cudnorm._spec.NormSpec.offset`), and
take only the offsets in ``_norm.RMS_NORM.cudnn_offsets`` (0 and 1).

The implementation, shared with LayerNorm, is :mod:`cudnorm._norm` (cuDNN or PyTorch fallback,
autograd) on ``[rows, N]`` views; :func:`rms_norm` flattens leading dims. Eager calls run the
implementation directly (through an ``autograd.Function`` when grad is needed); traced calls go
through the custom ops. The statistics are rstd, fp32 ``[M]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import _checks, _decisions, _entry, _fused_add, _norm, _norm_kernel, _ops, _policy

_OP = _norm.RMS_NORM.name
_TENSOR = torch.Tensor  # a plain tensor, as the native entry serves it (its subclasses are not)
_IMPL = _norm.implement(_norm.RMS_NORM)
_infer = _IMPL.infer  # a module global: the eager path's cheapest lookup

rms_norm_fwd, rms_norm_bwd = _norm.define_ops(
    _norm.RMS_NORM, _IMPL, "(Tensor x, Tensor? weight, float eps, bool training, float offset=0.) -> (Tensor, Tensor)",
    "(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, float offset=0.) -> (Tensor, Tensor)")
_RMSNormFunction = _ops.eager_autograd("_RMSNormFunction", _IMPL.forward, _IMPL.setup_context,
                                            _IMPL.make_backward(_IMPL.backward))


def rms_norm(input: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = None, *, weight_offset: float = 0.0,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Root-mean-square normalisation over the trailing dims, like
    :func:`torch.nn.functional.rms_norm`.

    Args:
        input: ``[*, *normalized_shape]``, float16/bfloat16/float32, any strides.
        normalized_shape: the trailing dims to normalise over.
        weight: ``normalized_shape``-shaped, float32 or ``input.dtype``, or ``None``.
        eps: added to the mean square; ``None`` means ``torch.finfo(input.dtype).eps``.
        weight_offset: the output is scaled by ``weight + weight_offset``, added in fp32
            (``1.0`` for Gemma's RMSNorm, whose weights are stored around zero); cuDNN adds
            an offset of ``1.0`` inside the graph, so it costs no extra kernel (other offsets
            run PyTorch's ops, which cuDNN does not take). The weight's gradient is unchanged
            by it.
        residual: the pre-norm residual stream, like ``input``: the op then normalises
            ``h = input + residual`` and returns ``(y, h)``, the add fused into the norm's
            graph (:mod:`cudnorm._fused_add`); ``input`` and ``residual`` get the same gradient.

    Returns:
        ``input``-shaped tensor in ``input.dtype`` (training graph when grad is needed,
        inference graph otherwise; fp32 weights are rounded to ``input.dtype`` in the
        forward only, as in :func:`cudnorm.layer_norm`). Small calls and calls traced by
        ``torch.compile`` run PyTorch's own op instead (:mod:`cudnorm._policy`).
    """
    # the native path: C++ from here on. A tensor subclass (a DTensor) goes straight to the Python
    # implementation, which the C++ entry would hand it back to through the dispatcher
    if _entry.native and type(input) is _TENSOR and not _entry.is_compiling():
        shape = (normalized_shape,) if type(normalized_shape) is int else normalized_shape
        try:
            if residual is None:
                return _entry.rms_norm(input, shape, weight, eps, weight_offset)
            return _entry.add_rms_norm(input, residual, shape, weight, eps, weight_offset)
        except (TypeError, RuntimeError):  # the op's schema refused an argument: cudnorm's error names it
            _check_call(input, normalized_shape, weight, eps, weight_offset, residual)
            raise
    if _entry.pending and _entry.try_native(input):
        return rms_norm(input, normalized_shape, weight, eps, weight_offset=weight_offset, residual=residual)
    return python_rms_norm(input, normalized_shape, weight, eps, weight_offset, residual)


def _check_call(input, normalized_shape, weight, eps, weight_offset, residual) -> tuple[int, float, float]:
    """``(N, eps, weight_offset)`` of a valid call; raises cudnorm's error naming a malformed argument."""
    if eps is None:
        eps = torch.finfo(input.dtype).eps if isinstance(input, torch.Tensor) and input.is_floating_point() else 0.0
    n, eps = _checks.norm_call(_OP, input, normalized_shape, {"weight": weight}, eps)
    if type(weight_offset) is not float or weight_offset:  # 0.0, the default, needs no check
        weight_offset = _checks.check_offset(_OP, weight_offset)
    if residual is not None:
        _checks.check_residual(_OP, residual, input)
    return n, eps, weight_offset


def _promoted_by_pytorch(input, weight, weight_offset, residual) -> bool:
    """A weight of a dtype cudnorm's kernels do not take for ``input`` (a half-precision weight
    on fp32 input, as a model that upcasts its activations for the norm hands over), which
    PyTorch's ``torch.rms_norm`` takes by type promotion: that op serves such a call, so a
    patched model computes what it computed before."""
    # the common call (no weight, or one of the input's dtype) is answered by the first tests
    return (isinstance(weight, torch.Tensor) and isinstance(input, torch.Tensor) and weight.dtype is not input.dtype
            and weight.dtype not in _checks.param_dtypes(input.dtype) and input.is_floating_point()
            and weight.is_floating_point() and weight.device == input.device and residual is None
            and type(weight_offset) in (float, int) and weight_offset == 0)


def python_rms_norm(input, normalized_shape, weight, eps, weight_offset=0.0, residual=None):
    """:func:`rms_norm` in Python: the path without the native launch path, and the one the
    native entry point hands back every call it does not serve itself."""
    if _promoted_by_pytorch(input, weight, weight_offset, residual):
        return torch.rms_norm(input, (normalized_shape,) if type(normalized_shape) is int else normalized_shape,
                              weight, eps)
    if _entry.is_compiling():  # cudnorm's checks first, as in cudnorm.layer_norm
        error = _checks.traced_error(_check_call, input, input, normalized_shape, weight, eps, weight_offset, residual)
        if error is not None:
            return error if residual is None else (error, error)
    if (residual is None and type(weight_offset) in (float, int) and weight_offset == 0
            and (eps is None or type(eps) is float and 0.0 <= eps < math.inf)):
        # PyTorch's op first where the policy prefers it, as in cudnorm.layer_norm: the checks run
        # only where it raised, to name the mistake (not on meta tensors)
        try:
            if not input.is_meta and _policy.torch_serves(input, weight):
                return _norm.torch_rms_norm(input, (normalized_shape,) if type(normalized_shape) is int
                                            else normalized_shape, weight, eps)
        except Exception:  # noqa: BLE001 - cudnorm's checks below raise the error that names the argument
            pass
    n, eps, weight_offset = _check_call(input, normalized_shape, weight, eps, weight_offset, residual)
    if residual is not None:
        return _fused_add.call(input, residual, normalized_shape, n, weight, None, eps, True, weight_offset)
    if _policy.torch_serves(input, weight):  # small or compiled calls: PyTorch's own op
        shape = (normalized_shape,) if type(normalized_shape) is int else normalized_shape
        if weight_offset:
            return _norm.gemma_rms_norm(input, shape, weight, eps, weight_offset)
        return _norm.torch_rms_norm(input, shape, weight, eps)
    flat = input.dim() == 2 and input.shape[1] == n  # the common case needs no reshapes
    x = input if flat else _checks.rows(_OP, "input", input, n)
    w = weight if weight is None or flat else weight.reshape(n)
    training = torch.is_grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad))
    if not _ops.eager(input):
        y = rms_norm_fwd(x, w, eps, training, weight_offset)[0]
        return y if flat else y.view(input.shape)
    serves = "cudnn" if weight_offset else _decisions.serves(_OP, input, n, weight, None, training)
    if serves == "torch":  # measured faster for this signature
        return _norm.torch_rms_norm(input, (normalized_shape,) if type(normalized_shape) is int else normalized_shape,
                                    weight, eps)
    if serves == "kernel":
        y = _norm_kernel.norm(x, w, None, eps, True)
    elif training:
        y = _RMSNormFunction.apply(x, w, None, eps, training, weight_offset)
    else:
        y = _infer(x, w, None, eps, weight_offset)
    return y if flat else y.view(input.shape)
