"""LayerNorm/RMSNorm with a fused residual add: ``h = input + residual; y = norm(h)``,
returning ``(y, h)`` (the pre-norm residual stream of a transformer block).

Forward: cuDNN's graph adds, writes ``h`` and normalises the unrounded sum in one pass
(:attr:`cudnorm._spec.NormSpec.residual`) up to :data:`FUSED_FORWARD_MAX_COLS` columns
(per op); wider rows run PyTorch's add and then the plain norm graph, which was faster there.
Backward: the norm's backward graph on the saved ``h``, then ``dh`` (the gradient reaching
``h`` from the residual stream) is added in place: cuDNN declines a pointwise add after its
norm backward (cuDNN 9.19 and 9.28.1 on an H100; 9.19 even builds such a graph when dx is
also an output and then leaves the sum unwritten: docs/performance.md, Decisions), so that
add is one PyTorch kernel.
``input`` and ``residual`` get the same gradient.

Works on ``[M, N]`` views with one implementation for both norms: ``rms`` selects the op's
description (:class:`cudnorm._norm.NormOp`), whose fp32 math the PyTorch paths share with the
plain ops. LayerNorm statistics are fp32 ``[2, ceil4(M)]`` (mean, rstd), RMSNorm's ``[1, ceil4(M)]``.
"""

from __future__ import annotations

import torch

from . import _call_plans, _checks, _decisions, _dispatch, _norm, _norm_kernel, _ops, _policy, _runtime
from ._graphs import eps_scalar, roles

_F32 = torch.float32
_OPS = (_norm.LAYER_NORM, _norm.RMS_NORM)  # indexed by the ops' ``rms`` flag
_IMPLS = tuple(_norm.implement(op) for op in _OPS)

# Widest rows whose forward runs the fused graph, per op. H100, bf16, M = 32768, the fused
# graph against PyTorch's add + the plain graph (docs/performance.md, Decisions): RMSNorm
# 0.382 vs 0.445 ms at N = 4096, 0.809 vs 0.888 at 8192; LayerNorm 0.385 vs 0.461 at 4096 but
# 1.038 vs 0.902 at 8192; at 16384 the fused graph took 2.6 ms against 1.8 (its plan is slow
# there; autotuning found none faster).
FUSED_FORWARD_MAX_COLS = {"rms_norm": 8192, "layer_norm": 4096}


def forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
            eps: float, training: bool, rms: bool, offset: float = 0.0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, stats)`` for ``x, residual: [M, N]`` of one dtype; ``weight``/``bias``:
    ``[N]`` fp32 or x's dtype, or None (``bias`` ignored when ``rms``). ``stats`` is empty
    (``[k, 0]``) with ``training=False``; no rows (``M = 0``) take PyTorch's path."""
    op = _OPS[rms]
    if x.shape[0] and _runtime.route(x) is None and (not offset or offset in op.cudnn_offsets):
        out = _cudnn_forward(x, residual, weight, bias, eps, training, op, offset)
        if out is not None:
            y, h, stats = out
            return y, h, stats if training else x.new_empty((op.stats_rows, 0), dtype=_F32)
    return _torch_forward(x, residual, weight, bias, eps, training, rms, offset)


def _cudnn_forward(x, residual, weight, bias, eps, training, op, offset):
    """``(y, h, stats)`` from cuDNN (``stats`` ``None`` when not training), or ``None`` when
    cuDNN declines."""
    scale, shift, scale_dtype = _dispatch.forward_params(x, weight, bias, has_bias=op.centred)
    phase = "train" if training else "infer"
    fused = x.shape[1] <= FUSED_FORWARD_MAX_COLS[op.name]
    if fused:
        x, plan = _call_plans.rows_plan(op.name, phase, x, scale_dtype, bool(offset), residual=True)
        h = torch.empty_like(x)
    else:
        h = torch.add(x, residual)
        x, plan = _call_plans.rows_plan(op.name, phase, h, scale_dtype, bool(offset))
    if plan is None:
        return None
    m = x.shape[0]
    y = torch.empty_like(x)
    stats = _dispatch.stats_buffer(m, op.stats_rows, x.device) if training else None
    buffers = {"x": x, "scale": scale, "bias": shift, "eps": eps_scalar(eps)[0], "y": y,
               "residual": _dispatch.packed(residual) if fused else None, "h": h}
    if training:
        buffers["rstd"] = stats[-1, :m]
        buffers["mean"] = stats[0, :m]
    if offset:
        buffers["offset"] = eps_scalar(offset)[0]
    plan.run(*(buffers[role] for role in roles(plan.spec)))
    return y, h, stats


