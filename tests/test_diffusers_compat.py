"""``cudnorm.diffusers`` against the real diffusers classes (CPU): the same constructor and
forward signatures; state_dicts that load both ways with ``strict=True``; the same outputs and
gradients (fp32 to 1e-5 relative, bf16 within twice diffusers' own error against an fp64
run); mixed dtypes promoted as diffusers does; ``torch.compile(fullgraph=True)``; argument
errors naming the class and the argument; ``from_diffusers``. Tiny DiT, SD3, Flux and PixArt
models patched by ``cudnorm.patch`` are tested in ``tests/test_patching.py``."""

import inspect

import pytest
import torch

import cudnorm
import cudnorm._diffusers_forwards as forwards
import cudnorm.diffusers as cd
from cudnorm import reference as ref

diffusers = pytest.importorskip("diffusers")
from diffusers.models import normalization as dn  # noqa: E402

import emulated_cudnn as emu  # noqa: E402

B, S, D, C = 2, 5, 32, 24
F32_TOL = 1e-5
CLASSES = ("AdaLayerNorm", "AdaLayerNormContinuous", "AdaLayerNormZero", "AdaLayerNormZeroSingle",
           "SD35AdaLayerNormZeroX")


def _x(dtype):
    return (3 + 2 * torch.randn(B, S, D)).to(dtype)  # an offset and a spread the norm must remove


def _cond(*shape):
    return lambda dtype: torch.randn(*shape).to(dtype)


# id -> (class, constructor args, constructor kwargs, {forward kwarg: maker(dtype)}); the first
# forward argument is x (hidden_states for SD35AdaLayerNormZeroX), passed positionally
CASES = {
    "zero": ("AdaLayerNormZero", (D,), {}, {"emb": _cond(B, D)}),
    "zero-dit": ("AdaLayerNormZero", (D, 10), {},
                 {"timestep": lambda dt: torch.tensor([3.0, 999.0]), "class_labels": lambda dt: torch.tensor([1, 7]),
                  "hidden_dtype": lambda dt: dt}),
    "zero-fp32-ln-no-bias": ("AdaLayerNormZero", (D,), {"norm_type": "fp32_layer_norm", "bias": False},
                             {"emb": _cond(B, D)}),
    "zero-single": ("AdaLayerNormZeroSingle", (D,), {}, {"emb": _cond(B, D)}),
    "sd35-x": ("SD35AdaLayerNormZeroX", (D,), {}, {"emb": _cond(B, D)}),
    "continuous-defaults": ("AdaLayerNormContinuous", (D, C), {}, {"conditioning_embedding": _cond(B, C)}),
    "continuous-models": ("AdaLayerNormContinuous", (D, C, False, 1e-6), {}, {"conditioning_embedding": _cond(B, C)}),
    "continuous-affine-no-bias": ("AdaLayerNormContinuous", (D, C, True, 1e-6, False), {},
                                  {"conditioning_embedding": _cond(B, C)}),
    "continuous-rms": ("AdaLayerNormContinuous", (D, C, True, 1e-6, True, "rms_norm"), {},
                       {"conditioning_embedding": _cond(B, C)}),
    "continuous-rms-plain": ("AdaLayerNormContinuous", (D, C, False, 1e-6, False, "rms_norm"), {},
                             {"conditioning_embedding": _cond(B, C)}),
    "adaln-timestep": ("AdaLayerNorm", (D, 10), {}, {"timestep": lambda dt: torch.tensor(4)}),
    "adaln-shared-affine": ("AdaLayerNorm", (D,), {"norm_elementwise_affine": True}, {"temb": _cond(D)}),
    "adaln-chunk1": ("AdaLayerNorm", (C,), {"output_dim": 2 * D, "norm_eps": 1e-6, "chunk_dim": 1},
                     {"temb": _cond(B, C)}),
    "adaln-chunk1-affine": ("AdaLayerNorm", (C,), {"output_dim": 2 * D, "norm_elementwise_affine": True,
                                                   "chunk_dim": 1}, {"temb": _cond(B, C)}),
}


