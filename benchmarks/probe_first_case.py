"""Why did the first case of api_vs_raw.py (LayerNorm forward, 32768 x 1024, bf16 x, fp32
weights, training) read 0.40-0.45 of raw execute in some processes and 0.95-0.97 in others?

In a fresh process, the API call and the raw launch of its plan are timed in alternation
(triton's do_bench, L2 flushed), with fp32 and then bf16 weights, then RMSNorm; each line
also gives the host wall time per call (back-to-back calls, one synchronize).

    PYTHONPATH=. python benchmarks/probe_first_case.py
"""

from __future__ import annotations

import torch

import cudnorm
from cudnorm import _cache, _graphs, _runtime
from cudnorm._bench.cuda_graph import wall_us_per_call

M, N = 32768, 1024


def do_bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def raw_launch(op: str):
    spec = [s for s in _cache.plans.specs() if s.op == op and s.phase == "train" and s.rows == M][-1]
    plan = _cache.plans.lookup(spec)
    buffers = _graphs.dummy_buffers(spec)
    ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")
    h = _runtime.handle(0)
    return plan.plan_name, lambda: plan.graph.execute(buffers, ws, handle=h, tensor_uids=plan.uids)


def case(op: str, wdtype: torch.dtype) -> None:
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=wdtype, requires_grad=True)
    b = torch.randn(N, device="cuda", dtype=wdtype, requires_grad=True)
    fn = (lambda: cudnorm.layer_norm(x, (N,), w, b)) if op == "layer_norm" else (lambda: cudnorm.rms_norm(x, (N,), w))
    fn()
    name, raw = raw_launch(op)
    api_ms, raw_ms = [], []
    for _ in range(4):
        api_ms.append(do_bench(fn))
        raw_ms.append(do_bench(raw))
    host = wall_us_per_call(fn, 500, warmup=50)
    print(f"{op:10s} w={str(wdtype)[6:]:8s} api ms {' '.join(f'{t:.4f}' for t in api_ms)} | raw ms "
          f"{' '.join(f'{t:.4f}' for t in raw_ms)} | api host {host:.1f} us/call | {name}", flush=True)


def main() -> None:
    print(f"device {torch.cuda.get_device_name()}")
    for op, wdtype in (("layer_norm", torch.float32), ("layer_norm", torch.bfloat16), ("rms_norm", torch.float32),
                       ("layer_norm", torch.float32)):
        case(op, wdtype)


if __name__ == "__main__":
    main()
