"""Probe for variable row counts (issue 5): what a new row count costs, and what chunking costs.

(a) build seconds of LN forward/backward graphs at N=4096 for new row counts, plain vs
    ``is_dynamic_shape_enabled`` + a shared kernel cache;
(b) GPU time of one exact-shape graph vs the same rows run as launches of a fixed-size
    chunk graph (pointer offsets), for fwd and bwd (bwd chunk dW/dB summed afterwards).

Run: PYTHONPATH=. python benchmarks/probe_rows.py   (GPU only)
"""

from __future__ import annotations

import time

import torch
import triton

from cudnorm import _graphs, _runtime
from cudnorm._spec import NormSpec

N = 4096


def spec(phase, rows):
    return NormSpec("layer_norm", phase, rows, N, torch.bfloat16, torch.float32 if phase == "bwd" else torch.bfloat16, 0)


def timed_build(s, dynamic=False, kernel_cache=None):
    cudnn = _runtime.cudnn_module()
    h = _runtime.handle(0)
    start = time.perf_counter()
    g, uids = _graphs.build_ir(s, handle=h) if not dynamic else _dynamic_ir(s, h, kernel_cache)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, uids, time.perf_counter() - start


def _dynamic_ir(s, h, kernel_cache):
    cudnn = _runtime.cudnn_module()
    original = cudnn.pygraph

    def patched(**kw):
        return original(**kw, is_dynamic_shape_enabled=True, kernel_cache=kernel_cache)

    cudnn.pygraph = patched
    try:
        return _graphs.build_ir(s, handle=h)
    finally:
        cudnn.pygraph = original


def main():
    cudnn = _runtime.cudnn_module()
    print("(a) build seconds, N=4096")
    for phase in ("train", "bwd"):
        kc = cudnn.create_kernel_cache()
        for rows in (1000, 3000, 5000, 20000, 40000):
            try:
                _, _, plain = timed_build(spec(phase, rows))
                _, _, dyn = timed_build(spec(phase, rows + 1), dynamic=True, kernel_cache=kc)
                print(f"  {phase:5s} rows={rows:6d} plain {plain:.3f}s  dynamic+kc {dyn:.3f}s", flush=True)
            except Exception as exc:
                print(f"  {phase} rows={rows}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)

    print("(b) exact graph vs fixed chunks, N=4096 (ms)")
    h = _runtime.handle(0)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")  # noqa: E731
    for total in (30000, 65536, 3000):
        for phase in ("train", "bwd"):
            s = spec(phase, total)
            g, uids, _ = timed_build(s)
            bufs = _graphs.dummy_buffers(s)
            ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
            exact = bench(lambda: g.execute(bufs, ws, handle=h, tensor_uids=uids))
            line = f"  {phase:5s} M={total:6d} exact {exact:.4f}"
            for chunk in (1024, 4096, 16384):
                if chunk > total:
                    continue
                cs = spec(phase, chunk)
                cg, cuids, _ = timed_build(cs)
                cws = torch.empty(max(cg.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
                n_chunks = total // chunk
                roles = _graphs.roles(cs)
                row_roles = {"x", "y", "dy", "dx", "mean", "rstd"}
                packs = []
                partial = torch.empty(n_chunks, 2, N, device="cuda")
                for i in range(n_chunks):
                    pack = []
                    for role, b in zip(roles, bufs):
                        if role in row_roles:
                            pack.append(b[i * chunk:(i + 1) * chunk])
                        elif role in ("dscale", "dbias"):
                            pack.append(partial[i, 0 if role == "dscale" else 1])
                        else:
                            pack.append(b)
                    packs.append(tuple(pack))

                def run_chunks():
                    for p in packs:
                        cg.execute(p, cws, handle=h, tensor_uids=cuids)
                    if phase == "bwd":
                        partial.sum(0)

                line += f"  chunks{chunk}x{n_chunks} {bench(run_chunks):.4f}"
            print(line, flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
