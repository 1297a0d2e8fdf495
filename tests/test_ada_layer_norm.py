"""Adaptive LayerNorm: fallback numerics vs the DiT formula, module conventions (chunk order,
zero-init identity, diffusers-style state_dict), argument errors, opcheck, torch.compile;
on a GPU: every backward strategy under the 2x-PyTorch rule, CUDA-graph replays, opcheck."""

import importlib

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _cache, _graphs
from cudnorm import reference as ref

ada = importlib.import_module("cudnorm.ada_layer_norm")  # the package attribute is the function

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAMES = ("y", "dx", "dscale", "dshift")


def _inputs(shape, dtype, wdtype, dit, device="cpu", scale_shape=None):
    b, d = shape[0], shape[-1]
    x = torch.randn(shape).to(device, dtype)
    scale = ((0.0 if dit else 1.0) + 0.1 * torch.randn(b, d)).to(device, wdtype)
    shift = (0.1 * torch.randn(b, d)).to(device, wdtype)
    if scale_shape is not None:
        scale, shift = scale.reshape(scale_shape), shift.reshape(scale_shape)
    return x, scale, shift


def _report(x, scale, shift, dit):
    b, d = x.shape[0], x.shape[-1]
    return ref.accuracy_report(
        lambda x, sc, sh: cudnorm.ada_layer_norm(x, sc, sh, 1e-6, one_plus_scale=dit),
        lambda x, sc, sh: ada._eager_formula(x.reshape(b, -1, d), sc.reshape(b, d), sh.reshape(b, d), 1e-6,
                                             dit).view(x.shape),
        lambda x, sc, sh: ref.ada_layer_norm(x, sc, sh, 1e-6, dit=dit),
        (x, scale, shift), torch.randn_like(x), NAMES, x.dtype)


def _dit_formula(x, scale, shift):
    """DiT's modulate(norm(x), shift, scale), written as DiT writes it (fp32)."""
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


# ---------------------------------------------------------------- CPU: numerics

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", ["fp32", "same"])
@pytest.mark.parametrize("dit", [True, False])
@pytest.mark.parametrize("shape, scale_shape", [((2, 7, 64), None), ((3, 5, 96), "b1d"), ((2, 3, 4, 48), "b11d"),
                                                ((1, 1, 1000), None), ((4, 160), None)])
def test_fallback_matches_reference(dtype, wdtype, dit, shape, scale_shape):
    b, d = shape[0], shape[-1]
    sshape = {None: None, "b1d": (b, 1, d), "b11d": (b, 1, 1, d)}[scale_shape]
    x, scale, shift = _inputs(shape, dtype, torch.float32 if wdtype == "fp32" else dtype, dit, scale_shape=sshape)
    rows = _report(x, scale, shift, dit)
    assert all(r["ok"] for r in rows), rows


def test_matches_dit_formula_and_gradient_shapes_dtypes():
    x = torch.randn(3, 10, 32, requires_grad=True)
    scale = (0.2 * torch.randn(3, 32)).requires_grad_(True)
    shift = torch.randn(3, 1, 32, requires_grad=True)
    y = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
    torch.testing.assert_close(y, _dit_formula(x, scale, shift.squeeze(1)))
    torch.testing.assert_close(cudnorm.ada_layer_norm(x, scale, shift),
                               F.layer_norm(x, (32,), eps=1e-6) * scale[:, None] + shift)
    y.sum().backward()
    assert scale.grad.shape == (3, 32) and shift.grad.shape == (3, 1, 32)
    xb = x.detach().bfloat16().requires_grad_(True)
    s32 = scale.detach().requires_grad_(True)
    cudnorm.ada_layer_norm(xb, s32, shift.detach().bfloat16(), one_plus_scale=True).float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and s32.grad.dtype == torch.float32


def test_no_grad_forward_saves_no_stats():
    x, scale, shift = _inputs((2, 4, 32), torch.float32, torch.float32, True)
    with torch.no_grad():
        _, mean, rstd = torch.ops.cudnorm.ada_layer_norm_fwd(x, scale, shift, 1e-6, True, False)
    assert mean.numel() == 0 and rstd.numel() == 0


