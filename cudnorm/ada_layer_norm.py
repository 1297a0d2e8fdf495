"""Adaptive LayerNorm (AdaLN) on cuDNN graphs: strategies, custom ops, autograd, functional.

Math, per sample ``b`` and token row ``x`` of ``D`` elements (non-affine LayerNorm)::

    xhat = (x - mean) * rstd,   rstd = 1 / sqrt(var + eps)
    y = xhat * gain[b] + shift[b],   gain = 1 + scale (one_plus_scale=True: DiT's ``modulate``)
                                     gain = scale     (one_plus_scale=False)

The implementation works on ``x: [B, S, D]`` and ``scale``/``shift``: ``[B, D]``. The gain is
computed here in PyTorch (``B*D`` elements, one small kernel): cuDNN 9.19 declines an
in-graph ``add(scale, 1)`` in the adalayernorm graph. Eager calls run the implementation
directly (through an ``autograd.Function`` when grad is needed); traced calls go through the
``cudnorm::ada_layer_norm_*`` custom ops, as in :mod:`cudnorm.layer_norm`.

Forward strategies (:data:`FORWARD_RULES`, ``CUDNORM_ADA_FWD`` forces one):

* ``cudnn``: cuDNN's adalayernorm forward graph, one launch.
* ``cudnn_graph``: the same launch and the gain kernel before it captured once into a CUDA
  graph and replayed (one replay instead of two launches: less host time per call).
* ``per_sample``: the plain LayerNorm forward graph (``S`` rows, autotuned for large
  samples) launched once per sample with weight ``gain[b]`` and bias ``shift[b]``.
* ``per_sample_graph``: those launches captured once into a CUDA graph and replayed, spread
  over ``CUDNORM_ADA_BRANCHES`` streams (see :class:`_CapturedLaunches`).
* ``torch``: PyTorch's kernels in fp32 (also the CPU path).

Backward strategies (:data:`BACKWARD_RULES`, ``CUDNORM_ADA_BWD`` forces one):

* ``cudnn``: cuDNN's adalayernorm backward graph (slow in 9.19 for many short samples).
* ``per_sample``: the plain LayerNorm backward graph run once per sample with the fp32
  gain as its weight; its dW/dB are that sample's dscale/dshift.
* ``per_sample_graph``: the same launches captured once into a CUDA graph and replayed,
  spread over ``CUDNORM_ADA_BRANCHES`` streams (see :class:`_CapturedLaunches`).
* ``torch``: the fp32 PyTorch formula.

A strategy that cannot serve a call (an unaligned layout, a declined graph, an outer CUDA
graph capture) falls through to the next one (:data:`_FORWARD_ORDER`, :data:`_BACKWARD_ORDER`),
so forcing one changes speed, never the function computed.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from . import _cache, _call_plans, _checks, _dispatch, _runtime, _settings
from . import reference as ref
from ._graphs import host_scalar
from ._spec import NormSpec

_OP = "ada_layer_norm"
_EMPTY = (0,)
_F32 = torch.float32
FORWARD_STRATEGIES = ("cudnn", "cudnn_graph", "per_sample", "per_sample_graph", "torch")
STRATEGIES = ("cudnn", "per_sample", "per_sample_graph", "torch")  # backward

# (rule(b, s, d, dtype), strategy) rows, first match wins.
# Measured on the H200 (benchmarks/results/nvidia-h200/ada_strategies.csv, bf16, the five
# DiT shapes of issue 3): the captured per-sample backward was fastest at every shape
# (1.2-12x over cuDNN's AdaLN backward, 1.2-4.3x over the uncaptured launches). Forward: the
# one-launch cuDNN graph, except for samples of at least PER_SAMPLE_FORWARD_MIN elements,
# where the captured per-sample forward spread over 4 streams took 0.211 / 0.230 ms of GPU
# time (inference / training) at 16x4096x3072 against 0.264-0.270 for the best cuDNN AdaLN
# plan; at 8x4096x1152 (4.7M per sample) it took 0.053 against 0.044 (ada_branches.csv,
# probe_plans_s5.txt). Elsewhere the cuDNN graph runs captured with its gain kernel
# (``cudnn_graph``): the same kernels, replayed for less host time than two launches
# (benchmarks/results/nvidia-h200/probe_s9_*.txt).
PER_SAMPLE_FORWARD_MIN = 1 << 23
FORWARD_RULES = (
    (lambda b, s, d, dtype: b > 1 and s * d >= PER_SAMPLE_FORWARD_MIN, "per_sample_graph"),
    (lambda b, s, d, dtype: True, "cudnn_graph"),
)
BACKWARD_RULES = (
    (lambda b, s, d, dtype: b == 1, "per_sample"),  # a graph of one launch saves nothing
    (lambda b, s, d, dtype: True, "per_sample_graph"),
)
_FORWARD_ORDER = {"cudnn": ("cudnn", "per_sample"), "cudnn_graph": ("cudnn_graph", "cudnn", "per_sample"),
                  "per_sample": ("per_sample", "cudnn"),
                  "per_sample_graph": ("per_sample_graph", "per_sample", "cudnn"), "torch": ()}
_BACKWARD_ORDER = {"cudnn": ("cudnn", "per_sample"), "per_sample": ("per_sample", "cudnn"),
                   "per_sample_graph": ("per_sample_graph", "per_sample", "cudnn"), "torch": ()}


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

def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` packed with a 16-byte aligned base pointer (what cuDNN's tensor descriptors
    promise); a chunk of a Linear output is often neither. Copies only when needed."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _forward_dtype(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.dtype:
    """The dtype the forward reads gain and shift in: ``_dispatch.forward_params``' rule for
    a pair (fp32 only when either is fp32 and ``CUDNORM_FP32_WEIGHT_FWD=native``)."""
    return _dispatch.forward_param_dtype(x, scale if scale.dtype is _F32 else shift)


def _gain(scale: torch.Tensor, dit: bool, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The per-sample multiplier, ``[B, D]`` of ``dtype``, aligned for cuDNN (or written to
    ``out``). ``1 + scale`` is added in fp32 and rounded once to ``dtype``, as PyTorch's
    eager bf16 ``1 + scale`` rounds it."""
    if not dit:
        if out is not None:
            return out.copy_(scale)
        return _aligned(scale if scale.dtype is dtype else scale.to(dtype))
    one = _dispatch.constant(1.0, scale.shape[-1], _F32, scale.device)  # fp32 operand: fp32 sum
    if out is None:
        out = torch.empty(scale.shape, dtype=dtype, device=scale.device)
    return torch.add(scale, one, out=out)


