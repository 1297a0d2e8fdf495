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
where the host is slower than the kernels; ``host_us`` is ``perf_counter`` around the enqueue
loop. Both are medians over :data:`ROUNDS` rounds. On a CPU both are ``perf_counter`` times.

Before timing, worker processes build the grid's cuDNN plans into the plan store and compile
cudnorm's Triton kernels into Triton's cache (:func:`_prepare_job`; builds are CPU-bound, 0.1-1.4 s
each); the main process then loads each in milliseconds. The dispatcher's own first-call
measurement stays in the main process, alone on the GPU.

Outputs under ``--out``: ``sweep.csv`` (:data:`COLUMNS`, one row per cell and provider),
``sweep_<op>_<direction>.png`` (cudnorm / PyTorch by width and element count), ``summary.md``
and, on a GPU, ``prior.json`` (``{"gpu", "cudnn", "torch", "command", "cells": {signature key:
{candidate: ms}}}``, the :mod:`cudnorm._candidates` closures timed by their own
:func:`~cudnorm._candidates.time_closures`; copy it to ``cudnorm/priors/<gpu slug>.json``).
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import math
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

from .. import _candidates, _norm_kernel, _settings
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
           "gpu_ms", "host_us", "ratio_vs_torch", "serves", "decision", "measure_ms", "error")
EPS = 1e-5
ROUNDS = 3
MAX_PASSES = 4  # passes over the input sets per round, for cells whose calls take microseconds
ROUND_MS = 1.0  # a round's target GPU time (more passes only while under it)
ROTATION_BYTES = 96 << 20  # the input sets together: about twice an H100's L2 cache
MAX_SETS = 16
PRIOR_BUDGET_MS = 20.0  # per signature, for the prior's candidates (the dispatcher's own: BUDGET_MS)
STORE_MB = 8192
SLEEP_CYCLES_PER_MS = 2.0e6  # ~ the GPU clock; sleeping longer only costs GPU time


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


def grid(kind: str = "default", dtype: str = "bf16") -> Grid:
    """``default`` (one device call): ``dtype`` with weights in it, LN weight+bias and RMS weight,
    training and inference, 2^25 elements plus per-head 2^26 (about 730 cells: at the 0.7 s a
    cell of a lent H100's run, builds included, about 8.5 minutes; 2^21 is a second call,
    ``--elements 21``); ``full``: every dtype,
    weight dtype, weight/bias choice and direction, 2^17/2^21/2^25 plus per-head 2^26/2^27;
    ``quick``: a handful of small cells (seconds on a CPU)."""
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
        return functools.partial(_kernel_forward, rms=cell.op == "rms_norm")
    if cell.op == "layer_norm":
        fn = F.layer_norm if name.startswith("torch") else cudnorm.layer_norm
        return lambda x, w, b: fn(x, n, w, b, EPS)
    fn = F.rms_norm if name.startswith("torch") else cudnorm.rms_norm
    return lambda x, w, b: fn(x, n, w, EPS)


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

def time_calls(calls: list[Callable], device: str) -> tuple[float, float]:
    """``(gpu ms, host us)`` per call: medians over :data:`ROUNDS` rounds of passes over
    ``calls`` (one per input set) after two untimed passes (builds, compiles, decisions; then
    the host-time estimate that sizes each round's leading GPU sleep)."""
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
    gpu, host = [], []
    for _ in range(ROUNDS):
        if cuda:
            torch.cuda._sleep(int(SLEEP_CYCLES_PER_MS * (1.5 * host_ms * len(order) + 0.05)))
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        for fn in order:
            fn()
        enqueued = time.perf_counter() - start
        if cuda:
            end.record()
            end.synchronize()
            gpu.append(begin.elapsed_time(end) / len(order))
        else:
            gpu.append(enqueued * 1e3 / len(order))
        host.append(enqueued * 1e6 / len(order))
    return statistics.median(gpu), statistics.median(host)


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
                row["gpu_ms"], row["host_us"] = time_calls(calls, device)
                if name == "cudnorm":
                    decision = _decision(cell, sets)
                    row["serves"] = decision.get("serves", "")
                    # how it was decided, for a cell whose decision the sweep's own timings contradict
                    row["decision"] = " ".join(
                        [decision.get("source", "")] + [f"{n}={ms:.4g}ms(+-{decision.get('spread', {}).get(n, 0):.0%})"
                                                        for n, ms in sorted(decision.get("ms", {}).items())])
                    cost = decision.get("cost_ms", {})
                    row["measure_ms"] = cost.get("timing", "")
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
        for name in _candidates.candidates_for(sig):
            with contextlib.suppress(Exception):  # a candidate that cannot prepare is no candidate
                closures[name] = _candidates.CANDIDATES[name].prepare(sig, x, weight, bias, EPS)
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


