"""AdaLN's strategies on cuDNN: what each builds, how it runs, and the rules that pick one.

A strategy runs adaptive LayerNorm on ``x2: [B*S, D]`` (a call's ``[B, S, D]`` rows) with
per-sample ``scale``/``shift`` ``[B, D]``, by launching plain cuDNN graphs on the call's own
tensors, so its cost is the same whether a training loop hands it new tensors each step or
the same ones. (Strategies that captured the launches into CUDA graphs replayed while tensor
addresses repeat were removed: with fresh tensors every capture was paid again, and a DiT
training step got slower than PyTorch's own norms.)

Forwards (``y`` and, training, fp32 mean/rstd ``[2, ceil4(B*S)]``):

* ``cudnn`` (:class:`CudnnForward`): cuDNN's adalayernorm forward graph, one launch.
* ``per_sample`` (:class:`PerSampleForward`): the plain LayerNorm forward graph launched
  once per sample with weight ``gain[b]`` and bias ``shift[b]``.

Backwards (``dx``, ``dscale``, ``dshift``):

* ``fused`` (:class:`FusedBackward`): one Triton kernel over all ``B*S`` rows and one sum
  (:mod:`cudnorm._ada_kernel`): the same launches for any batch.
* ``per_sample`` (:class:`PerSampleBackward`): the plain LayerNorm backward graph launched
  once per sample with weight ``gain[b]``; its dW/dB are that sample's dscale/dshift.
* ``cudnn`` (:class:`CudnnBackward`): cuDNN's adalayernorm backward graph, one launch (slow
  in 9.19 for more than a few samples: 3.5 ms at 32x256x1152 against 0.16 ms per sample).

Each class has ``spec`` (the graph that serves the call, or ``None`` where it cannot: an
unaligned layout) and ``run`` (the launches). :data:`FORWARD_RULES` and
:data:`BACKWARD_RULES` pick one per shape; ``cudnorm.config(ada_forward=..., ada_backward=...)``
forces one (``"torch"``: the PyTorch path of :mod:`cudnorm.ada_layer_norm`). A strategy
that cannot serve a call (an unaligned layout, a declined graph) hands it to the next in
:data:`FORWARD_ORDER` / :data:`BACKWARD_ORDER`, so forcing one changes speed, never the
function computed. :func:`specs_for` gives warmup the specs the rules lead to.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import _ada_kernel, _cache, _dispatch, _runtime, _settings
from ._graphs import eps_scalar
from ._spec import NormSpec

_OP = "ada_layer_norm"
_F32 = torch.float32
FORWARD_STRATEGIES = ("cudnn", "per_sample", "torch")
STRATEGIES = ("fused", "cudnn", "per_sample", "torch")  # backward

# (rule(b, s, d, dtype), strategy) rows, first match wins (docs/performance.md, Decisions).
# Forward: cuDNN's AdaLN forward graph is one launch at 7.8-76 us where the eager formula takes
# 12-292 us (lent H100, bf16, fresh tensors). Backward: the fused kernel is two or three
# launches at any batch and the least GPU time from 8 samples on (32 x 256 x 1152: 39 us
# against 170 for the per-sample launches and 103 for the eager formula; at 2 samples the
# per-sample launches are within 4%); cuDNN's AdaLN backward graph collapses beyond a few
# samples (3.5 ms at 32 x 256 x 1152). One sample is one plain LayerNorm backward launch.
FORWARD_RULES = ((lambda b, s, d, dtype: True, "cudnn"),)
BACKWARD_RULES = (
    (lambda b, s, d, dtype: b == 1, "per_sample"),  # one LayerNorm backward launch
    (lambda b, s, d, dtype: True, "fused"),  # one kernel and one sum, whatever the batch
)
FORWARD_ORDER = {"cudnn": ("cudnn", "per_sample"), "per_sample": ("per_sample", "cudnn"), "torch": ()}
# where Triton is missing (or the row too wide) ``fused`` hands over to the per-sample
# launches, which never collapse as cuDNN's AdaLN backward graph does beyond a few samples
BACKWARD_ORDER = {"fused": ("fused", "per_sample", "cudnn"), "cudnn": ("cudnn", "per_sample"),
                  "per_sample": ("per_sample", "cudnn"), "torch": ()}


def choose_forward(b: int, s: int, d: int, dtype: torch.dtype) -> str:
    """The forward strategy for ``x: [b, s, d]`` of ``dtype`` (first matching rule)."""
    return next(name for rule, name in FORWARD_RULES if rule(b, s, d, dtype))


def choose_backward(b: int, s: int, d: int, dtype: torch.dtype) -> str:
    """The backward strategy for ``x: [b, s, d]`` of ``dtype`` (first matching rule)."""
    return next(name for rule, name in BACKWARD_RULES if rule(b, s, d, dtype))


def forward_strategy(b: int, s: int, d: int, dtype: torch.dtype) -> str:
    """The forward strategy a call takes: the configured one, or the rules' under ``"auto"``."""
    forced = _settings.current.ada_forward
    return choose_forward(b, s, d, dtype) if forced == "auto" else forced


