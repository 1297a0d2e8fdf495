"""Variable row counts: a few shared row-chunk graphs instead of one graph per row count.

A cuDNN norm graph is built for one row count ``M`` (0.25-0.3 s for a LayerNorm forward,
0.75-1.1 s for a backward at N = 4096 on cuDNN 9.19), and execute-time shape overrides need
cuDNN >= 9.21. A run over many distinct ``M`` would spend its time building. So, per norm
*family* (a spec without its row count):

* the first ``CUDNORM_EXACT_ROWS`` distinct row counts (default 1) get exact graphs, as
  before: fixed-shape training keeps its exact-shape speed and builds nothing more;
* later row counts are cut into chunks of a few fixed sizes (:data:`CHUNK_ROWS`), each
  chunk one launch of a cached chunk graph on pointer offsets into the row dimension. Rows
  are independent, so the output is the same function; the backward's dW/dB are summed in
  fp32 from one partial row per chunk;
* a remainder shorter than the smallest chunk is covered by one smallest-size chunk that
  *ends* at row ``M`` and overlaps the rows before it. It runs first; the full chunks run
  after it (same stream) and rewrite the overlapped rows. In the backward its ``dy`` is a
  copy whose overlapped rows are zero, so they add nothing to dW/dB (and get ``dx = 0``
  until rewritten);
* a row count below the smallest chunk runs PyTorch's kernels (the call is tiny).

Forward chunk graphs are dynamic-shape graphs sharing a kernel cache, which makes a further
forward build 0.03-0.06 s instead of ~0.25 s; it does not help backward builds (measured in
``benchmarks/probe_rows.py``). The chunk sizes trade build time (one graph per size and
phase) against launch count and the remainder's overlap; ``benchmarks/variable_rows.py``
measures both.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from . import _cache, _dispatch, _graphs, _settings
from ._spec import NormSpec

# Chunk sizes per phase, largest first. Measured at N = 4096 bf16, 65536 rows (H200): 4096-row
# chunks cost +18% (fwd) / +3% (bwd) over the exact graph, 16384-row chunks -26% on the
# backward, 1024-row chunks +63-106% (used only for the remainder).
CHUNK_ROWS = {"train": (16384, 4096, 1024), "infer": (16384, 4096, 1024), "bwd": (16384, 4096)}
DYNAMIC_PHASES = frozenset({"train", "infer"})

_ROW_ROLES = frozenset({"x", "y", "dy", "dx", "mean", "rstd"})
_STAT_ROLES = ("mean", "rstd")
_SUM_ROLES = ("dscale", "dbias")

_exact_rows: dict[NormSpec, set[int]] = {}  # family -> row counts given exact graphs
_lock = threading.Lock()


def plan_or_chunks(spec: NormSpec):
    """What runs ``spec``: its cached or newly built exact :class:`~cudnorm._graphs.Plan`, a
    :class:`ChunkedPlan` over shared chunk graphs, or ``None`` (PyTorch's kernels). Both
    plan kinds take the buffers of ``spec`` in :func:`cudnorm._graphs.roles` order."""
    value = _cache.plans.lookup(spec)
    if value is not None and not _dispatch._recorders:
        return None if value is _cache.DECLINED else value
    return _resolve(spec)


def reset() -> None:
    """Forget which row counts got exact graphs (the next ones of each family will)."""
    with _lock:
        _exact_rows.clear()


def family(spec: NormSpec) -> NormSpec:
    """``spec`` without its row count (and the row-dependent autotune choice)."""
    return spec._replace(rows=0, autotune=False)


def chunkable(spec: NormSpec) -> bool:
    """Whether ``spec``'s rows can be cut: LayerNorm/RMSNorm with packed ``y``/``dx`` rows of
    a 16-byte multiple, so every chunk's row offset keeps cuDNN's pointer alignment."""
    return (spec.op in ("layer_norm", "rms_norm") and not spec.dynamic
            and spec.cols * spec.x_dtype.itemsize % 16 == 0)


def _resolve(spec: NormSpec):
    if not chunkable(spec):
        return _dispatch.get_plan(spec)
    with _lock:
        exact = _exact_rows.setdefault(family(spec), set())
        admitted = spec.rows in exact or len(exact) < _settings.current.exact_rows
        if admitted:
            exact.add(spec.rows)
    if admitted:
        return _dispatch.get_plan(spec)
    split = decompose(spec.rows, CHUNK_ROWS[spec.phase])
    if split is None:
        _cache.plans.record_rows_path(chunked=False)
        return None
    chunks, overlap = split
    plans = {size: _dispatch.get_plan(chunk_spec(spec, size)) for size in {size for _, size in chunks}}
    if None in plans.values():  # cuDNN declined a chunk graph: ask for the exact one as before
        return _dispatch.get_plan(spec)
    return ChunkedPlan(spec, chunks, overlap, plans)


def chunk_spec(spec: NormSpec, rows: int) -> NormSpec:
    """The chunk graph of ``rows`` rows serving ``spec``'s family.

    Chunk graphs are never autotuned: over 100 random row counts at N = 4096 (H200) tuning
    them cost 8 s of the 12.8 s spent building and left the steady state unchanged
    (147 ms per pass tuned, 139 ms untuned), while the whole point of chunks is few,
    cheap builds."""
    return spec._replace(rows=rows, autotune=False, dynamic=spec.phase in DYNAMIC_PHASES)


def decompose(rows: int, sizes: tuple[int, ...]) -> tuple[list[tuple[int, int]], int] | None:
    """``(chunks, overlap)``: ``(start, size)`` chunks covering ``[0, rows)``, or ``None`` if
    ``rows < min(sizes)``.

    Greedy, largest size first. A remainder ``r < min(sizes)`` becomes one chunk of the
    smallest size ending at ``rows``, listed *first*, whose first ``overlap = min(sizes) - r``
    rows belong to later chunks too (they rewrite them). Every other row is in exactly one
    chunk; ``overlap`` is 0 when there is no remainder.
    """
    smallest = min(sizes)
    if rows < smallest:
        return None
    chunks, start = [], 0
    for size in sorted(sizes, reverse=True):
        while rows - start >= size:
            chunks.append((start, size))
            start += size
    overlap = 0
    if start < rows:
        overlap = smallest - (rows - start)
        chunks.insert(0, (rows - smallest, smallest))
    return chunks, overlap


class ChunkedPlan:
    """Runs one call of ``spec`` as launches of chunk plans (see the module docstring).

    Args:
        spec: the exact spec of the call (``spec.rows`` = M).
        chunks, overlap: from :func:`decompose`.
        plans: chunk size -> runnable plan of that many rows (same family as ``spec``).
    """

    def __init__(self, spec: NormSpec, chunks: list[tuple[int, int]], overlap: int, plans: dict) -> None:
        self.spec = spec
        self.chunks = chunks
        self.overlap = overlap
        self.plans = plans

    def run(self, *buffers: torch.Tensor) -> None:
        """Execute on the current stream; ``buffers`` as for the exact plan of ``spec``:
        ``[M, N]`` x/y/dy/dx, ``[M]`` fp32 mean/rstd, ``[N]`` params/eps, fp32 ``[N]`` dW/dB."""
        spec = self.spec
        roles = _graphs.roles(spec)
        named = dict(zip(roles, buffers))
        sums = [r for r in _SUM_ROLES if r in named]
        # one fp32 partial row per chunk and output (16-byte aligned: chunkable() implies cols % 4 == 0)
        partials = (torch.empty((len(self.chunks), len(sums), spec.cols), dtype=torch.float32,
                                device=named["x"].device) if sums else None)
        for index, (start, size) in enumerate(self.chunks):
            view = {r: named[r][start:start + size] if r in _ROW_ROLES else named[r] for r in roles}
            for k, r in enumerate(sums):
                view[r] = partials[index, k]
            copies = self._remainder(named, view, start, size) if index == 0 and self.overlap else ()
            self.plans[size].run(*(view[r] for r in roles))
            for dest, src in copies:
                dest.copy_(src)
        for k, r in enumerate(sums):
            torch.sum(partials[:, k], dim=0, out=named[r])
        _cache.plans.record_rows_path(chunked=True)

    def _remainder(self, named: dict, view: dict, start: int, size: int) -> list:
        """Adjust ``view`` for the overlapping remainder chunk; returns the ``(dest, src)``
        copies to make after it ran.

        Its start row is arbitrary, so its fp32 stats would be misaligned in place: they go
        through fresh buffers. Backward: ``dy`` of the overlapped rows is zero, so they add
        nothing to dW/dB.
        """
        overlap = self.overlap
        stats = [r for r in _STAT_ROLES if r in view]
        if self.spec.phase == "bwd":
            view["dy"] = F.pad(named["dy"][start + overlap:start + size], (0, 0, overlap, 0))
            for r in stats:
                view[r] = view[r].clone()
            return []
        copies = []
        for r in stats:
            view[r] = torch.empty_like(view[r])
            copies.append((named[r][start + overlap:start + size], view[r][overlap:]))
        return copies