# -- reading the results -------------------------------------------------------------------------

_INTS = ("cols", "rows", "elements")
_FLOATS = ("gpu_ms", "host_us", "ratio_vs_torch", "measure_ms")


def read_csv(path: Path) -> list[dict]:
    """Rows of a ``sweep.csv``, numbers as numbers, blanks as ``None``."""
    with open(path, newline="") as f:
        return [{k: (None if v == "" and k in _INTS + _FLOATS else int(v) if k in _INTS
                     else float(v) if k in _FLOATS else v) for k, v in row.items()} for row in csv.DictReader(f)]


def _case(r: dict) -> str:
    return f"{r['op']} {r['direction']} {r['dtype']}/w={r['weight_dtype']}/b={r['bias']}"


def exponent(r: dict) -> int:
    """The power of two ``e`` a cell was sized from: its rows are ``2^e // cols``, so a width that
    does not divide ``2^e`` (72, 192, 1152, ...) leaves fewer elements than ``2^e``, yet more than
    ``2^(e-1)`` (one row at least): ``e`` is the element count's log2 rounded up."""
    return (int(r["elements"]) - 1).bit_length()


def _ratios(rows: list[dict], provider: str = "cudnorm") -> list[dict]:
    return [r for r in rows if r["provider"] == provider and r.get("ratio_vs_torch")]


def worst_table(rows: list[dict], count: int = 20) -> list[list[str]]:
    """The ``count`` cells where cudnorm's ratio to PyTorch is lowest, with every provider's ratio."""
    by_cell = defaultdict(dict)
    for r in rows:
        by_cell[(_case(r), r["cols"], r["rows"])][r["provider"]] = r
    others = [p for p in PROVIDERS if p not in ("torch", "cudnorm") and any(r["provider"] == p for r in rows)]
    worst = sorted(_ratios(rows), key=lambda r: r["ratio_vs_torch"])[:count]
    lines = [["cell", "N", "rows", "torch ms", "cudnorm ms", "cudnorm", "serves", *others]]
    for r in worst:
        got = by_cell[(_case(r), r["cols"], r["rows"])]
        ratio = {p: got[p].get("ratio_vs_torch") for p in others if p in got}
        lines.append([_case(r), str(r["cols"]), str(r["rows"]), f"{got['torch']['gpu_ms']:.4f}",
                      f"{r['gpu_ms']:.4f}", f"{r['ratio_vs_torch']:.2f}x", r.get("serves") or "",
                      *(f"{ratio[p]:.2f}x" if ratio.get(p) else "-" for p in others)])
    return lines


