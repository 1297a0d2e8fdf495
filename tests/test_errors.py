"""One error contract: a mistake raises the same cudnorm error, of one type and naming the op
(or module) and the argument, whatever serves the call: every input dtype, parameters in the
input's dtype or fp32, the CPU and meta devices, the emulated cuDNN path, and both policies
(``"auto"`` hands small calls, the CPU and float64 to PyTorch's own ops, ``"cudnn"`` sends
what it can to cudnorm's path). Before this contract, ``cudnorm.LayerNorm(4096)`` on an fp32
input of width 1024 raised PyTorch's ``RuntimeError`` and on a bf16 input cudnorm's
``ValueError``."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

import cudnorm
import emulated_cudnn

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# (device, emulated cuDNN path) x policy: every way a call is served on a machine without a GPU
PATHS = [(device, emulated, policy) for (device, emulated), policy in
         itertools.product((("cpu", False), ("meta", False), ("cpu", True)), ("auto", "cudnn"))]
D = 64  # the input's width


def _other(device: str) -> str:
    return "meta" if device == "cpu" else "cpu"


# name -> (call(x, param_dtype), exception type, the message's start). ``x``: [2, 3, D] on the
# path's device in the case's dtype; ``param_dtype``: the dtype of the parameters made here.
MISTAKES = {
    "LayerNorm module, input of another width": (
        lambda x, p: cudnorm.LayerNorm(D + 8).to(x.device, p)(x),
        ValueError, "cudnorm.layer_norm: argument 'normalized_shape'"),
    "RMSNorm module, input of another width": (
        lambda x, p: cudnorm.RMSNorm(D + 8).to(x.device, p)(x),
        ValueError, "cudnorm.rms_norm: argument 'normalized_shape'"),
    "RMSNorm module, negative eps": (
        lambda x, p: cudnorm.RMSNorm(D, eps=-1.0).to(x.device, p)(x),
        ValueError, "cudnorm.rms_norm: argument 'eps'"),
    "LayerNorm module, integer input": (
        lambda x, p: cudnorm.LayerNorm(D).to(x.device, p)(x.to(torch.int64)),
        TypeError, "cudnorm.layer_norm: argument 'input'"),
    "LayerNorm module, weight on another device": (
        lambda x, p: cudnorm.LayerNorm(D).to(_other(x.device.type), p)(x),
        ValueError, "cudnorm.layer_norm: argument 'weight'"),
    "FusedAddLayerNorm, residual of another shape": (
        lambda x, p: cudnorm.FusedAddLayerNorm(D).to(x.device, p)(x, x[:1]),
        ValueError, "cudnorm.layer_norm: argument 'residual'"),
    "layer_norm, normalized_shape of another width": (
        lambda x, p: cudnorm.layer_norm(x, (D + 8,)),
        ValueError, "cudnorm.layer_norm: argument 'normalized_shape'"),
    "layer_norm, weight of another shape": (
        lambda x, p: cudnorm.layer_norm(x, (D,), torch.ones(D // 2, device=x.device, dtype=p)),
        ValueError, "cudnorm.layer_norm: argument 'weight'"),
    "layer_norm, integer weight": (
        lambda x, p: cudnorm.layer_norm(x, (D,), torch.ones(D, device=x.device, dtype=torch.int32)),
        TypeError, "cudnorm.layer_norm: argument 'weight'"),
    "layer_norm, eps a string": (
        lambda x, p: cudnorm.layer_norm(x, (D,), None, None, "1e-5"),
        TypeError, "cudnorm.layer_norm: argument 'eps'"),
    "layer_norm, residual of another dtype": (
        lambda x, p: cudnorm.layer_norm(x, (D,), residual=x.to(torch.float64 if x.dtype != torch.float64
                                                                else torch.float32)),
        TypeError, "cudnorm.layer_norm: argument 'residual'"),
    "rms_norm, weight of another shape": (
        lambda x, p: cudnorm.rms_norm(x, (D,), torch.ones(D // 2, device=x.device, dtype=p)),
        ValueError, "cudnorm.rms_norm: argument 'weight'"),
    "rms_norm, weight_offset nan": (
        lambda x, p: cudnorm.rms_norm(x, (D,), torch.ones(D, device=x.device, dtype=p), weight_offset=float("nan")),
        ValueError, "cudnorm.rms_norm: argument 'weight_offset'"),
    "rms_norm, weight_offset a tensor": (
        lambda x, p: cudnorm.rms_norm(x, (D,), torch.ones(D, device=x.device, dtype=p), weight_offset=torch.zeros(3)),
        TypeError, "cudnorm.rms_norm: argument 'weight_offset'"),
    "ada_layer_norm, scale of another batch": (
        lambda x, p: cudnorm.ada_layer_norm(x, torch.ones(3, D, device=x.device, dtype=p),
                                            torch.ones(2, D, device=x.device, dtype=p)),
        ValueError, "cudnorm.ada_layer_norm: argument 'scale'"),
    "ada_layer_norm, one_plus_scale an int": (
        lambda x, p: cudnorm.ada_layer_norm(x, torch.ones(2, D, device=x.device, dtype=p),
                                            torch.ones(2, D, device=x.device, dtype=p), one_plus_scale=1),
        TypeError, "cudnorm.ada_layer_norm: argument 'one_plus_scale'"),
    "AdaLayerNorm module, input of another width": (
        lambda x, p: cudnorm.AdaLayerNorm(D + 8).to(x.device, p)(
            x, torch.ones(2, D + 8, device=x.device, dtype=p), torch.ones(2, D + 8, device=x.device, dtype=p)),
        ValueError, "cudnorm.AdaLayerNorm: argument 'x'"),
    "AdaLayerNormZero, a [B, 1, C] conditioning": (
        lambda x, p: cudnorm.AdaLayerNormZero(D, cond_dim=16).to(x.device, p)(
            x, torch.ones(2, 1, 16, device=x.device, dtype=p)),
        ValueError, "cudnorm.AdaLayerNormZero: argument 'emb'"),
    "AdaLayerNormZero, conditioning of another width": (
        lambda x, p: cudnorm.AdaLayerNormZero(D, cond_dim=16).to(x.device, p)(
            x, torch.ones(2, 8, device=x.device, dtype=p)),
        ValueError, "cudnorm.AdaLayerNormZero: argument 'emb'"),
    "AdaLayerNormContinuous, input of another width": (
        lambda x, p: cudnorm.AdaLayerNormContinuous(D + 8, cond_dim=16, elementwise_affine=True).to(x.device, p)(
            x, torch.ones(2, 16, device=x.device, dtype=p)),
        ValueError, "cudnorm.AdaLayerNormContinuous: argument 'x'"),
}


@contextlib.contextmanager
def _served(emulated: bool, policy: str):
    saved = emulated_cudnn.install() if emulated else None
    try:
        with cudnorm.config(policy=policy):
            yield
    finally:
        if saved is not None:
            emulated_cudnn.uninstall(saved)


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_mistake_raises_one_error_whatever_serves_the_call(mistake):
    call, error, start = MISTAKES[mistake]
    outcomes = {}
    for (device, emulated, policy), dtype in itertools.product(PATHS, DTYPES):
        x = torch.randn(2, 3, D, dtype=dtype).to(device)
        # fp32 parameters on a float64 input are a mistake of their own (PyTorch refuses them too)
        for param_dtype in dict.fromkeys((dtype, torch.float32 if dtype != torch.float64 else dtype)):
            with _served(emulated, policy):
                try:
                    call(x, param_dtype)
                except Exception as exc:  # noqa: BLE001 - the type is what is compared
                    got = (type(exc).__name__, str(exc)[:len(start)])
                else:
                    got = ("no error", "")
            where = f"{device}{' emulated cuDNN' if emulated else ''}, policy {policy}, {dtype}, params {param_dtype}"
            outcomes.setdefault(got, []).append(where)
    assert list(outcomes) == [(error.__name__, start)], {k: v[:3] for k, v in outcomes.items()}


@pytest.mark.parametrize("build, keyword, diffusers_class", [
    (lambda: cudnorm.AdaLayerNormZero(1152, 1000), "cond_dim=", "cudnorm.diffusers.AdaLayerNormZero"),
    (lambda: cudnorm.AdaLayerNormContinuous(64, 32, False, 1e-6), "cond_dim=", "cudnorm.diffusers.AdaLayerNormContinuous"),
    (lambda: cudnorm.AdaLayerNorm(64, 10), "eps=", "cudnorm.diffusers.AdaLayerNorm"),
])
def test_ada_modules_point_a_diffusers_style_call_to_the_keyword_and_class(build, keyword, diffusers_class):
    """A positional call written for diffusers' class of the same name names cudnorm's
    keywords and the diffusers-compatible class."""
    with pytest.raises(TypeError) as info:
        build()
    assert keyword in str(info.value) and str(info.value).endswith(f"is {diffusers_class}"), str(info.value)


# the functions' mistakes (the modules' build their module inside the compiled region, where
# Dynamo refuses nn.Parameter's constructor under fullgraph; a compiled module's forward still
# meets PyTorch's op first: Dynamo's TorchRuntimeError)
_COMPILED = [(m, fullgraph) for m in MISTAKES if m[0].islower() for fullgraph in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("mistake, fullgraph", _COMPILED,
                         ids=[f"{m}-{'fullgraph' if f else 'graph-breaks'}" for m, f in _COMPILED])
def test_a_compiled_mistake_raises_the_eager_error(mistake, fullgraph):
    """Under ``torch.compile`` the same mistake raises the same error: cudnorm's checks run in
    the traced code before PyTorch's ops meet the arguments (before, Dynamo's fake tensors met
    them first: ``TorchRuntimeError`` wrapping PyTorch's message), and a mistake is raised when
    the compiled code runs (under ``fullgraph=True`` Dynamo reports an exception raised while
    tracing as its own ``Unsupported``)."""
    call, error, start = MISTAKES[mistake]
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: call(x, torch.float32), backend="aot_eager", fullgraph=fullgraph)
    with cudnorm.config(policy="auto"), pytest.raises(error) as raised:
        compiled(torch.randn(2, 3, D))
    assert str(raised.value).startswith(start), str(raised.value)
