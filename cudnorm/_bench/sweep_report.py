"""``cudnorm bench --sweep``'s results read back: its CSV, the summary's tables (worst cells,
medians, copy fractions, first-call costs) and the heatmaps (:mod:`.sweep` measures them)."""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from . import report
from .sweep import PROVIDERS

_INTS = ("cols", "rows", "elements", "uncovered")
_FLOATS = ("gpu_ms", "host_us", "ratio_vs_torch", "measure_ms")


def read_csv(path: Path) -> list[dict]:
    """Rows of a ``sweep.csv``, numbers as numbers, blanks as ``None``."""
    with open(path, newline="") as f:
        return [{k: (None if v == "" and k in _INTS + _FLOATS else int(v) if k in _INTS
                     else float(v) if k in _FLOATS else v) for k, v in row.items()} for row in csv.DictReader(f)]


def _case(r: dict) -> str:
    return f"{r['op']} {r['direction']} {r['dtype']}/w={r['weight_dtype']}/b={r['bias']}"


def by_cell(rows: list[dict]) -> dict[tuple[str, int, int], dict[str, dict]]:
    """``{(case, cols, rows): {provider: row}}`` of the rows with a GPU time."""
    cells = defaultdict(dict)
    for r in rows:
        if r.get("gpu_ms"):
            cells[(_case(r), r["cols"], r["rows"])][r["provider"]] = r
    return cells


def exponent(r: dict) -> int:
    """The power of two ``e`` a cell was sized from: its rows are ``2^e // cols``, so a width that
    does not divide ``2^e`` (72, 192, 1152, ...) leaves fewer elements than ``2^e``, yet more than
    ``2^(e-1)`` (one row at least): ``e`` is the element count's log2 rounded up."""
    return (int(r["elements"]) - 1).bit_length()


def _ratios(rows: list[dict], provider: str = "cudnorm") -> list[dict]:
    return [r for r in rows if r["provider"] == provider and r.get("ratio_vs_torch")]


def worst_table(rows: list[dict], count: int = 20) -> list[list[str]]:
    """The ``count`` cells where cudnorm's ratio to PyTorch is lowest, with every provider's ratio."""
    cells = by_cell(rows)
    others = [p for p in PROVIDERS if p not in ("torch", "cudnorm") and any(r["provider"] == p for r in rows)]
    worst = sorted(_ratios(rows), key=lambda r: r["ratio_vs_torch"])[:count]
    lines = [["cell", "N", "rows", "torch ms", "cudnorm ms", "cudnorm", "serves", *others]]
    for r in worst:
        got = cells[(_case(r), r["cols"], r["rows"])]
        ratio = {p: got[p].get("ratio_vs_torch") for p in others if p in got}
        lines.append([_case(r), str(r["cols"]), str(r["rows"]), f"{got['torch']['gpu_ms']:.4f}",
                      f"{r['gpu_ms']:.4f}", f"{r['ratio_vs_torch']:.2f}x", r.get("serves") or "",
                      *(f"{ratio[p]:.2f}x" if ratio.get(p) else "-" for p in others)])
    return lines


def medians(rows: list[dict]) -> list[list[str]]:
    """cudnorm's median ratio for widths >= 512 at >= 2^21 elements, per op/direction and overall
    (issue 46's target: >= 1.15x), beside PyTorch again's."""
    lines = [["cells (N >= 512, >= 2^21 elements)", "count", "cudnorm median", "torch-again median"]]

    def kept(provider):
        return [r for r in _ratios(rows, provider) if r["cols"] >= 512 and exponent(r) >= 21]

    groups = defaultdict(lambda: defaultdict(list))
    for provider in ("cudnorm", "torch-again"):
        for r in kept(provider):
            groups[_case(r)][provider].append(r["ratio_vs_torch"])
            groups["all"][provider].append(r["ratio_vs_torch"])
    for case, got in groups.items():
        lines.append([case, str(len(got["cudnorm"])), *(f"{statistics.median(got[p]):.3f}x" if got[p] else "-"
                                                         for p in ("cudnorm", "torch-again"))])
    return lines


