"""Variable row counts: build time and steady-state speed, chunk graphs vs exact-shape graphs.

One training step (``y = norm(x); y.backward(dy)``, bf16 x, fp32 weight/bias, N = 4096) for
each of ``--counts`` distinct random row counts in [1, 65536] (seeded). Each mode runs in a
fresh interpreter with the on-disk plan store off, so its builds are its own:

* ``exact``: every row count gets its own graphs at its first call (``CUDNORM_EXACT_ROWS`` =
  counts + 1, ``CUDNORM_EXACT_AFTER`` = 1);
* ``chunked``: the library default (``cudnorm._rows``: the first row count gets exact graphs,
  later ones shared chunk graphs);
* ``chunks``: chunk graphs only (``CUDNORM_EXACT_ROWS=0``, the setting for variable-length
  runs); ``--fwd-chunks``/``--bwd-chunks`` try other chunk sizes in both chunk modes.

Pass 1 builds (reported: builds, build seconds). Then ``--passes`` timed passes over the
same counts (CUDA events per step and per pass); the table gives the median pass total and
its ratio to the exact mode, also split by row-count range. GPU only; about 3 minutes for
LayerNorm with the defaults (the exact mode builds ~200 graphs).

    PYTHONPATH=. python benchmarks/variable_rows.py
    PYTHONPATH=. python benchmarks/variable_rows.py --ops layer_norm,rms_norm --counts 50
    PYTHONPATH=. python benchmarks/variable_rows.py --modes chunked --bwd-chunks 4096
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
N = 4096
MAX_ROWS = 65536
BINS = ((1, 4095), (4096, 16383), (16384, MAX_ROWS))


def row_counts(count: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(1, MAX_ROWS + 1), count)


def worker(args) -> None:
    """Runs in the fresh process; prints one JSON line."""
    import torch

    import cudnorm
    from cudnorm import _rows

    if args.fwd_chunks:
        sizes = tuple(int(s) for s in args.fwd_chunks.split(","))
        _rows.CHUNK_ROWS = {**_rows.CHUNK_ROWS, "train": sizes, "infer": sizes}
    if args.bwd_chunks:
        _rows.CHUNK_ROWS = {**_rows.CHUNK_ROWS, "bwd": tuple(int(s) for s in args.bwd_chunks.split(","))}
    gen = torch.Generator(device="cuda").manual_seed(0)
    x_all = torch.randn(MAX_ROWS, N, device="cuda", generator=gen).to(torch.bfloat16)
    dy_all = torch.randn(MAX_ROWS, N, device="cuda", generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(N, device="cuda", generator=gen)).requires_grad_()
    b = (0.1 * torch.randn(N, device="cuda", generator=gen)).requires_grad_()
    if args.op == "layer_norm":
        def norm(x):
            return cudnorm.layer_norm(x, (N,), w, b)
    else:
        def norm(x):
            return cudnorm.rms_norm(x, (N,), w, 1e-6)

    def step(rows):
        x = x_all[:rows].detach().requires_grad_()
        norm(x).backward(dy_all[:rows])

    counts = row_counts(args.counts, args.seed)
    for rows in counts:
        step(rows)
    torch.cuda.synchronize()
    built = cudnorm.cache_info()
    pass_ms, step_ms = [], {rows: [] for rows in counts}
    for _ in range(args.passes):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(counts) + 1)]
        events[0].record()
        for rows, end in zip(counts, events[1:]):
            step(rows)
            end.record()
        torch.cuda.synchronize()
        pass_ms.append(events[0].elapsed_time(events[-1]))
        for rows, begin, end in zip(counts, events, events[1:]):
            step_ms[rows].append(begin.elapsed_time(end))
    after = cudnorm.cache_info()
    print(json.dumps({"builds": built.builds, "build_s": built.build_seconds, "declined": built.declined,
                      "steady_builds": after.builds - built.builds, "chunked_calls": after.chunked_calls,
                      "small_rows_fallbacks": after.small_rows_fallbacks, "pass_ms": statistics.median(pass_ms),
                      "step_ms": {str(r): statistics.median(v) for r, v in step_ms.items()}}))


def run_mode(args, op: str, mode: str) -> dict:
    env = {**os.environ, "CUDNORM_PLAN_STORE": "0", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if mode == "exact":
        env.update(CUDNORM_EXACT_ROWS=str(args.counts + 1), CUDNORM_EXACT_AFTER="1")
    elif mode == "chunks":
        env["CUDNORM_EXACT_ROWS"] = "0"
    cmd = [sys.executable, __file__, "--worker", "--op", op, "--counts", str(args.counts), "--seed", str(args.seed),
           "--passes", str(args.passes)]
    if mode in ("chunked", "chunks"):
        cmd += ["--fwd-chunks", args.fwd_chunks or "", "--bwd-chunks", args.bwd_chunks or ""]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{op} {mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bin_ms(result: dict, low: int, high: int) -> float:
    return sum(ms for rows, ms in result["step_ms"].items() if low <= int(rows) <= high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--op", default="layer_norm", help=argparse.SUPPRESS)
    parser.add_argument("--ops", default="layer_norm", help="comma-separated: layer_norm,rms_norm")
    # chunked first: it is cheap and answers the build-time budget even if the exact-shape
    # baseline (~200 builds) does not finish inside a device time limit
    parser.add_argument("--modes", default="chunks,chunked,exact")
    parser.add_argument("--counts", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--fwd-chunks", default="", help="forward chunk sizes, e.g. 16384,4096,1024")
    parser.add_argument("--bwd-chunks", default="", help="backward chunk sizes, e.g. 16384,4096")
    parser.add_argument("--csv", default=str(REPO / "benchmarks" / "results" / "variable_rows.csv"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows_out = []
    header = (f"{'op':10s} {'mode':8s} {'builds':>6s} {'build s':>8s} {'steady ms':>10s} {'ratio':>6s}  "
              + "  ".join(f"ratio {lo}-{hi}" for lo, hi in BINS) + "  chunked  torch")
    print(header, flush=True)
    for op in args.ops.split(","):
        results = {}
        for mode in args.modes.split(","):
            results[mode] = run_mode(args, op, mode)
            r = results[mode]
            print(f"[{op} {mode} done: {r['builds']} builds, {r['build_s']:.2f} s building, "
                  f"steady pass {r['pass_ms']:.2f} ms]", flush=True)
        exact = results.get("exact")
        for mode, r in results.items():
            ratio = r["pass_ms"] / exact["pass_ms"] if exact else float("nan")
            bins = [bin_ms(r, lo, hi) / bin_ms(exact, lo, hi) if exact and bin_ms(exact, lo, hi) else float("nan")
                    for lo, hi in BINS]
            print(f"{op:10s} {mode:8s} {r['builds']:6d} {r['build_s']:8.2f} {r['pass_ms']:10.2f} {ratio:6.3f}  "
                  + "  ".join(f"{v:{len(f'ratio {lo}-{hi}')}.3f}" for v, (lo, hi) in zip(bins, BINS))
                  + f"  {r['chunked_calls']:7d}  {r['small_rows_fallbacks']:5d}"
                  + (f"  (+{r['steady_builds']} builds in timed passes!)" if r["steady_builds"] else ""), flush=True)
            rows_out.append({"op": op, "mode": mode, "builds": r["builds"], "build_s": round(r["build_s"], 3),
                             "steady_ms": round(r["pass_ms"], 3), "ratio": round(ratio, 4),
                             "fwd_chunks": args.fwd_chunks, "bwd_chunks": args.bwd_chunks, "counts": args.counts,
                             "seed": args.seed})
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        writer.writeheader()
        writer.writerows(rows_out)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
