"""The cuDNN path's own code (specs, strategies, row chunks, per-sample address steps,
statistics layouts) run on the CPU against emulated graphs (tests/emulated_cudnn.py), every
result compared with PyTorch's fp32 formula. Runs in CI; cuDNN's kernels are tested on the GPU."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _ada_strategies as strategies
from cudnorm import _rows
from cudnorm import reference as ref

import emulated_cudnn as emu

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture
def emulated(fresh_cache):
    _rows.reset()
    with emu.installed() as launches:
        yield launches


def _meets_the_rule(candidate, baseline, reference, inputs, dy, names):
    """Output and gradients (training), and the output under no_grad (inference), within 2x
    PyTorch's own error in the same dtype against the fp64 reference."""
    dtype = inputs[0].dtype
    rows = ref.accuracy_report(candidate, baseline, reference, inputs, dy, names, dtype)
    assert all(row["ok"] for row in rows), rows
    with torch.no_grad():
        want = reference(*inputs)
        bound = ref.error_bound(ref.rel_error(baseline(*inputs), want), dtype)
        assert ref.rel_error(candidate(*inputs), want) <= bound


def _norm_case(op, rows, dtype):
    n = 256
    x = torch.randn(rows, n).to(dtype)
    w = (1 + 0.1 * torch.randn(n)).to(dtype)
    dy = torch.randn(rows, n).to(dtype)
    if op == "layer_norm":
        b = (0.1 * torch.randn(n)).to(dtype)
        _meets_the_rule(lambda x, w, b: cudnorm.layer_norm(x, (n,), w, b), lambda x, w, b: F.layer_norm(x, (n,), w, b),
                        lambda x, w, b: ref.layer_norm(x, w, b), (x, w, b), dy, ("y", "dx", "dweight", "dbias"))
    else:
        _meets_the_rule(lambda x, w: cudnorm.rms_norm(x, (n,), w, 1e-6), lambda x, w: F.rms_norm(x, (n,), w, 1e-6),
                        lambda x, w: ref.rms_norm(x, w, 1e-6), (x, w), dy, ("y", "dx", "dweight"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_layer_and_rms_norm(op, dtype, emulated):
    """The first row count of a family runs exact graphs (the address path); later ones run
    PyTorch's kernels until seen again, then row chunks of shared graphs (an overlapping last
    chunk where the count is not a sum of chunk sizes)."""
    _norm_case(op, 256, dtype)
    assert {phase for (o, phase) in emulated if o == op} == {"train", "bwd", "infer"}, emulated
    before = sum(emulated.values())
    for rows in (4100, 4100, 300, 300):
        _norm_case(op, rows, dtype)
    assert cudnorm.cache_info().chunked_calls > 0 and sum(emulated.values()) > before, emulated


def test_strided_rows_gemma_offset_and_residual(emulated):
    n = 128
    base = torch.randn(64, 2 * n)
    x = base[:, :n]  # rows 2n apart: the graph reads them with that stride
    w = 0.1 * torch.randn(n)
    got = cudnorm.rms_norm(x, (n,), w, 1e-6, weight_offset=1.0)
    torch.testing.assert_close(got, F.rms_norm(x, (n,), w + 1.0, 1e-6), **TOL[torch.float32])
    r = torch.randn(64, n)
    y, h = cudnorm.layer_norm(x, (n,), 1 + w, w, residual=r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, F.layer_norm(x + r, (n,), 1 + w, w), **TOL[torch.float32])
    assert emulated["rms_norm", "train"] + emulated["rms_norm", "infer"] >= 1
    assert emulated["layer_norm", "infer"] + emulated["layer_norm", "train"] >= 1


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])  # fp32 weights: rounded for the forward
@pytest.mark.parametrize("op, variant", [("layer_norm", "plain"), ("layer_norm", "residual"), ("rms_norm", "plain"),
                                         ("rms_norm", "residual"), ("rms_norm", "offset"),
                                         ("rms_norm", "residual+offset")])  # LayerNorm takes no offset
def test_residual_offset_and_fp32_weights(op, variant, wdtype, emulated):
    """bf16 input: the fused residual add (forward graph with the add, backward graph + dh)
    and Gemma's weight offset (RMSNorm), forward and backward, within the 2x rule."""
    m, n = 512, 256
    x, r, dy = (torch.randn(m, n).bfloat16() for _ in range(3))
    w = (0.1 * torch.randn(n) + (0.0 if "offset" in variant else 1.0)).to(wdtype)
    offset = {"weight_offset": 1.0} if "offset" in variant else {}
    if op == "layer_norm":
        params, names = (w, (0.1 * torch.randn(n)).to(wdtype)), ("dweight", "dbias")
        ours = lambda x, *p, **k: cudnorm.layer_norm(x, (n,), *p, **k)  # noqa: E731
        theirs = lambda x, w, b: F.layer_norm(x, (n,), w.to(x.dtype), b.to(x.dtype))  # noqa: E731
        exact = lambda x, w, b: ref.layer_norm(x, w, b)  # noqa: E731
    else:
        params, names = (w,), ("dweight",)
        ours = lambda x, w, **k: cudnorm.rms_norm(x, (n,), w, 1e-6, **offset, **k)  # noqa: E731
        theirs = lambda x, w: F.rms_norm(x, (n,), (w.float() + (1.0 if offset else 0.0)).to(x.dtype), 1e-6)  # noqa: E731
        exact = lambda x, w: ref.rms_norm(x, w.double() + (1.0 if offset else 0.0), 1e-6)  # noqa: E731
    if "residual" in variant:  # (y, h) of h = x + r, both used: their gradients reach x and r alike
        both = torch.randn(m, 2 * n).bfloat16()
        _meets_the_rule(lambda x, r, *p: torch.cat(ours(x, *p, residual=r), -1),
                        lambda x, r, *p: torch.cat((theirs(x + r, *p), x + r), -1),
                        lambda x, r, *p: torch.cat((exact(x.double() + r.double(), *p), x.double() + r.double()), -1),
                        (x, r, *params), both, ("y and h", "dx", "dresidual", *names))
        y, h = ours(x, *params, residual=r)
        torch.testing.assert_close(h, x + r)
        assert emulated[op, "train"] + emulated[op, "infer"] >= 2 and emulated[op, "bwd"] >= 1, emulated
    else:
        _meets_the_rule(ours, theirs, exact, (x, *params), dy, ("y", "dx", *names))
        assert emulated[op, "train"] >= 1 and emulated[op, "bwd"] >= 1, emulated