def medians(rows: list[dict]) -> list[list[str]]:
    """cudnorm's median ratio for widths >= 512 at >= 2^21 elements, per op/direction and overall
    (issue 46's target: >= 1.15x), beside PyTorch again's."""
    lines = [["cells (N >= 512, >= 2^21 elements)", "count", "cudnorm median", "torch-again median"]]

    def kept(provider):
        return [r for r in _ratios(rows, provider) if r["cols"] >= 512 and exponent(r) >= 21]

    groups = defaultdict(lambda: defaultdict(list))
    for provider in ("cudnorm", "torch-again"):
        for r in kept(provider):
            groups[_case(r)][provider].append(r["ratio_vs_torch"])
            groups["all"][provider].append(r["ratio_vs_torch"])
    for case, got in groups.items():
        lines.append([case, str(len(got["cudnorm"])), *(f"{statistics.median(got[p]):.3f}x" if got[p] else "-"
                                                         for p in ("cudnorm", "torch-again"))])
    return lines


def worst_per_provider(rows: list[dict]) -> list[list[str]]:
    lines = [["provider", "worst cell", "N", "rows", "ratio", "failed cells"]]
    for provider in dict.fromkeys(r["provider"] for r in rows):
        mine = [r for r in rows if r["provider"] == provider]
        failed = sum(1 for r in mine if r.get("error") and not r["error"].startswith("unsupported"))
        timed = [r for r in mine if r.get("ratio_vs_torch")]
        if not timed:
            lines.append([provider, "-", "", "", "", str(failed)])
            continue
        r = min(timed, key=lambda r: r["ratio_vs_torch"])
        lines.append([provider, _case(r), str(r["cols"]), str(r["rows"]), f"{r['ratio_vs_torch']:.2f}x", str(failed)])
    return lines


def copy_fractions(rows: list[dict], providers_: Iterable[str] = ("cudnorm", "kernel", "torch")) -> list[list[str]]:
    """Per op/direction, at widths 64-256 and >= 2^25 elements: each provider's bandwidth as a
    fraction of the copy's (copy ms / provider ms: issue 46's target >= 80%), median and worst."""
    by_cell = defaultdict(dict)
    for r in rows:
        if 64 <= r["cols"] <= 256 and exponent(r) >= 25 and r.get("gpu_ms"):
            by_cell[(_case(r), r["cols"], r["rows"])][r["provider"]] = r["gpu_ms"]
    providers_ = [p for p in providers_ if any(p in got for got in by_cell.values())]
    lines = [["cells (N 64-256, >= 2^25 elements)", "count", *(f"{p} median / worst" for p in providers_)]]
    groups = defaultdict(lambda: defaultdict(list))
    for (case, _, _), got in by_cell.items():
        for p in providers_:
            if "copy" in got and p in got:
                groups[case][p].append(got["copy"] / got[p])
    for case, got in sorted(groups.items()):
        lines.append([case, str(max(map(len, got.values())))] + [
            f"{statistics.median(got[p]):.0%} / {min(got[p]):.0%}" if got[p] else "-" for p in providers_])
    return lines


def measure_costs(rows: list[dict]) -> list[list[str]]:
    """The dispatcher's first-call measurement of each signature the sweep met: wall ms of its
    timing runs (issue 46's target: <= 50 ms), median, 90th percentile and worst. (Building and
    first-running each candidate, ``prepare=``/``first=`` in the ``decision`` column, is left
    out: a first call pays that for the kernel that serves it, measured or not.)"""
    costs = sorted(r["measure_ms"] for r in rows if r["provider"] == "cudnorm" and r.get("measure_ms"))
    if not costs:
        return [["measured signatures"]]
    return [["measured signatures", "median ms", "p90 ms", "worst ms"],
            [str(len(costs)), f"{statistics.median(costs):.1f}", f"{costs[int(0.9 * (len(costs) - 1))]:.1f}",
             f"{costs[-1]:.1f}"]]


# the heatmaps' colour scale spans 1/3x to 3x (beyond: the end colours), so that a cell a few
# percent either side of PyTorch still shows, where a scale up to the narrow cells' 40x hid it
HEAT_REACH = 3.0


