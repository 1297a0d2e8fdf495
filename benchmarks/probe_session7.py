"""Session-7 probes (GPU): cheaper graphs for new row counts, and where a warm-store load goes.

    python benchmarks/probe_session7.py replay   # new row count: heuristics vs replaying (engine, knobs)
    python benchmarks/probe_session7.py deser    # deserialize cost per graph, repeated, per stream binding
    python benchmarks/probe_session7.py rows     # variable row counts: host vs GPU time per pass, chunks vs exact
    python benchmarks/probe_session7.py chain    # 8-layer LN/RMS chain backward at 32768 x 1024: where host time goes

``replay``: LayerNorm/RMSNorm at N = 4096 bf16 (forward scale bf16, backward scale fp32, as the
library builds them). A template graph at 16384 rows is built through the heuristics; then,
for random row counts, the graph of that count is built (a) the library's way (heuristics'
first plan), (b) by ``create_execution_plan(engine, knobs)`` of the template's plan, each
static and dynamic-shape (shared kernel cache). Prints seconds per stage, then GPU time and
max |diff| of the replayed plan against the heuristics' plan on the same buffers.

``deser``: builds and serializes 4 graphs in this process, then in a fresh interpreter
deserializes each blob three times, with the handle on the default stream or on a side
stream, and prints milliseconds per deserialize.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cudnorm import _graphs, _runtime  # noqa: E402
from cudnorm._spec import NormSpec  # noqa: E402

N = 4096
BF16 = torch.bfloat16


def spec_of(op: str, phase: str, rows: int, dynamic: bool) -> NormSpec:
    scale = torch.float32 if phase == "bwd" else BF16
    return NormSpec(op, phase, rows, N, BF16, scale, 0, dynamic=dynamic)


def staged_build(spec: NormSpec, engine=None):
    """(graph, uids, {stage: seconds}) for ``spec``: heuristics when ``engine`` is None,
    else ``create_execution_plan(*engine)``."""
    h = _runtime.handle(0)
    start = time.perf_counter()
    g, uids = _graphs.build_ir(spec, handle=h, kernel_cache=_graphs._kernel_cache(spec) if spec.dynamic else None)
    if engine is None:
        plans, finalise = (lambda: g.create_execution_plans(_graphs._heuristic_modes(False))), g.build_plans
    else:
        plans = lambda: g.create_execution_plan(engine[0], engine[1])  # noqa: E731
        finalise = lambda: g.build_plan_at_index(g.get_execution_plan_count() - 1)  # noqa: E731
    t = {}
    stages = (("validate", g.validate), ("opgraph", g.build_operation_graph), ("plans", plans),
              ("support", g.check_support), ("finalise", finalise))
    for name, stage in stages:
        mark = time.perf_counter()
        stage()
        t[name] = time.perf_counter() - mark
    t["total"] = time.perf_counter() - start
    return g, uids, t


def gpu_ms(g, uids, buffers, index=None, reps=20) -> float:
    h = _runtime.handle(0)
    ws = torch.empty(max(1, int(g.get_workspace_size())), dtype=torch.uint8, device="cuda")

    def once():
        if index is None:
            g.execute(dict(zip(uids, buffers)), ws, handle=h)
        else:
            g.execute_plan_at_index(dict(zip(uids, buffers)), ws, index=index, handle=h)

    once()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        once()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / reps


def replay() -> None:
    rng = random.Random(7)
    counts = rng.sample(range(1, 65537), 10)
    for op in ("layer_norm", "rms_norm"):
        for phase in ("train", "bwd"):
            for dynamic in (True, False):
                tg, _, tt = staged_build(spec_of(op, phase, 16384, dynamic))
                index = getattr(tg, "_plan_index", 0) or 0
                engine = tg.get_engine_and_knobs_at_index(index)
                print(f"{op} {phase} dynamic={dynamic}: template 16384 rows {tt['total']:.3f} s, engine {engine}",
                      flush=True)
                for rows in counts[:6] if dynamic else counts[:3]:
                    spec = spec_of(op, phase, rows, dynamic)
                    row = []
                    try:
                        g_r, uids, t_r = staged_build(spec, engine)
                        row.append("replay " + " ".join(f"{k} {v * 1e3:.1f}" for k, v in t_r.items()))
                    except Exception as exc:  # noqa: BLE001 - a probe reports every failure
                        g_r = None
                        row.append(f"replay FAILED {type(exc).__name__}: {str(exc)[:160]}")
                    g_h, uids, t_h = staged_build(spec)
                    row.append("heur " + " ".join(f"{k} {v * 1e3:.1f}" for k, v in t_h.items()))
                    if g_r is not None:
                        bufs = _graphs.dummy_buffers(spec)
                        outs_r = [b.clone() for b in bufs]
                        ms_r = gpu_ms(g_r, uids, outs_r, index=g_r.get_execution_plan_count() - 1)
                        ms_h = gpu_ms(g_h, uids, bufs)
                        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outs_r, bufs)
                                   if a.is_cuda and a.numel() > 1)
                        row.append(f"gpu replay {ms_r * 1e3:.1f} us heur {ms_h * 1e3:.1f} us maxdiff {diff:.3g}")
                    print(f"  rows {rows:6d}: " + " | ".join(row), flush=True)


DESER_CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
from cudnorm import _runtime
import cudnn
blobs = [bytes.fromhex(s) for s in json.load(open(sys.argv[2]))]
side = sys.argv[3] == "side"
torch.ones(1, device="cuda")
h = _runtime.handle(0)
stream = torch.cuda.Stream() if side else None
if side:
    cudnn.set_stream(handle=h, stream=stream.cuda_stream)
out = []
for rep in range(3):
    row = []
    for blob in blobs:
        torch.cuda.synchronize()
        start = time.perf_counter()
        g = cudnn.pygraph(handle=h)
        g.deserialize(h, blob)
        torch.cuda.synchronize()
        row.append(round((time.perf_counter() - start) * 1e3, 2))
    out.append(row)
print(json.dumps(out))
"""


