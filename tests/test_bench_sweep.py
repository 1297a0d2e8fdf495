"""``cudnorm bench --sweep`` (cudnorm/_bench/sweep.py): the grid's rules, the quick run end to end
on a CPU, the redraw from its CSV, and the prior's keys."""

from __future__ import annotations

import csv
import functools
import importlib.util

import pytest
import torch

from cudnorm import _candidates, _sleep_timing, cli
from cudnorm._bench import sweep, sweep_compare, sweep_report


def test_default_grid_follows_the_issue_rules():
    g = sweep.grid()
    multiples_of_8 = set(range(8, 257, 8))
    multiples_of_64 = set(range(64, 8193, 64))
    assert set(g.widths) == multiples_of_8 | multiples_of_64 | set(sweep.MODEL_WIDTHS)
    assert len(multiples_of_8) == 32 and len(multiples_of_64) == 128
    assert {1152, 1408, 2240, 2304, 3584, 3840, 5120} <= set(sweep.MODEL_WIDTHS)
    assert g.head_widths == tuple(range(64, 257, 8))
    cells = sweep.cells(g)
    main = [c for c in cells if c.rows * c.cols <= 1 << 25]
    head = [c for c in cells if c not in main]
    # 2 ops (LN weight+bias, RMS weight) x 2 directions x widths at 2^25 (2^21: a second call,
    # to fit one call each); rows = count // width
    assert len(main) == 2 * 2 * len(g.widths)
    assert {c.rows for c in main if c.cols == 88} == {(1 << 25) // 88}
    assert {c.rows for c in sweep.cells(sweep.narrowed(g, exponents=[21]))} >= {(1 << 21) // 88}
    assert len(head) == 2 * 2 * 25 and {c.rows * c.cols for c in head if c.cols == 128} == {1 << 26}
    assert {(c.dtype, c.weight) for c in cells} == {(torch.bfloat16, torch.bfloat16)}


@pytest.mark.parametrize("kind, ops, weight", [
    ("bare", {("layer_norm", None, False), ("rms_norm", None, False)}, None),
    ("fp32-weights", {("layer_norm", torch.float32, True), ("rms_norm", torch.float32, False)}, torch.float32)])
def test_variant_grids_are_the_default_cells_with_other_weights(kind, ops, weight):
    """``--sweep bare`` and ``--sweep fp32-weights``: the default grid's shapes and directions
    (one device call each) for the norms without weights (what diffusers' adaptive norms
    normalise with) and with fp32 weights on bf16 activations."""
    default, variant = sweep.cells(sweep.grid()), sweep.cells(sweep.grid(kind))
    assert len(variant) == len(default)
    assert {(c.cols, c.rows, c.direction) for c in variant} == {(c.cols, c.rows, c.direction) for c in default}
    assert {(c.op, c.weight, c.bias) for c in variant} == ops
    assert {c.dtype for c in variant} == {torch.bfloat16} and {c.weight for c in variant} == {weight}
    assert kind in sweep.KINDS


def test_axes_sweep_covers_what_the_default_holds_fixed():
    """``--sweep axes``: the default's ops at 2^21 elements, with fp32 weights, on fp16 and on fp32
    input, each on the cliff, narrow and model widths; about the default's size (one call)."""
    cells = list(dict.fromkeys(c for g in sweep.grids("axes") for c in sweep.cells(g)))
    combos = {(c.dtype, c.weight, c.rows * c.cols <= 1 << 21) for c in cells}
    assert combos == {(torch.bfloat16, torch.bfloat16, True), (torch.bfloat16, torch.float32, False),
                      (torch.float16, torch.float16, False), (torch.float32, torch.float32, False)}
    assert {88, 96, 1152, 1408, 2240} <= {c.cols for c in cells} <= set(sweep.WIDTHS)
    # per-head rows (2^26) at every narrow width of the three 2^25 axes; none at 2^21
    assert {c.cols for c in cells if c.rows * c.cols > 1 << 25} == {n for n in sweep.AXES_WIDTHS if n <= 256}
    assert not [c for c in cells if c.dtype == torch.bfloat16 and c.weight == torch.bfloat16 and c.rows * c.cols > 1 << 21]
    assert 500 <= len(cells) <= len(sweep.cells(sweep.grid()))
    assert sweep.grids("bare") == (sweep.grid("bare"),)


def test_axes_sweep_runs_on_a_cpu_and_refuses_a_dtype(tmp_path, capsys):
    out = tmp_path / "axes"
    assert cli.main(["bench", "--sweep", "axes", "--widths", "64", "--elements", "10",
                     "--providers", "torch,cudnorm", "--out", str(out)]) == 0
    with open(out / "sweep.csv") as f:
        seen = {(r["dtype"], r["weight_dtype"]) for r in csv.DictReader(f)}
    assert seen == {("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"), ("fp32", "fp32")}
    capsys.readouterr()
    assert cli.main(["bench", "--sweep", "axes", "--dtype", "fp16", "--out", str(out)]) == 2
    assert "--dtype" in capsys.readouterr().err


def test_full_grid_and_filters():
    full = sweep.grid("full")
    assert full.counts == (1 << 17, 1 << 21, 1 << 25) and full.head_counts == (1 << 26, 1 << 27)
    cells = sweep.cells(sweep.narrowed(full, widths=[88], exponents=[21]))
    # 4 directions x (3 ops with a weight (LN w+b, LN w, RMS w) x 5 dtype pairs (bf16 and fp16 with weights in
    # their dtype or fp32, fp32 with fp32) + 2 ops without (LN, RMS) x 3 dtypes)
    assert len(cells) == 4 * (3 * 5 + 2 * 3)
    assert {c.rows for c in cells} == {(1 << 21) // 88}
    head_only = sweep.cells(sweep.narrowed(sweep.grid(), widths=[64, 4096], exponents=[26]))
    assert {(c.cols, c.rows) for c in head_only} == {(64, 1 << 20)}


def test_prior_key_is_the_dispatchers_signature(monkeypatch):
    cell = sweep.Cell("layer_norm", "train", torch.bfloat16, torch.bfloat16, True, 128, (1 << 17) // 128)
    sets = sweep.make_sets(cell, "cpu")
    # a user's call: [batch, heads, tokens, head_dim] with the same rows
    x = torch.empty(2, 8, 64, 128, dtype=torch.bfloat16)
    weight = torch.empty(128, dtype=torch.bfloat16)
    expected = _candidates.signature("layer_norm", True, x, weight, weight, 128).key()
    assert sweep.cell_signature(cell, sets).key() == expected

    timed = {}

    def fake_time(closures, **kwargs):
        timed.update(closures)
        return {name: _candidates.Timing(1.0 + i, 0.0, 3) for i, name in enumerate(closures)}

    monkeypatch.setattr(_candidates, "time_closures", fake_time)
    prior = {}
    sweep._time_prior(cell, sets, prior)
    assert list(prior) == [expected] and set(prior[expected]) == set(timed) >= {"torch", "cudnn"}


@pytest.mark.slow  # about 10 s on a 2-core CPU (matplotlib's heatmaps, 24 cells)
def test_quick_sweep_end_to_end(tmp_path, capsys):
    assert cli.main(["bench", "--sweep", "--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == sweep.COLUMNS
    assert {r["provider"] for r in rows} == {"torch", "cudnorm", "copy", "torch-again"}  # cudnn/kernel/peers: CUDA only
    assert {r["cols"] for r in rows} == {"88", "128", "1152"} and {r["dtype"] for r in rows} == {"bf16", "fp32"}
    for r in rows:
        assert r["error"] == "" and float(r["gpu_ms"]) > 0 and float(r["host_us"]) > 0 and float(r["ratio_vs_torch"]) > 0
        assert int(r["rows"]) == int(r["elements"]) // int(r["cols"])
    summary = (tmp_path / "summary.md").read_text()
    assert "cudnorm bench --sweep --quick --out" in summary and "## Worst 20 cells" in summary
    assert not (tmp_path / "prior.json").exists()  # no prior from a CPU
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "sweep_layer_norm_train.png").stat().st_size > 0
    out = capsys.readouterr().out
    worst = out[out.rindex("Worst 20 cells"):].strip().splitlines()
    assert worst[1].startswith("cell") and len(worst) == 2 + 20  # the table is printed last

    assert cli.main(["bench", "--from-csv", str(tmp_path / "sweep.csv")]) == 0
    again = capsys.readouterr().out
    assert again[again.rindex("Worst 20 cells"):] == out[out.rindex("Worst 20 cells"):]


def test_a_raising_provider_is_recorded_and_the_sweep_goes_on(monkeypatch):
    real = sweep.provider_calls

    def calls(name, cell, sets):
        if name == "cudnorm" and cell.cols == 88:
            raise RuntimeError("boom")
        return real(name, cell, sets)

    monkeypatch.setattr(sweep, "provider_calls", calls)
    g = sweep.narrowed(sweep.grid("quick"), widths=[88, 128])
    rows = [r for c in sweep.cells(g) if c.dtype == torch.float32 for r in
            sweep.run_cell(c, ["torch", "cudnorm"], "cpu", None)]
    failed = [r for r in rows if r["error"]]
    assert failed and all(r["provider"] == "cudnorm" and r["cols"] == 88 and "boom" in r["error"] for r in failed)
    assert all(r.get("gpu_ms") for r in rows if not r["error"])


def test_sweep_flags_need_sweep(capsys):
    assert cli.main(["bench", "--widths", "88"]) == 2
    assert "--widths" in capsys.readouterr().err


def _row(provider, ms, cols=128, elements=1 << 25, direction="train", **extra):
    """A sweep row sized as the sweep sizes a cell: ``elements // cols`` rows of ``cols``."""
    rows = elements // cols
    return {"op": "layer_norm", "direction": direction, "dtype": "bf16", "weight_dtype": "bf16", "bias": "True",
            "cols": cols, "rows": rows, "elements": rows * cols, "provider": provider, "gpu_ms": ms, **extra}


def test_copy_fractions_take_narrow_large_cells_only():
    rows = [_row("copy", 1.0), _row("cudnorm", 1.25), _row("torch", 4.0),
            _row("copy", 1.0, cols=256), _row("cudnorm", 2.0, cols=256), _row("torch", 4.0, cols=256),
            # 192 does not divide 2^25: a few elements short of it, still a 2^25 cell
            _row("copy", 1.0, cols=192), _row("cudnorm", 1.0 / 0.7, cols=192), _row("torch", 4.0, cols=192),
            _row("copy", 1.0, cols=512), _row("cudnorm", 10.0, cols=512),  # too wide: left out
            _row("copy", 1.0, elements=1 << 21), _row("cudnorm", 10.0, elements=1 << 21)]  # too few elements
    [header, line] = sweep_report.copy_fractions(rows)
    assert header[1:] == ["count", "cudnorm median / worst", "torch median / worst"]
    assert line == ["layer_norm train bf16/w=bf16/b=True", "3", "70% / 50%", "25% / 25%"]


@pytest.mark.parametrize("exp", [12, 17, 21, 25, 26])
def test_a_cell_counts_at_the_power_of_two_it_was_sized_from(exp):
    for cols in (8, 64, 72, 88, 192, 1152, 1408, 2240, 3000, 4096, 12288):
        if 1 << exp >= cols:
            assert sweep_report.exponent(_row("cudnorm", 1.0, cols=cols, elements=1 << exp)) == exp, cols


def test_medians_count_widths_that_do_not_divide_the_element_count():
    rows = [_row("cudnorm", 1.0, cols=c, elements=1 << 21, ratio_vs_torch=r)
            for c, r in ((1152, 1.5), (1408, 1.1), (2048, 1.3))]
    rows.append(_row("cudnorm", 1.0, cols=1152, elements=1 << 17, ratio_vs_torch=9.0))  # below 2^21: left out
    assert sweep_report.medians(rows)[1:] == [["layer_norm train bf16/w=bf16/b=True", "3", "1.300x", "-"],
                                       ["all", "3", "1.300x", "-"]]


def test_measure_costs_summarise_the_dispatchers_first_calls():
    rows = [_row("cudnorm", 1.0, measure_ms=ms) for ms in (4.0, 73.0, 30.0, 8.0, None)] + [_row("torch", 1.0, measure_ms=99.0)]
    assert sweep_report.measure_costs(rows) == [["measured signatures", "median ms", "p90 ms", "worst ms", "over 50 ms"],
                                         ["4", "19.0", "30.0", "73.0", "1"]]
    assert sweep_report.measure_costs([_row("cudnorm", 1.0)]) == [["measured signatures"]]


def test_gain_left_counts_cells_where_a_faster_choice_did_not_serve():
    """A cell leaves a gain where cuDNN, PyTorch's op or the kernel ran faster on the GPU than
    what served by more than 5%; peers (Liger, the copy) are not the dispatcher's choices."""
    rows = []
    for cols, served, cudnn, kernel in ((1024, 1.0, 0.8, 1.1), (2048, 1.0, 0.97, 1.2), (4096, 1.0, 1.5, 1.0)):
        rows += [_row("torch", 1.0, cols=cols, ratio_vs_torch=1.0, host_us=10.0),
                 _row("cudnorm", served, cols=cols, ratio_vs_torch=1.0 / served, serves="torch", host_us=11.0),
                 _row("cudnn", cudnn, cols=cols, host_us=20.0), _row("kernel", kernel, cols=cols),
                 _row("copy", 0.1, cols=cols), _row("liger", 0.5, cols=cols)]
    [header, line] = sweep_report.gain_left(rows)
    assert header[2] == "faster choice by > 5%"
    assert line == ["layer_norm train bf16/w=bf16/b=True", "3", "1", "1.25x", "1.25x"], "only 1024: 2048's 3% is noise"
    [_, worst] = sweep_report.left_table(rows)
    assert worst == ["layer_norm train bf16/w=bf16/b=True", "1024", "32768", "torch", "1.0000", "11.0", "cudnn",
                     "0.8000", "20.0", "1.25x"]


def test_heatmap_rows_are_the_element_counts_the_cells_were_sized_from():
    rows = [_row("cudnorm", 1.0, cols=c, elements=1 << e, ratio_vs_torch=r)
            for c, e, r in ((192, 25, 2.0), (256, 25, 3.0), (192, 26, 4.0), (1152, 21, 0.5))]
    exps, widths, values = sweep_report.heat_grid(rows, "layer_norm train bf16/w=bf16/b=True")
    assert exps == [21, 25, 26] and widths == [192, 256, 1152]
    assert values[1][:2] == [2.0, 3.0] and values[2][0] == 4.0 and values[0][2] == 0.5
    assert sum(v == v for line in values for v in line) == 4  # the other cells: NaN (not timed)


def _run(cells):
    """Sweep rows of ``{cols: (torch ms, cudnorm ms, served, cudnn ms)}``."""
    return [r for cols, (torch_ms, ours, served, cudnn) in cells.items()
            for r in (_row("torch", torch_ms, cols=cols), _row("cudnorm", ours, cols=cols, serves=served),
                      _row("cudnn", cudnn, cols=cols))]


def test_two_sweeps_compare_cell_by_cell():
    """``--against``: each provider's moves beyond 15% (PyTorch's the noise floor), and the cells
    where cudnorm's own-run ratio to PyTorch fell by more than 5%, worst first."""
    old = _run({1024: (1.0, 0.80, "cudnn", 0.80), 2048: (1.0, 0.90, "cudnn", 0.90), 4096: (1.0, 1.0, "torch", 1.2),
                8192: (1.0, 0.5, "kernel", 2.0)})
    new = _run({1024: (1.1, 1.10, "torch", 0.64), 2048: (1.0, 0.93, "cudnn", 0.93), 4096: (1.0, 0.8, "cudnn", 0.8),
                256: (1.0, 0.5, "kernel", 2.0)})  # 8192 and 256: in one run only
    moves = {line[0]: line[1:] for line in sweep_compare.provider_moves(new, old)[1:]}
    assert moves["torch"] == ["3", "1.000", "0", "0"]
    assert moves["cudnn"] == ["3", "0.800", "0", "2"], "1024: 0.80x, 4096: 0.67x; 2048's 3% is no move"
    assert moves["cudnorm"][2:] == ["1", "1"]
    losses = sweep_compare.served_losses(new, old)
    assert losses[1:] == [["layer_norm train bf16/w=bf16/b=True", "1024", "32768", "1.25x", "1.00x", "cudnn -> torch"]]
    summary = sweep_compare.served_summary(new, old)
    assert summary[1][:5] == ["old", "3", "1.00x", "1.11x", "0"]
    assert summary[2] == ["new", "3", "1.00x", "1.08x", "0", "1", "1"]


def test_against_compares_two_sweep_csvs(tmp_path, capsys):
    for name, rows in (("new", _run({1024: (1.0, 1.0, "torch", 0.7)})), ("old", _run({1024: (1.0, 0.8, "cudnn", 0.8)}))):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "sweep.csv", "w", newline="") as f:
            # the old one as written before the later columns (uncovered rounds) existed
            columns = sweep.COLUMNS if name == "new" else sweep.REQUIRED_COLUMNS
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    new, old = (str(tmp_path / n / "sweep.csv") for n in ("new", "old"))
    assert cli.main(["bench", "--from-csv", old]) == 0
    capsys.readouterr()
    assert cli.main(["bench", "--from-csv", new, "--against", old]) == 0
    out = capsys.readouterr().out
    assert "cudnn -> torch" in out and "1.25x" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "new" / "against_old.png").stat().st_size > 0
    assert cli.main(["bench", "--against", old]) == 2
    assert "--against" in capsys.readouterr().err
    other = tmp_path / "bench.csv"
    other.write_text("op,provider\nln_fwd,torch\n")
    assert cli.main(["bench", "--from-csv", str(other), "--against", old]) == 2
    assert "is not a sweep.csv" in capsys.readouterr().err


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_the_kernel_column_runs_as_a_call_the_dispatcher_gives_it(op, monkeypatch):
    """On the native path the sweep times cudnorm's kernel through the public function's C++ entry
    with the kernel forced (what a user's call it serves runs), not its Python autograd function."""
    from cudnorm import _entry
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_entry, "native", True)
    monkeypatch.setattr(_entry, op, lambda *args: calls.append(args))
    cell = sweep.Cell(op, "train", torch.bfloat16, torch.bfloat16, op == "layer_norm", 128, 64)
    x, w = torch.randn(64, 128), torch.randn(128)
    sweep._functional(cell, "kernel")(x, w, w if cell.bias else None)
    (args,) = calls
    assert args[0] is x and args[1] == [128] and args[-1] == _entry.SERVERS["kernel"]
    monkeypatch.setattr(_entry, "native", False)
    monkeypatch.setattr(_entry, "pending", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(sweep._functional(cell, "kernel"), functools.partial)  # its Python autograd function


def test_rounds_the_host_outlasted_the_sleep_of_are_counted_and_listed(monkeypatch):
    """A round whose GPU sleep the host outlasted even when timed again (its GPU time may hold
    waits on the host: an H200 bare RMSNorm training cell read 0.51x so) is counted in the row's
    ``uncovered`` and listed in the summary."""
    bursts = iter([_sleep_timing.Burst(2.0, 1.0, True), _sleep_timing.Burst(9.0, 4.0, False),
                   _sleep_timing.Burst(2.2, 1.0, True)])
    enqueued = []

    def timed_burst(enqueue, host_guess_ms):
        enqueue()
        return next(bursts)

    monkeypatch.setattr(_sleep_timing, "timed_burst", timed_burst)
    monkeypatch.setattr(sweep, "_sync", lambda cuda: None)
    gpu_ms, host_us, uncovered = sweep.time_calls([lambda: enqueued.append(1)], "cuda")
    assert uncovered == 1 and gpu_ms == pytest.approx(2.2 / (len(enqueued) - 2) * 3)
    rows = [_row("cudnorm", 0.2, uncovered=2, host_us=430.0), _row("torch", 0.1, uncovered=0),
            _row("kernel", 0.1, uncovered=1, cols=2048)]
    table = sweep_report.uncovered_table(rows)
    assert [line[3:5] for line in table[1:]] == [["cudnorm", "2"], ["kernel", "1"]]
    assert "every round's sleep outlasted the host" in sweep_report.summary_markdown(rows[1:2], {})
    assert "| cudnorm | 2 |" in sweep_report.summary_markdown(rows, {})


class _CudaInput:
    """A stand-in for a CUDA tensor (``is_cuda``, ``dtype``): what the torch column sees."""

    is_cuda = True
    dtype = torch.bfloat16


@pytest.mark.parametrize("on_cuda", [True, False])
def test_torch_column_casts_fp32_weights_only_where_pytorchs_cuda_layer_norm_refuses_them(on_cuda, monkeypatch):
    """PyTorch's CUDA LayerNorm raises on fp32 weights with bf16 input (the first fp32-weights
    sweep left every such cell without a torch column): there the column casts the weights, as
    a PyTorch user must; on a CPU, whose op takes the mix, the call is PyTorch's as written."""
    seen = []
    monkeypatch.setattr(sweep.F, "layer_norm", lambda x, n, w, b, eps: seen.append((w.dtype, b.dtype)))
    x = _CudaInput() if on_cuda else torch.randn(4, 8, dtype=torch.bfloat16)
    cell = sweep.Cell("layer_norm", "train", torch.bfloat16, torch.float32, True, 8, 4)
    sweep._functional(cell, "torch")(x, torch.ones(8), torch.zeros(8))
    assert seen == [(torch.bfloat16, torch.bfloat16) if on_cuda else (torch.float32, torch.float32)]