def worst_per_provider(rows: list[dict]) -> list[list[str]]:
    lines = [["provider", "worst cell", "N", "rows", "ratio", "failed cells"]]
    for provider in dict.fromkeys(r["provider"] for r in rows):
        mine = [r for r in rows if r["provider"] == provider]
        failed = sum(1 for r in mine if r.get("error") and not r["error"].startswith("unsupported"))
        timed = [r for r in mine if r.get("ratio_vs_torch")]
        if not timed:
            lines.append([provider, "-", "", "", "", str(failed)])
            continue
        r = min(timed, key=lambda r: r["ratio_vs_torch"])
        lines.append([provider, _case(r), str(r["cols"]), str(r["rows"]), f"{r['ratio_vs_torch']:.2f}x", str(failed)])
    return lines


def copy_fractions(rows: list[dict], providers_: Iterable[str] = ("cudnorm", "kernel", "torch")) -> list[list[str]]:
    """Per op/direction, at widths 64-256 and >= 2^25 elements: each provider's bandwidth as a
    fraction of the copy's (copy ms / provider ms: issue 46's target >= 80%), median and worst."""
    cells = by_cell([r for r in rows if 64 <= r["cols"] <= 256 and exponent(r) >= 25])
    providers_ = [p for p in providers_ if any(p in got for got in cells.values())]
    lines = [["cells (N 64-256, >= 2^25 elements)", "count", *(f"{p} median / worst" for p in providers_)]]
    groups = defaultdict(lambda: defaultdict(list))
    for (case, _, _), got in cells.items():
        for p in providers_:
            if "copy" in got and p in got:
                groups[case][p].append(got["copy"]["gpu_ms"] / got[p]["gpu_ms"])
    for case, got in sorted(groups.items()):
        lines.append([case, str(max(map(len, got.values())))] + [
            f"{statistics.median(got[p]):.0%} / {min(got[p]):.0%}" if got[p] else "-" for p in providers_])
    return lines


# issue 46's bound on the dispatcher's first-call measurement of one signature
MEASURE_BOUND_MS = 50.0


def measure_costs(rows: list[dict]) -> list[list[str]]:
    """The dispatcher's first-call measurement of each signature the sweep met: wall ms of its
    timing runs, median, 90th percentile, worst, and how many took longer than
    :data:`MEASURE_BOUND_MS`. (Building and first-running each candidate, ``prepare=``/``first=``
    in the ``decision`` column, is left out: a first call pays that for the kernel that serves
    it, measured or not.)"""
    costs = sorted(r["measure_ms"] for r in rows if r["provider"] == "cudnorm" and r.get("measure_ms"))
    if not costs:
        return [["measured signatures"]]
    return [["measured signatures", "median ms", "p90 ms", "worst ms", f"over {MEASURE_BOUND_MS:.0f} ms"],
            [str(len(costs)), f"{statistics.median(costs):.1f}", f"{costs[int(0.9 * (len(costs) - 1))]:.1f}",
             f"{costs[-1]:.1f}", str(sum(ms > MEASURE_BOUND_MS for ms in costs))]]


# what the dispatcher chooses among (the sweep's other providers are peers or references)
CHOICES = ("torch", "cudnn", "kernel")
# a cell "leaves" a gain where its fastest choice on the GPU beat what served by more than this:
# above the dispatcher's own MIN_GAIN (3%), so a lead it rightly takes for noise is not counted
LEFT = 0.05


def _left_cells(rows: list[dict]) -> list[tuple[float, dict, dict]]:
    """``(best / served GPU time, served row, best row)`` of every cell where a choice of the
    dispatcher's (:data:`CHOICES`) ran faster on the GPU than what served it by more than
    :data:`LEFT`, most left first."""
    out = []
    for got in by_cell(rows).values():
        served = got.get("cudnorm")
        timed = [got[p] for p in CHOICES if p in got]
        if served is None or not timed:
            continue
        best = min(timed, key=lambda r: r["gpu_ms"])
        left = served["gpu_ms"] / best["gpu_ms"]
        if left > 1.0 + LEFT:
            out.append((left, served, best))
    return sorted(out, key=lambda t: -t[0])


