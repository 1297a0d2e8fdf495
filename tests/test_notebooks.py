"""Every tutorial notebook runs top to bottom, and the outputs git keeps come from its current
sources, executed on a GPU.

The notebooks run against this checkout (the repo root is put on the kernel's PYTHONPATH),
on the GPU when there is one and on the CPU fallback otherwise. nbclient and ipykernel come
with the ``dev`` extra; without them these tests fail rather than skip, so a CI job that
forgot them cannot pass silently. ``tools/make_notebooks.py --execute`` stores them with
their outputs on a GPU; ``--check`` (run here) refuses outputs of other sources or of a CPU.
"""

from __future__ import annotations

import getpass
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
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


def _make_notebooks():
    """``tools/make_notebooks.py`` as a module (tools/ is no package)."""
    _require("nbformat")
    spec = importlib.util.spec_from_file_location("make_notebooks", ROOT / "tools" / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _executed_on_a_gpu(make, nb):
    """``nb`` as ``--execute`` stores it on a GPU: an output per code cell and the metadata."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [make.nbformat.v4.new_output("stream", text="out\n")]
            cell.execution_count = 1
    nb.metadata["cudnorm"]["executed"] = {"source_sha256": make.source_hash(nb), "device": "NVIDIA H100 80GB HBM3",
                                          "cudnorm": "0.1.0", "commit": "abc1234"}
    return nb


def test_the_check_refuses_outputs_of_other_sources_or_of_a_cpu():
    """What ``--check`` tells apart: a notebook executed on a GPU from its current sources
    passes; edited cells, outputs of other sources, outputs of a CPU, and outputs that
    ``--execute`` did not store are each refused."""
    make = _make_notebooks()
    source = make.SOURCES / "00_quickstart.py"
    current = _executed_on_a_gpu(make, make.build(source))
    assert make.problems(make.build(source), current, executed=False) == []
    edited = _executed_on_a_gpu(make, make.build(source))
    edited.cells[2].source += "\nprint('edited')"
    assert "its cells differ from its source" in make.problems(make.build(source), edited, executed=False)[0]
    stale = _executed_on_a_gpu(make, make.build(source))
    stale.metadata["cudnorm"]["executed"]["source_sha256"] = "0" * 64
    assert make.problems(make.build(source), stale, executed=False) == [
        "its outputs come from other sources (executed at abc1234)"]
    on_cpu = _executed_on_a_gpu(make, make.build(source))
    on_cpu.metadata["cudnorm"]["executed"]["device"] = "cpu"
    assert make.problems(make.build(source), on_cpu, executed=False) == ["its outputs were made on a CPU, not a GPU"]
    by_hand = _executed_on_a_gpu(make, make.build(source))
    del by_hand.metadata["cudnorm"]["executed"]
    assert make.problems(make.build(source), by_hand, executed=False) == [
        "it holds outputs that tools/make_notebooks.py --execute did not store"]
    stripped = make.build(source)
    assert make.problems(make.build(source), stripped, executed=False) == []
    assert "no outputs of cudnorm" in make.problems(make.build(source), stripped, executed=True)[0]


def test_notebooks_match_sources():
    """The committed notebooks are what tools/make_notebooks.py builds from their sources, and
    any outputs they hold were made from those sources on a GPU."""
    _require("nbformat")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "make_notebooks.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, f"run `python tools/make_notebooks.py`:\n{done.stdout}{done.stderr}"


@pytest.mark.slow
def test_execute_stores_outputs_with_the_device_and_versions_first(tmp_path):
    """``--execute`` (here with ``--allow-cpu``, the test machine has no GPU) stores the
    notebook with its outputs, the environment cell's output first, and metadata naming the
    device and the hash of the sources it ran."""
    make = _make_notebooks()
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "make_notebooks.py"), "--execute", "--allow-cpu",
                           "--into", str(tmp_path), "00_quickstart"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    nb = make.nbformat.read(tmp_path / "00_quickstart.ipynb", as_version=4)
    first = nb.cells[0].outputs[0]["text"]
    assert first.startswith("device: cpu\ncudnorm ") and " torch " in first
    assert nb.metadata["cudnorm"]["executed"]["source_sha256"] == make.source_hash(make.build(
        make.SOURCES / "00_quickstart.py"))
    assert all(cell.outputs for cell in nb.cells if cell.cell_type == "code" and "print(" in cell.source)
    refused = subprocess.run([sys.executable, str(ROOT / "tools" / "make_notebooks.py"), "--execute",
                              "--into", str(tmp_path), "00_quickstart"], capture_output=True, text=True, timeout=600)
    if not __import__("torch").cuda.is_available():
        assert refused.returncode == 2 and "no CUDA device" in refused.stderr


# Notebooks with cells that run only where the cuDNN frontend imports (the README's CPU set-up
# leaves it out): marked ``frontend``, so .ci/run runs them again once it has installed it.
USES_FRONTEND = {"20_adaptive_layer_norm"}


def _notebook_params(paths):
    return [pytest.param(p, id=p.stem, marks=[pytest.mark.frontend] if p.stem in USES_FRONTEND else [])
            for p in paths]


@pytest.mark.slow
@pytest.mark.parametrize("path", _notebook_params(NOTEBOOKS))
def test_notebook_runs(path, monkeypatch, tmp_path):
    _execute(path, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem in USES_FRONTEND], ids=lambda p: p.stem)
def test_notebook_runs_without_the_frontend(path, monkeypatch, tmp_path):
    """Where the frontend is installed, the notebook runs again with it hidden (a ``cudnn``
    package first on the kernel's path that fails to import, as a missing one does); each cell
    that needs it says so in one line naming the extra."""
    if importlib.util.find_spec("cudnn") is None:
        pytest.skip("the cuDNN frontend is not installed: test_notebook_runs ran this notebook without it")
    hidden = tmp_path / "hidden"
    (hidden / "cudnn").mkdir(parents=True)
    (hidden / "cudnn" / "__init__.py").write_text("raise ImportError('hidden by test_notebooks.py')\n")
    nb = _execute(path, monkeypatch, tmp_path, first_on_path=hidden)
    printed = "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)
    said = [line for line in printed.splitlines() if line.startswith("no cuDNN frontend: ")]
    assert said and all(line.endswith('pip install -e ".[frontend]" brings it') for line in said), printed


def _execute(path, monkeypatch, tmp_path, first_on_path=None):
    """The notebook at ``path`` run top to bottom against this checkout (``first_on_path``
    before it on the kernel's path); fails naming the cell that stopped."""
    nbformat = _require("nbformat")
    nbclient = _require("nbclient")
    _require("ipykernel")
    # the kernel inherits this process's environment: make it import this checkout
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [first_on_path and str(first_on_path), str(ROOT),
                                                                   os.environ.get("PYTHONPATH")])))
    # headless plotting in the kernel and its subprocesses (the notebooks display PNG files)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # the notebooks' temporary folders (cudnorm-bench-*, ...) go with the test's; Inductor keeps
    # its cache where it was (under the temporary directory by default): warm compiles stay warm
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exc:
        # IPython colours its tracebacks; strip the escape codes for a readable report
        pytest.fail(f"{path.name} failed:\n{ANSI_ESCAPE.sub('', str(exc))}")
    return nb
