"""Two ``cudnorm bench --sweep`` runs cell by cell (``cudnorm bench --from-csv NEW --against OLD``):
how far each provider's GPU times moved between them, PyTorch's column being the noise floor of
the two machines and runs, and the cells where what cudnorm serves lost ground against PyTorch.

A change to the dispatcher or a kernel is judged by a sweep after it against one before it;
between two default sweeps on H200s cuDNN's own column moved by more than 15% in 21-40 of 732
cells while PyTorch's moved in none (docs/performance.md, width sweep), so a provider's moves are
read against PyTorch's before a served cell's are blamed on the change."""

from __future__ import annotations

import statistics

from .sweep import PROVIDERS
from .sweep_report import LEFT, by_cell

# a provider's GPU time "moved" in a cell where the two runs differ by more than this either way:
# PyTorch's own column stayed inside it in every cell between five default sweeps on H200s
MOVED = 0.15


def provider_moves(new: list[dict], old: list[dict]) -> list[list[str]]:
    """Per provider timed in both runs: the cells both timed, the median new / old GPU time, and
    the cells where it grew or shrank by more than :data:`MOVED`."""
    a, b = by_cell(new), by_cell(old)
    lines = [["provider", "cells in both", "new / old (median)", f"slower by > {MOVED:.0%}",
              f"faster by > {MOVED:.0%}"]]
    for provider in PROVIDERS:
        ratios = [a[k][provider]["gpu_ms"] / b[k][provider]["gpu_ms"]
                  for k in a.keys() & b.keys() if provider in a[k] and provider in b[k]]
        if ratios:
            lines.append([provider, str(len(ratios)), f"{statistics.median(ratios):.3f}",
                          str(sum(r > 1 + MOVED for r in ratios)), str(sum(r < 1 / (1 + MOVED) for r in ratios))])
    return lines


def _served(cell: dict[str, dict]) -> float | None:
    """cudnorm's ratio to PyTorch's GPU time in one run's cell (> 1: faster than PyTorch)."""
    if "cudnorm" not in cell or "torch" not in cell:
        return None
    return cell["torch"]["gpu_ms"] / cell["cudnorm"]["gpu_ms"]


def served_losses(new: list[dict], old: list[dict], count: int = 20) -> list[list[str]]:
    """The ``count`` cells where cudnorm's ratio to PyTorch (each run's own) fell the most, by more
    than :data:`cudnorm._bench.sweep_report.LEFT`: the ratio and what served in each run."""
    a, b = by_cell(new), by_cell(old)
    fell = []
    for key in a.keys() & b.keys():
        now, then = _served(a[key]), _served(b[key])
        if now is not None and then is not None and now < then / (1 + LEFT):
            fell.append((now / then, key, now, then))
    lines = [["cell", "N", "rows", "old", "new", "served (old -> new)"]]
    for _, (case, cols, rows), now, then in sorted(fell)[:count]:
        serves = [run[(case, cols, rows)]["cudnorm"].get("serves") or "?" for run in (b, a)]
        lines.append([case, str(cols), str(rows), f"{then:.2f}x", f"{now:.2f}x", " -> ".join(serves)])
    return lines


def served_summary(new: list[dict], old: list[dict]) -> list[list[str]]:
    """Both runs over the cells both timed: cudnorm's worst and median ratio to PyTorch, the cells
    below 1.00x, and the cells whose ratio fell or rose by more than ``LEFT``."""
    a, b = by_cell(new), by_cell(old)
    pairs = [(_served(a[k]), _served(b[k])) for k in a.keys() & b.keys()]
    pairs = [(now, then) for now, then in pairs if now is not None and then is not None]
    if not pairs:
        return [["run", "cells"]]
    lines = [["run", "cells", "worst", "median", "below 1.00x", f"fell by > {LEFT:.0%}", f"rose by > {LEFT:.0%}"]]
    for name, ratios in (("old", [t for _, t in pairs]), ("new", [n for n, _ in pairs])):
        lines.append([name, str(len(ratios)), f"{min(ratios):.2f}x", f"{statistics.median(ratios):.2f}x",
                      str(sum(r < 0.995 for r in ratios)),
                      str(sum(n < t / (1 + LEFT) for n, t in pairs)) if name == "new" else "",
                      str(sum(n > t * (1 + LEFT) for n, t in pairs)) if name == "new" else ""])
    return lines


_TICKS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)


def plot(new: list[dict], old: list[dict], path, title: str):
    """One PNG: per op and direction, each cell's cudnorm ratio to PyTorch in the new run over the
    old run's, by width (log scale; below 1: lost ground), the cells whose server changed marked,
    and PyTorch again's same quotient in grey (the noise floor); ``None`` without matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.ticker import FuncFormatter  # noqa: PLC0415
    except ImportError:
        return None
    times = FuncFormatter(lambda v, _: f"{v:.3g}x")
    a, b = by_cell(new), by_cell(old)
    keys = sorted(a.keys() & b.keys(), key=lambda k: (k[0], k[1], k[2]))
    panels = list(dict.fromkeys(" ".join(k[0].split()[:2]) for k in keys))
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 0.4 + 2.2 * len(panels)), squeeze=False,
                             layout="constrained")
    for ax, panel in zip(axes[:, 0], panels):
        mine = [k for k in keys if k[0].startswith(panel + " ")]
        for provider, colour in (("torch-again", "0.6"), ("cudnorm", None)):
            points = [(k[1], (a[k]["torch"]["gpu_ms"] / a[k][provider]["gpu_ms"])
                       / (b[k]["torch"]["gpu_ms"] / b[k][provider]["gpu_ms"]), k) for k in mine
                      if provider in a[k] and provider in b[k] and "torch" in a[k] and "torch" in b[k]]
            if not points:
                continue
            if colour:
                ax.scatter([p[0] for p in points], [p[1] for p in points], s=6, color=colour, label=provider)
                continue
            changed = [a[k]["cudnorm"].get("serves") != b[k]["cudnorm"].get("serves") for _, _, k in points]
            for flag, marker, label in ((False, "o", "cudnorm, same server"), (True, "x", "cudnorm, server changed")):
                chosen = [p for p, c in zip(points, changed) if c == flag]
                if chosen:
                    ax.scatter([p[0] for p in chosen], [p[1] for p in chosen], s=10 if flag else 8, marker=marker,
                               label=label)
        ax.axhspan(1 / (1 + LEFT), 1 + LEFT, color="0.92", zorder=0)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        low, high = ax.get_ylim()
        ax.set_yticks([t for t in _TICKS if low <= t <= high])
        ax.yaxis.set_major_formatter(times)
        ax.minorticks_off()
        ax.set_title(panel, fontsize=9, loc="left")
        ax.set_ylabel("new / old ratio", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0, 0].legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel(f"width N (band: within {LEFT:.0%})", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