def gain_left(rows: list[dict]) -> list[list[str]]:
    """Per op/direction: the cells where the dispatcher served something slower on the GPU than
    its fastest choice by more than :data:`LEFT`, and by how much (median and worst). The sweep's
    ratios are GPU time, the dispatcher's charge GPU plus host time: a cell here is a gain a step
    bound by its GPU does not get (docs/performance.md, width sweep)."""
    cells = defaultdict(int)
    for r in _ratios(rows):
        cells[_case(r)] += 1
    groups = defaultdict(list)
    for left, served, _ in _left_cells(rows):
        groups[_case(served)].append(left)
    lines = [["cells", "count", f"faster choice by > {LEFT:.0%}", "median", "worst"]]
    for case, count in sorted(cells.items()):
        got = groups.get(case, [])
        lines.append([case, str(count), str(len(got)), f"{statistics.median(got):.2f}x" if got else "-",
                      f"{max(got):.2f}x" if got else "-"])
    return lines


def left_table(rows: list[dict], count: int = 10) -> list[list[str]]:
    """The ``count`` cells of :func:`gain_left` with the most left: what served and the faster
    choice, each with its GPU ms and host us per call (what the dispatcher weighed)."""
    lines = [["cell", "N", "rows", "serves", "GPU ms", "host us", "faster", "GPU ms", "host us", "left"]]
    for left, served, best in _left_cells(rows)[:count]:
        lines.append([_case(served), str(served["cols"]), str(served["rows"]), served.get("serves") or "",
                      f"{served['gpu_ms']:.4f}", f"{served['host_us']:.1f}" if served.get("host_us") else "-",
                      best["provider"], f"{best['gpu_ms']:.4f}",
                      f"{best['host_us']:.1f}" if best.get("host_us") else "-", f"{left:.2f}x"])
    return lines


# the heatmaps' colour scale spans 1/3x to 3x (beyond: the end colours), so that a cell a few
# percent either side of PyTorch still shows, where a scale up to the narrow cells' 40x hid it
HEAT_REACH = 3.0


def heat_grid(rows: list[dict], variant: str) -> tuple[list[int], list[int], list[list[float]]]:
    """``(exponents, widths, values)`` of one heatmap panel: ``values[i][j]`` is cudnorm's ratio
    to PyTorch at ``2^exponents[i]`` elements and width ``widths[j]`` (NaN: not timed), over the
    element counts and widths of all of ``rows`` (one op and direction), so that every panel of a
    figure has the same axes."""
    exponents = sorted({exponent(r) for r in rows})
    widths = sorted({r["cols"] for r in rows})
    values = [[math.nan] * len(widths) for _ in exponents]
    for r in rows:
        if _case(r) == variant:
            values[exponents.index(exponent(r))][widths.index(r["cols"])] = r["ratio_vs_torch"]
    return exponents, widths, values


