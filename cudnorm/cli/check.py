"""``cudnorm check``: the main job of a fresh machine.

Prints ``cudnorm info``, then every op forward and backward in every dtype checked against
the fp64 reference (:func:`cudnorm._self_check.check`), one line per compared quantity.
Exits 1 on any failure, so it doubles as an installation test.
"""

from __future__ import annotations

import argparse

import torch

from .._info import info
from .._self_check import check
from ._output import print_json_or_table


def _device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` of a GPU this machine has."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r} asked for, but this machine has no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r} asked for, but this machine has {torch.cuda.device_count()} GPU(s)")
    return text


def add_arguments(parser) -> None:
    parser.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda when available)")


def run(args) -> int:
    print_json_or_table(info(), False)
    print()
    rows = check(args.device)
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}  {'qty':<9} {'path':<10} {'rel.err':>9} {'torch':>9} {'bound':>9}  result")
    for r in rows:
        print(f"{r['case']:<{width}}  {r['name']:<9} {r['path'].split(' ')[0]:<10} {r['error']:9.2e} "
              f"{r['torch_error']:9.2e} {r['bound']:9.2e}  {'ok' if r['ok'] else 'FAIL'}")
    failed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