def _randomize(module):
    """Non-trivial parameters: norm weights around 1, everything else perturbed."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith("norm.") and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.add_(0.2 * torch.randn_like(p))
    return module


def _pair(case):
    """(diffusers' module, cudnorm's with its state_dict loaded strictly, forward inputs maker)."""
    name, args, kwargs, inputs = CASES[case]
    torch.manual_seed(0)
    theirs = _randomize(getattr(dn, name)(*args, **kwargs)).eval()
    mine = getattr(cd, name)(*args, **kwargs).eval()
    mine.load_state_dict(theirs.state_dict(), strict=True)

    def make(dtype):
        torch.manual_seed(1)
        return (_x(dtype),), {k: f(dtype) for k, f in inputs.items()}

    return theirs, mine, make


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _run(module, args, kwargs, grad_outs=None):
    """Outputs, and with ``grad_outs`` the gradients of sum(out * g) w.r.t. the float inputs and
    the parameters (``None`` for a parameter with no gradient)."""
    leaves = [t.detach().clone().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point()
              and grad_outs is not None else t for t in args]
    kw = {k: (v.detach().clone().requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point()
              and v.dim() > 0 and grad_outs is not None else v) for k, v in kwargs.items()}
    outs = _as_tuple(module(*leaves, **kw))
    if grad_outs is None:
        return [o.detach() for o in outs], []
    inputs = [t for t in [*leaves, *kw.values()] if isinstance(t, torch.Tensor) and t.requires_grad]
    params = list(module.parameters())
    loss = sum((o.float() * g).sum() for o, g in zip(outs, grad_outs))
    grads = torch.autograd.grad(loss, inputs + params, allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def _grad_outs(outs):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(o.shape, generator=g) for o in outs]


# ---------------------------------------------------------------- the classes themselves

@pytest.mark.parametrize("name", CLASSES)
def test_signatures_match_diffusers(name):
    for method in ("__init__", "forward"):
        mine = inspect.signature(getattr(getattr(cd, name), method)).parameters.values()
        theirs = inspect.signature(getattr(getattr(dn, name), method)).parameters.values()
        assert [(p.name, p.kind, p.default) for p in mine] == [(p.name, p.kind, p.default) for p in theirs], method


@pytest.mark.parametrize("case", CASES)
def test_state_dicts_load_both_ways_strictly(case):
    theirs, mine, _ = _pair(case)
    assert list(mine.state_dict()) == list(theirs.state_dict())
    fresh = getattr(dn, CASES[case][0])(*CASES[case][1], **CASES[case][2])
    fresh.load_state_dict(mine.state_dict(), strict=True)
    for key, value in theirs.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def _policy(policy: str):
    """``cudnorm.config(policy=...)``; ``"emulated"``: cudnorm's cuDNN path with the graphs
    emulated on the CPU (tests/emulated_cudnn.py)."""
    if policy == "emulated":
        return emu.installed()
    return cudnorm.config(policy=policy)


# cudnorm's own path (PyTorch's kernels on the CPU), the cuDNN path's code, PyTorch's ops (small calls)
@pytest.mark.parametrize("policy", ["cudnn", "emulated", "auto"])
@pytest.mark.parametrize("case", CASES)
def test_fp32_outputs_and_gradients_match(case, policy):
    theirs, mine, make = _pair(case)
    args, kwargs = make(torch.float32)
    want, want_grads = _run(theirs, args, kwargs, _grad_outs(_run(theirs, args, kwargs)[0]))
    with _policy(policy):
        got, got_grads = _run(mine, args, kwargs, _grad_outs(want))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        assert ref.rel_error(g, w) <= F32_TOL, (i, ref.rel_error(g, w))
    names = ["input"] * (len(want_grads) - len(list(theirs.parameters()))) + [n for n, _ in theirs.named_parameters()]
    for name, g, w in zip(names, got_grads, want_grads):
        assert (g is None) == (w is None), name
        if w is not None:
            assert ref.rel_error(g, w) <= F32_TOL, (name, ref.rel_error(g, w))


@pytest.mark.parametrize("policy", ["cudnn", "emulated"])
@pytest.mark.parametrize("case", CASES)
def test_bf16_meets_the_error_rule(case, policy):
    """bf16 modules on bf16 inputs: every output and gradient within twice the error of
    diffusers' own bf16 run, both measured against diffusers in fp64."""
    theirs, mine, make = _pair(case)
    exact = getattr(dn, CASES[case][0])(*CASES[case][1], **CASES[case][2]).eval().to(torch.float64)
    theirs, mine = theirs.to(torch.bfloat16), mine.to(torch.bfloat16)
    # fp64 from the bf16-rounded parameters, so the reference differs only in the arithmetic
    exact.load_state_dict({k: v.double() for k, v in theirs.state_dict().items()})
    args, kwargs = make(torch.bfloat16)
    grad_outs = _grad_outs(_run(theirs, args, kwargs)[0])
    want, want_grads = _run(exact, [a.double() if a.is_floating_point() else a for a in args],
                            {k: (torch.float64 if v is torch.bfloat16 else
                                 v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() else v)
                             for k, v in kwargs.items()}, grad_outs)
    base, base_grads = _run(theirs, args, kwargs, grad_outs)
    with _policy(policy):
        got, got_grads = _run(mine, args, kwargs, grad_outs)
    for i, (g, b, w) in enumerate(zip(got + got_grads, base + base_grads, want + want_grads)):
        if w is None:
            continue
        assert g.dtype == b.dtype, i
        bound = ref.error_bound(ref.rel_error(b, w), torch.bfloat16)
        assert ref.rel_error(g, w) <= bound, (i, ref.rel_error(g, w), bound)


