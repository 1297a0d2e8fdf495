"""Adaptive RMSNorm (cudnorm.ada_rms_norm): the CPU formula against fp64 under the 2x-PyTorch
rule, argument errors, the module, torch.compile, the dispatcher's candidates; the kernels
under Triton's interpreter (skipped without Triton); on a GPU the public function with each
candidate forced."""

import sys
from pathlib import Path

import pytest
import torch

import cudnorm
from cudnorm import _ada_rms, _candidates
from cudnorm import reference as ref
import interpreted

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6


def _reference(x, scale, shift, dit, dtype=torch.float64):
    return ref.ada_rms_norm(x, scale, shift, EPS, dit, dtype)


def _eager(x, scale, shift, dit):
    return ref.ada_rms_norm_eager(x, scale, shift, EPS, dit)


def _inputs(shape, dtype, wdtype, dit, has_shift, device="cpu", scale_shape=None):
    b, d = shape[0], shape[-1]
    x = (2 * torch.randn(shape) + 0.5).to(device, dtype)
    scale = ((0.0 if dit else 1.0) + 0.3 * torch.randn(b, d)).to(device, wdtype)
    shift = (0.3 * torch.randn(b, d)).to(device, wdtype) if has_shift else None
    if scale_shape is not None:
        scale = scale.reshape(scale_shape)
        shift = None if shift is None else shift.reshape(scale_shape)
    return x, scale, shift


def _report(fn, x, scale, shift, dit):
    """The 2x rule on y and every gradient (the shift's only where there is one)."""
    names = ("y", "dx", "dscale", "dshift")
    if shift is None:
        return ref.accuracy_report(lambda x, sc: fn(x, sc, None), lambda x, sc: _eager(x, sc, None, dit),
                                   lambda x, sc: _reference(x, sc, None, dit), (x, scale), torch.randn_like(x),
                                   names[:3], x.dtype)
    return ref.accuracy_report(fn, lambda x, sc, sh: _eager(x, sc, sh, dit),
                               lambda x, sc, sh: _reference(x, sc, sh, dit), (x, scale, shift),
                               torch.randn_like(x), names, x.dtype)


# ---------------------------------------------------------------- CPU: numerics

@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("wdtype", ["fp32", "same"])
@pytest.mark.parametrize("dit", [True, False])
@pytest.mark.parametrize("has_shift", [True, False])
@pytest.mark.parametrize("shape, scale_shape", [((2, 7, 64), None), ((3, 5, 96), "b1d"), ((1, 1, 1000), None),
                                                ((2, 3, 4, 48), None)])
def test_cpu_matches_reference(dtype, wdtype, dit, has_shift, shape, scale_shape):
    b, d = shape[0], shape[-1]
    x, scale, shift = _inputs(shape, dtype, F32 if wdtype == "fp32" else dtype, dit, has_shift,
                              scale_shape=None if scale_shape is None else (b, 1, d))
    rows = _report(lambda x, sc, sh: cudnorm.ada_rms_norm(x, sc, sh, EPS, one_plus_scale=dit), x, scale, shift, dit)
    assert all(r["ok"] for r in rows), rows


def test_gradient_shapes_and_dtypes():
    x = torch.randn(3, 10, 32, dtype=BF16, requires_grad=True)
    scale = torch.randn(3, 32, requires_grad=True)  # fp32 modulation of bf16 x
    shift = torch.randn(3, 1, 32, dtype=BF16, requires_grad=True)
    y = cudnorm.ada_rms_norm(x, scale, shift)
    assert y.dtype == BF16 and y.shape == x.shape
    y.float().sum().backward()
    assert x.grad.dtype == BF16 and scale.grad.dtype == F32 and shift.grad.dtype == BF16
    assert scale.grad.shape == (3, 32) and shift.grad.shape == (3, 1, 32)


