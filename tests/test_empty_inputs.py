"""Empty inputs (a zero-sized batch or sequence) pass through every op and module and give
empty outputs and zero parameter gradients, as ``torch.nn`` does, under both policies, on the
CPU, on the cuDNN path's code with emulated graphs (``emulated``: no graph may be built or
launched for them) and on a GPU (``gpu``). Each call is compared with PyTorch's own function
or module on the same tensors: output shapes and dtypes, every gradient's shape, dtype and
values (zeros for the parameters, empty for the input)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import cudnorm
import cudnorm.diffusers as cd

import emulated_cudnn as emu

D = 16
DEVICES = ["cpu", "emulated", pytest.param("cuda", marks=pytest.mark.gpu)]
POLICIES = ["auto", "cudnn"]
# (input dtype, parameter dtype): one dtype, and fp32 master weights on bf16 activations
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
SHAPES = [(0, 5, D), (3, 0, D), (0, D), (0, 2, 3, D)]  # no batch, no sequence, 2-D, 4-D


@contextlib.contextmanager
def _on(device: str):
    """The torch device of a ``DEVICES`` entry; ``"emulated"`` routes CPU tensors to the
    cuDNN path's code and checks that no graph was launched for the empty calls."""
    if device != "emulated":
        yield device
        return
    saved = emu.install()
    try:
        yield "cpu"
        assert sum(emu.launches.values()) == 0, emu.launches
    finally:
        emu.uninstall(saved)
        cudnorm.clear_cache()


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _outputs_and_grads(fn, tensors):
    """``fn(*tensors)``'s outputs (a tuple) and the gradients of ``tensors`` for the sum of
    the outputs (every gradient is materialised: zeros where an output does not reach it)."""
    leaves = [_leaf(t) for t in tensors]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    total = sum(o.float().sum() for o in out)
    grads = torch.autograd.grad(total, leaves, allow_unused=True, materialize_grads=True)
    return out, grads


def _assert_same(got, want):
    (got_out, got_grads), (want_out, want_grads) = got, want
    assert [(o.shape, o.dtype) for o in got_out] == [(o.shape, o.dtype) for o in want_out]
    assert all(o.numel() == 0 for o in got_out[:1])
    for g, w in zip(got_grads, want_grads):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        assert torch.equal(g, w)  # zeros for the parameters, empty for the input


def _ada_reference(x, scale, shift, eps, one_plus_scale):
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    gain = scale.float().reshape(view) + (1 if one_plus_scale else 0)
    return (F.layer_norm(x.float(), (x.shape[-1],), eps=eps) * gain + shift.float().reshape(view)).to(x.dtype)


