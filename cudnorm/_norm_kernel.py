"""LayerNorm and RMSNorm forward and backward on ``[M, N]`` rows: cudnorm's own Triton kernels.

cuDNN 9.19's norm engines fall off a cliff at some widths (7-16x slower than PyTorch at 88, 96
and 2240, RMSNorm at 1152 and 1408: docs/cudnn-facts, section 10), mostly in the backward's
weight-gradient reduction, and PyTorch's kernels are not at bandwidth for the narrow rows of
per-head query/key norms (width 64-256, millions of rows). The measuring dispatcher times these
kernels beside cuDNN's plans and PyTorch's ops per call signature; they serve any width up to
:data:`MAX_COLS`, and are laid out for narrow rows with many of them:

* a program works on 2-D tiles of ``BLOCK_M`` rows x ``BLOCK_N`` columns (``BLOCK_N`` the
  next power of two of the width); the width is a compile-time constant, so rows of 88
  half-precision values (176 bytes, 16-byte aligned) still load in 16-byte vectors;
* the backward runs a fixed number of programs (a few per SM), each looping over tiles
  ``programs`` apart; each keeps its running ``sum(dy * xhat)`` and ``sum(dy)`` as a fp32 tile
  in registers and writes one partial column at the end. At narrow widths that are not powers
  of two the loop is Triton's software-pipelined ``tl.range`` (the next tiles' loads in flight
  through shared memory while one is computed: padded tiles hold too few bytes a load to keep
  the memory busy otherwise), its grid as many programs as the SMs hold of the compiled
  kernel (its registers and shared memory); LayerNorm's training forward loops the same way up to
  width 208, where elsewhere a forward program computes one tile. A second launch sums the
  ``[N, programs]`` fp32 partials in a fixed order and writes dweight and dbias in their dtypes:
  deterministic, no atomics. (PyTorch's sum of ``[programs, N]`` partial rows over its first dim,
  then a cast, cost 10-14 us more than the kernel alone on an H200, a sixth of a narrow
  backward.)

Math, all in fp32 with ``y``/``dx`` rounded once to x's dtype (a fp32 weight is used as is):

    LayerNorm  xhat = (x - mean) * rstd,  rstd = 1 / sqrt(var + eps)  (biased var)
    RMSNorm    xhat = x * rstd,           rstd = 1 / sqrt(mean(x^2) + eps)
    y = xhat * w + b
    g = dy * w;  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm: no mean(g))
    dw = sum_rows(dy * xhat),  db = sum_rows(dy)

The launch shape comes from one function, :func:`_config` (its constants are guesses until
``benchmarks/norm_kernel.py`` measures them); :func:`forward` and :func:`backward` take a
:class:`Config` to override it. Triton is imported on first use, so importing cudnorm never
imports it; the tests run the kernels under Triton's interpreter on a CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import _triton_launch

_F32 = torch.float32
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The widest row served: one row is one tile of ``MAX_COLS`` fp32 values across a program's threads.
#: Widths up to 4608 ran on an H100 (the sweep); at 16384 the backward spills registers in an
#: offline sm_90 compile, and nothing wider than 4608 has run on a GPU yet, so the bound stays at 8192.
MAX_COLS = 8192
#: From this padded width a tile is one row (``BLOCK_M = 1``).
WIDE_COLS = 1024


#: ``Config.programs_per_sm`` of a grid sized by the compiled kernel: as many programs as one SM
#: holds at once by its registers, shared memory and warps (:func:`_resident`)
RESIDENT = -1


class Config(NamedTuple):
    """A launch shape. ``block_m``: rows per tile (a power of two); ``num_warps``: per program;
    ``programs_per_sm``: the grid is ``SMs * programs_per_sm`` programs looping over the tiles,
    :data:`RESIDENT` as many as the SMs hold of the compiled kernel, or, with 0, one program per
    tile (for the backward this means one partial row per tile); ``stages``: the tile loop
    software-pipelined over that many stages (Triton's ``tl.range(num_stages=...)``), 0 a
    plain loop (also what Triton's interpreter runs)."""

    block_m: int
    num_warps: int
    programs_per_sm: int
    stages: int = 0


# Launch shapes measured on an H100 (benchmarks/norm_kernel.py, bf16, 2^25 elements per width;
# docs/performance.md, Decisions). Narrow rows: tiles of 4096 elements over 4 warps forward
# (LayerNorm 90-97% of a device copy at widths 64-256 against 82-94% at 2048), 1024 backward
# (74-86%, the fixed grid of 8 programs per SM). Wide rows: one row a tile, 16 values a thread
# forward (LayerNorm 1152: 82% against 64% at 8), 8 backward. Register counts are ptxas's for
# sm_90, bf16: a backward thread of 8 values per tensor takes 64 registers, of 16 about 100-128.
_TILE_ELEMENTS = {False: 4096, True: 1024}
_NARROW_WARPS = 4
_WIDE_VALUES_PER_THREAD = {False: 16, True: 8}
# backward: warps per SM of the fixed grid, so that every program is resident at once (at 64
# registers a thread, 32 warps fill the register file; a program waiting for a free slot would
# double the time of the tiles it was given)
_BACKWARD_WARPS_PER_SM = 32


# backward at narrow widths that are not powers of two (measured on an H200: benchmarks/norm_kernel.py,
# docs/performance.md, Decisions): tiles of 2048 elements over 4 warps, the loop pipelined over 3
# stages, the grid what the SMs hold of it (80-107 registers a thread: 4-6 programs an SM).
# LayerNorm backward at 96, 192 and 240 went from 67-74% to 77-84% of a copy; at powers of two
# (64, 128, 256) the plain loop was as fast or faster (RMSNorm 256: 85% against 79%). LayerNorm's
# unmodulated training forward the same way up to 208: 72-208 went from 68-85% to 71-90% of a copy;
# from 224 it lost 1-6 points, and so did the forward without statistics, RMSNorm's forward and
# the powers of two (norm_kernel_forward_training.csv, norm_kernel_forward_pipelined.csv)
_PIPELINED_TILE_ELEMENTS = 2048
_PIPELINED_STAGES = 3
_PIPELINED_MAX_COLS = 256
_PIPELINED_FORWARD_MAX_COLS = 208


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tile_shape(cols: int, rows: int, backward: bool = False) -> tuple[int, int]:
    """``(block_m, num_warps)`` of a plain (not pipelined) tile of ``rows`` rows of ``cols``
    values: the launch shape's tile, also that of the per-token backward (:mod:`cudnorm._token_ada`)."""
    block_n = _pow2(cols)
    if block_n >= WIDE_COLS:
        return 1, min(32, max(4, block_n // (32 * _WIDE_VALUES_PER_THREAD[backward])))
    return min(max(1, _TILE_ELEMENTS[backward] // block_n), _pow2(rows)), _NARROW_WARPS


def _config(cols: int, dtype: torch.dtype, rows: int, backward: bool = False,
            layer_norm_forward: bool = False) -> Config:
    """The launch shape for ``rows`` rows of ``cols`` values of ``dtype``, forward or backward;
    ``layer_norm_forward``: a training forward (statistics written) that is LayerNorm's,
    unmodulated (it pipelines where the backward does, up to width 208; without statistics the
    forward measured faster one tile a program).

    The constants above come from ``benchmarks/norm_kernel.py``, which times candidate shapes
    against this one per width."""
    block_n = _pow2(cols)
    widest = _PIPELINED_MAX_COLS if backward else _PIPELINED_FORWARD_MAX_COLS if layer_norm_forward else 0
    if cols != block_n and cols <= widest and dtype.itemsize == 2:
        return Config(min(_PIPELINED_TILE_ELEMENTS // block_n, _pow2(rows)), _NARROW_WARPS, RESIDENT,
                      _PIPELINED_STAGES)
    block_m, warps = tile_shape(cols, rows, backward)
    # forward: one tile per program, the usual Triton grid (no partials to keep few)
    programs_per_sm = max(1, _BACKWARD_WARPS_PER_SM // warps) if backward else 0
    return Config(block_m, warps, programs_per_sm)


@functools.cache
def _kernels():
    """``(forward, backward)`` jitted kernels, ``None`` without Triton: built on first use so
    that importing cudnorm never imports Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # row and tile counts are not specialised: their "% 16" or "== 1" variants change nothing.
    # The plain tile loops are while loops: Triton's interpreter (3.6, with NumPy 2) cannot take a
    # runtime bound in range(); the pipelined backward loop (tl.range) runs on a GPU only
    # MODULATED: weight and bias are rows of COLS values, W_STRIDE and B_STRIDE apart (the
    # scale and shift of an adaptive norm: per sample, or per token with seq 1, read in place
    # from a chunk of a Linear's output), row r of x taking row r // seq of them, the gain
    # 1 + scale where ONE_PLUS
    # one tile of the forward: writes its y (and statistics where STATS)
    @triton.jit
    def _forward_tile(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, w, b, tile, rows, eps, seq, local, offsets,
                      cols, in_row, COLS: tl.constexpr, BLOCK_M: tl.constexpr, RMS: tl.constexpr,
                      HAS_W: tl.constexpr, HAS_B: tl.constexpr, STATS: tl.constexpr, MODULATED: tl.constexpr,
                      ONE_PLUS: tl.constexpr, W_STRIDE: tl.constexpr, B_STRIDE: tl.constexpr):
        first = tile.to(tl.int64) * BLOCK_M
        live = local < rows - first
        mask = live[:, None] & in_row[None, :]
        x = tl.load(x_ptr + first * COLS + offsets, mask=mask, other=0.0).to(tl.float32)
        if RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / COLS
            xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / COLS + eps)
        y = xc * rstd[:, None]
        if MODULATED:  # a tile may hold rows of two samples: each row reads its own sample's
            source = ((first + local) // seq)[:, None]
            gain = tl.load(w_ptr + source * W_STRIDE + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if ONE_PLUS:
                gain = gain + 1.0
            y = y * gain
            if HAS_B:
                y = y + tl.load(b_ptr + source * B_STRIDE + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            if HAS_W:
                y = y * w[None, :]
            if HAS_B:
                y = y + b[None, :]
        tl.store(y_ptr + first * COLS + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
        if STATS:
            if not RMS:
                tl.store(mean_ptr + first + local, mean, mask=live)
            tl.store(rstd_ptr + first + local, rstd, mask=live)

    # Triton's interpreter runs a kernel's source again in its module's globals, closures lost:
    # the kernels find their helpers there
    globals()["_forward_tile"] = _forward_tile

    @triton.jit(do_not_specialize=["rows", "tiles", "seq"])
    def norm_forward(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, rows, tiles, eps, seq,
                     COLS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, RMS: tl.constexpr,
                     HAS_W: tl.constexpr, HAS_B: tl.constexpr, STATS: tl.constexpr,
                     MODULATED: tl.constexpr, ONE_PLUS: tl.constexpr, W_STRIDE: tl.constexpr,
                     B_STRIDE: tl.constexpr, STAGES: tl.constexpr):
        program = tl.program_id(0)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_N)
        in_row = cols < COLS
        w = tl.zeros((BLOCK_N,), dtype=tl.float32)  # unused where absent or modulated
        b = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if not MODULATED:
            if HAS_W:
                w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
            if HAS_B:
                b = tl.load(b_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        local = tl.arange(0, BLOCK_M)
        offsets = local[:, None] * COLS + cols[None, :]
        if STAGES > 0:  # the next tiles' loads in flight while this one computes
            for tile in tl.range(program, tiles, programs, num_stages=STAGES):
                _forward_tile(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, w, b, tile, rows, eps, seq, local, offsets,
                              cols, in_row, COLS, BLOCK_M, RMS, HAS_W, HAS_B, STATS, MODULATED, ONE_PLUS, W_STRIDE,
                              B_STRIDE)
        else:
            tile = program
            while tile < tiles:
                _forward_tile(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, w, b, tile, rows, eps, seq, local, offsets,
                              cols, in_row, COLS, BLOCK_M, RMS, HAS_W, HAS_B, STATS, MODULATED, ONE_PLUS, W_STRIDE,
                              B_STRIDE)
                tile += programs

    # one tile of the backward: writes its dx, returns the running column sums with its rows added
    @triton.jit
    def _backward_tile(x_ptr, dy_ptr, w, mean_ptr, rstd_ptr, dx_ptr, tile, rows, local, offsets, in_row,
                      sum_dy_xhat, sum_dy, COLS: tl.constexpr, BLOCK_M: tl.constexpr, RMS: tl.constexpr,
                      HAS_W: tl.constexpr, HAS_DB: tl.constexpr):
        first = tile.to(tl.int64) * BLOCK_M
        live = local < rows - first
        mask = live[:, None] & in_row[None, :]
        x = tl.load(x_ptr + first * COLS + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + first * COLS + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + first + local, mask=live, other=0.0)
        if RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + first + local, mask=live, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            g = dy * w[None, :]
        else:
            g = dy
        mean_g_xhat = tl.sum(g * xhat, axis=1) / COLS
        if RMS:
            dx = (g - xhat * mean_g_xhat[:, None]) * rstd[:, None]
        else:
            mean_g = tl.sum(g, axis=1) / COLS
            dx = (g - mean_g[:, None] - xhat * mean_g_xhat[:, None]) * rstd[:, None]
        tl.store(dx_ptr + first * COLS + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            sum_dy_xhat += dy * xhat
        if HAS_DB:
            sum_dy += dy
        return sum_dy_xhat, sum_dy

    globals()["_backward_tile"] = _backward_tile

    @triton.jit(do_not_specialize=["rows", "tiles"])
    def norm_backward(x_ptr, dy_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, db_partial_ptr,
                      rows, tiles,
                      COLS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, RMS: tl.constexpr,
                      HAS_W: tl.constexpr, HAS_DB: tl.constexpr, STAGES: tl.constexpr):
        program = tl.program_id(0)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_N)
        in_row = cols < COLS
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        else:
            w = tl.zeros((BLOCK_N,), dtype=tl.float32)  # unused
        local = tl.arange(0, BLOCK_M)
        offsets = local[:, None] * COLS + cols[None, :]
        # per-element running sums, reduced over the tile's rows once at the end (a reduction
        # across rows in every iteration would cost a trip through shared memory each time)
        sum_dy_xhat = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sum_dy = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if STAGES > 0:  # the next tiles' loads in flight while this one computes
            for tile in tl.range(program, tiles, programs, num_stages=STAGES):
                sum_dy_xhat, sum_dy = _backward_tile(x_ptr, dy_ptr, w, mean_ptr, rstd_ptr, dx_ptr, tile, rows, local,
                                                      offsets, in_row, sum_dy_xhat, sum_dy, COLS, BLOCK_M, RMS, HAS_W,
                                                     HAS_DB)
        else:
            tile = program
            while tile < tiles:
                sum_dy_xhat, sum_dy = _backward_tile(x_ptr, dy_ptr, w, mean_ptr, rstd_ptr, dx_ptr, tile, rows, local,
                                                      offsets, in_row, sum_dy_xhat, sum_dy, COLS, BLOCK_M, RMS, HAS_W,
                                                     HAS_DB)
                tile += programs
        out = cols.to(tl.int64) * programs + program  # column-major: [COLS, programs]
        if HAS_W:
            tl.store(dw_partial_ptr + out, tl.sum(sum_dy_xhat, axis=0), mask=in_row)
        if HAS_DB:
            tl.store(db_partial_ptr + out, tl.sum(sum_dy, axis=0), mask=in_row)

    # the parameter gradients' second stage: a program sums BLOCK_C columns of the backward's
    # [COLS, programs] partials over every program (a fixed order: deterministic) and writes
    # them in the parameters' dtypes, dweight and dbias in one launch
    @triton.jit(do_not_specialize=["programs"])
    def norm_backward_finish(dw_partial_ptr, db_partial_ptr, dw_ptr, db_ptr, programs,
                             COLS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
                             HAS_W: tl.constexpr, HAS_DB: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_cols = cols < COLS
        local = tl.arange(0, BLOCK_P)
        rows = cols.to(tl.int64)[:, None] * programs
        sum_w = tl.zeros((BLOCK_C, BLOCK_P), dtype=tl.float32)
        sum_b = tl.zeros((BLOCK_C, BLOCK_P), dtype=tl.float32)
        start = 0
        while start < programs:
            at = rows + (start + local)[None, :]
            mask = in_cols[:, None] & (start + local < programs)[None, :]
            if HAS_W:
                sum_w += tl.load(dw_partial_ptr + at, mask=mask, other=0.0)
            if HAS_DB:
                sum_b += tl.load(db_partial_ptr + at, mask=mask, other=0.0)
            start += BLOCK_P
        if HAS_W:
            tl.store(dw_ptr + cols, tl.sum(sum_w, axis=1).to(dw_ptr.dtype.element_ty), mask=in_cols)
        if HAS_DB:
            tl.store(db_ptr + cols, tl.sum(sum_b, axis=1).to(db_ptr.dtype.element_ty), mask=in_cols)

    return norm_forward, norm_backward, norm_backward_finish


@functools.cache
def available() -> bool:
    """Whether Triton imports (the kernels are compiled on first launch; no CUDA check here)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def supports(cols: int, dtype: torch.dtype, weight_dtype: torch.dtype | None,
             bias_dtype: torch.dtype | None) -> bool:
    """Whether the kernels compute rows of ``cols`` values of ``dtype`` (fp16, bf16 or fp32) with
    a weight and a bias each absent (``None``), of ``dtype``, or fp32. Says nothing about
    Triton being importable (:func:`available`) or the device."""
    return (0 < cols <= MAX_COLS and dtype in _DTYPES
            and all(d is None or d in (dtype, _F32) for d in (weight_dtype, bias_dtype)))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# what an SM holds where torch's device properties do not say (Hopper's figures)
_SM_REGISTERS, _SM_THREADS, _SM_SHARED_BYTES, _SM_BLOCKS = 65536, 2048, 233472, 32
_BLOCK_RESERVED_SHARED_BYTES = 1024  # the driver's own per block


@functools.cache
def _sm_limits(device_index: int) -> tuple[int, int, int]:
    """``(registers, threads, shared bytes)`` one SM of the device holds."""
    props = torch.cuda.get_device_properties(device_index)
    return (getattr(props, "regs_per_multiprocessor", _SM_REGISTERS),
            getattr(props, "max_threads_per_multi_processor", _SM_THREADS),
            getattr(props, "shared_memory_per_multiprocessor", _SM_SHARED_BYTES))


def _resident(compiled, device_index: int) -> int:
    """How many programs of ``compiled`` (a loaded Triton kernel) one SM runs at once: the least
    its registers (allocated per warp, 8 at a time), threads, shared memory and block slots allow."""
    registers, threads, shared = _sm_limits(device_index)
    warps = compiled.metadata.num_warps
    by_registers = registers // (32 * warps * -(-max(compiled.n_regs, 1) // 8) * 8)
    by_shared = shared // (compiled.metadata.shared + _BLOCK_RESERVED_SHARED_BYTES)
    return max(1, min(by_registers, threads // (32 * warps), by_shared, _SM_BLOCKS))


def _programs(device: torch.device, config: Config, tiles: int, compiled=None) -> int:
    """The grid of ``config`` over ``tiles`` tiles on ``device``; ``compiled``: the loaded
    kernel it launches, which sizes a :data:`RESIDENT` grid."""
    if config.programs_per_sm == 0:
        return tiles
    if device.type != "cuda":  # Triton's interpreter, on a CPU: one "SM"
        return min(tiles, 2 if config.programs_per_sm == RESIDENT else config.programs_per_sm)
    per_sm = _resident(compiled, device.index) if config.programs_per_sm == RESIDENT else config.programs_per_sm
    return min(tiles, _sm_count(device.index) * per_sm)




# the finishing sum's tile: up to this many partials of a column at once, BLOCK_C columns a program
# (a first choice, not timed against other shapes: the whole backward with it is what the narrow
# sweep measured, docs/performance.md)
_FINISH_TILE = 4096
_FINISH_MAX_PARTIALS = 1024


def _finish_shape(programs: int, cols: int) -> tuple[int, int, int]:
    """``(BLOCK_P, BLOCK_C, grid)`` of the finishing sum over ``programs`` partials of ``cols`` columns."""
    block_p = min(_FINISH_MAX_PARTIALS, _pow2(programs))
    block_c = min(_pow2(cols), max(1, _FINISH_TILE // block_p))
    return block_p, block_c, -(-cols // block_c)


def _row_stride(t: torch.Tensor | None, seq: int, cols: int) -> int:
    """A modulation's row stride (compiled in: a model has one or two), ``cols`` where unused."""
    return cols if t is None or seq == 0 or t.shape[0] == 1 else t.stride(0)


def forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, rms: bool,
            training: bool, *, config: Config | None = None, seq: int = 0, one_plus: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, stats)`` of LayerNorm (``rms=False``) or RMSNorm of ``x: [M, N]`` (contiguous rows).

    ``weight``/``bias``: ``[N]`` of x's dtype or fp32, or ``None``. ``y``: ``[M, N]`` in x's
    dtype. ``stats`` (only when ``training``, else ``None``): fp32, LayerNorm ``[2, M]`` (mean
    in row 0, rstd in row 1), RMSNorm ``[1, M]`` (rstd). ``config`` overrides :func:`_config`.

    ``seq > 0`` modulates (adaptive norms): ``weight`` (the scale, required) and ``bias`` (the
    shift, or ``None``) are ``[M // seq, N]`` with unit column stride and any row stride (per
    sample: ``seq`` rows of a sample; per token: ``seq = 1``), row ``r`` of x takes their row
    ``r // seq``, and the gain is ``1 + weight`` (summed in fp32) where ``one_plus``."""
    rows, cols = x.shape
    y = torch.empty_like(x)
    stats = torch.empty((1 if rms else 2, rows), dtype=_F32, device=x.device) if training else None
    if rows == 0:
        return y, stats
    config = config or _config(cols, x.dtype, rows, layer_norm_forward=not rms and seq == 0 and training)
    if not x.is_cuda:
        config = config._replace(stages=0)  # Triton's interpreter runs the plain loop only
    tiles = -(-rows // config.block_m)
    mean, rstd = (stats[0], stats[-1]) if training else (y, y)  # unused pointers when not training
    if seq > 0:  # modulation rows read in place: any row stride, unit column stride
        weight, bias = (None if t is None else t if t.stride(-1) == 1 else t.contiguous() for t in (weight, bias))
    else:
        weight, bias = (None if t is None else t.contiguous() for t in (weight, bias))
    args = (x, x if weight is None else weight, x if bias is None else bias, y, mean, rstd, rows, tiles, eps,
            max(seq, 1))
    meta = {"COLS": cols, "BLOCK_N": _pow2(cols), "BLOCK_M": config.block_m, "RMS": rms,
            "HAS_W": weight is not None, "HAS_B": bias is not None, "STATS": training,
            "MODULATED": seq > 0, "ONE_PLUS": one_plus, "num_warps": config.num_warps,
            "W_STRIDE": _row_stride(weight, seq, cols), "B_STRIDE": _row_stride(bias, seq, cols),
            "STAGES": config.stages}
    kernel = _kernels()[0]
    if config.programs_per_sm == RESIDENT and x.is_cuda:  # the grid sized by the compiled kernel
        found_by = _triton_launch.key(kernel, args, meta)
        programs = _programs(x.device, config, tiles, _triton_launch.loaded(kernel, args, meta, found_by))
    else:
        found_by, programs = None, _programs(x.device, config, tiles)
    _triton_launch.launch(kernel, programs, args, meta, found_by)
    return y, stats


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, stats: torch.Tensor, rms: bool,
             bias_dtype: torch.dtype | None, *, config: Config | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight, dbias)`` of the norm :func:`forward` computed, given ``dy: [M, N]``.

    ``x``: the forward's input (contiguous rows); ``weight``: its weight or ``None``;
    ``stats``: the forward's statistics (``[2, M]`` LayerNorm, ``[1, M]`` RMSNorm, fp32);
    ``bias_dtype``: the bias's dtype, ``None`` where the forward had no bias. ``dx``: x's
    dtype; ``dweight``: weight's dtype (``None`` without a weight); ``dbias``: ``bias_dtype``
    (``None`` without a bias). The parameter gradients are summed in fp32 and rounded once."""
    rows, cols = x.shape
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    has_w, has_db = weight is not None, bias_dtype is not None
    if rows == 0:
        zeros = functools.partial(torch.zeros, cols, device=x.device)
        return dx, zeros(dtype=weight.dtype) if has_w else None, zeros(dtype=bias_dtype) if has_db else None
    config = config or _config(cols, x.dtype, rows, backward=True)
    if not x.is_cuda:
        config = config._replace(stages=0)  # Triton's interpreter runs the plain loop only
    tiles = -(-rows // config.block_m)
    weight = x if weight is None else weight.contiguous()
    meta = {"COLS": cols, "BLOCK_N": _pow2(cols), "BLOCK_M": config.block_m, "RMS": rms,
            "HAS_W": has_w, "HAS_DB": has_db, "STAGES": config.stages, "num_warps": config.num_warps}
    compiled = None
    if config.programs_per_sm == RESIDENT and x.is_cuda:  # the partials' pointers: fresh allocations, aligned as any
        partial = torch.empty(4, dtype=_F32, device=x.device)
        compiled = _triton_launch.loaded(_kernels()[1], (x, dy, weight, stats[0], stats[-1], dx, partial, partial,
                                                         rows, tiles), meta)
    programs = _programs(x.device, config, tiles, compiled)
    partial = torch.empty((has_w + has_db, cols, programs), dtype=_F32, device=x.device)
    dw_partial, db_partial = (partial[0], partial[-1]) if has_w or has_db else (dx, dx)
    args = (x, dy, weight, stats[0], stats[-1], dx, dw_partial, db_partial, rows, tiles)
    _triton_launch.launch(_kernels()[1], programs, args, meta)
    if not (has_w or has_db):
        return dx, None, None
    dw = torch.empty(cols, dtype=weight.dtype, device=x.device) if has_w else None
    db = torch.empty(cols, dtype=bias_dtype, device=x.device) if has_db else None
    block_p, block_c, grid = _finish_shape(programs, cols)
    _triton_launch.launch(_kernels()[2], grid, (dw_partial, db_partial, dx if dw is None else dw, dx if db is None else db,
                                     programs),
            {"COLS": cols, "BLOCK_C": block_c, "BLOCK_P": block_p, "HAS_W": has_w, "HAS_DB": has_db, "num_warps": 4})
    return dx, dw, db


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        y, stats = forward(x, weight, bias, eps, rms, training=True)
        ctx.save_for_backward(x, weight, stats)
        ctx.rms = rms
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, stats = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx, dw, db = backward(dy, x, weight, stats, ctx.rms, ctx.bias_dtype if need_b else None)
        return dx if need_x else None, dw if need_w else None, db, None, None


def norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
         rms: bool) -> torch.Tensor:
    """LayerNorm (``rms=False``) or RMSNorm of ``x: [M, N]`` through these kernels, with
    autograd: ``y`` in x's dtype; gradients flow to whichever of ``x``, ``weight``, ``bias``
    require them (``weight``/``bias``: ``[N]``, x's dtype or fp32, or ``None``). Without
    gradients to compute no statistics are stored."""
    x = x.contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _NormFunction.apply(x, weight, bias, eps, rms)
    return forward(x, weight, bias, eps, rms, training=False)[0]


# -- the launch C++ makes (csrc/kernel.cpp) ------------------------------------------------------

# the compiled kernels' parameters C++ fills, in order: pointers, then 32-bit scalars
# forward: x, weight, bias, y, mean, rstd; rows, tiles, eps (fp32), seq
# backward: x, dy, weight, mean, rstd, dx, dweight partial, dbias partial; rows, tiles
# the backward's finishing sum: dweight partial, dbias partial, dweight, dbias; programs
_NATIVE_PARAMETERS = {False: 6 * ["*"] + ["i32", "i32", "fp32", "i32"], True: 8 * ["*"] + ["i32", "i32"]}
_NATIVE_FINISH_PARAMETERS = 4 * ["*"] + ["i32"]

def native_launch(x: torch.Tensor, rms: bool, training: bool, weight_dtype: torch.dtype | None,
                  bias_dtype: torch.dtype | None, backward: bool = False,
                  per_token: tuple[bool, int, int] | None = None
                  ) -> tuple[int, int, int, int, int, int, int] | None:
    """``(CUfunction, threads, shared bytes, 0, scratch parameters, programs, tiles)``: the
    compiled kernel serving ``x: [M, N]`` (a packed CUDA or meta tensor) forward (``training``:
    writing statistics) or ``backward`` (followed by the same seven of its finishing sum, grid
    in ``programs``, all zero without a weight or bias), for cudnorm's native path to launch through the CUDA
    driver (csrc/kernel.cpp) with the launch shape :func:`_config` gives; the 0 is the AdaLN
    kernel's per-sample chunk count, unused here. Compiled for 16-byte aligned pointers (C++
    checks each call) and the call's width, weight and bias dtypes. ``None`` where the compiled
    kernel is not the plain launch C++ makes (clusters, cooperative or PDL launches, scratch
    memory, another parameter list) or the row count needs 64-bit scalars: Python launches it then.
    ``per_token``: ``(one_plus, scale row stride, shift row stride)`` compiles the modulated
    forward: weight and bias are the scale and shift, one row per token (:mod:`cudnorm._token_ada`)
    or per sample (:mod:`cudnorm._ada_rms`), the rows a modulation row serves a runtime argument.

    A kernel launched from Python costs 0.3-0.5 ms more host time per training call than one
    launched from C++ (a lent H200, docs/performance.md), which decided narrow training calls
    against it wherever the step is host-bound."""
    rows, cols = x.shape
    config = _config(cols, x.dtype, rows, backward, layer_norm_forward=not rms and per_token is None and training)
    device = x.device if x.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    tiles = -(-rows // config.block_m)
    if rows >= 2**31 or tiles >= 2**31:
        return None
    wdtype = weight_dtype or x.dtype  # an absent parameter's pointer is x's, as the Python launch passes it
    meta = {"COLS": cols, "BLOCK_N": _pow2(cols), "BLOCK_M": config.block_m, "RMS": rms, "HAS_W": weight_dtype is not None,
            "num_warps": config.num_warps}
    # the first values of the scalars only choose their types (i32, fp32); none is specialised
    if backward:
        dtypes = (x.dtype, x.dtype, wdtype, _F32, _F32, x.dtype, _F32, _F32)
        meta.update(HAS_DB=bias_dtype is not None, STAGES=config.stages)
        scalars = (rows, tiles)
    else:
        stats = _F32 if training else x.dtype  # not training: y's pointer stands for the statistics
        dtypes = (x.dtype, wdtype, bias_dtype or x.dtype, x.dtype, stats, stats)
        one_plus, w_stride, b_stride = per_token or (False, cols, cols)
        meta.update(HAS_B=bias_dtype is not None, STATS=training, MODULATED=per_token is not None, ONE_PLUS=one_plus,
                    W_STRIDE=w_stride, B_STRIDE=b_stride, STAGES=config.stages)
        scalars = (rows, tiles, 1e-5, 1)
    with torch.cuda.device(device):
        compiled = _kernels()[backward].warmup(*dtypes, *scalars, grid=(1,), **meta)
        compiled.run  # noqa: B018 - loads the module: sets compiled.function
    launch = _triton_launch.handle(compiled, _NATIVE_PARAMETERS[backward])
    if launch is None:
        return None
    function, threads, shared, scratch = launch
    programs = _programs(device, config, tiles, compiled)
    main = (function, threads, shared, 0, scratch, programs, tiles)
    if not backward:
        return main
    if weight_dtype is None and bias_dtype is None:
        return main + 7 * (0,)
    block_p, block_c, grid = _finish_shape(programs, cols)
    with torch.cuda.device(device):
        compiled = _kernels()[2].warmup(_F32, _F32, weight_dtype or _F32, bias_dtype or _F32, programs, grid=(1,),
                                        COLS=cols, BLOCK_C=block_c, BLOCK_P=block_p, HAS_W=weight_dtype is not None,
                                        HAS_DB=bias_dtype is not None, num_warps=4)
        compiled.run  # noqa: B018 - loads the module: sets compiled.function
    finish = _triton_launch.handle(compiled, _NATIVE_FINISH_PARAMETERS)
    if finish is None:
        return None
    function, threads, shared, scratch = finish
    return main + (function, threads, shared, 0, scratch, grid, 0)