def test_one_plus_scale_is_the_default_and_float64_computes_in_float64():
    x, scale, shift = _inputs((2, 4, 16), torch.float64, torch.float64, True, True)
    torch.testing.assert_close(cudnorm.ada_rms_norm(x, scale, shift), _reference(x, scale, shift, True),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cudnorm.ada_rms_norm(x, scale, one_plus_scale=False),
                               _reference(x, scale, None, False), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- CPU: errors

@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(scale=torch.randn(3, 16)), ValueError, "argument 'scale' has shape \\(3, 16\\).*B=2"),
    (dict(shift=torch.randn(2, 15)), ValueError, "argument 'shift' has shape \\(2, 15\\).*D=16"),
    (dict(scale=torch.randn(2, 4, 16)), ValueError, "argument 'scale'"),
    (dict(scale=torch.randn(16)), ValueError, "argument 'scale'"),
    (dict(scale=[1.0]), TypeError, "argument 'scale' must be a torch.Tensor"),
    (dict(scale=torch.randn(2, 16, dtype=torch.float64)), TypeError, "argument 'scale' has dtype torch.float64"),
    (dict(input=torch.randn(2, 5, 16).half(), shift=torch.randn(2, 16).bfloat16()), TypeError, "argument 'shift'"),
    (dict(input=torch.randn(2, 5, 16).int()), TypeError, "argument 'input' has dtype"),
    (dict(input="x"), TypeError, "argument 'input' must be a torch.Tensor"),
    (dict(input=torch.randn(16)), ValueError, "argument 'input' must be \\[B, \\*, D\\]"),
    (dict(eps=-1.0), ValueError, "argument 'eps'"),
    (dict(eps="1e-6"), TypeError, "argument 'eps'"),
    (dict(one_plus_scale=1), TypeError, "argument 'one_plus_scale'"),
])
def test_argument_errors_name_op_and_argument(kwargs, exc, match):
    args = dict(input=torch.randn(2, 5, 16), scale=torch.randn(2, 16), shift=torch.randn(2, 16))
    args.update(kwargs)
    with pytest.raises(exc, match="cudnorm.ada_rms_norm: " + match):
        cudnorm.ada_rms_norm(**args)


# ---------------------------------------------------------------- CPU: module, compile, dispatcher

def test_module_calls_the_function():
    x, scale, shift = _inputs((2, 6, 32), F32, F32, False, True)
    module = cudnorm.AdaRMSNorm(32, eps=1e-5, one_plus_scale=False)
    torch.testing.assert_close(module(x, scale, shift),
                               cudnorm.ada_rms_norm(x, scale, shift, 1e-5, one_plus_scale=False))
    torch.testing.assert_close(cudnorm.AdaRMSNorm(32)(x, scale), cudnorm.ada_rms_norm(x, scale))
    assert list(module.parameters()) == [] and "one_plus_scale=False" in repr(module)
    with pytest.raises(ValueError, match="cudnorm.AdaRMSNorm: argument 'x'"):
        cudnorm.AdaRMSNorm(16)(x, scale)
    with pytest.raises(TypeError, match="pass eps=, one_plus_scale= by keyword"):
        cudnorm.AdaRMSNorm(32, 1e-6)


@pytest.mark.slow  # torch.compile builds C++ kernels on the CPU
def test_compile_fullgraph_matches_eager():
    x, scale, shift = _inputs((2, 8, 64), F32, F32, True, True)
    for t in (x, scale, shift):
        t.requires_grad_(True)
    fn = lambda x, sc, sh: cudnorm.ada_rms_norm(x, sc, sh).square().sum()  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(x, scale, shift), [x, scale, shift])
    want = torch.autograd.grad(fn(x, scale, shift), [x, scale, shift])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    bad = torch.compile(lambda x, sc: cudnorm.ada_rms_norm(x, sc), backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="cudnorm.ada_rms_norm: argument 'scale'"):
        bad(x.detach(), torch.randn(3, 64))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shift", [BF16, F32, None])
