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
import torch.nn.functional as F

from . import _call_plans, _checks, _dispatch, _fused_add, _policy
from ._graphs import Plan, eps_scalar

_OP = "layer_norm"
_F32 = torch.float32


def _forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
             training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on ``x: [M, N]``; ``weight``/``bias``: ``[N]`` fp32 or x's dtype, or None.

    Returns ``(y [M, N] x.dtype, stats)``: ``stats`` is fp32 ``[2, ceil4(M)]``, mean in row 0
    and rstd in row 1 (first ``M`` columns), or ``[2, 0]`` with ``training=False`` (the
    inference graph runs and writes no statistics).
    """
    if _dispatch.route(x) is None:
        y, stats = _gpu_forward(x, weight, bias, eps, training)
        return y, stats if training else x.new_empty((2, 0), dtype=_F32)
    return _torch_forward(x, weight, bias, eps, training)


def _gpu_forward(x, weight, bias, eps, training):
    """``(y, stats)`` (``stats`` ``None`` when not training) on a CUDA tensor: cuDNN's graph,
    or PyTorch's fused kernel where that was measured faster (wide rows,
    :func:`cudnorm._dispatch.native_forward`) and where no graph serves the call (a row count
    the row policy leaves to PyTorch, such as decode steps of a few rows; a declined graph)."""
    if not _dispatch.native_forward(x):
        out = _cudnn_forward(x, weight, bias, eps, training)
        if out is not None:
            return out
    scale, shift, _ = _dispatch.forward_params(x, weight, bias, has_bias=True)  # rounded as for cuDNN
    y, mean, rstd = torch.native_layer_norm(x, [x.shape[1]], scale, shift, eps)
    if not training:
        return y, None
    stats = _dispatch.stats_buffer(x.shape[0], 2, x.device)
    stats[:, :x.shape[0]].copy_(torch.stack((mean.view(-1), rstd.view(-1))))
    return y, stats


def _cudnn_forward(x, weight, bias, eps, training):
    """``(y, stats)`` from the cuDNN graph (``stats`` ``None`` when not training), or ``None``
    when cuDNN declines. The hot path of every call: keep it lean."""
    scale, shift, scale_dtype = _dispatch.forward_params(x, weight, bias, has_bias=True)
    x, plan = _call_plans.rows_plan(_OP, "train" if training else "infer", x, scale_dtype)
    if plan is None:
        return None
    y = torch.empty_like(x)  # x's rows are cuDNN-ready: y comes out packed [M, N]
    eps_holder, eps_address = eps_scalar(eps)  # the holder keeps the host scalar alive until the launch
    if not training:
        if type(plan) is Plan:
            plan.launch([x.data_ptr(), scale.data_ptr(), shift.data_ptr(), eps_address, y.data_ptr()])
        else:
            plan.run(x, scale, shift, eps_holder, y)
        return y, None
    stats = _dispatch.stats_buffer(x.shape[0], 2, x.device)
    if type(plan) is Plan:
        mean = stats.data_ptr()
        plan.launch([x.data_ptr(), scale.data_ptr(), shift.data_ptr(), eps_address, y.data_ptr(), mean,
                     mean + 4 * stats.shape[1]])
    else:
        m = x.shape[0]
        plan.run(x, scale, shift, eps_holder, y, stats[0, :m], stats[1, :m])
    return y, stats


def _infer(x, weight, bias, eps) -> torch.Tensor:
    """Eager inference: ``y`` only (no empty statistics tensor to allocate)."""
    if _dispatch.route(x) is None:
        return _gpu_forward(x, weight, bias, eps, False)[0]
    return _torch_forward(x, weight, bias, eps, False)[0]


def _torch_forward(x, weight, bias, eps, training):
    """PyTorch path: ATen's LayerNorm in fp32 (any device), cast back to x's dtype; fp32
    parameters are rounded as on the cuDNN path (``_dispatch.forward_param_dtype``)."""
    m, n = x.shape
    w, b = (None if p is None else p.to(_dispatch.forward_param_dtype(x, p)).float() for p in (weight, bias))
    y, mean, rstd = torch.native_layer_norm(x.float(), [n], w, b, eps)
    y = y.to(x.dtype)
    if not training:
        return y, x.new_empty((2, 0), dtype=_F32)
    stats = x.new_zeros((2, -(-m // 4) * 4), dtype=_F32)
    stats[0, :m] = mean.view(m)
    stats[1, :m] = rstd.view(m)
    return y, stats


def _backward_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, stats: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward on ``[M, N]`` with the forward's ``stats`` (:func:`_forward`).

    Returns ``(dx x.dtype, dweight [N], dbias [N])``, dW/dB accumulated in fp32 and rounded
    once into the weight's dtype (fp32 without a weight): fp32 master weights get fp32
    gradients, half-precision weights what PyTorch's own backward gives them.
    """
    wdtype = _dispatch.backward_scale_dtype(weight)
    if _dispatch.route(x) is None:
        x, plan = _call_plans.rows_plan(_OP, "bwd", x, wdtype)
        if plan is not None:
            n = x.shape[1]
            scale = _dispatch.constant(1.0, n, _F32, x.device) if weight is None else weight
            dy = _dispatch.packed(dy)
            dx = torch.empty_like(x)
            dw = torch.empty(n, dtype=wdtype, device=x.device)
            db = torch.empty(n, dtype=wdtype, device=x.device)
            if type(plan) is Plan:
                mean = stats.data_ptr()
                plan.launch([x.data_ptr(), scale.data_ptr(), mean, mean + 4 * stats.shape[1], dy.data_ptr(),
                             dx.data_ptr(), dw.data_ptr(), db.data_ptr()])
            else:
                m = x.shape[0]
                plan.run(x, scale, stats[0, :m], stats[1, :m], dy, dx, dw, db)
            return dx, dw, db
    return _torch_backward(dy, x, weight, stats)