def test_choose_backward_and_env_override(monkeypatch):
    for shape in [(4, 1024, 768), (32, 256, 1152), (8, 4096, 1152), (16, 4096, 3072), (2, 4096, 1536), (1, 1, 1000)]:
        assert ada.choose_backward(*shape, torch.bfloat16) in ada.STRATEGIES
    monkeypatch.setenv("CUDNORM_ADA_BWD", "per_sample_graph")
    assert ada._backward_strategy(1, 1, 8, torch.float32) == "per_sample_graph"
    monkeypatch.setenv("CUDNORM_ADA_BWD", "fastest")
    with pytest.raises(ValueError, match="CUDNORM_ADA_BWD"):
        ada._backward_strategy(1, 1, 8, torch.float32)


def test_check_cases_pass_on_cpu():
    cases = list(ada.check_cases("cpu", (torch.float32, torch.bfloat16)))
    assert {c[0].split(" ")[0] for c in cases} == {"ada_layer_norm"}
    for _, dtype, candidate, baseline, reference, inputs, names in cases[:4]:
        rows = ref.accuracy_report(candidate, baseline, reference, inputs, torch.randn_like(inputs[0]), names, dtype)
        assert all(r["ok"] for r in rows), rows


class _FakeLayerNormBackwardPlan:
    """Stands in for a built LayerNorm-backward plan on CPU: checks the cuDNN alignment
    contract of every buffer, then writes ATen's LayerNorm backward into the outputs."""

    def __init__(self, spec):
        self.spec, self.calls = spec, 0

    def run(self, x, gamma, dy, mean, rstd, dx, dgamma, dbeta):
        assert all(t.data_ptr() % 16 == 0 for t in (x, gamma, dy, mean, rstd, dx, dgamma, dbeta))
        self.calls += 1
        d = x.shape[1]
        gx, gg, _ = torch.ops.aten.native_layer_norm_backward(
            dy.float(), x.float(), [d], mean[:, None], rstd[:, None], gamma, None, [True, True, False])
        dx.copy_(gx)
        dgamma.copy_(gg)
        dbeta.copy_(dy.float().sum(0))


@pytest.mark.parametrize("dtype, shape", [(torch.bfloat16, (3, 77, 1000)), (torch.float32, (5, 8, 30)),
                                          (torch.float16, (2, 64, 256))])
@pytest.mark.parametrize("dit", [True, False])
def test_per_sample_backward_plumbing_with_a_fake_plan(dtype, shape, dit, monkeypatch):
    """The per-sample decomposition (slices, padding, gain) on CPU, the plan faked."""
    plans = []

    def fake_get_plan(spec):
        assert spec.op == "layer_norm" and spec.phase == "bwd" and spec.rows == shape[1]
        plans.append(_FakeLayerNormBackwardPlan(spec))
        return plans[-1]

    monkeypatch.setattr(ada._dispatch, "get_plan", fake_get_plan)
    b, s, d = shape
    x, scale, _ = _inputs(shape, dtype, torch.float32, dit)
    dy = torch.randn_like(x)
    xhat, mean, rstd = torch.native_layer_norm(x.float(), [d], None, None, 1e-6)
    mean, rstd = mean.view(b * s), rstd.view(b * s)
    call = ada._BwdCall(dy.reshape(b * s, d), x.reshape(b * s, d), scale, mean, rstd, b, s, dit)
    dx, dscale, dshift = ada._bwd_per_sample(call)
    assert plans[0].calls == b
    want = ada._torch_backward(dy, x, scale, mean, rstd, dit)
    torch.testing.assert_close(dx.view(shape), want[0])
    torch.testing.assert_close(dscale, want[1])
    torch.testing.assert_close(dshift, want[2])


def test_per_sample_backward_declines_misaligned_samples():
    x = torch.randn(2 * 3, 30, dtype=torch.bfloat16)  # a sample is 3 * 30 * 2 = 180 bytes: not 16-aligned
    stats = torch.ones(6)
    call = ada._BwdCall(x, x, torch.ones(2, 30), stats, stats, 2, 3, True)
    assert ada._per_sample_setup(call) is None