def test_dispatcher_candidates_are_torch_and_kernel(training, shift, monkeypatch):
    monkeypatch.setattr(_candidates._norm_kernel, "available", lambda: True)  # as with Triton
    x = torch.empty(4 * 1024, 1152, dtype=BF16)
    sig = _candidates.signature("ada_rms_norm", training, x, torch.empty(4, 1152, dtype=BF16),
                                None if shift is None else torch.empty(4, 1152, dtype=shift), 1152)
    assert sig.weight == BF16 and sig.bias == shift and sig.rows_bucket == (4 * 1024).bit_length()
    assert _candidates.candidates_for(sig) == ["torch", "kernel"]
    assert _candidates.candidates_for(sig, deterministic=True) == ["torch", "kernel"]
    monkeypatch.setattr(_candidates._norm_kernel, "available", lambda: False)  # without Triton
    assert _candidates.candidates_for(sig) == ["torch"]
    # LayerNorm/RMSNorm keep all three
    assert "cudnn" in _candidates.candidates_for(sig._replace(op="rms_norm", bias=None))


def test_candidate_closures_compute_the_call_on_cpu():
    """The torch candidate's closures run (the kernel's need Triton: interpreted below)."""
    _check_closures("torch")
    _check_closures("torch", _candidates.MODULATED_RMS)


def _check_closures(name, op="ada_rms_norm"):
    """The candidate's closures compute the call's forward and its gradients (for a given
    ``dy``); op ``modulated_rms_norm`` is a fused block's (fp32 here, where its formula rounds as
    the fused op's does)."""
    x, dy = torch.randn(3 * 8, 40), torch.randn(3 * 8, 40)
    scale, shift = torch.randn(3, 40), torch.randn(3, 40)
    sig = _candidates.signature(op, True, x, scale, shift, 40)
    x3 = x.view(3, 8, 40)
    want = ref.grads(lambda x, sc, sh: _reference(x, sc, sh, True), (x3, scale, shift), dy.view(x3.shape))
    grads = _candidates.CANDIDATES[name].prepare(sig, x, scale, shift, EPS, dy)()
    for got, expected in zip(grads, want[1]):
        assert ref.rel_error(got.reshape(expected.shape), expected) < 1e-5, name
    y = _candidates.CANDIDATES[name].prepare(sig._replace(training=False), x, scale, shift, EPS)()
    assert ref.rel_error(y.reshape(x3.shape), want[0]) < 1e-6, name


# ---------------------------------------------------------------- Triton's interpreter

# (B, S, D, dtype, scale dtype, has shift, one_plus_scale): B 1 and 3, rows per sample that do not
# fill a tile, widths narrow to wide, modulation in x's dtype and fp32
_CASES = [
    (1, 5, 8, F32, F32, True, True),
    (3, 7, 88, BF16, BF16, True, True),
    (3, 13, 96, F16, F32, False, False),
    (1, 9, 256, BF16, F32, True, False),
    (3, 5, 1000, F32, F32, False, True),
    (3, 3, 1000, BF16, BF16, True, False),
]