def _torch_forward(x, residual, weight, bias, eps, training, rms, offset):
    """PyTorch path in fp32 (any device): the norm reads the unrounded sum, as the fused
    graph does; parameters rounded as on the cuDNN path."""
    hf = x.float() + residual.float()
    y, mean, rstd = _OPS[rms].math(hf, _norm.param32(x, weight), _norm.param32(x, bias), eps, offset)
    return y.to(x.dtype), hf.to(x.dtype), _norm.padded_stats(x, mean, rstd, training)


def backward(dy: torch.Tensor | None, dh: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor | None,
             stats: torch.Tensor, rms: bool, offset: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)`` on ``[M, N]``: ``dx`` is the gradient of both ``input`` and
    ``residual`` (h's dtype); dW/dB accumulated in fp32, rounded once to the weight's dtype
    (fp32 without a weight). ``dy``/``dh`` may be ``None`` (no gradient reached ``y``/``h``)."""
    n = h.shape[1]
    wdtype = _dispatch.backward_scale_dtype(weight)
    if dy is None:  # only the residual stream was used: the norm adds nothing
        zeros = torch.zeros(n, dtype=wdtype, device=h.device)
        return dh.clone(), zeros, zeros.clone()
    # the plain op's backward on h (cuDNN's graph or PyTorch's math, as it chooses), then dh;
    # RMSNorm's statistics are row 0 of [1, ceil4(M)], where the plain op keeps an [M] vector
    dx, dw, db = _IMPLS[rms].backward(dy, h, weight, stats[0, :h.shape[0]] if rms else stats, offset)
    if db is None:  # RMSNorm has no bias; the op's schema still returns a dbias
        db = torch.zeros_like(dw)
    if dh is not None:
        dx.add_(dh)
    return dx, dw, db


def reference(x, residual, normalized_shape, weight, bias, eps, rms, offset=0.0):
    """``(y, h)`` from PyTorch's own ops (calls the policy leaves to PyTorch: small or traced
    by ``torch.compile``, where Inductor fuses the add with the norm). Half-precision ``h`` is
    rounded before the norm reads it, as unfused model code does."""
    h = x + residual
    if not rms:
        return torch.layer_norm(h, normalized_shape, weight, bias, eps), h
    if offset:
        return _norm.gemma_rms_norm(h, normalized_shape, weight, eps, offset), h
    return _norm.torch_rms_norm(h, normalized_shape, weight, eps), h


def _fake_forward(x, residual, weight, bias, eps, training, rms, offset=0.0):
    m, n = x.shape
    return x.new_empty((m, n)), x.new_empty((m, n)), x.new_empty(
        (1 if rms else 2, -(-m // 4) * 4 if training else 0), dtype=_F32)


def _fake_backward(dy, dh, h, weight, stats, rms, offset=0.0):
    wdtype = _dispatch.backward_scale_dtype(weight)
    n = h.shape[1]
    return h.new_empty(h.shape), h.new_empty((n,), dtype=wdtype), h.new_empty((n,), dtype=wdtype)


add_norm_fwd = _ops.define_op(
    "add_norm_fwd", "(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, bool training, bool rms, "
    "float offset=0.) -> (Tensor, Tensor, Tensor)", forward, _fake_forward)
add_norm_bwd = _ops.define_op(
    "add_norm_bwd", "(Tensor? dy, Tensor? dh, Tensor h, Tensor? weight, Tensor stats, bool rms, float offset=0.) "
    "-> (Tensor, Tensor, Tensor)", backward, _fake_backward)


def _setup_context(ctx, inputs, output):
    _x, _residual, weight, bias, eps, _training, rms, offset = inputs
    ctx.set_materialize_grads(False)  # no zero gradient is made for an unused y or h
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.bias_dtype = None if bias is None or rms else bias.dtype
    ctx.eps, ctx.rms, ctx.offset = eps, rms, offset


def _make_backward(backward_fn):
    """The autograd backward calling ``backward_fn`` (the custom op in traced graphs, the
    implementation in eager calls)."""

    def backward_(ctx, dy, dh, _dstats=None):
        h, weight, stats = ctx.saved_tensors
        if stats.numel() == 0 and h.numel():  # an empty h has empty statistics in training too
            raise RuntimeError(f"cudnorm.{_OPS[ctx.rms].name}: backward through an inference-phase forward "
                               "(the forward ran without grad mode, so no statistics were saved)")
        if dy is None and dh is None:
            return (None,) * 8
        if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
            dx, dw, db = _differentiable_backward(dy, dh, h, weight, ctx)
        else:
            dx, dw, db = backward_fn(dy, dh, h, weight, stats, ctx.rms, ctx.offset)
        dbias = None if ctx.bias_dtype is None else db if db.dtype is ctx.bias_dtype else db.to(ctx.bias_dtype)
        return dx, dx, None if weight is None else dw, dbias, None, None, None, None

    return backward_


def _differentiable_backward(dy, dh, h, weight, ctx):
    """``(dx, dweight, dbias)`` as graphs for double backward, in the plain backward's dtypes.
    ``h`` is a saved output, so the second derivative reaches input and residual through it."""
    n = h.shape[1]
    wdtype = _dispatch.backward_scale_dtype(weight)
    if dy is None:
        zeros = torch.zeros(n, dtype=wdtype, device=h.device)
        return dh, zeros, zeros

    def norm(h, weight):
        return _OPS[ctx.rms].functional(h, weight, ctx.eps, ctx.offset)

    dx, dw = _ops.differentiable_grads(norm, (h, weight), dy.float())
    if dh is not None:
        dx = dx + dh
    db = dy.float().sum(0).to(wdtype) if not ctx.rms else torch.zeros(n, dtype=wdtype, device=h.device)
    return dx, dw, db


def _setup_op_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output[2])
    _setup_context(ctx, inputs, output)


torch.library.register_autograd("cudnorm::add_norm_fwd", _make_backward(add_norm_bwd),
                                setup_context=_setup_op_context, lib=_ops.LIBRARY)


class _FusedAddNorm(torch.autograd.Function):
    """Eager autograd for :func:`forward`: outputs ``(y, h)``, statistics kept in ``ctx``."""

    @staticmethod
    def forward(ctx, *inputs):
        y, h, stats = forward(*inputs)
        _setup_context(ctx, inputs, (y, h, stats))
        return y, h

    backward = staticmethod(_make_backward(backward))


def call(input: torch.Tensor, residual: torch.Tensor, normalized_shape, n: int, weight, bias, eps: float,
         rms: bool, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)`` of a checked public call (``cudnorm.layer_norm``/``rms_norm`` with
    ``residual=``): ``input``, ``residual``: ``[*, *normalized_shape]`` of one dtype, ``n``
    the normalised size. PyTorch's ops where the policy prefers them, else :func:`run`."""
    if _policy.torch_serves(input, weight, bias):
        shape = (normalized_shape,) if type(normalized_shape) is int else tuple(normalized_shape)
        return reference(input, residual, shape, weight, bias, eps, rms, offset)
    shape = (normalized_shape,) if type(normalized_shape) is int else tuple(normalized_shape)
    if _ops.eager(input) and not offset:
        # the measured decision of the plain norm's signature: the same engines serve the fused graph
        training = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                   for t in (input, residual, weight, bias))
        serves = _decisions.serves(_OPS[rms].name, input, n, weight, None if rms else bias, training)
        if serves == "torch":
            return reference(input, residual, shape, weight, bias, eps, rms, offset)
        if serves == "kernel":
            h = input + residual
            y = _norm_kernel.norm(_checks.rows(_OPS[rms].name, "input", h, n), None if weight is None else
                                  weight.reshape(n), None if rms or bias is None else bias.reshape(n), eps, rms)
            return y.view(input.shape), h
    flat = input.dim() == 2 and input.shape[1] == n
    x = input if flat else _checks.rows(_OPS[rms].name, "input", input, n)
    r = residual if flat else _checks.rows(_OPS[rms].name, "residual", residual, n)
    w = weight if weight is None or flat else weight.reshape(n)
    b = bias if bias is None or flat else bias.reshape(n)
    y, h = run(x, r, w, b, eps, rms, offset)
    return (y, h) if flat else (y.view(input.shape), h.view(input.shape))


def run(x, residual, weight, bias, eps, rms, offset=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)`` for ``x, residual: [M, N]``: the autograd node when grad is needed, the
    inference graph otherwise, the custom op while tracing."""
    training = torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or any(
        p is not None and p.requires_grad for p in (weight, bias)))
    if not _ops.eager(x):
        y, h, _ = add_norm_fwd(x, residual, weight, bias, eps, training, rms, offset)
        return y, h
    if training:
        return _FusedAddNorm.apply(x, residual, weight, bias, eps, training, rms, offset)
    y, h, _ = forward(x, residual, weight, bias, eps, False, rms, offset)
    return y, h
