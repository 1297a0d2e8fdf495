"""``cudnorm bench --sweep``: LayerNorm and RMSNorm at every width and row count, cudnorm against
PyTorch (issue 46), and the prior the measuring dispatcher reads.

cuDNN's norm engines fall off cliffs at some widths (7-16x slower than PyTorch at 88, 96, 2240,
RMSNorm 1152 and 1408) that a benchmark of chosen shapes never meets; this sweep meets every
width a model may have. A cell is one op, direction, dtype pair, weight/bias choice, width and
row count; each provider runs it as a user calls it (autograd for training, fresh inputs each
call: several input sets rotate so no two consecutive calls share addresses, and together they
outgrow the L2 cache at small sizes).

Timing (:func:`time_calls`): each round enqueues a GPU sleep long enough to cover the host's
enqueueing, then the calls between two CUDA events, so the event time is the GPU's work even
where the host is slower than the kernels; a round the host outlasted the sleep of is timed
again behind a longer one, and rounds it outlasted even so are counted (``uncovered``).
``host_us`` is ``perf_counter`` around the enqueue loop. Both are medians over :data:`ROUNDS`
rounds. On a CPU both are ``perf_counter`` times.

Before timing, worker processes build the grid's cuDNN plans into the plan store and compile
cudnorm's Triton kernels into Triton's cache (:func:`_prepare_job`; builds are CPU-bound, 0.1-1.4 s
each); the main process then loads each in milliseconds. The dispatcher's own first-call
measurement stays in the main process, alone on the GPU.

Outputs under ``--out``: ``sweep.csv`` (:data:`COLUMNS`, one row per cell and provider),
``sweep_<op>_<direction>.png`` (cudnorm / PyTorch by width and element count) and ``summary.md``
(both drawn by :mod:`.sweep_report`), and, on a GPU, ``prior.json`` (``{"gpu", "cudnn", "torch",
"command", "cells": {signature key: {candidate: ms}}}``, the :mod:`cudnorm._candidates` closures
timed by their own :func:`~cudnorm._candidates.time_closures`; copy it to
``cudnorm/priors/<gpu slug>.json``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import _candidates, _entry, _norm_kernel, _settings, _sleep_timing
from .._progress import progress
from . import providers, report, runner

# Hidden sizes of published models (the norm widths a user patches). Most are multiples of 64 and
# already in the grid; they are listed so the grid keeps them whatever its rules become.
MODEL_WIDTHS = (
    768, 1024, 1280, 1600,  # GPT-2 small/medium/large/XL, BERT
    1152,  # DiT-XL/2, PixArt-alpha, Gemma-3 1B, SigLIP
    1408,  # ViT-g, EVA
    1536, 2048,  # SD3 medium, Qwen2.5 1.5B/3B
    2240,  # widths of the losing diffusers family in issue 46
    2304, 3584, 4608,  # Gemma-2 2B/9B/27B
    2560, 3840, 5376,  # Gemma-3 4B/12B/27B, Phi-2
    3072, 4096,  # Flux.1, Llama-3 8B, Mistral 7B, Phi-3
    5120, 6144, 8192,  # Qwen2.5 14B/32B, Mistral Nemo, Llama-3 70B
    12288, 16384,  # GPT-3 175B / Mistral Large, Llama-3.1 405B
)
NARROW = tuple(range(8, 257, 8))  # every multiple of 8 up to 256
WIDE = tuple(range(64, 8193, 64))  # every multiple of 64 up to 8192
WIDTHS = tuple(sorted(set(NARROW) | set(WIDE) | set(MODEL_WIDTHS)))
HEAD_WIDTHS = tuple(n for n in NARROW if n >= 64)  # per-head query/key norms: rows = batch x heads x tokens

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = {v: k for k, v in DTYPES.items()}
# provider -> what it runs; the order is the timing order (PyTorch again last: the noise floor)
# "copy": the bytes the cell's norm must move, moved by PyTorch's copy/add (the bandwidth bound)
PROVIDERS = ("torch", "cudnorm", "cudnn", "kernel", "liger", "quack", "copy", "torch-again")
COLUMNS = ("op", "direction", "dtype", "weight_dtype", "bias", "cols", "rows", "elements", "provider",
           "gpu_ms", "host_us", "uncovered", "ratio_vs_torch", "serves", "decision", "measure_ms", "error")
# columns added since the first sweeps: a sweep.csv written before them still reads (without them)
LATER_COLUMNS = ("uncovered",)
REQUIRED_COLUMNS = tuple(c for c in COLUMNS if c not in LATER_COLUMNS)
EPS = 1e-5
ROUNDS = 3
MAX_PASSES = 4  # passes over the input sets per round, for cells whose calls take microseconds
ROUND_MS = 1.0  # a round's target GPU time (more passes only while under it)
ROTATION_BYTES = 96 << 20  # the input sets together: about twice an H100's L2 cache
MAX_SETS = 16
PRIOR_BUDGET_MS = 20.0  # per signature, for the prior's candidates (the dispatcher's own: BUDGET_MS)
STORE_MB = 8192


@dataclass(frozen=True)
class Grid:
    """What a sweep covers: every combination of its fields, per-head widths at ``head_counts``."""

    ops: tuple[tuple[str, bool, bool], ...]  # (op, has weight, has bias)
    directions: tuple[str, ...]  # "train" = forward + backward, "infer" = forward without grad,
    # "fwd-train" = the forward of a training step, "bwd" = the backward alone
    dtypes: tuple[str, ...]
    weight_dtypes: tuple[str, ...]  # "x": the input's dtype, or "fp32"
    widths: tuple[int, ...]
    counts: tuple[int, ...]  # elements per cell: rows = count // width
    head_counts: tuple[int, ...]
    head_widths: tuple[int, ...] = HEAD_WIDTHS


# the named grids besides "default" and "full", each sized as the default (one device call): the
# norm variants it leaves out that models run most
VARIANTS = {
    # no weight and no bias: the LayerNorm inside every adaptive norm of diffusers' blocks (DiT,
    # PixArt, SD3, Flux: elementwise_affine=False, modulated after) and weightless RMSNorms
    "bare": (("layer_norm", False, False), ("rms_norm", False, False)),
    # fp32 weights on half-precision activations: a model kept in fp32 whose activations are cast
    "fp32-weights": (("layer_norm", True, True), ("rms_norm", True, False)),
}
# the axes the default grid holds fixed (its dtype, its weights' dtype, its element count), each
# on AXES_WIDTHS: ``--sweep axes``, about 640 cells (one device call: 7 minutes on an H200). Its
# first run found a failure no test had (a kernel launched first on a new thread, CUresult 201).
AXES_WIDTHS = (64, 72, 88, 96, 128, 160, 192, 256,  # per-head widths, with the narrow cliffs 88/96
               320, 384, 512, 640, 768, 896, 1024, 1152, 1280, 1408, 1536, 1920, 2048, 2240, 2304, 2560,
               3072, 3584, 3840, 4096, 4608, 5120, 6144, 8192, 12288, 16384)
_PLAIN = (("layer_norm", True, True), ("rms_norm", True, False))
AXES = {  # name: (ops, input dtype, weight dtype, element count, per-head count or None)
    "rows21": (_PLAIN, "bf16", "x", 1 << 21, None),
    "fp32-weights": (VARIANTS["fp32-weights"], "bf16", "fp32", 1 << 25, 1 << 26),
    "fp16": (_PLAIN, "fp16", "x", 1 << 25, 1 << 26),
    "fp32": (_PLAIN, "fp32", "x", 1 << 25, 1 << 26),
}
KINDS = ("default", "full", *VARIANTS, "axes")


def grid(kind: str = "default", dtype: str = "bf16") -> Grid:
    """``default`` (one device call): ``dtype`` with weights in it, LN weight+bias and RMS weight,
    training and inference, 2^25 elements plus per-head 2^26 (about 730 cells: at the 0.7 s a
    cell of a lent H100's run, builds included, about 8.5 minutes; 2^21 is a second call,
    ``--elements 21``); ``bare`` and ``fp32-weights`` (:data:`VARIANTS`): the same cells for
    LayerNorm and RMSNorm without weights, and with fp32 weights; ``full``: every dtype,
    weight dtype, weight/bias choice and direction, 2^17/2^21/2^25 plus per-head 2^26/2^27;
    ``quick``: a handful of small cells (seconds on a CPU)."""
    if kind in VARIANTS:
        weights = ("fp32",) if kind == "fp32-weights" else ("x",)
        return Grid(VARIANTS[kind], ("train", "infer"), (dtype,), weights, WIDTHS, (1 << 25,), (1 << 26,))
    if kind == "quick":
        return Grid((("layer_norm", True, True), ("rms_norm", True, False)), ("train", "infer"), ("bf16", "fp32"),
                    ("x",), (88, 128, 1152), (1 << 12,), ())
    if kind == "full":
        ops = (("layer_norm", True, True), ("layer_norm", True, False), ("layer_norm", False, False),
               ("rms_norm", True, False), ("rms_norm", False, False))
        return Grid(ops, ("train", "infer", "fwd-train", "bwd"), tuple(DTYPES), ("x", "fp32"), WIDTHS,
                    (1 << 17, 1 << 21, 1 << 25), (1 << 26, 1 << 27))
    return Grid((("layer_norm", True, True), ("rms_norm", True, False)), ("train", "infer"), (dtype,), ("x",),
                WIDTHS, (1 << 25,), (1 << 26,))


def grids(kind: str = "default", dtype: str = "bf16") -> tuple[Grid, ...]:
    """The grids a sweep of ``kind`` runs: :func:`grid`'s one, or for ``axes`` one per entry of
    :data:`AXES` (its own dtypes: ``dtype`` does not apply)."""
    if kind != "axes":
        return (grid(kind, dtype),)
    heads = tuple(n for n in AXES_WIDTHS if n in HEAD_WIDTHS)
    return tuple(Grid(ops, ("train", "infer"), (x,), (w,), AXES_WIDTHS, (count,), () if head is None else (head,), heads)
                 for ops, x, w, count, head in AXES.values())


def narrowed(g: Grid, widths: Iterable[int] | None = None, exponents: Iterable[int] | None = None) -> Grid:
    """``g`` with its widths replaced by ``widths`` (per-head widths: those of them in 64..256) and
    its element counts by ``2**e`` for ``e`` in ``exponents`` (a per-head count stays per-head)."""
    if widths is not None:
        widths = tuple(sorted(set(widths)))
        g = replace(g, widths=widths, head_widths=tuple(n for n in widths if n in HEAD_WIDTHS))
    if exponents is not None:
        counts = sorted({1 << e for e in exponents})
        g = replace(g, counts=tuple(c for c in counts if c not in g.head_counts),
                    head_counts=tuple(c for c in counts if c in g.head_counts))
    return g


@dataclass(frozen=True)
class Cell:
    op: str
    direction: str
    dtype: torch.dtype
    weight: torch.dtype | None
    bias: bool
    cols: int
    rows: int

    @property
    def training(self) -> bool:
        return self.direction != "infer"

    def label(self) -> dict:
        return {"op": self.op, "direction": self.direction, "dtype": NAMES[self.dtype],
                "weight_dtype": NAMES.get(self.weight, "none"), "bias": self.bias, "cols": self.cols,
                "rows": self.rows, "elements": self.rows * self.cols}


def cells(g: Grid) -> list[Cell]:
    """Every cell of ``g``, grouped by shape (so a shape's plans are loaded once, together)."""
    shapes = [(n, c // n) for c in g.counts for n in g.widths if c // n > 0]
    shapes += [(n, c // n) for c in g.head_counts for n in g.head_widths]
    out = []
    for (op, has_w, has_b), dtype_name, (cols, rows) in ((o, d, s) for o in g.ops for d in g.dtypes for s in shapes):
        dtype = DTYPES[dtype_name]
        weights = dict.fromkeys(dtype if w == "x" else DTYPES[w] for w in g.weight_dtypes) if has_w else (None,)
        for weight in weights:
            out += [Cell(op, d, dtype, weight, has_b, cols, rows) for d in g.directions]
    return out


# -- the providers -------------------------------------------------------------------------------

class Unsupported(Exception):
    """The provider does not compute this cell (recorded in its row; the sweep goes on)."""


@dataclass
class Sets:
    """One cell's rotating inputs: ``xs``/``dys`` ``[rows, cols]`` per set, parameters shared
    (a model's weights keep their address)."""

    xs: list[torch.Tensor]
    dys: list[torch.Tensor]
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    @property
    def params(self) -> tuple:
        return (self.weight, self.bias)


def make_sets(cell: Cell, device: str) -> Sets:
    per_set = cell.rows * cell.cols * torch.tensor([], dtype=cell.dtype).element_size() * (2 if cell.training else 1)
    # a CPU has no L2 to outgrow worth the time: the fewest sets that still rotate
    count = 3 if device == "cpu" else max(3, min(MAX_SETS, -(-ROTATION_BYTES // per_set)))
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(shape, dtype, grad):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_(grad)

    shape = (cell.rows, cell.cols)
    xs = [randn(shape, cell.dtype, cell.training) for _ in range(count)]
    dys = [randn(shape, cell.dtype, False) for _ in range(count)] if cell.training else []
    weight = randn(cell.cols, cell.weight, cell.training) if cell.weight is not None else None
    bias = randn(cell.cols, cell.weight, cell.training) if cell.bias and cell.weight is not None else None
    return Sets(xs, dys, weight, bias)


def _functional(cell: Cell, name: str) -> Callable:
    """``forward(x, weight, bias)`` of a provider that records an autograd graph."""
    import cudnorm  # noqa: PLC0415 - the package imports _bench lazily

    n = (cell.cols,)
    if name == "kernel":
        return _kernel_call(cell)
    if cell.op == "layer_norm":
        fn = _torch_layer_norm if name.startswith("torch") else cudnorm.layer_norm
        return lambda x, w, b: fn(x, n, w, b, EPS)
    fn = F.rms_norm if name.startswith("torch") else cudnorm.rms_norm
    return lambda x, w, b: fn(x, n, w, EPS)


def _torch_layer_norm(x, n, w, b, eps):
    """PyTorch's LayerNorm as a PyTorch user calls it. Its CUDA kernel refuses fp32 weights on
    half-precision input ("expected scalar type BFloat16 but found Float"), so there the weights
    are cast to the input's dtype first: the call such a user writes to make it run (its cast
    and the cast's backward timed with it)."""
    if x.is_cuda and any(p is not None and p.dtype != x.dtype for p in (w, b)):
        w, b = (None if p is None else p.to(x.dtype) for p in (w, b))
    return F.layer_norm(x, n, w, b, eps)


def _kernel_call(cell: Cell) -> Callable:
    """``forward(x, weight, bias)`` of cudnorm's kernel as a call the dispatcher gives it runs: on
    the native path the public function's C++ entry with the kernel forced (its launch and
    autograd node in C++), else its Python autograd function. Timed through the latter with the
    native path on, the kernel's column read a median 36-37 us of host time an inference call and
    500-530 us a training call, against cuDNN's 17-18 and 197-201 (H200, ``sweep_tune_alone``)."""
    rms = cell.op == "rms_norm"
    if torch.cuda.is_available() and (_entry.native or _entry.try_native(torch.empty(1, device="cuda"))):
        code, n = _entry.SERVERS["kernel"], [cell.cols]
        if rms:
            return lambda x, w, b: _entry.rms_norm(x, n, w, EPS, 0.0, code)
        return lambda x, w, b: _entry.layer_norm(x, n, w, b, EPS, code)
    return functools.partial(_kernel_forward, rms=rms)


def _kernel_forward(x, w, b, *, rms):
    return _norm_kernel.norm(x, w, b, EPS, rms)


def _leaves(x, sets: Sets) -> list[torch.Tensor]:
    return [t for t in (x, *sets.params) if t is not None]


def _directional(forward: Callable, cell: Cell, sets: Sets) -> list[Callable]:
    """One call per input set running ``cell.direction`` of ``forward``."""
    calls = []
    for x, dy in zip(sets.xs, sets.dys or sets.xs):
        leaves = _leaves(x, sets)
        if cell.direction in ("infer", "fwd-train"):
            calls.append(functools.partial(forward, x, *sets.params))
        elif cell.direction == "train":
            calls.append(functools.partial(_train_step, forward, x, sets.params, leaves, dy))
        else:
            y = forward(x, *sets.params)
            calls.append(functools.partial(torch.autograd.grad, y, leaves, dy, retain_graph=True))
    return calls


def _train_step(forward, x, params, leaves, dy):
    return torch.autograd.grad(forward(x, *params), leaves, dy)


def _peer_calls(name: str, cell: Cell, sets: Sets) -> list[Callable]:
    """Liger / QuACK through their setups in :mod:`.providers` (one per input set)."""
    if cell.weight is None or cell.bias != (cell.op == "layer_norm"):
        raise Unsupported("its setup takes LayerNorm with weight and bias, RMSNorm with weight")
    setup = providers.REGISTRY[name].setup
    family = "ln" if cell.op == "layer_norm" else "rms"
    params = tuple(p.detach() for p in sets.params if p is not None)
    calls = []
    for x, dy in zip(sets.xs, sets.dys or sets.xs):
        inp = providers.Inputs(family, x.detach(), params, dy, EPS)
        if cell.direction in ("infer", "fwd-train"):
            calls.append(setup(f"{family}_fwd", inp)[0])
        elif cell.direction == "bwd":
            calls.append(setup(f"{family}_bwd", inp)[0])
        else:
            calls.append(_chain(setup(f"{family}_fwd", inp)[0], setup(f"{family}_bwd", inp)[0]))
    return calls


def _copy_calls(cell: Cell, sets: Sets) -> list[Callable]:
    """The least traffic of the cell's direction, as device copies (one per input set): a
    forward reads ``x`` and writes ``y``; a backward reads ``x`` and ``dy`` and writes ``dx``
    (parameters and statistics are ``cols`` or ``rows`` values: left out)."""
    calls = []
    for x, dy in zip(sets.xs, sets.dys or sets.xs):
        x = x.detach()
        forward = functools.partial(torch.clone, x)
        backward = functools.partial(torch.add, x, dy)
        calls.append({"infer": forward, "fwd-train": forward, "bwd": backward}.get(cell.direction)
                     or _chain(forward, backward))
    return calls


def _chain(first: Callable, second: Callable) -> Callable:
    def run():
        first()
        return second()
    return run


def unavailable(name: str, device: str) -> str | None:
    """Why provider ``name`` cannot run on ``device`` at all, or ``None``."""
    if name in ("cudnn", "kernel") and device == "cpu":
        return "needs CUDA (cuDNN / Triton kernels); on the CPU cudnorm runs PyTorch's code"
    if name == "kernel" and not _norm_kernel.available():
        return "Triton is not importable"
    if name in ("liger", "quack"):
        return providers.REGISTRY[name].unavailable(device, requested=True)
    return None


def provider_calls(name: str, cell: Cell, sets: Sets) -> list[Callable]:
    if name in ("liger", "quack"):
        return _peer_calls(name, cell, sets)
    if name == "copy":
        return _copy_calls(cell, sets)
    if name == "kernel" and not _norm_kernel.supports(cell.cols, cell.dtype, cell.weight,
                                                      cell.weight if cell.bias else None):
        raise Unsupported(f"cudnorm's kernel serves widths up to {_norm_kernel.MAX_COLS}")
    return _directional(_functional(cell, name), cell, sets)


# -- timing --------------------------------------------------------------------------------------

def time_calls(calls: list[Callable], device: str) -> tuple[float, float, int]:
    """``(gpu ms, host us, uncovered)`` per call: medians over :data:`ROUNDS` rounds of passes
    over ``calls`` (one per input set) after two untimed passes (builds, compiles, decisions;
    then the host-time estimate that sizes each round's leading GPU sleep). On a GPU each round
    is a :func:`cudnorm._sleep_timing.timed_burst` (timed again where the host outlasted the
    sleep); ``uncovered``: rounds whose sleep the host outlasted even so, whose GPU time may
    include waits on the host (an H200's bare RMSNorm training cell read 0.51x so, host time
    3x its usual)."""
    cuda = device != "cpu"
    for fn in calls:
        fn()
    _sync(cuda)
    start = time.perf_counter()
    for fn in calls:
        fn()
    host_ms = (time.perf_counter() - start) * 1e3 / len(calls)
    _sync(cuda)
    wall_ms = (time.perf_counter() - start) * 1e3 / len(calls)
    passes = max(1, min(MAX_PASSES, int(ROUND_MS / max(wall_ms * len(calls), 1e-6))))
    order = calls * passes

    def burst():
        for fn in order:
            fn()

    gpu, host, uncovered = [], [], 0
    for _ in range(ROUNDS):
        if cuda:
            timed = _sleep_timing.timed_burst(burst, host_ms * len(order))
            gpu.append(timed.gpu_ms / len(order))
            host.append(timed.host_ms * 1e3 / len(order))
            uncovered += not timed.covered
        else:
            start = time.perf_counter()
            burst()
            gpu.append((time.perf_counter() - start) * 1e3 / len(order))
            host.append(gpu[-1] * 1e3)
    return statistics.median(gpu), statistics.median(host), uncovered


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _decision(cell: Cell, sets: Sets) -> dict:
    """The default policy's decision for the cell at its first call (a row of
    :func:`cudnorm.serving_decisions`; ``{}``: none, e.g. off CUDA or where the size rules hand
    the call to PyTorch's op)."""
    from .. import _decisions  # noqa: PLC0415

    x = sets.xs[0]
    if not x.is_cuda or cell.direction not in ("train", "infer"):
        return {}
    key = cell_signature(cell, sets).key()
    return next((d for d in _decisions.decisions() if d["signature"] == key), {})


def run_cell(cell: Cell, names: list[str], device: str, prior: dict | None) -> list[dict]:
    """One row per provider of ``names``; ``prior`` (on a GPU) gets the cell's candidate times."""
    base = cell.label()
    try:
        sets = make_sets(cell, device)
    except Exception as exc:  # noqa: BLE001 - e.g. OOM: every row says so
        runner.free(device, collect=True)
        return [{**base, "provider": n, "error": f"{runner.describe(exc)} (inputs)"} for n in names]
    rows, decision = [], {}
    for name in names:
        row = {**base, "provider": name, "error": ""}
        try:
            with _settings.config(policy="cudnn") if name == "cudnn" else contextlib.nullcontext(), \
                    torch.set_grad_enabled(cell.training):
                calls = provider_calls(name, cell, sets)
                row["gpu_ms"], row["host_us"], row["uncovered"] = time_calls(calls, device)
                if name == "cudnorm":
                    decision = _decision(cell, sets)
                    row["serves"] = decision.get("serves", "")
                    # how it was decided, for a cell whose decision the sweep's own timings contradict
                    row["decision"] = " ".join([decision.get("source", "")] + [
                        f"{n}={ms:.4g}ms(+-{decision.get('spread', {}).get(n, 0):.0%})" + _rounds(decision, n)
                        for n, ms in sorted(decision.get("ms", {}).items())])
                    cost = decision.get("cost_ms", {})
                    # the timed runs, with the paired rounds that settle a close lead
                    row["measure_ms"] = cost["timing"] + cost.get("settle", 0.0) if "timing" in cost else ""
                    if cost:
                        row["decision"] += f" prepare={cost.get('prepare', 0):g}ms first={cost.get('first', 0):g}ms"
        except Unsupported as exc:
            row["error"] = f"unsupported: {exc}"
        except Exception as exc:  # noqa: BLE001 - recorded in the row; the sweep goes on
            row["error"] = runner.describe(exc)
            runner.free(device, collect=True)
        calls = None
        rows.append(row)
    if prior is not None and cell.direction in ("train", "infer"):
        if decision.get("source") == "measured" and decision.get("ms"):
            # the dispatcher timed this signature's candidates moments ago, as the prior would
            prior[cell_signature(cell, sets).key()] = dict(decision["ms"])
        else:
            _time_prior(cell, sets, prior)
    torch_ms = next((r.get("gpu_ms") for r in rows if r["provider"] == "torch"), None)
    for row in rows:
        if torch_ms and row.get("gpu_ms"):
            row["ratio_vs_torch"] = torch_ms / row["gpu_ms"]
    return rows


def _rounds(decision: dict, name: str) -> str:
    """``"x9"`` where a candidate was timed in more than the usual rounds (a lead settled in
    paired rounds, :func:`cudnorm._candidates.settle`), else ``""``."""
    rounds = decision.get("rounds", {}).get(name, 0)
    return f"x{rounds}" if rounds > _candidates.ROUNDS else ""


def cell_signature(cell: Cell, sets: Sets) -> _candidates.Signature:
    """The dispatcher's signature of the cell's calls (the prior's key: what it looks up)."""
    return _candidates.signature(cell.op, cell.training, sets.xs[0], sets.weight, sets.bias, cell.cols)


def _time_prior(cell: Cell, sets: Sets, prior: dict) -> None:
    """The :mod:`cudnorm._candidates` closures of the cell's signature, timed as the dispatcher
    times them, into ``prior[signature key]``."""
    x = sets.xs[0].detach()
    weight = None if sets.weight is None else sets.weight.detach()
    bias = None if sets.bias is None else sets.bias.detach()
    sig = cell_signature(cell, sets)
    with torch.no_grad():
        closures = {}
        dy = _candidates.gradient(x) if sig.training else None
        for name in _candidates.candidates_for(sig):
            with contextlib.suppress(Exception):  # a candidate that cannot prepare is no candidate
                closures[name] = _candidates.CANDIDATES[name].prepare(sig, x, weight, bias, EPS, dy)
        timings = _candidates.time_closures(closures, budget_ms=PRIOR_BUDGET_MS, device=x.device)
    if timings:
        prior[sig.key()] = {name: round(t.ms, 5) for name, t in timings.items()}


# -- building ahead, in worker processes ---------------------------------------------------------

def _prepare_job(job: tuple) -> str:
    """Build one shape's cuDNN plans into the plan store and compile cudnorm's kernel for it
    (run in a worker process; ``""`` or what failed)."""
    import cudnorm  # noqa: PLC0415
    from ..warmup import norm_specs  # noqa: PLC0415 - cudnorm.warmup is the function, not the module

    op, dtype_name, weight_name, bias, cols, rows, directions = job
    dtype, weight_dtype = DTYPES[dtype_name], DTYPES.get(weight_name)
    phases = (("train", "bwd") if any(d != "infer" for d in directions) else ()) + (
        ("infer",) if "infer" in directions else ())
    try:
        cudnorm.warmup(norm_specs(op, rows, cols, x_dtype=dtype, weight_dtype=weight_dtype, device_index=0,
                                         phases=phases), progress=False)
        x = torch.randn((rows, cols), dtype=dtype, device="cuda")
        w = None if weight_dtype is None else torch.ones(cols, dtype=weight_dtype, device="cuda")
        b = w if bias else None
        for training in {d != "infer" for d in directions}:
            sig = _candidates.signature(op, training, x, w, b, cols)
            if _candidates.CANDIDATES["kernel"].supports(sig):
                _candidates.CANDIDATES["kernel"].prepare(sig, x, w, b, EPS)()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the main process builds what is missing
        return f"{op} {cols}x{rows}: {runner.describe(exc)}"
    return ""


def store_config(store: Path | str) -> dict:
    """The plan store the sweep builds into and loads from: large enough for the whole grid's
    plans (thousands; the default 512 MB would evict the first before they are timed)."""
    return {"plan_store_dir": str(store), "plan_store_max_mb": max(STORE_MB, _settings.current.plan_store_max_mb)}


def _worker_init(store: str) -> None:
    import cudnorm  # noqa: PLC0415

    # policy "cudnn": warmup() makes no measured decisions here (timed beside other workers they
    # would be noise, and the store keeps the first one written)
    cudnorm.config(**store_config(store), policy="cudnn")


def prepare(all_cells: list[Cell], store: Path, jobs: int) -> list[str]:
    """Build every shape's plans and kernels in ``jobs`` processes; returns what failed."""
    shapes: dict[tuple, set] = defaultdict(set)
    for c in all_cells:
        shapes[(c.op, NAMES[c.dtype], NAMES.get(c.weight), c.bias, c.cols, c.rows)].add(c.direction)
    work = [(*key, tuple(sorted(d))) for key, d in shapes.items()]
    context = multiprocessing.get_context("spawn")
    with context.Pool(jobs, initializer=_worker_init, initargs=(str(store),)) as pool:
        done = progress(pool.imap_unordered(_prepare_job, work), len(work), f"sweep: building plans ({jobs} jobs)")
        return [failed for failed in done if failed]


def default_jobs() -> int:
    return min(12, os.cpu_count() or 1)


# -- the run -------------------------------------------------------------------------------------

def run(all_cells: list[Cell], names: list[str], device: str, out: Path, command: str, *,
        write_every: int = 50) -> tuple[list[dict], dict | None]:
    """Time every cell; ``(rows, prior cells or None on a CPU)``. ``sweep.csv`` and (on a GPU)
    ``prior.json`` are kept current, so a run cut short by its time limit leaves both."""
    prior = {} if device != "cpu" else None
    rows: list[dict] = []

    def write():
        report.write_csv(rows, out / "sweep.csv", COLUMNS)
        if prior is not None:
            (out / "prior.json").write_text(json.dumps(prior_document(prior, command), indent=1) + "\n")

    for i, cell in enumerate(progress(all_cells, len(all_cells), "cudnorm sweep"), 1):
        rows += run_cell(cell, names, device, prior)
        if i % write_every == 0:
            write()
    write()
    return rows, prior


def prior_document(prior: dict, command: str) -> dict:
    return {"gpu": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version(),
            "torch": torch.__version__, "command": command, "candidates_revision": _candidates.REVISION,
            "cells": prior}
