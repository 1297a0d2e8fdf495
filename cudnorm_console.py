"""The ``cudnorm`` console script: ``cudnorm --version`` answers without importing the library
(``import cudnorm`` imports torch, 2-3 s); every other command line is :func:`cudnorm.cli.main`'s.

This module sits beside the package, not in it, because importing any module of a package
runs the package's ``__init__`` first.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path


def version() -> str:
    """``cudnorm/_version.py``'s ``__version__``, read from the file (the package is not imported)."""
    package = importlib.util.find_spec("cudnorm")
    return runpy.run_path(str(Path(package.submodule_search_locations[0]) / "_version.py"))["__version__"]


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--version"]:
        print(f"cudnorm {version()}")
        return 0
    from cudnorm.cli import main as cli_main  # noqa: PLC0415 - the library, torch with it: only past --version

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