FUSED = {  # case -> cudnorm ops one forward calls (docs/adaln.md's table says why)
    "zero": {"ada_layer_norm": 1}, "zero-dit": {"ada_layer_norm": 1}, "zero-fp32-ln-no-bias": {"ada_layer_norm": 1},
    "zero-single": {"ada_layer_norm": 1}, "sd35-x": {"ada_layer_norm": 2},
    "continuous-defaults": {"ada_layer_norm": 1}, "continuous-models": {"ada_layer_norm": 1},
    "continuous-affine-no-bias": {"ada_layer_norm": 1}, "continuous-rms": {"rms_norm": 1},
    "continuous-rms-plain": {"rms_norm": 1}, "adaln-timestep": {"layer_norm": 1},
    "adaln-shared-affine": {"layer_norm": 1}, "adaln-chunk1": {"ada_layer_norm": 1},
    "adaln-chunk1-affine": {"ada_layer_norm": 1},
}


@pytest.mark.parametrize("case", CASES)
def test_each_class_runs_the_fused_op(case, monkeypatch):
    calls = {}
    for op in ("ada_layer_norm", "layer_norm", "rms_norm"):  # where the classes' arithmetic calls them
        def counted(*args, op=op, fn=getattr(forwards, op), **kwargs):
            calls[op] = calls.get(op, 0) + 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(forwards, op, counted)
    _, mine, make = _pair(case)
    args, kwargs = make(torch.float32)
    mine(*args, **kwargs)
    assert calls == FUSED[case]


@pytest.mark.parametrize("case, module_dtype, x_dtype, autocast", [
    ("zero", torch.float32, torch.bfloat16, False),  # fp32 modulation of bf16 x: fp32 out
    ("zero", torch.bfloat16, torch.float32, False),  # bf16 modulation of fp32 x: fp32 out
    ("adaln-chunk1", torch.bfloat16, torch.float32, False),
    ("adaln-chunk1-affine", torch.float32, torch.bfloat16, False),  # fp32 norm weights too
    # diffusers' AdaLayerNormContinuous casts the conditioning to x's dtype, so its linear
    # meets another dtype only under autocast: bf16 scale/shift for an fp32 x
    ("continuous-defaults", torch.float32, torch.float32, True),
    ("continuous-rms", torch.float32, torch.float32, True),
])
def test_mixed_dtypes_are_promoted_as_diffusers_does(case, module_dtype, x_dtype, autocast):
    theirs, mine, make = _pair(case)
    theirs, mine = theirs.to(module_dtype), mine.to(module_dtype)
    exact = getattr(dn, CASES[case][0])(*CASES[case][1], **CASES[case][2]).eval()
    exact.load_state_dict({k: v.double() for k, v in theirs.state_dict().items()})
    exact.double()
    (x,), kwargs = make(x_dtype)
    kwargs = {k: v.to(module_dtype) for k, v in kwargs.items()}  # diffusers' linear takes its own dtype
    want = _as_tuple(exact(x.double(), **{k: v.double() for k, v in kwargs.items()}))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        base, got = _as_tuple(theirs(x, **kwargs)), _as_tuple(mine(x, **kwargs))
    assert [g.dtype for g in got] == [b.dtype for b in base] and got[0].dtype == torch.float32
    for g, b, w in zip(got, base, want):
        assert ref.rel_error(g, w) <= ref.error_bound(ref.rel_error(b, w), torch.bfloat16)


