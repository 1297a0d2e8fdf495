"""The one cache abstraction: a bounded, thread-safe LRU map with counters, and the registry
of every cache in the package (what ``cudnorm.clear_cache()`` empties and
``cudnorm.cache_info().caches`` reports).

Reads take no lock: a dictionary lookup and ``OrderedDict.move_to_end`` are each one call
into C, atomic under the interpreter lock, and a read runs on every op call (a lock costs
a few hundred nanoseconds there). Writes, which evict, take the lock, and a write of a new
key evicts before it inserts, so a reader never sees more than ``capacity`` entries. Counters
are bumped without the lock: two threads racing may lose one count, never corrupt the map.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

_MISSING = object()


@dataclass(frozen=True)
class LRUStats:
    """One cache's counters (``cudnorm.cache_info().caches[name]``)."""

    size: int
    capacity: int
    hits: int
    misses: int
    evictions: int


class LRU:
    """A map of at most ``capacity`` entries; the least recently read or written goes first.

    Args:
        name: the key of this cache in :func:`registry` (unique).
        capacity: the most entries kept (>= 1).
        on_evict: called with no arguments after entries were evicted or cleared, outside the
            lock (for holders of derived state, such as memos of evicted plans).
        register: put it in the registry (``False`` for a private instance, as in tests).
    """

    def __init__(self, name: str, capacity: int, on_evict: Callable[[], None] | None = None, *,
                 register: bool = True) -> None:
        assert not (register and name in _REGISTRY), f"two registered caches named {name!r}"  # a bug here
        if capacity < 1:
            raise ValueError(f"cudnorm: cache capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._listeners = [] if on_evict is None else [on_evict]
        self.hits = self.misses = self.evictions = 0
        # peek(key, default=None): the value without counting or reordering, for the reads of
        # every op call that need no recency (a C call: no Python frame, ~0.3 us less than get)
        self.peek = self._data.get
        if register:
            _REGISTRY[name] = self

    def on_evict(self, listener: Callable[[], None]) -> None:
        """Also call ``listener()`` after evictions (see the class docstring)."""
        self._listeners.append(listener)

    def get(self, key, default=None, *, count_miss: bool = True):
        """The value for ``key`` (now the most recent), or ``default``; ``count_miss=False``
        for a lookup whose miss the caller counts itself (or does not call one)."""
        value = self._data.get(key, _MISSING)
        if value is _MISSING:
            if count_miss:
                self.misses += 1
            return default
        try:
            self._data.move_to_end(key)
        except KeyError:  # evicted by another thread since the lookup
            pass
        self.hits += 1
        return value

    def put(self, key, value) -> None:
        """Store ``value`` as the most recent entry; a new key first evicts the oldest entry
        if the cache is full (so lock-free readers never see ``capacity + 1`` entries)."""
        with self._lock:
            evicted = 0 if key in self._data else self._trim(room=1)
            self._data[key] = value
            self._data.move_to_end(key)
        if evicted:
            self._evicted()

    def pop(self, key, default=None):
        with self._lock:
            return self._data.pop(key, default)

    def clear(self) -> None:
        """Drop every entry (the counters stay: they describe the process)."""
        with self._lock:
            had = bool(self._data)
            self._data.clear()
        if had:
            self._evicted()

    def changed(self) -> None:
        """Tell the listeners that entries were replaced (as after an eviction): state derived
        from the old values must be dropped."""
        self._evicted()

    def reset_counters(self) -> None:
        self.hits = self.misses = self.evictions = 0

    def resize(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"cudnorm: cache capacity must be >= 1, got {capacity}")
        with self._lock:
            self.capacity = capacity
            evicted = self._trim()
        if evicted:
            self._evicted()

    def keys(self) -> list:
        """The keys, least recently used first."""
        with self._lock:
            return list(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key) -> bool:
        return key in self._data

    def stats(self) -> LRUStats:
        return LRUStats(len(self._data), self.capacity, self.hits, self.misses, self.evictions)

    def _trim(self, room: int = 0) -> int:
        """Evict the oldest entries until ``room`` more fit within the capacity (under the
        lock); returns how many went."""
        evicted = 0
        while len(self._data) > self.capacity - room:
            self._data.popitem(last=False)
            evicted += 1
        self.evictions += evicted
        return evicted

    def _evicted(self) -> None:
        for listener in self._listeners:
            listener()


_REGISTRY: dict[str, LRU] = {}


def registry() -> dict[str, LRU]:
    """Every cache of the package by name (a copy)."""
    return dict(_REGISTRY)


def clear_all() -> None:
    """Empty every registered cache (``cudnorm.clear_cache()``)."""
    for cache in list(_REGISTRY.values()):
        cache.clear()


def stats() -> dict[str, LRUStats]:
    """Every registered cache's counters by name."""
    return {name: cache.stats() for name, cache in _REGISTRY.items()}
