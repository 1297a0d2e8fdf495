"""Adaptive LayerNorm and RMSNorm modulated per token: PyTorch's formula and cudnorm's Triton kernels.

FLUX.3's blocks and output norm and Helios' and Sana-Video's output norms modulate every
token by its own scale and shift (``[B, S, D]``, chunks of a per-token Linear's output), where
DiT-style models modulate a sample's tokens alike (``[B, D]``: :mod:`cudnorm.ada_layer_norm`).
Per token, PyTorch's formula ``norm(x) * (1 + scale) + shift`` runs four kernels forward (ten
passes over ``[B, S, D]``) and more backward; the kernels here read ``x``, ``scale`` and
``shift`` once and write ``y`` once. Math per row ``x`` of ``D`` elements, all in fp32, results
rounded once::

    LayerNorm  xhat = (x - mean) * rstd,   RMSNorm  xhat = x * rstd
    y = xhat * gain + shift,               gain = 1 + scale (one_plus_scale) or scale
    g = dy * gain;  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm: no mean(g))
    dscale = dy * xhat,  dshift = dy      (per element: nothing is summed over tokens)

The forward is :mod:`cudnorm._norm_kernel`'s modulated forward with one modulation row per row
of ``x`` (``seq = 1``), the backward :func:`_kernel` below: one launch each, ``dshift`` being
``dy`` itself. The formula is the CPU and traced path and the ``"torch"`` candidate of the
measuring dispatcher (ops ``"token_ada_layer_norm"``, ``"token_ada_rms_norm"``); the public
functions are :func:`cudnorm.ada_layer_norm` and :func:`cudnorm.ada_rms_norm`, which take a
per-token modulation.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import _entry, _norm_kernel, _triton_launch

_F32 = torch.float32


def formula(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, eps: float, rms: bool,
            one_plus_scale: bool) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift`` in PyTorch's ops, as diffusers' blocks write it: ``x``,
    ``scale``, ``shift``: ``[..., D]`` of one shape (``shift`` may be ``None``); the norm in x's
    dtype, the modulation in PyTorch's type promotion, the result rounded to x's dtype."""
    d = (x.shape[-1],)
    xhat = F.rms_norm(x, d, None, eps) if rms else F.layer_norm(x, d, None, None, eps)
    y = xhat * (1 + scale if one_plus_scale else scale)
    if shift is not None:
        y = y + shift
    return y if y.dtype is x.dtype else y.to(x.dtype)


def supports(cols: int, dtype: torch.dtype, scale_dtype: torch.dtype, shift_dtype: torch.dtype | None) -> bool:
    """Whether the kernels compute this call (Triton importable, the width and dtypes served)."""
    return _norm_kernel.available() and _norm_kernel.supports(cols, dtype, scale_dtype, shift_dtype)


