"""Speed-up plots that read at a glance: one run, every bar a ratio against PyTorch starting
at 1.0, cases sorted by cudnorm's ratio, one panel per mode, and the run's A/A noise band
(PyTorch timed against itself in the same run) shaded around 1.0, so a gain inside the band
reads as the noise it is.

:func:`ratio_plot` draws; the three benchmarks turn their rows into its panels:
:func:`model_panels` (``cudnorm bench --models``: step-time speed-up per case),
:func:`op_panels` (``cudnorm bench``: kernel time per op and shape) and
:func:`host_panels` (the host-overhead section: host time per call). Each is what the
benchmark draws after a run and what ``cudnorm bench --from-csv`` redraws from its CSV.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

# the provider whose bars set the sort order; the A/A provider (PyTorch again, a second
# instance or a second timing) whose ratios to PyTorch make the noise band
PRIMARY, AA = "cudnorm", "torch-again"
_COLORS = {"cudnorm": "tab:blue", "cudnorm-cudnn": "tab:orange", "liger": "tab:green", "compile": "tab:purple",
           "quack": "tab:brown", "cudnn_ops": "tab:pink"}
_OTHER_COLORS = ("tab:olive", "tab:cyan", "tab:gray", "tab:red")

# a panel: (title, [(case label, provider, ratio)], [A/A ratios of this panel])
Panel = tuple[str, list[tuple[str, str, float]], list[float]]


def ratio_plot(panels: list[Panel], *, title: str, xlabel: str, path: Path, columns: int = 1) -> Path | None:
    """Horizontal bars from 1.0 to each ratio (> 1: faster than PyTorch), labelled with the
    ratio, one panel per entry of ``panels`` with its cases sorted by :data:`PRIMARY`'s ratio
    (best first). A panel's band is ``1 ± max |r - 1|`` over its A/A ratios, else over the
    whole run's; without any, the panel says no A/A was measured. All panels share one axis
    around 1.0, reaching :data:`PRIMARY`'s ratios and the bands (at least 0.95-1.05): another
    provider's bar beyond it is cut at the edge, its ratio written there. Panels fill ``columns`` columns,
    row by row. ``None`` when matplotlib is not installed or no panel has a bar."""
    panels = [p for p in panels if p[1]]
    if not panels:
        return None
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    run_aa = [r for _, _, aa in panels for r in aa]
    bands = [_band(aa or run_aa) for _, _, aa in panels]
    primary = [r for _, bars, _ in panels for _, p, r in bars if p == PRIMARY] or [r for _, bars, _ in panels
                                                                                    for _, _, r in bars]
    widest = max([b or 0.0 for b in bands] + [0.05])
    low, high = min(primary + [1.0 - widest]), max(primary + [1.0 + widest])
    pad = 0.15 * (high - low)
    limits = (max(0.0, low - pad), high + pad)
    providers = list(dict.fromkeys(p for _, bars, _ in panels for _, p, _ in bars))
    colors = {p: _COLORS.get(p) or _OTHER_COLORS[i % len(_OTHER_COLORS)] for i, p in enumerate(providers)}
    columns = min(columns, len(panels))
    rows = -(-len(panels) // columns)
    sizes = [0.8 + 0.3 * sum(len(g) for g in _grouped(bars).values()) for _, bars, _ in panels]
    heights = [max(sizes[r * columns:(r + 1) * columns]) for r in range(rows)]
    fig, axes = plt.subplots(rows, columns, figsize=(8.5 * columns, sum(heights) + 1.3), squeeze=False,
                             sharex=True, gridspec_kw={"height_ratios": heights}, layout="constrained")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    band_handle = None
    for ax, (panel_title, bars, aa), band in zip(axes.flat, panels, bands):
        band_handle = _draw_panel(ax, bars, colors, band, limits) or band_handle
        where = "" if aa or band is None else ", run-wide"
        note = f"A/A noise ±{band:.1%}{where}" if band is not None else "no A/A measured in this run"
        ax.set_title(f"{panel_title}  ({note})", fontsize=9, loc="left")
    axes[0, 0].set_xlim(*limits)  # shared by every panel
    for ax in axes[-1]:
        ax.set_xlabel(xlabel, fontsize=9)
        ax.tick_params(labelbottom=True)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in providers]
    labels = list(providers)
    if band_handle is not None:
        handles.append(band_handle)
        labels.append("A/A noise band: PyTorch against itself")
    fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _band(ratios: list[float]) -> float | None:
    return max(abs(r - 1.0) for r in ratios) if ratios else None


def _grouped(bars) -> dict[str, dict[str, float]]:
    """case -> {provider: ratio}, in the order the cases come."""
    by_case = defaultdict(dict)
    for case, provider, ratio in bars:
        by_case[case][provider] = ratio
    return by_case


def sorted_cases(bars) -> list[str]:
    """A panel's cases, best first by :data:`PRIMARY`'s ratio (by the best ratio shown for a
    case without one)."""
    by_case = _grouped(bars)
    return sorted(by_case, key=lambda c: -by_case[c].get(PRIMARY, max(by_case[c].values())))


def _draw_panel(ax, bars, colors, band, limits):
    """One panel: each case's bars one under another, cases sorted best first by
    :data:`PRIMARY`, the 1.0 line and the band; returns the band's artist (``None`` without)."""
    by_case = _grouped(bars)
    cases = sorted_cases(bars)
    y, ticks = 0.0, []
    for case in cases:
        got = [(p, by_case[case][p]) for p in colors if p in by_case[case]]
        ticks.append(y + (len(got) - 1) / 2)
        for provider, ratio in got:
            shown = min(max(ratio, limits[0]), limits[1])  # cut at the axis' edge
            ax.barh(y, shown - 1.0, left=1.0, height=0.8, color=colors[provider])
            cut = shown != ratio
            edge = limits[1] if ratio >= 1.0 else limits[0]
            inside = cut or abs(edge - ratio) < 0.12 * (limits[1] - limits[0])  # no room beyond the bar
            right = (ratio >= 1.0) != inside
            nudge = 0.006 * (limits[1] - limits[0]) * (1 if right else -1)
            ax.text(shown + nudge, y, f"{ratio:.2f}x" + (" (cut)" if cut else ""), va="center",
                    ha="left" if right else "right", fontsize=7, color="white" if inside else "black")
            y += 1
        y += 0.6  # a gap between cases
    ax.axvline(1.0, color="black", linewidth=0.8)
    handle = None
    if band is not None:
        handle = ax.axvspan(1.0 - band, 1.0 + band, color="gray", alpha=0.25, linewidth=0)
    ax.set_yticks(ticks, cases, fontsize=7)
    ax.set_ylim(y - 0.6 + 0.1, -0.7)  # best at the top
    ax.grid(axis="x", alpha=0.3)
    return handle


