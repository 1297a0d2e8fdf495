"""Without the cuDNN frontend (the README's CPU set-up leaves it out), every internal path that
needs it raises one error naming the function and the extra that installs it, never an
``AttributeError`` on ``None``; the public API still runs on PyTorch's kernels."""

from __future__ import annotations

import pytest
import torch

import cudnorm
from cudnorm import _graphs, _runtime
from cudnorm._spec import NormSpec

SPEC = NormSpec("layer_norm", "train", 64, 384, torch.bfloat16, torch.bfloat16, 0)


@pytest.fixture
def no_frontend(monkeypatch):
    monkeypatch.setattr(_runtime, "cudnn_module", lambda: None)


@pytest.mark.parametrize("name, call", [pytest.param(name, call, id=name.rpartition(".")[2]) for name, call in [
    ("cudnorm._graphs.build_ir", lambda: _graphs.build_ir(SPEC)),
    ("cudnorm._graphs._kernel_cache", lambda: _graphs._kernel_cache(SPEC)),
    ("cudnorm._graphs._heuristic_modes", lambda: _graphs._heuristic_modes(full=False)),
    ("cudnorm._graphs.deserialize_plan", lambda: _graphs.deserialize_plan(SPEC, b"")),
    ("cudnorm._runtime.torch_to_cudnn_dtype", lambda: _runtime.torch_to_cudnn_dtype(torch.float16)),
    ("cudnorm._runtime.handle", lambda: _runtime._DeviceState(0)),
]])
def test_paths_that_need_the_frontend_name_the_extra(no_frontend, name, call):
    with pytest.raises(_runtime.FrontendMissing) as caught:
        call()
    assert str(caught.value).startswith(f"{name}: the cuDNN frontend (nvidia-cudnn-frontend) does not import")
    assert 'pip install -e ".[frontend]"' in str(caught.value)
    assert isinstance(caught.value, ImportError)


def test_the_public_api_runs_without_it(no_frontend):
    x = torch.randn(4, 384)
    torch.testing.assert_close(cudnorm.layer_norm(x, (384,)), torch.nn.functional.layer_norm(x, (384,)))
    assert _graphs.RawExecute.mode() == "none (no cuDNN frontend)"