def _per_sample_fits(s: int, row_stride: int, d: int, x_itemsize: int, param_itemsize: int = 0) -> bool:
    """Whether each sample's block of ``x`` (rows ``row_stride`` apart), of the packed
    ``y``/``dy``/``dx`` and (``param_itemsize``) each ``[B, D]`` parameter row starts 16-byte
    aligned, as the per-sample LayerNorm graphs' descriptors require."""
    return not ((s * row_stride * x_itemsize) % 16 or (s * d * x_itemsize) % 16 or (d * param_itemsize) % 16)


def _padded_rows(b: int, n: int, device: torch.device) -> torch.Tensor:
    """An fp32 ``[b, n]`` view whose rows start 16-byte aligned (rows padded to 4 elements)."""
    return torch.empty((b, -(-n // 4) * 4), dtype=_F32, device=device)[:, :n]


# ---------------------------------------------------------------- forward

def _forward(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float, one_plus_scale: bool,
             training: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward on ``x: [B, S, D]``; ``scale``/``shift``: ``[B, D]``, fp32 or x's dtype.

    Returns ``(y [B, S, D] x.dtype, mean [B*S] fp32, rstd [B*S] fp32)``; with
    ``training=False`` the inference graph runs and ``mean``/``rstd`` are empty.
    """
    y, mean, rstd = _run_forward(x, scale, shift, eps, one_plus_scale, training)
    if not training:
        mean, rstd = x.new_empty(_EMPTY, dtype=_F32), x.new_empty(_EMPTY, dtype=_F32)
    return y, mean, rstd


def _run_forward(x, scale, shift, eps, dit, training):
    """``(y, mean, rstd)`` from the first strategy that serves the call (stats ``None`` when
    not training: eager inference allocates no empty statistics). The hot path: a call
    repeating an earlier call's signature takes the strategy and plan it found from
    :data:`_forward_plans` (as :mod:`cudnorm._call_plans` does for LayerNorm/RMSNorm)."""
    dtype = _forward_dtype(x, scale, shift)
    if _dispatch.route(x) is None:
        b, s, d = x.shape
        x2 = _dispatch.cudnn_rows(x.reshape(b * s, d))
        signature = (x2.shape, x2.stride(0), x2.dtype, x2.get_device(), b, dtype, training)
        hit = _forward_plans.get(signature)
        if hit is not None:
            _cache.plans.count_hit()
            return hit[0](x2, b, _Modulation(scale, shift, dit, dtype), eps, training, hit[1])
        for name in _FORWARD_ORDER[_forward_strategy(b, s, d, x.dtype)]:
            find_plan, run = _FORWARDS[name]
            plan = find_plan(x2, b, dtype, training)
            if plan is not None:
                _forward_plans.put(signature, (run, plan))
                return run(x2, b, _Modulation(scale, shift, dit, dtype), eps, training, plan)
    mod = _Modulation(scale, shift, dit, dtype)
    return _torch_forward(x, mod.gain(), mod.shift_for_graph(), eps, training)


class _Modulation(tuple):
    """A forward call's ``(scale, shift, dit, dtype)``: the caller's tensors and the dtype the
    graphs read them in. Strategies turn them into the buffers they read (:meth:`gain`,
    :meth:`shift_for_graph`) where it suits them: outside a captured graph, or inside it."""

    __slots__ = ()

    def __new__(cls, scale: torch.Tensor, shift: torch.Tensor, dit: bool, dtype: torch.dtype):
        return tuple.__new__(cls, (scale, shift, dit, dtype))

    def gain(self) -> torch.Tensor:
        scale, _, dit, dtype = self
        return _gain(scale, dit, dtype)

    def shift_for_graph(self) -> torch.Tensor:
        shift, dtype = self[1], self[3]
        return _aligned(shift if shift.dtype is dtype else shift.to(dtype))


def _torch_forward(x, gain, shift, eps, training):
    """PyTorch path in fp32 from the same gain/shift the graphs read, cast to x's dtype."""
    b, s, d = x.shape
    xhat, mean, rstd = torch.native_layer_norm(x.float(), [d], None, None, eps)
    y = (xhat * gain.float()[:, None] + shift.float()[:, None]).to(x.dtype)
    return (y, mean.view(b * s), rstd.view(b * s)) if training else (y, None, None)


# Each forward strategy is a pair: ``find_plan(x2, b, dtype, training)`` returns the plan that
# serves ``x2: [B*S, D]`` with gain/shift of ``dtype`` (``None``: it cannot), and
# ``run(x2, b, mod, eps, training, plan)`` launches it (``mod``: the call's :class:`_Modulation`).

def _cudnn_plan(x2, b, dtype, training):
    return _dispatch.get_plan(_dispatch.spec_for(_OP, "train" if training else "infer", x2, dtype,
                                                 x2.device.index, batch=b))


def _cudnn_forward_outputs(x2, b, training):
    """Fresh ``(y [B, S, D],)``, and when training fp32 ``mean``/``rstd`` ``[B*S]``."""
    rows, d = x2.shape
    y = torch.empty((b, rows // b, d), dtype=x2.dtype, device=x2.device)
    if not training:
        return (y,)
    return y, torch.empty(rows, dtype=_F32, device=x2.device), torch.empty(rows, dtype=_F32, device=x2.device)


def _run_cudnn(x2, b, mod, eps, training, plan):
    outputs = _cudnn_forward_outputs(x2, b, training)
    plan.run(x2, mod.gain(), mod.shift_for_graph(), host_scalar(eps, plan.spec), *outputs)
    return outputs if training else (outputs[0], None, None)


def _run_cudnn_graph(x2, b, mod, eps, training, plan):
    """:func:`_run_cudnn` through the captured-graph cache (:class:`_CapturedLaunches`): the
    gain kernel, any rounding or packing of shift, and the launch, recorded once and replayed
    while the call's tensors keep their addresses. eps is recorded by value: it is part of
    the family, with everything else the recorded kernels depend on."""
    if not x2.is_cuda or _runtime.capturing():
        return _run_cudnn(x2, b, mod, eps, training, plan)  # an outer capture records the launches
    scale, shift, dit, _ = mod
    outputs = _cudnn_forward_outputs(x2, b, training)
    family = ("cudnn", plan.spec, float(eps), dit, scale.dtype, scale.stride(), shift.dtype, shift.stride())
    one = _dispatch.constant(1.0, x2.shape[1], _F32, x2.device) if dit else None  # read by the gain's add
    _captured.run(plan, family, (x2, scale, shift, *outputs),
                  lambda: plan.run(x2, mod.gain(), mod.shift_for_graph(), host_scalar(eps, plan.spec), *outputs),
                  keep=one)
    return outputs if training else (outputs[0], None, None)


def _per_sample_fwd_plan(x2, b, dtype, training):
    rows, d = x2.shape
    s = rows // b
    if not _per_sample_fits(s, x2.stride(0), d, x2.element_size(), dtype.itemsize):
        return None
    return _dispatch.get_plan(_dispatch.spec_for("layer_norm", "train" if training else "infer", x2[:s], dtype,
                                                 x2.device.index))


def _per_sample_forward_outputs(x2, b, training):
    """Fresh ``(y [B, S, D],)``, and when training 16-byte aligned fp32 ``mean``/``rstd`` ``[B, S]``."""
    rows, d = x2.shape
    s = rows // b
    y = torch.empty((b, s, d), dtype=x2.dtype, device=x2.device)
    return (y, _padded_rows(b, s, x2.device), _padded_rows(b, s, x2.device)) if training else (y,)


def _per_sample_forward_launches(x2, b, gain, shift, eps, plan, outputs) -> list:
    """Per sample, the buffers of its launch in :func:`cudnorm._graphs.roles` order (B views
    of each tensor: worth skipping when a captured graph replays); ``gain``/``shift`` are the
    ``[B, D]`` buffers the graph reads."""
    eps_t = host_scalar(eps, plan.spec)
    per_sample = zip(x2.unflatten(0, (b, x2.shape[0] // b)).unbind(0), gain.unbind(0), shift.unbind(0),
                     *(t.unbind(0) for t in outputs))
    return [(xb, gb, sb, eps_t, *out) for xb, gb, sb, *out in per_sample]


def _forward_result(outputs, rows: int):
    if len(outputs) == 1:
        return outputs[0], None, None
    y, mean, rstd = outputs
    return y, mean.reshape(rows), rstd.reshape(rows)  # a copy only when S % 4 padded them


def _run_per_sample(x2, b, mod, eps, training, plan):
    outputs = _per_sample_forward_outputs(x2, b, training)
    launches = _per_sample_forward_launches(x2, b, mod.gain(), mod.shift_for_graph(), eps, plan, outputs)
    _launch_per_sample(plan, launches)
    return _forward_result(outputs, x2.shape[0])


def _run_per_sample_graph(x2, b, mod, eps, training, plan):
    """:func:`_run_per_sample` through the captured-graph cache (:class:`_CapturedLaunches`);
    eps is a by-value input the graph records, so it is part of the family."""
    if not x2.is_cuda or _runtime.capturing():
        return _run_per_sample(x2, b, mod, eps, training, plan)  # an outer capture records them
    gain, shift = mod.gain(), mod.shift_for_graph()
    outputs = _per_sample_forward_outputs(x2, b, training)
    family = (plan.spec, b, float(eps))
    _captured.run(plan, family, (x2, gain, shift, *outputs),
                  lambda: _launch_per_sample(plan, _per_sample_forward_launches(x2, b, gain, shift, eps, plan, outputs),
                                             _settings.current.ada_branches))
    return _forward_result(outputs, x2.shape[0])


_FORWARDS = {"cudnn": (_cudnn_plan, _run_cudnn), "cudnn_graph": (_cudnn_plan, _run_cudnn_graph),
             "per_sample": (_per_sample_fwd_plan, _run_per_sample),
             "per_sample_graph": (_per_sample_fwd_plan, _run_per_sample_graph)}
_forward_plans = _call_plans.SignatureMemo()  # signature -> (run, plan) of the strategy that served it


# ---------------------------------------------------------------- backward

def _backward_impl(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                   one_plus_scale: bool, shift_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward on ``x, dy: [B, S, D]``, ``scale: [B, D]`` (the forward's, fp32 or x's dtype).

    Returns ``(dx [B, S, D] x.dtype, dscale [B, D] scale.dtype, dshift [B, D] shift_dtype)``,
    dscale and dshift summed in fp32 and rounded once; dscale is the same for both
    conventions (``d(1 + scale) / dscale = 1``).
    """
    b, s, d = x.shape
    if _dispatch.route(x) is None:
        x2 = _dispatch.cudnn_rows(x.reshape(b * s, d))
        dy2, mean, rstd = _aligned(dy.reshape(b * s, d)), _aligned(mean), _aligned(rstd)
        args = (dy2, x2, b, scale, mean, rstd, one_plus_scale, shift_dtype)
        # a call repeating a signature reuses the strategy and plan it found (as the forward)
        signature = (x2.shape, x2.stride(0), x2.dtype, x2.get_device(), b, scale.dtype)
        hit = _backward_plans.get(signature)
        out = None if hit is None else hit[0](hit[1], *args)
        if out is None:
            for name in _BACKWARD_ORDER[_backward_strategy(b, s, d, x.dtype)]:
                find_plan, run = _BACKWARDS[name]
                plan = find_plan(x2, b, scale.dtype)
                out = None if plan is None else run(plan, *args)
                if out is not None:
                    if not (x2.is_cuda and _runtime.capturing()):  # an outer capture is no reason to drop a graph
                        _backward_plans.put(signature, (run, plan))
                    break
        if out is not None:
            dx, dscale, dshift = out
            return dx.view(b, s, d), dscale, dshift
    dx, dscale, dshift = _torch_backward(dy, x, _gain(scale, one_plus_scale, _F32), mean, rstd)
    return dx, dscale.to(scale.dtype), dshift.to(shift_dtype)


def _torch_backward(dy, x, gain, mean, rstd):
    """``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * gain``;
    ``dscale = sum_tokens(dy * xhat)``, ``dshift = sum_tokens(dy)``, all in fp32."""
    b, s, _ = x.shape
    dyf = dy.float()
    rstd3 = rstd.view(b, s, 1)
    xhat = (x.float() - mean.view(b, s, 1)) * rstd3
    g = dyf * gain.float()[:, None]
    dx = rstd3 * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(1), dyf.sum(1)


# Each backward strategy is a pair: ``find_plan(x2, b, scale_dtype)`` returns the plan that
# serves ``x2: [B*S, D]`` (``None``: it cannot), and ``run(plan, dy2, x2, b, scale, mean, rstd,
# dit, shift_dtype)`` returns ``(dx, dscale, dshift)``, or ``None`` when it cannot serve this
# call (a captured strategy during an outer capture).

def _cudnn_bwd_plan(x2, b, scale_dtype):
    return _dispatch.get_plan(_dispatch.spec_for(_OP, "bwd", x2, scale_dtype, x2.device.index, batch=b))


def _bwd_cudnn(plan, dy2, x2, b, scale, mean, rstd, dit, shift_dtype):
    """cuDNN's adalayernorm backward, reading the gain (and writing dscale/dshift) in the
    scale's own dtype."""
    gain = _gain(scale, dit, scale.dtype)
    dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    dscale = torch.empty(gain.shape, dtype=gain.dtype, device=x2.device)
    dshift = torch.empty_like(dscale)
    plan.run(x2, gain, dy2, mean, rstd, dx, dscale, dshift)
    return dx, dscale, dshift.to(shift_dtype)


def _per_sample_bwd_spec(sample: torch.Tensor, device_index: int) -> NormSpec:
    """The spec of the per-sample LayerNorm backward (fp32 weight) for ``sample: [S, D]``,
    the view of one sample's rows (real or meta)."""
    # Autotuned in "auto" mode from 2**22 elements per sample, unlike the other backwards: the
    # per-sample launches are short, and the plan the heuristics rank first was measured
    # 4-16% slower there (H200, L2 flushed: 4096x3072 0.0313 vs >= 0.0327 ms, 4096x1152
    # 0.0185-0.0221 vs >= 0.0215-0.0237; benchmarks/results/nvidia-h200/autotune.txt).
    spec = _dispatch.spec_for("layer_norm", "bwd", sample, _F32, device_index)
    if not spec.autotune and _settings.current.autotune == "auto" \
            and spec.rows * spec.cols >= _dispatch.AUTOTUNE_MIN_ELEMENTS:
        spec = spec._replace(autotune=True)
    return spec


def _per_sample_plan(x2, b, scale_dtype=None):
    """The LayerNorm-backward plan of one sample (fp32 weight, whatever ``scale_dtype``), or
    ``None`` when the samples are not 16-byte aligned or cuDNN declines."""
    rows, d = x2.shape
    s = rows // b
    if not _per_sample_fits(s, x2.stride(0), d, x2.element_size()):
        return None
    return _dispatch.get_plan(_per_sample_bwd_spec(x2[:s], x2.device.index))


_branch_streams = threading.local()  # .by_device: device -> side streams a capture forks onto


def branch_streams(device: int, count: int) -> list:
    """``count`` side streams of ``device`` for this thread (a stream is in one capture at a
    time), made before the capture begins."""
    by_device = getattr(_branch_streams, "by_device", None)
    if by_device is None:
        by_device = _branch_streams.by_device = {}
    streams = by_device.setdefault(device, [])
    while len(streams) < count:
        streams.append(torch.cuda.Stream(device))
    return streams[:count]


def _launch_per_sample(plan, samples: list, branches: int = 1) -> list:
    """One launch of ``plan`` per entry of ``samples`` (the buffers of one sample's launch).

    While a CUDA graph is being captured and ``branches > 1``, the samples are dealt round
    robin to that many side streams (:func:`branch_streams`) forked from the capturing stream
    and joined back into it, so a replay runs up to ``branches`` samples at once: a short
    sample's LayerNorm backward (two kernels of a few microseconds) leaves most of the GPU
    idle when the launches run one after another. Each branch gets its own workspace (cuDNN
    keeps partial dW/dB there). Returns those workspaces: they must outlive the capture.
    """
    branches = min(branches, len(samples))
    if branches <= 1 or not _runtime.capturing():
        for buffers in samples:
            plan.run(*buffers)
        return []
    device = plan.spec.device_index
    main = torch.cuda.current_stream(device)
    size = plan.workspace_size
    workspaces = [torch.empty(size, dtype=torch.uint8, device=main.device) if size else None
                  for _ in range(branches)]
    streams = branch_streams(device, branches)
    for k, stream in enumerate(streams):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            for buffers in samples[k::branches]:
                plan.run_with_workspace(workspaces[k], *buffers)
    for stream in streams:
        main.wait_stream(stream)
    _runtime.handle(device)  # bind the handle back to the capturing stream
    return workspaces


def _per_sample_backward(plan, dy2, x2, b, scale, mean, rstd, dit, dx, dscale, dshift, branches: int = 1) -> list:
    """The whole per-sample backward of a call, into ``dx [B, S, D]`` and ``dscale``/``dshift``
    ``[B, D]`` (any float dtype): the fp32 gain, B LayerNorm-backward launches (weight
    ``gain[b]``; their dW/dB are sample b's dscale/dshift, in fp32) and the rounding into the
    outputs. Only scratch is allocated here, so a CUDA graph can record all of it. The fp32
    ``[B, D]`` and statistics rows each start 16-byte aligned (padded when ``D`` or ``S`` is
    not a multiple of 4), as the per-sample graphs' descriptors require. ``branches``: see
    :func:`_launch_per_sample`, whose workspaces are returned (keep them until capture ends)."""
    rows, d = x2.shape
    s = rows // b
    device = x2.device
    gain = _gain(scale, dit, _F32) if d % 4 == 0 else _gain(scale, dit, _F32, out=_padded_rows(b, d, device))
    stats = [t.view(b, s) if s % 4 == 0 else _padded_rows(b, s, device).copy_(t.view(b, s)) for t in (mean, rstd)]
    sums = [out if out.dtype is _F32 and d % 4 == 0 else _padded_rows(b, d, device) for out in (dscale, dshift)]
    bases = (x2.unflatten(0, (b, s)), gain, dy2.view(b, s, d), *stats, dx, *sums)
    keep = _launch_per_sample(plan, list(zip(*(t.unbind(0) for t in bases))), branches)
    for out, summed in zip((dscale, dshift), sums):
        if out is not summed:
            out.copy_(summed)
    return keep


def _backward_outputs(x2, b, scale_dtype, shift_dtype):
    """Fresh ``(dx [B, S, D], dscale [B, D], dshift [B, D])``."""
    device = x2.device
    d = x2.shape[1]
    return (torch.empty((b, x2.shape[0] // b, d), dtype=x2.dtype, device=device),
            torch.empty((b, d), dtype=scale_dtype, device=device), torch.empty((b, d), dtype=shift_dtype, device=device))


def _bwd_per_sample(plan, dy2, x2, b, scale, mean, rstd, dit, shift_dtype):
    outputs = _backward_outputs(x2, b, scale.dtype, shift_dtype)
    _per_sample_backward(plan, dy2, x2, b, scale, mean, rstd, dit, *outputs)
    return outputs


class _CapturedLaunches:
    """The work of a call, captured once in a CUDA graph and replayed: a whole per-sample
    backward (gain, B launches, rounding of dscale/dshift: one replay instead of B + 3
    launches), a forward's B per-sample launches, or cuDNN's AdaLN forward with its gain
    kernel. While captured, the launches are spread over
    ``CUDNORM_ADA_BRANCHES`` streams (:func:`_launch_per_sample`).

    Correctness: a graph replays fixed pointers, so the key holds the family (LayerNorm spec,
    B, convention, dtypes and strides of scale, output dtypes; a forward's eps, recorded by
    value), the stream and the base pointer of every tensor read or written (backward: x,
    scale, dy, mean, rstd, dx, dscale, dshift; forward: x, gain, shift, y, mean, rstd).
    A replay therefore reads and writes exactly the tensors of the current call; memory
    freed and reused by another tensor of the same layout is read as that tensor, which is
    what the call asks. Scratch (the fp32 gain, padded rows) lives in the graph's memory.
    Keying on the stream keeps two streams from racing on the workspace and scratch.

    Cost: a miss runs the backward eagerly (that call's result), then records it on a side
    stream (host time only; nothing runs twice). In a training loop the caching allocator
    hands out the same addresses each step, so steady-state calls hit.

    Memory: cuDNN's workspace and the scratch live in a graph memory pool shared by the
    entries of one (device, stream); replays on one stream never overlap and keep nothing
    in scratch between replays, so sharing it is safe. At most ``CUDNORM_ADA_GRAPH_CACHE``
    entries (default 64; a DiT-XL step makes 56 AdaLN calls) are kept, least recently used
    evicted; 0 disables capture.

    Thrashing guard: a capture pays off only when its addresses come back. A family holding
    :attr:`MAX_MISSES` captures that were never replayed (a caller whose buffers move every
    call) captures no more and runs the plain launches; each first replay of an entry frees
    a slot, so a steady model with many calls of one family is captured over a few steps.
    """

    MAX_MISSES = 8

    def __init__(self) -> None:
        self.entries: OrderedDict = OrderedDict()  # key -> [CUDAGraph or None (failed), plan, replayed, keep]
        self.pools: dict = {}
        self.replays = 0
        self.unproven: dict = {}  # family -> captures not replayed yet

    def run(self, plan, family: tuple, tensors: tuple, program, keep=None) -> None:
        """Run ``program()`` (which reads and writes only ``tensors``, scratch and ``keep``,
        cached tensors the entry holds on to: their memory must outlive the graph) through
        the graph cache."""
        device = plan.spec.device_index
        stream = _runtime.current_stream_ptr(device)
        key = (family, stream, *(t.data_ptr() for t in tensors))
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            if entry[0] is None:
                program()
                return
            entry[0].replay()
            self.replays += 1
            if not entry[2]:
                entry[2] = True
                self.unproven[family] -= 1
            return
        program()
        limit = _settings.current.ada_graph_cache
        unproven = self.unproven.get(family, 0)
        if limit and unproven < self.MAX_MISSES:
            self.unproven[family] = unproven + 1
            # the plan owns the kernels
            self.entries[key] = [self._capture(program, device, stream), plan, False, keep]
            while len(self.entries) > limit:
                self.entries.popitem(last=False)

    def _capture(self, program, device: int, stream: int):
        """Record ``program`` (nothing runs); ``None``, with a warning, if capture fails."""
        pool = self.pools.get((device, stream))
        if pool is None:
            pool = self.pools[(device, stream)] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device)
        branch_streams(device, _settings.current.ada_branches)  # made before capture begins
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                # thread_local: other threads (data loaders, autograd workers) keep working
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    scratch = program()  # noqa: F841 - held until the capture ends
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - capture refused (driver, nested capture): stay correct, eager
            warnings.warn(f"cudnorm.{_OP}: CUDA-graph capture failed ({type(exc).__name__}: {exc}); "
                          f"running the launches without a graph", RuntimeWarning, stacklevel=2)
            graph = None
        current.wait_stream(side)
        return graph

    def clear(self) -> None:
        self.entries.clear()
        self.pools.clear()
        self.unproven.clear()


_captured = _CapturedLaunches()


def clear_captured_graphs() -> None:
    """Drop every captured AdaLN backward graph (called by :func:`cudnorm.clear_cache`)."""
    _captured.clear()


def _bwd_per_sample_graph(plan, dy2, x2, b, scale, mean, rstd, dit, shift_dtype):
    if not x2.is_cuda or _runtime.capturing():
        return None  # an outer capture records the plain launches itself
    outputs = _backward_outputs(x2, b, scale.dtype, shift_dtype)
    family = (plan.spec, b, dit, scale.dtype, scale.stride(), shift_dtype)
    one = _dispatch.constant(1.0, x2.shape[1], _F32, x2.device) if dit else None  # read by the gain's add
    _captured.run(plan, family, (x2, scale, dy2, mean, rstd, *outputs),
                  lambda: _per_sample_backward(plan, dy2, x2, b, scale, mean, rstd, dit, *outputs,
                                               branches=_settings.current.ada_branches), keep=one)
    return outputs


_BACKWARDS = {"cudnn": (_cudnn_bwd_plan, _bwd_cudnn), "per_sample": (_per_sample_plan, _bwd_per_sample),
              "per_sample_graph": (_per_sample_plan, _bwd_per_sample_graph)}
_backward_plans = _call_plans.SignatureMemo()  # signature -> (run, plan) of the strategy that served it


# ---------------------------------------------------------------- custom ops, autograd

ada_layer_norm_fwd = torch.library.custom_op("cudnorm::ada_layer_norm_fwd", _forward, mutates_args=())
ada_layer_norm_bwd = torch.library.custom_op("cudnorm::ada_layer_norm_bwd", _backward_impl, mutates_args=())


@ada_layer_norm_fwd.register_fake
def _(x, scale, shift, eps, one_plus_scale, training):
    b, s, _ = x.shape
    stats = (b * s,) if training else _EMPTY
    return x.new_empty(x.shape), x.new_empty(stats, dtype=_F32), x.new_empty(stats, dtype=_F32)


@ada_layer_norm_bwd.register_fake
def _(dy, x, scale, mean, rstd, one_plus_scale, shift_dtype):
    b, _, d = x.shape
    return x.new_empty(x.shape), x.new_empty((b, d), dtype=scale.dtype), x.new_empty((b, d), dtype=shift_dtype)


def _setup_context(ctx, inputs, output):
    x, scale, shift, _eps, one_plus_scale, _training = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, scale, mean, rstd)
    ctx.one_plus_scale = one_plus_scale
    ctx.shift_dtype = shift.dtype


def _make_backward(backward_fn):
    """The autograd backward, calling ``backward_fn``: the custom op when registered for
    traced graphs, the plain implementation in the eager ``autograd.Function``."""

    def backward(ctx, dy):
        x, scale, mean, rstd = ctx.saved_tensors
        if mean.numel() == 0:
            raise RuntimeError("cudnorm.ada_layer_norm: backward through an inference-phase forward "
                               "(the forward ran without grad mode, so no statistics were saved)")
        dx, dscale, dshift = backward_fn(dy, x, scale, mean, rstd, ctx.one_plus_scale, ctx.shift_dtype)
        return dx, dscale, dshift, None, None, None

    return backward


_dispatch.register_autograd(ada_layer_norm_fwd, _setup_context, _make_backward(ada_layer_norm_bwd))
_AdaLayerNormFunction = _dispatch.eager_autograd("_AdaLayerNormFunction", _forward, _setup_context,
                                                 _make_backward(_backward_impl))


# ---------------------------------------------------------------- functional

def _check_modulation(arg: str, value, input: torch.Tensor) -> None:
    """scale/shift: ``[B, D]`` or ``[B, 1, ..., 1, D]``, fp32 or the input's dtype."""
    b, d = input.shape[0], input.shape[-1]
    _checks.check_tensor(_OP, arg, value, dtypes=tuple(dict.fromkeys((input.dtype, _F32))))
    shape = tuple(value.shape)
    if len(shape) < 2 or shape[0] != b or shape[-1] != d or any(n != 1 for n in shape[1:-1]):
        raise ValueError(f"cudnorm.{_OP}: argument '{arg}' has shape {shape}; expected [B, D] or [B, 1, D] "
                         f"with B={b}, D={d} from input of shape {tuple(input.shape)}")
    _checks.check_same_device(_OP, arg, value, input)


def _check_call(input, scale, shift, eps, one_plus_scale) -> float:
    """Validate a call; return eps as a float. The common case costs a few attribute reads;
    anything unusual goes through the detailed checks, which raise the descriptive error."""
    try:
        b, d = input.shape[0], input.shape[-1]
        fast = (isinstance(input, torch.Tensor) and input.dtype in _runtime.SUPPORTED_DTYPES and input.dim() >= 2
                and input.numel() > 0 and type(eps) is float and 0.0 <= eps < math.inf
                and type(one_plus_scale) is bool)
        for p in (scale, shift):
            # first and last dims right and B*D elements: every middle dim is 1
            fast = fast and (isinstance(p, torch.Tensor) and p.dim() >= 2 and p.shape[0] == b and p.shape[-1] == d
                             and p.numel() == b * d and (p.dtype is input.dtype or p.dtype is _F32)
                             and p.get_device() == input.get_device() and p.is_meta == input.is_meta)
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
        scale: ``[B, D]`` or ``[B, 1, D]``, float32 or ``input.dtype``; broadcast over the
            tokens of each sample.
        shift: like ``scale``.
        eps: added to the variance (DiT/PixArt/SD3/Flux use 1e-6).
        one_plus_scale: ``True`` computes DiT's ``modulate``: ``norm(x) * (1 + scale) + shift``;
            ``False`` computes ``norm(x) * scale + shift``.

    Returns:
        ``input``-shaped tensor in ``input.dtype``. Gradients flow to input, scale and shift
        (scale/shift gradients are accumulated in fp32 and returned in their dtype). With
        bf16/fp16 input the forward reads the gain ``1 + scale`` (summed in fp32) and shift
        rounded to ``input.dtype``, as PyTorch's eager formula in that dtype does.
    """
    eps = _check_call(input, scale, shift, eps, one_plus_scale)
    b, d = input.shape[0], input.shape[-1]
    flat = input.dim() == 3  # the common case needs no reshapes
    x = input if flat else input.reshape(b, -1, d)
    sc = scale if scale.dim() == 2 else scale.reshape(b, d)
    sh = shift if shift.dim() == 2 else shift.reshape(b, d)
    training = torch.is_grad_enabled() and (input.requires_grad or scale.requires_grad or shift.requires_grad)
    if not _dispatch.eager(input):
        y = ada_layer_norm_fwd(x, sc, sh, eps, one_plus_scale, training)[0]
    elif training:
        y = _AdaLayerNormFunction.apply(x, sc, sh, eps, one_plus_scale, training)
    else:
        y = _run_forward(x, sc, sh, eps, one_plus_scale, False)[0]
    return y if flat else y.view(input.shape)


# ---------------------------------------------------------------- warmup, check

def specs_for(batch: int, seq: int, cols: int, x_dtype: torch.dtype, scale_dtype: torch.dtype, device_index: int,
              phases: Iterable[str] = ("train", "bwd", "infer")) -> list[NormSpec]:
    """The specs :func:`ada_layer_norm` requests for a packed ``x: [batch, seq, cols]`` of
    ``x_dtype`` with scale/shift ``[batch, cols]`` of ``scale_dtype``, under the current
    settings (forward and backward strategy), when cuDNN accepts its first choice. Built by
    the op's own helpers on meta tensors; tests/test_warmup.py checks them against specs
    recorded from the op."""
    x2 = torch.empty((batch * seq, cols), dtype=x_dtype, device="meta")
    param = torch.empty((batch, cols), dtype=scale_dtype, device="meta")
    fwd_dtype = _forward_dtype(x2, param, param)
    specs = []
    for phase in phases:
        if phase == "bwd":
            strategy = _backward_strategy(batch, seq, cols, x_dtype)
            per_sample = strategy.startswith("per_sample") and _per_sample_fits(seq, cols, cols, x_dtype.itemsize)
            if per_sample:
                specs.append(_per_sample_bwd_spec(x2[:seq], device_index))
            elif strategy != "torch":
                specs.append(_dispatch.spec_for(_OP, "bwd", x2, scale_dtype, device_index, batch=batch))
            continue
        strategy = _forward_strategy(batch, seq, cols, x_dtype)
        per_sample = strategy.startswith("per_sample") and _per_sample_fits(seq, cols, cols, x_dtype.itemsize,
                                                                             fwd_dtype.itemsize)
        if per_sample:
            specs.append(_dispatch.spec_for("layer_norm", phase, x2[:seq], fwd_dtype, device_index))
        elif strategy != "torch":
            specs.append(_dispatch.spec_for(_OP, phase, x2, fwd_dtype, device_index, batch=batch))
    return specs


def check_cases(device: str, dtypes):
    """``cudnorm check`` cases (see ``cudnorm._check._cases`` for the tuple format):
    both conventions, fp32 and activation-dtype scale/shift, DiT-like shape."""
    b, s, d = 4, 250, 1152
    for dtype in dtypes:
        for wdtype in dict.fromkeys((_F32, dtype)):
            for dit in (True, False):
                g = torch.Generator(device="cpu").manual_seed(0)
                x = torch.randn((b, s, d), generator=g).to(device, dtype)
                scale = ((0.0 if dit else 1.0) + 0.1 * torch.randn((b, d), generator=g)).to(device, wdtype)
                shift = (0.1 * torch.randn((b, d), generator=g)).to(device, wdtype)
                tag = f"{str(dtype)[6:]} x, {str(wdtype)[6:]} scale, {'1+scale' if dit else 'scale'}"
                yield (f"{_OP} ({tag})", dtype,
                       lambda x, sc, sh, dit=dit: ada_layer_norm(x, sc, sh, 1e-6, one_plus_scale=dit),
                       lambda x, sc, sh, dit=dit: _eager_formula(x, sc, sh, 1e-6, dit),
                       lambda x, sc, sh, dit=dit: ref.ada_layer_norm(x, sc, sh, 1e-6, dit=dit),
                       (x, scale, shift), ("y", "dx", "dscale", "dshift"))


def _eager_formula(x, scale, shift, eps, dit):
    """PyTorch in ``x``'s dtype, as DiT code writes it (the baseline of the 2x error rule)."""
    scale, shift = scale.to(x.dtype)[:, None], shift.to(x.dtype)[:, None]
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * ((1 + scale) if dit else scale) + shift
