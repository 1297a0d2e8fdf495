"""Adaptive LayerNorm (AdaLN) on cuDNN graphs: the public function, its custom ops and autograd.

Math, per sample ``b`` and token row ``x`` of ``D`` elements (non-affine LayerNorm)::

    xhat = (x - mean) * rstd,   rstd = 1 / sqrt(var + eps)
    y = xhat * gain[b] + shift[b],   gain = 1 + scale (one_plus_scale=True: DiT's ``modulate``)
                                     gain = scale     (one_plus_scale=False)

The implementation works on ``x: [B, S, D]`` and ``scale``/``shift``: ``[B, D]``. The gain is
computed here in PyTorch (``B*D`` elements, one small kernel): cuDNN 9.19 declines an
in-graph ``add(scale, 1)`` in the adalayernorm graph. Eager calls run the implementation
directly (through an ``autograd.Function`` when grad is needed); traced calls go through the
``cudnorm::ada_layer_norm_*`` ops, as in :mod:`cudnorm.layer_norm`.

The strategies (cuDNN's AdaLN graphs, or plain LayerNorm graphs launched once per sample)
and the rules that pick one are :mod:`cudnorm._ada_strategies`; ``ada_forward``/``ada_backward``
``="torch"`` runs the fp32 PyTorch formula here (also the CPU path).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _ada_strategies as strategies
from . import (_cache, _call_plans, _candidates, _checks, _decisions, _dispatch, _entry, _norm, _ops, _policy, _runtime,
               _token_entry)

_OP = "ada_layer_norm"
_F32 = torch.float32
_TENSOR = torch.Tensor  # a plain tensor, as the native entry serves it (its subclasses are not)


def _stats_view(stats: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, rstd)``, ``[rows]`` views of a ``[2, ceil4(rows)]`` statistics buffer."""
    return stats[0, :rows], stats[1, :rows]


# ---------------------------------------------------------------- forward

