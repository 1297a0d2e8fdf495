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


@pytest.fixture
def cudnorm_env(monkeypatch):
    """Set cudnorm environment settings for one test (they are read at import, so the
    settings are reloaded after each change and restored afterwards)."""
    from cudnorm import _settings

    def setenv(name, value):
        monkeypatch.setenv(name, value)
        _settings.reload()

    yield setenv
    monkeypatch.undo()
    _settings.reload()


@pytest.fixture(autouse=True)
def _exact_graphs(monkeypatch):
    """Numerics tests compare cuDNN's exact-shape graphs with references, so every CUDA call
    cuDNN can serve goes to cuDNN (``CUDNORM_POLICY=cudnn``: their shapes are small enough
    that the default policy would hand them to PyTorch's ops) and every row count gets its
    own graph at its first call; tests of the kernel policy and of the row-chunking policy
    set CUDNORM_POLICY / CUDNORM_EXACT_ROWS / CUDNORM_EXACT_AFTER themselves (through
    ``cudnorm_env``)."""
    from cudnorm import _rows, _settings

    monkeypatch.setenv("CUDNORM_POLICY", "cudnn")
    monkeypatch.setenv("CUDNORM_EXACT_ROWS", "1000000")
    monkeypatch.setenv("CUDNORM_EXACT_AFTER", "1")
    _settings.reload()
    _rows.reset()
    yield
    monkeypatch.undo()
    _settings.reload()
    _rows.reset()


@pytest.fixture(autouse=True)
def _no_default_plan_store():
    """Tests must not read or fill the user's on-disk plan store (it would turn builds into
    loads between runs); plan-store tests install their own store."""
    from cudnorm import _dispatch

    saved = _dispatch._plan_store
    _dispatch.set_plan_store(None)
    yield
    _dispatch.set_plan_store(saved)
