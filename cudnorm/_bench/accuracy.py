"""The correctness gate every provider passes before it is timed.

The reference is :mod:`cudnorm.reference` in fp64, computed in row chunks (a full fp64 copy
of a 2^31-element input would be 16 GiB) and stored in fp32. A provider's output passes when
its relative error is within :func:`cudnorm.reference.error_bound` of eager PyTorch's error
in the same dtype (the "torch" provider), i.e. 2x PyTorch's error or the dtype's floor.
"""

from __future__ import annotations

import math

import torch

from .. import reference as ref
from .providers import FAMILIES, Inputs

CHUNK_ELEMENTS = 1 << 24


def _reference_fn(inp: Inputs):
    eps = inp.eps
    return {
        "ln": lambda x, w, b: ref.layer_norm(x, w, b, eps),
        "rms": lambda x, w: ref.rms_norm(x, w, eps),
        "ada": lambda x, s, t: ref.ada_layer_norm(x, s, t, eps, dit=True),
    }[inp.family]


def reference(inp: Inputs, with_grads: bool) -> dict[str, torch.Tensor]:
    """fp64 results stored in fp32: ``"y"`` and, with ``with_grads``, ``"dx"`` and
    ``"d<param>"`` for every parameter (named as in :func:`providers.quantities`)."""
    fn = _reference_fn(inp)
    x, per_sample = inp.x, inp.family == "ada"  # AdaLN parameters are per sample: chunk them too
    step = max(1, CHUNK_ELEMENTS // (x.numel() // x.shape[0]))
    names = ["d" + name for name in FAMILIES[inp.family][1]]
    out = {"y": torch.empty(x.shape, dtype=torch.float32, device=x.device)}
    if with_grads:
        out["dx"] = torch.empty_like(out["y"])
        acc = [torch.zeros(p.shape, dtype=torch.float64, device=x.device) for p in inp.params]
    for start in range(0, x.shape[0], step):
        rows = slice(start, start + step)
        params = [p[rows] for p in inp.params] if per_sample else list(inp.params)
        if not with_grads:
            with torch.no_grad():
                out["y"][rows] = fn(x[rows], *params)
            continue
        y, grads = ref.grads(fn, [x[rows], *params], inp.dy[rows])
        out["y"][rows], out["dx"][rows] = y, grads[0]
        for total, grad in zip(acc, grads[1:]):
            if per_sample:
                total[rows] = grad
            else:
                total += grad
    if with_grads:
        out.update({name: total.float() for name, total in zip(names, acc)})
    return out


def rel_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """``||out - expected|| / ||expected||`` accumulated in fp64 chunk by chunk; ``inf`` if
    ``out`` has a NaN/Inf or a different number of elements."""
    if out.numel() != expected.numel():
        return math.inf
    out, expected = out.detach().reshape(-1), expected.reshape(-1)
    num = den = 0.0
    for start in range(0, out.numel(), CHUNK_ELEMENTS):
        o = out[start:start + CHUNK_ELEMENTS].double()
        e = expected[start:start + CHUNK_ELEMENTS].double()
        if not bool(torch.isfinite(o).all()):
            return math.inf
        num += float((o - e).square().sum())
        den += float(e.square().sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-300)


def errors(outputs, names, expected: dict) -> dict[str, float]:
    """Relative error of each output that the provider computes (``None`` ones are skipped)."""
    return {name: rel_error(o, expected[name]) for name, o in zip(names, outputs) if o is not None}


def bounds(torch_errors: dict[str, float], dtype: torch.dtype) -> dict[str, float]:
    """Per-quantity bound from eager PyTorch's own errors (see the module docstring)."""
    return {name: ref.error_bound(err, dtype) for name, err in torch_errors.items()}


def verdict(errs: dict[str, float], limits: dict[str, float]) -> tuple[str, float, float]:
    """``(status, worst error, its bound)``; status is ``"ok"`` or ``"wrong: <details>"``.
    ``limits`` must name every quantity in ``errs``."""
    if not errs:
        return "wrong: no output to check", math.inf, 0.0
    worst = max(errs, key=lambda k: errs[k] / limits[k])
    bad = [f"{k} {errs[k]:.1e} > {limits[k]:.1e}" for k in errs if not errs[k] <= limits[k]]
    return ("wrong: " + ", ".join(bad) if bad else "ok"), errs[worst], limits[worst]
