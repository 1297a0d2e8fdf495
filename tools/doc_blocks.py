"""The code blocks of README.md and docs/*.md, and where each runs as written.

Every ``python`` and ``bash`` block runs (``tests/test_doc_blocks.py``); a ``text`` block is
output, not code. docs/api.md renders docstrings, so its blocks are the literal blocks
(``Example::``) of the docstrings it names. A comment on the line before a block's fence
says where it runs; without one, on the CPU (in the slow test tier: each block starts an
interpreter, and some run for tens of seconds):

    <!-- doc-test: gpu -->       on a GPU, in the GPU suite (skipped without CUDA)
    <!-- doc-test: ci-setup -->  by .ci/run, as its install step (a test cannot install into
                                 its own environment)
    <!-- doc-test: ci-tests -->  by .ci/run, as its test step (the test suite itself)

The blocks of one page and tier run in order, in one folder holding a copy of the checkout,
so a later block may use a file an earlier one wrote.

    python tools/doc_blocks.py ci-setup   # the commands of the ci-setup blocks (.ci/run runs them)
    python tools/doc_blocks.py ci-tests
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("cpu", "gpu", "ci-setup", "ci-tests")
LANGUAGES = ("python", "bash", "text")
_FENCE = re.compile(r"^(?:<!-- doc-test: (?P<kind>[\w-]+) -->\n)?```(?P<language>\w*)[^\n]*\n(?P<code>.*?)^```",
                    flags=re.S | re.M)


@dataclass(frozen=True)
class Block:
    """One code block: where it is (``page`` relative to the repo, 1-based ``line`` of its
    fence, or the docstring it comes from), its language, where it runs and its code."""

    page: str
    line: int
    language: str
    kind: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(root: Path = ROOT, *, docstrings: bool = True) -> list[Block]:
    """Every code block of :func:`pages`, in page order; docs/api.md's from its docstrings
    (which imports cudnorm) unless ``docstrings`` is false."""
    found = []
    for path in pages(root):
        page = path.relative_to(root).as_posix()
        text = path.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start("language")) + 1
            language = m["language"]
            kind = m["kind"] or ("cpu" if language in ("python", "bash") else "output")
            found.append(Block(page, line, language, kind, m["code"]))
        if page == "docs/api.md" and docstrings:
            found += _docstring_blocks(page, text)
    return found


def _docstring_blocks(page: str, text: str) -> list[Block]:
    """The literal blocks (a line ending in ``::``, then an indented block) of the docstrings
    that ``::: dotted.path`` lines of ``text`` render; python, run on the CPU."""
    sys.path.insert(0, str(ROOT))
    found = []
    for number, dotted in _targets(text):
        module, _, name = dotted.rpartition(".")
        doc = inspect.getdoc(getattr(importlib.import_module(module), name)) or ""
        lines = doc.splitlines()
        for i, line in enumerate(lines):
            if not line.rstrip().endswith("::"):
                continue
            body = []
            for following in lines[i + 1:]:
                if following.strip() and not following.startswith(" "):
                    break
                body.append(following)
            code = textwrap.dedent("\n".join(body)).strip("\n")
            if code:
                found.append(Block(page, number, "python", "cpu", code + "\n"))
    return found


def _targets(text: str) -> list[tuple[int, str]]:
    return [(text.count("\n", 0, m.start()) + 1, m[1]) for m in re.finditer(r"^::: *([\w.]+)", text, flags=re.M)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=KINDS, help="print the code of the blocks of this kind, in page order")
    args = parser.parse_args(argv)
    for block in blocks(docstrings=args.kind == "cpu"):  # before the set-up, nothing imports cudnorm
        if block.kind == args.kind:
            print(f"# {block.where}\n{block.code}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
