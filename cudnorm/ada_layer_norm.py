"""Adaptive LayerNorm (AdaLN) on cuDNN graphs: strategies, custom ops, autograd, functional.

Math, per sample ``b`` and token row ``x`` of ``D`` elements (non-affine LayerNorm)::

    xhat = (x - mean) * rstd,   rstd = 1 / sqrt(var + eps)
    y = xhat * gain[b] + shift[b],   gain = 1 + scale (one_plus_scale=True: DiT's ``modulate``)
                                     gain = scale     (one_plus_scale=False)

The implementation works on ``x: [B, S, D]`` and ``scale``/``shift``: ``[B, D]``. The gain is
computed here in PyTorch (``B*D`` elements, one small kernel): cuDNN 9.19 declines an
in-graph ``add(scale, 1)`` in the adalayernorm graph. Eager calls run the implementation
directly (through an ``autograd.Function`` when grad is needed); traced calls go through the
``cudnorm::ada_layer_norm_*`` ops, as in :mod:`cudnorm.layer_norm`.

Every strategy launches plain cuDNN graphs on the call's own tensors, so its cost is the
same whether a training loop hands it new tensors each step or the same ones. (Strategies
that captured the launches into CUDA graphs replayed while tensor addresses repeat were
removed: with fresh tensors every capture was paid again, and a DiT training step got
slower than PyTorch's own norms.)

Forward strategies (:data:`FORWARD_RULES`, ``cudnorm.config(ada_forward=...)`` forces one):

* ``cudnn`` (:class:`CudnnForward`): cuDNN's adalayernorm forward graph, one launch.
* ``per_sample`` (:class:`PerSampleForward`): the plain LayerNorm forward graph launched
  once per sample with weight ``gain[b]`` and bias ``shift[b]``.
* ``torch``: PyTorch's kernels in fp32 (also the CPU path).

Backward strategies (:data:`BACKWARD_RULES`, ``cudnorm.config(ada_backward=...)`` forces one):

* ``per_sample`` (:class:`PerSampleBackward`): the plain LayerNorm backward graph launched
  once per sample with weight ``gain[b]``; its dW/dB are that sample's dscale/dshift.
* ``cudnn`` (:class:`CudnnBackward`): cuDNN's adalayernorm backward graph, one launch (slow
  in 9.19 for more than a few samples: 3.5 ms at 32x256x1152 against 0.16 ms per sample).
* ``torch``: the fp32 PyTorch formula.

Each strategy class says what it builds (``spec``) and how it runs (``run``); the rules say
when it is picked. A strategy that cannot serve a call (an unaligned layout, a declined
graph) falls through to the next one (:data:`_FORWARD_ORDER`, :data:`_BACKWARD_ORDER`), so
forcing one changes speed, never the function computed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from . import _cache, _call_plans, _checks, _dispatch, _ops, _policy, _runtime, _settings
from ._graphs import eps_scalar
from ._spec import NormSpec

_OP = "ada_layer_norm"
_F32 = torch.float32
FORWARD_STRATEGIES = ("cudnn", "per_sample", "torch")
STRATEGIES = ("cudnn", "per_sample", "torch")  # backward

# (rule(b, s, d, dtype), strategy) rows, first match wins. Measured with fresh tensors on a
# lent H100 (bf16, GPU time per call from CUDA-graph replays of plain launches;
# docs/performance.md, Decisions): cuDNN's AdaLN forward graph is one launch at 7.8-76 us
# where the eager formula takes 12-292 us. cuDNN's AdaLN backward graph matches the
# per-sample launches up to ADA_CUDNN_BACKWARD_MAX elements and 8 samples (2x256x1152 13.3
# vs 15.1 us, 8x256x1152 42.7 vs 45.3, 2x1024x1152 29.7 vs 25.5) with one launch instead of
# B, and collapses beyond (8x1024x1152 99.6 vs 76.6, 8x1024x3072 497 vs 126, 32x256x1152
# 3534 vs 159).
ADA_CUDNN_BACKWARD_MAX = 1 << 22
FORWARD_RULES = ((lambda b, s, d, dtype: True, "cudnn"),)
BACKWARD_RULES = (
    (lambda b, s, d, dtype: b == 1, "per_sample"),  # one LayerNorm backward launch
    (lambda b, s, d, dtype: b <= 8 and b * s * d <= ADA_CUDNN_BACKWARD_MAX, "cudnn"),
    (lambda b, s, d, dtype: True, "per_sample"),
)
_FORWARD_ORDER = {"cudnn": ("cudnn", "per_sample"), "per_sample": ("per_sample", "cudnn"), "torch": ()}
_BACKWARD_ORDER = {"cudnn": ("cudnn", "per_sample"), "per_sample": ("per_sample", "cudnn"), "torch": ()}


def choose_forward(b: int, s: int, d: int, dtype: torch.dtype) -> str:
    """The forward strategy for ``x: [b, s, d]`` of ``dtype`` (first matching rule)."""
    return next(name for rule, name in FORWARD_RULES if rule(b, s, d, dtype))


def choose_backward(b: int, s: int, d: int, dtype: torch.dtype) -> str:
    """The backward strategy for ``x: [b, s, d]`` of ``dtype`` (first matching rule)."""
    return next(name for rule, name in BACKWARD_RULES if rule(b, s, d, dtype))


def _forward_strategy(b: int, s: int, d: int, dtype: torch.dtype) -> str:
    forced = _settings.current.ada_forward
    return choose_forward(b, s, d, dtype) if forced == "auto" else forced


def _backward_strategy(b: int, s: int, d: int, dtype: torch.dtype) -> str:
    forced = _settings.current.ada_backward
    return choose_backward(b, s, d, dtype) if forced == "auto" else forced


# ---------------------------------------------------------------- shared helpers

def _forward_dtype(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.dtype:
    """The dtype the forward reads gain and shift in: ``_dispatch.forward_params``' rule for
    a pair (fp32 only when either is fp32 and ``Config.fp32_weight_fwd`` is ``"native"``)."""
    return _dispatch.forward_param_dtype(x, scale if scale.dtype is _F32 else shift)


def _gain(scale: torch.Tensor, dit: bool, dtype: torch.dtype) -> torch.Tensor:
    """The per-sample multiplier, ``[B, D]`` of ``dtype``, packed and aligned for cuDNN.
    ``1 + scale`` is one kernel that adds in fp32 and rounds once to ``dtype``, as PyTorch's
    eager ``1 + scale`` in that dtype does."""
    if not dit:
        return _dispatch.packed(scale if scale.dtype is dtype else scale.to(dtype))
    if scale.dtype is dtype:
        return _dispatch.packed(torch.add(scale, 1.0))
    out = torch.empty(scale.shape, dtype=dtype, device=scale.device)
    return torch.add(scale, _dispatch.constant(1.0, scale.shape[-1], _F32, scale.device), out=out)


def _shift(shift: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``shift`` as the forward graph reads it: ``[B, D]`` of ``dtype``, packed and aligned."""
    return _dispatch.packed(shift if shift.dtype is dtype else shift.to(dtype))


