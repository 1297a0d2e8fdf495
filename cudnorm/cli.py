"""The ``cudnorm`` console command.

    cudnorm info                 versions, device, which path serves each op
    cudnorm check                info + every op checked against the fp64 reference
    cudnorm bench [--quick]      speed vs peers (table, CSV, PNG)
    cudnorm warmup SPEC|--preset build the graphs a job needs ahead of time
    cudnorm cache info|clear     the on-disk plan store

Each subcommand lives with the code it drives; this module only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

# subcommand -> (module, help); each module defines add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "info": ("cudnorm._info", "versions, device and the path serving each op"),
    "check": ("cudnorm._check", "check every op against the fp64 reference on this machine"),
    "bench": ("cudnorm._bench", "benchmark cudnorm against its peers"),
    "warmup": ("cudnorm.warmup", "build (and store) the graphs a job needs, ahead of the job"),
    "cache": ("cudnorm._plan_store", "inspect or clear the on-disk plan store"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cudnorm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except BrokenPipeError:
        # the reader went away (`cudnorm info | head`): stop quietly, as shell tools do. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the broken pipe


def print_json_or_table(data: dict, as_json: bool) -> None:
    """Shared output helper: JSON for machines, aligned ``key: value`` lines for people."""
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return
    width = max(len(k) for d in (data, *(v for v in data.values() if isinstance(v, dict))) for k in d)
    for key, value in data.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k:<{width}} {v}")
        else:
            print(f"{key:<{width}} {value}")


if __name__ == "__main__":
    sys.exit(main())
