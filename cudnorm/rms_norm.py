"""RMSNorm on cuDNN graphs: custom ops (cuDNN or PyTorch fallback), autograd, functional.

Math, per row ``x`` of ``N`` elements::

    rstd = 1 / sqrt(sum(x^2) / N + eps),  y = x * rstd * (weight + offset)

``offset`` is 0 except for Gemma-style norms (``1 + weight``, weights stored around zero);
the cuDNN graphs add it in fp32 inside the graph (:attr:`cudnorm._spec.NormSpec.offset`).

The implementation works on ``[rows, N]`` views; :func:`rms_norm` flattens leading dims.
Eager calls run the implementation directly (through an ``autograd.Function`` when grad is
needed); traced calls go through the ``cudnorm::rms_norm_*`` custom ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import _call_plans, _checks, _dispatch, _fused_add, _policy
from ._graphs import Plan, eps_scalar

_OP = "rms_norm"
_EMPTY = (0,)
_F32 = torch.float32


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             training: bool, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on ``x: [M, N]``; ``weight``: ``[N]`` fp32 or x's dtype, or None; the scale
    is ``weight + offset`` (ones + offset without a weight).

    Returns ``(y [M, N] x.dtype, rstd [M] fp32)``; ``rstd`` is empty with ``training=False``.
    """
    if _dispatch.route(x) is None:
        y, rstd = _gpu_forward(x, weight, eps, training, offset)
        return y, rstd if training else x.new_empty(_EMPTY, dtype=_F32)
    return _torch_forward(x, weight, eps, training, offset)


# PyTorch's one-kernel RMSNorm (torch >= 2.8); older releases take the composite fp32 path
_FUSED_RMS_NORM = getattr(torch.ops.aten, "_fused_rms_norm", None)

# Offsets cuDNN's RMSNorm kernels take: its fused scale prologue accepts only ``weight + 1``
# (zero-centred gamma); execute refuses any other value (CUDNN_STATUS_BAD_PARAM on an H100,
# cuDNN 9.19, docs/performance.md, Decisions). Other offsets run the PyTorch path.
_CUDNN_OFFSETS = (0.0, 1.0)


def _gpu_forward(x, weight, eps, training, offset=0.0):
    """``(y, rstd)`` (``rstd`` ``None`` when not training) on a CUDA tensor: cuDNN's graph, or
    PyTorch's fused kernel where that was measured faster (wide rows,
    :func:`cudnorm._dispatch.native_forward`) and where no graph serves the call (a row count
    the row policy leaves to PyTorch, such as decode steps of a few rows; a declined graph)."""
    if offset in _CUDNN_OFFSETS and not _dispatch.native_forward(x):
        out = _cudnn_forward(x, weight, eps, training, offset)
        if out is not None:
            return out
    if _FUSED_RMS_NORM is None or offset:
        y, rstd = _torch_forward(x, weight, eps, training, offset)
        return y, rstd if training else None
    scale, _, _ = _dispatch.forward_params(x, weight, None, has_bias=False)  # rounded as for cuDNN
    y, rstd = _FUSED_RMS_NORM(x, [x.shape[1]], scale, eps)
    return (y, rstd.view(-1).float()) if training else (y, None)


def _cudnn_forward(x, weight, eps, training, offset=0.0):
    """``(y, rstd)`` from the cuDNN graph (``rstd`` ``None`` when not training), or ``None``
    when cuDNN declines. The hot path of every call: keep it lean."""
    scale, _, scale_dtype = _dispatch.forward_params(x, weight, None, has_bias=False)
    x, plan = _call_plans.rows_plan(_OP, "train" if training else "infer", x, scale_dtype, bool(offset))
    if plan is None:
        return None
    y = torch.empty_like(x)  # x's rows are cuDNN-ready: y comes out packed [M, N]
    rstd = torch.empty(x.shape[0], dtype=_F32, device=x.device) if training else None
    eps_holder, eps_address = eps_scalar(eps)  # the holder keeps the host scalar alive until the launch
    if type(plan) is Plan:
        pointers = [x.data_ptr(), scale.data_ptr(), eps_address, y.data_ptr()]
        if training:
            pointers.append(rstd.data_ptr())
        offset_buffers = _offset_arg(offset)  # held until the launch has read the scalar
        if offset:
            pointers.append(offset_buffers[0].data_ptr())
        plan.launch(pointers)
    else:
        plan.run(x, scale, eps_holder, y, *(() if rstd is None else (rstd,)), *_offset_arg(offset))
    return y, rstd


def _offset_arg(offset: float) -> tuple:
    """The offset's host scalar as the graph's last buffer, or nothing without an offset."""
    return (eps_scalar(offset)[0],) if offset else ()


def _infer(x, weight, eps, offset=0.0) -> torch.Tensor:
    """Eager inference: ``y`` only (no empty statistics tensor to allocate)."""
    if _dispatch.route(x) is None:
        return _gpu_forward(x, weight, eps, False, offset)[0]
    return _torch_forward(x, weight, eps, False, offset)[0]