def _check_interpreted():
    """Runs in a child process started with ``TRITON_INTERPRET=1`` (as tests/test_norm_kernel.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_norm_kernel import _poisoned_allocations

    torch.manual_seed(0)
    for b, s, d, dtype, wdtype, has_shift, dit in _CASES:
        case = f"{b}x{s}x{d} {dtype} scale={wdtype} shift={has_shift} one_plus={dit}"
        x, scale, shift = _inputs((b, s, d), dtype, wdtype, dit, has_shift)
        with _poisoned_allocations():
            y, rstd = _ada_rms.forward(x.view(-1, d), scale, shift, EPS, dit, True)
            y_eval, none = _ada_rms.forward(x.view(-1, d), scale, shift, EPS, dit, False)
        assert none is None and torch.equal(y, y_eval), case
        want_rstd = (x.double().square().mean(-1) + EPS).rsqrt().reshape(-1)
        assert rstd.dtype == F32 and ref.rel_error(rstd, want_rstd) < 1e-6, case
        with _poisoned_allocations():
            rows = _report(lambda x, sc, sh: _ada_rms.kernel(x, sc, sh, EPS, dit), x, scale, shift, dit)
        assert all(r["ok"] for r in rows), (case, rows)
    _check_closures("kernel")
    _check_closures("kernel", _candidates.MODULATED_RMS)
    print("interpreted cases ok")


def test_interpreted_kernels_meet_the_2x_rule():
    interpreted.run("test_ada_rms_norm", "_check_interpreted")


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch", "kernel"])
@pytest.mark.parametrize("shape, dtype, wdtype, has_shift, dit", [
    ((4, 1024, 1152), BF16, BF16, True, True),
    ((2, 4096, 1536), BF16, F32, False, True),
    ((3, 77, 88), F16, F16, True, False),
    ((1, 333, 3072), F32, F32, True, True),
])
def test_gpu_each_candidate_meets_the_2x_rule(name, shape, dtype, wdtype, has_shift, dit, tmp_path):
    from cudnorm import _decisions, _native

    x, scale, shift = _inputs(shape, dtype, wdtype, dit, has_shift, device="cuda")
    with cudnorm.config(policy="auto", plan_store=True, plan_store_dir=str(tmp_path / "store")):
        cudnorm.clear_cache()
        sig = _candidates.signature("ada_rms_norm", True, x, scale, shift, shape[-1])
        if not _candidates.CANDIDATES[name].supports(sig):
            pytest.skip(f"{name} does not serve {sig.key()}")
        _decisions._keep((sig, x.get_device(), torch.are_deterministic_algorithms_enabled()), name,
                         {"source": "test"})
        _native.forget()
        rows = _report(lambda x, sc, sh: cudnorm.ada_rms_norm(x, sc, sh, EPS, one_plus_scale=dit), x, scale, shift,
                       dit)
        served = [r["serves"] for r in cudnorm.serving_decisions() if r["signature"] == sig.key()]
        cudnorm.clear_cache()
    assert served == [name]
    assert all(r["ok"] for r in rows), rows


@pytest.mark.gpu
def test_gpu_kernel_backward_is_deterministic():
    x, scale, shift = _inputs((8, 1024, 1152), BF16, BF16, True, True, device="cuda")
    _, rstd = _ada_rms.forward(x.view(-1, 1152), scale, shift, EPS, True, True)
    dy = torch.randn_like(x).view(-1, 1152)
    first, second = (_ada_rms.backward(dy, x.view(-1, 1152), scale, rstd, True, BF16) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [256, 4096])
def test_gpu_fused_block_rms_norm_is_served_by_measurement(tokens, tmp_path):
    """A fused diffusers block's weightless RMSNorm and modulation (LTX-Video's,
    ``_diffusers_block_ops.rms_modulated``) takes the measured decision of op
    ``modulated_rms_norm``: the block's formula in bf16 or cudnorm's kernels, both timed; either
    meets the 2x rule against fp64."""
    from cudnorm import _diffusers_block_ops as block_ops

    x, scale, shift = _inputs((2, tokens, 2048), BF16, BF16, True, True, device="cuda")
    scale, shift = scale[:, None], shift[:, None]  # the block's [B, 1, D] chunks
    norm = torch.nn.RMSNorm(2048, eps=EPS, elementwise_affine=False)
    with cudnorm.config(policy="auto", plan_store=True, plan_store_dir=str(tmp_path / "store")):
        cudnorm.clear_cache()
        rows = _report(lambda x, sc, sh: block_ops.rms_modulated(norm, x, sc, sh), x, scale, shift, True)
        decided = [r for r in cudnorm.serving_decisions() if r["signature"].startswith("modulated_rms_norm/train")]
        cudnorm.clear_cache()
    assert len(decided) == 1 and decided[0]["source"] == "measured", decided
    assert set(decided[0]["ms"]) == {"torch", "kernel"}, decided[0]
    assert all(r["ok"] for r in rows), (decided[0]["serves"], rows)
