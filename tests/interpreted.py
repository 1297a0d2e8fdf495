"""Run a test module's checks of a Triton kernel under Triton's interpreter, on a CPU: in a child
process, since ``TRITON_INTERPRET`` is read when Triton is imported. The checks print
``interpreted cases ok`` when every case passed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def run(module: str, check: str, timeout: int = 600) -> None:
    """``module.check()`` (a function of a module in ``tests/``) under the interpreter; skips
    without Triton, fails with the child's stderr when a case failed."""
    pytest.importorskip("triton")
    code = f"import sys; sys.path.insert(0, 'tests'); import {module} as t; t.{check}()"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=TESTS.parent)
    assert done.returncode == 0 and "interpreted cases ok" in done.stdout, done.stderr[-3000:]
