"""Speed-ups, the printed tables, the CSV, the PNG plot and the markdown summary."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path

from . import plots

COLUMNS = ("op", "shape", "M", "N", "provider", "status", "path", "plan", "build_s", "error", "bound",
           "ms", "gbps", "pct_copy", "speedup", "best_peer", "bytes")
GOAL_PCT, GOAL_COLS = 90.0, (1024, 16384)  # issue 4: >= 90% of copy bandwidth for 1024 <= N <= 16384

LEGEND = """\
Legend: numbers are GB/s = bytes an ideal kernel moves (each input read once, each output written
once: bf16 x/dy/y/dx, fp32 LN/RMS weights, fp32 mean/rstd) / median time; the same bytes for every
provider, so GB/s ratios are speed ratios. fwd = training forward (stats saved), bwd = autograd
backward of a saved output (Liger LN and Quack: their backward kernels called directly).
WRONG = failed the check against the fp64 reference (error > 2x eager PyTorch's, or the dtype floor)
and was not timed; ERR/OOM = raised; '-' = not run. %copy = cudnorm GB/s / measured copy GB/s.
vs best = best other provider's time / cudnorm's time (>1: cudnorm faster). goal: 'ok', or the
misses: slower than the best peer, or < 90% of copy bandwidth where 1024 <= N <= 16384 (LN/RMS);
none on the CPU, where every provider runs PyTorch's code (the goals are a GPU's)."""


def add_speedups(rows: list[dict]) -> None:
    """Set ``speedup`` and ``best_peer`` on every timed cudnorm row: the fastest *other*
    provider's ms divided by cudnorm's ms, among rows of the same op and shape (the A/A
    control, PyTorch timed again, is no peer)."""
    groups = defaultdict(list)
    for row in rows:
        groups[(row["op"], row["shape"])].append(row)
    for group in groups.values():
        peers = [r for r in group if r["provider"] not in ("cudnorm", plots.AA) and r["ms"]]
        for row in group:
            if row["provider"] == "cudnorm" and row["ms"] and peers:
                best = min(peers, key=lambda r: r["ms"])
                row["speedup"], row["best_peer"] = best["ms"] / row["ms"], best["provider"]


def goal(row: dict) -> str:
    """``"ok"`` or the issue-4 goals this cudnorm row misses ("" when nothing to compare)."""
    if row["status"] != "ok":
        return "cudnorm " + cell(row)
    misses = []
    if row["speedup"] is not None and row["speedup"] < 1.0:
        misses.append(f"slower than {row['best_peer']}")
    in_range = GOAL_COLS[0] <= row["N"] <= GOAL_COLS[1] and not row["op"].startswith("ada")
    if in_range and row["pct_copy"] is not None and row["pct_copy"] < GOAL_PCT:
        misses.append(f"<{GOAL_PCT:.0f}% copy")
    return "; ".join(misses) or ("ok" if row["speedup"] is not None else "")


def cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["gbps"] is not None:
        return f"{row['gbps']:.0f}" if row["gbps"] >= 100 else f"{row['gbps']:.3g}"
    status = row["status"]
    return "WRONG" if status.startswith("wrong") else "OOM" if status.startswith("OOM") else "ERR" if status else "-"


def op_tables(rows: list[dict], providers: list[str]) -> dict[str, list[list[str]]]:
    """``{op: [header, *rows]}``: one line per shape, GB/s per provider, then cudnorm's
    ms, %copy, speed-up over the best peer, goal and serving path. A CPU run (every cudnorm
    row served on CPU tensors: PyTorch's code against PyTorch's) leaves the goal column ``-``."""
    verdicts = not all("cpu tensor" in r["path"] for r in rows if r["provider"] == "cudnorm" and r["path"])
    tables = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        by_shape = defaultdict(dict)
        for r in rows:
            if r["op"] == op:
                by_shape[r["shape"]][r["provider"]] = r
        lines = [["shape", *providers, "cudnorm ms", "%copy", "vs best", "goal", "cudnorm path / plan"]]
        for shape, got in by_shape.items():
            mine = got.get("cudnorm")
            extra = ["", "", "", "", ""]
            if mine is not None:
                extra = [f"{mine['ms']:.4f}" if mine["ms"] is not None else "",
                         f"{mine['pct_copy']:.0f}%" if mine["pct_copy"] is not None else "",
                         f"{mine['speedup']:.2f}x {mine['best_peer']}" if mine["speedup"] is not None else "",
                         goal(mine) if verdicts else "-", " ".join(filter(None, (mine["path"], mine["plan"])))]
            lines.append([shape, *(cell(got.get(p)) for p in providers), *extra])
        tables[op] = lines
    return tables


def text_table(lines: list[list[str]], left: int = 1, right: int = 2) -> str:
    """Aligned columns: the first ``left`` and last ``right`` left-aligned, numbers right-aligned."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    last = len(widths) - right

    def fmt(i, value):
        return value.ljust(widths[i]) if i < left or i >= last else value.rjust(widths[i])

    return "\n".join("  ".join(fmt(i, v) for i, v in enumerate(line)).rstrip() for line in lines)


