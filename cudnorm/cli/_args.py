"""Argument types and errors shared by the subcommands.

The CLI's contract: bad input is one line naming the argument, exit status 2 (argparse's
usage status); a failure the command could not carry out (a file it could not read or write)
is one line naming the path, exit status 1. The types below reject a bad value while argparse
parses, so it is reported as ``cudnorm <command>: error: argument <name>: <why>``; what only
shows once a command runs (the contents of a spec file) raises :class:`UsageError`, which
:func:`cudnorm.cli.main` reports the same way.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


class UsageError(Exception):
    """Bad input found while a command runs: ``argument <argument>: <message>``, exit status 2."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"argument {argument}: {message}")


def positive_int(text: str) -> int:
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    return _int(text, 0)


def _int(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
    return value


def input_file(text: str) -> Path:
    """A file to read: an existing regular file (not a folder, nor a FIFO a read would block
    on); whether it can be read shows when it is opened: exit status 1 naming it."""
    path = _path(text, "a file path")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular file")
    return path


def output_dir(text: str) -> Path:
    """A folder to write into: made when missing; it must not be an existing non-folder."""
    path = _path(text, "a folder path")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    return path


def _path(text: str, what: str) -> Path:
    """``text`` as a path that may name a file: a usage error naming the argument when it
    cannot (empty, a NUL byte, a name too long, a symlink loop, a file in place of a folder
    on the way); a path that exists or may be made is returned (one that cannot be read for
    want of permission fails when used, exit status 1)."""
    if not text:
        raise argparse.ArgumentTypeError(f"must be {what}, got ''")
    try:
        os.stat(text)
    except (FileNotFoundError, PermissionError):
        pass
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{text[:80]!r}{'...' if len(text) > 80 else ''} is not usable as "
                                         f"{what} ({getattr(exc, 'strerror', None) or exc})") from None
    return Path(text)


def describe_os_error(exc: OSError) -> str:
    """``<path>: <reason>`` for a failed file operation (the reason alone when no path is known)."""
    reason = exc.strerror or str(exc)
    paths = [os.fsdecode(p) for p in (exc.filename, exc.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {reason}" if paths else reason
