"""Adaptive LayerNorm: fallback numerics vs the DiT formula, module conventions (chunk order,
zero-init identity, diffusers-style state_dict), argument errors, opcheck, torch.compile;
on a GPU: every forward and backward strategy under the 2x-PyTorch rule, CUDA-graph
replays, opcheck, torch.compile."""

import ctypes
import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _cache, _graphs, _self_check
from cudnorm import reference as ref

from cudnorm import _ada_strategies as strategies  # noqa: E402

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
        lambda x, sc, sh: ref.ada_layer_norm_eager(x.reshape(b, -1, d), sc.reshape(b, d), sh.reshape(b, d), 1e-6,
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
                                                ((1, 1, 1000), None), ((4, 160), None),
                                                # samples of >= 4096 elements: ATen's LayerNorm per sample
                                                ((2, 64, 256), None), ((3, 2, 32, 64), "b11d")])
def test_fallback_matches_reference(dtype, wdtype, dit, shape, scale_shape):
    b, d = shape[0], shape[-1]
    sshape = {None: None, "b1d": (b, 1, d), "b11d": (b, 1, 1, d)}[scale_shape]
    x, scale, shift = _inputs(shape, dtype, torch.float32 if wdtype == "fp32" else dtype, dit, scale_shape=sshape)
    rows = _report(x, scale, shift, dit)
    assert all(r["ok"] for r in rows), rows


def test_cpu_fallback_makes_no_fp32_copy_of_the_activations(largest_fp32_tensor):
    """Samples of >= 4096 elements run ATen's LayerNorm per sample: no fp32 tensor of x's
    size in the forward or the backward, so the fallback costs PyTorch's eager formula's time."""
    x, scale, shift = _inputs((4, 64, 256), torch.bfloat16, torch.bfloat16, True)
    x.requires_grad_(True), scale.requires_grad_(True), shift.requires_grad_(True)
    y = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
    assert largest_fp32_tensor(lambda: cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)) < x.numel()
    assert largest_fp32_tensor(lambda: y.backward(torch.randn_like(y))) < x.numel()


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
        _, stats = torch.ops.cudnorm.ada_layer_norm_fwd(x, scale, shift, 1e-6, True, False)
    assert stats.numel() == 0


def test_strategy_rules_and_settings():
    # cuDNN's AdaLN forward graph everywhere; the backward: one plain LayerNorm backward launch
    # for one sample, the fused kernel (a fixed number of launches) for any larger batch
    for shape, backward in [((4, 1024, 768), "fused"), ((8, 256, 1152), "fused"), ((2, 1024, 1152), "fused"),
                            ((32, 256, 1152), "fused"), ((128, 4096, 3072), "fused"),
                            ((1, 4096, 3072), "per_sample"), ((1, 1, 1000), "per_sample")]:
        assert strategies.choose_forward(*shape, torch.bfloat16) == "cudnn"
        assert strategies.choose_backward(*shape, torch.bfloat16) == backward, shape
    cudnorm.config(ada_backward="cudnn", ada_forward="torch")
    assert strategies.backward_strategy(1, 1, 8, torch.float32) == "cudnn"
    assert strategies.forward_strategy(16, 4096, 3072, torch.bfloat16) == "torch"
    for name, allowed in (("ada_backward", "'auto', 'fused', 'cudnn', 'per_sample' or 'torch'"),
                          ("ada_forward", "'auto', 'cudnn', 'per_sample' or 'torch'")):
        for removed in ("fastest", "per_sample_graph", "cudnn_graph"):  # the captured strategies are gone
            with pytest.raises(ValueError, match=f"option '{name}' must be {allowed}"):
                cudnorm.config(**{name: removed})
    with pytest.raises(ValueError, match="option 'ada_forward' must be"):
        cudnorm.config(ada_forward="fused")  # a backward-only strategy


def test_check_cases_pass_on_cpu():
    cases = list(_self_check._ada_cases("cpu", (torch.float32, torch.bfloat16)))
    assert {c[0].split(" ")[0] for c in cases} == {"ada_layer_norm"}
    for _, dtype, candidate, baseline, reference, inputs, names in cases[:4]:
        rows = ref.accuracy_report(candidate, baseline, reference, inputs, torch.randn_like(inputs[0]), names, dtype)
        assert all(r["ok"] for r in rows), rows