def _modulation(scale: torch.Tensor, shift: torch.Tensor, dit: bool, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gain, shift)`` as the forward graph reads them (:func:`_gain`, :func:`_shift`).

    DiT passes scale and shift as chunks of one Linear output: neither is packed, so the
    forward needs ``1 + scale`` and a packed copy of shift. One ``_foreach_add`` makes both
    (adding 0 to shift copies it exactly): one op call instead of two, 17-18 us of host time
    each on a lent H100 host."""
    if dit and scale.dtype is dtype and shift.dtype is dtype and not _dispatch.is_packed(shift):
        gain, packed = torch._foreach_add([scale, shift], [1.0, 0.0])
        return _dispatch.packed(gain), _dispatch.packed(packed)
    return _gain(scale, dit, dtype), _shift(shift, dtype)


def _per_sample_fits(s: int, row_stride: int, d: int, x_itemsize: int, param_itemsize: int = 0) -> bool:
    """Whether each sample's block of ``x`` (rows ``row_stride`` apart), of the packed
    ``y``/``dy``/``dx`` and (``param_itemsize``) each ``[B, D]`` parameter row starts 16-byte
    aligned, as the per-sample LayerNorm graphs' descriptors require. (A sample's fp32
    statistics are aligned too when ``S % 4 == 0``; the backward pads them otherwise.)"""
    return not ((s * row_stride * x_itemsize) % 16 or (s * d * x_itemsize) % 16 or (d * param_itemsize) % 16)


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
    call's signature takes the strategy and plan it found from :data:`_forward_plans`."""
    dtype = _forward_dtype(x, scale, shift)
    if _runtime.route(x) is None:
        b, s, d = x.shape
        x2 = _dispatch.cudnn_rows(x.reshape(b * s, d))
        signature = (x2.shape, x2.stride(0), x2.dtype, x2.get_device(), b, dtype, training)
        hit = _forward_plans.get(signature)
        if hit is not None:
            _cache.plans.count_hit()
            return hit[0](hit[1], x2, b, scale, shift, dit, dtype, eps, training)
        for name in _FORWARD_ORDER[_forward_strategy(b, s, d, x.dtype)]:
            strategy = _FORWARDS[name]
            plan = _plan(strategy.spec(x2, b, dtype, training, x2.device.index))
            if plan is not None:
                _forward_plans.put(signature, (strategy.run, plan))
                return strategy.run(plan, x2, b, scale, shift, dit, dtype, eps, training)
    return _torch_forward(x, *_modulation(scale, shift, dit, dtype), eps, training)


