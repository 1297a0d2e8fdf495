"""Where one training step's GPU time goes: every kernel of the step, PyTorch's norms against
cudnorm's, and which kernels account for the difference.

For each case both providers' models are built, warmed up and timed (median of interleaved
rounds of back-to-back steps on fresh inputs, as ``cudnorm bench --models`` times them); then
three steps of each run under ``torch.profiler`` and every kernel's time is summed by name.
A step's kernel sum can exceed its wall time: on Hopper a kernel launched with programmatic
dependent launch may start while the kernel before it finishes and wait inside, so two
overlapping kernels both count that stretch (cuDNN's ``ln_bwd_finalize_kernel`` after
``ln_tma_bwd_kernel``, cuBLAS GEMMs after a norm). Read the per-kernel rows as where the
work is, and the step times as what it costs.

    python benchmarks/step_kernels.py --cases flux-3072-b1-s4608:train --csv step_kernels.csv
    python benchmarks/step_kernels.py --quick      # a tiny case on the CPU: the mechanics
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from cudnorm._bench import model_cases, models, report

PROVIDERS = ("torch", "cudnorm")
PROFILED_STEPS = 3


def kernel_ms(workload: models.Workload, device: str) -> tuple[dict[str, float], dict[str, int]]:
    """``(ms per step, launches per step)`` of each kernel (on the CPU: each operator) by name."""
    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(PROFILED_STEPS):
            workload.step()
        models._sync(device)
    wanted = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    times, counts = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == wanted:
            busy_us = event.device_time if device == "cuda" else event.self_cpu_time_total
            times[event.name] += busy_us / 1e3 / PROFILED_STEPS
            counts[event.name] += 1
    return dict(times), {name: n // PROFILED_STEPS for name, n in counts.items()}


def measure(case_id: str, rounds: int, device: str, quick: bool) -> tuple[dict, list[dict]]:
    """``({provider: step ms}, rows)``: one row per kernel name, both providers' ms per step."""
    cases = {c.id: c for c in model_cases.all_cases(quick=quick)}
    if case_id not in cases:
        raise SystemExit(f"step_kernels.py: unknown case {case_id!r}; known: {sorted(cases)}")
    case = cases[case_id]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    built = {p: models.build(case, p, device, dtype) for p in PROVIDERS}
    for workload in built.values():
        for _ in range(2 if quick else 5):
            workload.step()
    steps = 2 if quick else 10
    samples = {p: [] for p in PROVIDERS}
    for r in range(rounds):  # interleaved, each round starting at another provider
        for p in PROVIDERS[r % 2:] + PROVIDERS[:r % 2]:
            samples[p].append(models._timed_steps(built[p], steps, device))
    step_ms = {p: statistics.median(s) for p, s in samples.items()}
    per_kernel = {p: kernel_ms(built[p], device) for p in PROVIDERS}
    names = set().union(*(times for times, _ in per_kernel.values()))
    rows = []
    for name in names:
        row = {"case": case_id, "kernel": name}
        for p in PROVIDERS:
            times, counts = per_kernel[p]
            row[f"{p}_ms"], row[f"{p}_launches"] = round(times.get(name, 0.0), 4), counts.get(name, 0)
        row["difference_ms"] = round(row["cudnorm_ms"] - row["torch_ms"], 4)
        rows.append(row)
    rows.sort(key=lambda row: -abs(row["difference_ms"]))
    return step_ms, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="flux-3072-b1-s4608:train", help="comma-separated case ids of cudnorm bench --models")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default 7)")
    parser.add_argument("--top", type=int, default=15, help="kernels printed per case, largest difference first")
    parser.add_argument("--quick", action="store_true", help="a tiny case on this machine, two rounds: the mechanics")
    parser.add_argument("--csv", help="also write every kernel row to this CSV file")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case_ids = ["dit-64-b2-s16:train"] if args.quick and args.cases == parser.get_default("cases") else args.cases.split(",")
    every_row = []
    for case_id in case_ids:
        step_ms, rows = measure(case_id, 2 if args.quick else args.rounds, device, args.quick)
        sums = {p: sum(row[f"{p}_ms"] for row in rows) for p in PROVIDERS}
        print(f"{case_id}: step ms torch {step_ms['torch']:.3f}, cudnorm {step_ms['cudnorm']:.3f} "
              f"({step_ms['torch'] / step_ms['cudnorm']:.3f}x); kernel ms per step torch {sums['torch']:.3f}, "
              f"cudnorm {sums['cudnorm']:.3f}")
        print(f"  {'cudnorm - torch':>15s}  {'torch ms (n)':>14s}  {'cudnorm ms (n)':>14s}  kernel")
        for row in rows[:args.top]:
            print(f"  {row['difference_ms']:+15.3f}  {row['torch_ms']:8.3f} ({row['torch_launches']:3d})"
                  f"  {row['cudnorm_ms']:8.3f} ({row['cudnorm_launches']:3d})  {row['kernel'][:90]}")
        for row in rows:
            row.update({"torch_step_ms": round(step_ms["torch"], 4), "cudnorm_step_ms": round(step_ms["cudnorm"], 4)})
        every_row += rows
    if args.csv:
        report.write_csv(every_row, Path(args.csv), columns=list(every_row[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
