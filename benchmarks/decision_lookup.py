"""Host cost of the measured dispatcher's lookup on the native launch path (issue 46: <= 1 us a call).

Under ``policy="auto"`` every eager call at or above the size threshold looks its signature up
in C++'s decision table (``csrc/decisions.cpp``) before it launches; under ``policy="cudnn"`` or
``"torch"`` it launches without looking. With the decision pinned to the same server, the two
policies launch the same kernels, so the difference of their host time per call is the
lookup's cost (plus the size check beside it: an upper bound).

Each figure is the wall time per call of ``CALLS`` back-to-back calls with one synchronize at
the end, at a shape whose GPU work (a few us) is shorter than its host work, so it is host
time; the two policies alternate over ``ROUNDS`` rounds and the median is kept.

Run (GPU, native path built): PYTHONPATH=. python benchmarks/decision_lookup.py [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import torch

import cudnorm
from cudnorm import _candidates, _decisions, _entry
from cudnorm._bench.cuda_graph import wall_us_per_call

ROWS, COLS = 16, 4096  # 2^16 elements: the smallest call the size rule hands to the dispatcher
CALLS = 4000
ROUNDS = 15


def _pin(op: str, x, weight, bias, training: bool, server: str) -> str:
    """Make ``server`` this signature's decision, as a measured one would be kept; its key."""
    sig = _candidates.signature(op, training, x, weight, bias, COLS)
    key = (sig, x.get_device(), torch.are_deterministic_algorithms_enabled())
    _decisions.DECIDED.put(key, (server, {"source": "pinned by benchmarks/decision_lookup.py"}))
    return sig.key()


def _call(op: str, x, weight, bias):
    if op == "layer_norm":
        return lambda: cudnorm.layer_norm(x, (COLS,), weight, bias)
    return lambda: cudnorm.rms_norm(x, (COLS,), weight)


def measure(op: str, server: str) -> dict:
    x = torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(COLS, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(COLS, device="cuda", dtype=torch.bfloat16) if op == "layer_norm" else None
    fn = _call(op, x, weight, bias)
    looked, direct = [], []
    with torch.no_grad():
        for _ in range(ROUNDS):
            with cudnorm.config(policy="auto"):
                key = _pin(op, x, weight, bias, False, server)  # after the configuration change emptied C++'s table
                looked.append(wall_us_per_call(fn, CALLS))
                held = [(d["serves"], d["source"]) for d in _decisions.decisions() if d["signature"] == key]
                assert held == [(server, "pinned by benchmarks/decision_lookup.py")], held
            with cudnorm.config(policy=server):
                direct.append(wall_us_per_call(fn, CALLS))
    a, b = statistics.median(looked), statistics.median(direct)
    return {"op": op, "server": server, "shape": f"{ROWS}x{COLS} bf16", "auto_us": round(a, 3),
            "direct_us": round(b, 3), "lookup_us": round(a - b, 3),
            "spread_us": round(max(looked) - min(looked), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for decision_lookup.csv")
    args = parser.parse_args()
    cudnorm.config(plan_store=False)
    rows = [measure(op, server) for op in ("layer_norm", "rms_norm") for server in ("cudnn", "torch")]
    print(f"device: {torch.cuda.get_device_name()}  native path: {'on' if _entry.native else 'off'}")
    fields = list(rows[0])
    print("  ".join(f"{f:>12}" for f in fields))
    for r in rows:
        print("  ".join(f"{str(r[f]):>12}" for f in fields))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "decision_lookup.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fields)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
