"""RMSNorm on cuDNN graphs: custom ops (cuDNN or PyTorch fallback), autograd, functional.

Math, per row ``x`` of ``N`` elements::

    rstd = 1 / sqrt(sum(x^2) / N + eps),  y = x * rstd * weight

The implementation works on ``[rows, N]`` views; :func:`rms_norm` flattens leading dims.
Eager calls run the implementation directly (through an ``autograd.Function`` when grad is
needed); traced calls go through the ``cudnorm::rms_norm_*`` custom ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _call_plans, _checks, _dispatch
from ._graphs import host_scalar

_OP = "rms_norm"
_EMPTY = (0,)


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on ``x: [M, N]``; ``weight``: ``[N]`` fp32 or x's dtype, or None.

    Returns ``(y [M, N] x.dtype, rstd [M] fp32)``; ``rstd`` is empty with ``training=False``.
    """
    out = _gpu_forward(x, weight, eps, training) if _dispatch.route(x) is None else None
    if out is None:
        return _torch_forward(x, weight, eps, training)
    y, rstd = out
    return y, rstd if training else x.new_empty(_EMPTY, dtype=torch.float32)


def _gpu_forward(x, weight, eps, training):
    """``(y, rstd)`` (``rstd`` ``None`` when not training) from PyTorch's fused kernel where it
    was measured faster (:func:`cudnorm._dispatch.native_forward`), else from cuDNN's graph;
    ``None`` when cuDNN declines."""
    if not _dispatch.native_forward(x):
        return _cudnn_forward(x, weight, eps, training)
    scale, _, _ = _dispatch.forward_params(x, weight, None, has_bias=False)  # rounded as for cuDNN
    y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[1]], scale, eps)
    return (y, rstd.view(-1).float()) if training else (y, None)


def _cudnn_forward(x, weight, eps, training):
    """``(y, rstd)`` from the cuDNN graph (``rstd`` ``None`` when not training), or ``None``
    when cuDNN declines. The hot path of every call: keep it lean."""
    scale, _, scale_dtype = _dispatch.forward_params(x, weight, None, has_bias=False)
    x, spec, plan = _call_plans.rows_spec_plan(_OP, "train" if training else "infer", x, scale_dtype)
    if plan is None:
        return None
    y = torch.empty_like(x)  # x's rows are cuDNN-ready: y comes out packed [M, N]
    if not training:
        plan.run(x, scale, host_scalar(eps, spec), y)
        return y, None
    rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    plan.run(x, scale, host_scalar(eps, spec), y, rstd)
    return y, rstd


def _infer(x, weight, eps) -> torch.Tensor:
    """Eager inference: ``y`` only (no empty statistics tensor to allocate)."""
    out = _gpu_forward(x, weight, eps, False) if _dispatch.route(x) is None else None
    return out[0] if out is not None else _torch_forward(x, weight, eps, False)[0]


def _torch_forward(x, weight, eps, training):
    """PyTorch path, computed in fp32 and cast back to x's dtype (weight rounded as on the
    cuDNN path)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(dim=1) + eps)
    y = xf * rstd.unsqueeze(1)
    if weight is not None:
        y = y * weight.to(_dispatch.forward_param_dtype(x, weight)).float()
    return y.to(x.dtype), rstd if training else x.new_empty(_EMPTY, dtype=torch.float32)


def _backward_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward on ``[M, N]``. Returns ``(dx x.dtype, dweight [N] fp32)``."""
    m, n = x.shape
    if _dispatch.route(x) is None:
        x, spec, plan = _call_plans.rows_spec_plan(_OP, "bwd", x, torch.float32)
        if plan is not None:
            scale = _dispatch.constant(1.0, n, torch.float32, x.device) if weight is None else weight.float()
            dx = torch.empty_like(x)
            dw = torch.empty(n, dtype=torch.float32, device=x.device)
            plan.run(x, scale, dy.contiguous(), rstd, dx, dw)
            return dx, dw
    return _torch_backward(dy, x, weight, rstd)


def _torch_backward(dy, x, weight, rstd):
    """``dx = rstd * (g - xhat * mean(g * xhat))`` with ``g = dy * weight``; ``dw = sum(dy * xhat)``."""
    dyf = dy.float()
    xhat = x.float() * rstd.unsqueeze(1)
    g = dyf if weight is None else dyf * weight.float()
    dx = rstd.unsqueeze(1) * (g - xhat * (g * xhat).mean(dim=1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(0)


rms_norm_fwd = torch.library.custom_op("cudnorm::rms_norm_fwd", _forward, mutates_args=())
rms_norm_bwd = torch.library.custom_op("cudnorm::rms_norm_bwd", _backward_impl, mutates_args=())


@rms_norm_fwd.register_fake
def _(x, weight, eps, training):
    m, n = x.shape
    return x.new_empty((m, n)), x.new_empty((m,) if training else _EMPTY, dtype=torch.float32)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), x.new_empty((x.shape[1],), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, eps, training = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)


def _make_backward(backward_fn):
    """The autograd backward, calling ``backward_fn``: the custom op when registered for
    traced graphs, the plain implementation in the eager ``autograd.Function``."""

    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        if rstd.numel() == 0:
            raise RuntimeError("cudnorm.rms_norm: backward through an inference-phase forward "
                               "(the forward ran without grad mode, so no statistics were saved)")
        dx, dw = backward_fn(dy, x, weight, rstd)
        return dx, None if weight is None else dw.to(weight.dtype), None, None

    return backward


_dispatch.register_autograd(rms_norm_fwd, _setup_context, _make_backward(rms_norm_bwd))
_RMSNormFunction = _dispatch.eager_autograd("_RMSNormFunction", _forward, _setup_context,
                                            _make_backward(_backward_impl))


def rms_norm(input: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """Root-mean-square normalisation over the trailing dims, like
    :func:`torch.nn.functional.rms_norm`.

    Args:
        input: ``[*, *normalized_shape]``, float16/bfloat16/float32, any strides.
        normalized_shape: the trailing dims to normalise over.
        weight: ``normalized_shape``-shaped, float32 or ``input.dtype``, or ``None``.
        eps: added to the mean square; ``None`` means ``torch.finfo(input.dtype).eps``.

    Returns:
        ``input``-shaped tensor in ``input.dtype`` (training graph when grad is needed,
        inference graph otherwise; fp32 weights are rounded to ``input.dtype`` in the
        forward only, as in :func:`cudnorm.layer_norm`).
    """
    if eps is None:
        eps = torch.finfo(input.dtype).eps if isinstance(input, torch.Tensor) and input.is_floating_point() else 0.0
    n, eps = _checks.norm_call(_OP, input, normalized_shape, {"weight": weight}, eps)
    flat = input.dim() == 2 and input.shape[1] == n  # the common case needs no reshapes
    x = input if flat else input.reshape(-1, n)
    w = weight if weight is None or flat else weight.reshape(n)
    training = torch.is_grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad))
    if not _dispatch.eager(input):
        y = rms_norm_fwd(x, w, eps, training)[0]
    elif training:
        y = _RMSNormFunction.apply(x, w, eps, training)
    else:
        y = _infer(x, w, eps)
    return y if flat else y.view(input.shape)
