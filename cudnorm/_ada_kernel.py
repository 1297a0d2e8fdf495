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


def backward(dy2: torch.Tensor, x2: torch.Tensor, batch: int, scale: torch.Tensor, stats: torch.Tensor,
             one_plus_scale: bool, rms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [B*S, D] x's dtype, sums [2, B, D] fp32)``: ``sums[0]`` is dscale, ``sums[1]`` dshift.

    ``dy2``: packed ``[B*S, D]``; ``x2``: ``[B*S, D]`` with unit column stride; ``scale``:
    ``[B, D]`` (any row stride, unit column stride, fp32 or x's dtype: a chunk of a Linear
    output reads in place); ``stats``: fp32 ``[2, >= B*S]``, mean in row 0, rstd in row 1;
    with ``rms`` (adaptive RMSNorm: ``xhat = x * rstd``, no mean) the contiguous rstd ``[B*S]``.
    """
    rows, cols = x2.shape
    seq = rows // batch
    device = x2.device
    sm_count = _sm_count(device.index) if x2.is_cuda else 1  # 1: Triton's interpreter, on a CPU
    rows_per_program, chunks, block, warps = launch_shape(batch, seq, cols, sm_count)
    dx = torch.empty((rows, cols), dtype=x2.dtype, device=device)
    partial = torch.empty((2, batch, chunks, cols), dtype=_F32, device=device)
    args = (x2, dy2, scale, stats, dx, partial, seq, cols, x2.stride(0), scale.stride(0),
            0 if rms else stats.stride(0), chunks, batch)
    grid = (batch * chunks,)
    meta = {"ONE_PLUS_SCALE": one_plus_scale, "BLOCK": block, "ROWS": rows_per_program, "RMS": rms,
            "num_warps": warps}
    if x2.is_cuda and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):  # Triton launches on the current device's stream
            _kernel()[grid](*args, **meta)
    else:
        _kernel()[grid](*args, **meta)
    return dx, partial[:, :, 0] if chunks == 1 else partial.sum(2)


# the compiled kernel's parameters C++ fills (csrc/ada.cpp, fused_backward): six pointers
# (x, dy, scale, stats, dx, partial), then seven int32 (seq, cols, the three row strides,
# chunks, batch)
_NATIVE_PARAMETERS = 6 * ["*"] + 7 * ["i32"]
# the scale row stride the natively launched kernel is compiled for: any multiple of this
SCALE_STRIDE_ALIGN = 16


def native_launch(x2: torch.Tensor, batch: int, scale_dtype: torch.dtype, one_plus_scale: bool
                  ) -> tuple[int, int, int, int, int] | None:
    """``(CUfunction, threads, shared bytes, chunks, scratch parameters)`` of the kernel that
    serves ``x2: [B*S, D]`` with a ``[B, D]`` scale of ``scale_dtype``, compiled for 16-byte
    aligned pointers, a scale row stride divisible by 16 and statistics rows ``ceil4(B*S)``
    apart (csrc/ada.cpp checks each call against these), for cudnorm's native path to launch
    through the CUDA driver without coming back to Python (a Python launch from the autograd
    thread cost about 200 us of host time more than a C++ one on a lent H100). ``None`` where
    the compiled kernel is not the plain launch C++ makes (clusters, cooperative or PDL
    launches, scratch memory, another parameter list): Python launches it then."""
    rows, cols = x2.shape
    seq = rows // batch
    device = x2.device if x2.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        rows_per_program, chunks, block, warps = launch_shape(batch, seq, cols, _sm_count(device.index))
        dtypes = (x2.dtype, x2.dtype, scale_dtype, _F32, x2.dtype, _F32)  # x, dy, scale, stats, dx, partial
        # the call's own width, x row stride and statistics stride (the recipe is per x layout),
        # a scale row stride divisible by 16 (C++ launches it only for such a scale)
        stats_stride = -(-rows // 4) * 4
        compiled = _kernel().warmup(*dtypes, seq, cols, x2.stride(0), SCALE_STRIDE_ALIGN, stats_stride, chunks, batch,
                                    grid=(1,),
                                    ONE_PLUS_SCALE=one_plus_scale, BLOCK=block, ROWS=rows_per_program, RMS=False,
                                    num_warps=warps)
        compiled.run  # noqa: B018 - loads the module: sets compiled.function
    launch = _triton_launch.handle(compiled, _NATIVE_PARAMETERS)
    if launch is None:
        return None
    function, threads, shared, scratch = launch
    return function, threads, shared, chunks, scratch