def _torch_forward(x, gain, shift, eps, training):
    """PyTorch path in fp32 from the same gain/shift the graphs read, cast to x's dtype."""
    b, s, d = x.shape
    xhat, mean, rstd = torch.native_layer_norm(x.float(), [d], None, None, eps)
    y = (xhat * gain.float()[:, None] + shift.float()[:, None]).to(x.dtype)
    if not training:
        return y, None
    stats = x.new_zeros((2, -(-(b * s) // 4) * 4), dtype=_F32)
    stats[0, :b * s] = mean.view(b * s)
    stats[1, :b * s] = rstd.view(b * s)
    return y, stats


def _forward_outputs(x2, b, training):
    """Fresh ``y [B, S, D]`` and, when training, the ``[2, ceil4(B*S)]`` statistics."""
    rows, d = x2.shape
    y = torch.empty((b, rows // b, d), dtype=x2.dtype, device=x2.device)
    return y, _dispatch.stats_buffer(rows, 2, x2.device) if training else None


# ---------------------------------------------------------------- strategies
#
# A strategy is a class read as: what it builds (``spec``: the graph that serves the call, or
# None where it cannot: an unaligned layout), how it runs (``run``: the launches on the
# call's own tensors). The rules above say when each is picked; a strategy that cannot serve
# hands the call to the next in its order (_FORWARD_ORDER, _BACKWARD_ORDER).


def _plan(spec: NormSpec | None):
    """The plan of ``spec`` (``None`` when there is no spec or cuDNN declines it)."""
    return None if spec is None else _cache.get_plan(spec)


class CudnnForward:
    """``cudnn``: cuDNN's adalayernorm forward graph over all ``B*S`` rows, one launch reading
    ``gain``/``shift`` ``[B, D]``. The rules pick it at every shape."""

    name = "cudnn"

    @staticmethod
    def spec(x2, b, dtype, training, device_index):
        """``x2``: ``[B*S, D]``; ``dtype``: the gain/shift dtype the graph reads."""
        return _dispatch.spec_for(_OP, "train" if training else "infer", x2, dtype, device_index, batch=b)

    @staticmethod
    def run(plan, x2, b, scale, shift, dit, dtype, eps, training):
        """``(y [B, S, D], stats or None)``."""
        gain, shift = _modulation(scale, shift, dit, dtype)
        y, stats = _forward_outputs(x2, b, training)
        eps_holder, eps_address = eps_scalar(eps, 3)  # the holder keeps the host scalar alive until the launch
        pointers = [x2.data_ptr(), gain.data_ptr(), shift.data_ptr(), eps_address, y.data_ptr()]
        if training:
            mean = stats.data_ptr()
            pointers += [mean, mean + 4 * stats.shape[1]]
        plan.launch(pointers)
        return y, stats


class PerSampleForward:
    """``per_sample``: the plain LayerNorm forward graph of one sample's ``S`` rows, launched
    ``B`` times with weight ``gain[b]`` and bias ``shift[b]``. Only when forced, or where
    ``cudnn`` cannot serve."""

    name = "per_sample"

    @staticmethod
    def spec(x2, b, dtype, training, device_index):
        """``None`` unless every sample's rows are 16-byte aligned: the statistics are written
        straight into the caller's buffer, so a sample's rows must be aligned there too."""
        rows, d = x2.shape
        s = rows // b
        if not _per_sample_fits(s, x2.stride(0), d, x2.element_size(), dtype.itemsize) or s % 4:
            return None
        return _dispatch.spec_for("layer_norm", "train" if training else "infer", x2[:s], dtype, device_index)

    @staticmethod
    def run(plan, x2, b, scale, shift, dit, dtype, eps, training):
        """``(y [B, S, D], stats or None)``."""
        gain, shift = _modulation(scale, shift, dit, dtype)
        y, stats = _forward_outputs(x2, b, training)
        rows, d = x2.shape
        s = rows // b
        eps_holder, eps_address = eps_scalar(eps)  # the holder keeps the host scalar alive until the launch
        # per sample: x, weight gain[b], bias shift[b], eps, y, and when training mean, rstd
        steps = [s * x2.stride(0) * x2.element_size(), d * dtype.itemsize, d * dtype.itemsize, 0,
                 s * d * x2.element_size()]
        bases = [x2.data_ptr(), gain.data_ptr(), shift.data_ptr(), eps_address, y.data_ptr()]
        if training:
            mean = stats.data_ptr()
            bases += [mean, mean + 4 * stats.shape[1]]
            steps += [4 * s, 4 * s]
        _launch_per_sample(plan, b, bases, steps)
        return y, stats


def _launch_per_sample(plan, count: int, bases: list[int], steps: list[int]) -> None:
    """``count`` launches of ``plan``, launch ``k`` on addresses ``bases[i] + k * steps[i]``
    (a sample's rows of each buffer): no tensor view per sample, and the stream, handle and
    workspace are looked up once for all of them."""
    if plan.raw is None:
        for k in range(count):
            plan.launch([base + k * step for base, step in zip(bases, steps)])
        return
    state, workspace = _runtime.launch_context(plan.spec.device_index, plan.workspace_size)
    launch, backend = plan.raw.launch, state.backend
    for k in range(count):
        launch([base + k * step for base, step in zip(bases, steps)], workspace, backend)


_FORWARDS = {strategy.name: strategy for strategy in (CudnnForward, PerSampleForward)}
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
    if _runtime.route(x) is None:
        x2 = _dispatch.cudnn_rows(x.reshape(b * s, d))
        dy2 = _dispatch.packed(dy.reshape(b * s, d))
        args = (dy2, x2, b, scale, stats, one_plus_scale, shift_dtype)
        # a call repeating a signature reuses the strategy and plan it found (as the forward)
        signature = (x2.shape, x2.stride(0), x2.dtype, x2.get_device(), b, scale.dtype)
        hit = _backward_plans.get(signature)
        out = None if hit is None else hit[0](hit[1], *args)
        if out is None:
            for name in _BACKWARD_ORDER[_backward_strategy(b, s, d, x.dtype)]:
                strategy = _BACKWARDS[name]
                plan = _plan(strategy.spec(x2, b, scale.dtype, x2.device.index))
                out = None if plan is None else strategy.run(plan, *args)
                if out is not None:
                    _backward_plans.put(signature, (strategy.run, plan))
                    break
        if out is not None:
            dx, dscale, dshift = out
            return dx.view(b, s, d), dscale, dshift
    mean, rstd = _stats_view(stats, b * s)
    dx, dscale, dshift = _torch_backward(dy, x, _gain(scale, one_plus_scale, _F32), mean, rstd)
    return dx, dscale.to(scale.dtype), dshift.to(shift_dtype)


def _torch_backward(dy, x, gain, mean, rstd):
    """``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * gain``;
    ``dscale = sum_tokens(dy * xhat)``, ``dshift = sum_tokens(dy)``, all in fp32."""
    b, s, _ = x.shape
    dyf = dy.float()
    rstd3 = rstd.reshape(b, s, 1)
    xhat = (x.float() - mean.reshape(b, s, 1)) * rstd3
    g = dyf * gain.float()[:, None]
    dx = rstd3 * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(1), dyf.sum(1)


def _backward_outputs(x2, b, scale_dtype):
    """Fresh ``dx [B*S, D]`` and ``dscale``/``dshift`` ``[B, D]`` of the scale's dtype (what the
    graphs write; the caller casts dshift when the shift's dtype differs)."""
    device = x2.device
    d = x2.shape[1]
    return (torch.empty(x2.shape, dtype=x2.dtype, device=device), torch.empty((b, d), dtype=scale_dtype, device=device),
            torch.empty((b, d), dtype=scale_dtype, device=device))


class CudnnBackward:
    """``cudnn``: cuDNN's adalayernorm backward graph, one launch reading the gain (and writing
    dscale/dshift) in the scale's own dtype. The rules pick it for 2-8 samples up to
    ADA_CUDNN_BACKWARD_MAX elements; beyond, it collapses."""

    name = "cudnn"

    @staticmethod
    def spec(x2, b, scale_dtype, device_index):
        return _dispatch.spec_for(_OP, "bwd", x2, scale_dtype, device_index, batch=b)

    @staticmethod
    def run(plan, dy2, x2, b, scale, stats, dit, shift_dtype):
        """``(dx [B*S, D], dscale [B, D], dshift [B, D])``."""
        gain = _gain(scale, dit, scale.dtype)
        dx, dscale, dshift = _backward_outputs(x2, b, scale.dtype)
        mean = stats.data_ptr()
        plan.launch([x2.data_ptr(), gain.data_ptr(), mean, mean + 4 * stats.shape[1], dy2.data_ptr(), dx.data_ptr(),
                     dscale.data_ptr(), dshift.data_ptr()])
        return dx, dscale, dshift if shift_dtype is scale.dtype else dshift.to(shift_dtype)


class PerSampleBackward:
    """``per_sample``: the plain LayerNorm backward graph of one sample, launched ``B`` times
    with weight ``gain[b]``; its dW/dB are dscale[b]/dshift[b], written straight into the
    outputs' rows. The rules pick it for one sample and beyond the ``cudnn`` range."""

    name = "per_sample"

    @staticmethod
    def spec(x2, b, scale_dtype, device_index):
        """``None`` when the samples are not 16-byte aligned. Autotuned in "auto" mode from
        2**22 elements per sample, unlike the other backwards: the per-sample launches are
        short, and the plan the heuristics rank first was measured 4-16% slower there (H200,
        L2 flushed: 4096x3072 0.0313 vs >= 0.0327 ms, 4096x1152 0.0185-0.0221 vs >=
        0.0215-0.0237; benchmarks/results/nvidia-h200/autotune.txt; docs/performance.md,
        Decisions)."""
        rows, d = x2.shape
        s = rows // b
        if not _per_sample_fits(s, x2.stride(0), d, x2.element_size(), scale_dtype.itemsize):
            return None
        spec = _dispatch.spec_for("layer_norm", "bwd", x2[:s], scale_dtype, device_index)
        if not spec.autotune and _settings.current.autotune == "auto" \
                and spec.rows * spec.cols >= _dispatch.AUTOTUNE_MIN_ELEMENTS:
            spec = spec._replace(autotune=True)
        return spec

    @staticmethod
    def run(plan, dy2, x2, b, scale, stats, dit, shift_dtype):
        """``(dx [B*S, D], dscale [B, D], dshift [B, D])``."""
        gain = _gain(scale, dit, scale.dtype)
        dx, dscale, dshift = _backward_outputs(x2, b, scale.dtype)
        rows, d = x2.shape
        s = rows // b
        xsize, psize = x2.element_size(), scale.element_size()
        if s % 4:  # a sample's statistics must start 16-byte aligned: copy them to padded rows
            padded = torch.empty((2, b, -(-s // 4) * 4), dtype=_F32, device=x2.device)
            padded[:, :, :s].copy_(stats[:, :rows].view(2, b, s))
            stats = padded.view(2, -1)
        mean, stat_step = stats.data_ptr(), 4 * (stats.shape[1] // b)
        # per sample: x, gain, mean, rstd, dy, dx, dscale, dshift (roles() order)
        bases = [x2.data_ptr(), gain.data_ptr(), mean, mean + 4 * stats.shape[1], dy2.data_ptr(), dx.data_ptr(),
                 dscale.data_ptr(), dshift.data_ptr()]
        steps = [s * x2.stride(0) * xsize, d * psize, stat_step, stat_step, s * d * xsize, s * d * xsize, d * psize,
                 d * psize]
        _launch_per_sample(plan, b, bases, steps)
        return dx, dscale, dshift if shift_dtype is scale.dtype else dshift.to(shift_dtype)


_BACKWARDS = {strategy.name: strategy for strategy in (PerSampleBackward, CudnnBackward)}
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
        if stats.numel() == 0:
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
        raise ValueError(f"cudnorm.{_OP}: argument '{arg}' has shape {shape}; expected [B, D] or [B, 1, D] "
                         f"with B={b}, D={d} from input of shape {tuple(input.shape)}")
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
        raise ValueError(f"cudnorm.{_OP}: argument 'input' must be [B, *, D], got shape {tuple(input.shape)}")
    _check_modulation("scale", scale, input)
    _check_modulation("shift", shift, input)
    eps = _checks.check_eps(_OP, eps)
    if not isinstance(one_plus_scale, bool):
        raise TypeError(f"cudnorm.{_OP}: argument 'one_plus_scale' must be a bool, got {type(one_plus_scale).__name__}")
    return eps


def ada_layer_norm(input: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6,
                   one_plus_scale: bool = False) -> torch.Tensor:
    """Adaptive LayerNorm: a non-affine LayerNorm over the last dim, modulated per sample.

    Args:
        input: ``[B, *, D]`` (e.g. ``[B, S, D]`` tokens), float16/bfloat16/float32.
        scale: ``[B, D]`` or ``[B, 1, D]``, float32 or ``input.dtype`` (bf16/fp16 with a
            float32 input are promoted to float32, as PyTorch's formula does); broadcast over
            the tokens of each sample.
        shift: like ``scale``.
        eps: added to the variance (DiT/PixArt/SD3/Flux use 1e-6).
        one_plus_scale: ``True`` computes DiT's ``modulate``: ``norm(x) * (1 + scale) + shift``;
            ``False`` computes ``norm(x) * scale + shift``.

    Returns:
        ``input``-shaped tensor in ``input.dtype``. Gradients flow to input, scale and shift
        (scale/shift gradients are accumulated in fp32 and returned in their dtype). With
        bf16/fp16 input the forward reads the gain ``1 + scale`` (summed in fp32) and shift
        rounded to ``input.dtype``, as PyTorch's eager formula in that dtype does. Small
        calls and calls traced by ``torch.compile`` run PyTorch's ops instead
        (:mod:`cudnorm._policy`).
    """
    eps = _check_call(input, scale, shift, eps, one_plus_scale)
    if input.dtype is _F32 and (scale.dtype is not _F32 or shift.dtype is not _F32):
        scale, shift = scale.float(), shift.float()  # half-precision modulation of fp32 x: promoted
    if _policy.torch_serves(input, scale, shift):  # small or compiled calls: PyTorch's own ops
        return _torch_ops(input, scale, shift, eps, one_plus_scale)
    b, d = input.shape[0], input.shape[-1]
    flat = input.dim() == 3  # the common case needs no reshapes
    x = input if flat else input.reshape(b, -1, d)
    sc = scale if scale.dim() == 2 else scale.reshape(b, d)
    sh = shift if shift.dim() == 2 else shift.reshape(b, d)
    training = torch.is_grad_enabled() and (input.requires_grad or scale.requires_grad or shift.requires_grad)
    if not _ops.eager(input):
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
        return xhat * gain + shift
    return torch.addcmul(shift, xhat, gain)


# ---------------------------------------------------------------- warmup

def specs_for(batch: int, seq: int, cols: int, x_dtype: torch.dtype, scale_dtype: torch.dtype, device_index: int,
              phases: Iterable[str] = ("train", "bwd", "infer")) -> list[NormSpec]:
    """The specs :func:`ada_layer_norm` requests for a packed ``x: [batch, seq, cols]`` of
    ``x_dtype`` with scale/shift ``[batch, cols]`` of ``scale_dtype``, under the current
    settings (forward and backward strategy), when cuDNN accepts its first choice: the
    strategies' own ``spec`` on meta tensors. tests/test_warmup.py checks them against specs
    recorded from the op."""
    x2 = torch.empty((batch * seq, cols), dtype=x_dtype, device="meta")
    param = torch.empty((batch, cols), dtype=scale_dtype, device="meta")
    fwd_dtype = _forward_dtype(x2, param, param)
    specs = []
    for phase in phases:
        if phase == "bwd":
            found = (_BACKWARDS[name].spec(x2, batch, scale_dtype, device_index)
                     for name in _BACKWARD_ORDER[_backward_strategy(batch, seq, cols, x_dtype)])
        else:
            found = (_FORWARDS[name].spec(x2, batch, fwd_dtype, phase == "train", device_index)
                     for name in _FORWARD_ORDER[_forward_strategy(batch, seq, cols, x_dtype)])
        spec = next((spec for spec in found if spec is not None), None)
        if spec is not None:
            specs.append(spec)
    return specs
