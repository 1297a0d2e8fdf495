"""Backward through ``autograd.grad`` at M=32768, N=1024 (issue 2's weakest cell): which kernels
run and for how long, and how much host time a call costs, LayerNorm vs RMSNorm, fp32 weights.

    PYTHONPATH=. python benchmarks/probe_backward.py
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import cudnorm
from cudnorm._bench.cuda_graph import wall_us_per_call

M, N = 32768, 1024


def do_bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def wall_us(fn, calls=200) -> float:
    return wall_us_per_call(fn, calls)


def kernels(fn, calls=5) -> None:
    """Every CUDA kernel/memset/memcpy of ``calls`` calls: count and mean device us."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.device_time_total > 0 and e.device_type.name == "CUDA":
            print(f"      {e.count / calls:4.1f}x {e.device_time_total / e.count:8.1f} us  {e.key[:110]}")
    cpu = [e for e in prof.key_averages() if e.key in ("autograd::engine::evaluate_function: _LayerNormFunctionBackward",
                                                        "autograd::engine::evaluate_function: _RMSNormFunctionBackward")]
    for e in cpu:
        print(f"      host {e.key}: {e.cpu_time_total / e.count:.1f} us per call")


def main() -> None:
    print(f"device {torch.cuda.get_device_name()}")
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    for wdtype in (torch.float32, torch.bfloat16):
        w = torch.randn(N, device="cuda", dtype=wdtype, requires_grad=True)
        b = torch.randn(N, device="cuda", dtype=wdtype, requires_grad=True)
        cases = {"layer_norm": (lambda w=w, b=b: cudnorm.layer_norm(x, (N,), w, b), [x, w, b]),
                 "rms_norm": (lambda w=w: cudnorm.rms_norm(x, (N,), w), [x, w]),
                 "F.layer_norm": (lambda w=w, b=b: torch.nn.functional.layer_norm(x, (N,), w, b), [x, w, b]),
                 "F.rms_norm": (lambda w=w: torch.nn.functional.rms_norm(x, (N,), w), [x, w])}
        for name, (fwd, params) in cases.items():
            if name.startswith("F.") and wdtype is torch.float32:
                continue
            y = fwd()
            grad = lambda y=y, params=params: torch.autograd.grad(y, params, dy, retain_graph=True)
            grad_x = lambda y=y: torch.autograd.grad(y, [x], dy, retain_graph=True)
            print(f"  {name} {str(wdtype)[6:]} w: bench {do_bench(grad) * 1e3:7.1f} us, wall {wall_us(grad):7.1f} us/call,"
                  f" x only: bench {do_bench(grad_x) * 1e3:7.1f} us, wall {wall_us(grad_x):7.1f}")
            kernels(grad)
    y2 = x * 2
    print(f"  x * 2: bench {do_bench(lambda: torch.autograd.grad(y2, [x], dy, retain_graph=True)) * 1e3:7.1f} us, "
          f"wall {wall_us(lambda: torch.autograd.grad(y2, [x], dy, retain_graph=True)):7.1f} us/call")


if __name__ == "__main__":
    main()
