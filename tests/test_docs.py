"""The documentation stays complete and builds.

* every public name (and every public method of a public class) has a docstring;
* the API reference page renders every public name;
* every notebook is listed on the notebooks page;
* every error and warning message the package can raise is explained in
  docs/troubleshooting.md;
* ``mkdocs build --strict`` succeeds (warnings, broken links included, are errors).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cudnorm

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGE = ROOT / "cudnorm"
PUBLIC = [name for name in cudnorm.__all__ if name != "__version__"]


# nn.Module's repr hook: called by repr(), never by users, documented by PyTorch
NOT_API = {"extra_repr"}


def _own_public_methods(cls):
    """Public functions and properties defined by ``cls`` itself, in cudnorm."""
    for name, value in vars(cls).items():
        if name.startswith("_") or name in NOT_API:
            continue
        func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if inspect.isfunction(func) and func.__module__.startswith("cudnorm"):
            yield name, func


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_has_docstring(name):
    obj = getattr(cudnorm, name)
    assert (obj.__doc__ or "").strip(), f"cudnorm.{name} has no docstring"
    if inspect.isclass(obj):
        missing = [m for m, func in _own_public_methods(obj) if not (func.__doc__ or "").strip()]
        assert not missing, f"cudnorm.{name} methods without a docstring: {missing}"


def _api_targets() -> dict[str, object]:
    """``::: dotted.path`` lines of docs/api.md -> the object each names."""
    targets = {}
    for path in re.findall(r"^::: *([\w.]+)", (DOCS / "api.md").read_text(), flags=re.M):
        module, _, attr = path.rpartition(".")
        targets[path] = getattr(importlib.import_module(module), attr)
    return targets


def test_api_reference_lists_every_public_name():
    documented = {id(obj) for obj in _api_targets().values()}
    missing = [name for name in PUBLIC if id(getattr(cudnorm, name)) not in documented]
    assert not missing, f"docs/api.md has no '::: ...' entry for: {missing}"


def test_every_notebook_is_listed():
    page = (DOCS / "notebooks.md").read_text()
    missing = [p.name for p in sorted((ROOT / "notebooks").glob("*.ipynb")) if f"notebooks/{p.name}" not in page]
    assert not missing, f"docs/notebooks.md does not link: {missing}"


# -- error messages ------------------------------------------------------------------------
def _pieces(node) -> list[str | None] | None:
    """A message expression as literal text pieces (``None`` for each interpolated value),
    or ``None`` when it is not a string literal / f-string (or a ``+`` of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) else None for v in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _pieces(node.left), _pieces(node.right)
        return None if left is None or right is None else left + right
    return None


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _messages(tree: ast.AST):
    """``(line, pieces)`` of every message raised or warned: the longest string argument of
    an exception constructed in a ``raise`` (the CLI's ``UsageError(argument, message)``
    passes two), and of a call to ``warn``/``*_warn*``/``*fail*`` (the package's helpers that
    raise or warn for their caller)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            call = node.exc
        elif isinstance(node, ast.Call) and re.search(r"warn|fail", _callee(node), flags=re.I):
            call = node
        else:
            continue
        candidates = [p for p in map(_pieces, call.args) if p]
        if candidates:
            yield node.lineno, max(candidates, key=lambda p: sum(len(s) for s in p if s))


def _pattern(pieces: list[str | None]) -> re.Pattern | None:
    """Literal pieces in order on one line, anything in between; ``None`` if nothing literal
    of substance is left (a message that is only interpolation)."""
    literal = [" ".join(p.split()) for p in pieces if p is not None]
    if sum(len(p.strip(" :;,.()'\"")) for p in literal) < 4:
        return None
    return re.compile(".*?".join(re.escape(p) for p in literal if p), flags=re.I)


def error_messages() -> list[tuple[str, re.Pattern]]:
    """``("path:line", pattern)`` for every raise/warn message of the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, pieces in _messages(ast.parse(path.read_text())):
            pattern = _pattern(pieces)
            if pattern is not None:
                out.append((f"{path.relative_to(ROOT)}:{line}", pattern))
    return out


def test_error_scan_finds_the_known_families():
    """Guards the scanner itself: it must see the argument checks and the configuration checks."""
    patterns = [p.pattern for _, p in error_messages()]
    assert any("must\\ be\\ a\\ torch\\.Tensor" in p for p in patterns), patterns
    assert any("cudnorm:\\ ignoring" in p for p in patterns), patterns
    assert len(patterns) >= 15


def test_every_error_is_documented():
    page = (DOCS / "troubleshooting.md").read_text().replace("`", "")
    lines = [" ".join(line.split()) for line in page.splitlines()]
    missing = [f"{where}: {pattern.pattern}" for where, pattern in error_messages()
               if not any(pattern.search(line) for line in lines)]
    assert not missing, "docs/troubleshooting.md does not explain:\n" + "\n".join(missing)


# -- the site ------------------------------------------------------------------------------
def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner, not a build warning
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
