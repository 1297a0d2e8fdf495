"""Which specs the ops ask for while ``cudnorm.record_specs()`` blocks are open.

``blocks`` is read on every op call (an empty list is the common case); while it is not
empty the call-signature and row-count memos step aside, so every spec a call needs reaches
:func:`note`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ._spec import NormSpec

blocks: list[dict] = []  # one dict per open block, specs in the order first seen


def note(spec: NormSpec) -> None:
    """Record ``spec`` in every open block."""
    for seen in blocks:
        seen.setdefault(spec)


@contextmanager
def collecting() -> Iterator[dict]:
    """Open a block; yields the dict its specs are recorded in (keys, in first-seen order)."""
    seen: dict = {}
    blocks.append(seen)
    try:
        yield seen
    finally:  # by identity: another open block's dict may compare equal
        blocks[:] = [b for b in blocks if b is not seen]
