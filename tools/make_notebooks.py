"""Build ``notebooks/*.ipynb`` from their sources in ``tools/notebook_sources/*.py``, and
execute them on a GPU so that git keeps them with their outputs.

The sources are plain Python in the "percent" format, so they diff and review like code::

    # %% [markdown]
    # # A heading
    # Markdown text, each line behind "# ".

    # %%
    print("a code cell")

Every notebook starts with one code cell added here, :data:`ENVIRONMENT_CELL`, whose output
names the device and the versions it ran with. A notebook's metadata ``cudnorm.source_sha256``
hashes its cells' sources; ``cudnorm.executed`` (device, versions, commit, date) is set when
``--execute`` ran it. So a committed notebook with outputs says where they come from, and
``--check`` tells whether they come from the current sources.

    python tools/make_notebooks.py             # rebuild every notebook: one whose sources
                                               # changed loses its outputs, the others keep theirs
    python tools/make_notebooks.py --check     # are the committed notebooks current? (CI, on a CPU)
    python tools/make_notebooks.py --execute   # on a GPU: run each one, store it with its outputs
    python tools/make_notebooks.py --execute --into DIR   # ... into DIR instead of notebooks/

``--check`` fails when a notebook's cells differ from what its source builds, or when it
holds outputs that were not made from its current sources on a GPU. Outputs also depend on
the library: re-execute on the device before a release (``--check --executed`` then also
requires every notebook to hold outputs of this cudnorm version).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's cudnorm, the one the notebooks import
SOURCES = ROOT / "tools" / "notebook_sources"
NOTEBOOKS = ROOT / "notebooks"
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}
CELL_TIMEOUT_S = 600
ENVIRONMENT_CELL = """\
# Where this notebook last ran (tools/make_notebooks.py adds this cell to every notebook)
import platform

import torch

import cudnorm

print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
print(f"cudnorm {cudnorm.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}), cudnn-frontend {cudnorm.info()['cudnn_frontend']}, "
      f"Python {platform.python_version()}")"""


def parse_cells(text: str) -> list[tuple[str, str]]:
    """``[(kind, source)]`` of a percent-format file; kind is ``"code"`` or ``"markdown"``."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
        elif cells:
            kind, lines = cells[-1]
            if kind == "markdown":
                if line and not line.startswith("#"):
                    raise ValueError(f"markdown line without '# ': {line!r}")
                line = line[2:] if line.startswith("# ") else line.lstrip("#")
            lines.append(line)
        elif line.strip():
            raise ValueError(f"text before the first '# %%' marker: {line!r}")
    return [(kind, "\n".join(lines).strip("\n")) for kind, lines in cells]


def source_hash(nb: nbformat.NotebookNode) -> str:
    """SHA-256 of the notebook's cells (kind and source, in order): what its outputs depend on
    besides the library."""
    cells = [[cell.cell_type, cell.source] for cell in nb.cells]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()


def build(source: Path) -> nbformat.NotebookNode:
    """The notebook of one source file, without outputs: the environment cell, then the
    source's cells."""
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(ENVIRONMENT_CELL))
    for kind, text in parse_cells(source.read_text()):
        new = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(new(text))
    for cell in nb.cells:
        cell.pop("id", None)  # random ids would make every rebuild a diff
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"},
                   "cudnorm": {"source_sha256": source_hash(nb)}}
    nb.nbformat_minor = 4  # the last minor version without mandatory cell ids
    nbformat.validate(nb)
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def has_outputs(nb: nbformat.NotebookNode) -> bool:
    return any(cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None) for cell in nb.cells)


