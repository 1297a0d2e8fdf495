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
# called with no arguments when the first block opens and when the last one closes: state that
# would let calls skip note() (the native path's recipes, cudnorm._native) steps aside meanwhile
listeners: list = []


def note(spec: NormSpec) -> None:
    """Record ``spec`` in every open block."""
    for seen in blocks:
        seen.setdefault(spec)


@contextmanager
def collecting() -> Iterator[dict]:
    """Open a block; yields the dict its specs are recorded in (keys, in first-seen order)."""
    seen: dict = {}
    blocks.append(seen)
    if len(blocks) == 1:
        _notify()
    try:
        yield seen
    finally:  # by identity: another open block's dict may compare equal
        blocks[:] = [b for b in blocks if b is not seen]
        if not blocks:
            _notify()


def _notify() -> None:
    for listener in listeners:
        listener()