def test_eager_calls_bypass_the_dispatcher_traced_calls_do_not():
    x, scale, shift = _op_args("cpu")
    y = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
    assert type(y.grad_fn).__name__ == "_AdaLayerNormFunctionBackward"
    graph = torch.fx.experimental.proxy_tensor.make_fx(
        lambda x, sc, sh: cudnorm.ada_layer_norm(x, sc, sh, one_plus_scale=True),
        tracing_mode="fake")(x.detach(), scale, shift)
    assert "cudnorm.ada_layer_norm_fwd" in graph.code


def _tensor_at(address: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over the memory at ``address`` (what a launch's pointer points at)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype).view(shape)


class _FakePlan:
    """Stands in for a built plan (AdaLN, or the LayerNorm graph run per sample) on CPU: a
    launch's addresses are turned back into tensors of the graph's declared roles, sizes and
    dtypes (checking cuDNN's 16-byte alignment), and PyTorch's results are written there."""

    raw = None
    workspace_size = 0

    def __init__(self, spec):
        self.spec, self.calls = spec, 0

    def launch(self, pointers):
        spec = self.spec
        self.calls += 1
        t = {}
        for (role, (shape, dtype)), address in zip(_graphs.buffer_shapes(spec).items(), pointers, strict=True):
            if role != "eps":
                assert address % 16 == 0, role
            t[role] = _tensor_at(address, shape, dtype)
        b, s, d = (spec.batch, spec.seq, spec.cols) if spec.op == "ada_layer_norm" else (1, spec.rows, spec.cols)
        x = t["x"].reshape(b, s, d)
        gain = t["scale"].reshape(b, d)
        if spec.phase == "bwd":
            dx, dscale, dshift = ada._torch_backward(t["dy"].reshape(b, s, d), x, gain, t["mean"], t["rstd"])
            for role, value in (("dx", dx), ("dscale", dscale), ("dbias", dshift)):
                t[role].copy_(value.reshape(t[role].shape))
            return
        y, stats = ada._torch_forward(x, gain, t["bias"].reshape(b, d), t["eps"].item(), True)
        t["y"].copy_(y.reshape(t["y"].shape))
        if spec.phase == "train":
            t["mean"].copy_(stats[0, :b * s])
            t["rstd"].copy_(stats[1, :b * s])


@pytest.mark.parametrize("shape, dtype", [((3, 16, 64), torch.bfloat16),  # every strategy fits
                                          ((2, 6, 40), torch.float32),  # S % 4: padded statistics
                                          ((4, 8, 30), torch.bfloat16)])  # D % 8: parameter rows misaligned
@pytest.mark.parametrize("fwd, bwd", [("cudnn", "cudnn"), ("per_sample", "per_sample"), ("cudnn", "per_sample"),
                                      ("per_sample", "cudnn")])
@pytest.mark.parametrize("decline_first", [False, True])
def test_cuda_path_plumbing_with_fake_plans(shape, dtype, fwd, bwd, decline_first, monkeypatch):
    """The cuDNN-path code of both ops (addresses in role order, sizes, dtypes, alignment,
    per-sample offsets, fall-through) run on CPU with every plan faked; a declined first
    choice must fall through to the other strategy with the same result."""
    b, s, d = shape
    # fp32 scale/shift: the forward reads them rounded to x's dtype, the backward in fp32
    fits = {"train": strategies.per_sample_fits(s, d, d, dtype.itemsize, dtype.itemsize) and s % 4 == 0,
            "bwd": strategies.per_sample_fits(s, d, d, dtype.itemsize, 4)}
    order = {"cudnn": ["ada_layer_norm", "layer_norm"], "per_sample": ["layer_norm", "ada_layer_norm"]}
    candidates = {phase: [op for op in order[strategy] if op != "layer_norm" or fits[phase]]
                  for phase, strategy in (("train", fwd), ("bwd", bwd))}
    plans = []

    def fake_get_plan(spec):
        if decline_first and spec.op == candidates.get(spec.phase, [None])[0]:
            return None
        plans.append(_FakePlan(spec))
        return plans[-1]

    monkeypatch.setattr(ada._runtime, "route", lambda x: None)
    monkeypatch.setattr(ada._cache, "get_plan", fake_get_plan)
    cudnorm.config(ada_forward=fwd, ada_backward=bwd)
    x, scale, shift = _inputs(shape, dtype, torch.float32, True, scale_shape=(b, 1, d))
    rows = _report(x, scale, shift, True)
    assert all(r["ok"] for r in rows), rows
    served = {p.spec.phase: p for p in plans}
    for phase, ops in candidates.items():
        expected = ops[1:] if decline_first else ops
        if not expected:  # nothing left: PyTorch's kernels ran
            assert phase not in served
            continue
        assert served[phase].spec.op == expected[0], (phase, served[phase].spec)
        assert served[phase].calls == (b if expected[0] == "layer_norm" else 1)
    with torch.no_grad():  # the inference phase; atol: one bf16 ulp of outputs near 1
        gain = (1 + scale.float()).to(dtype)
        torch.testing.assert_close(cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True),
                                   ref.ada_layer_norm(x, gain, shift.to(dtype), dit=False).to(dtype), atol=8e-3,
                                   rtol=1.6e-2)


def test_chunked_shift_is_read_at_its_own_rows(monkeypatch):
    """A DiT chunk of a Linear output (rows 6*D apart, not contiguous) as scale and shift:
    the graph is handed packed copies, and the result is the formula's."""
    monkeypatch.setattr(ada._runtime, "route", lambda x: None)
    monkeypatch.setattr(ada._cache, "get_plan", _FakePlan)
    b, s, d = 3, 8, 32
    x = torch.randn(b, s, d)
    chunks = (0.1 * torch.randn(b, 6 * d)).chunk(6, dim=1)
    got = cudnorm.ada_layer_norm(x, chunks[1], chunks[0], one_plus_scale=True)
    torch.testing.assert_close(got, _dit_formula(x, chunks[1], chunks[0]))


def test_repeated_forward_signature_reuses_the_plan(monkeypatch, fresh_cache, tmp_path):
    """A forward repeating an earlier call's signature skips strategy and plan lookup (and
    counts a cache hit); another signature, or a recording of specs, takes the full path."""
    looked_up = []

    def fake_get_plan(spec):
        looked_up.append(spec)
        return _FakePlan(spec)

    monkeypatch.setattr(ada._runtime, "route", lambda x: None)
    monkeypatch.setattr(ada._cache, "get_plan", fake_get_plan)
    x, scale, shift = _inputs((2, 8, 32), torch.bfloat16, torch.float32, True)
    with torch.no_grad():
        first = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
        hits = cudnorm.cache_info().hits
        again = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
        assert len(looked_up) == 1 and cudnorm.cache_info().hits == hits + 1
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        other = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=False)  # same signature, other gain
        torch.testing.assert_close(other, ref.ada_layer_norm_eager(x, scale, shift, 1e-6, False), atol=3e-2, rtol=2e-2)
        assert len(looked_up) == 1
        cudnorm.ada_layer_norm(x[:, :4], scale, shift)  # another row count
        assert [spec.rows for spec in looked_up] == [16, 8]
        with pytest.warns(RuntimeWarning), cudnorm.record_specs(tmp_path / "specs.json"):
            cudnorm.ada_layer_norm(x, scale, shift)  # (the fake get_plan records nothing)
        assert len(looked_up) == 3 and looked_up[-1] == looked_up[0]
    y = cudnorm.ada_layer_norm(x.requires_grad_(), scale, shift)  # training: its own signature
    assert len(looked_up) == 4 and looked_up[-1].phase == "train" and y.requires_grad


