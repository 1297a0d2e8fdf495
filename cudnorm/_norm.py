"""One implementation of LayerNorm and RMSNorm, specialised by a description of the op (:class:`NormOp`).

Both norms run the same path on ``[rows, N]`` views: cuDNN's graph, PyTorch's fused kernel
where that was measured faster or no graph serves, and a PyTorch fallback computing in fp32
on any device; then the backward, the fake implementations for tracing and the autograd glue.
What tells the two apart fits in a :class:`NormOp`: whether the norm is centred (a mean and
a bias), its fp32 math, PyTorch's fused kernel and the weight offsets cuDNN takes.
:func:`implement` binds a description into closures once, at import, so a call never asks
which norm it is; :func:`define_ops` registers the custom ops. :mod:`cudnorm.layer_norm` and
:mod:`cudnorm.rms_norm` hold the public functions; :mod:`cudnorm._fused_add` shares the math.

The implementation's arguments are ``(x, weight, bias, eps, training, offset)``: ``x`` ``[M, N]``
fp16/bf16/fp32; ``weight``/``bias`` ``[N]`` fp32 or x's dtype, or None (RMSNorm has no bias);
the scale is ``weight + offset`` (RMSNorm only; Gemma's norms use 1). Statistics are fp32 in
each op's layout: LayerNorm's ``[2, ceil4(M)]`` (mean in row 0, rstd in row 1, first ``M``
columns: one allocation whose rows start 16-byte aligned, as cuDNN requires), RMSNorm's rstd
``[M]``; an inference forward returns them empty (``[2, 0]``, ``[0]``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _call_plans, _dispatch, _ops, _runtime
from ._graphs import Plan, eps_scalar

_F32 = torch.float32


# -- the math of each norm: the PyTorch fallback, fused residual add, double backward ----------

def _layer_norm_math(xf, w, b, eps, offset):
    """``(y, mean, rstd)`` of ``xf: [M, N]`` fp32 (``w``/``b``: fp32 ``[N]`` or None): ATen's
    LayerNorm; ``mean``/``rstd`` ``[M]``."""
    y, mean, rstd = torch.native_layer_norm(xf, [xf.shape[1]], w, b, eps)
    return y, mean.view(-1), rstd.view(-1)


def _rms_norm_math(xf, w, b, eps, offset):
    """``(y, None, rstd)``: ``y = xf * rstd * (w + offset)``, the offset added in fp32 as the
    cuDNN graph adds it; ``b`` is ignored."""
    rstd = torch.rsqrt(xf.square().mean(dim=1) + eps)
    y = xf * rstd.unsqueeze(1)
    if w is not None:
        y = y * (w + offset)
    elif offset:
        y = y * (1.0 + offset)
    return y, None, rstd


_LN_BACKWARD = torch.ops.aten.native_layer_norm_backward.default
# Elements of a half-precision x per block of the CPU LayerNorm backward's fp32 dW/dB sums:
# fp32 copies of 2**17 elements stay in cache (copies of a whole 4096x4096 x and dy made that
# backward 3x slower than PyTorch's; blocks of 2**15 elements paid more per-block host time).
# CPU, one thread, bf16: 256x1024 0.27 ms against PyTorch's 0.24, 4096x4096 42 ms against 39.
_BLOCK_ELEMENTS = 1 << 17


def _layer_norm_grads(dy, x, weight, mean, rstd, offset):
    """``(dx x.dtype, dweight fp32, dbias fp32)`` of ``dy, x: [M, N]`` from ATen's LayerNorm
    backward, which computes in fp32; dW is computed against ones when there is no weight,
    as the cuDNN graph does. On a CPU, an x larger than a block takes dx from the kernel on
    x's own dtype but dW/dB from fp32 copies of blocks of rows: for a half-precision x ATen's
    CPU kernel sums dW/dB in per-thread buffers of x's dtype (bf16 at 4096 rows: 2-8% error),
    where cuDNN's graph and fp32 master weights want fp32 sums."""
    m, n = x.shape
    w = _dispatch.constant(1.0, n, _F32, x.device) if weight is None else weight.float()
    no_bias = _dispatch.constant(0.0, n, _F32, x.device)  # ATen returns dB only when given a bias
    mean, rstd = mean.reshape(m, 1), rstd.reshape(m, 1)
    if x.dtype is _F32 or x.device.type != "cpu" or m * n <= _BLOCK_ELEMENTS:
        dx, dw, db = _LN_BACKWARD(dy.float(), x.float(), [n], mean, rstd, w, no_bias, [True, True, True])
        return dx.to(x.dtype), dw, db
    dx = _LN_BACKWARD(dy, x, [n], mean, rstd, w, no_bias, [True, False, False])[0]
    rows = max(1, _BLOCK_ELEMENTS // n)
    block = torch.empty((2, min(rows, m), n), dtype=_F32, device=x.device)
    sums = []
    for start in range(0, m, rows):
        k = min(rows, m - start)
        xf, dyf = block[0, :k], block[1, :k]
        torch._foreach_copy_([xf, dyf], [x[start:start + k], dy[start:start + k]])
        _, dw, db = _LN_BACKWARD(dyf, xf, [n], mean[start:start + k], rstd[start:start + k], w, no_bias,
                                 [False, True, True])
        sums.append(torch.stack((dw, db)))
    dw, db = (sums[0] if len(sums) == 1 else torch.stack(sums).sum(0)).unbind(0)
    return dx, dw, db


def _rms_norm_grads(dy, x, weight, mean, rstd, offset):
    """``(dx x.dtype, dweight fp32, None)``: ``dx = rstd * (g - xhat * mean(g * xhat))`` with
    ``g = dy * (weight + offset)``; ``dw = sum(dy * xhat)``, unchanged by the offset; in fp32."""
    dyf, xf = dy.float(), x.float()
    rstd = rstd.unsqueeze(1)
    xhat = xf * rstd
    g = dyf * (1.0 + offset) if weight is None else dyf * (weight.float() + offset)
    dx = rstd * (g - xhat * (g * xhat).mean(dim=1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(0), None


def _layer_norm_kernel(x, w, b, eps, offset):
    """``(y x.dtype, mean, rstd)`` of ``x: [M, N]`` from ATen's LayerNorm kernel on x's own
    dtype with fp32 ``w``/``b`` (``[N]`` or None): it computes in fp32 and rounds ``y`` once,
    so this is the fp32 math without fp32 copies of ``x`` and ``y`` (3-4x faster on a CPU),
    and ``y`` is bitwise PyTorch's for weights of x's dtype. With a half-precision ``x`` ATen
    returns fp32 statistics only when a parameter is fp32: fp32 ones stand in for no weight."""
    n = x.shape[1]
    if w is None and x.dtype is not _F32:
        w = _dispatch.constant(1.0, n, _F32, x.device)
    y, mean, rstd = torch.native_layer_norm(x, [n], w, b, eps)
    return y, mean.view(-1), rstd.view(-1)


def _rms_norm_kernel(x, w, b, eps, offset):
    """``(y x.dtype, None, rstd)`` from ATen's RMSNorm on x's own dtype, scaled by the fp32
    ``w + offset`` (computed in fp32, ``y`` rounded once, fp32 ``rstd``), as
    :func:`_layer_norm_kernel`. Off the CPU, and where this torch has no ``_fused_rms_norm``,
    the fp32 math: ``F.rms_norm`` keeps mixed dtypes off the fused kernel, measured on CPU only."""
    if _FUSED_RMS_NORM is None or x.device.type != "cpu":
        y, mean, rstd = _rms_norm_math(x.float(), w, b, eps, offset)
        return y.to(x.dtype), mean, rstd
    n = x.shape[1]
    if offset:
        w = _dispatch.constant(1.0 + offset, n, _F32, x.device) if w is None else w + offset
    y, rstd = _FUSED_RMS_NORM(x, [n], w, eps)
    return y, None, rstd.view(-1)


def _layer_norm_functional(x, weight, eps, offset):
    """LayerNorm of ``x: [M, N]`` by PyTorch's differentiable ops in fp32 (no bias: its
    gradient is ``sum(dy)``)."""
    return F.layer_norm(x.float(), (x.shape[1],), None if weight is None else weight.float(), None, eps)


def _rms_norm_functional(x, weight, eps, offset):
    """RMSNorm of ``x: [M, N]`` by PyTorch's differentiable ops in fp32, scaled by ``weight + offset``."""
    scale = None if weight is None else weight.float() + offset
    y = F.rms_norm(x.float(), (x.shape[1],), scale, eps)
    return y * (1.0 + offset) if weight is None and offset else y


def torch_rms_norm(x: torch.Tensor, shape, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
    """PyTorch's RMSNorm (calls the policy leaves to PyTorch). A weight of another dtype than
    ``x`` (fp32 on half-precision ``x``, :mod:`cudnorm._policy` rule 1) goes to ATen's fused
    kernel, which computes in fp32 and rounds ``y`` once; ``torch.rms_norm`` would warn that
    it cannot dispatch mixed dtypes to that kernel and take its composite fp32 path."""
    if weight is not None and weight.dtype is not x.dtype and _FUSED_RMS_NORM is not None:
        return _FUSED_RMS_NORM(x, shape, weight, eps)[0]
    return torch.rms_norm(x, shape, weight, eps)


def gemma_rms_norm(x: torch.Tensor, shape, weight: torch.Tensor | None, eps: float, offset: float) -> torch.Tensor:
    """PyTorch's RMSNorm scaled by ``weight + offset`` as Gemma's model code writes it (calls
    the policy leaves to PyTorch): fp32 throughout, one rounding at the end."""
    y = F.rms_norm(x.float(), shape, None, eps)
    return (y * ((1.0 if weight is None else weight.float()) + offset)).to(x.dtype)


# -- PyTorch's fused kernels, where they beat cuDNN's graph or none serves -------------------

def _native_layer_norm(x, scale, shift, eps, training):
    """``(y, stats)`` from ATen's LayerNorm kernel, statistics in the op's layout (``None``
    when not training)."""
    y, mean, rstd = torch.native_layer_norm(x, [x.shape[1]], scale, shift, eps)
    if not training:
        return y, None
    stats = _dispatch.stats_buffer(x.shape[0], 2, x.device)
    stats[:, :x.shape[0]].copy_(torch.stack((mean.view(-1), rstd.view(-1))))
    return y, stats


# PyTorch's one-kernel RMSNorm (torch >= 2.8); older releases take the composite fp32 path
_FUSED_RMS_NORM = getattr(getattr(torch.ops.aten, "_fused_rms_norm", None), "default", None)


def _native_rms_norm(x, scale, shift, eps, training):
    """``(y, rstd [M] fp32)`` from ATen's fused RMSNorm kernel (``rstd`` ``None`` when not training)."""
    y, rstd = _FUSED_RMS_NORM(x, [x.shape[1]], scale, eps)
    return (y, rstd.view(-1).float()) if training else (y, None)


# -- the description ---------------------------------------------------------------------------

@dataclass(frozen=True)
class NormOp:
    """What tells LayerNorm and RMSNorm apart; everything else in this module is shared.

    The custom ops' argument lists follow from ``centred``: LayerNorm's are
    ``(x, weight, bias, eps, training)`` and ``(dy, x, weight, stats)``, RMSNorm's
    ``(x, weight, eps, training, offset)`` and ``(dy, x, weight, rstd, offset)``.
    """

    name: str  # "layer_norm" | "rms_norm": the graph family, error messages, the cudnorm:: ops
    centred: bool  # subtracts the mean and adds a bias: mean and bias buffers, a dbias, [2, ceil4(M)] stats
    math: Callable  # fp32 forward (xf, w, b, eps, offset) -> (y, mean or None, rstd)
    kernel: Callable  # PyTorch's forward on x's dtype with fp32 (w, b): (x, w, b, eps, offset) -> (y, mean or None, rstd)
    grads: Callable  # backward in fp32 (dy, x, weight, mean, rstd, offset) -> (dx x.dtype, dweight fp32, dbias fp32 or None)
    functional: Callable  # differentiable fp32 forward (x, weight, eps, offset), for double backward
    native: Callable | None  # PyTorch's fused CUDA kernel (x, scale, shift, eps, training) -> (y, stats)
    cudnn_offsets: tuple[float, ...]  # nonzero weight offsets cuDNN's graphs take; others run PyTorch's ops

    @property
    def stats_rows(self) -> int:
        """fp32 statistics per row: mean and rstd, or rstd alone."""
        return 2 if self.centred else 1


LAYER_NORM = NormOp("layer_norm", True, _layer_norm_math, _layer_norm_kernel, _layer_norm_grads, _layer_norm_functional,
                    _native_layer_norm, ())
# Offsets cuDNN's RMSNorm kernels take: its fused scale prologue accepts only ``weight + 1``
# (zero-centred gamma); execute refuses any other value (CUDNN_STATUS_BAD_PARAM on an H100,
# cuDNN 9.19, docs/performance.md, Decisions). Other offsets run the PyTorch path.
RMS_NORM = NormOp("rms_norm", False, _rms_norm_math, _rms_norm_kernel, _rms_norm_grads, _rms_norm_functional,
                  None if _FUSED_RMS_NORM is None else _native_rms_norm, (1.0,))


# -- helpers shared with cudnorm._fused_add --------------------------------------------------

def param32(x: torch.Tensor, param: torch.Tensor | None) -> torch.Tensor | None:
    """``param`` in fp32 for the PyTorch path, rounded first as the cuDNN path rounds it
    (``_dispatch.forward_param_dtype``), so both paths compute the same function."""
    return None if param is None else param.to(_dispatch.forward_param_dtype(x, param)).float()


def padded_stats(x: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor, training: bool) -> torch.Tensor:
    """fp32 ``[k, ceil4(M)]`` statistics of ``x: [M, N]`` (``k`` = 2 with a mean, else 1), the
    padding zeroed so that repeated calls return equal tensors; ``[k, 0]`` when not training."""
    rows = (rstd,) if mean is None else (mean, rstd)
    if not training:
        return x.new_empty((len(rows), 0), dtype=_F32)
    stats = torch.stack(rows).float()  # one op for the common unpadded case (host time of small calls)
    pad = -x.shape[0] % 4
    return F.pad(stats, (0, pad)) if pad else stats


def torch_backward(op: NormOp, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                   mean: torch.Tensor | None, rstd: torch.Tensor, offset: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """PyTorch path of a backward on ``[M, N]`` (``mean``/``rstd``: fp32 ``[M]``): ``(dx x.dtype,
    dweight, dbias or None)``, dW/dB computed in fp32 and rounded once into the weight's dtype."""
    wdtype = _dispatch.backward_scale_dtype(weight)
    dx, dw, db = op.grads(dy, x, weight, mean, rstd, offset)
    return dx, dw.to(wdtype), None if db is None else db.to(wdtype)


# -- the implementation ------------------------------------------------------------------------

class Implementation(NamedTuple):
    """The functions :func:`implement` makes for one :class:`NormOp`."""

    forward: Callable  # (x, weight, bias, eps, training, offset=0.0) -> (y, stats)
    infer: Callable  # (x, weight, bias, eps, offset=0.0) -> y: eager inference, no statistics
    backward: Callable  # (dy, x, weight, stats, offset=0.0) -> (dx, dweight, dbias or None)
    fake_forward: Callable  # forward's shapes and dtypes, for tracing
    fake_backward: Callable  # backward's shapes and dtypes, for tracing
    setup_context: Callable  # (ctx, inputs, output) with inputs in the implementation's order
    make_backward: Callable  # (backward_fn) -> autograd backward(ctx, dy) of the 6 inputs
    differentiable_backward: Callable  # (dy, x, weight, eps, offset) -> (dx, dweight, dbias or None), as graphs


def implement(op: NormOp) -> Implementation:
    """The implementation of ``op``, with the description bound into closures: the hot path
    pays neither an attribute lookup nor a test of which norm it runs, beyond ``centred``."""
    name, centred, kernel, functional, native = op.name, op.centred, op.kernel, op.functional, op.native
    cudnn_offsets = op.cudnn_offsets
    no_stats = (2, 0) if centred else (0,)  # the statistics of an inference forward

    def forward(x, weight, bias, eps, training, offset=0.0):
        """``(y [M, N] x.dtype, stats)`` of ``x: [M, N]``; ``stats`` in the op's layout (module
        docstring), empty with ``training=False`` (the inference graph writes none). No rows
        (``M = 0``): PyTorch's path, which returns the empty results cuDNN has no graph for."""
        if x.shape[0] and _runtime.route(x) is None:
            y, stats = gpu_forward(x, weight, bias, eps, training, offset)
            return y, stats if training else x.new_empty(no_stats, dtype=_F32)
        return torch_forward(x, weight, bias, eps, training, offset)

    def infer(x, weight, bias, eps, offset=0.0):
        """Eager inference: ``y`` only (no empty statistics tensor to allocate)."""
        if x.shape[0] and _runtime.route(x) is None:
            return gpu_forward(x, weight, bias, eps, False, offset)[0]
        return torch_forward(x, weight, bias, eps, False, offset)[0]

    def gpu_forward(x, weight, bias, eps, training, offset):
        """``(y, stats)`` (``stats`` ``None`` when not training) on a CUDA tensor from cuDNN's
        graph, or from :func:`kernel_forward` where no graph serves the call: wide rows (PyTorch's
        kernel was measured faster, :func:`cudnorm._dispatch.native_forward`), an offset cuDNN
        does not take, a row count the row policy leaves to PyTorch (such as decode steps of a
        few rows), a declined graph. The hot path of every call: keep it lean."""
        if (offset and offset not in cudnn_offsets) or _dispatch.native_forward(x):
            return kernel_forward(x, weight, bias, eps, training, offset)
        scale, shift, scale_dtype = _dispatch.forward_params(x, weight, bias, has_bias=centred)
        x, plan = _call_plans.rows_plan(name, "train" if training else "infer", x, scale_dtype, offset != 0.0)
        if plan is None:
            return kernel_forward(x, weight, bias, eps, training, offset)
        y = torch.empty_like(x)  # x's rows are cuDNN-ready: y comes out packed [M, N]
        stats = None
        if training:  # LayerNorm's two rows in one buffer: an allocation costs 3-5 us of host time
            stats = (_dispatch.stats_buffer(x.shape[0], 2, x.device) if centred
                     else torch.empty(x.shape[0], dtype=_F32, device=x.device))
        eps_holder, eps_address = eps_scalar(eps)  # the holder keeps the host scalar alive until the launch
        if type(plan) is Plan:  # addresses in roles() order: no tensor views to make
            if centred:
                pointers = [x.data_ptr(), scale.data_ptr(), shift.data_ptr(), eps_address, y.data_ptr()]
                if training:
                    mean = stats.data_ptr()
                    pointers += (mean, mean + 4 * stats.shape[1])
            else:
                pointers = [x.data_ptr(), scale.data_ptr(), eps_address, y.data_ptr()]
                if training:
                    pointers.append(stats.data_ptr())
            if offset:
                offset_holder, offset_address = eps_scalar(offset)  # held until the launch has read it
                pointers.append(offset_address)
            plan.launch(pointers)
        elif centred:  # a chunked plan takes tensors (LayerNorm takes no offset)
            if training:
                m = x.shape[0]
                plan.run(x, scale, shift, eps_holder, y, stats[0, :m], stats[1, :m])
            else:
                plan.run(x, scale, shift, eps_holder, y)
        elif offset:
            plan.run(x, scale, eps_holder, y, *((stats,) if training else ()), eps_scalar(offset)[0])
        elif training:
            plan.run(x, scale, eps_holder, y, stats)
        else:
            plan.run(x, scale, eps_holder, y)
        return y, stats

    def kernel_forward(x, weight, bias, eps, training, offset):
        """``(y, stats)`` (``stats`` ``None`` when not training) from PyTorch's fused kernel
        (parameters rounded as for cuDNN), or the fp32 fallback with an offset or without one."""
        if offset or native is None:
            y, stats = torch_forward(x, weight, bias, eps, training, offset)
            return y, stats if training else None
        scale, shift, _ = _dispatch.forward_params(x, weight, bias, has_bias=centred)
        return native(x, scale, shift, eps, training)

    def torch_forward(x, weight, bias, eps, training, offset):
        """PyTorch path (any device): PyTorch's kernel computing in fp32 with the fp32
        parameters rounded as for cuDNN (:func:`param32`)."""
        y, mean, rstd = kernel(x, param32(x, weight), param32(x, bias), eps, offset)
        if centred:
            stats = padded_stats(x, mean, rstd, training)
        else:
            stats = rstd if training else x.new_empty(no_stats, dtype=_F32)
        return y, stats

    def backward(dy, x, weight, stats, offset=0.0):
        """Backward on ``[M, N]`` with the forward's ``stats``: ``(dx x.dtype, dweight [N],
        dbias [N] or None)`` (None for RMSNorm). dW/dB are accumulated in fp32 and rounded once
        into the weight's dtype (fp32 without a weight): fp32 master weights get fp32
        gradients, half-precision weights what PyTorch's own backward gives them. With an
        offset the graph reads ``weight + offset``; dW is unchanged by it."""
        wdtype = _dispatch.backward_scale_dtype(weight)
        if x.shape[0] and _runtime.route(x) is None and (not offset or offset in cudnn_offsets):
            x, plan = _call_plans.rows_plan(name, "bwd", x, wdtype, offset != 0.0)
            if plan is not None:
                n = x.shape[1]
                scale = _dispatch.constant(1.0, n, _F32, x.device) if weight is None else weight
                dy = _dispatch.packed(dy)
                dx = torch.empty_like(x)
                dw = torch.empty(n, dtype=wdtype, device=x.device)
                db = torch.empty(n, dtype=wdtype, device=x.device) if centred else None
                if type(plan) is Plan:
                    if centred:
                        mean = stats.data_ptr()
                        pointers = [x.data_ptr(), scale.data_ptr(), mean, mean + 4 * stats.shape[1], dy.data_ptr(),
                                    dx.data_ptr(), dw.data_ptr(), db.data_ptr()]
                    else:
                        pointers = [x.data_ptr(), scale.data_ptr(), stats.data_ptr(), dy.data_ptr(), dx.data_ptr(),
                                    dw.data_ptr()]
                    if offset:
                        offset_holder, offset_address = eps_scalar(offset)  # held until the launch has read it
                        pointers.append(offset_address)
                    plan.launch(pointers)
                elif centred:
                    m = x.shape[0]
                    plan.run(x, scale, stats[0, :m], stats[1, :m], dy, dx, dw, db)
                elif offset:
                    plan.run(x, scale, stats, dy, dx, dw, eps_scalar(offset)[0])
                else:
                    plan.run(x, scale, stats, dy, dx, dw)
                return dx, dw, db
        m = x.shape[0]
        if centred:
            return torch_backward(op, dy, x, weight, stats[0, :m], stats[1, :m], offset)
        return torch_backward(op, dy, x, weight, None, stats, offset)

    def fake_forward(x, weight, bias, eps, training, offset=0.0):
        m, n = x.shape
        if not training:
            stats = no_stats
        else:
            stats = (2, (m + 3) // 4 * 4) if centred else (m,)
        return x.new_empty((m, n)), x.new_empty(stats, dtype=_F32)

    def fake_backward(dy, x, weight, stats, offset=0.0):
        n = x.shape[1]
        wdtype = _dispatch.backward_scale_dtype(weight)
        db = x.new_empty((n,), dtype=wdtype) if centred else None
        return x.new_empty(x.shape), x.new_empty((n,), dtype=wdtype), db

    def setup_context(ctx, inputs, output):
        x, weight, bias, eps, training, offset = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.eps = eps
        ctx.offset = offset

    def make_backward(backward_fn):
        """The autograd backward, calling ``backward_fn(dy, x, weight, stats, offset)``: the
        custom op in traced graphs, :func:`backward` in the eager ``autograd.Function``.
        Returns the gradients of the implementation's six inputs."""

        def backward_(ctx, dy):
            x, weight, stats = ctx.saved_tensors
            if stats.numel() == 0 and x.numel():  # an empty x has empty statistics in training too
                raise RuntimeError(f"cudnorm.{name}: backward through an inference-phase forward "
                                   "(the forward ran without grad mode, so no statistics were saved)")
            if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
                dx, dw, db = differentiable_backward(dy, x, weight, ctx.eps, ctx.offset)
            else:
                dx, dw, db = backward_fn(dy, x, weight, stats, ctx.offset)
            bias_dtype = ctx.bias_dtype
            dbias = None if bias_dtype is None else db if db.dtype is bias_dtype else db.to(bias_dtype)
            return dx, None if weight is None else dw, dbias, None, None, None

        return backward_

    def differentiable_backward(dy, x, weight, eps, offset):
        """``(dx, dweight, dbias or None)`` as graphs for double backward
        (``_ops.differentiable_grads``), in the dtypes of the plain backward."""
        dx, dw = _ops.differentiable_grads(lambda x, weight: functional(x, weight, eps, offset),
                                                (x, weight), dy.float())
        db = dy.float().sum(0).to(_dispatch.backward_scale_dtype(weight)) if centred else None
        return dx, dw, db

    return Implementation(forward, infer, backward, fake_forward, fake_backward, setup_context, make_backward,
                          differentiable_backward)


def define_ops(op: NormOp, impl: Implementation, forward_schema: str, backward_schema: str):
    """Define ``cudnorm::<op.name>_fwd`` and ``_bwd`` running ``impl``, with their autograd for
    traced graphs; returns the two ops (default overloads).

    The schemas' argument lists are the op's own (:class:`NormOp`); the adapters below map them
    onto the implementation's ``(x, weight, bias, eps, training, offset)``. Only traced calls go
    through them: eager calls use ``impl`` directly.
    """
    if op.centred:  # (x, weight, bias, eps, training), (dy, x, weight, stats): the implementation's, offset 0
        op_forward, fake_forward = impl.forward, impl.fake_forward
        op_backward, fake_backward = impl.backward, impl.fake_backward

        def impl_inputs(x, weight, bias, eps, training):
            return x, weight, bias, eps, training, 0.0

        def backward_through_op(dy, x, weight, stats, offset):
            return backward_op(dy, x, weight, stats)
    else:  # (x, weight, eps, training, offset), (dy, x, weight, rstd, offset) -> (dx, dweight): no bias
        def impl_inputs(x, weight, eps, training, offset=0.0):
            return x, weight, None, eps, training, offset

        def op_forward(x, weight, eps, training, offset=0.0):
            return impl.forward(x, weight, None, eps, training, offset)

        def fake_forward(x, weight, eps, training, offset=0.0):
            return impl.fake_forward(x, weight, None, eps, training, offset)

        def op_backward(dy, x, weight, rstd, offset=0.0):
            return impl.backward(dy, x, weight, rstd, offset)[:2]

        def fake_backward(dy, x, weight, rstd, offset=0.0):
            return impl.fake_backward(dy, x, weight, rstd, offset)[:2]

        def backward_through_op(dy, x, weight, rstd, offset):
            return (*backward_op(dy, x, weight, rstd, offset), None)

    def setup_context(ctx, inputs, output):
        impl.setup_context(ctx, impl_inputs(*inputs), output)

    implementation_backward = impl.make_backward(backward_through_op)

    def backward(ctx, dy):
        return implementation_backward(ctx, dy)[:5]  # the gradients of the op's five inputs

    forward_op = _ops.define_op(f"{op.name}_fwd", forward_schema, op_forward, fake_forward)
    backward_op = _ops.define_op(f"{op.name}_bwd", backward_schema, op_backward, fake_backward)
    _ops.register_autograd(f"{op.name}_fwd", setup_context, backward)
    return forward_op, backward_op
