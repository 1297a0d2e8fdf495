"""Model steps at several values of the native path's small-call threshold
(``cudnorm._policy.NATIVE_CUDNN_MIN_ELEMENTS``): the evidence for that constant.

For each case one cudnorm model is timed with the threshold set to each value in turn, beside
PyTorch's norms and PyTorch's norms again (the run's noise floor), in interleaved rounds (each
round visits every variant, starting at another one), fresh inputs every step; the median
round is kept. A threshold above a call's element count sends that call to PyTorch's op from
the C++ entry point; below it, to cuDNN. Off CUDA the native path is never active, so the
thresholds change nothing there (``--quick`` runs the mechanics on the CPU).

    python benchmarks/policy_threshold.py --cases llama-4096:decode-b1,llama-4096:decode-b32 \
        --thresholds 0,65536,262144
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from cudnorm import _native, _policy
from cudnorm._bench import model_cases, models, report


def measure(case_ids: list[str], thresholds: list[int], rounds: int, device: str, quick: bool) -> list[dict]:
    """``[{"case", "variant", "threshold", "step_ms", "vs_torch"}]``: median step ms per variant."""
    cases = {c.id: c for c in model_cases.all_cases(quick=quick)}
    unknown = [c for c in case_ids if c not in cases]
    if unknown:
        raise SystemExit(f"policy_threshold.py: unknown --cases {unknown}; known: {sorted(cases)}")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    saved = _policy.NATIVE_CUDNN_MIN_ELEMENTS
    results = []
    try:
        for case_id in case_ids:
            case = cases[case_id]
            cudnorm_model = models.build(case, "cudnorm", device, dtype)
            live = {"torch": (models.build(case, "torch", device, dtype), None),
                    "torch-again": (models.build(case, "torch", device, dtype), None)}
            live.update({f"cudnorm@{t}": (cudnorm_model, t) for t in thresholds})
            steps = 2 if quick else (50 if case.decode else 10)
            for workload, _ in live.values():
                for _ in range(2 if quick else 5):
                    workload.step()
            times = {name: [] for name in live}
            names = list(live)
            for r in range(rounds):
                start = r % len(names)
                for name in names[start:] + names[:start]:
                    workload, threshold = live[name]
                    if threshold is not None:
                        _policy.NATIVE_CUDNN_MIN_ELEMENTS = threshold
                        _native._sync()  # pushes the threshold to the C++ entry points
                    if case.decode:
                        workload.model.position = workload.model.prefill
                    times[name].append(models._timed_steps(workload, steps, device))
            base = statistics.median(times["torch"])
            for name, samples in times.items():
                ms = statistics.median(samples)
                results.append({"case": case_id, "variant": name, "threshold": live[name][1],
                                "step_ms": ms, "vs_torch": base / ms})
    finally:
        _policy.NATIVE_CUDNN_MIN_ELEMENTS = saved
        _native._sync()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="llama-4096:decode-b1,llama-4096:decode-b32",
                        help="comma-separated case ids of cudnorm bench --models")
    parser.add_argument("--thresholds", default="0,65536,262144", help="comma-separated element counts")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--quick", action="store_true", help="the tiny cases, two rounds: the mechanics (CPU)")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    thresholds = [int(t) for t in args.thresholds.split(",")]
    rows = measure(args.cases.split(","), thresholds, 2 if args.quick else args.rounds, device, args.quick)
    print(f"{'case':28s} {'variant':18s} {'ms/step':>9s} {'vs torch':>9s}")
    for row in rows:
        print(f"{row['case']:28s} {row['variant']:18s} {row['step_ms']:9.3f} {row['vs_torch']:8.3f}x")
    if args.csv:
        report.write_csv(rows, Path(args.csv), columns=list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