def test_per_sample_declines_misaligned_samples():
    assert not strategies.per_sample_fits(3, 30, 30, 2)  # a sample is 3 * 30 * 2 = 180 bytes
    assert not strategies.per_sample_fits(4, 16, 11, 2)  # padded rows: x's sample block is 128 bytes, y's 88
    assert not strategies.per_sample_fits(4, 30, 30, 2, 2)  # a [B, D] parameter row is 60 bytes
    assert strategies.per_sample_fits(4, 30, 30, 2) and strategies.per_sample_fits(4, 1000, 1000, 2, 2)
    x = torch.randn(2 * 3, 30, dtype=torch.bfloat16)
    assert strategies.PerSampleBackward.spec(x, 2, torch.bfloat16, None) is None  # so the per-sample strategies are never tried


def test_gain_is_summed_in_fp32_and_rounded_once():
    scale = torch.tensor([[2.0 ** -9, -0.3]], dtype=torch.float32)
    gain = strategies.make_gain(scale, True, torch.bfloat16)
    assert gain.dtype == torch.bfloat16 and torch.equal(gain, (1 + scale.double()).to(torch.bfloat16))
    assert torch.equal(strategies.make_gain(scale.bfloat16(), True, torch.float32), 1 + scale.bfloat16().float())
    chunk = torch.randn(2, 12)[:, 4:8]  # a Linear chunk: not contiguous
    assert strategies.make_gain(chunk, False, torch.float32).is_contiguous()


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
    module = cudnorm.AdaLayerNormZero(dim, cond_dim=cond)
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


