"""Public API vs raw graph execute, the fp32-weight forward, autotuning and host overhead.

For LN/RMS forward (training) and backward at M=32768, N in {1024, 4096, 16384}, bf16 x:
  * GB/s of the public API (cudnorm.layer_norm / rms_norm with fp32 weights, as in the seed
    benchmark; backward through autograd.grad of one call, and per layer of an 8-layer chain)
  * GB/s of the raw ordered execute of the very plan the API uses (buffers preallocated),
    and of cudnorm's raw-pointer launch of it (``cudnorm._graphs.RawExecute``)
  * the fp32-weight forward through the API (each ``fp32_weight_fwd`` mode) vs the naive
    graph that reads an fp32 scale ("native")
Then autotune gain/cost and host microseconds per call at (64, 4096).

``--parts torch`` measures the same ratio for PyTorch's own LayerNorm (bf16 weights): its
public API (``F.layer_norm``; backward through ``autograd.grad`` of one call and of an
8-layer chain) against its ATen kernels called directly (``native_layer_norm`` /
``native_layer_norm_backward`` on preallocated inputs): the ceiling any op that goes through
torch's dispatcher and autograd engine meets on this host.

Run: PYTHONPATH=. python benchmarks/api_vs_raw.py [--out DIR]   (GPU only)
"""

from __future__ import annotations

import argparse
import csv
import os
import time

import torch

import cudnorm
from cudnorm import _cache, _graphs
from cudnorm._bench.cuda_graph import wall_us_per_call

M = 32768
SIZES = (1024, 4096, 16384)


def bench_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_gbps() -> float:
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    del a, b
    return 2 * (1 << 31) / ms * 1e-6


def nbytes(op, direction, n):
    io = 2 * M * n * 2 if direction == "fwd" else 3 * M * n * 2
    params = (2 if op == "layer_norm" else 1) * n * 4
    stats = (2 if op == "layer_norm" else 1) * M * 4
    return io + (params if direction == "fwd" else 2 * params) + stats


def latest_plan(op, phase):
    matches = [s for s in _cache.plans.specs() if s.op == op and s.phase == phase and s.rows == M]
    return _cache.plans.lookup(matches[-1])


def raw_callable(plan):
    spec = plan.spec
    buffers = _graphs.dummy_buffers(spec)
    ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")
    from cudnorm import _runtime

    h = _runtime.handle(0)
    public = lambda: plan.graph.execute(buffers, ws, handle=h, tensor_uids=plan.uids)  # noqa: E731
    # cudnorm's own launcher (the frontend's C++ graph by pointer array), when the plan has one
    addresses = [b.data_ptr() for b in buffers]
    backend = _runtime.launch_context(0, 0)[0].backend
    pointers = (lambda: plan.raw.launch(addresses, ws, backend)) if plan.raw is not None else None
    return public, pointers


def api_case(op, n, wdtype):
    x = torch.randn(M, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=wdtype, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=wdtype, requires_grad=True)
    dy = torch.randn(M, n, device="cuda", dtype=torch.bfloat16)
    if op == "layer_norm":
        fwd = lambda: cudnorm.layer_norm(x, (n,), w, b)  # noqa: E731
        params = [x, w, b]
    else:
        fwd = lambda: cudnorm.rms_norm(x, (n,), w)  # noqa: E731
        params = [x, w]
    y = fwd()
    return fwd, (lambda: torch.autograd.grad(y, params, dy, retain_graph=True))


CHAIN = 8  # layers per backward in the in-model measurement
ROUNDS = 3  # timings of each callable per case (median kept)


def chain_case(op, n, wdtype):
    """``CHAIN`` norms applied one after another, and one ``autograd.grad`` through all of
    them: the per-layer backward cost inside a model, where autograd's fixed per-call cost
    (~55 us of thread hand-off on an H200, paid even by ``x * 2``) is shared by the layers."""
    x = torch.randn(M, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(n, device="cuda", dtype=wdtype, requires_grad=True) for _ in range(CHAIN)]
    bs = [torch.randn(n, device="cuda", dtype=wdtype, requires_grad=True) for _ in range(CHAIN)]
    dy = torch.randn(M, n, device="cuda", dtype=torch.bfloat16)
    y = x
    for w, b in zip(ws, bs):
        y = cudnorm.layer_norm(y, (n,), w, b) if op == "layer_norm" else cudnorm.rms_norm(y, (n,), w)
    params = [x, *ws, *(bs if op == "layer_norm" else [])]
    return lambda: torch.autograd.grad(y, params, dy, retain_graph=True)