class _FakeAdaPlan:
    """Stands in for a built AdaLN plan on CPU: checks every buffer against the graph's
    declared roles/shapes/dtypes, then writes PyTorch's results into the outputs."""

    def __init__(self, spec):
        self.spec = spec

    def run(self, *buffers):
        spec = self.spec
        shapes = _graphs.buffer_shapes(spec)
        t = dict(zip(_graphs.roles(spec), buffers, strict=True))
        for role, (shape, dtype) in shapes.items():
            if role not in ("eps", "one"):
                assert t[role].numel() == torch.Size(shape).numel() and t[role].dtype == dtype, role
                assert t[role].data_ptr() % 16 == 0, role
        b, s, d = spec.batch, spec.seq, spec.cols
        x = t["x"].reshape(b, s, d)
        scale = t["scale"].view(b, d).float() + (t["one"].item() if spec.dit else 0.0)
        if spec.phase == "bwd":
            dx, dscale, dshift = ada._torch_backward(t["dy"].view(b, s, d), x, scale, t["mean"], t["rstd"], False)
            for role, value in (("dx", dx), ("dscale", dscale), ("dbias", dshift)):
                t[role].copy_(value.reshape(t[role].shape))
            return
        y, mean, rstd = ada._torch_forward(x, scale, t["bias"].view(b, d), t["eps"].item(), False, True)
        t["y"].copy_(y)
        if spec.phase == "train":
            t["mean"].copy_(mean)
            t["rstd"].copy_(rstd)


@pytest.mark.parametrize("strategy", ["cudnn", "per_sample"])
@pytest.mark.parametrize("dit_declined", [False, True])
def test_cuda_path_plumbing_with_fake_plans(strategy, dit_declined, monkeypatch):
    """The whole cuDNN-path code of the ops (buffer order, shapes, dtypes, the declined-DiT
    retry) run on CPU with every plan faked."""
    def fake_get_plan(spec):
        if spec.op == "layer_norm":
            return _FakeLayerNormBackwardPlan(spec)
        if spec.dit and dit_declined and spec.phase != "bwd":
            return None
        return _FakeAdaPlan(spec)

    monkeypatch.setattr(ada._dispatch, "route", lambda x: None)
    monkeypatch.setattr(ada._dispatch, "get_plan", fake_get_plan)
    monkeypatch.setenv("CUDNORM_ADA_BWD", strategy)
    x, scale, shift = _inputs((3, 16, 64), torch.bfloat16, torch.float32, True, scale_shape=(3, 1, 64))
    rows = _report(x, scale, shift, True)
    assert all(r["ok"] for r in rows), rows
    with torch.no_grad():  # the inference phase; atol: one bf16 ulp of outputs near 1
        torch.testing.assert_close(cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True),
                                   ref.ada_layer_norm(x, scale.bfloat16(), shift.bfloat16()).bfloat16(), atol=8e-3,
                                   rtol=1.6e-2)


# ---------------------------------------------------------------- CPU: errors

@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(scale=torch.randn(3, 16)), ValueError, "argument 'scale' has shape \\(3, 16\\).*B=2"),
    (dict(shift=torch.randn(2, 15)), ValueError, "argument 'shift' has shape \\(2, 15\\).*D=16"),
    (dict(scale=torch.randn(2, 4, 16)), ValueError, "argument 'scale'"),
    (dict(scale=torch.randn(2, 16, dtype=torch.float64)), TypeError, "argument 'scale' has dtype torch.float64"),
    (dict(input=torch.randn(2, 5, 16).half(), shift=torch.randn(2, 16).bfloat16()), TypeError, "argument 'shift'"),
    (dict(input=torch.randn(16)), ValueError, "argument 'input' must be \\[B, \\*, D\\]"),
    (dict(eps=-1.0), ValueError, "argument 'eps'"),
    (dict(one_plus_scale=1), TypeError, "argument 'one_plus_scale'"),
])
def test_argument_errors_name_op_and_argument(kwargs, exc, match):
    args = dict(input=torch.randn(2, 5, 16), scale=torch.randn(2, 16), shift=torch.randn(2, 16))
    args.update(kwargs)
    with pytest.raises(exc, match="cudnorm.ada_layer_norm: " + match):
        cudnorm.ada_layer_norm(**args)


# ---------------------------------------------------------------- CPU: modules

def test_ada_layer_norm_module_is_modulate():
    x, scale, shift = _inputs((2, 6, 32), torch.float32, torch.float32, True)
    torch.testing.assert_close(cudnorm.AdaLayerNorm(32)(x, shift, scale), _dit_formula(x, scale, shift))
    assert "eps=1e-06" in repr(cudnorm.AdaLayerNorm(32))