def latest_run(rows: list[dict]) -> tuple[str | None, list[dict]]:
    """``(call, rows of that call)``: the last ``call`` in the rows' order when they carry one
    (a results file that keeps every device call), else ``(None, rows)``."""
    calls = [r.get("call") for r in rows if r.get("call")]
    if not calls:
        return None, rows
    return calls[-1], [r for r in rows if r.get("call") == calls[-1]]


def model_panels(rows: list[dict], groups: dict[str, str]) -> list[Panel]:
    """``cudnorm bench --models`` rows (``speedup`` = PyTorch's step time / the provider's),
    one panel per mode group (``groups``: mode -> panel title, in panel order)."""
    panels: dict[str, Panel] = {title: (title, [], []) for title in dict.fromkeys(groups.values())}
    for r in rows:
        if r["provider"] == "torch" or not r.get("speedup"):
            continue
        _, bars, aa = panels[groups[r["mode"]]]
        if r["provider"] == AA:
            aa.append(float(r["speedup"]))
        else:  # the mode shows in the panel's title unless the panel holds several
            label = r["case"] if groups[r["mode"]] != r["mode"] else r["case"].split(":")[0]
            bars.append((label, r["provider"], float(r["speedup"])))
    return list(panels.values())


OP_TITLES = {"ln_fwd": "LayerNorm forward (training)", "ln_bwd": "LayerNorm backward",
             "rms_fwd": "RMSNorm forward (training)", "rms_bwd": "RMSNorm backward",
             "ada_fwd": "AdaLN forward (training)", "ada_bwd": "AdaLN backward"}


def op_panels(rows: list[dict]) -> list[Panel]:
    """``cudnorm bench`` rows: cudnorm's kernel time against eager PyTorch's (torch ms /
    cudnorm ms) per shape, one panel per op (the peers' GB/s are in ``bench.png``)."""
    torch_ms = {(r["op"], r["shape"]): float(r["ms"]) for r in rows if r["provider"] == "torch" and r.get("ms")}
    panels: dict[str, Panel] = {}
    for r in rows:
        base = torch_ms.get((r["op"], r["shape"]))
        if r["provider"] not in (PRIMARY, AA) or not r.get("ms") or base is None:
            continue
        _, bars, aa = panels.setdefault(r["op"], (OP_TITLES.get(r["op"], r["op"]), [], []))
        ratio = base / float(r["ms"])
        if r["provider"] == AA:
            aa.append(ratio)
        else:
            bars.append((r["shape"], r["provider"], ratio))
    return list(panels.values())


def host_panels(rows: list[dict]) -> list[Panel]:
    """Host-overhead rows: PyTorch's host µs per call (fresh tensors) over the provider's, per
    op, one panel per direction (forward for inference, forward for training, backward)."""
    torch_us = {(r["op"], r["direction"]): float(r["fresh_us"]) for r in rows if r["provider"] == "torch"}
    panels: dict[str, Panel] = {}
    for r in rows:
        if r["provider"] == "torch":
            continue
        _, bars, aa = panels.setdefault(r["direction"], (r["direction"], [], []))
        ratio = torch_us[(r["op"], r["direction"])] / float(r["fresh_us"])
        if r["provider"] == AA:
            aa.append(ratio)
        else:
            bars.append((r["op"], r["provider"], ratio))
    return list(panels.values())
