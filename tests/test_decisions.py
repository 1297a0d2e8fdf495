"""The measured dispatcher (cudnorm._decisions, cudnorm._candidates) on a CPU: signatures, the
winner rule, the plan store's decisions (first writer wins), the prior, and the cases where
nothing may be timed. Timing itself needs a GPU (tests/test_decisions_gpu.py)."""

import json
import threading
import time

import pytest
import torch

import cudnorm
from cudnorm import _candidates, _decisions, _entry, _plan_store, _runtime
from cudnorm._candidates import Signature, Timing
from cudnorm._plan_store import PlanStore

BF16 = torch.bfloat16


def _sig(cols=88, rows_bucket=18, training=True, op="layer_norm"):
    return Signature(op, training, BF16, BF16, BF16 if op == "layer_norm" else None, cols, rows_bucket)


def test_signature_buckets_rows_by_powers_of_two():
    x = torch.empty(3, 1000, 88, dtype=BF16)
    sig = _candidates.signature("layer_norm", True, x, torch.empty(88, dtype=BF16), None, 88)
    assert sig == Signature("layer_norm", True, BF16, BF16, None, 88, (3000).bit_length())
    same = _candidates.signature("layer_norm", True, torch.empty(2049, 88, dtype=BF16), torch.empty(88, dtype=BF16),
                                 None, 88)
    assert same.rows_bucket == sig.rows_bucket, "3000 and 2049 rows are in one bucket"
    assert sig.key() == "layer_norm/train/bf16/w=bf16/b=none/n=88/r=12"


def test_winner_needs_more_than_the_spread():
    torch_ms = Timing(1.0, 0.01, 3)
    assert _candidates.winner({"torch": torch_ms, "cudnn": Timing(0.5, 0.01, 3)}) == "cudnn"
    assert _candidates.winner({"torch": torch_ms, "cudnn": Timing(0.99, 0.0, 3)}) == "torch", "inside MIN_GAIN"
    assert _candidates.winner({"torch": Timing(1.0, 0.2, 3), "cudnn": Timing(0.85, 0.0, 3)}) == "torch", \
        "inside the spread"
    assert _candidates.winner({"torch": torch_ms, "cudnn": Timing(8.0, 0.0, 1), "kernel": Timing(0.4, 0.0, 3)}) \
        == "kernel"
    assert _candidates.winner({"cudnn": Timing(1.0, 0.0, 3), "kernel": Timing(2.0, 0.0, 3)}, "torch") == "cudnn"
    assert _candidates.winner({}, "torch") == "torch"


def test_a_lead_inside_the_spreads_is_decided_on_paired_rounds():
    """One slow round of the leader widens its spread past a 12% lead: three rounds cannot
    tell, nine paired rounds can (the lead holds in eight); a lead that holds in fewer than
    three rounds of four stays PyTorch's, however far its median is ahead."""
    torch_rounds = [0.183, 0.182, 0.184]
    first = {"torch": Timing.of(torch_rounds), "kernel": Timing.of([0.162, 0.161, 0.183])}
    assert _candidates.winner(first) == "torch", "12% lead, 13% + 1% spreads"
    assert _candidates.unsettled(first) == "kernel"
    settled = {"torch": Timing.of(torch_rounds + [0.183] * 6), "kernel": Timing.of([0.162, 0.161, 0.183] + [0.161] * 6)}
    assert _candidates.unsettled(settled) is None
    assert _candidates.winner(settled) == "kernel"
    mixed = [0.162, 0.161, 0.183, 0.16, 0.185, 0.16, 0.186, 0.161, 0.184]  # ahead in five rounds of nine
    assert _candidates.winner({"torch": Timing.of(torch_rounds + [0.183] * 6), "kernel": Timing.of(mixed)}) == "torch"
    assert _candidates.unsettled({"torch": Timing.of(torch_rounds), "kernel": Timing.of([0.1, 0.1, 0.1])}) is None, \
        "a lead beyond the spreads is decided at once"
    assert _candidates.unsettled({"torch": Timing.of(torch_rounds), "kernel": Timing.of([0.18, 0.179, 0.181])}) \
        is None, "a lead inside MIN_GAIN is PyTorch's at once"
    assert _candidates.unsettled({"kernel": Timing.of([0.1, 0.2, 0.1])}) is None, "no baseline timed"


