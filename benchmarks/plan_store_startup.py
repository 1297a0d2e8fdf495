"""Cold build vs warm plan store: the first call of a graph in a fresh process.

For each op and shape, two new interpreters run one forward (training phase) and one
backward: the first with an empty plan store (the graphs are built), the second with the
store the first left behind (the graphs are loaded). Each reports the wall time of its
first forward and first backward call, after CUDA and the cuDNN handle are initialised
and torch's first explicit-gradient backward (those are paid once per process, not per graph).

    python benchmarks/plan_store_startup.py            # table + CSV in benchmarks/results/
    CUDNORM_AUTOTUNE=0 python benchmarks/plan_store_startup.py
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = [(2048, 1024), (8192, 4096), (32768, 4096), (4096, 8192)]
OPS = ("layer_norm", "rms_norm")


def child(op: str, rows: int, cols: int) -> None:
    """Runs in the fresh process: print ``{"fwd_ms", "bwd_ms", "source"}`` as JSON."""
    import time  # noqa: PLC0415

    import torch  # noqa: PLC0415

    import cudnorm  # noqa: PLC0415
    from cudnorm import _runtime  # noqa: PLC0415

    torch.ones(1, device="cuda")
    _runtime.handle(torch.cuda.current_device())
    # torch's first explicit-gradient backward imports sympy (~1.8 s on the H200) whatever
    # op it runs through: a once-per-process cost, paid here so it is not charged to a graph
    probe = torch.ones(2, device="cuda", requires_grad=True)
    (probe * 2).backward(torch.ones(2, device="cuda"))
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(cols, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    fn = (lambda: cudnorm.layer_norm(x, (cols,), w)) if op == "layer_norm" else (lambda: cudnorm.rms_norm(x, (cols,), w))

    def timed(call):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = call()
        torch.cuda.synchronize()
        return out, (time.perf_counter() - start) * 1e3

    y, fwd_ms = timed(fn)
    _, bwd_ms = timed(lambda: y.backward(dy))
    info = cudnorm.cache_info()
    print(json.dumps({"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "builds": info.builds, "store_loads": info.store_loads,
                      "gpu": torch.cuda.get_device_name()}))


def spawn(op: str, rows: int, cols: int, store: str) -> dict:
    env = {**os.environ, "CUDNORM_PLAN_STORE_DIR": store, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("CUDNORM_PLAN_STORE", None)
    proc = subprocess.run([sys.executable, __file__, "--child", op, str(rows), str(cols)], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{op} {rows}x{cols}: child failed\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    rows_out = []
    print(f"CUDNORM_AUTOTUNE={os.environ.get('CUDNORM_AUTOTUNE', 'auto')}")
    header = f"{'op':<11} {'shape':>11} {'cold fwd':>9} {'cold bwd':>9} {'warm fwd':>9} {'warm bwd':>9} {'speedup':>8}"
    print(header + "   (ms, first call in a fresh process)")
    for op in OPS:
        for rows, cols in SHAPES:
            with tempfile.TemporaryDirectory() as store:
                cold = spawn(op, rows, cols, store)
                warm = spawn(op, rows, cols, store)
            if cold["builds"] != 2 or warm["store_loads"] != 2 or warm["builds"]:
                print(f"  warning: {op} {rows}x{cols}: cold built {cold['builds']}, warm loaded "
                      f"{warm['store_loads']} and built {warm['builds']} (expected 2, 2, 0)")
            speedup = (cold["fwd_ms"] + cold["bwd_ms"]) / (warm["fwd_ms"] + warm["bwd_ms"])
            print(f"{op:<11} {f'{rows}x{cols}':>11} {cold['fwd_ms']:9.1f} {cold['bwd_ms']:9.1f} "
                  f"{warm['fwd_ms']:9.1f} {warm['bwd_ms']:9.1f} {speedup:7.1f}x")
            rows_out.append({"op": op, "rows": rows, "cols": cols, "gpu": warm["gpu"],
                             **{f"cold_{k}": cold[k] for k in ("fwd_ms", "bwd_ms")},
                             **{f"warm_{k}": warm[k] for k in ("fwd_ms", "bwd_ms")}})
    gpu = rows_out[0]["gpu"].replace(" ", "_")
    out = Path(os.environ.get("OUT") or REPO / "benchmarks" / "results") / f"plan_store_startup_{gpu}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        writer.writeheader()
        writer.writerows(rows_out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