def heat_grid(rows: list[dict], variant: str) -> tuple[list[int], list[int], list[list[float]]]:
    """``(exponents, widths, values)`` of one heatmap panel: ``values[i][j]`` is cudnorm's ratio
    to PyTorch at ``2^exponents[i]`` elements and width ``widths[j]`` (NaN: not timed), over the
    element counts and widths of all of ``rows`` (one op and direction), so that every panel of a
    figure has the same axes."""
    exponents = sorted({exponent(r) for r in rows})
    widths = sorted({r["cols"] for r in rows})
    values = [[math.nan] * len(widths) for _ in exponents]
    for r in rows:
        if _case(r) == variant:
            values[exponents.index(exponent(r))][widths.index(r["cols"])] = r["ratio_vs_torch"]
    return exponents, widths, values


def heatmaps(rows: list[dict], device_name: str, out: Path) -> list[Path]:
    """One PNG per op/direction: cudnorm / PyTorch by width (x) and element count (y), one panel
    per dtype/weight/bias variant, diverging colours on a log scale centred at 1.0 (red: slower),
    from 1/:data:`HEAT_REACH` to :data:`HEAT_REACH`."""
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.colors import LogNorm  # noqa: PLC0415
    except ImportError:
        return []
    timed = _ratios(rows)
    paths = []
    for op, direction in dict.fromkeys((r["op"], r["direction"]) for r in timed):
        mine = [r for r in timed if (r["op"], r["direction"]) == (op, direction)]
        variants = list(dict.fromkeys(_case(r) for r in mine))
        norm = LogNorm(vmin=1 / HEAT_REACH, vmax=HEAT_REACH)
        width_count = len({r["cols"] for r in mine})
        fig, axes = plt.subplots(len(variants), 1, figsize=(max(8.0, 0.09 * width_count + 2), 0.5 + 1.9 * len(variants)),
                                 squeeze=False, layout="constrained")
        for ax, variant in zip(axes[:, 0], variants):
            counts, widths, grid_values = heat_grid(mine, variant)
            image = ax.pcolormesh(grid_values, cmap="RdBu", norm=norm)
            step = max(1, len(widths) // 40)
            ax.set_xticks([i + 0.5 for i in range(0, len(widths), step)], [str(w) for w in widths[::step]],
                          rotation=90, fontsize=6)
            ax.set_yticks([i + 0.5 for i in range(len(counts))], [f"2^{c}" for c in counts], fontsize=7)
            ax.set_ylabel("elements", fontsize=8)
            ax.set_title(variant, fontsize=9, loc="left")
        axes[-1, 0].set_xlabel("width N (rows = elements // N)", fontsize=8)
        bar = fig.colorbar(image, ax=axes[:, 0].tolist(), extend="both")
        bar.set_label("speed-up over PyTorch", fontsize=8)
        ticks = [1 / HEAT_REACH, 0.5, 1.0, 2.0, HEAT_REACH]
        bar.set_ticks(ticks, labels=[f"{t:.2g}x" for t in ticks], fontsize=7)
        bar.ax.minorticks_off()
        fig.suptitle(f"cudnorm (default policy) vs PyTorch, {op} {direction}, {device_name}: PyTorch's GPU time "
                     "/ cudnorm's (blue > 1: faster)", fontsize=10)
        path = out / f"sweep_{op}_{direction}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def summary_markdown(rows: list[dict], meta: dict) -> str:
    parts = ["# cudnorm bench --sweep", ""] + [f"- **{k}**: {v}" for k, v in meta.items()]
    for title, lines in (("Worst 20 cells (cudnorm / PyTorch GPU time, lowest first)", worst_table(rows)),
                         ("Median ratio, widths >= 512 at >= 2^21 elements", medians(rows)),
                         ("Worst cell of each provider", worst_per_provider(rows)),
                         ("Narrow widths: bandwidth as a fraction of a copy's", copy_fractions(rows)),
                         ("First-call measurement (the dispatcher timing a signature's candidates)",
                          measure_costs(rows))):
        parts += ["", f"## {title}", "", report.markdown_table(lines) if len(lines) > 1 else "(nothing timed)"]
    return "\n".join(parts) + "\n"
