"""``cudnorm bench --models``' output: the tables, the plot and ``models.md`` of a run's rows
(:mod:`.models` measures them)."""

from __future__ import annotations

from pathlib import Path

from . import plots, real_models, report
from .models import MODEL_TITLES, PROVIDERS, against_noise

LEGEND = """\
Legend: ms per step, median over interleaved rounds of K back-to-back steps on fresh inputs
(one synchronize per round); (1.05x) = torch's time / this provider's (> 1: faster than
PyTorch's norms). host = host time of one step after a synchronize, until the Python call of
backward (or forward) returns. saving = where torch's norm work takes longer than cudnorm's:
norm GPU time saved (CUDA graph of the step's norms) / step time saved. rel diff = relative
L2 distance of cudnorm's output / first-Linear weight gradient from torch's on the same inputs.
Real models (one line per provider): again = torch's time / torch-again's (the noise floor);
rounds = the middle half (quartiles) of torch's time / this provider's, round by round, and
"slower" / "faster" where it lies wholly below / above torch-again's (beyond the noise);
share of limit = (torch ms - this ms) / (torch ms - limit ms), where limit is the model with
its norms and AdaLN modulation costing nothing; rel diff out / grad of the latent input, in
eval mode."""


def _speed_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["step_ms"] is None:
        return "OOM" if row["status"] == "OOM" else "ERR"
    return f"{row['step_ms']:.3f}" + (f" ({row['speedup']:.2f}x)" if row["speedup"] else "")


def _saving_cell(torch_row: dict, mine: dict) -> str:
    """``kernel / step`` ms saved where torch's norm work is slower than cudnorm's."""
    if not (torch_row["norm_ms"] and mine["norm_ms"] and torch_row["step_ms"] and mine["step_ms"]):
        return ""
    if torch_row["norm_ms"] <= mine["norm_ms"]:
        return "-"
    return f"{torch_row['norm_ms'] - mine['norm_ms']:.3f} / {torch_row['step_ms'] - mine['step_ms']:.3f}"


def _real_lines(mine: list[dict]) -> list[list[str]]:
    """A real model's table: a line per (case, provider) with the ratios the issue's targets
    read (speed-up, torch-again's ratio, share of the limit's gain) and the errors."""
    lines = [["case", "provider", "ms/step (vs torch)", "rounds", "again", "share of limit", "host ms",
              "rel diff out / grad", "err vs fp32 (x torch's)", "status"]]
    again_rows = {r["case"]: r for r in mine if r["provider"] == "torch-again"}
    for r in mine:
        share, again = r.get("share_of_limit"), r.get("again_ratio")
        diffs = [v for v in (r["rel_diff"], r["grad_rel_diff"]) if v is not None]
        lines.append([r["case"], r["provider"], _speed_cell(r), _rounds_cell(r, again_rows.get(r["case"])),
                      "" if again is None else f"{again:.2f}x",
                      "" if share is None else f"{share:.0%}", "" if r["host_ms"] is None else f"{r['host_ms']:.2f}",
                      " / ".join(f"{v:.1e}" for v in diffs), _fp32_cell(r), "" if r["status"] == "ok" else r["status"]])
    return lines


def _rounds_cell(row: dict, again: dict | None) -> str:
    """The middle half of a provider's round-by-round speed-ups, and whether it lies beyond
    PyTorch again's (:func:`against_noise`); blank for torch itself and rows without rounds."""
    if row["provider"] == "torch" or row.get("speedup_q1") is None:
        return ""
    verdict = "" if row["provider"] == "torch-again" else against_noise(row, again)
    return f"{row['speedup_q1']:.2f}-{row['speedup_q3']:.2f}" + (f" {verdict}" if verdict else "")


def _fp32_cell(row: dict) -> str:
    err, ratio = row.get("fp32_err"), row.get("fp32_err_vs_torch")
    if err is None:
        return ""
    return f"{err:.1e}" + ("" if ratio is None else f" ({ratio:.2f}x)")


def tables(rows: list[dict]) -> dict[str, list[list[str]]]:
    """``{model title: [header, *one line per case]}`` (the real models: a line per provider)."""
    out = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        if real_models.is_real(model):
            out[MODEL_TITLES.get(model) or real_models.spec(model).title] = _real_lines(mine)
            continue
        by_case = {}
        for r in mine:
            by_case.setdefault(r["case"], {})[r["provider"]] = r
        peers = [p for p in PROVIDERS[1:] if any(p in got for got in by_case.values())]
        lines = [["case", "torch ms", *(f"{p} ms" for p in peers), "host ms torch / cudnorm",
                  "saving ms kernel / step", "cudnorm rel diff out / grad"]]
        for case, got in by_case.items():
            t, c = got.get("torch"), got.get("cudnorm")
            host = saving = diff = ""
            if t and c and t["host_ms"] and c["host_ms"]:
                host = f"{t['host_ms']:.3f} / {c['host_ms']:.3f} ({c['host_ratio']:.2f}x)"
            if t and c:
                saving = _saving_cell(t, c)
            if c and c["rel_diff"] is not None:
                diffs = [c["rel_diff"]] + ([c["grad_rel_diff"]] if c["grad_rel_diff"] is not None else [])
                diff = " / ".join(f"{v:.1e}" for v in diffs)
            lines.append([case, _speed_cell(t), *(_speed_cell(got.get(p)) for p in peers), host, saving, diff])
        out[MODEL_TITLES.get(model, model)] = lines
    return out


def mode_group(mode: str) -> str:
    """The plot panel of a mode: "train" (``train-autocast`` too), "train-compile" or
    "infer / decode" (the real models' ``sample`` and ``sample-compile`` too)."""
    if not mode.startswith("train"):
        return "infer / decode"
    return "train-compile" if "compile" in mode else "train"


MODE_GROUPS = ("train", "train-compile", "infer / decode")


def plot(rows: list[dict], device_name: str, path: Path) -> Path | None:
    """The speed-up of each provider per case against PyTorch's norms, of the latest run in
    ``rows`` (a results file keeps every device call in its ``call`` column), one panel per
    mode group, the run's ``torch-again`` ratios as the noise band (:func:`.plots.ratio_plot`).
    ``None`` when matplotlib is missing or nothing was timed."""
    call, rows = plots.latest_run(rows)
    modes = sorted({r["mode"] for r in rows}, key=lambda m: MODE_GROUPS.index(mode_group(m)))
    title = f"cudnorm bench --models on {device_name}" + (f", call {call}" if call else "")
    return plots.ratio_plot(plots.model_panels(rows, {m: mode_group(m) for m in modes}), title=title,
                            xlabel="speed-up over PyTorch's norms (step time, > 1 faster)", path=path)


def markdown(meta: dict, lines_by_title: dict[str, list[list[str]]]) -> str:
    out = ["# cudnorm bench --models", ""]
    out += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in meta.items()]
    for title, lines in lines_by_title.items():
        out += ["", f"## {title}", "", report.markdown_table(lines)]
    out += ["", "## Legend", "", LEGEND, "", "How each number is measured: the docstring of "
            "`cudnorm/_bench/models.py` and the Model benchmarks section of docs/performance.md.", ""]
    return "\n".join(out)


def write_report(rows: list[dict], meta: dict, out: Path) -> tuple[Path | None, dict[str, list[list[str]]]]:
    """``models.png`` (``None``: matplotlib missing or nothing timed) and ``models.md`` in
    ``out``; returns the PNG's path and the tables by title."""
    png = plot(rows, meta["device"], out / "models.png")
    lines_by_title = tables(rows)
    (out / "models.md").write_text(markdown(meta, lines_by_title))
    return png, lines_by_title
