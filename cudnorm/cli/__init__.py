"""The ``cudnorm`` console command.

    cudnorm info                 versions, device, which path serves each op
    cudnorm check                info + every op checked against the fp64 reference
    cudnorm bench [--quick]      speed vs peers (table, CSV, PNG)
    cudnorm warmup SPEC|--preset build the graphs a job needs ahead of time
    cudnorm cache info|clear     the on-disk plan store
    cudnorm build                compile the native launch path ahead of the first CUDA call

One module per subcommand, each with ``add_arguments(parser)`` and ``run(args) -> int``: it
parses, calls the library, prints and picks the exit status. The library never imports
this package. ``python -m cudnorm.cli`` is the same command without the console script.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import bench, build, cache, check, info, warmup

# subcommand -> (module, help)
SUBCOMMANDS = {
    "info": (info, "versions, device and the path serving each op"),
    "check": (check, "check every op against the fp64 reference on this machine"),
    "bench": (bench, "benchmark cudnorm against its peers"),
    "warmup": (warmup, "build (and store) the graphs a job needs, ahead of the job"),
    "cache": (cache, "inspect or clear the on-disk plan store"),
    "build": (build, "compile the native launch path ahead of the first CUDA call"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cudnorm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_run=module.run)
        module.add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (TypeError, ValueError) as exc:
        if not str(exc).startswith("cudnorm"):
            raise  # not an argument error cudnorm reports: a bug, keep its traceback
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2  # argparse's status for a usage error
    except BrokenPipeError:
        # the reader went away (`cudnorm info | head`): stop quietly, as shell tools do. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the broken pipe
