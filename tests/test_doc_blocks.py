"""Every code block of README.md and docs/ runs as written (``tools/doc_blocks.py`` lists them
and says where each runs).

The blocks of one page and tier run in order in a fresh copy of the checkout, as a reader
would type them there: a ``python`` block as a script, a ``bash`` block as a ``bash -e``
script (``cudnorm`` and ``python`` are this interpreter and this checkout). Unmarked blocks
run on the CPU, in the slow tier (each starts an interpreter), ``gpu`` ones on a GPU (on as
many GPUs as a ``--nproc-per-node`` in them asks). The ``ci-setup`` and ``ci-tests``
blocks install and run the test suite itself, so ``.ci/run`` runs them; here it is checked
that it does. A block that stops running fails its page's test, naming the block's line.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _doc_blocks():
    spec = importlib.util.spec_from_file_location("doc_blocks", ROOT / "tools" / "doc_blocks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


doc_blocks = _doc_blocks()
BLOCKS = doc_blocks.blocks()
_RUN_HERE = {"cpu": [pytest.mark.slow], "gpu": [pytest.mark.gpu]}


def _groups():
    """``pytest.param((page, kind))`` for every page and kind of block run here."""
    groups = defaultdict(list)
    for block in BLOCKS:
        if block.kind in _RUN_HERE:
            groups[(block.page, block.kind)].append(block)
    return [pytest.param(blocks, id=f"{page}-{kind}", marks=_RUN_HERE[kind]) for (page, kind), blocks in groups.items()]


def test_every_block_has_a_known_language_and_place():
    """python/bash run, text is output; each runs here or in .ci/run, which runs the README's
    set-up and test blocks as written (through tools/doc_blocks.py), without the frontend."""
    wrong = [f"{b.where}: {b.language!r} block, kind {b.kind!r}" for b in BLOCKS
             if b.language not in doc_blocks.LANGUAGES or (b.language == "text") != (b.kind == "output")
             or b.kind not in (*doc_blocks.KINDS, "output")]
    assert not wrong, "blocks without a known language or place:\n" + "\n".join(wrong)
    ci = (ROOT / ".ci" / "run").read_text()
    for kind in ("ci-setup", "ci-tests"):
        assert [b for b in BLOCKS if b.kind == kind and b.page == "README.md"], f"README.md has no {kind} block"
        assert f"tools/doc_blocks.py {kind})" in ci, f".ci/run does not run the {kind} blocks"
    # the README's tiers run as its reader has them (no frontend); then what needs the frontend
    frontend = ci.index('pip install -q -e ".[dev,frontend]"')
    assert ci.index("tools/doc_blocks.py ci-tests)") < frontend < ci.index("python3 -m pytest -m frontend"), \
        ".ci/run must run the README's tests before it installs the frontend, and the frontend tests after"


def source_files(root: Path) -> list[str]:
    """The source tree's files under ``root``, relative to it: in a git checkout the files git
    tracks and those it does not ignore (a file added since the last commit, or a copy of a
    working tree whose git index is older than its files); in a tree without git (a release
    tarball, ``git archive``), every file but what its .gitignore names (caches, build outputs)."""
    if (root / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, check=True).stdout
        return [name for name in listed.decode().split("\0") if name and (root / name).is_file()]
    ignore = root / ".gitignore"
    patterns = [line.strip().strip("/") for line in ignore.read_text().splitlines()
                if line.strip() and not line.startswith("#")] if ignore.exists() else []
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if not any(fnmatch.fnmatch(d, p) for p in patterns)]
        found += [os.path.relpath(os.path.join(directory, f), root) for f in files
                  if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    return sorted(Path(name).as_posix() for name in found)


def test_the_source_tree_is_listed_without_git(tmp_path):
    for name in ("README.md", "cudnorm/a.py", "cudnorm/__pycache__/a.cpython-311.pyc", "cudnorm.egg-info/PKG-INFO",
                 "docs/b.md", ".pytest_cache/v/x"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / ".gitignore").write_text("__pycache__/\n*.pyc\n.pytest_cache/\n*.egg-info/\n")
    assert source_files(tmp_path) == [".gitignore", "README.md", "cudnorm/a.py", "docs/b.md"]


@pytest.fixture
def checkout(tmp_path):
    """A copy of the source tree (blocks write files, relative to it) and the environment its
    blocks run in."""
    copy = tmp_path / "checkout"
    for name in source_files(ROOT):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, command in (("cudnorm", f'exec "{sys.executable}" -m cudnorm.cli "$@"'),
                          ("python", f'exec "{sys.executable}" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{command}\n")
        (bin_dir / name).chmod(0o755)
    # the copy first (its cudnorm is imported), then what the caller's PYTHONPATH held (where
    # packages come from it, as on the GPU machines: the cuDNN frontend)
    path = os.pathsep.join(filter(None, (str(copy), os.environ.get("PYTHONPATH"))))
    # then the scripts of this interpreter's environment (torchrun, mkdocs, jupyter), also when
    # it runs without its environment activated
    scripts = os.pathsep.join((str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]))
    env = {**os.environ, "PATH": scripts, "PYTHONPATH": path,
           "MPLBACKEND": "Agg", "CUDNORM_PLAN_STORE_DIR": str(tmp_path / "plans"), "OMP_NUM_THREADS": "1"}
    return copy, env


@pytest.mark.parametrize("blocks", _groups())
def test_blocks_run_as_written(blocks, checkout):
    copy, env = checkout
    wanted = max([int(n) for b in blocks for n in re.findall(r"--nproc-per-node (\d+)", b.code)] + [1])
    if blocks[0].kind == "gpu" and torch.cuda.device_count() < wanted:
        pytest.skip(f"needs {wanted} GPUs")
    for block in blocks:
        script = copy / f"doc-block-{block.line}.{'py' if block.language == 'python' else 'sh'}"
        script.write_text(block.code)
        command = [sys.executable, str(script)] if block.language == "python" else ["bash", "-e", str(script)]
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (f"{block.where} stopped running (exit {done.returncode}):\n{block.code}\n"
                                      f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
