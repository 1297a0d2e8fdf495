"""Adaptive LayerNorm and RMSNorm modulated per token (cudnorm.ada_layer_norm / ada_rms_norm with
a scale of the input's shape): the CPU formula, argument errors, the dispatcher's candidates; the
kernels under Triton's interpreter (skipped without Triton) against fp64 under the 2x-PyTorch
rule; on a GPU each candidate forced, and the measured decision."""

import sys
from pathlib import Path

import pytest
import torch

import cudnorm
from cudnorm import _candidates, _token_ada
from cudnorm import reference as ref
import interpreted

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6


def _inputs(shape, dtype, wdtype, has_shift=True, device="cpu", chunked=True):
    """``x`` and per-token ``scale``/``shift``; ``chunked``: read from one ``[..., 3D]`` tensor, as
    a model's chunks of a Linear's output are (rows ``3D`` apart)."""
    d = shape[-1]
    x = (2 * torch.randn(shape) + 0.5).to(device, dtype)
    mod = (0.3 * torch.randn(*shape[:-1], 3 * d)).to(device, wdtype)
    scale, shift, _ = mod.chunk(3, -1) if chunked else (t.contiguous() for t in mod.chunk(3, -1))
    return x, scale, shift if has_shift else None


def _report(rms, one_plus, fn, x, scale, shift):
    """The 2x rule (against the formula in x's dtype, both compared with fp64) on y and every gradient."""
    def formula(dtype=None):
        def run(x, sc, sh=None):
            cast = (lambda t: t) if dtype is None else (lambda t: None if t is None else t.to(dtype))
            return _token_ada.formula(cast(x), cast(sc), cast(sh), EPS, rms, one_plus)
        return run
    names = ("y", "dx", "dscale", "dshift")
    inputs = (x, scale) if shift is None else (x, scale, shift)
    return ref.accuracy_report(fn, formula(), formula(torch.float64), inputs, torch.randn_like(x),
                               names[:len(inputs) + 1], x.dtype)


def _public(rms, one_plus):
    if rms:
        return lambda x, sc, sh=None: cudnorm.ada_rms_norm(x, sc, sh, EPS, one_plus_scale=one_plus)
    return lambda x, sc, sh: cudnorm.ada_layer_norm(x, sc, sh, EPS, one_plus_scale=one_plus)


# ---------------------------------------------------------------- CPU

@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("one_plus", [True, False])
@pytest.mark.parametrize("dtype, wdtype", [(F32, F32), (BF16, BF16), (F16, F32)])
def test_cpu_public_functions_take_a_modulation_per_token(rms, one_plus, dtype, wdtype):
    """On a CPU the public functions run the formula: every token takes its own scale and shift,
    and the result is the input's dtype, within twice the formula's own error against fp64."""
    x, scale, shift = _inputs((2, 7, 64), dtype, wdtype)
    y = _public(rms, one_plus)(x, scale, shift)
    assert y.dtype == dtype and y.shape == x.shape
    rows = _report(rms, one_plus, _public(rms, one_plus), x, scale, shift)
    assert all(r["ok"] for r in rows), rows
    # a token's output changes with its own modulation only
    bumped = scale.clone()
    bumped[1, 3] += 1.0
    changed = (_public(rms, one_plus)(x, bumped, shift) != y).any(-1)
    assert changed.nonzero().tolist() == [[1, 3]]


def test_cpu_per_sample_modulation_keeps_its_path():
    """[B, 1, D] and [B, D] are per sample (one scale for every token of a sample), as before."""
    x = torch.randn(2, 5, 32)
    scale, shift = torch.randn(2, 32), torch.randn(2, 32)
    per_sample = cudnorm.ada_layer_norm(x, scale, shift, EPS, one_plus_scale=True)
    expanded = cudnorm.ada_layer_norm(x, scale[:, None].expand_as(x), shift[:, None].expand_as(x), EPS,
                                      one_plus_scale=True)
    assert torch.allclose(per_sample, expanded, atol=1e-6)
    assert torch.allclose(cudnorm.ada_layer_norm(x, scale[:, None], shift[:, None], EPS, one_plus_scale=True),
                          per_sample)


