"""The call-signature memo (cudnorm._call_plans): a repeated call skips spec and plan lookup,
and everything that must still see every call does.

On the CPU, CPU tensors are routed to the "cuDNN" branch and every build returns a
:class:`RecordingPlan`, a real ``_graphs.Plan`` whose launch records what it was handed.
"""

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _cache, _call_plans, _dispatch, _graphs, _rows, _runtime


class RecordingPlan(_graphs.Plan):
    """A built plan as far as the dispatch code can tell; a launch records its buffers."""

    def __init__(self, spec):
        super().__init__(spec=spec, graph=None, uids=(), workspace_size=0, plan_name="recording", build_seconds=0.0)
        self.launches = []

    def run(self, *buffers):
        named = dict(zip(_graphs.roles(self.spec), buffers, strict=True))
        assert named["x"].data_ptr() % 16 == 0
        self.launches.append(named)


@pytest.fixture
def recording(monkeypatch, fresh_cache):
    monkeypatch.setattr(_runtime, "route", lambda x: None)
    monkeypatch.setattr(_cache, "_build", RecordingPlan)
    looked_up = []
    real = _rows.plan_or_chunks

    def spy(spec):
        looked_up.append(spec)
        return real(spec)

    monkeypatch.setattr(_rows, "plan_or_chunks", spy)
    return looked_up


def _ln(x, n=64):
    with torch.no_grad():
        return cudnorm.layer_norm(x, (n,), torch.ones(n, dtype=x.dtype), torch.zeros(n, dtype=x.dtype))


def test_repeated_signature_skips_the_lookup_and_counts_a_hit(recording):
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    _ln(x)
    hits = cudnorm.cache_info().hits
    _ln(torch.randn(8, 64, dtype=torch.bfloat16))
    _ln(x)
    assert len(recording) == 1  # only the first call derived spec and plan
    assert cudnorm.cache_info().hits == hits + 2
    plan = _cache.plans.lookup(recording[0])
    assert len(plan.launches) == 3 and plan.launches[1]["x"].data_ptr() != x.data_ptr()


@pytest.mark.parametrize("change", ["rows", "dtype", "stride", "phase", "op"])
def test_another_signature_takes_the_full_path(recording, change):
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    _ln(x)
    if change == "rows":
        _ln(torch.randn(9, 64, dtype=torch.bfloat16))
    elif change == "dtype":
        _ln(torch.randn(8, 64, dtype=torch.float16))
    elif change == "stride":
        _ln(torch.randn(8, 128, dtype=torch.bfloat16)[:, :64])
    elif change == "phase":
        cudnorm.layer_norm(x.requires_grad_(), (64,))
    else:
        with torch.no_grad():
            cudnorm.rms_norm(x, (64,))
    assert len(recording) == 2
    # padded rows are copied into packed ones first (cuDNN 9.19 declines them): the same spec
    assert (recording[0] != recording[1]) == (change != "stride")


def test_misaligned_input_with_a_known_signature_is_copied(recording):
    base = torch.randn(8 * 64 + 1, dtype=torch.bfloat16)
    aligned = base[: 8 * 64].view(8, 64)
    misaligned = base[1:].view(8, 64)  # same shape and strides, address 2 bytes off
    assert aligned.data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 != 0
    _ln(aligned)
    _ln(misaligned)  # RecordingPlan.run asserts the address it is handed is aligned
    assert len(recording) == 2
    plan = _cache.plans.lookup(recording[0])
    assert torch.equal(plan.launches[-1]["x"], misaligned)


def test_clear_cache_and_config_changes_empty_the_memo(recording):
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    _ln(x)
    cudnorm.clear_cache()
    assert len(_call_plans._norm_calls) == 0
    _ln(x)
    assert len(recording) == 2
    cudnorm.config(cache_size=100)  # any change makes a new configuration object
    _ln(x)
    assert len(recording) == 3


def test_record_specs_sees_memoised_calls(recording, tmp_path):
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    _ln(x)
    with cudnorm.record_specs(tmp_path / "specs.json") as rec:
        _ln(x)
    assert rec.specs == [recording[0]]


def test_chunked_calls_are_not_memoised(recording, monkeypatch):
    cudnorm.config(exact_rows=0)
    monkeypatch.setattr(_rows, "CHUNK_ROWS", {"train": (8, 4), "infer": (8, 4), "bwd": (8, 4)})
    x = torch.randn(12, 64, dtype=torch.bfloat16)
    _ln(x)
    _ln(x)
    assert len([s for s in recording if s.rows == 12]) == 2  # the row policy saw both calls
    assert len(_call_plans._norm_calls) == 0
    assert cudnorm.cache_info().chunked_calls == 2


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_wide_forwards_run_pytorchs_kernel_and_backward_stays_on_cudnn(op, recording, monkeypatch):
    """From ``NATIVE_FORWARD_MIN_COLS`` columns the forward runs PyTorch's fused kernel (with
    fp32 weights rounded as for cuDNN) and asks for no forward graph; the backward still
    runs the cuDNN graph, fed the statistics PyTorch's kernel saved."""
    monkeypatch.setattr(_dispatch, "NATIVE_FORWARD_MIN_COLS", 64)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    w, b = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)
    call = (lambda: cudnorm.layer_norm(x, (64,), w, b)) if op == "layer_norm" else (lambda: cudnorm.rms_norm(x, (64,), w, 1e-6))
    with torch.no_grad():
        y_infer = call()
    y = call()
    assert recording == []  # no forward graph requested
    wb = w.to(torch.bfloat16).float()
    if op == "layer_norm":
        expected = F.layer_norm(x.float(), (64,), wb, b.to(torch.bfloat16).float())
    else:
        expected = x.float() * torch.rsqrt(x.float().square().mean(1, keepdim=True) + 1e-6) * wb
    for out in (y, y_infer):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=2e-2)
    (saved,) = y.grad_fn.saved_tensors[2:]  # LayerNorm (x, w, [mean; rstd]), RMSNorm (x, w, rstd)
    assert saved.shape == ((2, 8) if op == "layer_norm" else (8,)) and saved.dtype == torch.float32
    rstd = saved[1] if op == "layer_norm" else saved
    torch.testing.assert_close(rstd, torch.rsqrt(
        (x.float().var(1, unbiased=False) if op == "layer_norm" else x.float().square().mean(1))
        + (1e-5 if op == "layer_norm" else 1e-6)), rtol=8e-3, atol=0)  # CPU LayerNorm: bf16 statistics
    y.backward(torch.ones_like(y))
    assert [(s.op, s.phase) for s in recording] == [(op, "bwd")]
    launched = _cache.plans.lookup(recording[0]).launches[0]["rstd"]
    assert launched.data_ptr() == rstd.data_ptr() and torch.equal(launched, rstd)
