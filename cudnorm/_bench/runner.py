"""Shapes, timers, the copy-bandwidth ceiling and the measurement loop of ``cudnorm bench``.

One case is an op family at one shape: its inputs and fp64 reference are made once and
shared by the forward and backward ops and by every provider. Each provider is set up,
checked against the reference, and timed only if the check passes; an error or OOM is
recorded in its row and the loop goes on. Memory is released between providers.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time

import torch

from .. import _settings
from . import accuracy
from .providers import FAMILIES, Inputs, Provider, make_inputs, quantities, torch_setup, traffic_bytes

SEED_ROWS = 32768
LN_COLS = tuple(2**k for k in range(8, 17))  # 256 .. 65536, the seed's LayerNorm shapes
RMS_COLS = tuple(2**k for k in range(8, 16))  # 256 .. 32768, as far as the anchors go
EXTRA_SHAPES = ((16384, 131072), (8192, 262144))  # the seed's extra_shapes_for_norm
DIT_SHAPES = ((4, 1024, 768), (32, 256, 1152), (8, 4096, 1152), (16, 4096, 3072), (2, 4096, 1536))
QUICK_SHAPES = ((256, 256), (256, 1024))
QUICK_DIT_SHAPES = ((2, 64, 256),)
WARMUP_MS, REP_MS = 10, 50  # keeps the full default run within ~8 minutes on one GPU


def default_shapes(family: str, quick: bool) -> tuple[tuple[int, ...], ...]:
    if family == "ada":
        return QUICK_DIT_SHAPES if quick else DIT_SHAPES
    if quick:
        return QUICK_SHAPES
    cols = LN_COLS if family == "ln" else RMS_COLS
    return tuple((SEED_ROWS, n) for n in cols) + EXTRA_SHAPES


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"32768x4096,4x1024x768"`` -> ``[(32768, 4096), (4, 1024, 768)]``."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            shape = tuple(int(v) for v in item.lower().split("x"))
        except ValueError:
            shape = ()
        if len(shape) not in (2, 3) or min(shape) < 1:
            raise ValueError(f"{item!r} is not MxN or BxSxD (positive sizes, e.g. 32768x4096 or 8x1024x1152)")
        shapes.append(shape)
    if not shapes:
        raise ValueError(f"{text!r} names no shape; expected MxN or BxSxD (e.g. 32768x4096 or 8x1024x1152)")
    return shapes


def shapes_for(family: str, quick: bool, custom: list[tuple[int, ...]] | None):
    """``custom`` MxN shapes serve LayerNorm/RMSNorm, BxSxD shapes AdaLN."""
    if custom is None:
        return default_shapes(family, quick)
    return tuple(s for s in custom if len(s) == (3 if family == "ada" else 2))


def _cpu_median(fn) -> float:
    fn()
    samples, deadline = [], time.perf_counter() + 0.2
    while len(samples) < 5 or (len(samples) < 50 and time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _cuda_events_median(fn) -> float:
    """Median of per-call CUDA-event times, L2 flushed before each call (as do_bench does)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    estimate_ms = max((time.perf_counter() - start) * 1e3, 1e-3)
    for _ in range(max(1, int(WARMUP_MS / estimate_ms))):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(min(1000, max(5, int(REP_MS / estimate_ms))))]
    for begin, end in pairs:
        flush.zero_()
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(b.elapsed_time(e) for b, e in pairs)


def make_timer(device: str):
    """``(timer, description)``; ``timer(fn)`` returns the median milliseconds of ``fn()``."""
    if device == "cpu":
        return _cpu_median, "time.perf_counter median of >= 5 calls (up to 50 in 0.2 s)"
    try:
        from triton.testing import do_bench  # noqa: PLC0415 - optional
    except ImportError:
        return _cuda_events_median, f"CUDA-event median, L2 flushed, warmup {WARMUP_MS} ms, rep {REP_MS} ms"

    def timer(fn):
        return float(do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))

    return timer, f"triton.testing.do_bench median (warmup {WARMUP_MS} ms, rep {REP_MS} ms, L2 flushed)"


def copy_bandwidth(device: str, timer) -> float:
    """GB/s of a copy in the device's memory (device-to-device, 2 GiB, on a GPU; memory-to-memory,
    64 MiB, on the CPU), counting the read and the write, like the kernels' GB/s."""
    nbytes = (2 << 30) if device != "cpu" else (64 << 20)
    src, dst = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
    buffers = [src, dst]
    del src, dst
    ms = timer(lambda: buffers[1].copy_(buffers[0]))
    buffers.clear()
    free(device)
    return 2 * nbytes / ms * 1e-6


def free(device: str, collect: bool = False) -> None:
    """Return cached GPU memory to the driver between providers. ``collect`` also runs the
    garbage collector (0.1-0.2 s with torch imported: once per case, and after errors, whose
    tracebacks can hold tensors in reference cycles)."""
    if collect:
        gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()


def describe(exc: BaseException) -> str:
    if isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
        return "OOM"
    text = str(exc).strip().splitlines()
    return f"error: {type(exc).__name__}: {text[0][:120] if text else ''}"


def _shape_text(shape) -> str:
    return "x".join(str(v) for v in shape)


def blank_row(op: str, shape, provider: str) -> dict:
    cols = shape[-1]
    rows = 1
    for v in shape[:-1]:
        rows *= v
    return {"op": op, "shape": _shape_text(shape), "M": rows, "N": cols, "provider": provider,
            "status": "", "path": "", "plan": "", "build_s": None, "error": None, "bound": None,
            "ms": None, "gbps": None, "pct_copy": None, "speedup": None, "best_peer": "", "bytes": None}