def test_a_candidate_slower_on_the_gpu_does_not_serve():
    """Charged GPU plus host time, a candidate saving host time could serve with more GPU time
    than PyTorch's op; it may not beyond MIN_GAIN (LayerNorm inference at 5568 on an H200: the
    kernel 0.063 against 0.059 ms of GPU, 0.012 against 0.022 ms of host)."""
    torch_t = Timing.of([0.0812] * 3, [0.0593] * 3)
    assert _candidates.winner({"torch": torch_t, "kernel": Timing.of([0.0744] * 3, [0.0630] * 3)}) == "torch"
    assert _candidates.winner({"torch": torch_t, "kernel": Timing.of([0.0744] * 3, [0.0600] * 3)}) == "kernel", \
        "1% more GPU time, within MIN_GAIN"
    assert _candidates.winner({"torch": torch_t, "cudnn": Timing.of([0.070] * 3, [0.0650] * 3),
                               "kernel": Timing.of([0.074] * 3, [0.0580] * 3)}) == "kernel", \
        "the fastest of those not slower on the GPU"
    assert _candidates.unsettled({"torch": Timing.of([0.0812, 0.08, 0.09], [0.0593] * 3),
                                  "kernel": Timing.of([0.0744, 0.074, 0.08], [0.0630] * 3)}) is None
    assert _candidates.winner({"torch": Timing(1.0, 0.0, 3), "kernel": Timing(0.5, 0.0, 3)}) == "kernel", \
        "without GPU times kept, the sum decides"


class _FakeEvent:
    """A CUDA event on a CPU: ``elapsed_time`` reports the GPU ms the test's kernels would take."""
    gpu_ms = {}

    def __init__(self, enable_timing=True):
        self.calls = 0

    def record(self, stream=None):
        self.calls = _FakeEvent.gpu_ms["calls"]

    def synchronize(self):
        pass

    def query(self):  # the GPU sleep outlasted the host's enqueueing
        return False

    def elapsed_time(self, end):
        return (end.calls - self.calls) * _FakeEvent.gpu_ms["per_call"]


def _fake_closure(gpu_ms: float, host_ms: float):
    """A call taking ``gpu_ms`` on :class:`_FakeEvent`'s GPU and ``host_ms`` of the host's time."""
    def run():
        _FakeEvent.gpu_ms.update(per_call=gpu_ms, calls=_FakeEvent.gpu_ms["calls"] + 1)
        end = time.perf_counter() + host_ms / 1e3
        while time.perf_counter() < end:
            pass
    return run


def test_candidates_are_charged_gpu_plus_host_time(monkeypatch):
    """A candidate that saves GPU time but costs more host time per call than it saves (cuDNN's
    execute against PyTorch's launch, in a host-bound step) does not replace PyTorch's op."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)

    _FakeEvent.gpu_ms.update(calls=0, per_call=0.0)
    hosts = {}
    fast_gpu_slow_host = _fake_closure(0.030, 0.400)  # saves 20 us of GPU, costs 390 us more host
    ms = _candidates._elapsed_ms(fast_gpu_slow_host, 3, hosts)
    assert ms == pytest.approx(0.030 + hosts[fast_gpu_slow_host], rel=1e-6)
    assert hosts[fast_gpu_slow_host] >= 0.4
    timings = {"torch": Timing(_candidates._elapsed_ms(_fake_closure(0.050, 0.010), 3, hosts), 0.0, 3),
               "cudnn": Timing(ms, 0.0, 3)}
    assert _candidates.winner(timings) == "torch"
    big = {"torch": Timing(_candidates._elapsed_ms(_fake_closure(2.0, 0.010), 3, hosts), 0.0, 3),
           "cudnn": Timing(_candidates._elapsed_ms(_fake_closure(1.0, 0.030), 3, hosts), 0.0, 3)}
    assert _candidates.winner(big) == "cudnn", "a GPU saving larger than the host cost wins"


def test_settle_times_the_leader_and_the_baseline_again(monkeypatch):
    """:func:`settle` times only the unsettled leader and the baseline, in alternating order,
    and the decision then follows the pairs; a clear decision is returned untouched."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    ms = {"torch": 0.183, "cudnn": 0.5, "kernel": 0.161}
    closures = {name: (lambda: None) for name in ms}
    names = {id(fn): name for name, fn in closures.items()}
    order = []

    def elapsed(fn, reps, hosts):
        order.append(names[id(fn)])
        hosts[fn] = 0.0  # as _elapsed_ms keeps each closure's host ms
        return ms[names[id(fn)]]

    monkeypatch.setattr(_candidates, "_elapsed_ms", elapsed)
    timings = {"torch": Timing.of([0.183, 0.182, 0.184]), "cudnn": Timing(0.5, 0.0, 1),
               "kernel": Timing.of([0.162, 0.161, 0.183])}
    cost = {}
    settled = _candidates.settle(closures, timings, device=None, cost=cost)
    assert settled["cudnn"] is timings["cudnn"] and "cudnn" not in order
    assert settled["kernel"].rounds == settled["torch"].rounds == 3 + _candidates.SETTLE_ROUNDS
    assert settled["kernel"].samples[:3] == timings["kernel"].samples
    assert order[:4] == ["torch", "kernel", "kernel", "torch"], "the pair's order alternates"
    assert "settle" in cost and _candidates.winner(settled) == "kernel"
    clear = {"torch": Timing.of([0.183, 0.182, 0.184]), "kernel": Timing.of([0.1, 0.1, 0.1])}
    assert _candidates.settle(closures, clear) is clear