def _torch_backward(dy, x, weight, stats):
    """PyTorch path: ATen's LayerNorm backward in fp32. dW is computed against ones when
    there is no weight, as the cuDNN graph does."""
    m, n = x.shape
    wdtype = _dispatch.backward_scale_dtype(weight)
    dyf, xf = dy.float(), x.float()
    w = torch.ones(n, dtype=_F32, device=x.device) if weight is None else weight.float()
    dx, dw, _ = torch.ops.aten.native_layer_norm_backward(
        dyf, xf, [n], stats[0, :m].reshape(m, 1), stats[1, :m].reshape(m, 1), w, None, [True, True, False])
    return dx.to(x.dtype), dw.to(wdtype), dyf.sum(0).to(wdtype)


def _fake_forward(x, weight, bias, eps, training):
    m, n = x.shape
    return x.new_empty((m, n)), x.new_empty((2, (m + 3) // 4 * 4 if training else 0), dtype=_F32)


def _fake_backward(dy, x, weight, stats):
    n = x.shape[1]
    wdtype = _dispatch.backward_scale_dtype(weight)
    return x.new_empty(x.shape), x.new_empty((n,), dtype=wdtype), x.new_empty((n,), dtype=wdtype)


layer_norm_fwd = _dispatch.define_op(
    "layer_norm_fwd", "(Tensor x, Tensor? weight, Tensor? bias, float eps, bool training) -> (Tensor, Tensor)",
    _forward, _fake_forward)
layer_norm_bwd = _dispatch.define_op(
    "layer_norm_bwd", "(Tensor dy, Tensor x, Tensor? weight, Tensor stats) -> (Tensor, Tensor, Tensor)",
    _backward_impl, _fake_backward)


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, training = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.eps = eps


def _make_backward(backward_fn):
    """The autograd backward, calling ``backward_fn``: the custom op when registered for
    traced graphs, the plain implementation in the eager ``autograd.Function``."""

    def backward(ctx, dy):
        x, weight, stats = ctx.saved_tensors
        if stats.numel() == 0:
            raise RuntimeError("cudnorm.layer_norm: backward through an inference-phase forward "
                               "(the forward ran without grad mode, so no statistics were saved)")
        if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
            dx, dw, db = _differentiable_backward(dy, x, weight, ctx.eps)
        else:
            dx, dw, db = backward_fn(dy, x, weight, stats)
        dweight = None if weight is None else dw
        dbias = None if ctx.bias_dtype is None else db if db.dtype is ctx.bias_dtype else db.to(ctx.bias_dtype)
        return dx, dweight, dbias, None, None

    return backward


def _differentiable_backward(dy, x, weight, eps):
    """``(dx, dweight, dbias)`` as graphs for double backward (``_dispatch.differentiable_grads``),
    in the dtypes of the plain backward."""
    n = x.shape[1]

    def forward(x, weight):
        return F.layer_norm(x.float(), (n,), None if weight is None else weight.float(), None, eps)

    dx, dw = _dispatch.differentiable_grads(forward, (x, weight), dy.float())
    return dx, dw, dy.float().sum(0).to(_dispatch.backward_scale_dtype(weight))


_dispatch.register_autograd("layer_norm_fwd", _setup_context, _make_backward(layer_norm_bwd))
_LayerNormFunction = _dispatch.eager_autograd("_LayerNormFunction", _forward, _setup_context,
                                              _make_backward(_backward_impl))


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
    n, eps = _checks.norm_call(_OP, input, normalized_shape, {"weight": weight, "bias": bias}, eps)
    if residual is not None:
        _checks.check_residual(_OP, residual, input)
        return _fused_add.call(input, residual, normalized_shape, n, weight, bias, eps, False)
    if _policy.torch_serves(input, weight, bias):  # small or compiled calls: PyTorch's own op
        shape = (normalized_shape,) if type(normalized_shape) is int else normalized_shape
        return torch.layer_norm(input, shape, weight, bias, eps)
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
