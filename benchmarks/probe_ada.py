"""AdaLN: where does the time of a call go, host or GPU? cudnorm against torch.compile.

For each DiT shape (bf16 x, bf16 scale/shift, ``norm(x) * (1 + scale) + shift``) and each of
forward-inference, forward-training and backward (``autograd.grad`` of x, scale, shift):

* ``bench``: median ms of one call as ``benchmarks/ada_backward_strategies.py`` times it
  (triton's ``do_bench``: L2 flushed before each call, so the flush kernel hides up to its own
  length of host time);
* ``host``: wall time per call of 200 back-to-back calls with one synchronize at the end
  (the host cost per call when it exceeds the GPU time, else the GPU time);
* ``gpu``: the same call captured in a CUDA graph and replayed (``do_bench``): GPU time alone.
  A backward is captured with its forward (autograd runs each backward node on its forward's
  stream), so ``bwd``'s gpu column is (forward + backward) minus the training forward.

    PYTHONPATH=. python benchmarks/probe_ada.py [--shapes 4x1024x768,...]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

import cudnorm
from cudnorm._bench.cuda_graph import wall_us_per_call

SHAPES = ((4, 1024, 768), (32, 256, 1152), (8, 4096, 1152), (16, 4096, 3072), (2, 4096, 1536))


def do_bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def host_ms(fn, calls: int = 200) -> float:
    return wall_us_per_call(fn, calls) / 1e3


def graph_ms(fn) -> float:
    """GPU time of ``fn`` alone: captured once, replays timed (``nan`` if capture fails; a
    failed capture leaves CUDA unusable, so keep ``fn`` capturable)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # noqa: BLE001 - report, keep probing
        print(f"    capture failed: {type(exc).__name__}: {str(exc)[:120]}")
        return float("nan")
    return do_bench(graph.replay)


def formula(x, scale, shift):
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]


def probe(shape, names=("cudnorm", "compile")) -> None:
    b, s, d = shape
    torch.manual_seed(0)
    x = torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16)
    scale = (0.1 * torch.randn(b, d, device="cuda")).to(torch.bfloat16)
    shift = (0.1 * torch.randn(b, d, device="cuda")).to(torch.bfloat16)
    dy = torch.randn_like(x)
    leaves = [t.clone().requires_grad_(True) for t in (x, scale, shift)]
    providers = {"cudnorm": functools.partial(cudnorm.ada_layer_norm, eps=1e-6, one_plus_scale=True),
                 "compile": torch.compile(formula, fullgraph=True, dynamic=False)}
    providers = {name: providers[name] for name in names}
    print(f"{b}x{s}x{d}: {'':10s} {'bench ms':>9} {'host ms':>9} {'gpu ms':>9}")
    for name, fn in providers.items():
        def infer(fn=fn):
            with torch.no_grad():
                return fn(x, scale, shift)

        train = functools.partial(fn, *leaves)
        y = fn(*leaves)
        grad = functools.partial(torch.autograd.grad, y, leaves, dy, retain_graph=True)

        # fresh leaves, first used inside graph_ms's side-stream warm-up: a leaf whose autograd
        # node was made on another stream syncs with that stream and breaks the capture
        step_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]

        def step(fn=fn, step_leaves=step_leaves):
            return torch.autograd.grad(fn(*step_leaves), step_leaves, dy)

        gpu = {"infer": graph_ms(infer), "train": graph_ms(train)}
        gpu["bwd"] = graph_ms(step) - gpu["train"]
        for phase, call in (("infer", infer), ("train", train), ("bwd", grad)):
            print(f"  {name:8s} {phase:5s} {do_bench(call):9.4f} {host_ms(call):9.4f} {gpu[phase]:9.4f}", flush=True)


def profile_backward(shape, calls: int = 200) -> None:
    """cProfile of ``calls`` backward calls of cudnorm (as the bench makes them), and the
    captured-graph cache's counters: where does the host time of the backward go?"""
    import cProfile
    import importlib
    import pstats

    ada = importlib.import_module("cudnorm.ada_layer_norm")
    b, s, d = shape
    leaves = [torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True),
              torch.randn(b, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True),
              torch.randn(b, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True)]
    dy = torch.randn_like(leaves[0])
    y = cudnorm.ada_layer_norm(*leaves, eps=1e-6, one_plus_scale=True)
    grad = functools.partial(torch.autograd.grad, y, leaves, dy, retain_graph=True)
    print(f"{b}x{s}x{d} backward: bench {do_bench(grad):.4f} ms, host {host_ms(grad):.4f} ms; captured graphs: "
          f"{len(ada._captured.entries)} entries, {ada._captured.replays} replays")
    def loop():
        for _ in range(calls):
            grad()  # each result dropped at once, as a training step drops its gradients

    prof = cProfile.Profile()
    prof.runcall(loop)
    torch.cuda.synchronize()
    torch.cuda.synchronize()
    print(f"after the profiled calls: {len(ada._captured.entries)} entries, {ada._captured.replays} replays")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    parser.add_argument("--providers", default="cudnorm,compile")
    parser.add_argument("--profile", action="store_true", help="cProfile cudnorm's backward at each shape instead")
    args = parser.parse_args()
    if args.profile:
        for text in args.shapes.split(","):
            profile_backward(tuple(int(v) for v in text.split("x")))
        return
    torch._dynamo.config.cache_size_limit = 64
    # compiled backwards donate buffers unless told not to, which forbids retain_graph=True
    torch._functorch.config.donated_buffer = False
    print(f"device {torch.cuda.get_device_name()}")
    for text in args.shapes.split(","):
        probe(tuple(int(v) for v in text.split("x")), args.providers.split(","))


if __name__ == "__main__":
    main()
