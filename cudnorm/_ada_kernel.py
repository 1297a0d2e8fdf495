"""AdaLN backward for any batch in a constant number of launches: one Triton kernel.

cuDNN 9.19 has no fast graph for it: its adalayernorm backward graph offers one generic
engine (3.5 ms at 32x256x1152, bf16), and running the plain LayerNorm backward graph once
per sample costs ``B`` launches, so a host-bound DiT step at batch 32 paid 32 launches per
norm (docs/performance.md, Decisions). This kernel reads ``x`` and ``dy`` once and writes
``dx`` once, for all samples in one launch:

    xhat = (x - mean) * rstd,   g = dy * gain[b]      (gain = 1 + scale, or scale)
    dx = rstd * (g - mean_D(g) - xhat * mean_D(g * xhat))
    dscale[b] = sum_S(dy * xhat),   dshift[b] = sum_S(dy)

Each program takes ``rows_per_program`` rows of one sample, keeps its running sums of
``dy * xhat`` and ``dy`` in fp32 registers, and writes them as one partial row; a sum over a
sample's partial rows (one reduction) finishes dscale/dshift, so results are deterministic
(no atomics). All arithmetic is fp32; dx is rounded once to x's dtype.

Triton ships with PyTorch's CUDA wheels on Linux; without it (or on a CPU) :func:`available`
is False and the strategies fall back to the per-sample LayerNorm backward graphs. On the
native path C++ launches the compiled kernel itself (:func:`native_launch`).
"""

from __future__ import annotations

import functools

import torch

from . import _triton_launch