def _torch_forward(x, weight, eps, training, offset=0.0):
    """PyTorch path, computed in fp32 and cast back to x's dtype (weight rounded as on the
    cuDNN path, the offset added in fp32 as the graph does)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(dim=1) + eps)
    y = xf * rstd.unsqueeze(1)
    if weight is not None:
        y = y * (weight.to(_dispatch.forward_param_dtype(x, weight)).float() + offset)
    elif offset:
        y = y * (1.0 + offset)
    return y.to(x.dtype), rstd if training else x.new_empty(_EMPTY, dtype=_F32)


def _backward_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                   rstd: torch.Tensor, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward on ``[M, N]``. Returns ``(dx x.dtype, dweight [N])``, dW accumulated in fp32
    and rounded once into the weight's dtype (fp32 without a weight). With an offset the
    graph reads ``weight + offset``; dW is unchanged by it."""
    wdtype = _dispatch.backward_scale_dtype(weight)
    if _dispatch.route(x) is None and offset in _CUDNN_OFFSETS:
        x, plan = _call_plans.rows_plan(_OP, "bwd", x, wdtype, bool(offset))
        if plan is not None:
            n = x.shape[1]
            scale = _dispatch.constant(1.0, n, _F32, x.device) if weight is None else weight
            dy = _dispatch.packed(dy)
            dx = torch.empty_like(x)
            dw = torch.empty(n, dtype=wdtype, device=x.device)
            offset_buffers = _offset_arg(offset)
            if type(plan) is Plan:
                plan.launch([x.data_ptr(), scale.data_ptr(), rstd.data_ptr(), dy.data_ptr(), dx.data_ptr(),
                             dw.data_ptr(), *(b.data_ptr() for b in offset_buffers)])
            else:
                plan.run(x, scale, rstd, dy, dx, dw, *offset_buffers)
            return dx, dw
    return _torch_backward(dy, x, weight, rstd, offset)


def _torch_backward(dy, x, weight, rstd, offset=0.0):
    """``dx = rstd * (g - xhat * mean(g * xhat))`` with ``g = dy * (weight + offset)``;
    ``dw = sum(dy * xhat)``."""
    dyf = dy.float()
    xhat = x.float() * rstd.unsqueeze(1)
    g = dyf * (1.0 + offset) if weight is None else dyf * (weight.float() + offset)
    dx = rstd.unsqueeze(1) * (g - xhat * (g * xhat).mean(dim=1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(0).to(_dispatch.backward_scale_dtype(weight))


def _fake_forward(x, weight, eps, training, offset=0.0):
    m, n = x.shape
    return x.new_empty((m, n)), x.new_empty((m,) if training else _EMPTY, dtype=_F32)


def _fake_backward(dy, x, weight, rstd, offset=0.0):
    return x.new_empty(x.shape), x.new_empty((x.shape[1],), dtype=_dispatch.backward_scale_dtype(weight))


rms_norm_fwd = _dispatch.define_op(
    "rms_norm_fwd", "(Tensor x, Tensor? weight, float eps, bool training, float offset=0.) -> (Tensor, Tensor)",
    _forward, _fake_forward)
rms_norm_bwd = _dispatch.define_op(
    "rms_norm_bwd", "(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, float offset=0.) -> (Tensor, Tensor)",
    _backward_impl, _fake_backward)


def _setup_context(ctx, inputs, output):
    x, weight, eps, training, offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps = eps
    ctx.offset = offset


def _make_backward(backward_fn):
    """The autograd backward, calling ``backward_fn``: the custom op when registered for
    traced graphs, the plain implementation in the eager ``autograd.Function``."""

    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        if rstd.numel() == 0:
            raise RuntimeError("cudnorm.rms_norm: backward through an inference-phase forward "
                               "(the forward ran without grad mode, so no statistics were saved)")
        if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
            dx, dw = _differentiable_backward(dy, x, weight, ctx.eps, ctx.offset)
        else:
            dx, dw = backward_fn(dy, x, weight, rstd, ctx.offset)
        return dx, None if weight is None else dw, None, None, None

    return backward


def _differentiable_backward(dy, x, weight, eps, offset=0.0):
    """``(dx, dweight)`` as graphs for double backward (``_dispatch.differentiable_grads``)."""
    n = x.shape[1]

    def forward(x, weight):
        scale = None if weight is None else weight.float() + offset
        y = F.rms_norm(x.float(), (n,), scale, eps)
        return y * (1.0 + offset) if weight is None and offset else y

    return tuple(_dispatch.differentiable_grads(forward, (x, weight), dy.float()))


_dispatch.register_autograd("rms_norm_fwd", _setup_context, _make_backward(rms_norm_bwd))
_RMSNormFunction = _dispatch.eager_autograd("_RMSNormFunction", _forward, _setup_context,
                                            _make_backward(_backward_impl))


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
    if eps is None:
        eps = torch.finfo(input.dtype).eps if isinstance(input, torch.Tensor) and input.is_floating_point() else 0.0
    n, eps = _checks.norm_call(_OP, input, normalized_shape, {"weight": weight}, eps)
    if weight_offset:
        weight_offset = _checks.check_offset(_OP, weight_offset)
    if residual is not None:
        _checks.check_residual(_OP, residual, input)
        return _fused_add.call(input, residual, normalized_shape, n, weight, None, eps, True, weight_offset)
    if _policy.torch_serves(input, weight):  # small or compiled calls: PyTorch's own op
        shape = (normalized_shape,) if type(normalized_shape) is int else normalized_shape
        if weight_offset:  # Gemma's formula: one rounding, at the end
            y = F.rms_norm(input.float(), shape, None, eps)
            return (y * ((1.0 if weight is None else weight.float()) + weight_offset)).to(input.dtype)
        return torch.rms_norm(input, shape, weight, eps)
    flat = input.dim() == 2 and input.shape[1] == n  # the common case needs no reshapes
    x = input if flat else input.reshape(-1, n)
    w = weight if weight is None or flat else weight.reshape(n)
    training = torch.is_grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad))
    if not _dispatch.eager(input):
        y = rms_norm_fwd(x, w, eps, training, weight_offset)[0]
    elif training:
        y = _RMSNormFunction.apply(x, w, eps, training, weight_offset)
    else:
        y = _infer(x, w, eps, weight_offset)
    return y if flat else y.view(input.shape)
