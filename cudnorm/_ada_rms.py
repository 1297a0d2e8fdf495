"""Adaptive RMSNorm's two implementations: PyTorch's formula and cudnorm's Triton kernels.

Math, per sample ``b`` and token row ``x`` of ``D`` elements, all in fp32, ``y`` rounded once::

    rstd = 1 / sqrt(mean(x^2) + eps),   xhat = x * rstd
    y = xhat * gain[b] + shift[b],      gain = 1 + scale (one_plus_scale) or scale
    g = dy * gain[b];  dx = rstd * (g - xhat * mean_D(g * xhat))
    dscale[b] = sum_S(dy * xhat),  dshift[b] = sum_S(dy)

The formula is the CPU and traced path, and the ``"torch"`` candidate of the measuring
dispatcher (:mod:`cudnorm._candidates`); the kernels are its ``"kernel"`` candidate: the
forward is :mod:`cudnorm._norm_kernel`'s with per-sample modulation (one launch, ``y`` and the
fp32 rstd), the backward :mod:`cudnorm._ada_kernel`'s per-sample partial sums (one launch and
one fixed-order sum: deterministic, no atomics). Both launch a constant number of kernels for
any batch. Neither is imported here: the public function is :mod:`cudnorm.ada_rms_norm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _ada_kernel, _entry, _norm_kernel

_F32 = torch.float32


def formula(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, eps: float,
            one_plus_scale: bool) -> torch.Tensor:
    """``x: [B, *, D]``; ``scale``/``shift``: ``[B, D]`` (or any shape of ``B*D`` elements, or
    ``shift=None``). In fp32, rounded once to x's dtype; autograd by PyTorch (a float64 ``x``
    computes in float64)."""
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    compute = torch.promote_types(x.dtype, _F32)
    gain = scale.reshape(view).to(compute)
    y = F.rms_norm(x.to(compute), (x.shape[-1],), None, eps) * (gain + 1 if one_plus_scale else gain)
    if shift is not None:
        y = y + shift.reshape(view).to(compute)
    return y.to(x.dtype)


def supports(cols: int, dtype: torch.dtype, scale_dtype: torch.dtype, shift_dtype: torch.dtype | None) -> bool:
    """Whether the kernels compute this call (Triton importable, the width and dtypes served)."""
    return _norm_kernel.available() and _norm_kernel.supports(cols, dtype, scale_dtype, shift_dtype)


def forward(x2: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, eps: float, one_plus_scale: bool,
            training: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y [B*S, D], rstd [B*S] fp32 or None)`` of ``x2: [B*S, D]`` (contiguous) with
    ``scale``/``shift`` ``[B, D]`` (contiguous; ``shift`` may be ``None``)."""
    y, stats = _norm_kernel.forward(x2, scale, shift, eps, True, training, seq=x2.shape[0] // scale.shape[0],
                                    one_plus=one_plus_scale)
    return y, None if stats is None else stats[0]


def backward(dy2: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, rstd: torch.Tensor, one_plus_scale: bool,
             shift_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dx [B*S, D] x's dtype, dscale [B, D] scale's dtype, dshift [B, D] shift_dtype or None)``,
    the sums in fp32, rounded once."""
    dx, sums = _ada_kernel.backward(dy2.contiguous(), x2, scale.shape[0], scale, rstd, one_plus_scale, rms=True)
    return dx, sums[0].to(scale.dtype), None if shift_dtype is None else sums[1].to(shift_dtype)


def differentiable_backward(dy2: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, eps: float,
                            one_plus_scale: bool, shift_dtype: torch.dtype | None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dx, dscale, dshift)`` in PyTorch's ops (the module docstring's math, in fp32 or wider),
    differentiable: the gradients ``create_graph=True`` asks for. ``dy2``/``x2``: ``[B*S, D]``,
    ``scale``: ``[B, D]``; each gradient in its input's dtype, ``dshift`` ``None`` without a shift."""
    b, d = scale.shape
    wide = torch.promote_types(x2.dtype, _F32)
    x, dy = x2.to(wide).view(b, -1, d), dy2.to(wide).view(b, -1, d)
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    xhat = x * rstd
    gain = scale.to(wide)[:, None]
    g = dy * (gain + 1 if one_plus_scale else gain)
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dshift = None if shift_dtype is None else dy.sum(1).to(shift_dtype)
    return dx.view_as(x2).to(x2.dtype), (dy * xhat).sum(1).to(scale.dtype), dshift


class _KernelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, scale, shift, eps, one_plus_scale):
        y, rstd = forward(x2, scale, shift, eps, one_plus_scale, True)
        ctx.save_for_backward(x2, scale, rstd)
        ctx.one_plus_scale = one_plus_scale
        ctx.shift_dtype = None if shift is None else shift.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, scale, rstd = ctx.saved_tensors
        dx, dscale, dshift = backward(dy, x2, scale, rstd, ctx.one_plus_scale, ctx.shift_dtype)
        return dx, dscale, dshift, None, None


def kernel(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, eps: float,
           one_plus_scale: bool) -> torch.Tensor:
    """Adaptive RMSNorm of ``x: [B, *, D]`` through the kernels, with autograd; ``scale``/``shift``
    ``[B, D]`` (``shift`` may be ``None``). Without gradients to compute no rstd is stored.
    While the native path serves, C++ launches the kernels and holds the autograd node
    (csrc/kernel.cpp)."""
    if _entry.native and type(x) is torch.Tensor:
        y = _entry.ada_rms_kernel(x, scale, shift, eps, one_plus_scale)
        if y is not None:
            return y
    b, d = x.shape[0], x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    sc = scale.reshape(b, d).contiguous()
    sh = None if shift is None else shift.reshape(b, d).contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, scale, shift)):
        y = _KernelFunction.apply(x2, sc, sh, eps, one_plus_scale)
    else:
        y = forward(x2, sc, sh, eps, one_plus_scale, False)[0]
    return y.view(x.shape)