_F32 = torch.float32
# The widest row one program holds in registers (fp32 vectors of this many elements); wider
# rows take the per-sample strategy.
MAX_COLS = 16384
# Programs per SM the grid aims at: enough rows in flight to hide memory latency, few enough
# that the partial sums (2 fp32 rows per program) stay a small share of the traffic.
PROGRAMS_PER_SM = 4
MIN_ROWS_PER_PROGRAM = 8
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _kernel():
    """The jitted kernel (``None`` without Triton): built on first use so that importing
    cudnorm never imports Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # counts that may be 1 are not specialised (a "== 1" variant would drop its parameter, and
    # C++ fills a fixed list: native_launch); widths and strides are, since their "% 16"
    # variants let loads vectorise (unspecialised, the kernel took 67 instead of 39-49 us at
    # 32 x 256 x 1152 on a lent H100)
    @triton.jit(do_not_specialize=["seq", "chunks", "batch"])
    def ada_layer_norm_backward(x_ptr, dy_ptr, scale_ptr, stats_ptr, dx_ptr, partial_ptr,
                                seq, cols, x_row_stride, scale_row_stride, stats_row_stride,
                                chunks, batch,
                                ONE_PLUS_SCALE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                                RMS: tl.constexpr):
        program = tl.program_id(0)
        sample = program // chunks
        chunk = program % chunks
        offsets = tl.arange(0, BLOCK)
        in_row = offsets < cols
        gain = tl.load(scale_ptr + sample.to(tl.int64) * scale_row_stride + offsets, mask=in_row,
                       other=0.0).to(tl.float32)
        if ONE_PLUS_SCALE:
            gain = gain + 1.0
        sum_dy_xhat = tl.zeros((BLOCK,), dtype=tl.float32)
        sum_dy = tl.zeros((BLOCK,), dtype=tl.float32)
        first = chunk * ROWS
        for i in range(0, ROWS):
            token = first + i
            live = token < seq
            row = sample.to(tl.int64) * seq + token
            mask = in_row & live
            x = tl.load(x_ptr + row * x_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * cols + offsets, mask=mask, other=0.0).to(tl.float32)
            g = dy * gain
            if RMS:  # adaptive RMSNorm: rstd alone, at stats_ptr + row
                rstd = tl.load(stats_ptr + row, mask=live, other=0.0)
                xhat = x * rstd
                dx = (g - xhat * (tl.sum(g * xhat, axis=0) / cols)) * rstd
            else:
                mean = tl.load(stats_ptr + row, mask=live, other=0.0)
                rstd = tl.load(stats_ptr + stats_row_stride + row, mask=live, other=0.0)
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
                mean_g = tl.sum(g, axis=0) / cols
                mean_g_xhat = tl.sum(g * xhat, axis=0) / cols
                dx = (g - mean_g - xhat * mean_g_xhat) * rstd
            tl.store(dx_ptr + row * cols + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            sum_dy_xhat += dy * xhat
            sum_dy += dy
        out = (sample.to(tl.int64) * chunks + chunk) * cols + offsets
        tl.store(partial_ptr + out, sum_dy_xhat, mask=in_row)
        tl.store(partial_ptr + batch * chunks * cols + out, sum_dy, mask=in_row)

    return ada_layer_norm_backward


@functools.cache
def _gated_kernel():
    """The jitted backward of the gated residual into an adaptive LayerNorm (:mod:`cudnorm._gated`),
    ``None`` without Triton. Per row of ``h = residual + gate * branch`` (packed rows) it computes
    the norm's dh as :func:`_kernel` does, adds ``dh`` (``HAS_DH``), and writes that sum as the
    residual's gradient and times the gate as the branch's; per sample it sums ``dy * xhat``,
    ``dy`` and ``branch * total`` into three partial rows (dscale, dshift, dgate)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["seq", "chunks", "batch"])
    def gated_ada_layer_norm_backward(h_ptr, dy_ptr, dh_ptr, branch_ptr, gate_ptr, scale_ptr, stats_ptr,
                                      dres_ptr, dbranch_ptr, partial_ptr,
                                      seq, cols, gate_row_stride, scale_row_stride, stats_row_stride, chunks, batch,
                                      ONE_PLUS_SCALE: tl.constexpr, HAS_DH: tl.constexpr, BLOCK: tl.constexpr,
                                      ROWS: tl.constexpr):
        sample, chunk = tl.program_id(0) // chunks, tl.program_id(0) % chunks
        offsets = tl.arange(0, BLOCK)
        in_row = offsets < cols
        first_row = sample.to(tl.int64) * seq + chunk * ROWS  # this program's rows: ROWS of one sample
        gate = tl.load(gate_ptr + sample.to(tl.int64) * gate_row_stride + offsets, mask=in_row,
                       other=0.0).to(tl.float32)
        gain = tl.load(scale_ptr + sample.to(tl.int64) * scale_row_stride + offsets, mask=in_row,
                       other=0.0).to(tl.float32)
        if ONE_PLUS_SCALE:
            gain += 1.0
        sum_branch_total = tl.zeros((BLOCK,), dtype=tl.float32)  # dgate
        sum_dy_xhat = tl.zeros((BLOCK,), dtype=tl.float32)  # dscale
        sum_dy = tl.zeros((BLOCK,), dtype=tl.float32)  # dshift
        for i in range(0, ROWS):
            live = chunk * ROWS + i < seq
            row = first_row + i
            mask = in_row & live
            at = row * cols + offsets
            h = tl.load(h_ptr + at, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + at, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(stats_ptr + row, mask=live, other=0.0)
            rstd = tl.load(stats_ptr + stats_row_stride + row, mask=live, other=0.0)
            xhat = tl.where(mask, (h - mean) * rstd, 0.0)
            g = dy * gain
            total = (g - tl.sum(g, axis=0) / cols - xhat * (tl.sum(g * xhat, axis=0) / cols)) * rstd
            if HAS_DH:
                total += tl.load(dh_ptr + at, mask=mask, other=0.0).to(tl.float32)
            branch = tl.load(branch_ptr + at, mask=mask, other=0.0).to(tl.float32)
            tl.store(dres_ptr + at, total.to(dres_ptr.dtype.element_ty), mask=mask)
            tl.store(dbranch_ptr + at, (total * gate).to(dbranch_ptr.dtype.element_ty), mask=mask)
            sum_dy_xhat += dy * xhat
            sum_dy += dy
            sum_branch_total += tl.where(mask, branch * total, 0.0)
        out = (sample.to(tl.int64) * chunks + chunk) * cols + offsets
        plane = batch * chunks * cols
        tl.store(partial_ptr + out, sum_dy_xhat, mask=in_row)
        tl.store(partial_ptr + plane + out, sum_dy, mask=in_row)
        tl.store(partial_ptr + 2 * plane + out, sum_branch_total, mask=in_row)

    return gated_ada_layer_norm_backward


def available(x2: torch.Tensor, scale_dtype: torch.dtype) -> bool:
    """Whether the kernel serves ``x2: [B*S, D]`` (unit column stride) with a ``[B, D]`` scale
    of ``scale_dtype``: CUDA tensors of fp16/bf16/fp32, ``D <= MAX_COLS``, Triton importable.
    A meta ``x2`` stands for a CUDA one (warmup and the native path's recipes ask with those)."""
    return (x2.device.type in ("cuda", "meta") and x2.dtype in _DTYPES and scale_dtype in _DTYPES
            and x2.shape[1] <= MAX_COLS and x2.stride(1) == 1 and _kernel() is not None)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_shape(batch: int, seq: int, cols: int, sm_count: int) -> tuple[int, int, int, int]:
    """``(rows_per_program, chunks per sample, BLOCK, num_warps)`` for ``[batch, seq, cols]``
    on a GPU of ``sm_count`` SMs."""
    target = max(1, sm_count * PROGRAMS_PER_SM)
    # a power of two: the row loop is unrolled per value, so few compiled variants exist
    wanted = max(MIN_ROWS_PER_PROGRAM, -(-batch * seq // target))
    rows_per_program = min(1 << (wanted - 1).bit_length(), 1 << (seq - 1).bit_length())
    block = 1 << max(cols - 1, 1).bit_length()
    # a warp per 256 elements keeps each thread's share of a row at 8 values
    warps = min(16, max(1, block // 256))
    return rows_per_program, -(-seq // rows_per_program), block, warps


def _launch_of(x2: torch.Tensor, batch: int) -> tuple[int, int, int, int, int]:
    """``(seq, rows_per_program, chunks, BLOCK, num_warps)`` of a launch over ``x2: [B*S, D]``."""
    rows, cols = x2.shape
    sm_count = _sm_count(x2.device.index) if x2.is_cuda else 1  # 1: Triton's interpreter, on a CPU
    return (rows // batch, *launch_shape(batch, rows // batch, cols, sm_count))


def backward(dy2: torch.Tensor, x2: torch.Tensor, batch: int, scale: torch.Tensor, stats: torch.Tensor,
             one_plus_scale: bool, rms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [B*S, D] x's dtype, sums [2, B, D] fp32)``: ``sums[0]`` is dscale, ``sums[1]`` dshift.

    ``dy2``: packed ``[B*S, D]``; ``x2``: ``[B*S, D]`` with unit column stride; ``scale``:
    ``[B, D]`` (any row stride, unit column stride, fp32 or x's dtype: a chunk of a Linear
    output reads in place); ``stats``: fp32 ``[2, >= B*S]``, mean in row 0, rstd in row 1;
    with ``rms`` (adaptive RMSNorm: ``xhat = x * rstd``, no mean) the contiguous rstd ``[B*S]``.
    """
    rows, cols = x2.shape
    device = x2.device
    seq, rows_per_program, chunks, block, warps = _launch_of(x2, batch)
    dx = torch.empty((rows, cols), dtype=x2.dtype, device=device)
    partial = torch.empty((2, batch, chunks, cols), dtype=_F32, device=device)
    args = (x2, dy2, scale, stats, dx, partial, seq, cols, x2.stride(0), scale.stride(0),
            0 if rms else stats.stride(0), chunks, batch)
    meta = {"ONE_PLUS_SCALE": one_plus_scale, "BLOCK": block, "ROWS": rows_per_program, "RMS": rms,
            "num_warps": warps}
    _triton_launch.launch(_kernel(), batch * chunks, args, meta)
    return dx, partial[:, :, 0] if chunks == 1 else partial.sum(2)


def gated_backward(dy2: torch.Tensor, h2: torch.Tensor, batch: int, scale: torch.Tensor, stats: torch.Tensor,
                   one_plus_scale: bool, dh2: torch.Tensor | None, branch2: torch.Tensor, gate: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated residual's backward (:func:`_gated_kernel`): ``(dresidual, dbranch)``, ``[B*S, D]``
    in h's dtype, and ``sums [3, B, D]`` fp32 (dscale, dshift, dgate).

    ``dy2``, ``h2``, ``dh2`` (or None: no gradient reached ``h``) and ``branch2``: packed
    ``[B*S, D]``; ``scale``/``gate``: ``[B, D]`` with unit column stride; ``stats``: the adaptive
    LayerNorm forward's fp32 ``[2, >= B*S]`` (mean, rstd)."""
    rows, cols = h2.shape
    device = h2.device
    seq, rows_per_program, chunks, block, warps = _launch_of(h2, batch)
    dres = torch.empty((rows, cols), dtype=h2.dtype, device=device)
    dbranch = torch.empty_like(dres)
    partial = torch.empty((3, batch, chunks, cols), dtype=_F32, device=device)
    args = (h2, dy2, h2 if dh2 is None else dh2, branch2, gate, scale, stats, dres, dbranch, partial,
            seq, cols, gate.stride(0), scale.stride(0), stats.stride(0), chunks, batch)
    meta = {"ONE_PLUS_SCALE": one_plus_scale, "HAS_DH": dh2 is not None, "BLOCK": block, "ROWS": rows_per_program,
            "num_warps": warps}
    _triton_launch.launch(_gated_kernel(), batch * chunks, args, meta)
    return dres, dbranch, partial[:, :, 0] if chunks == 1 else partial.sum(2)


# the compiled kernel's parameters C++ fills (csrc/ada.cpp, fused_backward): six pointers
# (x, dy, scale, stats, dx, partial), then seven int32 (seq, cols, the three row strides,
# chunks, batch)
_NATIVE_PARAMETERS = 6 * ["*"] + 7 * ["i32"]
# the scale row stride the natively launched kernel is compiled for: any multiple of this
SCALE_STRIDE_ALIGN = 16


def native_launch(x2: torch.Tensor, batch: int, scale_dtype: torch.dtype, one_plus_scale: bool, rms: bool = False
                  ) -> tuple[int, int, int, int, int] | None:
    """``(CUfunction, threads, shared bytes, chunks, scratch parameters)`` of the kernel that
    serves ``x2: [B*S, D]`` with a ``[B, D]`` scale of ``scale_dtype``, compiled for 16-byte
    aligned pointers, a scale row stride divisible by 16 and statistics rows ``ceil4(B*S)``
    apart (csrc/ada.cpp checks each call against these), for cudnorm's native path to launch
    through the CUDA driver without coming back to Python (a Python launch from the autograd
    thread cost about 200 us of host time more than a C++ one on a lent H100). ``None`` where
    the compiled kernel is not the plain launch C++ makes (clusters, cooperative or PDL
    launches, scratch memory, another parameter list): Python launches it then. ``rms``: the
    adaptive RMSNorm's (no mean; its rstd ``[B*S]`` read with a statistics stride of 0,
    csrc/kernel.cpp)."""
    rows, cols = x2.shape
    seq = rows // batch
    device = x2.device if x2.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        rows_per_program, chunks, block, warps = launch_shape(batch, seq, cols, _sm_count(device.index))
        dtypes = (x2.dtype, x2.dtype, scale_dtype, _F32, x2.dtype, _F32)  # x, dy, scale, stats, dx, partial
        # the call's own width, x row stride and statistics stride (the recipe is per x layout),
        # a scale row stride divisible by 16 (C++ launches it only for such a scale)
        stats_stride = 0 if rms else -(-rows // 4) * 4
        compiled = _kernel().warmup(*dtypes, seq, cols, x2.stride(0), SCALE_STRIDE_ALIGN, stats_stride, chunks, batch,
                                    grid=(1,),
                                    ONE_PLUS_SCALE=one_plus_scale, BLOCK=block, ROWS=rows_per_program, RMS=rms,
                                    num_warps=warps)
        return _per_sample_launch(compiled, _NATIVE_PARAMETERS, chunks)  # loaded on the call's device


def _per_sample_launch(compiled, parameters: list[str], chunks: int) -> tuple[int, int, int, int, int] | None:
    """``(CUfunction, threads, shared bytes, chunks, scratch parameters)`` of a per-sample kernel
    ``compiled`` (its module loaded here), or ``None`` where C++ cannot launch it plainly."""
    compiled.run  # noqa: B018 - loads the module: sets compiled.function
    launch = _triton_launch.handle(compiled, parameters)
    if launch is None:
        return None
    function, threads, shared, scratch = launch
    return function, threads, shared, chunks, scratch


# the gated residual's compiled backward as C++ launches it (csrc/gated.cpp): ten pointers (h,
# dy, dh, branch, gate, scale, stats, dres, dbranch, partial), then seven int32 (seq, cols, the
# gate's, the scale's and the statistics' row strides, chunks, batch)
_GATED_NATIVE_PARAMETERS = 10 * ["*"] + 7 * ["i32"]


def gated_native_launch(h2: torch.Tensor, batch: int, dtype: torch.dtype, one_plus_scale: bool, has_dh: bool
                        ) -> tuple[int, int, int, int, int] | None:
    """``(CUfunction, threads, shared bytes, chunks, scratch parameters)`` of the gated residual's
    backward serving ``h2: [B*S, D]`` (packed) with gate and scale ``[B, D]`` of ``dtype``,
    compiled for 16-byte aligned pointers, gate and scale row strides divisible by 16 and
    statistics rows ``ceil4(B*S)`` apart (csrc/gated.cpp checks each call against these);
    ``None`` where the compiled kernel is not the plain launch C++ makes."""
    rows, cols = h2.shape
    seq = rows // batch
    device = h2.device if h2.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        rows_per_program, chunks, block, warps = launch_shape(batch, seq, cols, _sm_count(device.index))
        x = h2.dtype
        dtypes = (x, x, x, x, dtype, dtype, _F32, x, x, _F32)
        compiled = _gated_kernel().warmup(*dtypes, seq, cols, SCALE_STRIDE_ALIGN, SCALE_STRIDE_ALIGN,
                                          -(-rows // 4) * 4, chunks, batch, grid=(1,),
                                          ONE_PLUS_SCALE=one_plus_scale, HAS_DH=has_dh, BLOCK=block,
                                          ROWS=rows_per_program, num_warps=warps)
        return _per_sample_launch(compiled, _GATED_NATIVE_PARAMETERS, chunks)  # loaded on the call's device
