"""A gated residual into an adaptive LayerNorm: its formula in PyTorch's ops and cudnorm's fused op.

DiT-style blocks add a sublayer's output to the residual stream through a per-sample gate and
normalise the sum with the next modulation (Flux's, SD3's, HunyuanVideo's and CogView4's blocks)::

    h = residual + gate[b] * branch
    y = LayerNorm(h) * (1 + scale[b]) + shift[b]        (or * scale[b] + shift[b])

Both ``h`` (the stream, read by the next residual add) and ``y`` are outputs. As separate ops
the backward reads and writes the stream's gradient in four kernels: the norm's dx, autograd's
sum of it with ``dh`` (the gradient the stream brings from later blocks), the branch's gradient
and the gate's sum. The fused op's backward does all of it in one pass
(:func:`cudnorm._ada_kernel.gated_backward`); its forward is one multiply-add for ``h`` and the
adaptive LayerNorm op. Which of the two serves a call is measured (op ``"gated_ada_layer_norm"``,
:mod:`cudnorm._candidates`).
"""

from __future__ import annotations

import torch

from . import _ada_kernel, _entry

_F32 = torch.float32


def formula(residual: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor,
            shift: torch.Tensor, eps: float, one_plus_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)`` in PyTorch's ops as the blocks write them: ``residual``/``branch`` ``[B, S, D]``,
    ``gate``/``scale``/``shift`` ``[B, D]`` or ``[B, 1, D]``; autograd by PyTorch."""
    b, d = residual.shape[0], residual.shape[-1]
    gate, scale, shift = (t.reshape(b, 1, d) for t in (gate, scale, shift))
    h = residual + gate * branch
    xhat = torch.nn.functional.layer_norm(h, (d,), None, None, eps)
    return xhat * (1 + scale if one_plus_scale else scale) + shift, h


def supports(residual: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> bool:
    """Whether the fused op computes this call: CUDA tensors ``[B, S, D]`` of one dtype of the
    kernel's, the modulation of that dtype, Triton importable (:func:`cudnorm._ada_kernel.available`)."""
    rows = residual.reshape(-1, residual.shape[-1])
    return (residual.dim() == 3 and all(t.dtype is residual.dtype for t in (gate, scale, shift))
            and _ada_kernel.available(rows, scale.dtype))


class _FusedGated(torch.autograd.Function):
    """The fused op: ``h`` by one multiply-add, ``y`` by cudnorm's adaptive LayerNorm op (the
    statistics kept), the backward in one kernel."""

    @staticmethod
    def forward(ctx, residual, branch, gate, scale, shift, eps, one_plus_scale):
        b, s, d = residual.shape
        gate2, scale2, shift2 = (t.reshape(b, d) for t in (gate, scale, shift))
        h = torch.addcmul(residual, gate2[:, None], branch)
        y, stats = torch.ops.cudnorm.ada_layer_norm_fwd(h, scale2, shift2, eps, one_plus_scale, True)
        ctx.save_for_backward(h, branch, gate2, scale2, stats)
        ctx.one_plus_scale = one_plus_scale
        ctx.shapes = (gate.shape, scale.shape, shift.shape)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, branch, gate, scale, stats = ctx.saved_tensors
        b, s, d = h.shape
        dy = torch.zeros_like(h) if dy is None else dy
        dres, dbranch, sums = _ada_kernel.gated_backward(
            dy.reshape(b * s, d).contiguous(), h.reshape(b * s, d), b, scale, stats, ctx.one_plus_scale,
            None if dh is None else dh.reshape(b * s, d).contiguous(), branch.reshape(b * s, d).contiguous(), gate)
        gate_shape, scale_shape, shift_shape = ctx.shapes
        return (dres.view(b, s, d), dbranch.view(b, s, d), sums[2].to(gate.dtype).view(gate_shape),
                sums[0].to(scale.dtype).view(scale_shape), sums[1].to(scale.dtype).view(shift_shape), None, None)


def fused(residual: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
          eps: float, one_plus_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)`` by the fused op (a call :func:`supports`); gradients to all five tensors. While
    the native path serves, C++ runs it with its autograd node and launches the backward kernel
    (csrc/gated.cpp)."""
    if _entry.native and type(residual) is torch.Tensor:
        out = _entry.gated_kernel(residual, branch, gate, scale, shift, eps, one_plus_scale)
        if out is not None:
            return out
    return _FusedGated.apply(residual, branch, gate, scale, shift, eps, one_plus_scale)


def differentiable_backward(dy: torch.Tensor | None, dh: torch.Tensor | None, h: torch.Tensor, branch: torch.Tensor,
                            gate: torch.Tensor, scale: torch.Tensor, eps: float, one_plus_scale: bool
                            ) -> tuple[torch.Tensor, ...]:
    """``(dresidual, dbranch, dgate, dscale, dshift)`` of the fused op in PyTorch's ops (in fp32 or
    wider), differentiable: the gradients ``create_graph=True`` asks for. ``h``, ``branch``, ``dy``
    and ``dh`` (either may be ``None``): ``[B, S, D]``; ``gate``, ``scale``: ``[B, D]``."""
    wide = torch.promote_types(h.dtype, _F32)
    centred = h.to(wide) - h.to(wide).mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
    xhat = centred * rstd
    grad_y = torch.zeros_like(xhat) if dy is None else dy.to(wide)
    gain = scale.to(wide)[:, None]
    g = grad_y * (gain + 1 if one_plus_scale else gain)
    total = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if dh is not None:
        total = total + dh.to(wide)
    return (total.to(h.dtype), (total * gate.to(wide)[:, None]).to(h.dtype),
            (branch.to(wide) * total).sum(1).to(gate.dtype), (grad_y * xhat).sum(1).to(scale.dtype),
            grad_y.sum(1).to(scale.dtype))
