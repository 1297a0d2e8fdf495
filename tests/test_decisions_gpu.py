"""The measured dispatcher on a GPU: a first call measures every candidate and later calls take
its decision (in Python and in C++), every kernel it can pick passes the reference rule at the
widths the sweep found cliffs at, and nothing is timed while a CUDA graph is captured."""

import pytest
import torch

import cudnorm
from cudnorm import _candidates, _decisions, _native

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

BF16 = torch.bfloat16
# widths where cuDNN 9.19 fell off a cliff on an H100, one where it wins, one wide
WIDTHS = (88, 96, 128, 1152, 2240, 4096)


@pytest.fixture(autouse=True)
def fresh(tmp_path):
    # the suite's default is policy "cudnn" without a store (conftest): these tests are of the
    # default policy's measured decisions, kept in a store of their own
    with cudnorm.config(policy="auto", plan_store=True, plan_store_dir=str(tmp_path / "store")):
        cudnorm.clear_cache()
        yield
        cudnorm.clear_cache()


def _force(op, x, weight, bias, training, name):
    """Make ``name`` serve the signature of this call (C++'s table emptied so it asks again)."""
    sig = _candidates.signature(op, training, x, weight, bias, x.shape[-1])
    _decisions._keep((sig, x.get_device(), torch.are_deterministic_algorithms_enabled()), name, {"source": "test"})
    _native.forget()


def _errors(op, x, weight, bias, dy):
    """Relative errors of y, dx and (with a weight) dw against fp64, for cudnorm's call and
    PyTorch's own."""
    def run(fn, xx, ww, bb):
        xx = xx.detach().requires_grad_()
        ww, bb = (None if t is None else t.detach().requires_grad_() for t in (ww, bb))
        y = fn(xx, ww, bb)
        y.backward(dy.to(y.dtype))
        return [y, xx.grad] + ([] if ww is None else [ww.grad])

    def double(t):
        return None if t is None else t.double()

    n = (x.shape[-1],)
    if op == "layer_norm":
        ours = run(lambda a, w, b: cudnorm.layer_norm(a, n, w, b), x, weight, bias)
        theirs = run(lambda a, w, b: torch.nn.functional.layer_norm(a, n, w, b), x, weight, bias)
        ref = run(lambda a, w, b: torch.nn.functional.layer_norm(a, n, w, b), x.double(), double(weight),
                  double(bias))
    else:
        ours = run(lambda a, w, b: cudnorm.rms_norm(a, n, w, 1e-5), x, weight, None)
        theirs = run(lambda a, w, b: torch.nn.functional.rms_norm(a, n, w, 1e-5), x, weight, None)
        ref = run(lambda a, w, b: torch.nn.functional.rms_norm(a, n, w, 1e-5), x.double(), double(weight), None)

    def rel(a, r):
        return ((a.double() - r).norm() / r.norm()).item()
    return [rel(a, r) for a, r in zip(ours, ref)], [rel(a, r) for a, r in zip(theirs, ref)]


