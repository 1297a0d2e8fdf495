"""The kernel policy (cudnorm._policy): which calls PyTorch's own ops serve under the default
``policy="auto"``, that those calls compute what PyTorch computes, build no cuDNN plan
and keep cudnorm's argument errors, and that ``policy="cudnn"`` restores cudnorm's own
path. CPU tests run everywhere; the ``gpu`` ones check the size and compile rules on CUDA."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _native, _policy, _runtime
from cudnorm import reference as ref

gpu = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.fixture
def auto():
    cudnorm.config(policy="auto")


def test_rules(auto, monkeypatch):
    big, small = _policy.CUDNN_MIN_ELEMENTS, _policy.CUDNN_MIN_ELEMENTS - 1
    assert _policy.prefers_torch(True, small) and not _policy.prefers_torch(True, big)
    assert _policy.prefers_torch(False, big)  # CPU, meta, tensor subclasses
    w16, w32 = torch.empty(1, dtype=BF16), torch.empty(1)
    assert _policy.torch_serves(torch.empty(2, 4, dtype=BF16), w16, None)  # CPU
    # fp32 weights on a CPU: PyTorch's mixed-dtype kernels; one fp32 and one bf16 weight: PyTorch's
    # kernels refuse the mix, cudnorm's own path serves it; a tensor subclass keeps cudnorm's path
    assert _policy.torch_serves(torch.empty(2, 4, dtype=BF16), w32, None)
    assert not _policy.torch_serves(torch.empty(2, 4, dtype=BF16), w32, w16)
    # an fp32 bias without a weight: ATen's CPU backward raises on it (tests/test_mixed_dtypes.py)
    assert not _policy.torch_serves(torch.empty(2, 4, dtype=BF16), None, w32)
    assert not _policy.torch_serves(torch.nn.Parameter(torch.empty(2, 4, dtype=BF16)), w32)
    assert not _policy.torch_serves([1.0], w16)  # not a tensor: cudnorm's path raises the argument error
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _policy.prefers_torch(True, big)  # traced: Inductor fuses PyTorch's ops


def test_size_rule_tries_the_native_path_first(auto, monkeypatch):
    """The size rule's threshold depends on whether the native path serves, so an op that is
    a process's first CUDA call (``cudnorm.gated_ada_layer_norm``, ``ada_rms_norm``) tries it
    before reading the rule, as ``layer_norm`` does: its threshold is then the same whichever
    op came first."""
    from cudnorm import _entry
    tried = []

    def activate(x):
        tried.append(x)
        _entry.native, _entry.pending = True, False
        return True

    monkeypatch.setattr(_entry, "native", False)
    monkeypatch.setattr(_entry, "pending", True)
    monkeypatch.setattr(_entry, "try_native", activate)
    _policy.torch_serves(torch.empty(2, 4, dtype=BF16), None)
    assert tried == []  # a CPU tensor: nothing to try (and no call added to a CPU user's op)
    x = torch.empty(2, 4, dtype=BF16, device="meta")
    monkeypatch.setattr(type(x), "is_cuda", property(lambda self: True))
    _policy.torch_serves(x, None)
    assert tried == [x] and _entry.native
    _policy.torch_serves(x, None)
    assert tried == [x]  # tried once


def test_cudnn_policy_serves_nothing_to_torch():
    cudnorm.config(policy="cudnn")
    assert not _policy.torch_serves(torch.empty(2, 4))


def test_torch_policy_sends_every_same_dtype_call_to_pytorch(monkeypatch):
    """``policy="torch"``: PyTorch's ops at any size (the control for what cudnorm's Python
    costs a patched model), in Python and in the arguments C++ gets."""
    monkeypatch.setattr(_policy, "prefers_torch", lambda plain_cuda, numel: False)  # a large CUDA call under "auto"
    x, w16, w32 = torch.empty(2, 4, dtype=BF16), torch.empty(4, dtype=BF16), torch.empty(4)
    cudnorm.config(policy="torch")
    assert _policy.torch_serves(x, w16, w16) and _policy.torch_serves(x, w32, None)
    monkeypatch.setattr(_runtime, "route", lambda x: None)  # as for a CUDA tensor
    assert cudnorm.serving_path("layer_norm", x).startswith("torch (policy 'torch'")
    cudnorm.config(policy="auto")
    assert not _policy.torch_serves(x, w16, w16)
    assert _native.policy_arguments("torch") == (True, 1 << 62, False)
    assert _native.policy_arguments("auto") == (True, _policy.NATIVE_CUDNN_MIN_ELEMENTS, True)
    assert not _native.policy_arguments("cudnn")[0]


def test_bad_policy_value_is_named():
    with pytest.raises(ValueError, match="cudnorm.config: option 'policy' must be 'auto', 'cudnn' or 'torch', got 'fastest'"):
        cudnorm.config(policy="fastest")


def _rows_inputs(dtype, n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, n, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(n, generator=g)).to(dtype).requires_grad_()
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_routed_layer_and_rms_norm_are_pytorchs_ops(auto, dtype):
    x, w, b = _rows_inputs(dtype)
    for mine, theirs in ((lambda: cudnorm.layer_norm(x, (64,), w, b, 1e-5), lambda: F.layer_norm(x, (64,), w, b, 1e-5)),
                         (lambda: cudnorm.rms_norm(x, 64, w, 1e-6), lambda: F.rms_norm(x, (64,), w, 1e-6))):
        y = mine()
        assert "cudnorm" not in type(y.grad_fn).__name__  # PyTorch's own autograd node
        got = torch.autograd.grad(y.float().square().sum(), (x, w))
        want_y = theirs()
        want = torch.autograd.grad(want_y.float().square().sum(), (x, w))
        assert torch.equal(y, want_y)
        for a, e in zip(got, want):
            assert torch.equal(a, e)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_cpu_calls_with_fp32_weights_are_pytorchs_mixed_dtype_ops(auto, dtype):
    """Half-precision x with fp32 weights on a CPU (what cudnorm's modules hold): PyTorch's own
    autograd nodes, the results PyTorch's mixed-dtype kernels give (RMSNorm's fused kernel,
    equal to ``F.rms_norm``'s fp32 path within a rounding), fp32 weight gradients, and no
    warning (``torch.rms_norm`` warns that it cannot send mixed dtypes to its fused kernel)."""
    x, w, b = _rows_inputs(dtype)
    w, b = (p.detach().float().requires_grad_() for p in (w, b))
    ln, torch_ln = cudnorm.LayerNorm(64), torch.nn.LayerNorm(64)
    rms, torch_rms = cudnorm.RMSNorm(64, eps=1e-6), torch.nn.RMSNorm(64, eps=1e-6)
    cases = ((lambda: cudnorm.layer_norm(x, (64,), w, b, 1e-5), lambda: F.layer_norm(x, (64,), w, b, 1e-5), w, w, 0),
             (lambda: ln(x), lambda: torch_ln(x), ln.weight, torch_ln.weight, 0),
             (lambda: cudnorm.rms_norm(x, 64, w, 1e-6), lambda: F.rms_norm(x, (64,), w, 1e-6), w, w, 4e-3),
             (lambda: rms(x), lambda: torch_rms(x), rms.weight, torch_rms.weight, 4e-3))
    for mine, theirs, my_weight, their_weight, tolerance in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = mine()
            got = torch.autograd.grad(y.float().square().sum(), (x, my_weight))
        assert "cudnorm" not in type(y.grad_fn).__name__ and y.dtype is dtype
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # F.rms_norm's mixed-dtype warning
            want_y = theirs()
            want = torch.autograd.grad(want_y.float().square().sum(), (x, their_weight))
        for a, e in zip((y, *got), (want_y, *want)):
            assert a.dtype is e.dtype and (torch.equal(a, e) if tolerance == 0 else ref.rel_error(a, e) < tolerance)
    assert got[1].dtype is torch.float32


@pytest.mark.parametrize("dit", [True, False])
def test_routed_ada_layer_norm_meets_the_error_rule(auto, dit):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 96, generator=g).to(BF16)
    scale = ((0.0 if dit else 1.0) + 0.1 * torch.randn(2, 96, generator=g)).to(BF16)
    shift = (0.1 * torch.randn(2, 96, generator=g)).to(BF16)
    dy = torch.randn(x.shape, generator=g).to(BF16)
    y = cudnorm.ada_layer_norm(x, scale, shift, 1e-6, one_plus_scale=dit)
    assert type(y.grad_fn).__name__ != "_AdaLayerNormFunctionBackward"
    rows = ref.accuracy_report(lambda x, sc, sh: cudnorm.ada_layer_norm(x, sc, sh, 1e-6, one_plus_scale=dit),
                               lambda x, sc, sh: ref.ada_layer_norm_eager(x, sc, sh, 1e-6, dit),
                               lambda x, sc, sh: ref.ada_layer_norm(x, sc, sh, 1e-6, dit=dit),
                               (x, scale, shift), dy, ("y", "dx", "dscale", "dshift"), BF16)
    assert all(r["ok"] for r in rows), rows


def test_routed_calls_keep_cudnorm_errors(auto):
    x, w, b = _rows_inputs(BF16)
    with pytest.raises(ValueError, match=r"cudnorm\.layer_norm.*'weight'"):
        cudnorm.layer_norm(x, (64,), w[:10], b)
    with pytest.raises(ValueError, match=r"cudnorm\.rms_norm.*'eps'"):
        cudnorm.rms_norm(x, (64,), w, -1.0)
    with pytest.raises(ValueError, match=r"cudnorm\.ada_layer_norm.*'scale'"):
        cudnorm.ada_layer_norm(x, w[None, :10], b[None].expand(3, 64))


def _graph_ops(fn, *args):
    """The call targets of the FX graph torch.compile traces for ``fn(*args)``."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=record, fullgraph=True)(*args)
    torch._dynamo.reset()
    return " ".join(str(node.target) for gm in graphs for node in gm.graph.nodes)


def test_compiled_graph_holds_cudnorm_op_only_under_cudnn_policy():
    x = torch.randn(4, 64)
    w = torch.ones(64)
    fn = lambda x, w: cudnorm.layer_norm(x, (64,), w, None)  # noqa: E731
    cudnorm.config(policy="cudnn")
    assert "cudnorm" in _graph_ops(fn, x, w)
    cudnorm.config(policy="auto")
    assert "cudnorm" not in _graph_ops(fn, x, w)


# ---------------------------------------------------------------- GPU: size and compile rules

@gpu
@pytest.mark.parametrize("native", ["auto", "off"])
def test_torch_policy_builds_no_plan_at_any_size(fresh_cache, native):
    cudnorm.config(policy="torch", native=native)
    x = torch.randn(8, 1024, 1152, device="cuda", dtype=BF16, requires_grad=True)  # above both thresholds
    w = torch.randn(1152, device="cuda", dtype=BF16, requires_grad=True)
    mod = torch.randn(8, 2 * 1152, device="cuda", dtype=BF16, requires_grad=True)
    scale, shift = mod.chunk(2, dim=1)
    y = cudnorm.layer_norm(x, (1152,), w, w)
    assert torch.equal(y, F.layer_norm(x, (1152,), w, w))
    assert torch.equal(cudnorm.rms_norm(x, (1152,), w, 1e-6), F.rms_norm(x, (1152,), w, 1e-6))
    cudnorm.ada_layer_norm(x, scale, shift, 1e-6, one_plus_scale=True).sum().backward()
    info = cudnorm.cache_info()
    assert info.builds == 0 and info.misses == 0, info
    assert cudnorm.serving_path("layer_norm", x).startswith("torch (policy 'torch'")


@gpu
def test_small_cuda_calls_build_no_plan_and_equal_pytorch(auto, fresh_cache):
    """On the Python launch path small calls run PyTorch's own ops (the native path's rule is
    the next test's)."""
    cudnorm.config(native="off")
    x = torch.randn(2, 256, 1152, device="cuda", dtype=BF16, requires_grad=True)
    w = torch.randn(1152, device="cuda", dtype=BF16, requires_grad=True)
    mod = torch.randn(2, 2 * 1152, device="cuda", dtype=BF16, requires_grad=True)
    scale, shift = mod.chunk(2, dim=1)
    for _ in range(3):  # fresh outputs every call, as in a training loop
        y = cudnorm.layer_norm(x, (1152,), w, w)
        assert torch.equal(y, F.layer_norm(x, (1152,), w, w))
        y = cudnorm.rms_norm(x, (1152,), w, 1e-6)
        assert torch.equal(y, F.rms_norm(x, (1152,), w, 1e-6))
        cudnorm.ada_layer_norm(x, scale, shift, 1e-6, one_plus_scale=True).sum().backward()
    info = cudnorm.cache_info()
    assert info.builds == 0 and info.misses == 0, info
    assert cudnorm.serving_path("layer_norm", x).startswith("torch (small call")


@gpu
def test_native_path_runs_small_calls_on_cudnn(auto, fresh_cache):
    """With the native launch path every eager CUDA call but the smallest takes its measured
    decision by default (NATIVE_CUDNN_MIN_ELEMENTS: its host cost is about PyTorch's); a
    decode-sized call runs PyTorch's op."""
    if cudnorm.get_config().native == "off":
        pytest.skip("the native launch path is switched off")
    x = torch.randn(2, 256, 1152, device="cuda", dtype=BF16)
    w = torch.randn(1152, device="cuda", dtype=BF16)
    y = cudnorm.layer_norm(x, (1152,), w, w)
    torch.testing.assert_close(y, F.layer_norm(x, (1152,), w, w))
    if _native.status()["active"]:
        assert cudnorm.cache_info().builds > 0
        # not handed to PyTorch for its size: the measured decision serves it (cuDNN, cudnorm's kernel
        # or PyTorch's op, whichever measured fastest)
        path = cudnorm.serving_path("layer_norm", x)
        assert not path.startswith("torch (small call"), path
        token = x[:1, :1]  # one decode token: [1, 1, 1152]
        assert token.numel() < _policy.NATIVE_CUDNN_MIN_ELEMENTS
        builds = cudnorm.cache_info().builds
        torch.testing.assert_close(cudnorm.layer_norm(token, (1152,), w, w), F.layer_norm(token, (1152,), w, w))
        assert cudnorm.cache_info().builds == builds
        assert cudnorm.serving_path("layer_norm", token).startswith("torch (small call")


@gpu
def test_large_calls_take_their_measured_path_and_mixed_dtype_calls_cudnn(auto, fresh_cache):
    n = _policy.CUDNN_MIN_ELEMENTS // 4096
    x = torch.randn(n, 4096, device="cuda", dtype=BF16)
    w = torch.ones(4096, device="cuda", dtype=BF16)
    # at or above the size threshold the dispatcher measures the signature (cuDNN's plan is one
    # of the candidates it builds and times) and names what it measured
    path = cudnorm.serving_path("rms_norm", x)
    assert path == "cudnn" or (path.split(" (")[0] in ("torch", "kernel") and "measured" in path), path
    builds = cudnorm.cache_info().builds
    assert builds >= 1
    with torch.no_grad():
        cudnorm.rms_norm(x, (4096,), w, 1e-6)
        assert cudnorm.cache_info().builds == builds  # decided: no new plan
        cudnorm.rms_norm(x[:1024], (4096,), w.float(), 1e-6)  # fp32 weight: cudnorm's own path at any size
    assert cudnorm.cache_info().builds == builds + 1


@gpu
def test_compiled_cuda_calls_trace_pytorchs_ops(auto, fresh_cache):
    n = _policy.CUDNN_MIN_ELEMENTS // 1024
    x = torch.randn(n // 256, 256, 1024, device="cuda", dtype=BF16)
    mod = torch.randn(n // 256, 2 * 1024, device="cuda", dtype=BF16)
    fn = lambda x, mod: cudnorm.ada_layer_norm(x, *mod.chunk(2, dim=1), 1e-6, one_plus_scale=True)  # noqa: E731
    assert "cudnorm" not in _graph_ops(fn, x, mod)
    with torch.no_grad():
        got = torch.compile(fn, fullgraph=True)(x, mod)
        want = ref.ada_layer_norm_eager(x, *mod.chunk(2, dim=1), 1e-6, True)
        exact = ref.ada_layer_norm(x, *mod.chunk(2, dim=1), 1e-6, dit=True)
    # Inductor's fused kernel rounds once where the eager formula rounds three times
    assert ref.rel_error(got, exact) <= ref.error_bound(ref.rel_error(want, exact), BF16)
    assert cudnorm.cache_info().builds == 0


def test_modules_follow_the_policy():
    x = torch.randn(2, 5, 64, dtype=BF16, requires_grad=True)
    for mine, theirs in ((cudnorm.LayerNorm(64), torch.nn.LayerNorm(64)), (cudnorm.RMSNorm(64), torch.nn.RMSNorm(64))):
        mine, theirs = mine.to(BF16), theirs.to(BF16)
        cudnorm.config(policy="auto")
        y = mine(x)
        assert "cudnorm" not in type(y.grad_fn).__name__ and torch.equal(y, theirs(x))
        cudnorm.config(policy="cudnn")
        node = mine(x).grad_fn.next_functions[0][0]  # under the view back to [2, 5, 64]
        assert "Function" in type(node).__name__  # cudnorm's own autograd node


def test_dtensor_inputs_run_pytorchs_ops_and_stay_sharded(auto, tmp_path):
    """A tensor subclass takes PyTorch's ops, which carry DTensor's sharding rules (cudnorm's
    own ops have none). One process, gloo."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.tensor import DeviceMesh, Partial, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        mesh = DeviceMesh("cpu", [0])
        x = distribute_tensor(torch.randn(4, 6, 64), mesh, [Shard(1)]).requires_grad_()
        w = distribute_tensor(torch.randn(64), mesh, [Replicate()]).requires_grad_()
        ops = ((lambda: cudnorm.layer_norm(x, (64,), w, w), lambda: F.layer_norm(x, (64,), w, w)),
               (lambda: cudnorm.rms_norm(x, (64,), w, 1e-6), lambda: F.rms_norm(x, (64,), w, 1e-6)))
        for ours, theirs in ops:
            results = []
            for op in (ours, theirs):
                w.grad = x.grad = None
                y = op()
                y.sum().backward()
                results.append((y, x.grad, w.grad))
            for got, want in zip(*results):  # the same values and the same placements as PyTorch's
                assert got.placements == want.placements, (got.placements, want.placements)
                torch.testing.assert_close(got.full_tensor(), want.full_tensor())
            assert results[0][0].placements == (Shard(1),)
            # how PyTorch leaves w.grad depends on its release: Partial() (reduce later) or Replicate()
            assert results[0][2].placements in ((Partial(),), (Replicate(),))
        scale = distribute_tensor(torch.randn(4, 64), mesh, [Replicate()])
        assert cudnorm.ada_layer_norm(x, scale, scale).placements == (Shard(1),)
    finally:
        dist.destroy_process_group()
