"""Every candidate plan cuDNN offers for one graph, timed: is there a faster plan than the ones
autotuning looks at (the first ``autotune_candidates``, plus ``cudnorm._graphs.EXTRA_CANDIDATES``)?
Run it where cudnorm loses to a peer, and again with each new cuDNN (``benchmarks/newer_cudnn.sh``).

For each ``op:phase:MxN`` given (``ada_layer_norm:phase:BxSxD``), the graph is built with heuristics A + B + FALLBACK, every
candidate (or those whose name contains ``--engine``) is finalised and timed as autotuning
times it (``cudnorm._graphs._time_plans``), and a table of plan name, ms and GB/s is printed.

    PYTHONPATH=. python benchmarks/plan_candidates.py rms_norm:train:32768x8192 layer_norm:train:8192x262144
"""

from __future__ import annotations

import argparse
import time

import torch

from cudnorm import _graphs, _runtime
from cudnorm._spec import NormSpec


def bytes_moved(spec: NormSpec) -> int:
    io = (2 if spec.phase != "bwd" else 3) * spec.rows * spec.cols * spec.x_dtype.itemsize
    return io + spec.rows * 8 + spec.cols * 8


def probe(text: str, engine: str | None, limit: int, budget_s: float) -> None:
    op, phase, shape = text.split(":")
    dims = [int(v) for v in shape.split("x")]
    batch = dims[0] if len(dims) == 3 else 1  # ada_layer_norm: BxSxD
    rows, cols = batch * dims[-2], dims[-1]
    scale = torch.float32 if phase == "bwd" and op != "ada_layer_norm" else torch.bfloat16
    spec = NormSpec(op, phase, rows, cols, torch.bfloat16, scale, 0, batch=batch, autotune=True)
    start = time.perf_counter()
    h = _runtime.handle(0)
    g, _ = _graphs.build_ir(spec, handle=h)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans(_graphs._heuristic_modes(True))
    g.check_support()
    count = g.get_execution_plan_count()
    names = [str(g.get_plan_name_at_index(i)) for i in range(count)]
    chosen = [i for i in range(count) if engine is None or engine in names[i]][:limit]
    print(f"\n{text}: {count} candidates, timing {len(chosen)} (list in {time.perf_counter() - start:.1f} s)")
    timings: dict[int, float] = {}
    for index in chosen:
        if time.perf_counter() - start > budget_s:
            print(f"  (stopped: {budget_s:.0f} s budget for this graph)")
            break
        try:
            timings.update(_graphs._time_plans(g, spec, indices=[index]))
        except RuntimeError:  # the plan did not build or run
            print(f"  #{index:2d} did not build or run  {names[index]}")
    gbytes = bytes_moved(spec) / 1e9
    for index, ms in sorted(timings.items(), key=lambda kv: kv[1]):
        print(f"  #{index:2d} {ms:8.4f} ms {gbytes / ms * 1e3:7.0f} GB/s  {names[index]}")
    print(f"  ({time.perf_counter() - start:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="+", help="op:phase:MxN (ada_layer_norm: BxSxD), e.g. rms_norm:train:32768x8192")
    parser.add_argument("--engine", default=None, help="only plans whose name contains this, e.g. eng5")
    parser.add_argument("--limit", type=int, default=64, help="at most this many candidates per graph")
    parser.add_argument("--budget-s", type=float, default=90.0, help="stop timing a graph after this long")
    args = parser.parse_args()
    print(f"device {torch.cuda.get_device_name()}")
    for text in args.graphs:
        probe(text, args.engine, args.limit, args.budget_s)


if __name__ == "__main__":
    main()
