"""Session-3 probes (GPU only): where chunked variable-rows time goes, an in-graph cast of
fp32 weights, and per-graph vs per-process cost of the first call with a warm plan store.

    PYTHONPATH=. python benchmarks/probe_session3.py rows|cast|store
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

N = 4096


def probe_rows() -> None:
    import cudnorm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x_all = torch.randn(65536, N, device="cuda", generator=gen).to(torch.bfloat16)
    dy_all = torch.randn(65536, N, device="cuda", generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(N, device="cuda", generator=gen)).requires_grad_()
    b = (0.1 * torch.randn(N, device="cuda", generator=gen)).requires_grad_()
    counts = random.Random(0).sample(range(1, 65537), 30)
    t0 = time.perf_counter()
    for rows in counts:
        x = x_all[:rows].detach().requires_grad_()
        cudnorm.layer_norm(x, (N,), w, b).backward(dy_all[:rows])
    torch.cuda.synchronize()
    print(f"rows: first pass {time.perf_counter() - t0:.2f} s, {cudnorm.cache_info()}")
    # host time per phase with an idle GPU queue, and GPU time per step
    host_f, host_b, gpu = [], [], []
    for rows in counts:
        x = x_all[:rows].detach().requires_grad_()
        torch.cuda.synchronize()
        s = time.perf_counter()
        y = cudnorm.layer_norm(x, (N,), w, b)
        m = time.perf_counter()
        y.backward(dy_all[:rows])
        e = time.perf_counter()
        torch.cuda.synchronize()
        host_f.append((m - s) * 1e6)
        host_b.append((e - m) * 1e6)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        y = cudnorm.layer_norm(x, (N,), w, b)
        y.backward(dy_all[:rows])
        ev[1].record()
        torch.cuda.synchronize()
        gpu.append(ev[0].elapsed_time(ev[1]) * 1e3)
    for rows, f, bw, g in sorted(zip(counts, host_f, host_b, gpu))[:: 3]:
        print(f"rows {rows:6d}: host fwd {f:7.0f} us  host bwd {bw:7.0f} us  step (events) {g:7.0f} us")
    print(f"rows: median host fwd {statistics.median(host_f):.0f} us, bwd {statistics.median(host_b):.0f} us")
    # where host time goes: wrap the layers and count allocator device mallocs
    from collections import defaultdict

    from cudnorm import _graphs, _rows
    spent = defaultdict(float)
    calls = defaultdict(int)

    def wrap(owner, name, label_of):
        original = getattr(owner, name)

        def timed(*a, **k):
            s = time.perf_counter()
            out = original(*a, **k)
            label = label_of(a)
            spent[label] += time.perf_counter() - s
            calls[label] += 1
            return out
        setattr(owner, name, timed)
    wrap(_graphs.Plan, "run", lambda a: f"Plan.run {a[0].spec.phase} dyn={a[0].spec.dynamic} rows={a[0].spec.rows}")
    wrap(_rows.ChunkedPlan, "run", lambda a: f"ChunkedPlan.run {a[0].spec.phase}")
    wrap(_rows, "plan_or_chunks", lambda a: "plan_or_chunks")
    _rows._memo.clear()  # chunked plans hold bound runs: remake them with the wrapped Plan.run
    for rows in counts:
        x = x_all[:rows].detach().requires_grad_()
        cudnorm.layer_norm(x, (N,), w, b).backward(dy_all[:rows])
    torch.cuda.synchronize()
    spent.clear()
    calls.clear()
    stats0 = torch.cuda.memory_stats()
    t0 = time.perf_counter()
    fwd_t = bwd_t = 0.0
    for rows in counts:
        x = x_all[:rows].detach().requires_grad_()
        s = time.perf_counter()
        y = cudnorm.layer_norm(x, (N,), w, b)
        m = time.perf_counter()
        y.backward(dy_all[:rows])
        fwd_t += m - s
        bwd_t += time.perf_counter() - m
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    stats1 = torch.cuda.memory_stats()
    print(f"rows instrumented pass: host {host * 1e3:.1f} ms for {len(counts)} steps (fwd {fwd_t * 1e3:.1f}, bwd {bwd_t * 1e3:.1f}); "
          f"device mallocs +{stats1.get('num_device_alloc', 0) - stats0.get('num_device_alloc', 0)}, "
          f"frees +{stats1.get('num_device_free', 0) - stats0.get('num_device_free', 0)}, "
          f"alloc retries +{stats1.get('num_alloc_retries', 0) - stats0.get('num_alloc_retries', 0)}")
    for label in sorted(spent, key=spent.get, reverse=True)[:20]:
        print(f"  {label:45s} {calls[label]:5d} calls {spent[label] * 1e3:8.2f} ms  {spent[label] / calls[label] * 1e6:7.1f} us/call")


def _time(fn, reps=50) -> float:
    for _ in range(5):
        fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ev[0].record()
    for e in ev[1:]:
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(ev, ev[1:]))


def probe_cast() -> None:
    import cudnn

    from cudnorm import _runtime
    h = _runtime.handle(0)
    f32, bf = cudnn.data_type.FLOAT, cudnn.data_type.BFLOAT16
    for op in ("layer_norm", "rms_norm"):
        for n in (1024, 4096, 16384):
            m = 32768
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            w32 = torch.rand(n, device="cuda") + 0.5
            b32 = torch.randn(n, device="cuda") * 0.1
            eps = torch.full((1, 1, 1, 1), 1e-5)
            for mode in ("bf16", "fp32", "cast"):
                g = cudnn.pygraph(handle=h, io_data_type=bf, intermediate_data_type=f32, compute_data_type=f32)
                tx = g.tensor(name="x", dim=[m, n, 1, 1], stride=[n, 1, 1, 1], data_type=bf)
                pdt = bf if mode == "bf16" else f32
                ts = g.tensor(name="s", dim=[1, n, 1, 1], stride=[n, 1, 1, 1], data_type=pdt)
                tb = g.tensor(name="b", dim=[1, n, 1, 1], stride=[n, 1, 1, 1], data_type=pdt)
                te = g.tensor(name="eps", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32, is_pass_by_value=True)
                s_in, b_in = ts, tb
                try:
                    if mode == "cast":
                        s_in = g.identity(input=ts, compute_data_type=f32)
                        s_in.set_data_type(bf)
                        b_in = g.identity(input=tb, compute_data_type=f32)
                        b_in.set_data_type(bf)
                    phase = cudnn.norm_forward_phase.TRAINING
                    if op == "layer_norm":
                        y, mean, rstd = g.layernorm(name="n", norm_forward_phase=phase, input=tx, scale=s_in, bias=b_in, epsilon=te)
                        mean.set_output(True).set_data_type(f32)
                    else:
                        y, rstd = g.rmsnorm(name="n", norm_forward_phase=phase, input=tx, scale=s_in, epsilon=te)
                        mean = None
                    y.set_output(True).set_data_type(bf)
                    rstd.set_output(True).set_data_type(f32)
                    g.validate()
                    g.build_operation_graph()
                    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                    g.check_support()
                    g.build_plans()
                    count = g.get_execution_plan_count()
                    name = g.get_plan_name_at_index(0)
                except Exception as exc:
                    print(f"cast {op} N={n} {mode}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                yt = torch.empty_like(x)
                mt = torch.empty(m, 1, 1, 1, device="cuda")
                rt = torch.empty(m, 1, 1, 1, device="cuda")
                s_t = w32.to(torch.bfloat16) if mode == "bf16" else w32
                b_t = b32.to(torch.bfloat16) if mode == "bf16" else b32
                pack = {tx: x, ts: s_t, te: eps, y: yt, rstd: rt}
                if op == "layer_norm":
                    pack[tb] = b_t
                    pack[mean] = mt
                ws = torch.empty(max(g.get_workspace_size(), 1), device="cuda", dtype=torch.uint8)
                ms = _time(lambda: g.execute(pack, ws, handle=h))
                ref = (torch.nn.functional.layer_norm(x.float(), (n,), w32.to(torch.bfloat16).float(), b32.to(torch.bfloat16).float(), 1e-5)
                       if op == "layer_norm" else torch.nn.functional.rms_norm(x.float(), (n,), w32.to(torch.bfloat16).float(), 1e-5))
                err = ((yt.float() - ref).abs().max() / ref.abs().max()).item()
                gbs = (2 * m * n * 2) / ms / 1e6
                print(f"cast {op:10s} N={n:5d} {mode:4s}: {ms * 1e3:8.1f} us {gbs:6.0f} GB/s plans={count} first={name} maxrel={err:.2e}")


def _store_child(store: str, phase: str) -> None:
    import cudnorm
    from cudnorm import _graphs, _runtime
    torch.ones(1, device="cuda")
    _runtime.handle(0)
    probe = torch.ones(2, device="cuda", requires_grad=True)
    (probe * 2).backward(torch.ones(2, device="cuda"))
    deser = []
    original = _graphs.deserialize_plan

    def timed(*a, **k):
        s = time.perf_counter()
        out = original(*a, **k)
        deser.append(round((time.perf_counter() - s) * 1e3, 1))
        return out
    _graphs.deserialize_plan = timed
    from cudnorm import _plan_store  # noqa: F401
    results = []
    for op, (rows, cols) in [("layer_norm", (8192, 4096)), ("rms_norm", (8192, 4096)), ("layer_norm", (2048, 1024)),
                             ("rms_norm", (32768, 4096))]:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(cols, device="cuda", requires_grad=True)
        dy = torch.randn_like(x)
        fn = (lambda: cudnorm.layer_norm(x, (cols,), w)) if op == "layer_norm" else (lambda: cudnorm.rms_norm(x, (cols,), w))
        torch.cuda.synchronize()
        s = time.perf_counter()
        y = fn()
        torch.cuda.synchronize()
        m = time.perf_counter()
        y.backward(dy)
        torch.cuda.synchronize()
        e = time.perf_counter()
        results.append((op, rows, cols, round((m - s) * 1e3, 1), round((e - m) * 1e3, 1)))
    print(json.dumps({"phase": phase, "calls": results, "deserialize_ms": deser,
                      "info": str(cudnorm.cache_info())}))


def probe_store() -> None:
    with tempfile.TemporaryDirectory() as store:
        env = {**os.environ, "CUDNORM_PLAN_STORE_DIR": store, "CUDNORM_AUTOTUNE": "0"}
        env.pop("CUDNORM_PLAN_STORE", None)
        for phase in ("cold", "warm", "warm"):
            proc = subprocess.run([sys.executable, __file__, "store-child", store, phase], env=env,
                                  capture_output=True, text=True, timeout=300)
            print(proc.stdout.strip()[-2000:] or proc.stderr[-2000:])


def probe_launch() -> None:
    """Host us per Plan.run: exact vs dynamic chunk graph, base tensors vs row views vs ints."""
    from cudnorm import _graphs
    from cudnorm._spec import NormSpec
    rows = 256
    big = torch.randn(4 * rows, N, device="cuda", dtype=torch.bfloat16)
    for phase in ("train", "bwd"):
        sdt = torch.float32 if phase == "bwd" else torch.bfloat16
        for dynamic in (False, True):
            spec = NormSpec("layer_norm", phase, rows, N, torch.bfloat16, sdt, 0, dynamic=dynamic)
            t = time.perf_counter()
            try:
                plan = _graphs.build_plan(spec)
            except Exception as exc:
                print(f"launch {phase} dynamic={dynamic}: build failed {exc}")
                continue
            build = time.perf_counter() - t
            bufs = _graphs.dummy_buffers(spec)
            roles = _graphs.roles(spec)
            row_roles = {"x", "y", "dy", "dx"}
            views = [big[rows:2 * rows] if r in row_roles else b for r, b in zip(roles, bufs)]
            ints = [b.data_ptr() if b.is_cuda else b for b in views]
            for name, args in (("base", bufs), ("view", views), ("int", ints)):
                try:
                    for _ in range(20):
                        plan.run(*args)
                    torch.cuda.synchronize()
                    s = time.perf_counter()
                    for _ in range(1000):
                        plan.run(*args)
                    host = (time.perf_counter() - s) * 1e3
                    torch.cuda.synchronize()
                    print(f"launch {phase:5s} dynamic={dynamic!s:5s} build {build:5.2f} s  {name:4s}: {host:6.1f} us/run")
                except Exception as exc:
                    print(f"launch {phase} dynamic={dynamic} {name}: FAILED {type(exc).__name__} {str(exc)[:200]}")
    # slicing cost
    s = time.perf_counter()
    for i in range(10000):
        big[i % 7:i % 7 + 100]
    print(f"launch: tensor row slice {(time.perf_counter() - s) * 1e2:.2f} us")


def probe_build() -> None:
    """Where a backward chunk graph's build time goes; heuristics A only vs A+B+FALLBACK;
    whether two builds overlap in threads."""
    import threading

    import cudnn

    from cudnorm import _graphs, _runtime
    from cudnorm._spec import NormSpec
    h = _runtime.handle(0)

    def build(spec, modes):
        times = {}
        t = time.perf_counter()
        g, _ = _graphs.build_ir(spec, handle=h)
        g.validate()
        times["validate"] = time.perf_counter() - t
        g.build_operation_graph()
        times["opgraph"] = time.perf_counter() - t
        g.create_execution_plans(modes)
        times["heur"] = time.perf_counter() - t
        g.check_support()
        times["support"] = time.perf_counter() - t
        g.build_plans()
        times["plans"] = time.perf_counter() - t
        return {k: round(v, 3) for k, v in times.items()}, g.get_plan_name_at_index(0)

    A, B, F = cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK
    rows_list = [4096, 16384, 8192, 12288, 20000]
    for i, rows in enumerate(rows_list):
        for phase in ("bwd", "train"):
            sdt = torch.float32 if phase == "bwd" else torch.bfloat16
            spec = NormSpec("layer_norm", phase, rows, N, torch.bfloat16, sdt, 0)
            for modes, label in (([A, B, F], "ABF"), ([A], "A")):
                times, name = build(spec, modes)
                print(f"build {phase:5s} rows={rows:6d} {label:3s}: cumulative {times} plan={name}")
    specs = [NormSpec("layer_norm", "bwd", r, N, torch.bfloat16, torch.float32, 0) for r in (2048, 6144)]
    t = time.perf_counter()
    for s_ in specs:
        _graphs.build_plan(s_)
    serial = time.perf_counter() - t
    specs = [NormSpec("layer_norm", "bwd", r, N, torch.bfloat16, torch.float32, 0) for r in (3072, 7168)]
    threads = [threading.Thread(target=_graphs.build_plan, args=(s_,)) for s_ in specs]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    print(f"build: two bwd graphs serial {serial:.2f} s, in two threads {time.perf_counter() - t:.2f} s")


def probe_dyn() -> None:
    """Dynamic-shape exact graphs per row count: build seconds (shared kernel cache, mode A)
    and GPU time vs the static graph; then host time per step of exact-shape graphs."""
    from cudnorm import _graphs
    from cudnorm._spec import NormSpec
    for phase in ("train", "bwd"):
        sdt = torch.float32 if phase == "bwd" else torch.bfloat16
        for rows in (5000, 12000, 33000, 50000, 60000, 33001):
            spec = NormSpec("layer_norm", phase, rows, N, torch.bfloat16, sdt, 0, dynamic=True)
            t = time.perf_counter()
            try:
                plan = _graphs.build_plan(spec)
            except Exception as exc:
                print(f"dyn {phase} rows={rows}: FAILED {type(exc).__name__} {str(exc)[:200]}")
                break
            print(f"dyn {phase} rows={rows}: build {time.perf_counter() - t:.3f} s plan={plan.plan_name}")
        for dynamic in (True, False):
            spec = NormSpec("layer_norm", phase, 33000, N, torch.bfloat16, sdt, 0, dynamic=dynamic)
            plan = _graphs.build_plan(spec)
            bufs = _graphs.dummy_buffers(spec)
            ms = _time(lambda: plan.run(*bufs))
            print(f"dyn {phase} rows=33000 dynamic={dynamic}: {ms * 1e3:.1f} us GPU")
    import cudnorm
    cudnorm.config(exact_rows=100000)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x_all = torch.randn(65536, N, device="cuda", generator=gen).to(torch.bfloat16)
    dy_all = torch.randn(65536, N, device="cuda", generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(N, device="cuda", generator=gen)).requires_grad_()
    b = (0.1 * torch.randn(N, device="cuda", generator=gen)).requires_grad_()
    counts = random.Random(0).sample(range(1, 65537), 12)
    for rows in counts:
        x = x_all[:rows].detach().requires_grad_()
        cudnorm.layer_norm(x, (N,), w, b).backward(dy_all[:rows])
    torch.cuda.synchronize()
    for _ in range(2):
        t0 = time.perf_counter()
        fwd_t = bwd_t = 0.0
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for rows in counts:
            x = x_all[:rows].detach().requires_grad_()
            s = time.perf_counter()
            y = cudnorm.layer_norm(x, (N,), w, b)
            m = time.perf_counter()
            y.backward(dy_all[:rows])
            fwd_t += m - s
            bwd_t += time.perf_counter() - m
        host = time.perf_counter() - t0
        ev[1].record()
        torch.cuda.synchronize()
        print(f"exact steps: host {host * 1e3 / len(counts):.0f} us/step (fwd {fwd_t * 1e6 / len(counts):.0f}, "
              f"bwd {bwd_t * 1e6 / len(counts):.0f}); GPU pass {ev[0].elapsed_time(ev[1]) / len(counts) * 1e3:.0f} us/step")


def probe_cast2() -> None:
    """fp32 weight+bias to bf16 per call: two .to() vs one _foreach_copy_ (kernels, host, GPU);
    and host time of the grad-enabled cudnorm.layer_norm forward at (32768, 1024)."""
    import cudnorm
    n = 1024
    w = torch.randn(n, device="cuda", requires_grad=True)
    b = torch.randn(n, device="cuda", requires_grad=True)

    def two():
        return w.to(torch.bfloat16), b.to(torch.bfloat16)

    def fused():
        pair = torch.empty((2, n), dtype=torch.bfloat16, device="cuda")
        rows = pair.unbind(0)
        torch._foreach_copy_(list(rows), [w.detach(), b.detach()])
        return rows

    for name, fn in (("two .to()", two), ("foreach", fused)):
        with torch.no_grad():
            out = fn()
            assert torch.equal(out[0], w.detach().to(torch.bfloat16)) and torch.equal(out[1], b.detach().to(torch.bfloat16))
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
            gpu = _time(fn)
            torch.cuda.synchronize()
            s = time.perf_counter()
            for _ in range(2000):
                fn()
            host = (time.perf_counter() - s) / 2000 * 1e6
            torch.cuda.synchronize()
        print(f"cast2 {name}: {len(kernels)} kernels {kernels[:3]}, GPU {gpu * 1e3:.1f} us, host {host:.1f} us")
    x = torch.randn(32768, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for label, (ww, bb) in (("fp32 w,b", (w, b)), ("bf16 w,b", (w.detach().bfloat16().requires_grad_(), b.detach().bfloat16().requires_grad_()))):
        fn = lambda: cudnorm.layer_norm(x, (n,), ww, bb)  # noqa: E731
        gpu = _time(fn)
        torch.cuda.synchronize()
        s = time.perf_counter()
        for _ in range(300):
            fn()
        host = (time.perf_counter() - s) / 300 * 1e6
        torch.cuda.synchronize()
        print(f"cast2 layer_norm fwd grad-enabled (32768,{n}) {label}: host {host:.1f} us/call (GPU-bound if < GPU), events {gpu * 1e3:.1f} us")


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "store-child":
        _store_child(sys.argv[2], sys.argv[3])
    else:
        {"rows": probe_rows, "cast": probe_cast, "store": probe_store, "launch": probe_launch,
         "build": probe_build, "dyn": probe_dyn, "cast2": probe_cast2}[what]()