def test_ada_layer_norm_zero_conditioning_defaults_to_the_width():
    """Without ``cond_dim`` the conditioning has ``dim`` features, as its docstring says."""
    module = cudnorm.AdaLayerNormZero(16)
    x = torch.randn(2, 5, 16)
    assert module(x, torch.randn(2, 16))[0].shape == x.shape
    with pytest.raises(ValueError, match=r"AdaLayerNormZero.*emb.*expected \[B, cond_dim\] = \[2, 16\]"):
        module(x, torch.randn(2, 8))


def test_ada_layer_norm_zero_loads_diffusers_state_dict():
    dim, cond = 16, 12
    state = {"linear.weight": 0.1 * torch.randn(6 * dim, cond), "linear.bias": 0.1 * torch.randn(6 * dim)}
    module = cudnorm.AdaLayerNormZero(dim, cond_dim=cond)
    assert set(module.state_dict()) == set(state)
    module.load_state_dict(state)
    x, emb = torch.randn(3, 4, dim), torch.randn(3, cond)
    expected = _diffusers_zero_reference(x, emb, state["linear.weight"], state["linear.bias"])
    for got, want in zip(module(x, emb), expected):
        torch.testing.assert_close(got, want)
    clone = cudnorm.AdaLayerNormZero(dim, cond_dim=cond)
    clone.load_state_dict(module.state_dict())
    torch.testing.assert_close(clone(x, emb)[0], module(x, emb)[0])


@pytest.mark.parametrize("affine", [False, True])
def test_ada_layer_norm_continuous_scale_shift_order_and_state_dict(affine):
    dim, cond = 16, 10
    module = cudnorm.AdaLayerNormContinuous(dim, cond_dim=cond, elementwise_affine=affine)
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
    _, stats = torch.ops.cudnorm.ada_layer_norm_fwd(x, scale, scale, 1e-6, False, True)
    bwd_args = (torch.randn_like(x), x, scale, stats, True, torch.bfloat16)
    torch.library.opcheck(torch.ops.cudnorm.ada_layer_norm_bwd.default, bwd_args)


def _compiled_matches_eager(device):
    module = cudnorm.AdaLayerNormZero(64, cond_dim=32).to(device)
    torch.nn.init.normal_(module.linear.weight, std=0.1)
    x, emb = torch.randn(2, 8, 64, device=device, requires_grad=True), torch.randn(2, 32, device=device)
    fn = lambda x, emb: module(x, emb)[0].square().sum()  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    got = torch.autograd.grad(compiled(x, emb), [x, module.linear.weight])
    want = torch.autograd.grad(fn(x, emb), [x, module.linear.weight])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.slow  # torch.compile builds C++ kernels on the CPU: 20 s
def test_compile_fullgraph_cpu():
    _compiled_matches_eager("cpu")


# ---------------------------------------------------------------- GPU

# fp16/fp32 only on the smallest shapes (the dtype plumbing); bf16 on the DiT-like ones too
GPU_CASES = ([((4, 1024, 768), torch.bfloat16), ((32, 256, 1152), torch.bfloat16)]
             + [(shape, dtype) for shape in ((1, 1, 1000), (3, 77, 1000)) for dtype in DTYPES])
GPU_STRATEGIES = [("ada_forward", s) for s in strategies.FORWARD_STRATEGIES] + [("ada_backward", s) for s in strategies.STRATEGIES]


