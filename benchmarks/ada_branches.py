"""AdaLN captured per-sample launches: one after another vs spread over side streams.

For the issue's DiT shapes (bf16, DiT convention, bf16 scale/shift), the ``per_sample_graph``
backward (and with ``--directions bwd,fwd`` the ``per_sample_graph`` forward, inference and
training) with ``CUDNORM_ADA_BRANCHES`` in {1, 2, 4, 8}, alternated over two rounds in one
process, each timed two ways:

* ``api_ms``: one call through the public API (``autograd.grad`` for the backward; triton's
  do_bench, L2 flushed), as ``benchmarks/ada_backward_strategies.py`` times every provider;
* ``gpu_ms``: the captured graph's replay alone (GPU time).

torch.compile of the eager formula (and for the forward cuDNN's one-launch AdaLN graph,
``cudnn_ms``) is timed in the same process for the ratio. Every cudnorm result is checked
against the fp32 formula (relative error of dx, or of y).

Run: PYTHONPATH=. python benchmarks/ada_branches.py [--out DIR] [--branches 1,2,4,8] [--directions bwd,fwd]
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cudnorm  # noqa: E402
from ada_backward_strategies import SHAPES, bench_ms, dit_inputs, eager_formula, force, rel_error  # noqa: E402

ada = importlib.import_module("cudnorm.ada_layer_norm")


def _replay_ms() -> float:
    graphs = [entry[0] for entry in ada._captured.entries.values() if entry[0] is not None]
    return bench_ms(graphs[-1].replay) if graphs else float("nan")


def run_forward(shape, branch_counts, rows) -> None:
    b, s, d = shape
    x, scale, shift, _ = dit_inputs(shape)
    leaves = [t.clone().requires_grad_(True) for t in (x, scale, shift)]
    ref_y = eager_formula(x.float(), scale.float(), shift.float())
    compiled = torch.compile(eager_formula, fullgraph=True, dynamic=False)
    fused = functools.partial(cudnorm.ada_layer_norm, eps=1e-6, one_plus_scale=True)

    def infer(f):
        with torch.no_grad():
            return f(x, scale, shift)

    calls = {"infer": infer, "train": lambda f: f(*leaves)}
    base = {}
    for phase, call in calls.items():
        force("CUDNORM_ADA_FWD", "cudnn")
        base[phase] = (bench_ms(lambda: call(compiled)), bench_ms(lambda: call(fused)))
    for round_ in range(2):
        for branches in branch_counts:
            force("CUDNORM_ADA_FWD", "per_sample_graph")
            force("CUDNORM_ADA_BRANCHES", str(branches))
            for phase, call in calls.items():
                ada.clear_captured_graphs()
                for _ in range(3):
                    call(fused)
                err = rel_error(call(fused), ref_y)
                api_ms = bench_ms(lambda: call(fused))
                compile_ms, cudnn_ms = base[phase]
                rows.append({"shape": f"{b}x{s}x{d}", "direction": "fwd", "phase": phase, "branches": branches,
                             "round": round_, "api_ms": api_ms, "gpu_ms": _replay_ms(), "compile_ms": compile_ms,
                             "cudnn_ms": cudnn_ms, "vs_compile": compile_ms / api_ms, "rel_err": err,
                             "captured": len(ada._captured.entries)})
                print(f"{b}x{s}x{d:<5} fwd {phase:5s} branches {branches}  api {api_ms:.4f} ms  gpu "
                      f"{rows[-1]['gpu_ms']:.4f} ms  cudnn graph {cudnn_ms:.4f}  compile {compile_ms:.4f}  "
                      f"x{compile_ms / api_ms:.2f}  err {err:.2e}", flush=True)
    force("CUDNORM_ADA_FWD", "auto")
    os.environ.pop("CUDNORM_ADA_BRANCHES", None)


def run_shape(shape, branch_counts, rows) -> None:
    b, s, d = shape
    x, scale, shift, dy = dit_inputs(shape)
    leaves = [t.clone().requires_grad_(True) for t in (x, scale, shift)]
    xf = x.float().requires_grad_(True)
    ref_dx = torch.autograd.grad(eager_formula(xf, scale.float(), shift.float()), xf, dy.float())[0]
    compiled = torch.compile(eager_formula, fullgraph=True, dynamic=False)
    compile_grad = functools.partial(torch.autograd.grad, compiled(*leaves), leaves, dy, retain_graph=True)
    compile_ms = bench_ms(compile_grad)
    fused = functools.partial(cudnorm.ada_layer_norm, eps=1e-6, one_plus_scale=True)
    force("CUDNORM_ADA_BWD", "per_sample_graph")
    for round_ in range(2):
        for branches in branch_counts:
            force("CUDNORM_ADA_BRANCHES", str(branches))
            ada.clear_captured_graphs()
            grad = functools.partial(torch.autograd.grad, fused(*leaves), leaves, dy, retain_graph=True)
            for _ in range(3):  # eager call + capture, then replays
                grad()
            err = rel_error(grad()[0], ref_dx)
            api_ms = bench_ms(grad)
            gpu_ms = _replay_ms()
            rows.append({"shape": f"{b}x{s}x{d}", "direction": "bwd", "phase": "train", "branches": branches,
                         "round": round_, "api_ms": api_ms, "gpu_ms": gpu_ms, "compile_ms": compile_ms,
                         "vs_compile": compile_ms / api_ms, "rel_err": err,
                         "captured": len(ada._captured.entries)})
            print(f"{b}x{s}x{d:<5} branches {branches}  api {api_ms:.4f} ms  gpu {gpu_ms:.4f} ms  "
                  f"compile {compile_ms:.4f} ms  x{compile_ms / api_ms:.2f}  err {err:.2e}", flush=True)
            del grad
    force("CUDNORM_ADA_BWD", "auto")
    os.environ.pop("CUDNORM_ADA_BRANCHES", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--branches", default="1,2,4,8")
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    parser.add_argument("--directions", default="bwd")
    args = parser.parse_args()
    counts = [int(v) for v in args.branches.split(",")]
    shapes = [tuple(int(v) for v in text.split("x")) for text in args.shapes.split(",")]
    print(f"device {torch.cuda.get_device_name()}")
    rows: list[dict] = []
    for shape in shapes:
        if "bwd" in args.directions:
            run_shape(shape, counts, rows)
        if "fwd" in args.directions:
            run_forward(shape, counts, rows)
    with open(Path(args.out) / "ada_branches.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