def heatmaps(rows: list[dict], device_name: str, out: Path) -> list[Path]:
    """One PNG per op/direction: cudnorm / PyTorch by width (x) and element count (y), one panel
    per dtype/weight/bias variant, diverging colours on a log scale centred at 1.0 (red: slower),
    from 1/:data:`HEAT_REACH` to :data:`HEAT_REACH`."""
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.colors import LogNorm  # noqa: PLC0415
    except ImportError:
        return []
    timed = _ratios(rows)
    paths = []
    for op, direction in dict.fromkeys((r["op"], r["direction"]) for r in timed):
        mine = [r for r in timed if (r["op"], r["direction"]) == (op, direction)]
        variants = list(dict.fromkeys(_case(r) for r in mine))
        norm = LogNorm(vmin=1 / HEAT_REACH, vmax=HEAT_REACH)
        width_count = len({r["cols"] for r in mine})
        fig, axes = plt.subplots(len(variants), 1, figsize=(max(8.0, 0.09 * width_count + 2), 0.5 + 1.9 * len(variants)),
                                 squeeze=False, layout="constrained")
        for ax, variant in zip(axes[:, 0], variants):
            counts, widths, grid_values = heat_grid(mine, variant)
            image = ax.pcolormesh(grid_values, cmap="RdBu", norm=norm)
            step = max(1, len(widths) // 40)
            ax.set_xticks([i + 0.5 for i in range(0, len(widths), step)], [str(w) for w in widths[::step]],
                          rotation=90, fontsize=6)
            ax.set_yticks([i + 0.5 for i in range(len(counts))], [f"2^{c}" for c in counts], fontsize=7)
            ax.set_ylabel("elements", fontsize=8)
            ax.set_title(variant, fontsize=9, loc="left")
        axes[-1, 0].set_xlabel("width N (rows = elements // N)", fontsize=8)
        bar = fig.colorbar(image, ax=axes[:, 0].tolist(), extend="both")
        bar.set_label("speed-up over PyTorch", fontsize=8)
        ticks = [1 / HEAT_REACH, 0.5, 1.0, 2.0, HEAT_REACH]
        bar.set_ticks(ticks, labels=[f"{t:.2g}x" for t in ticks], fontsize=7)
        bar.ax.minorticks_off()
        # two lines: on one, a sweep of a few widths (a narrow figure) cut the title at both ends
        fig.suptitle(f"cudnorm (default policy) vs PyTorch, {op} {direction}, {device_name}\n"
                     "PyTorch's GPU time / cudnorm's (blue > 1: faster)", fontsize=10)
        path = out / f"sweep_{op}_{direction}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def uncovered_table(rows: list[dict], count: int = 20) -> list[list[str]]:
    """The rows with rounds whose leading GPU sleep the host outlasted even when timed again
    (:func:`cudnorm._sleep_timing.timed_burst`): their GPU time may include waits on the host.
    Most such rounds first; a sweep written before the column existed has none."""
    hit = sorted((r for r in rows if r.get("uncovered")), key=lambda r: (-r["uncovered"], _case(r), r["cols"]))
    lines = [["cell", "N", "rows", "provider", "uncovered rounds", "gpu ms", "host us"]]
    for r in hit[:count]:
        lines.append([_case(r), str(r["cols"]), str(r["rows"]), r["provider"], str(r["uncovered"]),
                      f"{r['gpu_ms']:.4f}" if r.get("gpu_ms") else "-", f"{r['host_us']:.0f}" if r.get("host_us") else "-"])
    return lines


def summary_markdown(rows: list[dict], meta: dict) -> str:
    parts = ["# cudnorm bench --sweep", ""] + [f"- **{k}**: {v}" for k, v in meta.items()]
    nothing = "(nothing timed)"
    for title, lines, empty in (
            ("Worst 20 cells (cudnorm / PyTorch GPU time, lowest first)", worst_table(rows), nothing),
            ("Median ratio, widths >= 512 at >= 2^21 elements", medians(rows), nothing),
            ("Worst cell of each provider", worst_per_provider(rows), nothing),
            ("Gain left: a faster choice on the GPU than what served", gain_left(rows), nothing),
            ("The cells with the most gain left", left_table(rows), nothing),
            ("Narrow widths: bandwidth as a fraction of a copy's", copy_fractions(rows), nothing),
            ("First-call measurement (the dispatcher timing a signature's candidates)", measure_costs(rows), nothing),
            ("Rounds the host outlasted the GPU sleep of (GPU time may include host waits)", uncovered_table(rows),
             "(none: every round's sleep outlasted the host)")):
        parts += ["", f"## {title}", "", report.markdown_table(lines) if len(lines) > 1 else empty]
    return "\n".join(parts) + "\n"