STRATEGIES = [(f, b) for f in ("cudnn", "per_sample") for b in ("cudnn", "per_sample")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 64, 96), (3, 30, 64), (1, 16, 128)])  # S % 4 != 0: padded statistics
@pytest.mark.parametrize("dit", [True, False])
@pytest.mark.parametrize("forward, backward", STRATEGIES)
def test_ada_layer_norm_every_strategy(forward, backward, dit, shape, dtype, emulated):
    b, s, d = shape
    x = torch.randn(shape).to(dtype)
    scale = ((0.0 if dit else 1.0) + 0.1 * torch.randn(b, d)).to(dtype)
    shift = (0.1 * torch.randn(b, d)).to(dtype)
    dy = torch.randn(shape).to(dtype)

    with cudnorm.config(ada_forward=forward, ada_backward=backward):
        _meets_the_rule(lambda x, sc, sh: cudnorm.ada_layer_norm(x, sc, sh, 1e-6, one_plus_scale=dit),
                        lambda x, sc, sh: ref.ada_layer_norm_eager(x, sc, sh, 1e-6, dit),
                        lambda x, sc, sh: ref.ada_layer_norm(x, sc, sh, 1e-6, dit=dit),
                        (x, scale, shift), dy, ("y", "dx", "dscale", "dshift"))
    # the strategy ran where the layout lets it (a per-sample forward needs S % 4 == 0)
    fwd_op = "layer_norm" if forward == "per_sample" and s % 4 == 0 else "ada_layer_norm"
    bwd_op = "layer_norm" if backward == "per_sample" else "ada_layer_norm"
    assert emulated[fwd_op, "train"] >= 1 and emulated[fwd_op, "infer"] >= 1, emulated
    assert emulated[bwd_op, "bwd"] >= 1, emulated


def test_warmup_specs_are_the_specs_the_strategies_build(emulated):
    """``specs_for`` (warmup) asks for the specs the op's strategies request."""

    for forward, backward in STRATEGIES:
        with cudnorm.config(ada_forward=forward, ada_backward=backward), cudnorm.record_specs() as recorded:
            x = torch.randn(2, 64, 96, requires_grad=True)
            scale, shift = torch.randn(2, 96, requires_grad=True), torch.randn(2, 96)
            cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True).sum().backward()
            expected = strategies.specs_for(2, 64, 96, torch.float32, torch.float32, None, phases=("train", "bwd"))
        assert sorted(map(str, recorded.specs)) == sorted(map(str, expected)), (forward, backward)


def _op_cases():
    x, w, b = torch.randn(8, 64), torch.randn(64), torch.randn(64)
    xa, sa = torch.randn(2, 8, 64), torch.randn(2, 64)
    grad = lambda *ts: [t.clone().requires_grad_() for t in ts]  # noqa: E731
    ops = torch.ops.cudnorm
    return {
        "layer_norm_fwd train": (ops.layer_norm_fwd, (*grad(x, w, b), 1e-5, True)),
        "layer_norm_fwd infer": (ops.layer_norm_fwd, (x, w, b, 1e-5, False)),
        "rms_norm_fwd offset": (ops.rms_norm_fwd, (*grad(x, w), 1e-6, True, 1.0)),
        "layer_norm_bwd": (ops.layer_norm_bwd, (torch.randn(8, 64), x, w, ops.layer_norm_fwd(x, w, b, 1e-5, True)[1])),
        "rms_norm_bwd": (ops.rms_norm_bwd, (torch.randn(8, 64), x, w, ops.rms_norm_fwd(x, w, 1e-6, True)[1])),
        "ada_layer_norm_fwd": (ops.ada_layer_norm_fwd, (*grad(xa, sa, sa), 1e-6, True, True)),
        "ada_layer_norm_bwd": (ops.ada_layer_norm_bwd, (torch.randn(2, 8, 64), xa, sa,
                                                        ops.ada_layer_norm_fwd(xa, sa, sa, 1e-6, True, True)[1],
                                                        True, torch.float32)),
        "add_norm_fwd": (ops.add_norm_fwd, (*grad(x, x, w), None, 1e-6, True, True, 0.0)),
    }


@pytest.mark.parametrize("case", ["layer_norm_fwd train", "layer_norm_fwd infer", "rms_norm_fwd offset", "layer_norm_bwd",
                                  "rms_norm_bwd", "ada_layer_norm_fwd", "ada_layer_norm_bwd", "add_norm_fwd"])
def test_opcheck_on_the_cudnn_path(case, emulated):
    """``torch.library.opcheck`` (schema, fake tensors, autograd registration, AOT dispatch)
    of each custom op where its implementation takes the cuDNN path."""
    op, args = _op_cases()[case]
    before = sum(emulated.values())
    torch.library.opcheck(op.default, args)
    assert sum(emulated.values()) > before, emulated
