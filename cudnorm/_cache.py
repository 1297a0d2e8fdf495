"""In-memory cache of built cuDNN plans: a bounded, thread-safe LRU keyed by :class:`NormSpec`.

Building a graph costs 0.1-1.4 s, so every built :class:`~cudnorm._graphs.Plan` is kept here,
and, when the on-disk plan store is enabled, looked up there before building and saved there
after. A spec cuDNN declines is remembered too (as ``DECLINED``), so the PyTorch fallback is
taken at once on later calls instead of re-asking cuDNN.

Size: ``cudnorm.config(cache_size=...)`` entries (default 512); a change resizes it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from . import _settings
from ._spec import NormSpec

DECLINED = object()  # cache value for a spec cuDNN has no engine for


@dataclass
class CacheInfo:
    """Counters of the plan cache (see :func:`cudnorm.cache_info`)."""

    hits: int = 0
    misses: int = 0
    builds: int = 0
    build_seconds: float = 0.0
    store_loads: int = 0
    declined: int = 0
    evictions: int = 0
    size: int = 0
    capacity: int = 0
    chunked_calls: int = 0  # calls served by row-chunk graphs (cudnorm._rows)
    small_rows_fallbacks: int = 0  # calls of a variable-rows family too short to chunk: PyTorch ran


class PlanCache:
    """Bounded LRU of ``NormSpec -> Plan | DECLINED`` with hit/miss/build counters.

    Thread-safe: lookups take one lock; a miss builds under a per-spec lock, so two threads
    asking for the same new spec build it once while other specs stay servable.
    """

    def __init__(self, capacity: int) -> None:
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[NormSpec, threading.Lock] = {}
        self._info = CacheInfo(capacity=capacity)
        self._evict_listeners: list = []

    def on_evict(self, listener) -> None:
        """Call ``listener()`` after entries are evicted, so that whatever else holds plans
        (the call signature memos) lets them go too: the capacity bounds the plans alive."""
        self._evict_listeners.append(listener)

    def _evicted(self) -> None:
        for listener in self._evict_listeners:
            listener()

    def lookup(self, spec: NormSpec):
        """The cached value for ``spec`` (counted as a hit) or ``None``."""
        with self._lock:
            value = self._entries.get(spec)
            if value is not None:
                self._entries.move_to_end(spec)
                self._info.hits += 1
            return value

    def count_hit(self) -> None:
        """Count a hit served without :meth:`lookup` (a call signature memo held the plan).
        Not under the lock: this runs on every call, and a count two threads race on may
        at worst miss one hit."""
        self._info.hits += 1

    def get_or_build(self, spec: NormSpec, build):
        """The value for ``spec``; on a miss ``build(spec)`` makes it (once per spec)."""
        value = self.lookup(spec)
        if value is not None:
            return value
        with self._lock:
            spec_lock = self._building.setdefault(spec, threading.Lock())
        with spec_lock:
            with self._lock:
                value = self._entries.get(spec)
                if value is None:
                    self._info.misses += 1
                else:  # another thread built it while this one waited
                    self._info.hits += 1
            if value is None:
                value = build(spec)
                self.put(spec, value)
        with self._lock:
            self._building.pop(spec, None)
        return value

    def put(self, spec: NormSpec, value) -> None:
        with self._lock:
            self._entries[spec] = value
            self._entries.move_to_end(spec)
            evicted = self._trim()
        if evicted:
            self._evicted()

    def _trim(self) -> int:
        """Evict least recently used entries down to the capacity (under the lock)."""
        evicted = 0
        while len(self._entries) > self._info.capacity:
            self._entries.popitem(last=False)
            evicted += 1
        self._info.evictions += evicted
        return evicted

    def record_build(self, seconds: float, *, from_store: bool = False, declined: bool = False) -> None:
        with self._lock:
            if declined:
                self._info.declined += 1
            elif from_store:
                self._info.store_loads += 1
            else:
                self._info.builds += 1
                self._info.build_seconds += seconds

    def record_rows_path(self, *, chunked: bool) -> None:
        """Count a call that :mod:`cudnorm._rows` served by chunks, or sent to PyTorch."""
        with self._lock:
            if chunked:
                self._info.chunked_calls += 1
            else:
                self._info.small_rows_fallbacks += 1

    def specs(self) -> list[NormSpec]:
        """The cached specs, least recently used first."""
        with self._lock:
            return list(self._entries)

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(**{**self._info.__dict__, "size": len(self._entries)})

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            capacity = self._info.capacity
            self._info = CacheInfo(capacity=capacity)

    def resize(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"cudnorm: cache capacity must be >= 1, got {capacity}")
        with self._lock:
            self._info.capacity = capacity
            evicted = self._trim()
        if evicted:
            self._evicted()


plans = PlanCache(_settings.current.cache_size)
_settings.on_change(lambda old, new: plans.resize(new.cache_size))