def _inference_ok(x, scale, shift):
    with torch.no_grad():
        got = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
        want = ref.ada_layer_norm(x, scale, shift)
        eager = ref.ada_layer_norm_eager(x, scale, shift, 1e-6, True)
    return ref.rel_error(got, want) <= ref.error_bound(ref.rel_error(eager, want), x.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("setting, strategy", GPU_STRATEGIES)
@pytest.mark.parametrize("shape, dtype", GPU_CASES)
def test_gpu_accuracy_every_strategy(shape, dtype, setting, strategy):
    """Each strategy, forced, meets the 2x-PyTorch rule and really served the call: the
    specs requested are exactly the first choice (``specs_for``) and none was declined."""
    cudnorm.config(autotune="off", **{setting: strategy})
    b, s, d = shape
    x, scale, shift = _inputs(shape, dtype, torch.float32, True, "cuda")
    with cudnorm.record_specs() as rec:
        rows = _report(x, scale, shift, True)
    assert all(r["ok"] for r in rows), rows
    assert _inference_ok(x, scale, shift)
    expected = strategies.specs_for(b, s, d, dtype, torch.float32, x.device.index, phases=("train", "bwd"))
    assert set(rec.specs) == set(expected), (rec.specs, expected)
    assert all(_cache.plans.lookup(spec) is not _cache.DECLINED for spec in rec.specs)


@pytest.mark.gpu
@pytest.mark.parametrize("fwd, bwd", [("cudnn", "cudnn"), ("per_sample", "per_sample")])
def test_gpu_plain_convention_same_dtype_scale(fwd, bwd):
    cudnorm.config(ada_forward=fwd, ada_backward=bwd)
    x, scale, shift = _inputs((4, 1024, 768), torch.bfloat16, torch.bfloat16, False, "cuda", scale_shape=(4, 1, 768))
    rows = _report(x, scale, shift, False)
    assert all(r["ok"] for r in rows), rows


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])  # bf16: the graph also rounds dscale/dshift
def test_gpu_chunked_modulation_every_strategy_agrees(wdtype):
    """scale/shift as chunks of one Linear output (DiT's adaLN-Zero): the forward and both
    backward strategies give the fp32 formula's values within bf16 rounding."""
    b, s, d = 8, 256, 1152
    x = torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    emb = (0.1 * torch.randn(b, 6 * d, device="cuda")).to(wdtype).requires_grad_(True)
    dy = torch.randn_like(x)
    results = {}
    for bwd in ("fused", "per_sample", "cudnn", "torch"):
        cudnorm.config(ada_backward=bwd)
        shift, scale = emb.chunk(6, dim=1)[:2]
        y = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
        results[bwd] = (y, *torch.autograd.grad(y, [x, emb], dy))
    shift, scale = emb.float().chunk(6, dim=1)[:2]
    xf = x.float()
    want_y = _dit_formula(xf, scale, shift)
    want = (want_y, *torch.autograd.grad(want_y, [xf, emb], dy.float()))
    for bwd, got in results.items():
        for g, w, name in zip(got, want, ("y", "dx", "demb")):
            assert ref.rel_error(g, w) < 1.5e-2, (bwd, name, ref.rel_error(g, w))