def test_ada_layer_norm_zero_identity_at_init_and_chunk_order():
    dim, cond = 16, 8
    module = cudnorm.AdaLayerNormZero(dim, cond)
    x, emb = torch.randn(2, 5, dim), torch.randn(2, cond)
    out, *gates = module(x, emb)
    torch.testing.assert_close(out, F.layer_norm(x, (dim,), eps=1e-6))
    assert all(torch.equal(g, torch.zeros(2, dim)) for g in gates)
    # chunk i of the projection is the constant i+1 (zero weight): the outputs reveal the order
    with torch.no_grad():
        module.linear.bias.copy_(torch.arange(1, 7).float().repeat_interleave(dim))
    out, gate_msa, shift_mlp, scale_mlp, gate_mlp = module(x, emb)
    full = lambda v: torch.full((2, dim), float(v))  # noqa: E731
    torch.testing.assert_close(out, _dit_formula(x, full(2), full(1)))  # shift_msa=1, scale_msa=2
    for got, want in zip((gate_msa, shift_mlp, scale_mlp, gate_mlp), (3, 4, 5, 6)):
        torch.testing.assert_close(got, full(want))


def _diffusers_zero_reference(x, emb, weight, bias):
    """diffusers' AdaLayerNormZero forward, written out (diffusers is not a dependency)."""
    chunks = F.linear(F.silu(emb), weight, bias).chunk(6, dim=1)
    shift_msa, scale_msa = chunks[0], chunks[1]
    return (_dit_formula(x, scale_msa, shift_msa),) + tuple(chunks[2:])


def test_ada_layer_norm_zero_loads_diffusers_state_dict():
    dim, cond = 16, 12
    state = {"linear.weight": 0.1 * torch.randn(6 * dim, cond), "linear.bias": 0.1 * torch.randn(6 * dim)}
    module = cudnorm.AdaLayerNormZero(dim, cond)
    assert set(module.state_dict()) == set(state)
    module.load_state_dict(state)
    x, emb = torch.randn(3, 4, dim), torch.randn(3, cond)
    expected = _diffusers_zero_reference(x, emb, state["linear.weight"], state["linear.bias"])
    for got, want in zip(module(x, emb), expected):
        torch.testing.assert_close(got, want)
    clone = cudnorm.AdaLayerNormZero(dim, cond)
    clone.load_state_dict(module.state_dict())
    torch.testing.assert_close(clone(x, emb)[0], module(x, emb)[0])


@pytest.mark.parametrize("affine", [False, True])
def test_ada_layer_norm_continuous_scale_shift_order_and_state_dict(affine):
    dim, cond = 16, 10
    module = cudnorm.AdaLayerNormContinuous(dim, cond, elementwise_affine=affine)
    keys = {"linear.weight", "linear.bias"} | ({"norm.weight", "norm.bias"} if affine else set())
    assert set(module.state_dict()) == keys
    state = {k: 0.2 * torch.randn(v.shape) for k, v in module.state_dict().items()}
    module.load_state_dict(state)
    x, emb = torch.randn(2, 5, dim), torch.randn(2, cond)
    scale, shift = F.linear(F.silu(emb), state["linear.weight"], state["linear.bias"]).chunk(2, dim=1)
    norm = F.layer_norm(x, (dim,), state.get("norm.weight"), state.get("norm.bias"), eps=1e-6)
    want = norm * (1 + scale)[:, None] + shift[:, None]
    got = module(x, emb)
    torch.testing.assert_close(got, want)
    torch.autograd.grad(got.sum(), list(module.parameters()))  # every parameter is in the graph


# ---------------------------------------------------------------- CPU: opcheck, compile

def _op_args(device, dtype=torch.float32, training=True):
    x, scale, shift = _inputs((2, 6, 64), dtype, torch.float32, True, device)
    for t in (x, scale, shift):
        t.requires_grad_(training)
    return x, scale, shift


@pytest.mark.parametrize("training", [True, False])
def test_opcheck_cpu(training):
    torch.library.opcheck(torch.ops.cudnorm.ada_layer_norm_fwd.default, (*_op_args("cpu", training=training), 1e-6,
                                                                         True, training))
    x, scale, _ = _op_args("cpu", training=False)
    _, mean, rstd = torch.ops.cudnorm.ada_layer_norm_fwd(x, scale, scale, 1e-6, False, True)
    bwd_args = (torch.randn_like(x), x, scale, mean, rstd, True)
    torch.library.opcheck(torch.ops.cudnorm.ada_layer_norm_bwd.default, bwd_args)


def _compiled_matches_eager(device):
    module = cudnorm.AdaLayerNormZero(64, 32).to(device)
    torch.nn.init.normal_(module.linear.weight, std=0.1)
    x, emb = torch.randn(2, 8, 64, device=device, requires_grad=True), torch.randn(2, 32, device=device)
    fn = lambda x, emb: module(x, emb)[0].square().sum()  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    got = torch.autograd.grad(compiled(x, emb), [x, module.linear.weight])
    want = torch.autograd.grad(fn(x, emb), [x, module.linear.weight])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_compile_fullgraph_cpu():
    _compiled_matches_eager("cpu")


