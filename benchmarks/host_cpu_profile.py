"""Host time of cudnorm's Python above the plan launch, on any machine (no GPU needed).

A no-op plan is installed for CPU tensors, so every call walks the real checks, memo and
dispatch code of the cuDNN path (``policy="cudnn"``: the default policy would hand these
small calls to PyTorch's ops) and stops where a GPU call would launch the graph. Lets
host-overhead work be measured without a GPU; absolute figures are this CPU's, ratios carry
over roughly.

Run: PYTHONPATH=. python benchmarks/host_cpu_profile.py [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import cudnorm
from cudnorm import _cache, _graphs, _runtime

M, N = 64, 4096
ADA_B, ADA_S, ADA_D = 4, 64, 768


def _noop_run(plan, *buffers):
    for b in buffers:
        if b is not None:
            b.data_ptr()


def install_noop_plans():
    """Route CPU tensors to 'cuDNN' and answer every spec with a plan whose launch does
    nothing. The plans are real :class:`~cudnorm._graphs.Plan` objects (the ops take their
    address path only for that exact type, so a subclass would time another branch); their
    ``run``/``launch`` are replaced for the process."""
    _runtime.route = lambda tensor: None
    _graphs.Plan.run = _noop_run
    _graphs.Plan.launch = lambda plan, pointers: None  # the ops' hot paths launch by address
    # a miss "builds" a no-op plan: the cache path stays the real one
    _cache._build = lambda spec: _graphs.Plan(spec=spec, graph=None, uids=(), workspace_size=0, plan_name="no-op",
                                              build_seconds=0.0)


def per_call_us(fn, calls: int = 20000, repeats: int = 5) -> float:
    """Best of ``repeats`` timings of ``calls`` back-to-back calls (this machine is shared)."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def cases():
    x = torch.randn(M, N, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    w16, b16 = torch.randn(N, dtype=torch.bfloat16), torch.randn(N, dtype=torch.bfloat16)
    w32, b32 = w16.float(), b16.float()
    w32g = w32.clone().requires_grad_(True)
    b32g = b32.clone().requires_grad_(True)
    # AdaLN: a DiT-like [B, S, D] with per-sample bf16 scale/shift [B, D]
    xa = torch.randn(ADA_B, ADA_S, ADA_D, dtype=torch.bfloat16)
    sa, ta = torch.randn(ADA_B, ADA_D, dtype=torch.bfloat16), torch.randn(ADA_B, ADA_D, dtype=torch.bfloat16)
    xag, sag, tag = (t.clone().requires_grad_(True) for t in (xa, sa, ta))
    dya = torch.randn_like(xa)
    return {
        "layer_norm no_grad bf16 w": (lambda: cudnorm.layer_norm(x, (N,), w16, b16), True),
        "layer_norm no_grad fp32 w": (lambda: cudnorm.layer_norm(x, (N,), w32, b32), True),
        "rms_norm no_grad bf16 w": (lambda: cudnorm.rms_norm(x, (N,), w16, 1e-6), True),
        "layer_norm train fp32 w": (lambda: cudnorm.layer_norm(xg, (N,), w32g, b32g), False),
        "rms_norm train fp32 w": (lambda: cudnorm.rms_norm(xg, (N,), w32g, 1e-6), False),
        "ada_layer_norm no_grad bf16": (lambda: cudnorm.ada_layer_norm(xa, sa, ta, one_plus_scale=True), True),
        "ada_layer_norm train bf16": (lambda: cudnorm.ada_layer_norm(xag, sag, tag, one_plus_scale=True), False),
        "ada_layer_norm fwd+grad bf16": (lambda: torch.autograd.grad(
            cudnorm.ada_layer_norm(xag, sag, tag, one_plus_scale=True), (xag, sag, tag), dya), False),
        "torch.empty_like (reference)": (lambda: torch.empty_like(x), True),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default=None, metavar="CASE", nargs="?", const="layer_norm no_grad bf16 w",
                        help="cProfile one case (default: the first)")
    args = parser.parse_args()
    install_noop_plans()
    cudnorm.config(policy="cudnn")
    for name, (fn, no_grad) in cases().items():
        with torch.no_grad() if no_grad else torch.enable_grad():
            print(f"{name:34s} {per_call_us(fn):7.2f} us")
    if args.profile:
        fn, no_grad = cases()[args.profile]
        with torch.no_grad() if no_grad else torch.enable_grad():
            prof = cProfile.Profile()
            prof.runcall(lambda: [fn() for _ in range(20000)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    print("cache:", _cache.plans.info())


if __name__ == "__main__":
    main()