def _forward(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float, one_plus_scale: bool,
             training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on ``x: [B, S, D]``; ``scale``/``shift``: ``[B, D]``, fp32 or x's dtype.

    Returns ``(y [B, S, D] x.dtype, stats)``: fp32 ``[2, ceil4(B*S)]``, mean in row 0 and rstd
    in row 1, or ``[2, 0]`` with ``training=False`` (the inference graph runs).
    """
    y, stats = _run_forward(x, scale, shift, eps, one_plus_scale, training)
    return y, stats if training else x.new_empty((2, 0), dtype=_F32)


def _run_forward(x, scale, shift, eps, dit, training):
    """``(y, stats)`` from the first strategy that serves the call (``stats`` ``None`` when not
    training: eager inference allocates no empty statistics). A call repeating an earlier
    call's signature takes the strategy and plan it found from :data:`_forward_plans`. An
    empty ``x`` takes PyTorch's path, which returns the empty results cuDNN has no graph for."""
    dtype = strategies.forward_dtype(x, scale, shift)
    if x.numel() and _runtime.route(x) is None:
        b, s, d = x.shape
        x2 = _dispatch.cudnn_rows(x.reshape(b * s, d))
        signature = (x2.shape, x2.stride(0), x2.dtype, x2.get_device(), b, dtype, training)
        hit = _forward_plans.get(signature)
        if hit is not None:
            _cache.plans.count_hit()
            return hit[0](hit[1], x2, b, scale, shift, dit, dtype, eps, training)
        for name in strategies.FORWARD_ORDER[strategies.forward_strategy(b, s, d, x.dtype)]:
            strategy = strategies.FORWARDS[name]
            plan = strategies.plan_for(strategy.spec(x2, b, dtype, training, x2.device.index))
            if plan is not None:
                _forward_plans.put(signature, (strategy.run, plan))
                return strategy.run(plan, x2, b, scale, shift, dit, dtype, eps, training)
    return _torch_forward(x, *strategies.modulation(scale, shift, dit, dtype), eps, training)


# A CPU call whose samples hold at least this many elements runs ATen's LayerNorm kernels
# once per sample (AdaLN is, per sample, a LayerNorm with weight gain[b] and bias shift[b]):
# they compute in fp32 without fp32 copies of x. CPU, one thread, bf16 x, 2x1024x1152: the
# fp32 formula took 10.6 ms forward and 30 ms backward against 2.5 and 4.6 for PyTorch's eager
# formula; per sample 1.4 and 3.1. Smaller samples keep the formula: a kernel call costs a few
# us of host time.
_PER_SAMPLE_MIN_ELEMENTS = 1 << 12


def _per_sample(x: torch.Tensor) -> bool:
    """Whether the PyTorch path runs ATen's LayerNorm once per sample of ``x: [B, S, D]``."""
    return x.device.type == "cpu" and x.shape[1] * x.shape[2] >= _PER_SAMPLE_MIN_ELEMENTS


def _torch_forward(x, gain, shift, eps, training):
    """PyTorch path in fp32 from the same gain/shift the graphs read, rounded once to x's dtype."""
    b, s, d = x.shape
    if _per_sample(x):
        outs = [_norm.LAYER_NORM.kernel(x[i], gain[i].float(), shift[i].float(), eps, 0.0) for i in range(b)]
        y = torch.stack([out[0] for out in outs])
        if not training:
            return y, None
        mean, rstd = torch.cat([out[1] for out in outs]), torch.cat([out[2] for out in outs])
    else:
        xhat, mean, rstd = torch.native_layer_norm(x.float(), [d], None, None, eps)
        y = (xhat * gain.float()[:, None] + shift.float()[:, None]).to(x.dtype)
        if not training:
            return y, None
    stats = x.new_zeros((2, -(-(b * s) // 4) * 4), dtype=_F32)
    stats[0, :b * s] = mean.view(b * s)
    stats[1, :b * s] = rstd.view(b * s)
    return y, stats


_forward_plans = _call_plans.SignatureMemo("ada_forward_calls")  # signature -> (run, plan) of the strategy that served it


# ---------------------------------------------------------------- backward

def _backward_impl(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, stats: torch.Tensor,
                   one_plus_scale: bool, shift_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward on ``x, dy: [B, S, D]``, ``scale: [B, D]`` (the forward's, fp32 or x's dtype)
    and the forward's ``stats``.

    Returns ``(dx [B, S, D] x.dtype, dscale [B, D] scale.dtype, dshift [B, D] shift_dtype)``,
    dscale and dshift summed in fp32 and rounded once; dscale is the same for both
    conventions (``d(1 + scale) / dscale = 1``).
    """
    b, s, d = x.shape
    if x.numel() and _runtime.route(x) is None:  # an empty x: PyTorch's path, as in the forward
        x2 = _dispatch.cudnn_rows(x.reshape(b * s, d))
        dy2 = _dispatch.packed(dy.reshape(b * s, d))
        args = (dy2, x2, b, scale, stats, one_plus_scale, shift_dtype)
        # a call repeating a signature reuses the strategy and plan it found (as the forward)
        signature = (x2.shape, x2.stride(0), x2.dtype, x2.get_device(), b, scale.dtype)
        hit = _backward_plans.get(signature)
        out = None if hit is None else hit[0](hit[1], *args)
        if out is None:
            for name in strategies.BACKWARD_ORDER[strategies.backward_strategy(b, s, d, x.dtype)]:
                strategy = strategies.BACKWARDS[name]
                plan = strategies.plan_for(strategy.spec(x2, b, scale.dtype, x2.device.index))
                out = None if plan is None else strategy.run(plan, *args)
                if out is not None:
                    _backward_plans.put(signature, (strategy.run, plan))
                    break
        if out is not None:
            dx, dscale, dshift = out
            return dx.view(b, s, d), dscale, dshift
    mean, rstd = _stats_view(stats, b * s)
    dx, dscale, dshift = _torch_backward(dy, x, strategies.make_gain(scale, one_plus_scale, _F32), mean, rstd)
    return dx, dscale.to(scale.dtype), dshift.to(shift_dtype)


def _torch_backward(dy, x, gain, mean, rstd):
    """``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * gain``;
    ``dscale = sum_tokens(dy * xhat)``, ``dshift = sum_tokens(dy)``, all in fp32: per sample,
    LayerNorm's dx, dweight and dbias with weight ``gain[b]``."""
    b, s, _ = x.shape
    if _per_sample(x):
        grads = [_norm.LAYER_NORM.grads(dy[i], x[i], gain[i], mean[i * s:(i + 1) * s], rstd[i * s:(i + 1) * s], 0.0)
                 for i in range(b)]
        return tuple(torch.stack(parts) for parts in zip(*grads))
    dyf = dy.float()
    rstd3 = rstd.reshape(b, s, 1)
    xhat = (x.float() - mean.reshape(b, s, 1)) * rstd3
    g = dyf * gain.float()[:, None]
    dx = rstd3 * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(1), dyf.sum(1)


_backward_plans = _call_plans.SignatureMemo("ada_backward_calls")  # signature -> (run, plan) of the strategy that served it


# ---------------------------------------------------------------- ops, autograd

def _fake_forward(x, scale, shift, eps, one_plus_scale, training):
    b, s, _ = x.shape
    return x.new_empty(x.shape), x.new_empty((2, (b * s + 3) // 4 * 4 if training else 0), dtype=_F32)


def _fake_backward(dy, x, scale, stats, one_plus_scale, shift_dtype):
    b, _, d = x.shape
    return x.new_empty(x.shape), x.new_empty((b, d), dtype=scale.dtype), x.new_empty((b, d), dtype=shift_dtype)


ada_layer_norm_fwd = _ops.define_op(
    "ada_layer_norm_fwd",
    "(Tensor x, Tensor scale, Tensor shift, float eps, bool one_plus_scale, bool training) -> (Tensor, Tensor)",
    _forward, _fake_forward)
ada_layer_norm_bwd = _ops.define_op(
    "ada_layer_norm_bwd",
    "(Tensor dy, Tensor x, Tensor scale, Tensor stats, bool one_plus_scale, ScalarType shift_dtype) "
    "-> (Tensor, Tensor, Tensor)",
    _backward_impl, _fake_backward)


def _setup_context(ctx, inputs, output):
    x, scale, shift, eps, one_plus_scale, _training = inputs
    ctx.save_for_backward(x, scale, output[1])
    ctx.one_plus_scale = one_plus_scale
    ctx.shift_dtype = shift.dtype
    ctx.eps = eps


def _make_backward(backward_fn):
    """The autograd backward, calling ``backward_fn``: the op when registered for traced
    graphs, the plain implementation in the eager ``autograd.Function``."""

    def backward(ctx, dy):
        x, scale, stats = ctx.saved_tensors
        if stats.numel() == 0 and x.numel():  # an empty x has empty statistics in training too
            raise RuntimeError("cudnorm.ada_layer_norm: backward through an inference-phase forward "
                               "(the forward ran without grad mode, so no statistics were saved)")
        if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
            dx, dscale, dshift = _differentiable_backward(dy, x, scale, ctx.eps, ctx.one_plus_scale, ctx.shift_dtype)
        else:
            dx, dscale, dshift = backward_fn(dy, x, scale, stats, ctx.one_plus_scale, ctx.shift_dtype)
        return dx, dscale, dshift, None, None, None

    return backward


def _differentiable_backward(dy, x, scale, eps, one_plus_scale, shift_dtype):
    """``(dx, dscale, dshift)`` as graphs for double backward (``_ops.differentiable_grads``):
    the fp32 formula without its shift, whose gradient is ``dy`` summed over the tokens."""

    def forward(x, scale):
        gain = scale.float() + 1 if one_plus_scale else scale.float()
        return F.layer_norm(x.float(), (x.shape[-1],), eps=eps) * gain.unsqueeze(1)

    dx, dscale = _ops.differentiable_grads(forward, (x, scale), dy.float())
    return dx, dscale, dy.float().sum(1).to(shift_dtype)


_ops.register_autograd("ada_layer_norm_fwd", _setup_context, _make_backward(ada_layer_norm_bwd))
_AdaLayerNormFunction = _ops.eager_autograd("_AdaLayerNormFunction", _forward, _setup_context,
                                                 _make_backward(_backward_impl))


# ---------------------------------------------------------------- functional

def _check_modulation(arg: str, value, input: torch.Tensor) -> None:
    """scale/shift: ``[B, D]`` or ``[B, 1, ..., 1, D]``, fp32 or the input's dtype (any
    supported dtype with an fp32 input: promoted, as PyTorch's formula does)."""
    b, d = input.shape[0], input.shape[-1]
    dtypes = _runtime.SUPPORTED_DTYPES if input.dtype is _F32 else _checks.param_dtypes(input.dtype)
    _checks.check_tensor(_OP, arg, value, dtypes=dtypes)
    shape = tuple(value.shape)
    if len(shape) < 2 or shape[0] != b or shape[-1] != d or any(n != 1 for n in shape[1:-1]):
        raise ValueError(f"cudnorm.{_OP}: argument '{arg}' has shape {_checks.dims(shape)}; expected [B, D] or "
                         f"[B, 1, D] with B={int(b)}, D={int(d)} from input of shape {_checks.dims(input.shape)}")
    _checks.check_same_device(_OP, arg, value, input)


def _check_call(input, scale, shift, eps, one_plus_scale) -> float:
    """Validate a call; return eps as a float. The common case costs a few attribute reads;
    anything unusual goes through the detailed checks, which raise the descriptive error."""
    try:
        shape, dtype, device = input.shape, input.dtype, input.device
        b, d = shape[0], shape[-1]
        fast = (isinstance(input, torch.Tensor) and type(eps) is float and 0.0 <= eps < math.inf
                and type(one_plus_scale) is bool and dtype in _runtime.SUPPORTED_DTYPES and len(shape) >= 2
                and input.numel() > 0)
        for p in (scale, shift):
            # first and last dims right and B*D elements: every middle dim is 1
            fast = fast and (isinstance(p, torch.Tensor) and (p.dtype is dtype or p.dtype is _F32) and p.dim() >= 2
                             and p.shape[0] == b and p.shape[-1] == d and p.numel() == b * d and p.device == device)
    except (AttributeError, IndexError, TypeError):
        fast = False
    if fast:
        return eps
    _checks.check_input(_OP, input)
    if input.dim() < 2:
        raise ValueError(f"cudnorm.{_OP}: argument 'input' must be [B, *, D], got shape {_checks.dims(input.shape)}")
    _check_modulation("scale", scale, input)
    _check_modulation("shift", shift, input)
    eps = _checks.check_eps(_OP, eps)
    if not isinstance(one_plus_scale, bool):
        raise TypeError(f"cudnorm.{_OP}: argument 'one_plus_scale' must be a bool, got {type(one_plus_scale).__name__}")
    return eps


def ada_layer_norm(input: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6,
                   one_plus_scale: bool = False) -> torch.Tensor:
    """Adaptive LayerNorm: a non-affine LayerNorm over the last dim, modulated per sample or per token.

    Args:
        input: ``[B, *, D]`` (e.g. ``[B, S, D]`` tokens), float16/bfloat16/float32.
        scale: ``[B, D]`` or ``[B, 1, D]``, float32 or ``input.dtype`` (bf16/fp16 with a
            float32 input are promoted to float32, as PyTorch's formula does); broadcast over
            the tokens of each sample. Or per token (FLUX.3, Helios): the input's shape,
            float32 or ``input.dtype``, a chunk of a Linear's output read in place
            (:mod:`cudnorm._token_ada`; its gradients are per token, nothing summed).
        shift: like ``scale``.
        eps: added to the variance (DiT/PixArt/SD3/Flux use 1e-6).
        one_plus_scale: ``True`` computes DiT's ``modulate``: ``norm(x) * (1 + scale) + shift``;
            ``False`` computes ``norm(x) * scale + shift``.

    Returns:
        ``input``-shaped tensor in ``input.dtype``. Gradients flow to input, scale and shift
        (scale/shift gradients are accumulated in fp32 and returned in their dtype). With
        bf16/fp16 input the forward reads the gain ``1 + scale`` (summed in fp32) and shift
        rounded to ``input.dtype``, as PyTorch's eager formula in that dtype does. Small
        calls and calls traced by ``torch.compile`` run PyTorch's ops instead, and under
        ``policy="auto"`` a larger eager call runs whichever of the formula in PyTorch's ops and
        cuDNN's AdaLN measured faster for its signature (:mod:`cudnorm._policy`, rule 4).
    """
    if _token_entry.is_per_token(input, scale):  # a modulation per token: its own kernels and formula
        return _token_entry.call(input, scale, shift, eps, one_plus_scale, rms=False)
    # the native path: C++ from here on. A tensor subclass (a DTensor) goes straight to the Python
    # implementation, which the C++ entry would hand it back to through the dispatcher
    if _entry.native and type(input) is _TENSOR and not _entry.is_compiling():
        try:
            return _entry.ada_layer_norm(input, scale, shift, eps, one_plus_scale)
        except (TypeError, RuntimeError):  # the op's schema refused an argument: cudnorm's error names it
            _check_call(input, scale, shift, eps, one_plus_scale)
            raise
    if _entry.pending and _entry.try_native(input):
        return ada_layer_norm(input, scale, shift, eps, one_plus_scale)
    return python_ada_layer_norm(input, scale, shift, eps, one_plus_scale)


def python_ada_layer_norm(input, scale, shift, eps, one_plus_scale):
    """:func:`ada_layer_norm` in Python: the path without the native launch path, and the one
    the native entry point hands back every call it does not serve itself."""
    if _entry.is_compiling():  # a mistake raises cudnorm's error when the compiled code runs, as in cudnorm.layer_norm
        error = _checks.traced_error(_check_call, input, input, scale, shift, eps, one_plus_scale)
        if error is not None:
            return error
    eps = _check_call(input, scale, shift, eps, one_plus_scale)
    if input.dtype is _F32 and (scale.dtype is not _F32 or shift.dtype is not _F32):
        scale, shift = scale.float(), shift.float()  # half-precision modulation of fp32 x: promoted
    if _policy.torch_serves(input, scale, shift):  # small or compiled calls: PyTorch's own ops
        return _torch_ops(input, scale, shift, eps, one_plus_scale)
    b, d = input.shape[0], input.shape[-1]
    flat = input.dim() == 3  # the common case needs no reshapes
    x = input if flat else input.reshape(b, math.prod(input.shape[1:-1]), d)  # not -1: B may be 0
    sc = scale if scale.dim() == 2 else scale.reshape(b, d)
    sh = shift if shift.dim() == 2 else shift.reshape(b, d)
    training = torch.is_grad_enabled() and (input.requires_grad or scale.requires_grad or shift.requires_grad)
    eager = _ops.eager(input)
    if (eager and scale.dtype is input.dtype and shift.dtype is input.dtype
            and _decisions.serves(_candidates.ADA_LAYER_NORM, input, d, sc, sh, training) == "torch"):
        return _torch_ops(input, scale, shift, eps, one_plus_scale)  # the measured decision (policy "auto")
    if not eager:
        y = ada_layer_norm_fwd(x, sc, sh, eps, one_plus_scale, training)[0]
    elif training:
        y = _AdaLayerNormFunction.apply(x, sc, sh, eps, one_plus_scale, training)
    else:
        y = _run_forward(x, sc, sh, eps, one_plus_scale, False)[0]
    return y if flat else y.view(input.shape)


def _torch_ops(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float, one_plus_scale: bool
               ) -> torch.Tensor:
    """AdaLN in PyTorch's ops on ``x [B, *, D]`` with ``scale``/``shift`` ``[B, D]`` or
    ``[B, 1, ..., D]`` of x's dtype, autograd by PyTorch: the LayerNorm, the gain, then the
    modulation. Without grad one multiply-add kernel (``addcmul``, one rounding) modulates,
    where DiT's formula runs a multiply and an add; with grad the formula's two ops, because
    ``addcmul``'s backward multiplies by its scalar ``value`` over the whole tensor (one more
    kernel than the formula's backward)."""
    if scale.dim() == 2 and x.dim() == 3:  # DiT's [B, S, D] with [B, D] chunks
        scale, shift = scale.unsqueeze(1), shift.unsqueeze(1)
    elif scale.dim() != x.dim():
        view = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
        scale, shift = scale.reshape(view), shift.reshape(view)
    xhat = torch.layer_norm(x, (x.shape[-1],), None, None, eps)
    gain = scale + 1 if one_plus_scale else scale
    if torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad or shift.requires_grad):
        y = xhat * gain + shift
    else:
        y = torch.addcmul(shift, xhat, gain)
    # fp32 modulation of half-precision x (a CPU call, cudnorm._policy rule 1): the formula
    # computes in fp32 and the result is rounded once to x's dtype, as cudnorm's own path returns
    return y if y.dtype is x.dtype else y.to(x.dtype)
