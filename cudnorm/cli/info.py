"""``cudnorm info``: versions, device, cuDNN availability and the path serving each op."""

from __future__ import annotations

from .._info import info
from ._output import print_json_or_table


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    print_json_or_table(info(), args.json)
    return 0
