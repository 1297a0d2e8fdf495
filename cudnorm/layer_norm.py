"""LayerNorm on cuDNN graphs: implementation (cuDNN or PyTorch fallback), custom ops,
autograd, functional.

Math, per row ``x`` of ``N`` elements::

    mean = sum(x) / N,  rstd = 1 / sqrt(sum((x - mean)^2) / N + eps)
    y = (x - mean) * rstd * weight + bias

The implementation works on ``[rows, N]`` views; :func:`layer_norm` flattens leading dims.
Eager calls run the implementation directly (through an ``autograd.Function`` when grad is
needed); traced calls go through the ``cudnorm::layer_norm_*`` custom ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _call_plans, _checks, _dispatch
from ._graphs import host_scalar

_OP = "layer_norm"
_EMPTY = (0,)


def _forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
             training: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward on ``x: [M, N]``; ``weight``/``bias``: ``[N]`` fp32 or x's dtype, or None.

    Returns ``(y [M, N] x.dtype, mean [M] fp32, rstd [M] fp32)``; with ``training=False``
    the inference graph runs and ``mean``/``rstd`` are empty.
    """
    out = _gpu_forward(x, weight, bias, eps, training) if _dispatch.route(x) is None else None
    if out is None:
        return _torch_forward(x, weight, bias, eps, training)
    y, mean, rstd = out
    if not training:
        mean, rstd = x.new_empty(_EMPTY, dtype=torch.float32), x.new_empty(_EMPTY, dtype=torch.float32)
    return y, mean, rstd


def _gpu_forward(x, weight, bias, eps, training):
    """``(y, mean, rstd)`` (stats ``None`` when not training) from PyTorch's fused kernel where
    it was measured faster (:func:`cudnorm._dispatch.native_forward`), else from cuDNN's
    graph; ``None`` when cuDNN declines."""
    if not _dispatch.native_forward(x):
        return _cudnn_forward(x, weight, bias, eps, training)
    scale, shift, _ = _dispatch.forward_params(x, weight, bias, has_bias=True)  # rounded as for cuDNN
    y, mean, rstd = torch.native_layer_norm(x, [x.shape[1]], scale, shift, eps)
    if not training:
        return y, None, None
    # fp32 statistics on CUDA already (the CPU kernel keeps x's dtype; tests run it there)
    return y, mean.view(-1).float(), rstd.view(-1).float()


def _cudnn_forward(x, weight, bias, eps, training):
    """``(y, mean, rstd)`` from the cuDNN graph (stats ``None`` when not training), or
    ``None`` when cuDNN declines. The hot path of every call: keep it lean."""
    scale, shift, scale_dtype = _dispatch.forward_params(x, weight, bias, has_bias=True)
    x, spec, plan = _call_plans.rows_spec_plan(_OP, "train" if training else "infer", x, scale_dtype)
    if plan is None:
        return None
    y = torch.empty_like(x)  # x's rows are cuDNN-ready: y comes out packed [M, N]
    if not training:
        plan.run(x, scale, shift, host_scalar(eps, spec), y)
        return y, None, None
    m = x.shape[0]
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    plan.run(x, scale, shift, host_scalar(eps, spec), y, mean, rstd)
    return y, mean, rstd


def _infer(x, weight, bias, eps) -> torch.Tensor:
    """Eager inference: ``y`` only (no empty statistics tensors to allocate)."""
    out = _gpu_forward(x, weight, bias, eps, False) if _dispatch.route(x) is None else None
    return out[0] if out is not None else _torch_forward(x, weight, bias, eps, False)[0]


def _torch_forward(x, weight, bias, eps, training):
    """PyTorch path: ATen's LayerNorm in fp32 (any device), cast back to x's dtype; fp32
    parameters are rounded as on the cuDNN path (``_dispatch.forward_param_dtype``)."""
    m, n = x.shape
    w, b = (None if p is None else p.to(_dispatch.forward_param_dtype(x, p)).float() for p in (weight, bias))
    y, mean, rstd = torch.native_layer_norm(x.float(), [n], w, b, eps)
    y = y.to(x.dtype)
    if not training:
        return y, x.new_empty(_EMPTY, dtype=torch.float32), x.new_empty(_EMPTY, dtype=torch.float32)
    return y, mean.view(m), rstd.view(m)