# op -> (cudnorm's call, PyTorch's, parameters) on (x, *params)
OPS = {
    "layer_norm": (lambda x, w, b: cudnorm.layer_norm(x, D, w, b), lambda x, w, b: F.layer_norm(x, (D,), w, b), 2),
    "rms_norm": (lambda x, w: cudnorm.rms_norm(x, D, w, 1e-6), lambda x, w: F.rms_norm(x, (D,), w, 1e-6), 1),
    "rms_norm_offset": (lambda x, w: cudnorm.rms_norm(x, D, w, 1e-6, weight_offset=1.0),
                        lambda x, w: (F.rms_norm(x.float(), (D,), None, 1e-6) * (1 + w.float())).to(x.dtype), 1),
    "layer_norm_residual": (lambda x, w, b: cudnorm.layer_norm(x, D, w, b, residual=x.detach() * 2),
                            lambda x, w, b: (F.layer_norm(x + x.detach() * 2, (D,), w, b), x + x.detach() * 2), 2),
    "rms_norm_residual": (lambda x, w: cudnorm.rms_norm(x, D, w, 1e-6, residual=x.detach() * 2),
                          lambda x, w: (F.rms_norm(x + x.detach() * 2, (D,), w, 1e-6), x + x.detach() * 2), 1),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("op", OPS)
def test_norm_ops(op, dtypes, policy, device):
    ours, theirs, count = OPS[op]
    x_dtype, p_dtype = dtypes
    with _on(device) as device, cudnorm.config(policy=policy):
        for shape in SHAPES:
            tensors = [torch.randn(shape, dtype=x_dtype, device=device)]
            tensors += [torch.randn(D, dtype=p_dtype, device=device) for _ in range(count)]
            _assert_same(_outputs_and_grads(ours, tensors), _outputs_and_grads(theirs, tensors))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("one_plus_scale", [True, False])
def test_ada_layer_norm(one_plus_scale, dtypes, policy, device):
    x_dtype, p_dtype = dtypes
    with _on(device) as device, cudnorm.config(policy=policy):
        for shape in SHAPES:
            tensors = [torch.randn(shape, dtype=x_dtype, device=device)]
            tensors += [torch.randn(shape[0], D, dtype=p_dtype, device=device) for _ in range(2)]
            _assert_same(_outputs_and_grads(lambda x, s, t: cudnorm.ada_layer_norm(x, s, t, 1e-6, one_plus_scale),
                                            tensors),
                         _outputs_and_grads(lambda x, s, t: _ada_reference(x, s, t, 1e-6, one_plus_scale), tensors))


def _module_pairs():
    """(name, cudnorm module, PyTorch's computation of the same on the same ``Parameter``
    objects, its call on ``x``)."""
    layer, rms = cudnorm.LayerNorm(D), cudnorm.RMSNorm(D, eps=1e-6)
    fused_layer, fused_rms = cudnorm.FusedAddLayerNorm(D), cudnorm.FusedAddRMSNorm(D, eps=1e-6)
    zero = cudnorm.AdaLayerNormZero(D, cond_dim=8)
    for m in (layer, rms, fused_layer, fused_rms, zero):
        for p in m.parameters():
            torch.nn.init.normal_(p)

    def zero_reference(x, emb):
        chunks = zero.linear(F.silu(emb.to(zero.linear.weight.dtype))).chunk(6, dim=1)
        return (_ada_reference(x, chunks[1], chunks[0], 1e-6, True), *chunks[2:])

    def emb(x):
        return torch.ones(x.shape[0], 8, device=x.device)

    return [
        ("LayerNorm", layer, lambda x: F.layer_norm(x, (D,), layer.weight, layer.bias), lambda m, x: m(x)),
        ("RMSNorm", rms, lambda x: F.rms_norm(x, (D,), rms.weight, 1e-6), lambda m, x: m(x)),
        ("FusedAddLayerNorm", fused_layer,
         lambda x, r: (F.layer_norm(x + r, (D,), fused_layer.weight, fused_layer.bias), x + r),
         lambda m, x: m(x, 2 * x.detach())),
        ("FusedAddRMSNorm", fused_rms, lambda x, r: (F.rms_norm(x + r, (D,), fused_rms.weight, 1e-6), x + r),
         lambda m, x: m(x, 2 * x.detach())),
        ("AdaLayerNormZero", zero, zero_reference, lambda m, x: m(x, emb(x))),
    ]


def _module_outputs_and_grads(call, x, params):
    x = _leaf(x)
    out = call(x)
    out = out if isinstance(out, tuple) else (out,)
    grads = torch.autograd.grad(sum(o.float().sum() for o in out), [x, *params], allow_unused=True,
                                materialize_grads=True)
    return out, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
def test_modules(dtypes, policy, device):
    x_dtype, p_dtype = dtypes
    with _on(device) as device, cudnorm.config(policy=policy):
        for name, ours, theirs, call in _module_pairs():
            ours.to(device, p_dtype)
            params = list(ours.parameters())
            for shape in SHAPES[:2]:
                x = torch.randn(shape, dtype=x_dtype, device=device)
                got = _module_outputs_and_grads(lambda x: call(ours, x), x, params)
                want = _module_outputs_and_grads(lambda x: call(theirs, x), x, params)
                assert [(o.shape, o.dtype) for o in got[0]] == [(o.shape, o.dtype) for o in want[0]], name
                assert got[0][0].numel() == 0, name
                for g, w in zip(got[0][1:] + got[1], want[0][1:] + want[1]):
                    assert g.shape == w.shape and g.dtype == w.dtype, name
                    torch.testing.assert_close(g, w, msg=name)


DIFFUSERS_CLASSES = {
    "AdaLayerNormZero": (lambda: (D,), lambda x, emb: (x, None, None, None, emb)),
    "AdaLayerNormZeroSingle": (lambda: (D,), lambda x, emb: (x, emb)),
    "SD35AdaLayerNormZeroX": (lambda: (D,), lambda x, emb: (x, emb)),
    "AdaLayerNormContinuous": (lambda: (D, D, False, 1e-6), lambda x, emb: (x, emb)),
    "AdaLayerNormContinuous-rms": (lambda: (D, D, True, 1e-6, False, "rms_norm"), lambda x, emb: (x, emb)),
    "AdaLayerNorm-chunk1": (lambda: (D, None, None, True, 1e-5, 1), lambda x, emb: (x, None, emb)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", DIFFUSERS_CLASSES)
def test_diffusers_compatible_classes(name, policy, device):
    """cudnorm.diffusers' classes against diffusers' own, with the same parameters: an empty
    batch (``emb`` empty too) and an empty sequence (the gates and shifts are not empty and
    equal diffusers')."""
    normalization = pytest.importorskip("diffusers.models.normalization")
    args, call = DIFFUSERS_CLASSES[name]
    cls = name.split("-")[0]
    theirs = getattr(normalization, cls)(*args()).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours = getattr(cd, cls)(*args())
    ours.load_state_dict(theirs.state_dict())
    with _on(device) as device, cudnorm.config(policy=policy):
        for module in (ours, theirs):
            module.to(device)
        for batch, seq in ((0, 5), (3, 0)):
            x, emb = torch.randn(batch, seq, D, device=device), torch.randn(batch, D, device=device)
            got = _module_outputs_and_grads(lambda x: ours(*call(x, emb)), x, list(ours.parameters()))
            want = _module_outputs_and_grads(lambda x: theirs(*call(x, emb)), x,
                                             [dict(theirs.named_parameters())[n] for n, _ in ours.named_parameters()])
            assert [(o.shape, o.dtype) for o in got[0]] == [(o.shape, o.dtype) for o in want[0]]
            assert got[0][0].numel() == 0
            for g, w in zip(got[0][1:] + got[1], want[0][1:] + want[1]):
                assert g.shape == w.shape and g.dtype == w.dtype
                torch.testing.assert_close(g, w)