def problems(built: nbformat.NotebookNode, committed: nbformat.NotebookNode, *, executed: bool) -> list[str]:
    """Why ``committed`` is not the current notebook of its source (``built``): other cells,
    or outputs not made from these cells on a GPU; with ``executed``, also no outputs of this
    cudnorm version."""
    import cudnorm  # noqa: PLC0415 - the checkout's, on the path of this script's callers

    found = []
    stored = committed.metadata.get("cudnorm", {})
    if [(c.cell_type, c.source) for c in committed.cells] != [(c.cell_type, c.source) for c in built.cells]:
        found.append("its cells differ from its source: run tools/make_notebooks.py")
    elif stored.get("source_sha256") != source_hash(built):
        found.append("its metadata does not hash its cells: run tools/make_notebooks.py")
    run = stored.get("executed")
    if has_outputs(committed):
        if run is None:
            found.append("it holds outputs that tools/make_notebooks.py --execute did not store")
        elif run.get("source_sha256") != source_hash(built):
            found.append(f"its outputs come from other sources (executed at {run.get('commit')})")
        elif run.get("device", "cpu") == "cpu":
            found.append("its outputs were made on a CPU, not a GPU")
    if executed and (run is None or not has_outputs(committed) or run.get("cudnorm") != cudnorm.__version__):
        found.append(f"it holds no outputs of cudnorm {cudnorm.__version__} executed on a GPU: "
                     "run tools/make_notebooks.py --execute on one")
    return found


def _commit() -> str:
    """The checkout's commit, ``+dirty`` when files differ from it (what the outputs ran on)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def execute(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Run ``nb`` top to bottom in a kernel importing this checkout (plots inline, as a reader
    sees them) and record where it ran in its metadata."""
    import nbclient  # noqa: PLC0415 - the dev extra's; only executing needs it
    import torch  # noqa: PLC0415

    import cudnorm  # noqa: PLC0415

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("MPLBACKEND", None)  # the kernel's inline backend stores the plots as outputs
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute(env=env)
    nb.metadata["cudnorm"]["executed"] = {
        "source_sha256": source_hash(nb),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cudnorm": cudnorm.__version__, "torch": torch.__version__, "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="compare only; exit 1 if any notebook is not current")
    action.add_argument("--execute", action="store_true", help="run each notebook (on a GPU) and store its outputs")
    parser.add_argument("--executed", action="store_true",
                        help="with --check: also require outputs of this cudnorm version from a GPU (before a release)")
    parser.add_argument("--into", type=Path, default=NOTEBOOKS, help="with --execute: write there (default notebooks/)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="with --execute: run on a machine without a GPU (to test this script; --check refuses "
                             "the outputs)")
    parser.add_argument("names", nargs="*", help="notebook names (default: all), e.g. 00_quickstart")
    args = parser.parse_args(argv)
    sources = sorted(SOURCES.glob("*.py"))
    unknown = sorted(set(args.names) - {s.stem for s in sources})
    if unknown:
        parser.error(f"argument names: no source for {unknown}")
    chosen = [s for s in sources if not args.names or s.stem in args.names]
    if args.execute:
        return _execute_all(chosen, args.into, args.allow_cpu)
    status = 0
    for source in chosen:
        target = NOTEBOOKS / f"{source.stem}.ipynb"
        built = build(source)
        committed = nbformat.read(target, as_version=4) if target.exists() else None
        if args.check:
            found = ["it is missing"] if committed is None else problems(built, committed, executed=args.executed)
            for why in found:
                print(f"notebooks/{target.name}: {why}")
            status |= bool(found)
        elif committed is None or render(committed) != render(built) and problems(built, committed, executed=False):
            target.write_text(render(built))  # its sources changed: the outputs of the old ones go
            print(f"notebooks/{target.name}: written")
    orphans = sorted({p.stem for p in NOTEBOOKS.glob("*.ipynb")} - {s.stem for s in sources})
    for name in orphans:
        print(f"notebooks/{name}.ipynb has no source in tools/notebook_sources/", file=sys.stderr)
    return 1 if orphans or status else 0


def _execute_all(sources: list[Path], into: Path, allow_cpu: bool) -> int:
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available() and not allow_cpu:
        print("tools/make_notebooks.py --execute: no CUDA device here; the notebooks are stored as a GPU ran "
              "them (--allow-cpu to test this script)", file=sys.stderr)
        return 2
    into.mkdir(parents=True, exist_ok=True)
    for source in sources:
        started = datetime.datetime.now()
        nb = execute(build(source))
        (into / f"{source.stem}.ipynb").write_text(render(nb))
        print(f"{into / source.stem}.ipynb: executed on {nb.metadata['cudnorm']['executed']['device']} in "
              f"{(datetime.datetime.now() - started).total_seconds():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