def deser() -> None:
    specs = [spec_of("layer_norm", "train", 8192, False), spec_of("layer_norm", "bwd", 8192, False),
             spec_of("rms_norm", "train", 8192, False), spec_of("rms_norm", "bwd", 8192, False)]
    blobs = [_graphs.serialize_plan(_graphs.build_plan(s)) for s in specs]
    path = Path(os.environ.get("OUT", "/tmp")) / "blobs.json"
    path.write_text(json.dumps([b.hex() for b in blobs]))
    print("graphs: LN train, LN bwd, RMS train, RMS bwd (8192 x 4096); blob KB", [len(b) // 1024 for b in blobs])
    for binding in ("default", "side", "default", "side"):
        done = subprocess.run([sys.executable, "-c", DESER_CHILD, str(REPO), str(path), binding],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            print(binding, "FAILED", done.stderr[-1500:])
            continue
        print(f"fresh process, handle on {binding:7s} stream: ms per deserialize (3 rounds):",
              done.stdout.strip().splitlines()[-1], flush=True)


ROWS_MODES = {"exact": {"CUDNORM_EXACT_ROWS": "100000", "CUDNORM_EXACT_AFTER": "1"},
              "chunks": {"CUDNORM_EXACT_ROWS": "0"}}


def rows_worker(mode: str, count: int) -> None:
    """One training step per row count (as ``benchmarks/variable_rows.py``), then per pass: GPU
    time, host time (loop without a sync), kernel time summed by the profiler, and a cProfile."""
    import cProfile
    import pstats

    import cudnorm
    from torch.profiler import ProfilerActivity, profile

    from cudnorm import _cache, _rows

    if os.environ.get("PROBE_STATIC_FWD") == "1":
        _rows.DYNAMIC_PHASES = frozenset()
    for phase_key, env_key in (("train", "PROBE_FWD_CHUNKS"), ("bwd", "PROBE_BWD_CHUNKS")):
        if os.environ.get(env_key):
            sizes = tuple(int(v) for v in os.environ[env_key].split(","))
            _rows.CHUNK_ROWS = {**_rows.CHUNK_ROWS, phase_key: sizes}
    counts = random.Random(0).sample(range(1, 65537), 100)[:count]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x_all = torch.randn(65536, N, device="cuda", generator=gen).to(BF16)
    dy_all = torch.randn(65536, N, device="cuda", generator=gen).to(BF16)
    w = (1 + 0.1 * torch.randn(N, device="cuda", generator=gen)).requires_grad_()
    b = (0.1 * torch.randn(N, device="cuda", generator=gen)).requires_grad_()

    def one_pass():
        for rows in counts:
            x = x_all[:rows].detach().requires_grad_()
            cudnorm.layer_norm(x, (N,), w, b).backward(dy_all[:rows])

    one_pass()
    torch.cuda.synchronize()
    report = {"mode": mode, "counts": count, "builds": cudnorm.cache_info().builds,
              "build_s": round(cudnorm.cache_info().build_seconds, 2)}
    for k in range(3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        begin.record()
        one_pass()
        end.record()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        report[f"pass{k}"] = {"gpu_ms": round(begin.elapsed_time(end), 2), "host_ms": round(host * 1e3, 2)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one_pass()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    report["kernel_ms"] = round(sum(e.device_time for e in kernels) / 1e3, 2)
    report["kernels"] = len(kernels)
    by_name: dict = {}
    for e in kernels:
        by_name[e.name[:60]] = by_name.get(e.name[:60], 0) + e.device_time
    report["top_kernels_ms"] = {k: round(v / 1e3, 2) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]}
    torch.cuda.synchronize()
    prof_c = cProfile.Profile()
    prof_c.enable()
    one_pass()
    prof_c.disable()
    torch.cuda.synchronize()
    print(json.dumps(report))
    for spec in sorted(_cache.plans.specs(), key=lambda s: (s.phase, s.rows)):
        plan = _cache.plans.lookup(spec)
        if spec.rows not in (1024, 4096, 16384, 32768) and spec.rows != counts[0]:
            continue
        bufs = _graphs.dummy_buffers(spec)
        plan.run(*bufs)
        torch.cuda.synchronize()
        calls = 50
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        for _ in range(calls):
            plan.run(*bufs)
        host = (time.perf_counter() - start) / calls
        end.record()
        torch.cuda.synchronize()
        print(f"  launch {spec.phase:5s} rows {spec.rows:6d} dynamic={spec.dynamic}: host {host * 1e6:6.1f} us/launch, "
              f"gpu {begin.elapsed_time(end) / calls * 1e3:7.1f} us, plan {plan.plan_name}")
    stats = pstats.Stats(prof_c)
    stats.sort_stats("tottime").print_stats(12)


def rows() -> None:
    """``PROBE_MODES``: comma-separated ``mode[+static][/fwd sizes][/bwd sizes]``, e.g.
    ``chunks+static/16384:4096:1024/16384:4096``."""
    count = int(os.environ.get("PROBE_COUNTS", "30"))
    for label in os.environ.get("PROBE_MODES", "chunks,exact,chunks").split(","):
        parts = label.split("/")
        mode = parts[0].split("+")[0]
        env = {**os.environ, "CUDNORM_PLAN_STORE": "0", "CUDNORM_AUTOTUNE": "0", **ROWS_MODES[mode],
               "PROBE_STATIC_FWD": "1" if "+static" in parts[0] else "0",
               "PROBE_FWD_CHUNKS": parts[1].replace(":", ",") if len(parts) > 1 else "",
               "PROBE_BWD_CHUNKS": parts[2].replace(":", ",") if len(parts) > 2 else ""}
        done = subprocess.run([sys.executable, __file__, "rows-worker", mode, str(count)], env=env,
                              capture_output=True, text=True, check=False)
        print(f"===== {label} ({count} counts)", flush=True)
        print(done.stdout[-9000:] if not done.returncode else done.stderr[-3000:], flush=True)


def chain() -> None:
    """One ``autograd.grad`` through 8 norms (fp32 weights) at 32768 x 1024 bf16, as
    ``benchmarks/api_vs_raw.py`` times it: wall time per layer, our backward's host time per
    layer (perf_counter around the implementation), and the profiler's view."""
    import cudnorm
    import importlib

    ln_mod = importlib.import_module("cudnorm.layer_norm")  # the module; cudnorm.layer_norm is the function
    rms_mod = importlib.import_module("cudnorm.rms_norm")
    from torch.profiler import ProfilerActivity, profile

    m, n, layers = 32768, 1024, 8
    for op, mod in (("layer_norm", ln_mod), ("rms_norm", rms_mod), ("layer_norm", ln_mod), ("rms_norm", rms_mod)):
        x = torch.randn(m, n, device="cuda", dtype=BF16, requires_grad=True)
        ws = [torch.randn(n, device="cuda", requires_grad=True) for _ in range(layers)]
        bs = [torch.randn(n, device="cuda", requires_grad=True) for _ in range(layers)]
        dy = torch.randn(m, n, device="cuda", dtype=BF16)
        y = x
        for w, b in zip(ws, bs):
            y = cudnorm.layer_norm(y, (n,), w, b) if op == "layer_norm" else cudnorm.rms_norm(y, (n,), w)
        params = [x, *ws, *(bs if op == "layer_norm" else [])]
        grad = lambda: torch.autograd.grad(y, params, dy, retain_graph=True)  # noqa: E731
        inner = mod._backward_impl  # noqa: F841 - restored below through the closure
        spent = []

        def timed_impl(*a, _inner=inner, _spent=spent):
            start = time.perf_counter()
            out = _inner(*a)
            _spent.append(time.perf_counter() - start)
            return out

        for _ in range(5):
            grad()
        torch.cuda.synchronize()
        reps = 50
        start = time.perf_counter()
        for _ in range(reps):
            grad()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / reps / layers
        # the eager autograd.Function's backward holds the implementation in its closure
        fn = ln_mod._LayerNormFunction if op == "layer_norm" else rms_mod._RMSNormFunction
        cell = fn.backward.__closure__[0]
        cell.cell_contents = timed_impl
        for _ in range(reps):
            grad()
        torch.cuda.synchronize()
        cell.cell_contents = inner
        impl_us = sorted(spent)[len(spent) // 2] * 1e6 if spent else float("nan")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                grad()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        kernel_us = sum(e.device_time for e in kernels) / 10 / layers
        print(f"{op}: wall {wall * 1e6:.1f} us/layer, backward impl host {impl_us:.1f} us/call "
              f"({len(spent)} calls timed; {fn.__name__}), kernels {kernel_us:.1f} us/layer, "
              f"{len(kernels) / 10 / layers:.1f} kernels/layer", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


def steps_worker(mode: str) -> None:
    """Synchronised forward and backward times of single steps at a few row counts."""
    import cudnorm
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator(device="cuda").manual_seed(0)
    x_all = torch.randn(65536, N, device="cuda", generator=gen).to(BF16)
    dy_all = torch.randn(65536, N, device="cuda", generator=gen).to(BF16)
    w = (1 + 0.1 * torch.randn(N, device="cuda", generator=gen)).requires_grad_()
    b = (0.1 * torch.randn(N, device="cuda", generator=gen)).requires_grad_()
    for rows in (50000, 700, 2000, 3000, 6000, 10000, 30000):
        fwd_ms, bwd_ms = [], []
        for rep in range(13):
            x = x_all[:rows].detach().requires_grad_()
            torch.cuda.synchronize()
            start = time.perf_counter()
            y = cudnorm.layer_norm(x, (N,), w, b)
            torch.cuda.synchronize()
            mid = time.perf_counter()
            y.backward(dy_all[:rows])
            torch.cuda.synchronize()
            end = time.perf_counter()
            if rep >= 3:
                fwd_ms.append((mid - start) * 1e3)
                bwd_ms.append((end - mid) * 1e3)
        print(f"{mode:6s} rows {rows:6d}: fwd {statistics.median(fwd_ms):.3f} ms  bwd {statistics.median(bwd_ms):.3f} ms "
              f"(synchronised, median of 10)", flush=True)
    x = x_all[:2000].detach().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            cudnorm.layer_norm(x, (N,), w, b).backward(dy_all[:2000])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=16, max_name_column_width=50))


def steps() -> None:
    for mode in ("chunks", "exact"):
        env = {**os.environ, "CUDNORM_PLAN_STORE": "0", "CUDNORM_AUTOTUNE": "0", **ROWS_MODES[mode]}
        done = subprocess.run([sys.executable, __file__, "steps-worker", mode], env=env, capture_output=True,
                              text=True, check=False)
        print(done.stdout[-8000:] if not done.returncode else done.stderr[-3000:], flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "steps-worker":
        steps_worker(sys.argv[2])
    elif sys.argv[1] == "rows-worker":
        rows_worker(sys.argv[2], int(sys.argv[3]))
    else:
        {"replay": replay, "deser": deser, "rows": rows, "chain": chain, "steps": steps}[sys.argv[1]]()
