"""LayerNorm on cuDNN graphs: custom ops (cuDNN or PyTorch fallback), autograd, functional.

Math, per row ``x`` of ``N`` elements::

    mean = sum(x) / N,  rstd = 1 / sqrt(sum((x - mean)^2) / N + eps)
    y = (x - mean) * rstd * weight + bias

The ops work on ``[rows, N]`` views; :func:`layer_norm` flattens the leading dims.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _checks, _dispatch
from ._graphs import host_scalar
from ._spec import NormSpec

_OP = "layer_norm"
_EMPTY = (0,)


@torch.library.custom_op("cudnorm::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float, training: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward on ``x: [M, N]``; ``weight``/``bias``: ``[N]`` fp32 or x's dtype, or None.

    Returns ``(y [M, N] x.dtype, mean [M] fp32, rstd [M] fp32)``; with ``training=False``
    the inference graph runs and ``mean``/``rstd`` are empty.
    """
    m, n = x.shape
    if _dispatch.route(x) is None:
        x = _dispatch.cudnn_rows(x)
        scale, shift, scale_dtype, cast = _dispatch.forward_params(x, weight, bias, has_bias=True)
        phase = "train" if training else "infer"
        spec = NormSpec(_OP, phase, m, n, x.dtype, scale_dtype, x.device.index, x_row_stride=x.stride(0),
                        scale_cast=cast, autotune=_dispatch.autotune_wanted(_OP, phase, m, n))
        plan = _dispatch.get_plan(spec)
        if plan is not None:
            y = torch.empty((m, n), dtype=x.dtype, device=x.device)
            eps_t = host_scalar(eps, spec)
            if training:
                mean = torch.empty(m, dtype=torch.float32, device=x.device)
                rstd = torch.empty(m, dtype=torch.float32, device=x.device)
                plan.run(x, scale, shift, eps_t, y, mean, rstd)
                return y, mean, rstd
            plan.run(x, scale, shift, eps_t, y)
            return y, x.new_empty(_EMPTY, dtype=torch.float32), x.new_empty(_EMPTY, dtype=torch.float32)
    return _torch_forward(x, weight, bias, eps, training)


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


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps, training):
    m, n = x.shape
    stats = (m,) if training else _EMPTY
    return (x.new_empty((m, n)), x.new_empty(stats, dtype=torch.float32), x.new_empty(stats, dtype=torch.float32))


@torch.library.custom_op("cudnorm::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
                   rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward on ``[M, N]``. Returns ``(dx x.dtype, dweight [N] fp32, dbias [N] fp32)``.

    dW/dB are always accumulated and returned in fp32 (the autograd formula casts them to
    the parameter's dtype), so fp32 master weights get fp32-accurate gradients.
    """
    m, n = x.shape
    if _dispatch.route(x) is None:
        x = _dispatch.cudnn_rows(x)
        spec = NormSpec(_OP, "bwd", m, n, x.dtype, torch.float32, x.device.index, x_row_stride=x.stride(0),
                        autotune=_dispatch.autotune_wanted(_OP, "bwd", m, n))
        plan = _dispatch.get_plan(spec)
        if plan is not None:
            scale = _dispatch.constant(1.0, n, torch.float32, x.device) if weight is None else weight.float()
            dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
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


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd):
    n = x.shape[1]
    return x.new_empty(x.shape), x.new_empty((n,), dtype=torch.float32), x.new_empty((n,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, training = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    if mean.numel() == 0:
        raise RuntimeError("cudnorm.layer_norm: backward through an inference-phase forward "
                           "(the forward ran without grad mode, so no statistics were saved)")
    dx, dw, db = layer_norm_bwd(dy, x, weight, mean, rstd)
    dweight = None if weight is None else dw.to(weight.dtype)
    dbias = None if ctx.bias_dtype is None else db.to(ctx.bias_dtype)
    return dx, dweight, dbias, None, None


layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def layer_norm(input: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Layer normalisation over the trailing ``normalized_shape`` dims, like
    :func:`torch.nn.functional.layer_norm`.

    Args:
        input: ``[*, *normalized_shape]``, float16/bfloat16/float32, any strides.
        normalized_shape: the trailing dims to normalise over.
        weight, bias: ``normalized_shape``-shaped, float32 or ``input.dtype``, or ``None``.
        eps: added to the variance; finite and >= 0.

    Returns:
        ``input``-shaped tensor in ``input.dtype``. With grad enabled and any argument
        requiring grad the training graph runs (it saves fp32 mean/rstd for backward);
        otherwise the cheaper inference graph runs.

    With bf16/fp16 ``input`` and fp32 ``weight``/``bias`` the forward rounds the parameters
    to ``input.dtype`` (what ``torch.autocast`` does) while gradients stay fp32-accurate.
    """
    _checks.check_input(_OP, input)
    shape, n = _checks.normalized_size(_OP, input, normalized_shape)
    weight = _checks.check_param(_OP, "weight", weight, input, shape)
    bias = _checks.check_param(_OP, "bias", bias, input, shape)
    eps = _checks.check_eps(_OP, eps)
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias))
    flat = lambda p: None if p is None else p.reshape(n)  # noqa: E731
    y, _, _ = layer_norm_fwd(input.reshape(-1, n), flat(weight), flat(bias), eps, training)
    return y.view(input.shape)
