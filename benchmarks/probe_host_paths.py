"""Host time per call of the public API at the issue shapes, with the GPU held busy.

For each case: ``host_us``, the Python/driver time of one call measured while a long
``torch.cuda._sleep`` kernel keeps the stream busy, so the call only enqueues work and its
wall time is host time (the GPU cannot be the bound); and ``loop_us``, the wall time per
call of back-to-back calls with one synchronize at the end (max of host and GPU time).
Where ``host_us`` exceeds the GPU time of the work, the public API is host-bound there.
Then a cProfile (cumulative, top entries) of the cases named by ``--profile``.

Run: PYTHONPATH=. python benchmarks/probe_host_paths.py [--profile SUBSTRING ...]   (GPU only)
"""

from __future__ import annotations

import argparse
import importlib
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F

import cudnorm
from cudnorm._bench.cuda_graph import wall_us_per_call

ADA_SHAPES = ((4, 1024, 768), (32, 256, 1152), (8, 4096, 1152), (16, 4096, 3072), (2, 4096, 1536))
# Fewer than ~19 launches of a CUDA graph holding cuDNN kernels may be pending before a launch
# waits for the queue to drain (benchmarks/probe_replay_block.py, H200): stay below that.
CALLS = 12
SLEEP_CYCLES = 80_000_000  # ~40 ms at H200 clocks: longer than CALLS calls of any case here


def host_us(fn, calls: int = CALLS) -> float:
    """Median over 3 rounds of the wall time per call of ``calls`` calls enqueued behind a
    sleeping kernel (host time only)."""
    samples = []
    for _ in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(samples)[1]


def loop_us(fn, calls: int = 100) -> float:
    """Back-to-back calls, one synchronize at the end (the warm-up already ran)."""
    return wall_us_per_call(fn, calls, warmup=0)


def ada_cases(with_compile: bool = True):
    def formula(x, scale, shift):
        return F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]

    torch._dynamo.config.recompile_limit = 64  # one compile per shape and grad mode
    compiled = torch.compile(formula, fullgraph=True, dynamic=False)
    for b, s, d in ADA_SHAPES:
        x = torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16)
        scale = (0.1 * torch.randn(b, d, device="cuda")).bfloat16()
        shift = (0.1 * torch.randn(b, d, device="cuda")).bfloat16()
        dy = torch.randn_like(x)
        leaves = [t.clone().requires_grad_(True) for t in (x, scale, shift)]
        tag = f"ada {b}x{s}x{d}"
        providers = (("cudnorm", lambda *a: cudnorm.ada_layer_norm(*a, eps=1e-6, one_plus_scale=True)),
                     ("compile", compiled))
        for name, fn in providers[:2 if with_compile else 1]:
            def infer(fn=fn, args=(x, scale, shift)):
                with torch.no_grad():
                    return fn(*args)

            y = fn(*leaves)
            yield f"{tag} fwd infer {name}", infer
            yield f"{tag} fwd train {name}", lambda fn=fn, leaves=leaves: fn(*leaves)
            yield f"{tag} bwd {name}", \
                lambda y=y, leaves=leaves, dy=dy: torch.autograd.grad(y, leaves, dy, retain_graph=True)
        ada = importlib.import_module("cudnorm.ada_layer_norm")
        with torch.no_grad():
            _, mean, rstd = ada._forward(x, scale, shift, 1e-6, True, True)
        yield f"{tag} bwd impl direct", \
            lambda a=(dy, x, scale, mean, rstd, True, shift.dtype): ada._backward_impl(*a)


def norm_cases():
    m, n = 32768, 1024
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, device="cuda", requires_grad=True)
    b = torch.randn(n, device="cuda", requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for op, fwd, params in (("layer_norm", lambda t: cudnorm.layer_norm(t, (n,), w, b), [x, w, b]),
                            ("rms_norm", lambda t: cudnorm.rms_norm(t, (n,), w), [x, w])):
        y = fwd(x)
        yield f"{op} {m}x{n} fwd train", lambda fwd=fwd: fwd(x)
        impl = importlib.import_module(f"cudnorm.{op}")._backward_impl
        with torch.no_grad():
            stats = importlib.import_module(f"cudnorm.{op}")._forward(x, w, b, 1e-5, True)[1:] \
                if op == "layer_norm" else importlib.import_module(f"cudnorm.{op}")._forward(x, w, 1e-5, True)[1:]
        # the backward implementation alone, on this thread (cProfile sees it; autograd runs
        # backward nodes on its device thread, which cProfile does not)
        yield f"{op} {m}x{n} bwd impl direct", lambda impl=impl, stats=stats: impl(dy, x.detach(), w.detach(), *stats)
        yield f"{op} {m}x{n} bwd single grad", lambda y=y, p=params: torch.autograd.grad(y, p, dy, retain_graph=True)
        chain = x
        for _ in range(8):
            chain = fwd(chain)
        yield f"{op} {m}x{n} bwd 8-chain (per call of 8)", \
            lambda c=chain, p=params: torch.autograd.grad(c, p, dy, retain_graph=True)
    y2 = x * 2
    yield f"x * 2 {m}x{n} bwd single grad (engine floor)", lambda: torch.autograd.grad(y2, [x], dy, retain_graph=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", nargs="*", default=[], help="substrings of case names to cProfile")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile cases")
    args = parser.parse_args(argv)
    from cudnorm import _runtime

    status = _runtime.cudnn_status()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN status {status}")
    if _runtime.route(torch.empty(8, device="cuda")) is not None:
        raise SystemExit("cuDNN does not serve CUDA tensors here: nothing to measure")
    print(f"{'case':54s} {'host_us':>9s} {'loop_us':>9s}")
    for name, fn in (*norm_cases(), *ada_cases(not args.no_compile)):
        if args.only not in name:
            continue
        for _ in range(20):
            fn()  # builds, captures, compiles
        torch.cuda.synchronize()
        print(f"{name:54s} {host_us(fn):9.1f} {loop_us(fn):9.1f}", flush=True)
        if any(p in name for p in args.profile):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
            print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