@pytest.mark.parametrize("fn, kwargs, match", [
    ("ada_layer_norm", {"scale": torch.randn(2, 4, 16)}, r"ada_layer_norm: argument 'scale' has shape \(2, 4, 16\)"),
    ("ada_layer_norm", {"shift": torch.randn(2, 4, 16)}, r"ada_layer_norm: argument 'shift'"),
    ("ada_rms_norm", {"scale": torch.randn(2, 4, 16)}, r"ada_rms_norm: argument 'scale' has shape \(2, 4, 16\)"),
    ("ada_rms_norm", {"scale": torch.randn(2, 5, 16, dtype=torch.float64)}, r"ada_rms_norm: argument 'scale'"),
])
def test_argument_errors_name_the_function_and_argument(fn, kwargs, match):
    args = {"input": torch.randn(2, 5, 16), "scale": torch.randn(2, 5, 16), "shift": torch.randn(2, 5, 16)}
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        getattr(cudnorm, fn)(args["input"], args["scale"], args["shift"])


def test_compile_fullgraph_matches_eager():
    """Traced by torch.compile, a per-token call is the formula in PyTorch's ops, in one graph."""
    x, scale, shift = _inputs((2, 6, 32), F32, F32)
    fn = _public(False, True)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(x, scale, shift), fn(x, scale, shift), atol=1e-6)


@pytest.mark.parametrize("op", _candidates.TOKEN)
def test_dispatcher_candidates_are_torch_and_kernel(op, monkeypatch):
    monkeypatch.setattr(_candidates._norm_kernel, "available", lambda: True)  # as with Triton
    x = torch.empty(4096, 3072, dtype=BF16)
    sig = _candidates.signature(op, True, x, x, x, 3072)
    assert _candidates.candidates_for(sig) == ["torch", "kernel"]
    assert _candidates.candidates_for(sig, deterministic=True) == ["torch", "kernel"]
    monkeypatch.setattr(_candidates._norm_kernel, "available", lambda: False)
    assert _candidates.candidates_for(sig) == ["torch"]


def _check_closures(name):
    """The candidate's closures compute the call's forward and gradients (for a given ``dy``) for both ops."""
    for op in _candidates.TOKEN:
        rms = op == _candidates.TOKEN_RMS_NORM
        x, scale, shift, dy = (torch.randn(24, 40) for _ in range(4))
        sig = _candidates.signature(op, True, x, scale, shift, 40)
        want = ref.grads(lambda x, sc, sh: _token_ada.formula(x, sc, sh, EPS, rms, True),
                         tuple(t.double() for t in (x, scale, shift)), dy.double())
        grads = _candidates.CANDIDATES[name].prepare(sig, x, scale, shift, EPS, dy)()
        for got, expected in zip(grads, want[1]):
            assert ref.rel_error(got, expected) < 1e-5, (name, op)
        y = _candidates.CANDIDATES[name].prepare(sig._replace(training=False), x, scale, shift, EPS)()
        assert ref.rel_error(y, want[0]) < 1e-5, (name, op)


def test_torch_candidate_closures_compute_the_call_on_cpu():
    _check_closures("torch")


# ---------------------------------------------------------------- Triton's interpreter

# (shape, dtype, modulation dtype, has shift, one_plus_scale, rms, chunked): rows that do not fill
# a tile, narrow to wide widths, modulation in x's dtype and fp32, read in place or packed
_CASES = [
    ((1, 5, 8), F32, F32, True, True, False, True),
    ((3, 7, 88), BF16, BF16, True, True, False, True),
    ((2, 13, 96), F16, F32, False, False, True, False),
    ((1, 9, 256), BF16, F32, True, False, True, True),
    ((2, 5, 1000), F32, F32, True, True, False, False),
    ((2, 3, 1152), BF16, BF16, True, True, True, True),
]


