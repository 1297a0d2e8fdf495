"""Host cost per call of a small LayerNorm, where the GPU work (~2-3 us) is below it."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from .cuda_graph import wall_us_per_call

HOW = ("Each entry: {iters} back-to-back calls of layer_norm on x [{rows}, {cols}] bf16 (weight and bias "
       "as said, eps 1e-5) under torch.no_grad() (inference graph), after 20 warm-up calls, with no "
       "synchronisation inside the loop and one torch.cuda.synchronize() after it; us/call = wall "
       "time / {iters}. The GPU work per call is shorter than the host work, so this is the host cost "
       "(launch queue permitting). 'Plan.run' calls the cached cuDNN plan of the first entry directly: "
       "the floor under cudnorm's Python-side dispatch.")


def _plan_call(x, weight, bias, eps, y):
    """A zero-arg ``Plan.run`` of the cached inference plan for ``x`` (``None`` if none)."""
    from .. import _cache, _dispatch, _graphs  # noqa: PLC0415

    rows, cols = x.shape
    specs = [s for s in _cache.plans.specs()
             if (s.op, s.phase, s.rows, s.cols, s.x_dtype, s.scale_dtype)
             == ("layer_norm", "infer", rows, cols, x.dtype, weight.dtype)]
    plan = _dispatch.get_plan(specs[-1]) if specs else None
    if plan is None:
        return None
    by_role = {"x": x, "scale": weight, "bias": bias, "eps": _graphs.host_scalar(eps, plan.spec), "y": y}
    buffers = [by_role[role] for role in _graphs.roles(plan.spec)]
    return lambda: plan.run(*buffers)


def bench(rows: int = 64, cols: int = 4096, iters: int = 2000) -> tuple[list[dict], str]:
    """``([{"call", "us_per_call"}], how it was measured)`` on the current CUDA device."""
    import cudnorm  # noqa: PLC0415

    eps = 1e-5
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w32, b32 = torch.randn(cols, device="cuda"), torch.randn(cols, device="cuda")
    w16, b16 = w32.to(x.dtype), b32.to(x.dtype)
    calls = [
        ("cudnorm.layer_norm, bf16 weight", lambda: cudnorm.layer_norm(x, (cols,), w16, b16, eps)),
        ("cudnorm.layer_norm, fp32 weight", lambda: cudnorm.layer_norm(x, (cols,), w32, b32, eps)),
        ("torch F.layer_norm, bf16 weight", lambda: F.layer_norm(x, (cols,), w16, b16, eps)),
    ]
    try:
        ops = importlib.import_module("cudnn.ops.norm")
        calls.append(("cudnn.ops.norm.layer_norm, fp32 weight (training graph)",
                      lambda: ops.layer_norm(x, (cols,), w32, b32, eps)))
    except Exception:  # noqa: BLE001 - the upstream op is optional
        pass
    results = []
    with torch.no_grad():
        calls[0][1]()  # builds and caches the plan that Plan.run reuses
        plan_call = _plan_call(x, w16, b16, eps, torch.empty_like(x))
        if plan_call is not None:
            calls.insert(2, ("Plan.run of the cached plan (bf16 weight)", plan_call))
        for name, fn in calls:
            results.append({"call": name, "us_per_call": wall_us_per_call(fn, iters)})
    if plan_call is None:
        path = cudnorm.serving_path("layer_norm", x)
        results.append({"call": f"Plan.run: no cached cuDNN plan (layer_norm served by {path})", "us_per_call": None})
    return results, HOW.format(iters=iters, rows=rows, cols=cols)


def table(results: list[dict]) -> list[list[str]]:
    return [["call", "us/call"]] + [
        [r["call"], "-" if r["us_per_call"] is None else f"{r['us_per_call']:.1f}"] for r in results]