@functools.cache
def _kernel():
    """The jitted backward (``None`` without Triton), built on first use."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # one program per tile of BLOCK_M rows (no running sums: every gradient is per row)
    @triton.jit(do_not_specialize=["rows"])
    def token_ada_norm_backward(x_ptr, dy_ptr, scale_ptr, mean_ptr, rstd_ptr, dx_ptr, dscale_ptr, rows,
                                COLS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                                RMS: tl.constexpr, ONE_PLUS: tl.constexpr, S_STRIDE: tl.constexpr):
        first = tl.program_id(0).to(tl.int64) * BLOCK_M
        local = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        live = local < rows - first
        mask = live[:, None] & (cols < COLS)[None, :]
        at = (first + local)[:, None] * COLS + cols[None, :]
        x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + at, mask=mask, other=0.0).to(tl.float32)
        gain = tl.load(scale_ptr + (first + local)[:, None] * S_STRIDE + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)
        if ONE_PLUS:
            gain = gain + 1.0
        rstd = tl.load(rstd_ptr + first + local, mask=live, other=0.0)
        if RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + first + local, mask=live, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * gain
        mean_g_xhat = tl.sum(g * xhat, axis=1) / COLS
        if RMS:
            dx = (g - xhat * mean_g_xhat[:, None]) * rstd[:, None]
        else:
            dx = (g - (tl.sum(g, axis=1) / COLS)[:, None] - xhat * mean_g_xhat[:, None]) * rstd[:, None]
        tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dscale_ptr + at, (dy * xhat).to(dscale_ptr.dtype.element_ty), mask=mask)

    return token_ada_norm_backward


def backward(dy2: torch.Tensor, x2: torch.Tensor, scale2: torch.Tensor, stats: torch.Tensor, rms: bool,
             one_plus_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dscale)``: ``[M, D]`` in x's and scale's dtypes, given ``dy2``/``x2`` packed
    ``[M, D]``, ``scale2`` ``[M, D]`` (unit column stride, any row stride) and the forward's fp32
    statistics (``[2, M]`` LayerNorm: mean, rstd; ``[1, M]`` RMSNorm: rstd)."""
    rows, cols = x2.shape
    dx = torch.empty_like(x2)
    dscale = torch.empty((rows, cols), dtype=scale2.dtype, device=x2.device)
    if rows == 0:
        return dx, dscale
    block_m, warps = _norm_kernel.tile_shape(cols, rows, backward=True)
    tiles = -(-rows // block_m)
    args = (x2, dy2, scale2, stats[0], stats[-1], dx, dscale, rows)
    meta = {"COLS": cols, "BLOCK_N": _norm_kernel._pow2(cols), "BLOCK_M": block_m, "RMS": rms,
            "ONE_PLUS": one_plus_scale, "S_STRIDE": scale2.stride(0) if rows > 1 else cols,
            "num_warps": warps}
    _triton_launch.launch(_kernel(), tiles, args, meta)
    return dx, dscale


def differentiable_backward(dy2: torch.Tensor, x2: torch.Tensor, scale2: torch.Tensor, eps: float, rms: bool,
                            one_plus_scale: bool, shift_dtype: torch.dtype | None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dx, dscale, dshift)`` of the per-token norm in PyTorch's ops (the math of the module
    docstring, in fp32 or wider), differentiable: the gradients ``create_graph=True`` asks for.
    ``dy2``, ``x2``, ``scale2``: ``[M, D]``; each gradient in its input's dtype, ``dshift``
    ``None`` without a shift."""
    wide = torch.promote_types(x2.dtype, torch.float32)
    x = x2.to(wide)
    if rms:
        rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
        xhat = x * rstd
    else:
        centred = x - x.mean(-1, keepdim=True)
        rstd = torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
        xhat = centred * rstd
    dy, scale = dy2.to(wide), scale2.to(wide)
    g = dy * (scale + 1 if one_plus_scale else scale)
    inner = g - xhat * (g * xhat).mean(-1, keepdim=True)
    dx = rstd * (inner if rms else inner - g.mean(-1, keepdim=True))
    dshift = None if shift_dtype is None else dy2.to(shift_dtype)
    return dx.to(x2.dtype), (dy * xhat).to(scale2.dtype), dshift


# the compiled backward's parameters C++ fills (csrc/kernel.cpp, token_backward): x, dy, scale,
# mean, rstd, dx, dscale; rows
_NATIVE_PARAMETERS = 7 * ["*"] + ["i32"]


def native_launch(x2: torch.Tensor, scale_dtype: torch.dtype, rms: bool, one_plus_scale: bool, scale_stride: int
                  ) -> tuple[int, int, int, int, int, int, int] | None:
    """``(CUfunction, threads, shared bytes, 0, scratch parameters, programs, tiles)`` of the
    backward serving ``x2: [M, D]`` (packed) with a scale of ``scale_dtype`` and row stride
    ``scale_stride`` (compiled in), for the native path to launch (csrc/kernel.cpp); ``None``
    where C++ cannot launch the compiled kernel plainly or the rows need 64-bit scalars."""
    rows, cols = x2.shape
    block_m, warps = _norm_kernel.tile_shape(cols, rows, backward=True)
    tiles = -(-rows // block_m)
    if rows >= 2**31:
        return None
    meta = {"COLS": cols, "BLOCK_N": _norm_kernel._pow2(cols), "BLOCK_M": block_m, "RMS": rms,
            "ONE_PLUS": one_plus_scale, "S_STRIDE": scale_stride,
            "num_warps": warps}
    f32 = torch.float32
    with torch.cuda.device(x2.device if x2.device.type == "cuda" else torch.cuda.current_device()):
        compiled = _kernel().warmup(x2.dtype, x2.dtype, scale_dtype, f32, f32, x2.dtype, scale_dtype, rows,
                                    grid=(1,), **meta)
        compiled.run  # noqa: B018 - loads the module: sets compiled.function
    launch = _triton_launch.handle(compiled, _NATIVE_PARAMETERS)
    return None if launch is None else (*launch[:3], 0, launch[3], tiles, tiles)


class _KernelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, scale2, shift2, eps, rms, one_plus_scale):
        y, stats = _norm_kernel.forward(x2, scale2, shift2, eps, rms, True, seq=1, one_plus=one_plus_scale)
        ctx.save_for_backward(x2, scale2, stats)
        ctx.rms, ctx.one_plus_scale = rms, one_plus_scale
        ctx.shift_dtype = None if shift2 is None else shift2.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, scale2, stats = ctx.saved_tensors
        dx, dscale = backward(dy.contiguous(), x2, scale2, stats, ctx.rms, ctx.one_plus_scale)
        dshift = None if ctx.shift_dtype is None else dy if dy.dtype is ctx.shift_dtype else dy.to(ctx.shift_dtype)
        return dx, dscale, dshift, None, None, None


def kernel(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, eps: float, rms: bool,
           one_plus_scale: bool) -> torch.Tensor:
    """The per-token adaptive norm of ``x: [..., D]`` through the kernels, with autograd:
    ``scale``/``shift`` of x's shape (``shift`` may be ``None``), each read in place where its
    rows are evenly spaced (a chunk of a Linear's output). ``y`` in x's dtype; without gradients
    to compute no statistics are stored. While the native path serves, C++ launches the kernels
    and holds the autograd node (csrc/kernel.cpp)."""
    if _entry.native and type(x) is torch.Tensor:
        y = _entry.token_ada_kernel(x, scale, shift, eps, one_plus_scale, rms)
        if y is not None:
            return y
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    scale2, shift2 = (None if t is None else _rows(t, d) for t in (scale, shift))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, scale, shift)):
        y = _KernelFunction.apply(x2, scale2, shift2, eps, rms, one_plus_scale)
    else:
        y = _norm_kernel.forward(x2, scale2, shift2, eps, rms, False, seq=1, one_plus=one_plus_scale)[0]
    return y.view(x.shape)


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t`` as ``[M, D]`` rows with unit column stride, a view where its rows are evenly spaced."""
    rows = t.reshape(-1, d)  # a view where the strides allow it, else a copy
    return rows if rows.stride(-1) == 1 else rows.contiguous()
