"""Warnings that point at the user's line, not at the cudnorm line that noticed the problem.

A warning is raised deep inside the package (a plan store read under a forward, the
environment read while ``import cudnorm`` runs), at a depth that changes with the path that
got there, so no fixed ``stacklevel`` is right. :func:`warn` attributes the warning to the
first frame outside cudnorm and outside the machinery a call passes through on its way in:
PyTorch (``nn.Module.__call__``, autograd), ``contextlib`` (a ``with`` block's exit) and the
import system.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

_PASSED_THROUGH = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
                   os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
                   os.path.abspath(contextlib.__file__))


def _passed_through(filename: str) -> bool:
    return filename.startswith("<frozen importlib") or os.path.abspath(filename).startswith(_PASSED_THROUGH)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the caller's line (the module
    docstring); the filters and the once-per-location registry work as for ``warnings.warn``."""
    frame = sys._getframe(1)
    while frame.f_back is not None and _passed_through(frame.f_code.co_filename):
        frame = frame.f_back
    # what warnings.warn passes for that frame (no module globals: the source line is read
    # when the warning is shown, and a `python -c` frame has no loader that can give it)
    module_globals = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__", "<string>"),
                           registry=module_globals.setdefault("__warningregistry__", {}))
