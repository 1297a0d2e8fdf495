"""``cudnorm warmup SPEC_FILE | --preset NAME``: build the graphs a job needs ahead of the job
(:func:`cudnorm.warmup`)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .. import _runtime
from ..warmup import PRESETS, parse_dtype, read_spec_file, resolve, warmup
from . import _args
from ._output import print_table


def _dtype(text: str):
    try:
        return parse_dtype(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be bf16, fp16 or fp32, got {text!r}") from None


def add_arguments(parser) -> None:
    parser.add_argument("spec_file", nargs="?", type=_args.input_file,
                        help="spec file written by cudnorm.record_specs()")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="build the graphs of a model preset")
    parser.add_argument("--batch", type=_args.positive_int, default=1, help="preset batch size (default 1)")
    parser.add_argument("--seq", type=_args.positive_int, default=None,
                        help="preset tokens per sample (default: the preset's)")
    parser.add_argument("--dtype", type=_dtype, default="bf16", help="preset activation dtype: bf16, fp16 or fp32")
    parser.add_argument("--device", type=_args.non_negative_int, default=None,
                        help="CUDA device index to build on (default: the specs')")
    parser.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    if args.list_presets:
        print_table([{"preset": p.name, "model": p.model, "default seq": p.default_seq, "norm layers": p.norms}
                     for p in PRESETS.values()], ("preset", "model", "default seq", "norm layers"))
        return 0
    if (args.spec_file is None) == (args.preset is None):
        raise _args.UsageError("spec_file/--preset", "give a spec file or --preset NAME (--list-presets lists them)")
    if args.spec_file is not None:
        try:  # the file's contents are the input here: a damaged or foreign file is a usage error
            source = read_spec_file(args.spec_file)
        except ValueError as exc:
            raise _args.UsageError("spec_file", str(exc)) from None
    else:
        source = args.preset
    specs = resolve(source, batch=args.batch, seq=args.seq, dtype=args.dtype, device=args.device)
    status = _runtime.cudnn_status()
    if not status.available:
        print(f"cudnorm warmup: cuDNN is not available here ({status.reason}); nothing was built. "
              f"The {len(specs)} graph(s) it would build:")
        for spec in specs:
            print(f"  {spec.slug()}")
        return 0
    start = time.perf_counter()
    try:
        rows = warmup(specs, progress=not args.no_progress)
    except ValueError as exc:  # specs naming a GPU this machine lacks
        raise _args.UsageError("--device", str(exc)) from None
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    print_table([{**r, "seconds": f"{r['seconds']:.3f}"} for r in rows], ("spec", "source", "plan", "seconds", "serves"))
    counts = {k: sum(r["source"] == k for r in rows) for k in ("built", "store", "cached", "declined")}
    print(f"\n{len(rows)} graph(s) in {time.perf_counter() - start:.1f} s: "
          + ", ".join(f"{n} {k}" for k, n in counts.items()))
    return 0
