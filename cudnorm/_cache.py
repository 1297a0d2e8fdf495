"""The plan of a spec: memory LRU -> on-disk plan store -> build (:func:`get_plan`).

Building a graph costs 0.1-1.4 s, so every built :class:`~cudnorm._graphs.Plan` is kept in
an LRU keyed by :class:`NormSpec`, and, when the on-disk plan store is enabled, looked up
there before building and saved there after. A spec cuDNN declines is remembered too (as ``DECLINED``), so the PyTorch fallback is
taken at once on later calls instead of re-asking cuDNN.

Size: ``cudnorm.config(cache_size=...)`` entries (default 512); a change resizes it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field

from . import _graphs, _lru, _plan_store, _recording, _settings, _warn
from ._spec import NormSpec

DECLINED = object()  # cache value for a spec cuDNN has no engine for


@dataclass
class CacheInfo:
    """Counters of the plan cache (see :func:`cudnorm.cache_info`); ``caches``: every cache
    of the package (plans, call-signature memos, row-count history, constants...) by name."""

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
    # name -> {size, capacity, hits, misses, evictions}: plain dicts, so vars(info) stays JSON
    caches: dict[str, dict] = field(default_factory=dict, repr=False)


class PlanCache(_lru.LRU):
    """The LRU of ``NormSpec -> Plan | DECLINED`` with build counters.

    Thread-safe: a miss builds under a per-spec lock, so two threads asking for the same new
    spec build it once while other specs stay servable.
    """

    def __init__(self, capacity: int, *, register: bool = False) -> None:
        super().__init__("plans", capacity, register=register)
        self._building: dict[NormSpec, threading.Lock] = {}
        self._counts = CacheInfo()

    def lookup(self, spec: NormSpec):
        """The cached value for ``spec`` (counted as a hit) or ``None``."""
        return self.get(spec, count_miss=False)

    def count_hit(self) -> None:
        """Count a hit served without :meth:`lookup` (a call signature memo held the plan)."""
        self.hits += 1

    def get_or_build(self, spec: NormSpec, build):
        """The value for ``spec``; on a miss ``build(spec)`` makes it (once per spec)."""
        value = self.lookup(spec)
        if value is not None:
            return value
        with self._lock:
            spec_lock = self._building.setdefault(spec, threading.Lock())
        with spec_lock:
            value = self.peek(spec)
            if value is None:
                self.misses += 1
                value = build(spec)
                self.put(spec, value)
            else:  # another thread built it while this one waited
                self.hits += 1
        with self._lock:
            self._building.pop(spec, None)
        return value

    def record_build(self, seconds: float, *, from_store: bool = False, declined: bool = False) -> None:
        with self._lock:
            if declined:
                self._counts.declined += 1
            elif from_store:
                self._counts.store_loads += 1
            else:
                self._counts.builds += 1
                self._counts.build_seconds += seconds

    def record_rows_path(self, *, chunked: bool) -> None:
        """Count a call that :mod:`cudnorm._rows` served by chunks, or sent to PyTorch."""
        with self._lock:
            if chunked:
                self._counts.chunked_calls += 1
            else:
                self._counts.small_rows_fallbacks += 1

    def specs(self) -> list[NormSpec]:
        """The cached specs, least recently used first."""
        return self.keys()

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(**{**self._counts.__dict__, "hits": self.hits, "misses": self.misses,
                                "evictions": self.evictions, "size": len(self._data), "capacity": self.capacity,
                                "caches": {name: dataclasses.asdict(stats) for name, stats in _lru.stats().items()}})

    def clear(self) -> None:
        """Drop every plan and zero the counters."""
        super().clear()
        self.reset_counters()
        with self._lock:
            self._counts = CacheInfo()


plans = PlanCache(_settings.current.cache_size, register=True)
_settings.on_change(lambda old, new: plans.resize(new.cache_size))


_warned = _lru.LRU("declined_warnings", 4096)  # spec slugs already warned about (once each)


def get_plan(spec: NormSpec):
    """The :class:`~cudnorm._graphs.Plan` for ``spec``, or ``None`` if cuDNN declines it (the
    op then runs PyTorch's kernels): from memory, else the on-disk store, else built."""
    if _recording.blocks:
        _recording.note(spec)
    value = plans.get_or_build(spec, _build)
    return None if value is DECLINED else value


def stored(spec: NormSpec) -> bool:
    """Whether the on-disk plan store holds a plan for ``spec`` (loading it is cheap)."""
    store = _plan_store.installed()
    return store is not None and store.has(spec)


def _build(spec: NormSpec):
    """A cache miss: load from the store, else build (and save); ``DECLINED`` when cuDNN has
    no engine for the graph (warned once per spec)."""
    store = _plan_store.installed()
    if store is not None:
        start = time.perf_counter()
        plan = store.load(spec)
        if plan is not None:
            plans.record_build(time.perf_counter() - start, from_store=True)
            return plan
    try:
        plan = _graphs.build_plan(spec)
    except Exception as exc:  # no engine for this configuration: take the PyTorch path
        plans.record_build(0.0, declined=True)
        if spec.slug() not in _warned:
            _warned.put(spec.slug(), True)
            _warn.warn(f"cudnorm.{spec.op}: cuDNN declined {spec.slug()} ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); using PyTorch's kernels",
                       RuntimeWarning)
        return DECLINED
    plans.record_build(plan.build_seconds)
    if store is not None:
        store.save(plan)
    return plan
