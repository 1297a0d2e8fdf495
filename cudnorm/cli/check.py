"""``cudnorm check``: the main job of a fresh machine.

Prints ``cudnorm info``, then every op forward and backward in every dtype checked against
the fp64 reference (:func:`cudnorm._self_check.check`), one line per compared quantity.
Exits 1 on any failure, so it doubles as an installation test.
"""

from __future__ import annotations

from .._info import info
from .._self_check import check
from ._output import print_json_or_table


def add_arguments(parser) -> None:
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")


def run(args) -> int:
    print_json_or_table(info(), False)
    print()
    rows = check(args.device)
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}  {'qty':<8} {'path':<10} {'rel.err':>9} {'torch':>9} {'bound':>9}  result")
    for r in rows:
        print(f"{r['case']:<{width}}  {r['name']:<8} {r['path'].split(' ')[0]:<10} {r['error']:9.2e} "
              f"{r['torch_error']:9.2e} {r['bound']:9.2e}  {'ok' if r['ok'] else 'FAIL'}")
    failed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