def backward_strategy(b: int, s: int, d: int, dtype: torch.dtype) -> str:
    """The backward strategy a call takes: the configured one, or the rules' under ``"auto"``."""
    forced = _settings.current.ada_backward
    return choose_backward(b, s, d, dtype) if forced == "auto" else forced


# ---------------------------------------------------------------- shared helpers

def forward_dtype(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.dtype:
    """The dtype the forward reads gain and shift in: ``_dispatch.forward_params``' rule for
    a pair (fp32 only when either is fp32 and ``Config.fp32_weight_fwd`` is ``"native"``)."""
    return _dispatch.forward_param_dtype(x, scale if scale.dtype is _F32 else shift)


def make_gain(scale: torch.Tensor, dit: bool, dtype: torch.dtype) -> torch.Tensor:
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


def modulation(scale: torch.Tensor, shift: torch.Tensor, dit: bool, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gain, shift)`` as the forward graph reads them (:func:`make_gain`, :func:`_shift`).

    DiT passes scale and shift as chunks of one Linear output: neither is packed, so the
    forward needs ``1 + scale`` and a packed copy of shift. One ``_foreach_add`` makes both
    (adding 0 to shift copies it exactly): one op call instead of two, 17-18 us of host time
    each on a lent H100 host."""
    if dit and scale.dtype is dtype and shift.dtype is dtype and not _dispatch.is_packed(shift):
        gain, packed = torch._foreach_add([scale, shift], [1.0, 0.0])
        return _dispatch.packed(gain), _dispatch.packed(packed)
    return make_gain(scale, dit, dtype), _shift(shift, dtype)


def per_sample_fits(s: int, row_stride: int, d: int, x_itemsize: int, param_itemsize: int = 0) -> bool:
    """Whether each sample's block of ``x`` (rows ``row_stride`` apart), of the packed
    ``y``/``dy``/``dx`` and (``param_itemsize``) each ``[B, D]`` parameter row starts 16-byte
    aligned, as the per-sample LayerNorm graphs' descriptors require. (A sample's fp32
    statistics are aligned too when ``S % 4 == 0``; the backward pads them otherwise.)"""
    return not ((s * row_stride * x_itemsize) % 16 or (s * d * x_itemsize) % 16 or (d * param_itemsize) % 16)


def _forward_outputs(x2, b, training):
    """Fresh ``y [B, S, D]`` and, when training, the ``[2, ceil4(B*S)]`` statistics."""
    rows, d = x2.shape
    y = torch.empty((b, rows // b, d), dtype=x2.dtype, device=x2.device)
    return y, _dispatch.stats_buffer(rows, 2, x2.device) if training else None


def _backward_outputs(x2, b, scale_dtype):
    """Fresh ``dx [B*S, D]`` and ``dscale``/``dshift`` ``[B, D]`` of the scale's dtype (what the
    graphs write; the caller casts dshift when the shift's dtype differs)."""
    device = x2.device
    d = x2.shape[1]
    return (torch.empty(x2.shape, dtype=x2.dtype, device=device), torch.empty((b, d), dtype=scale_dtype, device=device),
            torch.empty((b, d), dtype=scale_dtype, device=device))


# ---------------------------------------------------------------- strategies
#
# A strategy is a class read as: what it builds (``spec``: the graph that serves the call, or
# None where it cannot: an unaligned layout), how it runs (``run``: the launches on the
# call's own tensors). The rules above say when each is picked; a strategy that cannot serve
# hands the call to the next in its order (FORWARD_ORDER, BACKWARD_ORDER).


class KernelSpec(tuple):
    """What a strategy that runs cudnorm's own kernel (no cuDNN graph) serves a call with:
    :func:`plan_for` hands it back as the "plan" (there is nothing to build or warm up)."""


def plan_for(spec):
    """The plan of ``spec`` (``None`` when there is no spec or cuDNN declines it); a
    :class:`KernelSpec` is its own plan."""
    if spec is None or isinstance(spec, KernelSpec):
        return spec
    return _cache.get_plan(spec)


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
        gain, shift = modulation(scale, shift, dit, dtype)
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
        if not per_sample_fits(s, x2.stride(0), d, x2.element_size(), dtype.itemsize) or s % 4:
            return None
        return _dispatch.spec_for("layer_norm", "train" if training else "infer", x2[:s], dtype, device_index)

    @staticmethod
    def run(plan, x2, b, scale, shift, dit, dtype, eps, training):
        """``(y [B, S, D], stats or None)``."""
        gain, shift = modulation(scale, shift, dit, dtype)
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


