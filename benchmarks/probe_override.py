"""Does a newer cuDNN serve LayerNorm/RMSNorm graphs with execute-time shape overrides (GPU)?

Issue 5's variable-row-count target names "execute-time shape overrides where cuDNN >= 9.21
allows them". cuDNN 9.19 (torch 2.11's) refuses the option. This probe runs in a process
where a newer cuDNN was loaded in its place (``LD_PRELOAD`` of its ``libcudnn.so.9`` and
``libcudnn_graph.so.9``; see ``benchmarks/gpu_verify.sh`` stage ``override``) and, for each
(op, phase) at N = 4096 bf16:

1. builds the graph at a "cache shape" of 65536 rows with ``is_override_shape_enabled``
   (alone, and with ``is_dynamic_shape_enabled``), heuristics mode A then FALLBACK;
2. executes it at other row counts with ``override_uids/shapes/strides`` and compares the
   result with the exact-shape graph (max |diff|);
3. when it runs, times the override plan against the exact-shape plan at those counts.

Every failure is printed with the message cuDNN gave; nothing is retried silently.

    python benchmarks/probe_override.py
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cudnorm import _graphs, _runtime  # noqa: E402
from cudnorm._spec import NormSpec  # noqa: E402

N = 4096
CACHE_ROWS = 65536
COUNTS = (1000, 4097, 12345, 40000)
BF16 = torch.bfloat16


def spec_of(op: str, phase: str, rows: int) -> NormSpec:
    return NormSpec(op, phase, rows, N, BF16, torch.float32 if phase == "bwd" else BF16, 0)


def build(spec: NormSpec, override: bool, dynamic: bool):
    """(graph, uids, seconds, plan name) of ``spec``, built with the given options."""
    cudnn = _runtime.cudnn_module()
    h = _runtime.handle(0)
    original = cudnn.pygraph
    extra = {}
    if override:
        extra["is_override_shape_enabled"] = True
    if dynamic:
        extra.update(is_dynamic_shape_enabled=True, kernel_cache=cudnn.create_kernel_cache())
    start = time.perf_counter()
    cudnn.pygraph = functools.partial(original, **extra)
    try:
        g, uids = _graphs.build_ir(spec, handle=h)
    finally:
        cudnn.pygraph = original
    g.validate()
    g.build_operation_graph()
    errors = []
    for modes in ([cudnn.heur_mode.A], [cudnn.heur_mode.FALLBACK]):
        try:
            g.create_execution_plans(modes)
            g.check_support()
            g.build_plans()
            break
        except Exception as exc:  # noqa: BLE001 - reported, then the next mode is tried
            errors.append(f"{modes}: {str(exc).splitlines()[0][:300]}")
    else:
        raise RuntimeError(" | ".join(errors))
    return g, uids, time.perf_counter() - start, str(g.get_plan_name_at_index(getattr(g, "_plan_index", 0) or 0))


def overrides(spec: NormSpec, rows: int):
    """override_uids/shapes/strides for every row-sized tensor of ``spec`` at ``rows``."""
    uids, shapes, strides = [], [], []
    for role in _graphs.roles(spec):
        if role in ("x", "y", "dy", "dx"):
            uids.append(_graphs.UIDS[role]); shapes.append([rows, N, 1, 1]); strides.append([N, 1, 1, 1])  # noqa: E702
        elif role in ("mean", "rstd"):
            uids.append(_graphs.UIDS[role]); shapes.append([rows, 1, 1, 1]); strides.append([1, 1, 1, 1])  # noqa: E702
    return uids, shapes, strides


def gpu_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / reps


def probe(op: str, phase: str, override_only: bool) -> None:
    label = f"{op} {phase} ({'override' if override_only else 'override+dynamic'})"
    spec = spec_of(op, phase, CACHE_ROWS)
    try:
        g, uids, seconds, name = build(spec, True, not override_only)
    except Exception as exc:  # noqa: BLE001
        print(f"{label}: BUILD FAILED: {str(exc)[:600]}", flush=True)
        return
    print(f"{label}: built at {CACHE_ROWS} rows in {seconds:.2f} s, plan {name}", flush=True)
    h = _runtime.handle(0)
    for rows in COUNTS:
        small = spec_of(op, phase, rows)
        bufs = _graphs.dummy_buffers(small)
        outs_override = [b.clone() for b in bufs]
        ou, osh, ost = overrides(spec, rows)
        try:
            ws_size = max(int(g.get_workspace_size()), 1)
            ws = torch.empty(ws_size, dtype=torch.uint8, device="cuda")
            run = lambda: g.execute(dict(zip(uids, outs_override)), ws, handle=h, override_uids=ou,  # noqa: E731
                                    override_shapes=osh, override_strides=ost)
            run()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            print(f"  rows {rows}: EXECUTE FAILED: {str(exc)[:600]}", flush=True)
            traceback.print_exc(limit=2)
            return
        exact = _graphs.build_plan(small)
        outs_exact = [b.clone() for b in bufs]
        exact.run(*outs_exact)
        torch.cuda.synchronize()
        roles = _graphs.roles(spec)
        diffs = {r: float((a.float() - b.float()).abs().max()) for r, a, b in zip(roles, outs_override, outs_exact)
                 if r in ("y", "mean", "rstd", "dx", "dscale", "dbias")}
        t_override = gpu_ms(run)
        t_exact = gpu_ms(lambda: exact.run(*outs_exact))
        print(f"  rows {rows:6d}: override {t_override * 1e3:8.1f} us, exact {t_exact * 1e3:8.1f} us "
              f"(plan {exact.plan_name}), max|diff| {diffs}", flush=True)


def main() -> None:
    cudnn = _runtime.cudnn_module()
    print(f"torch {torch.__version__}, torch cuDNN {torch.backends.cudnn.version()}, frontend "
          f"{getattr(cudnn, '__version__', '?')}, backend {cudnn.backend_version()}, {torch.cuda.get_device_name()}",
          flush=True)
    for op in ("layer_norm", "rms_norm"):
        for phase in ("train", "bwd"):
            for override_only in (True, False):
                probe(op, phase, override_only)


if __name__ == "__main__":
    main()
