"""Output helpers shared by the subcommands: ``key: value`` blocks, JSON, column tables."""

from __future__ import annotations

import json


def print_json_or_table(data: dict, as_json: bool) -> None:
    """JSON for machines, aligned ``key: value`` lines for people."""
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


def print_table(rows: list[dict], columns: tuple[str, ...]) -> None:
    """Left-aligned columns with a header line."""
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in columns}
    print("  ".join(f"{c:<{widths[c]}}" for c in columns).rstrip())
    for r in rows:
        print("  ".join(f"{str(r.get(c, '')):<{widths[c]}}" for c in columns).rstrip())
