"""Shared test setup: the ``gpu`` marker skips without CUDA; seeds are fixed per test."""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def fake_fused_backward(calls: list):
    """``cudnorm._ada_kernel.backward`` computed by PyTorch's formula (so it runs on a CPU),
    appending each call's batch to ``calls``."""
    import importlib

    ada = importlib.import_module("cudnorm.ada_layer_norm")  # the package attribute is the function

    def backward(dy2, x2, b, scale, stats, dit):
        calls.append(b)
        rows, d = x2.shape
        gain = (scale.float() + 1) if dit else scale.float()
        dx, dscale, dshift = ada._torch_backward(dy2.view(b, -1, d), x2.view(b, -1, d), gain, stats[0, :rows],
                                                 stats[1, :rows])
        return dx.view(rows, d), torch.stack([dscale, dshift])

    return backward


@pytest.fixture(params=[False, True], ids=["without-triton", "with-triton"])
def fused_kernel(request, monkeypatch):
    """The fused AdaLN backward's kernel missing (as without Triton) or serving every tensor
    (faked by :func:`fake_fused_backward`, so CPU tensors take it too): what a test sees must
    not depend on whether its environment happens to have Triton. Yields the calls' batches."""
    from cudnorm import _ada_kernel

    calls = []
    if request.param:
        monkeypatch.setattr(_ada_kernel, "available", lambda x2, dtype: True)
        monkeypatch.setattr(_ada_kernel, "backward", fake_fused_backward(calls))
    else:
        monkeypatch.setattr(_ada_kernel, "_kernel", lambda: None)
    yield calls if request.param else None


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fresh_cache():
    """An empty plan cache for the test, restored to empty afterwards."""
    import cudnorm

    cudnorm.clear_cache()
    yield
    cudnorm.clear_cache()


@pytest.fixture(autouse=True)
def _test_config():
    """Every test runs under ``cudnorm.config(...)`` with the options below, and whatever the
    test changes with ``cudnorm.config`` is undone after it. Numerics tests compare cuDNN's
    graphs with references, so every CUDA call cuDNN can serve goes to cuDNN
    (``policy="cudnn"``: their shapes are small enough that the default policy would hand them
    to PyTorch's ops); the row-count policy is the library's default (the first row count of
    a shape family gets exact graphs, later ones run shared chunk graphs), so the numerics
    tests run the path users get. Tests of the kernel policy and of the row-chunking policy
    set ``policy`` / ``exact_rows`` / ``exact_after`` themselves. Tests must not read or fill
    the user's on-disk plan store (it would turn builds into loads between runs): plan-store
    tests configure their own."""
    import cudnorm
    from cudnorm import _rows

    with cudnorm.config(policy="cudnn", plan_store=False):
        _rows.reset()
        yield
    _rows.reset()


@pytest.fixture
def largest_fp32_tensor():
    """``measure(fn)``: the most elements of any fp32 tensor an aten op returns while ``fn()``
    runs (the fp32 copies a CPU fallback makes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype is torch.float32:
                    Record.largest = max(Record.largest, t.numel())
            return out

    def measure(fn) -> int:
        Record.largest = 0
        with Record():
            fn()
        return Record.largest

    return measure
