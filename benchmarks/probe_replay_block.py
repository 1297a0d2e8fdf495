"""Does replaying a CUDA graph block the host until the stream's earlier work is done?

Each case captures one small program in a ``torch.cuda.CUDAGraph`` and replays it ``CALLS``
times behind a ~40 ms ``torch.cuda._sleep`` kernel: host us per replay far below the sleep
means replays are queued asynchronously; about ``sleep / CALLS`` means one of them waited
for the GPU. Cases: a copy on one stream; copies forked to 2 side streams and joined; a
cuDNN LayerNorm forward / backward plan launched inside (cudnorm's Plan.run); the same with
``torch.cuda.graph`` instead of a bare capture; a graph replayed twice per round.

Run: PYTHONPATH=. python benchmarks/probe_replay_block.py   (GPU only)
"""

from __future__ import annotations

import time

import torch

import cudnorm
from cudnorm import _cache

CALLS = 40
SLEEP_CYCLES = 80_000_000


def host_us(fn) -> tuple[float, float]:
    """(us per call behind the sleep, us until the first call returned)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    for _ in range(CALLS - 1):
        fn()
    total = time.perf_counter() - start
    torch.cuda.synchronize()
    return total / CALLS * 1e6, first * 1e6


def captured(program, side_streams: int = 0):
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    sides = [torch.cuda.Stream() for _ in range(side_streams)]
    with torch.cuda.stream(stream):
        program()  # warm
        torch.cuda.synchronize()
        graph.capture_begin(capture_error_mode="thread_local")
        if sides:
            for s in sides:
                s.wait_stream(stream)
                with torch.cuda.stream(s):
                    program()
            for s in sides:
                stream.wait_stream(s)
        else:
            program()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph


def main() -> int:
    print(f"device {torch.cuda.get_device_name()}, driver {torch.cuda.driver_version() if hasattr(torch.cuda, 'driver_version') else '?'}, "
          f"torch {torch.__version__}, cuda {torch.version.cuda}")
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    cases = {"plain copy_ (no graph)": lambda: y.copy_(x)}
    g1 = captured(lambda: y.copy_(x))
    cases["graph: copy_, one stream"] = g1.replay
    g2 = captured(lambda: y.copy_(x), side_streams=2)
    cases["graph: copy_ forked to 2 side streams"] = g2.replay

    m, n = 4096, 1024
    xs = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, device="cuda", requires_grad=True)
    b = torch.randn(n, device="cuda", requires_grad=True)
    with torch.no_grad():
        cudnorm.layer_norm(xs, (n,), w.bfloat16(), b.bfloat16())
    plan = [_cache.plans.lookup(s) for s in _cache.plans.specs() if s.phase == "infer"][-1]
    yout = torch.empty_like(xs)
    from cudnorm._graphs import host_scalar

    wb, bb = w.detach().bfloat16(), b.detach().bfloat16()
    run_fwd = lambda: plan.run(xs.detach(), wb, bb, host_scalar(1e-5, plan.spec), yout)  # noqa: E731
    cases["plain cuDNN LN forward plan.run"] = run_fwd
    cases["graph: cuDNN LN forward plan.run"] = captured(run_fwd).replay
    cases["graph: cuDNN LN forward on 2 side streams"] = captured(run_fwd, side_streams=2).replay
    ga, gb, gc = (captured(run_fwd) for _ in range(3))

    def alternate(graphs=(ga, gb), state=[0]):  # noqa: B006 - the call counter
        state[0] += 1
        graphs[state[0] % len(graphs)].replay()

    cases["graph: cuDNN LN forward, 2 copies alternated"] = alternate
    cases["graph: cuDNN LN forward, 3 copies in turn"] = lambda: alternate((ga, gb, gc))

    def graph_then_plain():
        ga.replay()
        run_fwd()
    cases["graph: cuDNN LN forward replay, then plain run"] = graph_then_plain
    out = cudnorm.layer_norm(xs, (n,), w, b)
    dy = torch.randn_like(out)
    bwd = lambda: torch.autograd.grad(out, [xs, w, b], dy, retain_graph=True)  # noqa: E731
    cases["plain cudnorm LN backward (autograd.grad)"] = bwd

    def twice():
        g1.replay()
        g1.replay()
    cases["graph: copy_, replayed twice per call"] = twice
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        per, first = host_us(fn)
        print(f"{name:48s} host {per:8.1f} us/call, first call {first:8.1f} us", flush=True)

    # which launch waits: a pair of calls behind the sleep, each timed (ms)
    print("\npairs behind a ~40 ms sleep: ms of the first call, ms of the second call")
    plans = {}
    for op, phase in (("layer_norm", "train"), ("layer_norm", "bwd"), ("rms_norm", "train"), ("rms_norm", "bwd")):
        t = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        wt = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        o = cudnorm.layer_norm(t, (n,), wt, wt) if op == "layer_norm" else cudnorm.rms_norm(t, (n,), wt)
        o.backward(torch.randn_like(o))
        plans[(op, phase)] = [_cache.plans.lookup(s) for s in _cache.plans.specs() if (s.op, s.phase) == (op, phase)][-1]
    from cudnorm._graphs import dummy_buffers

    pairs = {"cuDNN graph, then copy graph": (ga.replay, g1.replay),
             "copy graph, then cuDNN graph": (g1.replay, ga.replay),
             "cuDNN graph, then plain cuDNN run": (ga.replay, run_fwd),
             "cuDNN graph copy A, then copy B": (ga.replay, gb.replay),
             "plain copy_, then cuDNN graph": (lambda: y.copy_(x), ga.replay)}
    for key, p in plans.items():
        bufs = dummy_buffers(p.spec)
        g = captured(lambda p=p, bufs=bufs: p.run(*bufs))
        pairs[f"{key[0]} {key[1]} graph ({p.plan_name[:24]}) twice"] = (g.replay, g.replay)
    for name, (first, second) in pairs.items():
        first(), second()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{name:60s} {1e3 * (t1 - t0):8.3f} {1e3 * (t2 - t1):8.3f}", flush=True)

    # after how many launches behind the sleep does one wait, and for how long
    def ten_copies():
        for _ in range(10):
            y.copy_(x)
    g10 = captured(ten_copies)
    print("\nlaunch index that waited (> 1 ms) among 300 behind the sleep, and its ms")
    for name, fn in (("copy graph", g1.replay), ("graph of 10 copies", g10.replay),
                     ("cuDNN LN forward graph", ga.replay), ("cuDNN LN forward graphs A/B alternated", alternate),
                     ("plain cuDNN LN forward", run_fwd)):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        waits = []
        for i in range(300):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if dt > 1e-3:
                waits.append((i, round(dt * 1e3, 2)))
        torch.cuda.synchronize()
        print(f"{name:44s} {waits[:6]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
