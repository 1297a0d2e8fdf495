"""Progress bars for long work (tqdm when installed, else a one-line counter on stderr)."""

from __future__ import annotations

import sys


def progress(iterable, total: int | None = None, desc: str = ""):
    """Iterate ``iterable`` showing progress; quiet when stderr is not a terminal and tqdm
    is missing."""
    try:
        from tqdm.auto import tqdm  # noqa: PLC0415 - optional

        return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr)
    except ImportError:
        return _counter(iterable, total, desc)


def _counter(iterable, total, desc):
    stream = sys.stderr
    for i, item in enumerate(iterable, 1):
        if stream.isatty():
            stream.write(f"\r{desc} {i}/{total if total is not None else '?'}")
            stream.flush()
        yield item
    if stream.isatty():
        stream.write("\n")
