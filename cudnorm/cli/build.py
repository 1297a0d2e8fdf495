"""``cudnorm build``: compile the native launch path ahead of the first CUDA call (for images
and clusters: build once where the job's environment is, every later process loads it).

Prints where it was built and whether it loaded; exits 1, naming what is missing and how to
fix it, when it cannot be built here.
"""

from __future__ import annotations

import sys
import time


def add_arguments(parser) -> None:
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")


def run(args) -> int:
    from .. import _native  # noqa: PLC0415 - imports torch's cpp_extension tools when building

    start = time.perf_counter()
    try:
        library = _native.build(verbose=args.verbose)
    except _native.Unavailable as exc:
        print(f"cudnorm build: the native launch path cannot be built here: {exc.reason}. Fix: {exc.fix}",
              file=sys.stderr)
        return 1
    print(f"native launch path: {library} (loaded; {time.perf_counter() - start:.1f} s)")
    return 0
