"""Does autotuning pick the same plan in every process? For each ``op:phase:MxN`` given, a
fresh interpreter builds the graph with autotuning (``cudnorm._graphs.build_plan``), as many
times as ``--processes``; each prints its pick and the median ms of its three fastest
candidates, then a summary says whether the picks agree.

    PYTHONPATH=. python benchmarks/autotune_agreement.py layer_norm:bwd:4096x3072 rms_norm:train:32768x16384

Run it after a change to how autotuning times candidates (``cudnorm._graphs._time_plans``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def child(graphs: list[str]) -> None:
    import torch  # noqa: PLC0415

    from cudnorm import _graphs  # noqa: PLC0415
    from cudnorm._spec import NormSpec  # noqa: PLC0415

    out = {}
    for text in graphs:
        op, phase, shape = text.split(":")
        rows, cols = (int(v) for v in shape.split("x"))
        scale = torch.float32 if phase == "bwd" else torch.bfloat16
        plan = _graphs.build_plan(NormSpec(op, phase, rows, cols, torch.bfloat16, scale, 0, autotune=True))
        best = sorted(plan.timings_ms.items(), key=lambda kv: kv[1])[:3]
        out[text] = {"pick": plan.plan_name, "index": best[0][0], "fastest_ms": best, "tune_s": plan.build_seconds}
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="+", help="op:phase:MxN, e.g. layer_norm:bwd:4096x3072")
    parser.add_argument("--processes", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for _ in range(args.processes):
        proc = subprocess.run([sys.executable, __file__, "--child", *args.graphs], capture_output=True, text=True,
                              env=os.environ, timeout=600)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    for text in args.graphs:
        print(f"\n{text}")
        for i, run in enumerate(runs):
            r = run[text]
            fastest = ", ".join(f"#{k} {v:.4f}" for k, v in r["fastest_ms"])
            print(f"  process {i}: pick #{r['index']} {r['pick']}  ({fastest} ms; tuned in {r['tune_s']:.1f} s)")
        picks = {run[text]["index"] for run in runs}
        print(f"  picks agree: {'yes' if len(picks) == 1 else 'NO'}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        main()