def markdown_table(lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0])]
    out += ["| " + " | ".join(line) + " |" for line in lines[1:]]
    return "\n".join(out)


def write_csv(rows: list[dict], path: Path, columns=COLUMNS) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k)) for k in columns})


_INTS, _FLOATS = ("M", "N", "bytes"), ("build_s", "error", "bound", "ms", "gbps", "pct_copy", "speedup")


def read_csv(path: Path) -> list[dict]:
    """Rows of a ``bench.csv`` with numbers as numbers and blanks as ``None``."""
    def typed(key, value):
        if value == "" and key in _INTS + _FLOATS:
            return None
        return int(value) if key in _INTS else float(value) if key in _FLOATS else value

    with open(path, newline="") as f:
        return [{k: typed(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


def _csv_value(value):
    if isinstance(value, float):  # repr round-trips exactly, so --from-csv redraws the same tables
        return "" if math.isnan(value) else repr(value)
    return "" if value is None else value


def plot(rows: list[dict], copy_gbps: float, path: Path) -> Path | None:
    """GB/s vs N (log2 axis; AdaLN: one tick per shape), one subplot per op, one line per
    provider, the copy bandwidth dashed. ``None`` when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    ops = list(dict.fromkeys(r["op"] for r in rows))
    ncols = min(2, len(ops))
    nrows = math.ceil(len(ops) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7 * ncols, 4.2 * nrows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        timed = [r for r in rows if r["op"] == op and r["gbps"]]
        shapes = list(dict.fromkeys(r["shape"] for r in rows if r["op"] == op))
        for provider in dict.fromkeys(r["provider"] for r in timed):
            mine = [r for r in timed if r["provider"] == provider]
            if op.startswith("ada"):
                points = sorted((shapes.index(r["shape"]), r["gbps"]) for r in mine)
            else:
                points = sorted((r["N"], r["gbps"]) for r in mine)
            ax.plot(*zip(*points), marker="o", label=provider, linewidth=2.2 if provider == "cudnorm" else 1.2)
        ax.axhline(copy_gbps, linestyle="--", color="gray", label=f"copy {copy_gbps:.0f} GB/s")
        if op.startswith("ada"):
            ax.set_xticks(range(len(shapes)), shapes, rotation=20, fontsize=7)
            ax.set_xlabel("B x S x D")
        else:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("N (normalised size)")
        ax.set_title(op)
        ax.set_ylabel("GB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_speedups(rows: list[dict], device_name: str, path: Path) -> Path | None:
    """cudnorm's kernel time against eager PyTorch's per op and shape, one panel per op, the
    ``torch-again`` rows (when asked for) as the noise band (:func:`.plots.ratio_plot`)."""
    return plots.ratio_plot(plots.op_panels(rows), title=f"cudnorm bench on {device_name}: cudnorm against eager PyTorch",
                            xlabel="speed-up over eager PyTorch (kernel time, > 1 faster)", path=path, columns=2)


def summary_markdown(meta: dict, tables: dict[str, list[list[str]]], sections: list[tuple[str, str, list]]) -> str:
    """The README-ready record of a run: ``meta`` (command, device, versions, copy bandwidth,
    timer) as a list, each op's table, then ``sections`` as ``(title, how measured, table)``."""
    out = ["# cudnorm bench", ""]
    out += [f"- {key}: `{value}`" if key == "command" else f"- {key}: {value}" for key, value in meta.items()]
    for op, lines in tables.items():
        out += ["", f"## {op} (GB/s)", "", markdown_table(lines)]
    for title, how, lines in sections:
        out += ["", f"## {title}", "", how, ""] + ([markdown_table(lines)] if lines else [])
    out += ["", "## Legend", "", LEGEND, ""]
    return "\n".join(out)
