"""Which plan runs a call: ``x`` as cuDNN reads it, its :class:`NormSpec` and its plan, with a
memo so that a call repeating an earlier call's signature skips re-deriving them.

Deriving them costs a layout check (four stride reads and an address), building the spec,
the row-count policy of :mod:`cudnorm._rows` and the plan cache's locked LRU update: about a
third of the host time of a small norm call. Training and serving repeat a few signatures
(shape, strides, dtypes, device, phase) millions of times, so the first call of a signature
records what it found and later calls check one dictionary. Only exact plans are recorded
(they never change for a spec); row-chunked and declined calls take the full path, which
keeps the row policy's counters and the fallback warnings as they are. A recorded call still
checks the one thing its signature does not fix, the 16-byte alignment of ``x``'s address.

The memo is emptied by ``cudnorm.clear_cache()`` and whenever the settings are reloaded, and
is bypassed while ``cudnorm.record_specs()`` is recording (every spec must be seen then).
"""

from __future__ import annotations

import torch

from . import _cache, _dispatch, _graphs, _rows, _settings
from ._spec import NormSpec

_CAPACITY = 1024
_memo: dict = {}  # signature -> (spec, plan)
_memo_settings = None  # the settings _memo was filled under


def rows_spec_plan(op: str, phase: str, x: torch.Tensor, scale_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, NormSpec, object]:
    """``(x_rows, spec, plan)`` for a LayerNorm/RMSNorm call on ``x: [M, N]`` (CUDA).

    ``x_rows`` is ``x`` or, when its layout is not one cuDNN reads, a contiguous copy;
    ``plan`` is a :class:`~cudnorm._graphs.Plan`, a :class:`~cudnorm._rows.ChunkedPlan` or
    ``None`` (cuDNN declines: the caller runs PyTorch's kernels).
    """
    signature = (op, phase, x.shape, x.stride(), x.dtype, x.get_device(), scale_dtype)
    hit = _memo.get(signature)
    if hit is not None and _memo_settings is _settings.current and not _dispatch._recorders \
            and not x.data_ptr() % 16:
        _cache.plans.count_hit()
        return x, hit[0], hit[1]
    rows = _dispatch.cudnn_rows(x)
    spec = _dispatch.spec_for(op, phase, rows, scale_dtype, rows.device.index)
    plan = _rows.plan_or_chunks(spec)
    if rows is x and isinstance(plan, _graphs.Plan) and not _dispatch._recorders:
        _remember(signature, spec, plan)
    return rows, spec, plan


def _remember(signature: tuple, spec: NormSpec, plan) -> None:
    global _memo_settings
    if _memo_settings is not _settings.current:
        _memo.clear()
        _memo_settings = _settings.current
    if len(_memo) >= _CAPACITY:
        _memo.clear()
    _memo[signature] = (spec, plan)


def forget() -> None:
    """Empty the memo (``cudnorm.clear_cache()`` calls this)."""
    _memo.clear()
