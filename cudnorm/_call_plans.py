"""Which plan runs a call, memoised by the call's signature so that a call repeating an
earlier one skips re-deriving it.

Deriving a plan costs a layout check (four stride reads and an address), building the spec,
the row-count policy of :mod:`cudnorm._rows` and the plan cache's locked LRU update: about a
third of the host time of a small norm call. Training and serving repeat a few signatures
(shape, strides, dtypes, device, phase) millions of times, so the first call of a signature
records what it found and later calls check one dictionary. Only exact plans are recorded
(they never change for a spec); row-chunked and declined calls take the full path, which
keeps the row policy's counters and the fallback warnings as they are. A recorded call still
checks the one thing its signature does not fix, the 16-byte alignment of ``x``'s address.

Every memo (:class:`SignatureMemo`, a :class:`cudnorm._lru.LRU`) is emptied by ``cudnorm.clear_cache()``, whenever the plan
cache evicts (a memo must not keep an evicted plan, and its memory, alive) and whenever the
settings change, and is bypassed while ``cudnorm.record_specs()`` is recording (every
spec must be seen then).
"""

from __future__ import annotations

import torch

from . import _cache, _dispatch, _graphs, _lru, _recording, _rows, _settings

_memos: list[SignatureMemo] = []


class SignatureMemo(_lru.LRU):
    """An LRU from a call signature to what the call resolved to, valid for one settings
    object; reads and writes are no-ops while specs are being recorded."""

    def __init__(self, name: str, capacity: int = 1024) -> None:
        super().__init__(name, capacity)
        self._settings = None  # the settings the entries were made under
        _memos.append(self)

    def get(self, signature: tuple, default=None, *, count_miss: bool = True):
        # LRU.get inlined: this runs on every op call
        if self._settings is not _settings.current or _recording.blocks:
            return default
        value = self._data.get(signature)
        if value is None:
            if count_miss:
                self.misses += 1
            return default
        try:
            self._data.move_to_end(signature)
        except KeyError:  # evicted by another thread since the lookup
            pass
        self.hits += 1
        return value

    def put(self, signature: tuple, value) -> None:
        if _recording.blocks:
            return
        if self._settings is not _settings.current:
            self.clear()
            self._settings = _settings.current
        super().put(signature, value)


_norm_calls = SignatureMemo("norm_calls")  # LayerNorm / RMSNorm: signature -> exact Plan


def rows_plan(op: str, phase: str, x: torch.Tensor, scale_dtype: torch.dtype,
              offset: bool = False, residual: bool = False) -> tuple[torch.Tensor, object]:
    """``(x_rows, plan)`` for a LayerNorm/RMSNorm call on ``x: [M, N]`` (CUDA).

    ``x_rows`` is ``x`` or, when its layout is not one cuDNN reads, a contiguous copy;
    ``plan`` is a :class:`~cudnorm._graphs.Plan`, a :class:`~cudnorm._rows.ChunkedPlan` or
    ``None`` (cuDNN declines: the caller runs PyTorch's kernels). ``offset``: a graph that
    scales by ``weight + offset`` (its launch passes the offset's host scalar);
    ``residual``: a graph with a fused residual add (:mod:`cudnorm._fused_add`). The hot path of every call:
    a repeated signature costs one tuple, one dictionary lookup and an alignment check.
    """
    signature = (op, phase, x.shape, x.stride(), x.dtype, x.get_device(), scale_dtype, offset, residual)
    plan = _norm_calls.get(signature)
    if plan is not None and not x.data_ptr() & 15:
        _cache.plans.count_hit()
        return x, plan
    rows = _dispatch.cudnn_rows(x)
    spec = _dispatch.spec_for(op, phase, rows, scale_dtype, rows.device.index, offset=offset, residual=residual)
    plan = _rows.plan_or_chunks(spec)
    if rows is x and isinstance(plan, _graphs.Plan):
        _norm_calls.put(signature, plan)
    return rows, plan


def forget() -> None:
    """Empty every memo (the plan cache's evictions call this: a memo must not keep an
    evicted plan alive)."""
    for memo in _memos:
        memo.clear()


_cache.plans.on_evict(forget)
