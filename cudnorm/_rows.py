"""Variable row counts: a few shared row-chunk graphs instead of one graph per row count.

A cuDNN norm graph is built for one row count ``M`` (0.25-0.3 s for a LayerNorm forward,
0.75-1.1 s for a backward at N = 4096 on cuDNN 9.19), and no cuDNN release (9.28 tried) offers
an engine for a norm graph with execute-time shape overrides. A run over many distinct ``M``
would spend its time building. So, per norm
*family* (a spec without its row count):

* a row count gets exact graphs once it has been asked for ``Config.exact_after`` times
  (default 1: at once), for at most ``Config.exact_rows`` counts per family (default 1), so
  fixed-shape training and serving run exact-shape graphs from the first call. A run over
  many counts can set ``cudnorm.config(exact_rows=0)`` (chunk graphs only: fewest builds) or
  a larger ``exact_after`` (only counts that recur get exact graphs). A count whose exact
  plan is in the on-disk plan store uses it at once (loading is cheap);
* the other calls are cut into chunks of a few fixed sizes (:data:`CHUNK_ROWS`), each
  chunk one launch of a cached chunk graph on offsets into the row dimension. Rows are
  independent, so the output is the same function; the backward's dW/dB are summed in
  fp32 from one partial row per chunk;
* rows left over are covered by one more chunk that *ends* at row ``M`` and overlaps the
  rows before it. It runs first; the other chunks run after it (same stream) and rewrite
  the overlapped rows. In the backward it has the smallest size and its ``dy`` is a copy
  whose overlapped rows are zero, so they add nothing to dW/dB (and get ``dx = 0`` until
  rewritten). In the forward, where overlapped rows cost only recomputation, it is the
  first size whose chunk is at least half filled (:func:`decompose`), which saves launches;
* a row count below the smallest chunk runs PyTorch's kernels (the call is tiny) unless it
  gets exact graphs.

Forward chunk graphs are dynamic-shape graphs sharing a kernel cache, which makes a further
forward build 0.02-0.06 s instead of ~0.25 s; it does not help backward builds (H200;
docs/performance.md, Decisions). The chunk sizes trade build time (one graph per size and
phase) against launch count and the overlap; ``benchmarks/variable_rows.py`` measures both.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from . import _cache, _graphs, _lru, _recording, _settings
from ._spec import NormSpec

# Chunk sizes per phase, largest first. Measured at N = 4096 bf16, 65536 rows (H200): 4096-row
# chunks cost +18% (fwd) / +3% (bwd) over the exact graph, 16384-row chunks -26% on the
# backward, 1024-row chunks +63-106% (used only for the remainder). docs/performance.md,
# Decisions.
CHUNK_ROWS = {"train": (16384, 4096, 1024), "infer": (16384, 4096, 1024), "bwd": (16384, 4096)}
DYNAMIC_PHASES = frozenset({"train", "infer"})

_ROW_ROLES = frozenset({"x", "y", "dy", "dx", "mean", "rstd", "residual", "h"})
_STAT_ROLES = ("mean", "rstd")
_SUM_ROLES = ("dscale", "dbias")

# Whether the overlapping chunk may be any size (forward) or only the smallest (backward: its dy
# is copied, so a large overlapping chunk would copy up to a chunk of dy per call).
OVERLAP_ANY_SIZE = {"train": True, "infer": True, "bwd": False}

# family -> row counts given exact graphs (a forgotten family starts its exact budget again)
_exact_rows = _lru.LRU("exact_row_families", 4096)
# spec -> [ChunkedPlan or None (PyTorch's kernels), times asked for]: a repeated row count skips
# the policy until it may be promoted to exact graphs
_memo = _lru.LRU("row_counts", 4096)
_memo_settings = None  # the settings _memo was filled under
_lock = threading.Lock()


def plan_or_chunks(spec: NormSpec):
    """What runs ``spec``: its cached or newly built exact :class:`~cudnorm._graphs.Plan`, a
    :class:`ChunkedPlan` over shared chunk graphs, or ``None`` (PyTorch's kernels). Both
    plan kinds take the buffers of ``spec`` in :func:`cudnorm._graphs.roles` order."""
    value = _cache.plans.lookup(spec)
    if value is not None and not _recording.blocks:
        return None if value is _cache.DECLINED else value
    entry = _memo.get(spec, count_miss=False)
    if entry is not None and _memo_settings is _settings.current and not _recording.blocks:
        entry[1] += 1
        if entry[1] != _settings.current.exact_after:  # only then may the count be promoted
            _cache.plans.record_rows_path(chunked=entry[0] is not None)
            return entry[0]
    return _resolve(spec)


_reset_listeners: list = []


def reset() -> None:
    """Forget which row counts got exact graphs and how often counts were seen, and the
    chunked plans made so far."""
    with _lock:
        _exact_rows.clear()
        _memo.clear()
    for listener in _reset_listeners:
        listener()


def on_reset(listener) -> None:
    """Call ``listener()`` after each :func:`reset` (for holders of what the row policy decided:
    the native path's recipes)."""
    _reset_listeners.append(listener)


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
        return _cache.get_plan(spec)
    current = _settings.current
    with _lock:
        exact = _exact_rows.peek(family(spec))
        if exact is None:
            exact = set()
            _exact_rows.put(family(spec), exact)
        entry = _memo.peek(spec) if _memo_settings is current else None
        seen = 1 if entry is None else entry[1]
        admitted = spec.rows in exact or (len(exact) < current.exact_rows and seen >= current.exact_after)
    # a plan the on-disk store holds (warmed up, or built by an earlier run) loads in tens of
    # milliseconds instead of a build: use it at once, whatever the policy says
    if admitted or _cache.stored(spec):
        with _lock:
            exact.add(spec.rows)
            _memo.pop(spec, None)
        return _cache.get_plan(spec)
    if entry is not None:  # asked for often enough, but the family has its exact counts
        _cache.plans.record_rows_path(chunked=entry[0] is not None)
        return entry[0]
    split = decompose(spec.rows, CHUNK_ROWS[spec.phase], any_size_overlap=OVERLAP_ANY_SIZE[spec.phase])
    if split is None:
        _remember(spec, None)
        _cache.plans.record_rows_path(chunked=False)
        return None
    chunks, overlap = split
    plans = {size: _cache.get_plan(chunk_spec(spec, size)) for size in {size for _, size in chunks}}
    if None in plans.values():  # cuDNN declined a chunk graph: ask for the exact one as before
        return _cache.get_plan(spec)
    chunked = ChunkedPlan(spec, chunks, overlap, plans)
    _remember(spec, chunked)
    _cache.plans.record_rows_path(chunked=True)
    return chunked


def _remember(spec: NormSpec, chunked) -> None:
    global _memo_settings
    with _lock:
        if _memo_settings is not _settings.current:
            _memo.clear()
            _memo_settings = _settings.current
        _memo.put(spec, [chunked, 1])


def chunk_spec(spec: NormSpec, rows: int) -> NormSpec:
    """The chunk graph of ``rows`` rows serving ``spec``'s family.

    Chunk graphs are never autotuned: over 100 random row counts at N = 4096 (H200) tuning
    them cost 8 s of the 12.8 s spent building and left the steady state unchanged
    (147 ms per pass tuned, 139 ms untuned), while the whole point of chunks is few,
    cheap builds (docs/performance.md, Decisions). Backward chunks read an fp32 scale and
    write fp32 partial dW/dB whatever the weight's dtype: the partials are summed across
    chunks and rounded once, so half-precision weights get one rounding, as with an exact
    graph."""
    scale_dtype = torch.float32 if spec.phase == "bwd" else spec.scale_dtype
    return spec._replace(rows=rows, autotune=False, dynamic=spec.phase in DYNAMIC_PHASES, scale_dtype=scale_dtype)


def _sum_rows(partials: torch.Tensor, out: torch.Tensor) -> None:
    """``out = partials.sum(0)``, summed in fp32 and rounded once into ``out``'s dtype."""
    if out.dtype is torch.float32:
        torch.sum(partials, dim=0, out=out)
    else:
        out.copy_(partials.sum(0))


def decompose(rows: int, sizes: tuple[int, ...], *, any_size_overlap: bool = False
              ) -> tuple[list[tuple[int, int]], int] | None:
    """``(chunks, overlap)``: ``(start, size)`` chunks covering ``[0, rows)``, or ``None`` if
    ``rows < min(sizes)``.

    Greedy, largest size first. Rows left over are covered by one chunk ending at ``rows``,
    listed *first*, whose first ``overlap`` rows belong to later chunks too (they rewrite
    them); every other row is in exactly one chunk, and ``overlap`` is 0 when nothing is
    left over. That chunk has the smallest size, or with ``any_size_overlap`` the first size
    (largest first) that is at most ``rows`` and whose chunk the left-over rows fill at
    least half of, which replaces several smaller launches by one. Every chunk lies in
    ``[0, rows)``.
    """
    smallest = min(sizes)
    if rows < smallest:
        return None
    chunks, start = [], 0
    for size in sorted(sizes, reverse=True):
        while rows - start >= size:
            chunks.append((start, size))
            start += size
        left = rows - start
        # the overlapping chunk ends at ``rows``, so it must fit in [0, rows): a larger one
        # would start before row 0 and its launch would read and write outside the buffers
        if left and size <= rows and (size == smallest or (any_size_overlap and 2 * left >= size)):
            chunks.insert(0, (rows - size, size))
            return chunks, size - left
    return chunks, 0


class ChunkedPlan:
    """Runs one call of ``spec`` as launches of chunk plans (see the module docstring).

    Everything that does not depend on the buffers (which slots are cut, the split sizes,
    the bound ``run`` of each chunk plan) is worked out here once: a call costs one
    ``split`` per row buffer plus one execute per chunk (15-18 us of host time each).

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
        roles = _graphs.roles(spec)
        self._row_slots = tuple(i for i, r in enumerate(roles) if r in _ROW_ROLES)
        self._stat_slots = tuple(i for i, r in enumerate(roles) if r in _STAT_ROLES)
        self._sum_slots = tuple(i for i, r in enumerate(roles) if r in _SUM_ROLES)
        self._dy_slot = roles.index("dy") if "dy" in roles else None
        self._scale_slot = roles.index("scale")
        regular = chunks[1:] if overlap else chunks
        # split sizes cover [0, M): the regular chunks, then the rows only the remainder has
        self._split = [size for _, size in regular]
        if overlap:
            self._split.append(spec.rows - sum(self._split))
            self._remainder = (chunks[0][0], plans[chunks[0][1]].run)
        self._runs = [plans[size].run for _, size in regular]
        # Address path: every chunk plan launches from raw addresses (cudnorm._graphs.RawExecute),
        # so a chunk is a few integer additions instead of a tensor view per buffer; inside a
        # training step this halved the host time of a chunked call (H200; docs/performance.md,
        # Decisions).
        if all(getattr(plan, "raw", None) is not None for plan in plans.values()):
            itemsize = spec.x_dtype.itemsize
            row_bytes = {"x": spec.x_row_stride * itemsize, "mean": 4, "rstd": 4}
            self._row_bytes = tuple((slot, row_bytes.get(roles[slot], spec.cols * itemsize)) for slot in self._row_slots)
            self._launches = [(start, plans[size]) for start, size in regular]
        else:
            self._launches = None

    def run(self, *buffers: torch.Tensor) -> None:
        """Execute on the current stream; ``buffers`` as for the exact plan of ``spec``:
        ``[M, N]`` x/y/dy/dx, ``[M]`` fp32 mean/rstd, ``[N]`` params/eps, ``[N]`` dW/dB in the
        scale's dtype (the chunks read an fp32 scale: see :func:`chunk_spec`)."""
        if self._sum_slots and buffers[self._scale_slot].dtype is not torch.float32:
            buffers = list(buffers)
            buffers[self._scale_slot] = buffers[self._scale_slot].float()
        if self._launches is not None:
            self._run_by_address(buffers)
            return
        args = list(buffers)
        pieces = [(slot, buffers[slot].split(self._split)) for slot in self._row_slots]
        sums = self._sum_slots
        partial_rows = ()
        if sums:
            # one fp32 partial row per chunk and output (16-byte aligned: chunkable() implies cols % 4 == 0)
            launches = len(self._runs) + (1 if self.overlap else 0)
            partials = torch.empty((launches, len(sums), self.spec.cols), dtype=torch.float32,
                                   device=buffers[0].device)
            partial_rows = partials.view(-1, self.spec.cols).unbind(0)
        launch = 0
        if self.overlap:
            self._run_remainder(buffers, args, partial_rows)
            launch = 1
        for index, run in enumerate(self._runs):
            for slot, piece in pieces:
                args[slot] = piece[index]
            for k, slot in enumerate(sums):
                args[slot] = partial_rows[launch * len(sums) + k]
            run(*args)
            launch += 1
        for k, slot in enumerate(sums):
            _sum_rows(partials[:, k], buffers[slot])

    def _run_remainder(self, buffers, args: list, partial_rows) -> None:
        """Run the chunk that ends at row M and overlaps the ``overlap`` rows before it.

        Its start row is arbitrary, so fp32 stats at that offset may break cuDNN's 16-byte
        alignment: they go through fresh buffers (forward: the rows it alone owns are copied
        back after). Backward: ``dy`` of the overlapped rows is zero, so they add nothing to
        dW/dB (their ``dx`` comes out zero and the later chunks rewrite it).
        """
        start, run = self._remainder
        overlap = self.overlap
        for slot in self._row_slots:
            args[slot] = buffers[slot][start:]
        for k, slot in enumerate(self._sum_slots):
            args[slot] = partial_rows[k]
        if self._dy_slot is not None:
            args[self._dy_slot] = F.pad(buffers[self._dy_slot][start + overlap:], (0, 0, overlap, 0))
            for slot in self._stat_slots:
                args[slot] = args[slot].clone()
            run(*args)
            return
        fresh = [(slot, torch.empty_like(args[slot])) for slot in self._stat_slots]
        for slot, tensor in fresh:
            args[slot] = tensor
        run(*args)
        for slot, tensor in fresh:
            buffers[slot][start + overlap:].copy_(tensor[overlap:])

    def _run_by_address(self, buffers) -> None:
        """:meth:`run` on the address path: the same launches, chunks given as offsets."""
        base = [b.data_ptr() for b in buffers]
        pointers = list(base)
        sums = self._sum_slots
        cols = self.spec.cols
        keep = []  # temporaries that must outlive the launch calls below
        if sums:
            launches = len(self._launches) + (1 if self.overlap else 0)
            partials = torch.empty((launches, len(sums), cols), dtype=torch.float32, device=buffers[0].device)
            partial_base = partials.data_ptr()
        launch = 0
        if self.overlap:
            keep = self._remainder_by_address(buffers, pointers, partial_base if sums else 0)
            launch = 1
        for start, plan in self._launches:
            for slot, nbytes in self._row_bytes:
                pointers[slot] = base[slot] + start * nbytes
            for k, slot in enumerate(sums):
                pointers[slot] = partial_base + (launch * len(sums) + k) * cols * 4
            plan.launch(pointers)
            launch += 1
        for k, slot in enumerate(sums):
            _sum_rows(partials[:, k], buffers[slot])
        del keep

    def _remainder_by_address(self, buffers, pointers: list, partial_base: int) -> list:
        """The remainder chunk of :meth:`_run_remainder` on the address path. Its fp32 stats
        go through temporaries only when their offset breaks 16-byte alignment."""
        start, _ = self._remainder
        plan = self.plans[self.chunks[0][1]]
        overlap = self.overlap
        for slot, nbytes in self._row_bytes:
            pointers[slot] = buffers[slot].data_ptr() + start * nbytes
        cols = self.spec.cols
        for k, slot in enumerate(self._sum_slots):
            pointers[slot] = partial_base + k * cols * 4
        keep = []
        misaligned = any((buffers[slot].data_ptr() + start * 4) % 16 for slot in self._stat_slots)
        if self._dy_slot is not None:
            dy = F.pad(buffers[self._dy_slot][start + overlap:], (0, 0, overlap, 0))
            pointers[self._dy_slot] = dy.data_ptr()
            keep.append(dy)
            if misaligned:
                for slot in self._stat_slots:
                    stat = buffers[slot][start:].clone()
                    pointers[slot] = stat.data_ptr()
                    keep.append(stat)
            plan.launch(pointers)
            return keep
        size = self.chunks[0][1]
        stats = torch.empty((len(self._stat_slots), size), dtype=torch.float32, device=buffers[0].device) if (
            misaligned and self._stat_slots) else None
        if stats is not None:
            for k, slot in enumerate(self._stat_slots):
                pointers[slot] = stats.data_ptr() + k * size * 4
        plan.launch(pointers)
        if stats is not None:
            for k, slot in enumerate(self._stat_slots):
                buffers[slot][start + overlap:].copy_(stats[k, overlap:])
        return keep