FORWARDS = {strategy.name: strategy for strategy in (CudnnForward, PerSampleForward)}


class CudnnBackward:
    """``cudnn``: cuDNN's adalayernorm backward graph, one launch reading the gain (and writing
    dscale/dshift) in the scale's own dtype. Only when forced, or where the per-sample
    launches cannot serve: beyond a few samples it collapses (3.5 ms at 32 x 256 x 1152)."""

    name = "cudnn"

    @staticmethod
    def spec(x2, b, scale_dtype, device_index):
        return _dispatch.spec_for(_OP, "bwd", x2, scale_dtype, device_index, batch=b)

    @staticmethod
    def run(plan, dy2, x2, b, scale, stats, dit, shift_dtype):
        """``(dx [B*S, D], dscale [B, D], dshift [B, D])``."""
        gain = make_gain(scale, dit, scale.dtype)
        dx, dscale, dshift = _backward_outputs(x2, b, scale.dtype)
        mean = stats.data_ptr()
        plan.launch([x2.data_ptr(), gain.data_ptr(), mean, mean + 4 * stats.shape[1], dy2.data_ptr(), dx.data_ptr(),
                     dscale.data_ptr(), dshift.data_ptr()])
        return dx, dscale, dshift if shift_dtype is scale.dtype else dshift.to(shift_dtype)


class PerSampleBackward:
    """``per_sample``: the plain LayerNorm backward graph of one sample, launched ``B`` times
    with weight ``gain[b]``; its dW/dB are dscale[b]/dshift[b], written straight into the
    outputs' rows. The rules pick it for one sample (one launch); where ``fused`` cannot serve
    (no Triton), for every batch."""

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
        if not per_sample_fits(s, x2.stride(0), d, x2.element_size(), scale_dtype.itemsize):
            return None
        spec = _dispatch.spec_for("layer_norm", "bwd", x2[:s], scale_dtype, device_index)
        if not spec.autotune and _settings.current.autotune == "auto" \
                and spec.rows * spec.cols >= _dispatch.AUTOTUNE_MIN_ELEMENTS:
            spec = spec._replace(autotune=True)
        return spec

    @staticmethod
    def run(plan, dy2, x2, b, scale, stats, dit, shift_dtype):
        """``(dx [B*S, D], dscale [B, D], dshift [B, D])``."""
        gain = make_gain(scale, dit, scale.dtype)
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


class FusedBackward:
    """``fused``: one Triton kernel over all ``B*S`` rows writes dx and each program's partial
    sums of ``dy * xhat`` and ``dy``, one sum over them gives dscale/dshift
    (:mod:`cudnorm._ada_kernel`): the same launches for 2 samples or 128. The rules pick it
    from 2 samples on; without Triton it hands over to ``per_sample``."""

    name = "fused"

    @staticmethod
    def spec(x2, b, scale_dtype, device_index):
        return KernelSpec((_OP, "bwd", "fused")) if _ada_kernel.available(x2, scale_dtype) else None

    @staticmethod
    def run(plan, dy2, x2, b, scale, stats, dit, shift_dtype):
        """``(dx [B*S, D], dscale [B, D], dshift [B, D])``: dscale in the scale's dtype, dshift
        in ``shift_dtype``, each rounded once from fp32 sums."""
        if scale.stride(-1) != 1:
            scale = scale.contiguous()
        dx, sums = _ada_kernel.backward(dy2, x2, b, scale, stats, dit)
        if scale.dtype is shift_dtype:
            sums = sums if shift_dtype is _F32 else sums.to(shift_dtype)  # one cast for both
            return dx, sums[0], sums[1]
        return dx, sums[0].to(scale.dtype), sums[1].to(shift_dtype)


BACKWARDS = {strategy.name: strategy for strategy in (FusedBackward, PerSampleBackward, CudnnBackward)}


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
    fwd_dtype = forward_dtype(x2, param, param)
    specs = []
    for phase in phases:
        if phase == "bwd":
            found = (BACKWARDS[name].spec(x2, batch, scale_dtype, device_index)
                     for name in BACKWARD_ORDER[backward_strategy(batch, seq, cols, x_dtype)])
        else:
            found = (FORWARDS[name].spec(x2, batch, fwd_dtype, phase == "train", device_index)
                     for name in FORWARD_ORDER[forward_strategy(batch, seq, cols, x_dtype)])
        spec = next((spec for spec in found if spec is not None), None)
        if isinstance(spec, NormSpec):  # a KernelSpec has no cuDNN graph to warm up
            specs.append(spec)
    return specs
