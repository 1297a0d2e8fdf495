"""Every op forward and backward in every dtype against the fp64 reference: the cases behind
``cudnorm check`` (:mod:`cudnorm.cli.check` prints them; not the argument checks of
:mod:`cudnorm._checks`).

:func:`check` runs on this machine's device (the GPU if there is one, else the CPU
fallback) and compares output and gradients with the fp64 reference under the
2x-PyTorch-error rule. Its shapes are small, which the default kernel policy hands to
PyTorch's ops: the check sends them to cuDNN, the kernels it is there to check.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from . import _ada_rms, _gated, _info, _settings
from . import reference as ref
from ._progress import progress

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cases(device: str):
    """``(label, dtype, candidate, baseline, reference, inputs, names)`` for every op."""
    import cudnorm  # noqa: PLC0415 - the package is fully imported by now

    shape, n = (4, 250, 1024), 1024
    for dtype in DTYPES:
        for wdtype in dict.fromkeys((torch.float32, dtype)):
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(shape, generator=g).to(device, dtype)
            w = (1 + 0.1 * torch.randn(n, generator=g)).to(device, wdtype)
            b = (0.1 * torch.randn(n, generator=g)).to(device, wdtype)
            tag = f"{str(dtype)[6:]} x, {str(wdtype)[6:]} w"
            yield (f"layer_norm ({tag})", dtype,
                   lambda x, w, b: cudnorm.layer_norm(x, (n,), w, b, 1e-5),
                   lambda x, w, b: F.layer_norm(x, (n,), w.to(x.dtype), b.to(x.dtype), 1e-5),
                   lambda x, w, b: ref.layer_norm(x, w, b, 1e-5), (x, w, b), ("y", "dx", "dweight", "dbias"))
            yield (f"rms_norm ({tag})", dtype,
                   lambda x, w: cudnorm.rms_norm(x, (n,), w, 1e-6),
                   lambda x, w: F.rms_norm(x, (n,), w.to(x.dtype), 1e-6),
                   lambda x, w: ref.rms_norm(x, w, 1e-6), (x, w), ("y", "dx", "dweight"))
    yield from _ada_cases(device)
    yield from _ada_rms_cases(device)
    yield from _gated_cases(device)


def _ada_cases(device: str, dtypes=DTYPES):
    """AdaLN: both conventions, fp32 and activation-dtype scale/shift, a DiT-like shape."""
    import cudnorm  # noqa: PLC0415

    b, s, d = 4, 250, 1152
    for dtype in dtypes:
        for wdtype in dict.fromkeys((torch.float32, dtype)):
            for dit in (True, False):
                g = torch.Generator(device="cpu").manual_seed(0)
                x = torch.randn((b, s, d), generator=g).to(device, dtype)
                scale = ((0.0 if dit else 1.0) + 0.1 * torch.randn((b, d), generator=g)).to(device, wdtype)
                shift = (0.1 * torch.randn((b, d), generator=g)).to(device, wdtype)
                tag = f"{str(dtype)[6:]} x, {str(wdtype)[6:]} scale, {'1+scale' if dit else 'scale'}"
                yield (f"ada_layer_norm ({tag})", dtype,
                       lambda x, sc, sh, dit=dit: cudnorm.ada_layer_norm(x, sc, sh, 1e-6, one_plus_scale=dit),
                       lambda x, sc, sh, dit=dit: ref.ada_layer_norm_eager(x, sc, sh, 1e-6, dit),
                       lambda x, sc, sh, dit=dit: ref.ada_layer_norm(x, sc, sh, 1e-6, dit=dit),
                       (x, scale, shift), ("y", "dx", "dscale", "dshift"))


def _ada_rms_cases(device: str, dtypes=DTYPES):
    """Adaptive RMSNorm: the cases of :func:`_ada_cases` with the RMSNorm counterpart."""
    import cudnorm  # noqa: PLC0415

    for label, dtype, _, _, _, inputs, names in _ada_cases(device, dtypes):
        dit = "1+scale" in label
        yield (label.replace("ada_layer_norm", "ada_rms_norm"), dtype,
               lambda x, sc, sh, dit=dit: cudnorm.ada_rms_norm(x, sc, sh, 1e-6, one_plus_scale=dit),
               lambda x, sc, sh, dit=dit: ref.ada_rms_norm_eager(x, sc, sh, 1e-6, dit),
               lambda x, sc, sh, dit=dit: ref.ada_rms_norm(x, sc, sh, 1e-6, dit=dit), inputs, names)


def _gated_cases(device: str, dtypes=DTYPES):
    """The gated residual into AdaLN (its modulation in the activations' dtype, as the op
    requires), both conventions: compared through ``y + h``, so that the output and one
    gradient per input check both of the op's outputs and the gradient each carries."""
    import cudnorm  # noqa: PLC0415

    b, s, d = 4, 250, 1152
    for dtype in dtypes:
        for dit in (True, False):
            g = torch.Generator(device="cpu").manual_seed(0)
            residual, branch = (torch.randn((b, s, d), generator=g).to(device, dtype) for _ in range(2))
            gate = (0.3 * torch.randn((b, d), generator=g)).to(device, dtype)
            scale = ((0.0 if dit else 1.0) + 0.1 * torch.randn((b, d), generator=g)).to(device, dtype)
            shift = (0.1 * torch.randn((b, d), generator=g)).to(device, dtype)
            yield (f"gated_ada_layer_norm ({str(dtype)[6:]}, {'1+scale' if dit else 'scale'}; y + h)", dtype,
                   lambda *t, dit=dit: sum(cudnorm.gated_ada_layer_norm(*t, 1e-6, one_plus_scale=dit)),
                   lambda *t, dit=dit: sum(_gated.formula(*t, 1e-6, dit)),
                   lambda *t, dit=dit: sum(ref.gated_ada_layer_norm(*t, 1e-6, dit=dit)),
                   (residual, branch, gate, scale, shift), ("y+h", "dresidual", "dbranch", "dgate", "dscale", "dshift"))


def _path(op: str, inputs) -> str:
    """What serves ``op`` in the check (policy "cudnn": cuDNN where it can run, else cudnorm's
    kernels; the per-sample RMSNorm and the gated residual have no cuDNN graph)."""
    import cudnorm  # noqa: PLC0415

    if op in _info.OPS:
        return cudnorm.serving_path(op, inputs[0])
    x, *rest = inputs
    if not x.is_cuda:
        return "torch (cpu tensor)"
    if op == "ada_rms_norm":
        scale, shift = rest
        fits = _ada_rms.supports(x.shape[-1], x.dtype, scale.dtype, shift.dtype)
    else:  # gated_ada_layer_norm: residual, branch, gate, scale, shift
        fits = _gated.supports(x, *rest[1:])
    return "kernel" if fits else "torch (no Triton)"


def check(device: str | None = None) -> list[dict]:
    """Run every case; returns one row per compared quantity (see ``reference.accuracy_report``)."""
    import cudnorm  # noqa: PLC0415

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cases = list(_cases(device))
    rows = []
    with _settings.config(policy="cudnn"):
        for label, dtype, candidate, baseline, reference, inputs, names in progress(cases, len(cases), "checking"):
            g = torch.Generator(device="cpu").manual_seed(1)
            dy = torch.randn(inputs[0].shape, generator=g).to(device, dtype)
            start = time.perf_counter()
            op = label.split(" ")[0]
            path = _path(op, inputs)
            for r in ref.accuracy_report(candidate, baseline, reference, inputs, dy, names, dtype):
                rows.append({"case": label, "path": path, **r, "seconds": time.perf_counter() - start})
    return rows
