"""``cudnorm cache info|clear``: inspect or empty the on-disk plan store."""

from __future__ import annotations

import json
from pathlib import Path

from .._plan_store import current_store
from ._output import print_json_or_table, print_table


def add_arguments(parser) -> None:
    parser.add_argument("action", choices=("info", "clear"), help="show the store, or delete every entry")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args) -> int:
    store = current_store()
    if args.action == "clear":
        removed = store.clear()  # PermissionError naming the store: cudnorm.cli.main's exit status 1
        print(f"removed {removed} file(s) from {store.root}")
        return 0
    summary = store.info()
    entries = store.entries()
    if args.json:
        print(json.dumps({**summary, "files": entries}, indent=2, default=str))
        return 0
    print_json_or_table({**summary, "bytes": _size(summary["bytes"]), "max_bytes": _size(summary["max_bytes"])}, False)
    if entries:
        print()
        print_table([_entry_row(e) for e in entries], ("op", "phase", "shape", "dtype", "gpu", "plan", "size", "age"))
    return 0


def _entry_row(entry: dict) -> dict:
    age, size = _age(entry["age_s"]), _size(entry["bytes"])
    if "error" in entry:
        return {"op": Path(entry["path"]).name, "phase": "-", "shape": "-", "dtype": "-", "gpu": "-",
                "plan": f"unreadable: {entry['error']}", "size": size, "age": age}
    h = entry["header"]
    spec = h["spec"]
    shape = f"{spec['rows']}x{spec['cols']}" + (f" (b{spec['batch']})" if spec.get("batch", 1) != 1 else "")
    return {"op": spec["op"], "phase": spec["phase"], "shape": shape,
            "dtype": f"{spec['x_dtype']}/{spec['scale_dtype']}", "gpu": h["fingerprint"].get("gpu", "?"),
            "plan": h.get("plan_name", "?"), "size": size, "age": age}


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MB" if n >= 1 << 20 else f"{n / 1024:.1f} KB"


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f} {unit}"
    return f"{seconds:.0f} s"
