"""Every tutorial notebook runs top to bottom, and git keeps them without outputs.

The notebooks run against this checkout (the repo root is put on the kernel's PYTHONPATH),
on the GPU when there is one and on the CPU fallback otherwise. nbclient and ipykernel come
with the ``dev`` extra; without them these tests fail rather than skip, so a CI job that
forgot them cannot pass silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _require(module: str):
    try:
        return __import__(module)
    except ImportError:
        pytest.fail(f"{module} is not installed; install the dev extra: pip install -e '.[dev]'")


EXPECTED = ["00_quickstart", "10_layer_norm_and_rms_norm", "20_adaptive_layer_norm", "30_dit_training",
            "40_graph_cache_warmup", "50_performance", "60_patching_a_model"]


def test_the_tutorial_series_is_complete():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stripped(path):
    nbformat = _require("nbformat")
    nb = nbformat.read(path, as_version=4)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs, f"{path.name} cell {index} has outputs; run tools/make_notebooks.py"
            assert cell.execution_count is None, f"{path.name} cell {index} has an execution count"


def test_notebooks_match_sources():
    """The committed notebooks are what tools/make_notebooks.py builds from their sources."""
    _require("nbformat")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "make_notebooks.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, f"run `python tools/make_notebooks.py`:\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nbformat = _require("nbformat")
    nbclient = _require("nbclient")
    _require("ipykernel")
    # the kernel inherits this process's environment: make it import this checkout
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # headless plotting in the kernel and its subprocesses (the notebooks display PNG files)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exc:
        # IPython colours its tracebacks; strip the escape codes for a readable report
        pytest.fail(f"{path.name} failed:\n{ANSI_ESCAPE.sub('', str(exc))}")
