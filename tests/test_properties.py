"""Property-based accuracy: hypothesis draws shapes, dtypes, strides (contiguous, row-sliced,
transposed views), eps, parameter presence and dtype, and every op's output and gradients
must meet the 2x-PyTorch error rule against the fp64 reference. Runs cudnorm's own path
(``policy="cudnn"``, conftest): the PyTorch fallback on the CPU, cuDNN on a GPU."""

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import reference as ref

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_N = {"layer_norm": 3, "rms_norm": 2}  # rows_case says why
SETTINGS = hypothesis.settings(max_examples=100, deadline=None, derandomize=True, database=None)


@st.composite
def rows_case(draw, device, min_n):
    """``(x, weight, bias, eps, dy)``: ``x [rows, n]`` in a drawn layout, ``n >= min_n``.
    Degenerate widths are left out, with no bearing on real models: over one element
    LayerNorm's output and gradients are exactly zero (a relative error then compares rounding
    noise with zero) and RMSNorm's dx is pure cancellation (``1 - x_hat^2`` with
    ``x_hat^2 ~ 1``); over two, LayerNorm's output is ``+-1`` up to eps and its dx is of order
    ``eps / var`` times dy, again pure cancellation (an fp32 draw on an H100 found it)."""
    rows, n = draw(st.integers(1, 48)), draw(st.integers(min_n, 320))
    dtype = draw(st.sampled_from(DTYPES))
    layout = draw(st.sampled_from(("contiguous", "row slice", "transposed")))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if layout == "transposed":  # a column-major view: no unit stride along n
        x = torch.randn(n, rows, generator=g).to(device, dtype).t()
    elif layout == "row slice":  # rows of a wider buffer: padded row stride
        x = torch.randn(rows, n + 7, generator=g).to(device, dtype)[:, :n]
    else:
        x = torch.randn(rows, n, generator=g).to(device, dtype)
    wdtype = draw(st.sampled_from(tuple(dict.fromkeys((torch.float32, dtype)))))
    weight = (1 + 0.1 * torch.randn(n, generator=g)).to(device, wdtype) if draw(st.booleans()) else None
    bias = (0.1 * torch.randn(n, generator=g)).to(device, wdtype) if draw(st.booleans()) else None
    eps = draw(st.sampled_from((1e-6, 1e-5, 1e-3)))
    dy = torch.randn(rows, n, generator=g).to(device, dtype)
    return x, weight, bias, eps, dy


def _check(case, op):
    x, weight, bias, eps, dy = case
    n, dtype = x.shape[-1], x.dtype
    cast = (lambda p: None if p is None else p.to(dtype))  # PyTorch's baseline in x's dtype
    if op == "layer_norm":
        inputs, names = (x, weight, bias), ("y", "dx", "dweight", "dbias")
        mine = lambda x, w, b: cudnorm.layer_norm(x, (n,), w, b, eps)  # noqa: E731
        theirs = lambda x, w, b: F.layer_norm(x, (n,), cast(w), cast(b), eps)  # noqa: E731
        exact = lambda x, w, b: ref.layer_norm(x, w, b, eps)  # noqa: E731
    else:
        inputs, names = (x, weight), ("y", "dx", "dweight")
        mine = lambda x, w: cudnorm.rms_norm(x, (n,), w, eps)  # noqa: E731
        theirs = lambda x, w: F.rms_norm(x, (n,), cast(w), eps)  # noqa: E731
        exact = lambda x, w: ref.rms_norm(x, w, eps)  # noqa: E731
    rows = ref.accuracy_report(mine, theirs, exact, inputs, dy, names, dtype)
    assert all(r["ok"] for r in rows), rows


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_random_calls_meet_the_error_rule_cpu(op):
    hypothesis.given(case=rows_case("cpu", MIN_N[op]))(SETTINGS(lambda case: _check(case, op)))()


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_random_calls_meet_the_error_rule_gpu(op):
    # 30 draws: on the GPU every draw builds its own graphs (~0.4 s each), 100 took 80 s per op
    settings = hypothesis.settings(SETTINGS, max_examples=30)
    hypothesis.given(case=rows_case("cuda", MIN_N[op]))(settings(lambda case: _check(case, op)))()


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_random_calls_on_emulated_cudnn_meet_the_error_rule(op, fresh_cache):
    """The same draws through the cuDNN path's own code (layouts, copies, row policy, launch
    addresses) on the CPU, the graphs emulated (tests/emulated_cudnn.py)."""
    import emulated_cudnn as emu  # noqa: PLC0415

    with emu.installed() as launches:
        hypothesis.given(case=rows_case("cpu", MIN_N[op]))(SETTINGS(lambda case: _check(case, op)))()
        assert launches[op, "train"] >= 20 and launches[op, "bwd"] >= 20, launches
