"""Reference implementations in high precision, used by the tests, the benchmark and the docs.

Each function upcasts its inputs (fp64 by default), applies the textbook formula and returns
the result in that precision, so it can serve as ground truth for fp16/bf16/fp32 outputs.
Gradients come from autograd through these same formulas.
"""

from __future__ import annotations

import torch


def layer_norm(x, weight=None, bias=None, eps=1e-5, dtype=torch.float64):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim of ``x``."""
    x = x.to(dtype)
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).square().mean(-1, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    return y


def rms_norm(x, weight=None, eps=1e-6, dtype=torch.float64):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim of ``x``."""
    x = x.to(dtype)
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.to(dtype)


def ada_layer_norm(x, scale, shift, eps=1e-6, dit=True, dtype=torch.float64):
    """AdaLN: ``layer_norm(x) * (1 + scale) + shift`` (DiT's ``modulate``) or, with
    ``dit=False``, ``layer_norm(x) * scale + shift``. ``x: [B, *, D]``; scale/shift
    ``[B, D]`` or ``[B, 1, D]`` broadcast over the tokens."""
    b, d = x.shape[0], x.shape[-1]
    view = (b,) + (1,) * (x.dim() - 2) + (d,)
    scale = scale.to(dtype).reshape(view)
    shift = shift.to(dtype).reshape(view)
    gain = 1 + scale if dit else scale
    return layer_norm(x, eps=eps, dtype=dtype) * gain + shift


def ada_layer_norm_eager(x, scale, shift, eps=1e-6, dit=True):
    """Not a reference: AdaLN in PyTorch's ops in ``x``'s dtype, as DiT code writes it
    (``x: [B, S, D]``, scale/shift ``[B, D]``): the baseline whose error the 2x rule allows
    twice of."""
    scale, shift = scale.to(x.dtype)[:, None], shift.to(x.dtype)[:, None]
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps) * ((1 + scale) if dit else scale) + shift


def ada_rms_norm(x, scale, shift=None, eps=1e-6, dit=True, dtype=torch.float64):
    """Adaptive RMSNorm: ``rms_norm(x) * (1 + scale) + shift`` or, with ``dit=False``,
    ``rms_norm(x) * scale + shift``; ``shift`` may be ``None``. ``x: [B, *, D]``; scale/shift
    ``[B, D]`` or ``[B, 1, D]`` broadcast over the tokens."""
    b, d = x.shape[0], x.shape[-1]
    view = (b,) + (1,) * (x.dim() - 2) + (d,)
    gain = scale.to(dtype).reshape(view)
    y = rms_norm(x, eps=eps, dtype=dtype) * (1 + gain if dit else gain)
    return y if shift is None else y + shift.to(dtype).reshape(view)


def ada_rms_norm_eager(x, scale, shift=None, eps=1e-6, dit=True):
    """Not a reference: adaptive RMSNorm in PyTorch's ops in ``x``'s dtype, as model code writes
    it: the baseline whose error the 2x rule allows twice of."""
    b, d = x.shape[0], x.shape[-1]
    view = (b,) + (1,) * (x.dim() - 2) + (d,)
    gain = scale.to(x.dtype).reshape(view)
    y = torch.nn.functional.rms_norm(x, (d,), eps=eps) * (1 + gain if dit else gain)
    return y if shift is None else y + shift.to(x.dtype).reshape(view)


def gated_ada_layer_norm(residual, branch, gate, scale, shift, eps=1e-6, dit=True, dtype=torch.float64):
    """A gated residual into AdaLN: ``(y, h)`` with ``h = residual + gate * branch`` and
    ``y = ada_layer_norm(h, scale, shift)``. ``residual``/``branch``: ``[B, S, D]``;
    gate/scale/shift ``[B, D]`` or ``[B, 1, D]`` broadcast over the tokens."""
    b, d = residual.shape[0], residual.shape[-1]
    h = residual.to(dtype) + gate.to(dtype).reshape(b, 1, d) * branch.to(dtype)
    return ada_layer_norm(h, scale, shift, eps, dit, dtype), h


def grads(fn, inputs, grad_out, dtype=torch.float64):
    """Output and gradients of ``fn`` w.r.t. every non-None tensor of ``inputs``, in ``dtype``.

    ``fn`` receives upcast leaf copies of ``inputs`` (in order, ``None`` passed through).
    """
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    wanted = [t for t in leaves if t is not None]
    got = torch.autograd.grad(out, wanted, grad_out.to(dtype))
    it = iter(got)
    return out.detach(), [None if t is None else next(it) for t in leaves]


def rel_error(out, ref) -> float:
    """``||out - ref|| / ||ref||`` in fp64 (``inf`` if ``out`` has a NaN or Inf)."""
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


#: Per-dtype floor of the relative-error bound: where PyTorch's own error is tiny (fp32, or a
#: lucky draw) the bound is this floor rather than 2x a near-zero number. Values are a few
#: units of the dtype's rounding of a unit-norm result (bf16 eps 7.8e-3, fp16 9.8e-4).
ERROR_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def error_bound(torch_error: float, dtype: torch.dtype, factor: float = 2.0) -> float:
    """The largest relative error cudnorm may have: ``factor`` x PyTorch's own error in the
    same dtype, but never below :data:`ERROR_FLOOR`."""
    return max(factor * torch_error, ERROR_FLOOR[dtype])


def accuracy_report(candidate, baseline, ref, inputs, grad_out, names, dtype):
    """Compare ``candidate`` (cudnorm) and ``baseline`` (PyTorch in the same dtype) with the
    fp64 ``ref`` on the output and on the gradient of every non-None input.

    ``inputs`` are the tensors passed positionally to all three callables; ``names`` labels
    them (output first: ``["y", "dx", "dweight", ...]``). Returns one dict per compared
    quantity: ``name, error, torch_error, bound, ok``.
    """
    ref_out, ref_grads = grads(ref, inputs, grad_out)
    rows = []
    results = [_run_with_grads(fn, inputs, grad_out) for fn in (candidate, baseline)]
    quantities = [(names[0], ref_out, results[0][0], results[1][0])]
    for i, r in enumerate(ref_grads):
        if r is not None:
            quantities.append((names[i + 1], r, results[0][1][i], results[1][1][i]))
    for name, r, mine, theirs in quantities:
        err, terr = rel_error(mine, r), rel_error(theirs, r)
        bound = error_bound(terr, dtype)
        rows.append({"name": name, "error": err, "torch_error": terr, "bound": bound, "ok": err <= bound})
    return rows


def _run_with_grads(fn, inputs, grad_out):
    leaves = [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(out, wanted, grad_out))
    return out.detach(), [None if (t is None or not t.requires_grad) else next(got) for t in leaves]