def test_settle_times_every_candidate_ahead_with_the_leader(monkeypatch):
    """Where the unsettled leader's lead does not hold in the paired rounds, the next candidate
    ahead of the baseline was timed in the same rounds and is judged on its own pairs, not on a
    baseline spread the rounds widened (RMSNorm training 6400 x 5242 on an H200: cuDNN settled
    and fell back, the kernel led PyTorch's op by 22% and PyTorch's op served)."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    rounds = {"torch": iter([0.30, 0.23, 0.31, 0.22, 0.30, 0.24]), "cudnn": iter([0.25, 0.25, 0.24, 0.26, 0.25, 0.25]),
              "kernel": iter([0.192, 0.193, 0.192, 0.191, 0.192, 0.193])}
    closures = {name: (lambda: None) for name in rounds}
    names = {id(fn): name for name, fn in closures.items()}
    timed = []

    def elapsed(fn, reps, hosts):
        timed.append(names[id(fn)])
        hosts[fn] = 0.0
        return next(rounds[names[id(fn)]])

    monkeypatch.setattr(_candidates, "_elapsed_ms", elapsed)
    timings = {"torch": Timing.of([0.235, 0.30, 0.19]), "cudnn": Timing.of([0.15, 0.19, 0.25]),
               "kernel": Timing.of([0.192, 0.193, 0.191])}
    assert _candidates.unsettled(timings) == "cudnn"
    settled = _candidates.settle(closures, timings, device=None)
    assert sorted(set(timed)) == ["cudnn", "kernel", "torch"]
    assert settled["kernel"].rounds == settled["torch"].rounds == 3 + _candidates.SETTLE_ROUNDS
    assert _candidates.winner(settled) == "kernel"
    behind = {**timings, "kernel": Timing.of([0.24, 0.24, 0.24])}  # not ahead by MIN_GAIN: not timed again
    timed.clear()
    rounds.update(torch=iter([0.235] * 6), cudnn=iter([0.25] * 6))
    assert _candidates.settle(closures, behind, device=None)["kernel"] is behind["kernel"] and "kernel" not in timed


class _SharedBackwardArgs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every backward op (``*backward*``/``*bwd*``) that receives two tensors sharing memory."""

    def __init__(self):
        super().__init__()
        self.backwards, self.shared = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "backward" in name or "bwd" in name:
            self.backwards.append(name)
            ptrs = [a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor) and a.numel()]
            if len(set(ptrs)) < len(ptrs):
                self.shared.append(name)
        return func(*args, **(kwargs or {}))


def _storages(tensors) -> list[int]:
    return [t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()]


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", _candidates.ADA_LAYER_NORM, _candidates.AFFINE_MODULATED,
                                "ada_rms_norm", _candidates.MODULATED_RMS, _candidates.GATED,
                                _candidates.TOKEN_LAYER_NORM])