@pytest.mark.gpu
def test_gpu_fresh_tensors_keep_builds_and_captures_bounded(monkeypatch, fresh_cache):
    """The loop a model runs: every step makes new activations. After the first step no
    plan is built or loaded, nothing is captured into a CUDA graph, and every step's result
    is its own inputs' (checked against the fp64 reference under the 2x-PyTorch rule)."""
    captures = []
    begin = torch.cuda.CUDAGraph.capture_begin
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda self, *a, **k: captures.append(1) or
                        begin(self, *a, **k))
    b, s, d = 8, 256, 1152
    ln_w = torch.randn(d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kept = []  # every step's tensors stay alive, so no step reuses an earlier step's addresses

    def step():
        x = torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        emb = (0.1 * torch.randn(b, 2 * d, device="cuda", dtype=torch.bfloat16)).requires_grad_(True)
        shift, scale = emb.chunk(2, dim=1)
        h = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
        out = cudnorm.rms_norm(cudnorm.layer_norm(h, (d,), ln_w, None, 1e-5), (d,), ln_w, 1e-6)
        dy = torch.randn_like(out)
        grads = torch.autograd.grad(out, [x, emb], dy)
        kept.append((x, emb, out, dy, grads))
        return x, emb, out, dy, grads

    step()
    torch.cuda.synchronize()
    info = cudnorm.cache_info()
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    after = cudnorm.cache_info()
    assert (after.builds, after.store_loads, after.misses) == (info.builds, info.store_loads, info.misses)
    assert after.hits > info.hits and not captures
    for x, emb, out, dy, _ in kept[-3:]:
        def model(x, emb, dtype_ref=False):
            shift, scale = emb.chunk(2, dim=1)
            h = ref.ada_layer_norm(x, scale, shift) if dtype_ref else ref.ada_layer_norm_eager(x, scale, shift, 1e-6, True)
            if dtype_ref:
                return ref.rms_norm(ref.layer_norm(h, ln_w, None, 1e-5), ln_w, 1e-6)
            return F.rms_norm(F.layer_norm(h, (d,), ln_w, None, 1e-5), (d,), ln_w, 1e-6)

        want = model(x.detach().double(), emb.detach().double(), dtype_ref=True)
        eager = model(x.detach(), emb.detach())
        assert ref.rel_error(out, want) <= ref.error_bound(ref.rel_error(eager, want), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_step_captured_by_the_caller():
    """Inside a caller's CUDA graph the per-sample launches are recorded into it directly."""
    x, scale, shift = _inputs((16, 128, 1024), torch.bfloat16, torch.float32, True, "cuda")
    x.requires_grad_(True)
    scale.requires_grad_(True)
    dy = torch.randn_like(x)

    def step():
        y = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
        return (y,) + torch.autograd.grad(y, [x, scale], dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = step()
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(static_outputs, step()):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fwd, bwd", [("cudnn", "cudnn"), ("per_sample", "per_sample")])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_opcheck(fwd, bwd, training, dtype):
    """Real, fake (no data pointers) and autograd-registration checks of both ops on CUDA."""
    cudnorm.config(ada_forward=fwd, ada_backward=bwd)
    torch.library.opcheck(torch.ops.cudnorm.ada_layer_norm_fwd.default, (*_op_args("cuda", dtype, training), 1e-6,
                                                                         True, training))
    x, scale, _ = _op_args("cuda", dtype, training=False)
    _, stats = torch.ops.cudnorm.ada_layer_norm_fwd(x, scale, scale, 1e-6, False, True)
    bwd_args = (torch.randn_like(x), x, scale, stats, True, torch.bfloat16)
    torch.library.opcheck(torch.ops.cudnorm.ada_layer_norm_bwd.default, bwd_args)


@pytest.mark.gpu
@pytest.mark.parametrize("fwd, bwd", [("cudnn", "per_sample"), ("per_sample", "cudnn"), ("cudnn", "fused")])
def test_gpu_compile_fullgraph(fwd, bwd):
    cudnorm.config(ada_forward=fwd, ada_backward=bwd)
    _compiled_matches_eager("cuda")


@pytest.mark.parametrize("mode, s, tuned", [("auto", 4096, True), ("auto", 1024, False), ("off", 4096, False),
                                           ("on", 1024, True)])
def test_per_sample_backward_spec_matches_warmup(mode, s, tuned):
    """warmup's specs (``specs_for``) ask for exactly the per-sample backward spec the op
    builds; in ``auto`` mode it is tuned from 2**22 elements per sample (4096 x 3072 is
    12.6M, 1024 x 3072 is 3.1M)."""
    cudnorm.config(autotune=mode, ada_backward="per_sample")
    b, d = 16, 3072
    x2 = torch.empty((b * s, d), dtype=torch.bfloat16, device="meta")
    spec = strategies.PerSampleBackward.spec(x2, b, torch.float32, 0)
    assert (spec.op, spec.phase, spec.rows, spec.autotune, spec.scale_dtype) == ("layer_norm", "bwd", s, tuned,
                                                                                torch.float32)
    assert strategies.specs_for(b, s, d, torch.bfloat16, torch.float32, 0, phases=("bwd",)) == [spec]
