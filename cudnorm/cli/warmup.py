"""``cudnorm warmup SPEC_FILE | --preset NAME``: build the graphs a job needs ahead of the job
(:func:`cudnorm.warmup`)."""

from __future__ import annotations

import json
import time

from .. import _runtime
from ..warmup import PRESETS, resolve, warmup
from ._output import print_table


def add_arguments(parser) -> None:
    parser.add_argument("spec_file", nargs="?", help="spec file written by cudnorm.record_specs()")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="build the graphs of a model preset")
    parser.add_argument("--batch", type=int, default=1, help="preset batch size (default 1)")
    parser.add_argument("--seq", type=int, default=None, help="preset tokens per sample (default: the preset's)")
    parser.add_argument("--dtype", default="bf16", help="preset activation dtype: bf16, fp16 or fp32")
    parser.add_argument("--device", type=int, default=None, help="CUDA device to build on (default: the specs')")
    parser.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    if args.list_presets:
        print_table([{"preset": p.name, "model": p.model, "default seq": p.default_seq, "norm layers": p.norms}
                     for p in PRESETS.values()], ("preset", "model", "default seq", "norm layers"))
        return 0
    if (args.spec_file is None) == (args.preset is None):
        print("cudnorm warmup: give a spec file or --preset NAME (see --list-presets)")
        return 2
    try:
        specs = resolve(args.spec_file or args.preset, batch=args.batch, seq=args.seq, dtype=args.dtype,
                        device=args.device)
    except (TypeError, ValueError) as exc:
        print(exc)
        return 2
    status = _runtime.cudnn_status()
    if not status.available:
        print(f"cudnorm warmup: cuDNN is not available here ({status.reason}); nothing was built. "
              f"The {len(specs)} graph(s) it would build:")
        for spec in specs:
            print(f"  {spec.slug()}")
        return 0
    start = time.perf_counter()
    rows = warmup(specs, progress=not args.no_progress)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print_table([{**r, "seconds": f"{r['seconds']:.3f}"} for r in rows], ("spec", "source", "plan", "seconds"))
    counts = {k: sum(r["source"] == k for r in rows) for k in ("built", "store", "cached", "declined")}
    print(f"\n{len(rows)} graph(s) in {time.perf_counter() - start:.1f} s: "
          + ", ".join(f"{n} {k}" for k, n in counts.items()))
    return 0