def test_training_closures_take_a_gradient_of_their_own(op, monkeypatch):
    """A candidate's training closure runs its backward on a gradient of its own, never on its
    input: with the input as its gradient a backward reads one tensor twice and L2 serves half
    of it, which made PyTorch's backward read 20-25% faster than in a step (H200,
    docs/performance.md, Decisions). No backward op gets two tensors sharing memory, the
    gradients handed to autograd share none with its leaves or each other, and none is drawn
    from the caller's random numbers (a seeded job would draw others after a measurement)."""
    per_sample = op in _candidates.MODULATED and op not in _candidates.TOKEN
    sig = Signature(op, True, torch.float32, None if op == "rms_norm" else torch.float32,
                    torch.float32 if op == "layer_norm" or op in _candidates.MODULATED else None, 64, 6)
    x = torch.randn(2 * 16, 64)
    shape = (2, 64) if per_sample else (2 * 16, 64) if op in _candidates.TOKEN else (64,)
    w = torch.randn(shape) if sig.weight else None
    b = torch.randn(shape) if sig.bias else None
    handed = []
    grad = torch.autograd.grad

    def recording_grad(outputs, inputs, grad_outputs=None, **kwargs):
        handed.append((_storages(torch.utils._pytree.tree_leaves(inputs)),
                       _storages(torch.utils._pytree.tree_leaves(grad_outputs))))
        return grad(outputs, inputs, grad_outputs, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", recording_grad)
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    ran = 0
    for name in _candidates.candidates_for(sig):
        handed.clear()
        try:
            run = _candidates.CANDIDATES[name].prepare(sig, x, w, b, 1e-5)
            with _SharedBackwardArgs() as seen:
                run()
        except Exception:  # noqa: BLE001 - a candidate needing a GPU (cuDNN's graphs, the kernel)
            continue
        ran += 1
        assert seen.backwards or handed, (name, "ran no backward")
        assert not seen.shared, (name, seen.shared)
        for inputs, grads in handed:
            assert len(set(grads)) == len(grads), (name, "one tensor is the gradient of two outputs")
            assert not set(grads) & set(inputs), (name, "a gradient shares an autograd leaf's memory")
    assert ran, "PyTorch's candidate at least runs on a CPU"
    assert torch.equal(torch.get_rng_state(), rng), "a measurement drew from the caller's random numbers"


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_inference_closures_call_the_entry_with_their_candidate(op, monkeypatch):
    """On the native path a plain norm's inference closure calls the public function's C++ entry
    point with its candidate's server code (the host time a user's call pays, not a custom op's
    from Python), on detached tensors; a training call, and a call the entry would hand back to
    Python (weights of a third dtype, a dispatch mode active), keep the closures that call the ops."""
    calls = []
    monkeypatch.setattr(_entry, "native", True)
    monkeypatch.setattr(_entry, op, lambda *args: calls.append(args))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the entry takes CUDA calls
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(64, dtype=torch.bfloat16) if op == "layer_norm" else None
    sig = _candidates.signature(op, False, x, w, b, 64)
    for name, code in _entry.SERVERS.items():
        calls.clear()
        _candidates.CANDIDATES[name].prepare(sig, x, w, b, 1e-5)()
        (args,) = calls
        assert args[-1] == code and args[1] == [64]
        assert torch.equal(args[0], x) and not args[2].requires_grad
    assert _candidates._through_entry(sig._replace(training=True), x, w, b, 1e-5, "torch") is None
    w16 = w.detach().half()
    sig16 = _candidates.signature(op, False, x, w16, b, 64)
    assert _candidates._through_entry(sig16, x, w16, b, 1e-5, "torch") is None
    with _SharedBackwardArgs():  # under a dispatch mode the entry would hand the call to Python, which
        assert _candidates._through_entry(sig, x, w, b, 1e-5, "torch") is None  # would measure it again
    monkeypatch.setattr(_entry, "native", False)
    assert _candidates._through_entry(sig, x, w, b, 1e-5, "torch") is None


def test_time_closures_keeps_each_rounds_gpu_time(monkeypatch):
    """Each round's GPU time is kept beside its GPU-plus-host time (what :func:`_eligible` reads)."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    stream = type("Stream", (), {"synchronize": lambda self: None})()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    _FakeEvent.gpu_ms.update(calls=0, per_call=0.0)
    closures = {"torch": _fake_closure(0.06, 0.02), "kernel": _fake_closure(0.07, 0.01)}
    timings = _candidates.time_closures(closures, budget_ms=3.0)
    for name, gpu in (("torch", 0.06), ("kernel", 0.07)):
        t = timings[name]
        assert len(t.gpu_samples) == t.rounds == _candidates.ROUNDS
        assert t.gpu_ms == pytest.approx(gpu, rel=1e-6) and t.ms > gpu
    assert _candidates.winner(timings) == "torch", "the kernel's 17% more GPU time is not bought by host time"


def test_modulated_layer_norm_candidates():
    """diffusers' affine modulated LayerNorm: PyTorch's formula always competes, the fold plus
    one adaptive LayerNorm only on the native path, cudnorm's kernel never; the formula's
    closure runs a training call's forward and backward through autograd."""
    sig = Signature(_candidates.AFFINE_MODULATED, True, BF16, BF16, BF16, 64, 8)
    assert _candidates.candidates_for(sig) == ["torch"] + (["cudnn"] if _candidates._entry.native else [])
    assert _candidates.candidates_for(sig, deterministic=True) == ["torch"]
    x, scale, shift = torch.randn(2 * 8, 64), torch.randn(2, 64), torch.randn(2, 64)
    grads = _candidates.CANDIDATES["torch"].prepare(sig, x, scale, shift, 1e-6)()
    assert [tuple(g.shape) for g in grads] == [(2, 8, 64), (64,), (64,), (2, 64), (2, 64)]
    y = _candidates.CANDIDATES["torch"].prepare(sig._replace(training=False), x, scale, shift, 1e-6)()
    want = torch.nn.functional.layer_norm(x.view(2, 8, 64), (64,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    torch.testing.assert_close(y, want)


def test_modulated_layer_norm_takes_the_formula_where_it_is_decided(monkeypatch):
    """Where the measured decision of a per-sample affine call says ``torch``, the patched
    forward computes diffusers' formula itself: no fold, no adaptive LayerNorm node."""
    from cudnorm import _diffusers_forwards as forwards

    asked = []
    monkeypatch.setattr(forwards, "_native_fold", lambda *tensors: True)
    monkeypatch.setattr(forwards._entry, "affine_fold", lambda *a: pytest.fail("the fold ran"))
    monkeypatch.setattr(_decisions, "serves", lambda op, *a: asked.append(op) or "torch")
    x, w, b = torch.randn(2, 8, 64), 1 + 0.1 * torch.randn(64), 0.1 * torch.randn(64)
    scale, shift = 0.1 * torch.randn(2, 1, 64), 0.1 * torch.randn(2, 1, 64)
    y = forwards._modulated_layer_norm(x, scale, shift, 1e-6, w, b)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (64,), w, b, 1e-6) * (1 + scale) + shift)
    assert asked == [_candidates.AFFINE_MODULATED]
    asked.clear()
    with pytest.raises(pytest.fail.Exception, match="the fold ran"):  # another dtype: not that signature
        forwards._modulated_layer_norm(x, scale, shift, 1e-6, w.double(), b)
    assert asked == []


def test_ada_layer_norm_candidates():
    """The adaptive LayerNorm: PyTorch's formula and cudnorm's AdaLN compete on either launch
    path (cuDNN's only outside deterministic algorithms), cudnorm's kernel never; the formula's
    closure runs a training call's forward and backward through autograd."""
    sig = Signature(_candidates.ADA_LAYER_NORM, True, BF16, BF16, BF16, 64, 8)
    assert _candidates.candidates_for(sig) == ["torch", "cudnn"]
    assert _candidates.candidates_for(sig, deterministic=True) == ["torch"]
    x, scale, shift = torch.randn(2 * 8, 64), torch.randn(2, 64), torch.randn(2, 64)
    grads = _candidates.CANDIDATES["torch"].prepare(sig, x, scale, shift, 1e-6)()
    assert [tuple(g.shape) for g in grads] == [(2, 8, 64), (2, 64), (2, 64)]
    y = _candidates.CANDIDATES["torch"].prepare(sig._replace(training=False), x, scale, shift, 1e-6)()
    want = torch.nn.functional.layer_norm(x.view(2, 8, 64), (64,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    torch.testing.assert_close(y, want)


def test_ada_layer_norm_takes_the_formula_where_it_is_decided(monkeypatch):
    """Where the measured decision of an adaptive LayerNorm's signature says ``torch``, the call
    computes the formula in PyTorch's ops: no cudnorm node; another answer keeps cudnorm's."""
    asked = []
    monkeypatch.setattr(_decisions, "serves", lambda op, *a: asked.append(op) or "torch")
    x = torch.randn(2, 8, 64, requires_grad=True)
    scale, shift = 0.1 * torch.randn(2, 64), 0.1 * torch.randn(2, 64)
    with cudnorm.config(policy="cudnn"):  # past the size rules, as a large CUDA call is
        y = cudnorm.ada_layer_norm(x, scale, shift, 1e-6, one_plus_scale=True)
    assert asked == [_candidates.ADA_LAYER_NORM]
    assert "cudnorm" not in type(y.grad_fn).__name__.lower() and "AdaLayerNorm" not in type(y.grad_fn).__name__
    want = torch.nn.functional.layer_norm(x, (64,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    torch.testing.assert_close(y, want)
    monkeypatch.setattr(_decisions, "serves", lambda op, *a: asked.append(op) or "cudnn")
    with cudnorm.config(policy="cudnn"):
        y = cudnorm.ada_layer_norm(x, scale, shift, 1e-6, one_plus_scale=True)
    assert "AdaLayerNorm" in type(y.grad_fn).__name__, type(y.grad_fn).__name__
    torch.testing.assert_close(y, want)
    asked.clear()
    with cudnorm.config(policy="cudnn"):  # fp32 modulation of bf16 x: not the signature's dtypes
        cudnorm.ada_layer_norm(x.detach().bfloat16(), scale, shift, 1e-6)
    assert asked == []


def test_modulated_rms_norm_candidates():
    """A fused block's weightless RMSNorm and modulation: the block's own formula in the input's
    dtype (what the plain patch runs) against cudnorm's adaptive RMSNorm kernels where they serve;
    no cuDNN graph. The formula's closure runs a training call through autograd."""
    from cudnorm import _ada_rms

    sig = Signature(_candidates.MODULATED_RMS, True, BF16, BF16, BF16, 64, 8)
    kernel = ["kernel"] if _ada_rms.supports(64, BF16, BF16, BF16) else []
    assert _candidates.candidates_for(sig) == ["torch"] + kernel
    x, scale, shift = torch.randn(2 * 8, 64, dtype=BF16), torch.randn(2, 64, dtype=BF16), torch.randn(2, 64, dtype=BF16)
    grads = _candidates.CANDIDATES["torch"].prepare(sig, x, scale, shift, 1e-6)()
    assert [tuple(g.shape) for g in grads] == [(2, 8, 64), (2, 64), (2, 64)]
    y = _candidates.CANDIDATES["torch"].prepare(sig._replace(training=False), x, scale, shift, 1e-6)()
    x3 = x.view(2, 8, 64)
    want = torch.nn.functional.rms_norm(x3, (64,), None, 1e-6) * (1 + scale[:, None]) + shift[:, None]
    assert y.dtype is BF16 and torch.equal(y, want), "the formula in the input's dtype, as the block writes it"


def test_an_empty_call_is_not_measured(monkeypatch):
    """An empty input has nothing to time: its call takes the baseline (PyTorch's op where it
    serves the signature, else cudnorm's path), and nothing is measured or kept."""
    monkeypatch.setattr(_decisions, "decide", lambda *a, **k: pytest.fail("measured an empty call"))
    x = torch.empty(0, 64, dtype=BF16)
    assert _decisions.server_kept("layer_norm", x, 64, torch.ones(64, dtype=BF16), None, True) == ("torch", False)
    fp32 = torch.ones(64)  # PyTorch's fused RMSNorm takes one dtype: no torch candidate
    assert _decisions.server_kept("rms_norm", x, 64, fp32, None, True) == ("cudnn", False)


def test_candidates_follow_dtypes_and_determinism():
    assert _candidates.candidates_for(_sig(), deterministic=True) == [
        n for n in ("torch", "kernel") if _candidates.CANDIDATES[n].supports(_sig())]
    mixed_rms = Signature("rms_norm", True, BF16, torch.float32, None, 4096, 20)
    assert "torch" not in _candidates.candidates_for(mixed_rms), "PyTorch's fused RMSNorm takes one dtype"
    assert "cudnn" in _candidates.candidates_for(mixed_rms)


@pytest.fixture
def store(tmp_path, monkeypatch):
    fingerprint = lambda device: {"gpu": "Test GPU", "compute_capability": "9.0"}  # noqa: E731
    store = PlanStore(tmp_path / "store", 1 << 20, fingerprint=fingerprint)
    monkeypatch.setattr(_plan_store, "_installed", store)
    monkeypatch.setattr(_runtime, "driver_version", lambda: 13000)
    monkeypatch.setattr(_runtime, "capturing", lambda: False)  # a CPU build of torch cannot ask
    cudnorm.clear_cache()
    yield store
    cudnorm.clear_cache()


def test_store_keeps_the_first_decision_written(store):
    first = store.save_decision("k", 0, False, {"choice": "torch", "ms": {"torch": 1.0}})
    assert first["choice"] == "torch" and store.load_decision("k", 0, False)["choice"] == "torch"
    second = store.save_decision("k", 0, False, {"choice": "cudnn"})
    assert second["choice"] == "torch", "another process decided first: its decision is returned"
    assert store.load_decision("k", 0, True) is None, "deterministic mode is another decision"
    assert store.info()["decisions"] == 1
    assert store.clear() >= 1 and store.load_decision("k", 0, False) is None


def test_concurrent_writers_agree(store):
    results = []
    threads = [threading.Thread(target=lambda c=c: results.append(store.save_decision("race", 0, False,
                                                                                        {"choice": c})))
               for c in ("torch", "cudnn", "kernel") * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r["choice"] for r in results}) == 1


def _input(rows=4096, cols=88):
    return torch.randn(rows, cols, dtype=BF16), torch.ones(cols, dtype=BF16), torch.zeros(cols, dtype=BF16)


def test_measures_once_then_stores(store, monkeypatch):
    calls = []

    def fake_measure(sig, input, weight, bias, names, eps=1e-5, errors=None, cost=None, baseline=None):
        calls.append(sorted(names))
        return {"torch": Timing(1.0, 0.01, 3), "cudnn": Timing(9.0, 0.0, 1), "kernel": Timing(0.5, 0.01, 3)}

    monkeypatch.setattr(_decisions, "measure", fake_measure)
    monkeypatch.setattr(_decisions, "prior_times", lambda sig, device: {})
    monkeypatch.setattr(_candidates, "_kernel_supports", lambda sig: True)
    monkeypatch.setitem(_candidates.CANDIDATES, "kernel", _candidates.Candidate(
        "kernel", True, lambda sig: True, _candidates._kernel_prepare))
    x, w, b = _input()
    assert _decisions.server("layer_norm", x, 88, w, b, True) == "kernel"
    assert _decisions.server("layer_norm", x, 88, w, b, True) == "kernel"
    assert len(calls) == 1, "one measurement per signature"
    [row] = cudnorm.serving_decisions()
    assert row["serves"] == "kernel" and row["source"] == "measured" and row["ms"]["cudnn"] == 9.0
    cudnorm.clear_cache()  # a new process: the store answers
    assert _decisions.server("layer_norm", x, 88, w, b, True) == "kernel" and len(calls) == 1
    assert cudnorm.serving_decisions()[0]["source"] == "stored"


def test_prior_skips_known_cliffs(store, monkeypatch):
    measured = []
    monkeypatch.setattr(_decisions, "measure", lambda sig, x, w, b, names, eps=1e-5, errors=None, cost=None, baseline=None:
                        measured.append(names) or
                        {n: Timing(1.0 if n == "torch" else 0.5, 0.0, 3) for n in names})
    monkeypatch.setattr(_decisions, "prior_times", lambda sig, device: {"torch": 1.0, "cudnn": 12.0})
    monkeypatch.setitem(_candidates.CANDIDATES, "kernel", _candidates.Candidate(
        "kernel", True, lambda sig: False, _candidates._kernel_prepare))
    x, w, b = _input()
    assert _decisions.server("layer_norm", x, 88, w, b, True) == "torch"
    assert measured == [], "the prior left one candidate: nothing to time"
    assert cudnorm.serving_decisions()[0]["source"] == "prior"


def test_no_timing_while_capturing_or_unwanted(store, monkeypatch):
    monkeypatch.setattr(_decisions, "measure", lambda *a, **k: pytest.fail("timed where it must not"))
    monkeypatch.setattr(_decisions, "prior_times", lambda sig, device: {})
    x, w, b = _input()
    monkeypatch.setattr(_runtime, "capturing", lambda: True)
    assert _decisions.server("layer_norm", x, 88, w, b, True) == "torch"
    assert not cudnorm.serving_decisions(), "a stand-in is not kept: a later eager call measures"
    monkeypatch.setattr(_runtime, "capturing", lambda: False)
    with cudnorm.config(measure=False):
        monkeypatch.setattr(_decisions, "prior_times", lambda sig, device: {"torch": 2.0, "cudnn": 1.0})
        assert _decisions.server("layer_norm", x, 88, w, b, True) == "cudnn", "the prior's fastest"


def test_prior_file_lookup(monkeypatch, tmp_path):
    sig = _sig(cols=96, rows_bucket=20)
    (tmp_path / "test-gpu-80gb.json").write_text(json.dumps(
        {"gpu": "Test GPU 80GB", "cells": {sig._replace(rows_bucket=19).key(): {"torch": 1.0, "cudnn": 9.0}}}))
    monkeypatch.setattr(_decisions, "PRIORS", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU 80GB")
    _decisions._prior_table.cache_clear()
    assert _decisions.prior_times(sig, 0) == {"torch": 1.0, "cudnn": 9.0}, "a neighbouring row bucket"
    assert _decisions.prior_times(sig._replace(cols=104), 0) == {}
    assert _decisions.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    _decisions._prior_table.cache_clear()


def test_prior_timings_of_changed_candidates_are_not_used(monkeypatch, tmp_path):
    """A prior written before cudnorm's kernel launched from C++ (no ``candidates_revision``)
    timed it with the Python launch's host time: its kernel timings must not drop it."""
    sig = _sig(cols=96, rows_bucket=20)
    cell = {"torch": 1.0, "cudnn": 9.0, "kernel": 4.0}
    monkeypatch.setattr(_decisions, "PRIORS", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU 80GB")
    for revision, want in ((None, {"torch": 1.0, "cudnn": 9.0}), (_candidates.REVISION, cell)):
        document = {"gpu": "Test GPU 80GB", "cells": {sig.key(): cell}}
        if revision is not None:
            document["candidates_revision"] = revision
        (tmp_path / "test-gpu-80gb.json").write_text(json.dumps(document))
        _decisions._prior_table.cache_clear()
        assert _decisions.prior_times(sig, 0) == want, revision
    _decisions._prior_table.cache_clear()


def test_cpu_calls_are_not_measured(monkeypatch):
    monkeypatch.setattr(_decisions, "server", lambda *a: pytest.fail("a CPU call was measured"))
    x, w, b = _input()
    assert _decisions.serves("layer_norm", x, 88, w, b, True) == "cudnn"  # cudnorm's own path decides (CPU: PyTorch)
    torch.testing.assert_close(cudnorm.layer_norm(x, (88,), w, b), torch.nn.functional.layer_norm(x, (88,), w, b))


def _share_worker(rank, world, path, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        choice = "kernel" if rank == 0 else "torch"
        _decisions._keep((_sig(), -1, False), choice, {"source": "measured"})
        count = cudnorm.share_decisions()
        rows = cudnorm.serving_decisions()
        with open(f"{path}/{rank}.json", "w") as f:
            json.dump({"count": count, "serves": [r["serves"] for r in rows],
                       "sources": [r["source"] for r in rows]}, f)
    finally:
        dist.destroy_process_group()


def test_share_decisions_gives_every_rank_rank_0s(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_share_worker, args=(2, str(tmp_path), port), nprocs=2)
    seen = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert [s["serves"] for s in seen] == [["kernel"], ["kernel"]], seen
    assert seen[1]["sources"] == ["rank 0 (share_decisions)"] and seen[1]["count"] == 1


def test_share_decisions_needs_a_process_group():
    with pytest.raises(RuntimeError, match="cudnorm.share_decisions: torch.distributed is not initialized"):
        cudnorm.share_decisions()