def test_conditioning_is_cast_to_the_linear_dtype():
    """diffusers' AdaLayerNormZero fails on fp32 conditioning with a bf16 module; this one casts."""
    theirs, mine, make = _pair("zero")
    theirs, mine = theirs.to(torch.bfloat16), mine.to(torch.bfloat16)
    (x,), kwargs = make(torch.bfloat16)
    with pytest.raises(RuntimeError):
        theirs(x, emb=kwargs["emb"].float())
    got = mine(x, emb=kwargs["emb"].float())
    want = theirs(x, emb=kwargs["emb"])
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16 and ref.rel_error(g, w) <= 2e-2  # SiLU before vs after rounding


def test_dit_label_dropout_matches_in_training():
    theirs, mine, make = _pair("zero-dit")
    theirs.train(), mine.train()
    labels, t = torch.arange(8) % 10, torch.linspace(0, 999, 8)
    x = torch.randn(8, S, D)
    torch.manual_seed(5)
    want = theirs(x, t, labels, torch.float32)
    torch.manual_seed(5)
    got = mine(x, t, labels, torch.float32)
    for g, w in zip(got, want):
        assert ref.rel_error(g, w) <= F32_TOL


@pytest.mark.slow  # torch.compile on the CPU
def test_compile_fullgraph_matches_eager():
    theirs, mine, make = _pair("zero-dit")
    (x,), kwargs = make(torch.float32)
    x.requires_grad_(True)
    fn = lambda x: sum(o.square().sum() for o in mine(x, **kwargs))  # noqa: E731
    got = torch.autograd.grad(torch.compile(fn, fullgraph=True)(x), [x, mine.linear.weight])
    want = torch.autograd.grad(fn(x), [x, mine.linear.weight])
    for g, w in zip(got, want):
        assert ref.rel_error(g, w) <= F32_TOL


