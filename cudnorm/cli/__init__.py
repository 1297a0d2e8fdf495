"""The cudnorm console command: inspect the install, check the ops, benchmark, warm up graphs.

    cudnorm info                 versions, device, which path serves each op
    cudnorm check                info + every op checked against the fp64 reference
    cudnorm bench [--quick]      speed vs peers (table, CSV, PNG)
    cudnorm warmup SPEC|--preset build the graphs a job needs ahead of time
    cudnorm cache info|clear     the on-disk plan store
    cudnorm build                compile the native launch path ahead of the first CUDA call

One module per subcommand, each with ``add_arguments(parser)`` and ``run(args) -> int``: it
parses, calls the library, prints and picks the exit status. The library never imports
this package. The console script is ``cudnorm_console.main`` (beside the package, so that
``cudnorm --version`` does not import torch), which hands everything else to :func:`main`;
``python -m cudnorm.cli`` is the same command without the console script.

Exit statuses: 0 done; 1 a check or benchmark row failed, or a file could not be read or
written (one line naming the path); 2 bad input (one line naming the argument, as argparse
reports a usage error; :mod:`cudnorm.cli._args`); 130 interrupted; 141 the reader of the
output went away. No traceback reaches the user for any of them.
"""

from __future__ import annotations

import argparse
import os
import sys

from .._version import __version__
from . import _args, bench, build, cache, check, info, warmup

# subcommand -> (module, help)
SUBCOMMANDS = {
    "info": (info, "versions, device and the path serving each op"),
    "check": (check, "check every op against the fp64 reference on this machine"),
    "bench": (bench, "benchmark cudnorm against its peers"),
    "warmup": (warmup, "build (and store) the graphs a job needs, ahead of the job"),
    "cache": (cache, "inspect or clear the on-disk plan store"),
    "build": (build, "compile the native launch path ahead of the first CUDA call"),
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser, reporting a usage error in one line (argparse prints the whole
    usage before it, several lines for ``bench``) that points to ``--help``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="cudnorm", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"cudnorm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        commands[name] = sub.add_parser(name, help=help_text, description=help_text)
        commands[name].set_defaults(_run=module.run)
        module.add_arguments(commands[name])
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse's parse_args reports a subcommand's unknown arguments as the top parser's
        # ("cudnorm: error"); name the subcommand they were given to
        given = sys.argv[1:] if argv is None else argv
        owner = parser if given.index(args.command) > 0 else commands[args.command]
        owner.error(f"unrecognized arguments: {' '.join(unknown)}")
    prog = f"{parser.prog} {args.command}"
    try:
        return int(args._run(args) or 0)
    except _args.UsageError as exc:
        return _error(prog, f"{exc} (see {prog} --help)", 2)
    except (TypeError, ValueError) as exc:
        if not str(exc).startswith("cudnorm"):
            raise  # not an argument error cudnorm reports: a bug, keep its traceback
        return _error(prog, f"{exc} (see {prog} --help)", 2)  # argparse's status for a usage error
    except BrokenPipeError:
        # the reader went away (`cudnorm info | head`): stop quietly, as shell tools do. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the broken pipe
    except OSError as exc:  # a file the command could not read or write
        return _error(prog, _args.describe_os_error(exc), 1)
    except KeyboardInterrupt:
        return _error(prog, "interrupted", 130)  # 128 + SIGINT, as a shell reports it


def _error(prog: str, message: str, status: int) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status