def _cudnorm_state(op: str, inp: Inputs, before) -> dict:
    """Which path served cudnorm: ``serving_path``, a cuDNN decline, the plan that ran."""
    import cudnorm  # noqa: PLC0415
    from .. import _cache, _dispatch  # noqa: PLC0415

    name = FAMILIES[inp.family][0]
    after = cudnorm.cache_info()
    path = cudnorm.serving_path(name, inp.x)
    if after.declined > before.declined:
        path = "torch (cuDNN declined)"
    elif path == "cudnn" and op.endswith("_fwd") and name != "ada_layer_norm" and _dispatch.native_forward(inp.x):
        path = "torch (faster at this N)"
    phase = "bwd" if op.endswith("_bwd") else "train"
    rows = inp.x.numel() // inp.cols
    specs = [s for s in _cache.plans.specs()
             if (s.op, s.phase, s.rows, s.cols, s.x_dtype) == (name, phase, rows, inp.cols, inp.x.dtype)]
    plan = _cache.get_plan(specs[-1]) if specs and path == "cudnn" else None
    label = ""
    if plan is not None:
        label = plan.plan_name + (f" (tuned {plan.candidates_timed})" if plan.candidates_timed else "")
    if op == "ada_bwd" and path == "cudnn":
        label = " ".join(filter(None, (label, _ada_backward_strategy(inp))))
    return {"path": path, "plan": label, "build_s": after.build_seconds - before.build_seconds}


def _ada_backward_strategy(inp: Inputs) -> str:
    """The AdaLN backward strategy cudnorm picks for this shape (its module's rule table)."""
    module = sys.modules.get("cudnorm.ada_layer_norm")
    choose = getattr(module, "_backward_strategy", None) or getattr(module, "choose_backward", None)
    if choose is None:
        return ""
    b, d = inp.x.shape[0], inp.cols
    return f"bwd strategy {choose(b, inp.x.numel() // (b * d), d, inp.x.dtype)}"


def _limits(op: str, inp: Inputs, expected: dict) -> dict[str, float]:
    """Error bounds of ``op`` from eager PyTorch's own errors (the dtype floor where the
    "torch" provider itself fails)."""
    names = quantities(op)
    torch_errors = {}
    try:
        fn, outputs = torch_setup(op, inp)
        torch_errors = accuracy.errors(outputs, names, expected)
        del fn, outputs
    except Exception:  # noqa: BLE001 - without a baseline the floor applies
        pass
    free(inp.x.device.type)
    found = accuracy.bounds(torch_errors, inp.x.dtype)
    floor = accuracy.bounds({n: 0.0 for n in names}, inp.x.dtype)
    return {n: found.get(n, floor[n]) for n in names}


def measure(provider: Provider, op: str, inp: Inputs, expected: dict, limits: dict, timer, copy_gbps: float) -> dict:
    """One row: check ``provider`` on ``op``, then time it if the check passed."""
    import cudnorm  # noqa: PLC0415

    row = blank_row(op, tuple(inp.x.shape), provider.name)
    row["bytes"] = traffic_bytes(op, inp)
    before = cudnorm.cache_info()
    fn = outputs = None
    # the op table compares kernels: on CUDA cudnorm's row is its cuDNN path at every size (the
    # default policy hands small calls to PyTorch's op, which the torch row already times); off
    # CUDA there is no cuDNN path, and the row is what the default policy runs there
    cudnn_path = provider.name == "cudnorm" and inp.x.is_cuda
    try:
        with _settings.config(policy="cudnn") if cudnn_path else contextlib.nullcontext():
            fn, outputs = provider.setup(op, inp)
            errs = accuracy.errors(outputs, quantities(op), expected)
            outputs = None
            row["status"], row["error"], row["bound"] = accuracy.verdict(errs, limits)
            if provider.name == "cudnorm":
                row.update(_cudnorm_state(op, inp, before))
            if row["status"] == "ok":
                row["ms"] = timer(fn)
                row["gbps"] = row["bytes"] / row["ms"] * 1e-6
                row["pct_copy"] = 100.0 * row["gbps"] / copy_gbps if copy_gbps else None
    except Exception as exc:  # noqa: BLE001 - a failing provider is reported, not fatal
        row["status"] = describe(exc)
    fn = outputs = None
    free(inp.x.device.type, collect=row["status"] != "ok" and not row["status"].startswith("wrong"))
    return row


def run_case(family: str, shape, ops, providers, dtype, device, timer, copy_gbps) -> list[dict]:
    """Every selected op of ``family`` at ``shape``, for every provider that has the op."""
    case_ops = [op for op in ops if op.startswith(family + "_")]
    pairs = [(op, p) for op in case_ops for p in providers if op in p.ops]
    try:
        inp = make_inputs(family, shape, dtype, device)
        expected = accuracy.reference(inp, with_grads=any(op.endswith("_bwd") for op in case_ops))
    except Exception as exc:  # noqa: BLE001 - e.g. OOM making the inputs: report every row
        status = describe(exc)
        free(device, collect=True)
        return [{**blank_row(op, shape, p.name), "status": f"{status} (inputs/reference)"} for op, p in pairs]
    rows = []
    for op in case_ops:
        limits = _limits(op, inp, expected)
        rows.extend(measure(p, op, inp, expected, limits, timer, copy_gbps) for o, p in pairs if o == op)
    del inp, expected
    free(device, collect=True)
    return rows
