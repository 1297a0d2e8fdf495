"""The implementations compared, one small setup function per provider and op.

A setup takes the case's :class:`Inputs` and returns ``(fn, outputs)``: ``fn`` is the zero-arg
callable that gets timed, ``outputs`` the tensors it produces, in the order of
:func:`quantities` (``None`` where a provider does not compute one). The runner checks
``outputs`` against the fp64 reference before it times ``fn``.

Forward ops are the *training* forward (inputs require grad, statistics are saved). Backward
ops time ``torch.autograd.grad`` of a precomputed output with ``retain_graph=True``, as the
PyTorch genai_layers benchmark does, except where a peer is called on its backward kernel
directly (Liger LayerNorm, Quack), again as that benchmark does.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# family -> (cudnorm's op name, parameter names, number of fp32 statistics per row)
FAMILIES = {
    "ln": ("layer_norm", ("weight", "bias"), 2),
    "rms": ("rms_norm", ("weight",), 1),
    "ada": ("ada_layer_norm", ("scale", "shift"), 2),
}
OPS = ("ln_fwd", "ln_bwd", "rms_fwd", "rms_bwd", "ada_fwd", "ada_bwd")


@dataclass
class Inputs:
    """One benchmark case. ``x``/``dy``: ``[M, N]`` (ln, rms) or ``[B, S, D]`` (ada);
    ``params``: ln ``(weight, bias)`` fp32 ``[N]``, rms ``(weight,)`` fp32 ``[N]``, ada
    ``(scale, shift)`` in x's dtype ``[B, D]``."""

    family: str
    x: torch.Tensor
    params: tuple[torch.Tensor, ...]
    dy: torch.Tensor
    eps: float = 1e-6

    @property
    def cols(self) -> int:
        return self.x.shape[-1]


