"""``cudnorm.gated_ada_layer_norm``: a gated residual into an adaptive LayerNorm (cudnorm._gated).
The formula on the CPU against fp64, the argument errors, which implementation a call takes,
the measured decision's candidates, the fused op's backward kernel under Triton's interpreter
(the 2x rule against fp64, with and without a gradient reaching ``h``), and on a GPU the fused
op and the measured decision."""

import sys
from pathlib import Path

import pytest
import torch

import cudnorm
from cudnorm import _candidates, _decisions, _gated, _policy
from cudnorm import reference as ref
from cudnorm._candidates import Signature

import interpreted

BF16, F32 = torch.bfloat16, torch.float32
EPS = 1e-6


def _inputs(b, s, d, dtype, device="cpu", gate_shape="bd"):
    g = torch.Generator().manual_seed(0)
    residual, branch = (torch.randn(b, s, d, generator=g) for _ in range(2))
    gate, scale, shift = (0.3 * torch.randn(b, d, generator=g) for _ in range(3))
    if gate_shape == "b1d":
        gate, scale, shift = (t[:, None] for t in (gate, scale, shift))
    return [t.to(device, dtype) for t in (residual, branch, gate, scale, shift)]


def _reference(residual, branch, gate, scale, shift, one_plus_scale=True):
    """fp64, from the definition (:func:`cudnorm.reference.gated_ada_layer_norm`)."""
    return ref.gated_ada_layer_norm(residual, branch, gate, scale, shift, EPS, dit=one_plus_scale)