@pytest.mark.parametrize("build, exc, match", [
    (lambda: cd.AdaLayerNormZero(D, "10"), TypeError, r"diffusers\.AdaLayerNormZero: argument 'num_embeddings'"),
    (lambda: cd.AdaLayerNormZero(D, norm_type="rms_norm"), ValueError, r"AdaLayerNormZero: argument 'norm_type'"),
    (lambda: cd.AdaLayerNormZero(1.5), TypeError, r"AdaLayerNormZero: argument 'embedding_dim' must be an int"),
    (lambda: cd.AdaLayerNormZeroSingle(D, "fp32_layer_norm"), ValueError, r"must be one of 'layer_norm'"),
    (lambda: cd.SD35AdaLayerNormZeroX(D, bias="yes"), TypeError, r"SD35AdaLayerNormZeroX: argument 'bias'"),
    (lambda: cd.AdaLayerNormContinuous(D, C, "no"), TypeError, r"argument 'elementwise_affine' must be a bool"),
    (lambda: cd.AdaLayerNormContinuous(D, C, False, "1e-6"), TypeError, r"AdaLayerNormContinuous: argument 'eps'"),
    (lambda: cd.AdaLayerNormContinuous(D, C, norm_type="group_norm"), ValueError, r"argument 'norm_type'"),
    (lambda: cd.AdaLayerNormContinuous(D, 0), ValueError, r"'conditioning_embedding_dim' must be >= 1"),
    (lambda: cd.AdaLayerNorm(D, output_dim=7), ValueError, r"AdaLayerNorm: argument 'output_dim' must be even"),
    (lambda: cd.AdaLayerNorm(D, chunk_dim=2), ValueError, r"AdaLayerNorm: argument 'chunk_dim' must be 0 or 1"),
    (lambda: cd.AdaLayerNorm(D, norm_eps=-1.0), ValueError, r"AdaLayerNorm: argument 'norm_eps' must be finite and >= 0"),
    (lambda: cd.AdaLayerNormZero(D)(torch.randn(B, S, D)), TypeError,
     r"AdaLayerNormZero: argument 'emb' must be a torch\.Tensor, got NoneType"),
    (lambda: cd.AdaLayerNormZero(D, 10)(torch.randn(B, S, D), None, torch.tensor([1, 2])), TypeError,
     r"argument 'timestep' must be a torch\.Tensor"),
    (lambda: cd.AdaLayerNormZero(D, 10)(torch.randn(B, S, D), torch.tensor(3.0), torch.tensor([1, 2])), ValueError,
     r"argument 'timestep' must be 1-D"),
    (lambda: cd.AdaLayerNormZero(D, 10)(torch.randn(B, S, D), torch.ones(B), torch.tensor([1, 2]), "bf16"),
     TypeError, r"argument 'hidden_dtype' must be a torch\.dtype or None"),
    (lambda: cd.SD35AdaLayerNormZeroX(D)([1.0], torch.randn(B, D)), TypeError,
     r"SD35AdaLayerNormZeroX: argument 'hidden_states' must be a torch\.Tensor"),
    (lambda: cd.AdaLayerNormContinuous(D, C)(torch.randn(B, S, D), None), TypeError,
     r"AdaLayerNormContinuous: argument 'conditioning_embedding'"),
    (lambda: cd.AdaLayerNorm(D)(torch.randn(B, S, D).long(), temb=torch.randn(D)), TypeError,
     r"AdaLayerNorm: argument 'x' has dtype torch\.int64"),
])
def test_argument_errors_name_the_class_and_argument(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


def test_diffusers_argument_conventions_are_accepted():
    """What diffusers' own models pass: ``ada_norm_bias=None`` as ``bias`` (BasicTransformerBlock),
    ``norm_type`` as the sixth positional argument, ``output_dim=None``."""
    norm = cd.AdaLayerNormContinuous(D, C, False, 1e-5, None, "rms_norm")
    assert norm.linear.bias is None and isinstance(norm.norm, torch.nn.RMSNorm)
    assert cd.AdaLayerNorm(D, None, None).linear.out_features == 2 * D


def test_unmatched_broadcast_runs_diffusers_formula():
    """One conditioning row for a batch of two: diffusers broadcasts it; so does this class."""
    theirs, mine, make = _pair("zero")
    (x,), kwargs = make(torch.float32)
    for g, w in zip(mine(x, emb=kwargs["emb"][:1]), theirs(x, emb=kwargs["emb"][:1])):
        assert g.shape == w.shape and ref.rel_error(g, w) <= F32_TOL


# ---------------------------------------------------------------- from_diffusers and cudnorm.patch

def test_from_diffusers_keeps_the_modules_and_parameters():
    for case in CASES:
        theirs, _, make = _pair(case)
        mine = cd.from_diffusers(theirs)
        assert type(mine) is getattr(cd, CASES[case][0]), case
        assert mine.linear is theirs.linear and mine.norm.eps == theirs.norm.eps
        assert getattr(mine, "emb", None) is getattr(theirs, "emb", None)
        assert all(a is b for a, b in zip(mine.state_dict(keep_vars=True).values(),
                                          theirs.state_dict(keep_vars=True).values()))
        args, kwargs = make(torch.float32)
        for g, w in zip(_as_tuple(mine(*args, **kwargs)), _as_tuple(theirs(*args, **kwargs))):
            assert ref.rel_error(g, w) <= F32_TOL, case
    assert cd.from_diffusers(torch.nn.LayerNorm(8)) is None
    assert cd.from_diffusers(cd.AdaLayerNormZero(8)) is None  # already cudnorm's
