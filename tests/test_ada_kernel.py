"""The fused AdaLN backward (cudnorm._ada_kernel): the kernel's arithmetic under Triton's
interpreter on a CPU (skipped without Triton), the strategy's plumbing with the kernel faked,
and on a GPU its accuracy and a launch count that does not grow with the batch."""

import importlib

import pytest
import torch

import cudnorm
from cudnorm import _ada_kernel
from cudnorm import _ada_strategies as strategies
from cudnorm import reference as ref
from conftest import fake_fused_backward
import interpreted

ada = importlib.import_module("cudnorm.ada_layer_norm")  # the package attribute is the function


def _reference(dy, x, scale, dit, eps=1e-6):
    """fp64 ``(dx, dscale, dshift)`` and the fp32 ``(mean, rstd)`` the forward saves."""
    b, s, d = x.shape
    xd = x.double()
    mean, var = xd.mean(-1), xd.var(-1, unbiased=False)
    rstd = (var + eps).rsqrt()
    xhat = (xd - mean[..., None]) * rstd[..., None]
    g = dy.double() * ((scale.double() + 1) if dit else scale.double())[:, None]
    dx = rstd[..., None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return (dx, (dy.double() * xhat).sum(1), dy.double().sum(1)), (mean.float(), rstd.float())


def _stats(mean, rstd):
    rows = mean.numel()
    stats = torch.zeros(2, -(-rows // 4) * 4)
    stats[0, :rows], stats[1, :rows] = mean.reshape(-1), rstd.reshape(-1)
    return stats


_CASES = [((2, 5, 24), torch.float32, torch.float32, True),  # fewer tokens than a program's rows
          ((3, 17, 40), torch.bfloat16, torch.bfloat16, True),  # a sample over two programs, the last one partial
          ((4, 9, 33), torch.float16, torch.float32, False)]  # odd width: masked columns


def _check_interpreted_cases():
    """Runs in a child process started with ``TRITON_INTERPRET=1`` (Triton reads it when
    imported, so the test process, whose Triton may already run on a GPU, cannot switch)."""
    for shape, dtype, sdtype, dit in _CASES:
        b, s, d = shape
        x = (2 * torch.randn(shape) + 0.5).to(dtype)
        dy = torch.randn(shape).to(dtype)
        scale = (0.1 * torch.randn(b, 3 * d)).to(sdtype)[:, d:2 * d]  # a chunk: rows 3*D apart
        (want_dx, want_ds, want_dsh), (mean, rstd) = _reference(dy, x, scale, dit)
        dx, sums = _ada_kernel.backward(dy.reshape(b * s, d), x.reshape(b * s, d), b, scale, _stats(mean, rstd), dit)
        assert dx.dtype == dtype and sums.shape == (2, b, d) and sums.dtype == torch.float32
        # dx is rounded once to x's dtype; the sums stay fp32
        assert ref.rel_error(dx.view(shape), want_dx) < {torch.float32: 1e-6, torch.float16: 1e-3}.get(dtype, 8e-3)
        assert ref.rel_error(sums[0], want_ds) < 1e-6 and ref.rel_error(sums[1], want_dsh) < 1e-6
    print("interpreted cases ok")


def test_interpreted_kernel_matches_fp64():
    """The kernel's arithmetic (masks, partial programs, strided scale, both gain conventions,
    three dtypes) under Triton's interpreter, on a CPU."""
    interpreted.run("test_ada_kernel", "_check_interpreted_cases", timeout=300)


def test_launch_shape_keeps_programs_per_sample_bounded():
    # 32 x 256 rows on 132 SMs: 16 rows a program, 16 programs a sample
    assert _ada_kernel.launch_shape(32, 256, 1152, 132) == (16, 16, 2048, 8)
    rows, chunks, block, warps = _ada_kernel.launch_shape(128, 4096, 3072, 132)
    assert rows * chunks >= 4096 and chunks <= 8 and block == 4096 and warps == 16
    assert _ada_kernel.launch_shape(2, 3, 64, 132)[:2] == (4, 1)  # never more rows than a sample has (rounded up)


@pytest.mark.parametrize("sdtype, hdtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                            (torch.float32, torch.bfloat16)])
def test_fused_strategy_serves_any_batch_in_one_call(monkeypatch, sdtype, hdtype):
    """The rules send 32 samples to the fused strategy: one kernel call for the batch, dscale in
    the scale's dtype and dshift in the shift's, values as PyTorch's formula."""
    calls = []
    monkeypatch.setattr(ada._runtime, "route", lambda x: None)
    monkeypatch.setattr(_ada_kernel, "available", lambda x2, dtype: True)
    monkeypatch.setattr(_ada_kernel, "backward", fake_fused_backward(calls))
    monkeypatch.setattr(ada._cache, "get_plan", lambda spec: pytest.fail(f"no cuDNN graph was asked for: {spec}"))
    b, s, d = 32, 8, 16
    x = torch.randn(b, s, d, dtype=torch.bfloat16, requires_grad=True)
    scale = (0.1 * torch.randn(b, d)).to(sdtype).requires_grad_(True)
    shift = (0.1 * torch.randn(b, d)).to(hdtype).requires_grad_(True)
    with cudnorm.config(ada_forward="torch"):
        y = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, scale, shift], dy)
    assert calls == [b]
    assert [g.dtype for g in got] == [torch.bfloat16, sdtype, hdtype]
    want = torch.autograd.grad(ref.ada_layer_norm_eager(x, scale, shift, 1e-6, True), [x, scale, shift], dy)
    for g, w in zip(got, want):
        assert ref.rel_error(g, w) < 2e-2


def test_fused_without_triton_hands_over_to_per_sample(monkeypatch):
    monkeypatch.setattr(_ada_kernel, "available", lambda x2, dtype: False)
    x2 = torch.empty((4 * 256, 1152), dtype=torch.bfloat16, device="meta")
    found = [strategies.BACKWARDS[name].spec(x2, 4, torch.bfloat16, 0) for name in strategies.BACKWARD_ORDER["fused"]]
    assert found[0] is None and found[1].op == "layer_norm" and found[1].rows == 256
    assert strategies.specs_for(4, 256, 1152, torch.bfloat16, torch.bfloat16, 0, phases=("bwd",)) == [found[1]]


def test_fused_needs_no_warmup_spec(monkeypatch):
    monkeypatch.setattr(_ada_kernel, "available", lambda x2, dtype: True)
    assert strategies.specs_for(32, 256, 1152, torch.bfloat16, torch.bfloat16, 0, phases=("bwd",)) == []


@pytest.mark.gpu
@pytest.mark.parametrize("shape, chunked", [((2, 256, 1152), True), ((32, 256, 1152), True), ((8, 300, 3072), True),
                                            ((4, 64, 1000), False)])  # scale rows 1000 apart: Python's launch
def test_gpu_fused_meets_the_2x_rule(shape, chunked):
    b, s, d = shape
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    emb = (0.1 * torch.randn(b, 6 * d, device="cuda")).bfloat16().requires_grad_(True)
    shift, scale = emb.chunk(6, dim=1)[:2] if chunked else emb.detach()[:, :2 * d].reshape(b, 2, d).unbind(1)
    if not chunked:
        shift, scale = shift.contiguous().requires_grad_(True), scale.contiguous().requires_grad_(True)
    rows = ref.accuracy_report(
        lambda x, sc, sh: cudnorm.ada_layer_norm(x, sc, sh, 1e-6, one_plus_scale=True),
        lambda x, sc, sh: ref.ada_layer_norm_eager(x, sc, sh, 1e-6, True),
        lambda x, sc, sh: ref.ada_layer_norm(x, sc, sh, 1e-6, dit=True),
        (x, scale, shift), torch.randn_like(x), ("y", "dx", "dscale", "dshift"), x.dtype)
    assert all(r["ok"] for r in rows), rows


@pytest.mark.gpu
def test_gpu_fused_launches_do_not_grow_with_the_batch():
    """Kernels one AdaLN backward launches, counted by the profiler: the same at 2 and 64 samples;
    with the native path active, C++ launches the kernel itself (no call back into Python)."""
    from cudnorm import _native

    counts = {}
    for b in (2, 64):
        x = torch.randn(b, 256, 1152, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        scale, shift = (0.1 * torch.randn(2, b, 1152, device="cuda")).bfloat16().requires_grad_(True).unbind(0)
        y = cudnorm.ada_layer_norm(x, scale, shift, one_plus_scale=True)
        dy = torch.randn_like(y)
        torch.autograd.grad(y, [x, scale, shift], dy, retain_graph=True)  # compiles the kernel
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as prof:
            torch.autograd.grad(y, [x, scale, shift], dy)
            torch.cuda.synchronize()
        counts[b] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        if _native.status()["active"]:
            assert not [e.name for e in prof.events() if e.name == "cudnorm::_kernel_py"]
    assert counts[2] == counts[64] and counts[2] <= 6, counts


def test_warmup_asks_for_no_backward_graph_where_the_kernel_serves():
    """With Triton importable, a meta ``x`` (what warmup and the native path's recipes ask
    with) is served by the kernel, so warmup builds no per-sample backward graph."""
    pytest.importorskip("triton")
    x2 = torch.empty((3 * 77, 1000), dtype=torch.float32, device="meta")
    assert _ada_kernel.available(x2, torch.float32)
    assert not _ada_kernel.available(torch.empty((3 * 77, 1000)), torch.float32)  # a CPU tensor: PyTorch's path
    assert strategies.specs_for(3, 77, 1000, torch.float32, torch.float32, 0, phases=("bwd",)) == []