# ---------------------------------------------------------------- GPU

GPU_SHAPES = [(4, 1024, 768), (32, 256, 1152), (2, 4096, 1536), (1, 1, 1000), (3, 1, 1000), (1, 77, 1000)]


def _served_by(strategy):
    """Whether the forced strategy really ran (not silently fallen through)."""
    specs = [s for s in _cache.plans.specs() if s.phase == "bwd" and _cache.plans.lookup(s) is not _cache.DECLINED]
    if strategy == "cudnn":
        return any(s.op == "ada_layer_norm" for s in specs)
    if strategy == "per_sample":
        return any(s.op == "layer_norm" for s in specs)
    if strategy == "per_sample_graph":
        return any(e.graph is not None for e in ada._CapturedBackward._entries.values())
    return not specs


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ada.STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_accuracy_every_strategy(shape, dtype, strategy, monkeypatch, fresh_cache):
    monkeypatch.setenv("CUDNORM_AUTOTUNE", "0")
    monkeypatch.setenv("CUDNORM_ADA_BWD", strategy)
    ada._CapturedBackward.clear()
    x, scale, shift = _inputs(shape, dtype, torch.float32, True, "cuda")
    rows = _report(x, scale, shift, True)
    assert all(r["ok"] for r in rows), rows
    assert _served_by(strategy), f"{strategy} did not serve the backward"


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["cudnn", "per_sample"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_accuracy_plain_convention_same_dtype_scale(dtype, strategy, monkeypatch):
    monkeypatch.setenv("CUDNORM_ADA_BWD", strategy)
    x, scale, shift = _inputs((8, 512, 1152), dtype, dtype, False, "cuda", scale_shape=(8, 1, 1152))
    rows = _report(x, scale, shift, False)
    assert all(r["ok"] for r in rows), rows


@pytest.mark.gpu
def test_gpu_captured_backward_replays_current_data(monkeypatch):
    monkeypatch.setenv("CUDNORM_ADA_BWD", "per_sample_graph")
    ada._CapturedBackward.clear()
    x, scale, shift = _inputs((16, 128, 1024), torch.bfloat16, torch.float32, True, "cuda")
    dy = torch.randn_like(x)
    mean = torch.empty(16 * 128, device="cuda")
    rstd = torch.empty_like(mean)
    for _ in range(4):  # same buffers, new values (in place: no allocation moves them)
        x.normal_()
        dy.normal_()
        scale.normal_(std=0.1)
        y, m, r = torch.ops.cudnorm.ada_layer_norm_fwd(x, scale, shift, 1e-6, True, True)
        mean.copy_(m)
        rstd.copy_(r)
        del y, m, r
        got = torch.ops.cudnorm.ada_layer_norm_bwd(dy, x, scale, mean, rstd, True)
        want = ada._torch_backward(dy, x, scale, mean, rstd, True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)
        del got, want
    # the allocator hands dx the same block each round once it settles: later calls replay
    assert 1 <= len(ada._CapturedBackward._entries) <= 2
    assert all(e.graph is not None for e in ada._CapturedBackward._entries.values())


@pytest.mark.gpu
def test_gpu_step_captured_by_the_caller(monkeypatch):
    """Inside a caller's CUDA graph the per-sample launches are recorded into it directly."""
    monkeypatch.setenv("CUDNORM_ADA_BWD", "per_sample_graph")
    x, scale, shift = _inputs((16, 128, 1024), torch.bfloat16, torch.float32, True, "cuda")
    x.requires_grad_(True)
    scale.requires_grad_(True)
    dy = torch.randn_like(x)

    def step():
        y = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
        return torch.autograd.grad(y, [x, scale], dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grads = step()
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(static_grads, step()):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_opcheck(training, dtype):
    torch.library.opcheck(torch.ops.cudnorm.ada_layer_norm_fwd.default, (*_op_args("cuda", dtype, training), 1e-6,
                                                                         True, training))
    x, scale, _ = _op_args("cuda", dtype, training=False)
    _, mean, rstd = torch.ops.cudnorm.ada_layer_norm_fwd(x, scale, scale, 1e-6, False, True)
    bwd_args = (torch.randn_like(x), x, scale, mean, rstd, True)
    torch.library.opcheck(torch.ops.cudnorm.ada_layer_norm_bwd.default, bwd_args)


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    _compiled_matches_eager("cuda")