def _outputs_and_grads(fn, inputs, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
    y, h = fn(*leaves)
    g = torch.Generator().manual_seed(1)
    dy, dh = (torch.randn(y.shape, generator=g).to(y.device, y.dtype) for _ in range(2))
    grads = torch.autograd.grad((y, h), leaves, (dy, dh))
    return [y, h, *grads]


def test_formula_matches_the_definition_in_fp32():
    inputs = _inputs(2, 7, 40, F32)
    got = _outputs_and_grads(lambda *t: cudnorm.gated_ada_layer_norm(*t, EPS), inputs)
    want = _outputs_and_grads(lambda *t: _reference(*t), inputs, torch.float64)
    for name, a, r in zip(("y", "h", "dresidual", "dbranch", "dgate", "dscale", "dshift"), got, want):
        assert a.dtype is F32 and ref.rel_error(a, r) < 1e-5, name


@pytest.mark.parametrize(("arg", "value", "error", "words"), [
    ("residual", torch.randn(2, 40), ValueError, "must be [B, S, D]"),
    ("branch", torch.randn(2, 6, 40), ValueError, "expected the residual's (2, 7, 40)"),
    ("branch", torch.randn(2, 7, 40, dtype=torch.float64), TypeError, "has dtype torch.float64"),
    ("gate", torch.randn(3, 40), ValueError, "expected [B, D] or [B, 1, D] with B=2, D=40"),
    ("scale", torch.randn(2, 40, dtype=BF16), TypeError, "has dtype torch.bfloat16"),
    ("eps", -1.0, ValueError, "must be finite and >= 0"),
])
def test_errors_name_the_function_and_the_argument(arg, value, error, words):
    args = dict(zip(("residual", "branch", "gate", "scale", "shift"), _inputs(2, 7, 40, F32)), eps=EPS)
    args[arg] = value
    with pytest.raises(error, match=rf"cudnorm\.gated_ada_layer_norm: argument '{arg}' .*{words}".replace(
            "[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        cudnorm.gated_ada_layer_norm(**args)


@pytest.mark.parametrize("decided", ["torch", "kernel"])
def test_a_training_call_takes_the_measured_decision(decided, monkeypatch):
    """Past the size rules, with the fused op able to serve: the measured decision of op
    ``gated_ada_layer_norm`` picks the fused op or the formula; without grad, a multiply-add and
    the adaptive LayerNorm."""
    ran, asked = [], []
    monkeypatch.setattr(_policy, "torch_serves", lambda *a: False)
    monkeypatch.setattr(_gated, "supports", lambda *a: True)
    monkeypatch.setattr(_decisions, "serves", lambda op, *a: asked.append(op) or decided)
    monkeypatch.setattr(_gated, "fused", lambda *a: ran.append("fused") or _gated.formula(*a))
    inputs = [t.requires_grad_() for t in _inputs(2, 7, 40, F32)]
    y, h = cudnorm.gated_ada_layer_norm(*inputs, EPS)
    assert asked == [_candidates.GATED] and ran == ([] if decided == "torch" else ["fused"])
    want_y, want_h = _reference(*inputs)
    assert ref.rel_error(y, want_y) < 1e-5 and ref.rel_error(h, want_h) < 1e-6
    asked.clear()
    with torch.no_grad():
        y, h = cudnorm.gated_ada_layer_norm(*inputs, EPS, one_plus_scale=False)
    assert _candidates.GATED not in asked  # the adaptive LayerNorm's own decision only
    assert ref.rel_error(y, _reference(*inputs, one_plus_scale=False)[0]) < 1e-5


@pytest.mark.slow  # torch.compile of a whole graph on the CPU
def test_compile_fullgraph_matches_eager():
    """Traced, the op is the formula in PyTorch's ops (Inductor fuses them), one graph with both
    outputs and their gradients as in eager; a mistake raises the eager error naming the argument."""
    inputs = [t.requires_grad_() for t in _inputs(2, 8, 64, F32)]

    def fn(*t):
        y, h = cudnorm.gated_ada_layer_norm(*t, EPS)
        return y.square().sum() + (h * h.detach()).sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*inputs), inputs)
    want = torch.autograd.grad(fn(*inputs), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    residual, branch, gate, scale, shift = (t.detach() for t in inputs)
    bad = torch.compile(lambda *t: cudnorm.gated_ada_layer_norm(*t), backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="cudnorm.gated_ada_layer_norm: argument 'gate'"):
        bad(residual, branch, torch.randn(3, 64), scale, shift)


def test_candidates_and_the_formulas_closure():
    """The formula always competes; the fused op (``kernel``) where Triton imports; no cuDNN
    candidate of its own. The formula's closure returns the five inputs' gradients."""
    sig = Signature(_candidates.GATED, True, BF16, BF16, BF16, 64, 8)
    kernel = ["kernel"] if _candidates._norm_kernel.available() else []
    assert _candidates.candidates_for(sig) == ["torch"] + kernel
    x, scale, shift = torch.randn(2 * 8, 64, dtype=BF16), torch.randn(2, 64, dtype=BF16), torch.randn(2, 64, dtype=BF16)
    grads = _candidates.CANDIDATES["torch"].prepare(sig, x, scale, shift, EPS)()
    assert [tuple(g.shape) for g in grads] == [(2, 8, 64), (2, 8, 64), (2, 64), (2, 64), (2, 64)]


# (B, S, D, dtype, one_plus_scale, modulation shape, a gradient reaching h)
_CASES = [(1, 5, 8, F32, True, "bd", True), (3, 7, 96, BF16, True, "b1d", True), (3, 13, 40, F32, False, "bd", False),
          (2, 9, 1000, BF16, True, "bd", False)]


def _check_interpreted():
    """Runs in a child process started with ``TRITON_INTERPRET=1``: the fused op (the adaptive
    LayerNorm op's CPU forward, then the backward kernel) under the 2x rule against fp64, eager
    PyTorch in the same dtype the baseline."""
    sys.path.insert(0, str(Path(__file__).parent))
    torch.manual_seed(0)
    for b, s, d, dtype, dit, shape, with_dh in _CASES:
        case = f"{b}x{s}x{d} {dtype} one_plus={dit} {shape} dh={with_dh}"
        inputs = _inputs(b, s, d, dtype, gate_shape=shape)

        def run(fn, inputs=inputs, dtype=None, dit=dit, with_dh=with_dh):
            leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
            y, h = fn(*leaves, dit)
            g = torch.Generator().manual_seed(1)
            dy, dh = (torch.randn(y.shape, generator=g).to(y.dtype) for _ in range(2))
            outs, cots = ((y, h), (dy, dh)) if with_dh else ((y,), (dy,))
            return [y, h, *torch.autograd.grad(outs, leaves, cots)]

        mine = run(lambda *t: _gated.fused(*t[:5], EPS, t[5]))
        eager = run(lambda *t: _gated.formula(*t[:5], EPS, t[5]))
        want = run(lambda *t: _reference(*t), dtype=torch.float64)
        for name, a, e, r in zip(("y", "h", "dresidual", "dbranch", "dgate", "dscale", "dshift"), mine, eager, want):
            assert a.dtype is dtype and a.shape == e.shape, (case, name)
            bound = ref.error_bound(ref.rel_error(e, r), dtype)
            assert ref.rel_error(a, r) <= bound, (case, name, ref.rel_error(a, r), bound)
    print("interpreted cases ok")


def test_interpreted_fused_op_meets_the_2x_rule():
    interpreted.run("test_gated_ada_layer_norm", "_check_interpreted")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [256, 4096])
def test_gpu_training_call_is_served_by_measurement(tokens, tmp_path):
    """An eager training call on a GPU: past the size rule's threshold, the measured decision
    between the formula and the fused op, both timed (below it, no decision: the formula); the
    call meets the 2x rule against fp64 whichever serves, and so does the fused op itself
    (``policy="cudnn"``)."""
    inputs = _inputs(2, tokens, 3072, BF16, device="cuda")
    want = _outputs_and_grads(lambda *t: _reference(*t), inputs, torch.float64)
    eager = _outputs_and_grads(lambda *t: _gated.formula(*t, EPS, True), inputs)
    for policy in ("auto", "cudnn"):
        with cudnorm.config(policy=policy, plan_store=True, plan_store_dir=str(tmp_path / "store")):
            cudnorm.clear_cache()
            got = _outputs_and_grads(lambda *t: cudnorm.gated_ada_layer_norm(*t, EPS), inputs)
            rows = [r for r in cudnorm.serving_decisions() if r["signature"].startswith(f"{_candidates.GATED}/train")]
        if policy == "auto" and _policy.prefers_torch(True, inputs[0].numel()):
            assert rows == [], rows  # under the size rule's threshold (the Python path's is higher): the formula
        elif policy == "auto":
            assert len(rows) == 1 and set(rows[0]["ms"]) == {"torch", "kernel"}, rows
        for name, a, e, r in zip(("y", "h", "dresidual", "dbranch", "dgate", "dscale", "dshift"), got, eager, want):
            assert ref.rel_error(a, r) <= ref.error_bound(ref.rel_error(e, r), BF16), (policy, name)