def run_api_vs_raw(rows, copy):
    for op in ("layer_norm", "rms_norm"):
        for n in SIZES:
            fwd, bwd = api_case(op, n, torch.float32)
            cases = (("fwd", fwd, "train", 1, "single call"), ("bwd", bwd, "bwd", 1, "single autograd.grad"),
                     ("bwd", chain_case(op, n, torch.float32), "bwd", CHAIN, f"{CHAIN}-layer chain, one autograd.grad"))
            for direction, fn, phase, layers, how in cases:
                fn()  # builds the plan the raw launches run
                public, pointers = raw_callable(latest_plan(op, phase))
                # API and raw launches timed in alternation, the median of ROUNDS kept: the
                # first case of a process once read 0.40 of raw where other runs read 0.97
                timed = {"api": fn, "raw": public, "ptr": pointers}
                samples = {k: [] for k in timed}
                for _ in range(ROUNDS):
                    for k, f in timed.items():
                        samples[k].append(bench_ms(f) if f is not None else float("nan"))
                api_ms, raw_ms, ptr_ms = (sorted(t)[len(t) // 2] for t in samples.values())
                api_ms /= layers
                nb = nbytes(op, direction, n)
                rows.append(dict(test="api_vs_raw", op=op, direction=direction, N=n, how=how, api_ms=api_ms,
                                 raw_ms=raw_ms, api_GBps=nb / api_ms * 1e-6, raw_GBps=nb / raw_ms * 1e-6,
                                 api_over_raw=raw_ms / api_ms, rawptr_ms=ptr_ms, api_over_rawptr=ptr_ms / api_ms,
                                 pct_copy=100 * nb / api_ms * 1e-6 / copy, plan=latest_plan(op, phase).plan_name))
            torch.cuda.empty_cache()


def run_torch_ceiling(rows, copy):
    """PyTorch's LayerNorm: public API vs its own kernels, timed as :func:`run_api_vs_raw` times ours."""
    import torch.nn.functional as F

    aten = torch.ops.aten
    for n in SIZES:
        x = torch.randn(M, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, n, device="cuda", dtype=torch.bfloat16)
        xd = x.detach()
        _, mean, rstd = aten.native_layer_norm(xd, [n], w.detach(), b.detach(), 1e-5)
        y = F.layer_norm(x, (n,), w, b)
        chain = x
        ws = [torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(CHAIN)]
        for wk in ws:
            chain = F.layer_norm(chain, (n,), wk, b)
        chain_params = [x, b, *ws]
        cases = (
            ("fwd", "single call", lambda: F.layer_norm(x, (n,), w, b),
             lambda: aten.native_layer_norm(xd, [n], w.detach(), b.detach(), 1e-5), 1),
            ("bwd", "single autograd.grad", lambda: torch.autograd.grad(y, [x, w, b], dy, retain_graph=True),
             lambda: aten.native_layer_norm_backward(dy, xd, [n], mean, rstd, w.detach(), b.detach(),
                                                     [True, True, True]), 1),
            ("bwd", f"{CHAIN}-layer chain, one autograd.grad",
             lambda: torch.autograd.grad(chain, chain_params, dy, retain_graph=True),
             lambda: aten.native_layer_norm_backward(dy, xd, [n], mean, rstd, w.detach(), b.detach(),
                                                     [True, True, True]), CHAIN),
        )
        for direction, how, api, raw, layers in cases:
            samples = {"api": [], "raw": []}
            for _ in range(ROUNDS):
                samples["api"].append(bench_ms(api))
                samples["raw"].append(bench_ms(raw))
            api_ms, raw_ms = (sorted(t)[len(t) // 2] for t in samples.values())
            api_ms /= layers
            nb = nbytes("layer_norm", direction, n)
            rows.append(dict(test="torch_ceiling", op="torch layer_norm (bf16 w)", direction=direction, N=n, how=how,
                             api_ms=api_ms, raw_ms=raw_ms, api_GBps=nb / api_ms * 1e-6, raw_GBps=nb / raw_ms * 1e-6,
                             api_over_raw=raw_ms / api_ms, pct_copy=100 * nb / api_ms * 1e-6 / copy))
        del x, w, b, dy, y, chain, ws
        torch.cuda.empty_cache()


def run_fp32_weight_modes(rows):
    """The fp32-weight forward through the API in each ``fp32_weight_fwd`` mode."""
    for op in ("layer_norm", "rms_norm"):
        for n in SIZES:
            times = {}
            for mode in ("round", "native"):
                with cudnorm.config(fp32_weight_fwd=mode):
                    try:
                        fwd, _ = api_case(op, n, torch.float32)
                        times[mode] = bench_ms(fwd)
                    except Exception as exc:  # a mode cuDNN refuses is reported, not hidden
                        times[mode] = float("nan")
                        print(f"fp32 weights {op} N={n} mode={mode}: {type(exc).__name__}: {exc}")
            nb = nbytes(op, "fwd", n)
            plans = [s for s in _cache.plans.specs() if s.op == op and s.phase == "train" and s.cols == n]
            rows.append(dict(test="fp32_weight_fwd", op=op, direction="fwd", N=n,
                             **{f"{m}_GBps": nb / t * 1e-6 for m, t in times.items()},
                             round_vs_native=times["native"] / times["round"],
                             scale_dtypes=",".join(sorted({str(s.scale_dtype)[6:] for s in plans}))))
            torch.cuda.empty_cache()


def run_autotune(rows):
    for op, n in (("layer_norm", 4096), ("layer_norm", 1024), ("rms_norm", 4096), ("rms_norm", 16384)):
        for phase in ("train", "bwd"):
            base = dict(op=op, phase=phase, rows=M, cols=n, x_dtype=torch.bfloat16, device_index=0,
                        scale_dtype=torch.float32 if phase == "bwd" else torch.bfloat16)
            first = _graphs.build_plan(_graphs.NormSpec(**base))
            tuned = _graphs.build_plan(_graphs.NormSpec(**base, autotune=True))
            t_first, t_tuned = bench_ms(raw_callable(first)[0]), bench_ms(raw_callable(tuned)[0])
            rows.append(dict(test="autotune", op=op, direction=phase, N=n, first_ms=t_first, tuned_ms=t_tuned,
                             speedup=t_first / t_tuned, build_s=first.build_seconds, tune_s=tuned.build_seconds,
                             candidates=tuned.candidates_timed, first_plan=first.plan_name, tuned_plan=tuned.plan_name))


def host_us(fn, calls=2000) -> float:
    return wall_us_per_call(fn, calls, warmup=50)


def run_host_overhead(rows):
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w16 = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    b16 = torch.randn_like(w16)
    w32, b32 = w16.float(), b16.float()
    import torch.nn.functional as F

    with torch.no_grad():
        cases = {
            "cudnorm.layer_norm bf16 w": lambda: cudnorm.layer_norm(x, (4096,), w16, b16),
            "cudnorm.layer_norm fp32 w": lambda: cudnorm.layer_norm(x, (4096,), w32, b32),
            "cudnorm.rms_norm bf16 w": lambda: cudnorm.rms_norm(x, (4096,), w16, 1e-6),
            "torch F.layer_norm bf16 w": lambda: F.layer_norm(x, (4096,), w16, b16),
        }
        cases["cudnorm.layer_norm bf16 w"]()
        plan = [_cache.plans.lookup(s) for s in _cache.plans.specs() if s.rows == 64 and s.op == "layer_norm"][0]
        public, pointers = raw_callable(plan)
        cases["raw ordered execute (same plan)"] = public
        if pointers is not None:
            cases["cudnorm raw-pointer launch (same plan)"] = pointers
        try:
            from cudnn.ops.norm import layer_norm as upstream

            cases["cudnn.ops.norm.layer_norm fp32 w"] = lambda: upstream(x, (4096,), w32, b32, 1e-5)
        except Exception as exc:
            print("upstream cudnn.ops.norm not available:", exc)
        for name, fn in cases.items():
            rows.append(dict(test="host_overhead", op=name, direction="fwd", N=4096, us_per_call=host_us(fn)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--parts", default="api,fp32,autotune,host")
    args = parser.parse_args()
    cudnorm.config(policy="cudnn")  # the default policy hands the small host-overhead calls to PyTorch's ops
    copy = copy_gbps()
    print(f"device {torch.cuda.get_device_name()}  copy {copy:.0f} GB/s  cudnn {cudnorm.info()['cudnn_backend']}")
    rows: list[dict] = []
    parts = args.parts.split(",")
    for name, fn in (("api", lambda: run_api_vs_raw(rows, copy)), ("fp32", lambda: run_fp32_weight_modes(rows)),
                     ("autotune", lambda: run_autotune(rows)), ("host", lambda: run_host_overhead(rows)),
                     ("torch", lambda: run_torch_ceiling(rows, copy))):
        if name in parts:
            start = time.perf_counter()
            fn()
            print(f"[{name} done in {time.perf_counter() - start:.1f}s]", flush=True)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(args.out, "api_vs_raw.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    for r in rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    print("cache:", cudnorm.cache_info())


if __name__ == "__main__":
    main()