@pytest.mark.parametrize("name", ["torch", "cudnn", "kernel"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "bare"])  # bare: the norm inside adaptive norms
@pytest.mark.parametrize("cols", WIDTHS)
def test_every_candidate_passes_the_reference_rule(name, op, affine, cols):
    rows = max(4096, (1 << 21) // cols)
    x = torch.randn(rows, cols, device="cuda", dtype=BF16)
    weight = (1 + 0.1 * torch.randn(cols, device="cuda")).to(BF16) if affine else None
    bias = (0.1 * torch.randn(cols, device="cuda")).to(BF16) if affine and op == "layer_norm" else None
    sig = _candidates.signature(op, True, x, weight, bias, cols)
    if not _candidates.CANDIDATES[name].supports(sig):
        pytest.skip(f"{name} does not serve {sig.key()}")
    _force(op, x, weight, bias, True, name)
    dy = torch.randn_like(x)
    ours, theirs = _errors(op, x, weight, bias, dy)
    served = [r["serves"] for r in cudnorm.serving_decisions() if r["signature"] == sig.key()]
    assert served == [name], (served, name)
    for what, a, t in zip(("y", "dx", "dw"), ours, theirs):
        # PyTorch sums bf16 dW in fp32 and rounds once, as every candidate does: 2x its error, with a floor
        # for the cases where its error is ~0 (an exactly representable result)
        assert a <= 2 * t + 1e-3, f"{name} {op} {cols}: {what} error {a:.3g} vs PyTorch's {t:.3g}"


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_inference_closures_serve_their_candidate_through_the_entry(op):
    """On the native path an inference candidate's closure calls the public function's C++ entry
    with that candidate forced (``_candidates._through_entry``): with the signature decided for
    PyTorch's op, each closure returns bit for bit what the public call returns when its
    candidate serves, so each is timed as a user's call on it runs."""
    from cudnorm import _entry
    cols, rows = 1152, 4096
    x = torch.randn(rows, cols, device="cuda", dtype=BF16)
    weight = (1 + 0.1 * torch.randn(cols, device="cuda")).to(BF16)
    bias = (0.1 * torch.randn(cols, device="cuda")).to(BF16) if op == "layer_norm" else None

    def public():
        with torch.no_grad():
            if op == "layer_norm":
                return cudnorm.layer_norm(x, (cols,), weight, bias, 1e-5)
            return cudnorm.rms_norm(x, (cols,), weight, 1e-5)
    public()
    if not _entry.native:
        pytest.skip("the native path is off: closures call the custom ops")
    sig = _candidates.signature(op, False, x, weight, bias, cols)
    names = [n for n in ("torch", "cudnn", "kernel") if _candidates.CANDIDATES[n].supports(sig)]
    served = {}
    for name in names:
        _force(op, x, weight, bias, False, name)
        served[name] = public()
    _force(op, x, weight, bias, False, "torch")
    with torch.no_grad():
        timed = {n: _candidates.CANDIDATES[n].prepare(sig, x, weight, bias, 1e-5)() for n in names}
    for name in names:
        assert torch.equal(timed[name], served[name]), name
    # the check above tells servers apart only where their outputs differ
    assert any(not torch.equal(served[n], served["torch"]) for n in names if n != "torch"), names
    # a forced call the entry would hand to Python (float64) raises: Python would measure it again
    code = _entry.SERVERS["cudnn"]
    with pytest.raises(RuntimeError, match="left the native path"):
        if op == "layer_norm":
            _entry.layer_norm(x.double(), [cols], None, None, 1e-5, code)
        else:
            _entry.rms_norm(x.double(), [cols], None, 1e-5, 0.0, code)


def test_first_call_measures_and_later_calls_reuse(tmp_path):
    x = torch.randn(1 << 18, 96, device="cuda", dtype=BF16, requires_grad=True)  # 2^24+: measured on either path
    weight = torch.ones(96, device="cuda", dtype=BF16, requires_grad=True)
    bias = torch.zeros(96, device="cuda", dtype=BF16, requires_grad=True)
    cudnorm.layer_norm(x, (96,), weight, bias).sum().backward()
    [row] = [r for r in cudnorm.serving_decisions() if "/n=96/" in r["signature"]]
    assert row["source"] in ("measured", "prior") and row["serves"] in ("torch", "cudnn", "kernel")
    if row["source"] == "measured":
        assert set(row["ms"]) >= {"torch"}, row
        # "settle": the paired rounds, where the lead was inside the spreads
        assert {"prepare", "first", "timing"} <= set(row["cost_ms"]) <= {"prepare", "first", "timing", "settle"}, row
        assert row["cost_ms"]["timing"] > 0 and sum(row["rounds"].values()) >= len(row["ms"]), row
        # each candidate timed in rounds keeps its GPU time, at most its GPU plus host time
        assert all(0 < row["gpu_ms"][n] <= row["ms"][n] for n in row["gpu_ms"]) and row["gpu_ms"], row
    before = cudnorm.cache_info().caches.get("native", {})
    for _ in range(3):
        cudnorm.layer_norm(x, (96,), weight, bias).sum().backward()
    assert len([r for r in cudnorm.serving_decisions() if "/n=96/" in r["signature"]]) == 1
    assert cudnorm.plan_store_info()["decisions"] >= (row["source"] == "measured")
    assert cudnorm.cache_info().caches.get("native", {}).get("resolved", 0) >= before.get("resolved", 0)


def test_decision_is_stored_for_the_next_process(tmp_path):
    x = torch.randn(1 << 15, 2240, device="cuda", dtype=BF16)
    w = torch.ones(2240, device="cuda", dtype=BF16)
    cudnorm.rms_norm(x, (2240,), w)
    [row] = cudnorm.serving_decisions()
    cudnorm.clear_cache()  # as a new process: the store answers without timing
    cudnorm.rms_norm(x, (2240,), w)
    [again] = cudnorm.serving_decisions()
    assert again["serves"] == row["serves"]
    assert again["source"] in ("stored", "prior", "only candidate")


def test_nothing_is_timed_during_capture(monkeypatch):
    x = torch.randn(1 << 14, 104, device="cuda", dtype=BF16)
    w = torch.ones(104, device="cuda", dtype=BF16)
    static_y = cudnorm.rms_norm(x, (104,), w)  # warm-up outside the capture (it may measure)
    cudnorm.clear_cache()  # its decision forgotten: the captured call has to decide again
    monkeypatch.setattr(_decisions, "measure", lambda *a, **k: pytest.fail("timed during capture"))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        static_y = cudnorm.rms_norm(x, (104,), w)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_y, torch.nn.functional.rms_norm(x, (104,), w), atol=2e-2, rtol=2e-2)
    assert not [r for r in cudnorm.serving_decisions() if r["source"] == "measured"]


def test_deterministic_mode_keeps_to_deterministic_candidates():
    # 2^24 elements: measured on either launch path (the Python path hands smaller calls to PyTorch)
    x = torch.randn(1 << 17, 128, device="cuda", dtype=BF16)
    w = torch.ones(128, device="cuda", dtype=BF16)
    torch.use_deterministic_algorithms(True)
    try:
        cudnorm.rms_norm(x, (128,), w)
        rows = [r for r in cudnorm.serving_decisions() if r["deterministic"]]
        assert rows and all(r["serves"] in ("torch", "kernel") for r in rows)
    finally:
        torch.use_deterministic_algorithms(False)