def _backward_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
                   rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward on ``[M, N]``. Returns ``(dx x.dtype, dweight [N] fp32, dbias [N] fp32)``.

    dW/dB are always accumulated and returned in fp32 (the autograd formula casts them to
    the parameter's dtype), so fp32 master weights get fp32-accurate gradients.
    """
    m, n = x.shape
    if _dispatch.route(x) is None:
        x, spec, plan = _call_plans.rows_spec_plan(_OP, "bwd", x, torch.float32)
        if plan is not None:
            scale = _dispatch.constant(1.0, n, torch.float32, x.device) if weight is None else weight.float()
            dx = torch.empty_like(x)
            dw = torch.empty(n, dtype=torch.float32, device=x.device)
            db = torch.empty(n, dtype=torch.float32, device=x.device)
            plan.run(x, scale, dy.contiguous(), mean, rstd, dx, dw, db)
            return dx, dw, db
    return _torch_backward(dy, x, weight, mean, rstd)


def _torch_backward(dy, x, weight, mean, rstd):
    """PyTorch path: ATen's LayerNorm backward in fp32. dW is computed against ones when
    there is no weight, as the cuDNN graph does."""
    m, n = x.shape
    dyf, xf = dy.float(), x.float()
    w = torch.ones(n, dtype=torch.float32, device=x.device) if weight is None else weight.float()
    dx, dw, _ = torch.ops.aten.native_layer_norm_backward(
        dyf, xf, [n], mean.view(m, 1), rstd.view(m, 1), w, None, [True, True, False])
    return dx.to(x.dtype), dw, dyf.sum(0)


layer_norm_fwd = torch.library.custom_op("cudnorm::layer_norm_fwd", _forward, mutates_args=())
layer_norm_bwd = torch.library.custom_op("cudnorm::layer_norm_bwd", _backward_impl, mutates_args=())


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps, training):
    m, n = x.shape
    stats = (m,) if training else _EMPTY
    return (x.new_empty((m, n)), x.new_empty(stats, dtype=torch.float32), x.new_empty(stats, dtype=torch.float32))


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd):
    n = x.shape[1]
    return x.new_empty(x.shape), x.new_empty((n,), dtype=torch.float32), x.new_empty((n,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, training = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _make_backward(backward_fn):
    """The autograd backward, calling ``backward_fn``: the custom op when registered for
    traced graphs, the plain implementation in the eager ``autograd.Function``."""

    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        if mean.numel() == 0:
            raise RuntimeError("cudnorm.layer_norm: backward through an inference-phase forward "
                               "(the forward ran without grad mode, so no statistics were saved)")
        dx, dw, db = backward_fn(dy, x, weight, mean, rstd)
        dweight = None if weight is None else dw.to(weight.dtype)
        dbias = None if ctx.bias_dtype is None else db.to(ctx.bias_dtype)
        return dx, dweight, dbias, None, None

    return backward


_dispatch.register_autograd(layer_norm_fwd, _setup_context, _make_backward(layer_norm_bwd))
_LayerNormFunction = _dispatch.eager_autograd("_LayerNormFunction", _forward, _setup_context,
                                              _make_backward(_backward_impl))


def layer_norm(input: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Layer normalisation over the trailing ``normalized_shape`` dims, like
    :func:`torch.nn.functional.layer_norm`.

    Args:
        input: ``[*, *normalized_shape]``, float16/bfloat16/float32, any strides.
        normalized_shape: the trailing dims to normalise over.
        weight: ``normalized_shape``-shaped, float32 or ``input.dtype``, or ``None``.
        bias: like ``weight``.
        eps: added to the variance; finite and >= 0.

    Returns:
        ``input``-shaped tensor in ``input.dtype``. With grad enabled and any argument
        requiring grad the training graph runs (it saves fp32 mean/rstd for backward);
        otherwise the cheaper inference graph runs.

    With bf16/fp16 ``input`` and fp32 ``weight``/``bias`` the forward rounds the parameters
    to ``input.dtype`` (what ``torch.autocast`` does) while gradients stay fp32-accurate.
    """
    n, eps = _checks.norm_call(_OP, input, normalized_shape, {"weight": weight, "bias": bias}, eps)
    flat = input.dim() == 2 and input.shape[1] == n  # the common case needs no reshapes
    x = input if flat else input.reshape(-1, n)
    w = weight if weight is None or flat else weight.reshape(n)
    b = bias if bias is None or flat else bias.reshape(n)
    training = torch.is_grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad)
                                            or (bias is not None and bias.requires_grad))
    if not _dispatch.eager(input):
        y = layer_norm_fwd(x, w, b, eps, training)[0]
    elif training:
        y = _LayerNormFunction.apply(x, w, b, eps, training)
    else:
        y = _infer(x, w, b, eps)
    return y if flat else y.view(input.shape)
