"""mkdocs hooks: publish files that live outside ``docs/`` and list the benchmark results.

* ``benchmarks/results/**`` plots and data (PNG, SVG, CSV, JSON) are copied into the site
  under ``results/``, and ``notebooks/*.ipynb`` under ``notebooks/``, so pages link them
  with relative links that the strict build checks.
* In ``performance.md`` the line ``<!-- benchmark-results -->`` becomes one section per
  results folder: its Markdown tables inlined, its plots shown, its data linked (a plot the
  page already shows is not shown twice); or a note that none is committed yet. The page
  therefore never links a file that does not exist.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NOTEBOOKS = ROOT / "notebooks"
RESULT_SUFFIXES = {".csv", ".png", ".svg", ".json", ".txt"}
MARKER = "<!-- benchmark-results -->"
SECTION_ORDER = {".png": 0, ".svg": 0, ".md": 1}


def _published() -> dict[str, Path]:
    """Site path -> file on disk, for every file published from outside ``docs/``."""
    out = {f"notebooks/{p.name}": p for p in sorted(NOTEBOOKS.glob("*.ipynb"))}
    if RESULTS.is_dir():
        for path in sorted(RESULTS.rglob("*")):
            if path.is_file() and path.suffix.lower() in RESULT_SUFFIXES:
                out[f"results/{path.relative_to(RESULTS).as_posix()}"] = path
    return out


def on_files(files: Files, config) -> Files:
    for site_path, path in _published().items():
        files.append(File.generated(config, site_path, abs_src_path=str(path)))
    return files


def results_markdown(page: str = "") -> str:
    """The benchmark section of the performance page, built from what is committed; plots
    already shown in ``page`` (its Markdown) are linked instead of shown again."""
    groups: dict[Path, list[Path]] = {}
    if RESULTS.is_dir():
        for path in sorted(RESULTS.rglob("*")):
            if path.is_file() and path.suffix.lower() in RESULT_SUFFIXES | {".md"}:
                groups.setdefault(path.parent, []).append(path)
    for paths in groups.values():  # plots first, then the tables, then links to the data
        paths.sort(key=lambda p: (SECTION_ORDER.get(p.suffix.lower(), len(SECTION_ORDER)), p.name))
    if not groups:
        return ("!!! note \"No benchmark results are committed yet\"\n"
                "    `benchmarks/results/` holds no result files in this version. Run "
                "`cudnorm bench` on your GPU to measure your own.\n")
    lines = []
    for folder, paths in groups.items():
        # the marker sits under the page's own "## Result files" heading
        lines.append(f"### {folder.relative_to(RESULTS).as_posix() if folder != RESULTS else 'results'}\n")
        for path in paths:
            link = "results/" + path.relative_to(RESULTS).as_posix()
            if path.suffix == ".md":
                lines.append(_demote_headings(path.read_text().strip()) + "\n")
            elif path.suffix.lower() in (".png", ".svg") and f"]({link})" not in page:
                lines.append(f"![{path.name}]({link})\n")
            else:
                lines.append(f"- [{path.name}]({link})\n")
    return "\n".join(lines) + "\n"


def _demote_headings(markdown: str, levels: int = 3) -> str:
    """Headings of an inlined file go below the folder's own ``###`` heading (at most h6)."""
    return re.sub(r"^(#{1,6}) ", lambda m: "#" * min(6, len(m.group(1)) + levels) + " ", markdown, flags=re.M)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, results_markdown(markdown))
    return markdown