def _check_interpreted():
    """Runs in a child process started with ``TRITON_INTERPRET=1`` (as tests/test_norm_kernel.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_norm_kernel import _poisoned_allocations

    torch.manual_seed(0)
    for shape, dtype, wdtype, has_shift, one_plus, rms, chunked in _CASES:
        case = f"{shape} {dtype} mod={wdtype} shift={has_shift} one_plus={one_plus} rms={rms} chunked={chunked}"
        x, scale, shift = _inputs(shape, dtype, wdtype, has_shift, chunked=chunked)
        with _poisoned_allocations():
            rows = _report(rms, one_plus, lambda *a: _token_ada.kernel(
                a[0], a[1], a[2] if len(a) > 2 else None, EPS, rms, one_plus), x, scale, shift)
        assert all(r["ok"] for r in rows), (case, rows)
        with torch.no_grad(), _poisoned_allocations():
            y = _token_ada.kernel(x, scale, shift, EPS, rms, one_plus)
        assert torch.equal(y, _token_ada.kernel(x, scale, shift, EPS, rms, one_plus)), case
    _check_closures("kernel")
    print("interpreted cases ok")


def test_interpreted_kernels_meet_the_2x_rule():
    interpreted.run("test_token_ada", "_check_interpreted")


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch", "kernel"])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("shape, dtype, wdtype", [
    ((1, 4608, 3072), BF16, BF16),
    ((2, 1024, 1536), BF16, F32),
    ((3, 77, 88), F16, F16),
    ((1, 333, 5120), F32, F32),
])
def test_gpu_each_candidate_meets_the_2x_rule(name, rms, shape, dtype, wdtype, tmp_path):
    from cudnorm import _decisions

    x, scale, shift = _inputs(shape, dtype, wdtype, device="cuda")
    op = _candidates.TOKEN_RMS_NORM if rms else _candidates.TOKEN_LAYER_NORM
    with cudnorm.config(policy="auto", plan_store=True, plan_store_dir=str(tmp_path / "store")):
        cudnorm.clear_cache()
        sig = _candidates.signature(op, True, x, scale, shift, shape[-1])
        _decisions._keep((sig, x.get_device(), torch.are_deterministic_algorithms_enabled()), name,
                         {"source": "test"})
        rows = _report(rms, True, _public(rms, True), x, scale, shift)
        served = [r["serves"] for r in cudnorm.serving_decisions() if r["signature"] == sig.key()]
        cudnorm.clear_cache()
    assert served == [name]
    assert all(r["ok"] for r in rows), rows


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True])
def test_gpu_a_call_is_served_by_measurement(rms, tmp_path):
    """A first eager call measures both candidates and stores its choice; a training call's
    results meet the 2x rule whichever serves. 2^24.6 elements: above the size rule's threshold
    on either launch path (:mod:`cudnorm._policy`, rule 3)."""
    x, scale, shift = _inputs((1, 8192, 3072), BF16, BF16, device="cuda")
    op = _candidates.TOKEN_RMS_NORM if rms else _candidates.TOKEN_LAYER_NORM
    with cudnorm.config(policy="auto", plan_store=True, plan_store_dir=str(tmp_path / "store")):
        cudnorm.clear_cache()
        rows = _report(rms, True, _public(rms, True), x, scale, shift)
        decided = [r for r in cudnorm.serving_decisions() if r["signature"].startswith(f"{op}/train")]
        cudnorm.clear_cache()
    assert len(decided) == 1 and decided[0]["source"] == "measured", decided
    assert set(decided[0]["ms"]) == {"torch", "kernel"}, decided
    assert all(r["ok"] for r in rows), rows