def make_inputs(family: str, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Inputs:
    """Random inputs like the seed benchmark's: randn activations, randn weights."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    dy = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    if family == "ada":
        param_shape, param_dtype = (shape[0], shape[-1]), dtype
    else:
        param_shape, param_dtype = (shape[-1],), torch.float32
    params = tuple(torch.randn(param_shape, generator=gen, device=device, dtype=param_dtype)
                   for _ in FAMILIES[family][1])
    return Inputs(family, x, params, dy)


def quantities(op: str) -> tuple[str, ...]:
    """What op ``op`` produces and the check compares: ``("y",)`` or ``("dx", "d<param>"...)``."""
    family, phase = op.split("_")
    if phase == "fwd":
        return ("y",)
    return ("dx",) + tuple("d" + name for name in FAMILIES[family][1])


def traffic_bytes(op: str, inp: Inputs) -> int:
    """Bytes an ideal kernel moves: each input read once, each output written once.

    fwd: read x and the parameters, write y and the statistics; bwd: read x, dy, the scale
    and the statistics, write dx and every parameter gradient. The same count serves every
    provider, so GB/s ratios are speed ratios.
    """
    family, phase = op.split("_")
    act = inp.x.numel() * inp.x.element_size()
    params = sum(p.numel() * p.element_size() for p in inp.params)
    stats = FAMILIES[family][2] * (inp.x.numel() // inp.cols) * 4
    if phase == "fwd":
        return 2 * act + params + stats
    scale = inp.params[0].numel() * inp.params[0].element_size()
    return 3 * act + scale + params + stats


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().requires_grad_(True) for t in tensors]


def _autograd(forward: Callable, leaves: list[torch.Tensor], phase: str, dy: torch.Tensor):
    """``(fn, outputs)`` for a provider whose forward records an autograd graph."""
    if phase == "fwd":
        return (lambda: forward(*leaves)), (forward(*leaves),)
    y = forward(*leaves)

    def backward():
        return torch.autograd.grad(y, leaves, dy, retain_graph=True)

    return backward, backward()


def _dit_formula(x, scale, shift, eps):
    """DiT's ``modulate(norm(x), shift, scale)`` in eager PyTorch."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale[:, None]) + shift[:, None]


def _stats(inp: Inputs):
    """fp32 ``(mean, LayerNorm rstd, RMSNorm rstd)`` per row, for peers whose backward is
    called directly. Computed in row chunks: an fp32 copy of a 2^31-element x is 8 GiB."""
    parts = []
    for xf in inp.x.reshape(-1, inp.cols).split(max(1, (1 << 25) // inp.cols)):
        xf = xf.float()
        var, mean = torch.var_mean(xf, dim=-1, correction=0)
        parts.append((mean, torch.rsqrt(var + inp.eps), torch.rsqrt(xf.square().mean(-1) + inp.eps)))
    return tuple(torch.cat(column) for column in zip(*parts))


def cudnorm_setup(op: str, inp: Inputs):
    import cudnorm  # noqa: PLC0415 - the package imports this module lazily

    n, eps = inp.cols, inp.eps
    forward = {
        "ln": lambda x, w, b: cudnorm.layer_norm(x, (n,), w, b, eps),
        "rms": lambda x, w: cudnorm.rms_norm(x, (n,), w, eps),
        "ada": lambda x, s, t: cudnorm.ada_layer_norm(x, s, t, eps=eps, one_plus_scale=True),
    }[inp.family]
    return _autograd(forward, _leaves(inp.x, *inp.params), op.split("_")[1], inp.dy)


def torch_setup(op: str, inp: Inputs):
    """Eager PyTorch with parameters in the activation dtype (as in the anchors' table)."""
    n, eps, dtype = inp.cols, inp.eps, inp.x.dtype
    forward = {
        "ln": lambda x, w, b: F.layer_norm(x, (n,), w, b, eps),
        "rms": lambda x, w: F.rms_norm(x, (n,), w, eps),
        "ada": lambda x, s, t: _dit_formula(x, s, t, eps),
    }[inp.family]
    return _autograd(forward, _leaves(inp.x, *(p.to(dtype) for p in inp.params)), op.split("_")[1], inp.dy)


_compiled: dict = {}


def compile_setup(op: str, inp: Inputs):
    """``torch.compile(fullgraph=True)`` of the fp32-upcast reference (the seed's "compiled"),
    or of the DiT formula for AdaLN. One compilation per shape, shared by fwd and bwd; the
    dynamo cache is reset between shapes so the recompile limit never sends it to eager."""
    n, eps = inp.cols, inp.eps

    def ln(x, w, b):
        return F.layer_norm(x.float(), (n,), w, b, eps).to(x.dtype)

    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w).to(x.dtype)

    def ada(x, s, t):
        return _dit_formula(x, s, t, eps)

    key = (inp.family, tuple(inp.x.shape), inp.x.dtype, inp.x.device)
    if key not in _compiled:
        _compiled.clear()
        torch._dynamo.reset()
        fn = {"ln": ln, "rms": rms, "ada": ada}[inp.family]
        _compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False)
    return _autograd(_compiled[key], _leaves(inp.x, *inp.params), op.split("_")[1], inp.dy)


def liger_setup(op: str, inp: Inputs):
    """Liger-Kernel: LayerNorm kernels called directly (fp32 stats, as the seed does);
    RMSNorm through ``LigerRMSNorm`` (casting_mode="gemma" as the seed). Its backward may
    write dx into dy in place: ``in_place=False`` where the version has it, else its own dy."""
    phase = op.split("_")[1]
    if inp.family == "rms":
        from liger_kernel.transformers.rms_norm import LigerRMSNorm  # noqa: PLC0415

        has_option = "in_place" in inspect.signature(LigerRMSNorm).parameters
        extra = {"in_place": False} if has_option else {}
        module = LigerRMSNorm(hidden_size=inp.cols, eps=inp.eps, casting_mode="gemma", **extra)
        module = module.to(inp.x.device)
        module.weight.data.copy_(inp.params[0])
        x = inp.x.detach().requires_grad_(True)
        if phase == "fwd":
            return (lambda: module(x)), (module(x),)
        y = module(x)
        dy = inp.dy if has_option else inp.dy.clone()

        def backward():
            return torch.autograd.grad(y, [x, module.weight], dy, retain_graph=True)

        return backward, backward()
    from liger_kernel.ops.layer_norm import layer_norm_backward, layer_norm_forward  # noqa: PLC0415

    x, (w, b) = inp.x, inp.params
    if phase == "fwd":
        def forward():
            return layer_norm_forward(x, w, b, inp.eps)

        return forward, (forward()[0],)
    mean, rstd, _ = _stats(inp)

    def backward():
        return layer_norm_backward(inp.dy, x, w, b, mean, rstd)

    return backward, tuple(backward()[:3])


def quack_setup(op: str, inp: Inputs):
    """quack-kernels (CuTe DSL) forward/backward functions of ``quack.rmsnorm``."""
    q = importlib.import_module("quack.rmsnorm")
    x, w, eps = inp.x, inp.params[0], inp.eps
    b = inp.params[1] if inp.family == "ln" else None
    mean, ln_rstd, rms_rstd = _stats(inp)
    if op == "ln_fwd":
        def fn():
            return q.layernorm_fwd(x, w, b, eps=eps, return_rstd=True, return_mean=True)
    elif op == "rms_fwd":
        def fn():
            return q.rmsnorm_fwd(x, w, eps=eps, store_rstd=True)
    elif op == "ln_bwd":
        extra = {"has_bias": True} if "has_bias" in inspect.signature(q.layernorm_bwd).parameters else {}

        def fn():
            return q.layernorm_bwd(x, w, inp.dy, ln_rstd, mean, **extra)
    else:
        def fn():
            return q.rmsnorm_bwd(x, w, inp.dy, rms_rstd)
    result = fn()
    result = result if isinstance(result, tuple) else (result,)
    wanted = len(quantities(op))
    outputs = tuple(result[i] if i < len(result) and isinstance(result[i], torch.Tensor) else None
                    for i in range(wanted))
    return fn, outputs


def cudnn_ops_setup(op: str, inp: Inputs):
    """cuDNN-frontend's own ``cudnn.ops.norm`` (training-phase graphs with autograd). Its
    rms_norm wants the weight in the activation dtype; its layer_norm takes fp32."""
    ops = importlib.import_module("cudnn.ops.norm")
    n, eps = inp.cols, inp.eps
    if inp.family == "ln":
        return _autograd(lambda x, w, b: ops.layer_norm(x, (n,), w, b, eps), _leaves(inp.x, *inp.params),
                         op.split("_")[1], inp.dy)
    return _autograd(lambda x, w: ops.rms_norm(x, w, eps=eps), _leaves(inp.x, inp.params[0].to(inp.x.dtype)),
                     op.split("_")[1], inp.dy)


@dataclass
class Provider:
    """A compared implementation: its setup, which ops it has, and what it needs."""

    name: str
    setup: Callable  # setup(op, inputs) -> (fn, outputs)
    ops: tuple[str, ...]
    module: str | None = None  # must import for the provider to be available
    cuda_only: bool = False
    explicit_on_cpu: bool = False  # on a CPU-only machine, run only when named in --providers
    explicit: bool = False  # run only when named in --providers

    def unavailable(self, device: str, requested: bool) -> str | None:
        """Why this provider cannot run here, or ``None``."""
        if self.explicit and not requested:
            return "runs when named in --providers"
        if device == "cpu" and self.cuda_only:
            return "needs CUDA"
        if device == "cpu" and self.explicit_on_cpu and not requested:
            return "skipped on CPU (inductor C++ builds take minutes); name it in --providers to run it"
        if self.module is not None:
            try:
                importlib.import_module(self.module)
            except Exception as exc:  # an optional peer that is absent or broken is skipped
                return f"not importable ({type(exc).__name__}: {str(exc)[:80]})"
        return None


_LN_RMS = ("ln_fwd", "ln_bwd", "rms_fwd", "rms_bwd")
REGISTRY: dict[str, Provider] = {p.name: p for p in (
    Provider("cudnorm", cudnorm_setup, OPS),
    Provider("torch", torch_setup, OPS),
    # the A/A control: PyTorch timed a second time; its ratio to torch is the run's noise
    Provider("torch-again", torch_setup, OPS, explicit=True),
    Provider("compile", compile_setup, OPS, explicit_on_cpu=True),
    Provider("liger", liger_setup, _LN_RMS, module="liger_kernel", cuda_only=True),
    Provider("quack", quack_setup, _LN_RMS, module="quack.rmsnorm", cuda_only=True),
    Provider("cudnn_ops", cudnn_ops_setup, _LN_RMS, module="cudnn.ops.norm", cuda_only=True),
)}
