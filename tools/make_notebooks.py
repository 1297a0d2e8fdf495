"""Build ``notebooks/*.ipynb`` from their sources in ``tools/notebook_sources/*.py``.

The sources are plain Python in the "percent" format, so they diff and review like code::

    # %% [markdown]
    # # A heading
    # Markdown text, each line behind "# ".

    # %%
    print("a code cell")

The notebooks are written without outputs or execution counts (that is what git keeps).
``--check`` only compares and exits non-zero when a notebook is missing or out of date,
which ``tests/test_notebooks.py`` runs.

    python tools/make_notebooks.py          # (re)write every notebook
    python tools/make_notebooks.py --check  # are the committed notebooks current?
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "tools" / "notebook_sources"
NOTEBOOKS = ROOT / "notebooks"
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


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


def build(source: Path) -> nbformat.NotebookNode:
    """The stripped notebook of one source file."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    for kind, text in parse_cells(source.read_text()):
        new = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = new(text)
        cell.pop("id", None)  # random ids would make every rebuild a diff
        nb.cells.append(cell)
    nb.nbformat_minor = 4  # the last minor version without mandatory cell ids
    nbformat.validate(nb)
    return nb


def render(source: Path) -> str:
    return nbformat.writes(build(source)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if anything differs")
    args = parser.parse_args(argv)
    stale = []
    for source in sorted(SOURCES.glob("*.py")):
        target = NOTEBOOKS / f"{source.stem}.ipynb"
        text = render(source)
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not args.check:
            target.write_text(text)
    orphans = sorted({p.stem for p in NOTEBOOKS.glob("*.ipynb")} - {p.stem for p in SOURCES.glob("*.py")})
    for name in orphans:
        print(f"notebooks/{name}.ipynb has no source in tools/notebook_sources/", file=sys.stderr)
    verb = "out of date" if args.check else "written"
    for name in stale:
        print(f"notebooks/{name}: {verb}")
    return 1 if orphans or (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
