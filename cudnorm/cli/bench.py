"""``cudnorm bench``: cudnorm against its peers (:mod:`cudnorm._bench` measures; this module
parses, prints and picks the exit status).

Run::

    cudnorm bench --out benchmarks/results/<gpu>   # full run on the GPU (sized for < 8 min on one
                                                   # H100; summary.md records the real run time)
    cudnorm bench --quick              # two small shapes, any device (CI runs this on CPU)
    cudnorm bench --ops ln_bwd,rms_bwd --providers cudnorm,quack,torch-again --shapes 32768x4096
    cudnorm bench --cuda-graph --host-overhead --ops rms_fwd --shapes 256x256
    cudnorm bench --from-csv benchmarks/results/<gpu>/bench.csv   # redraw the PNGs, reprint
    cudnorm bench --sweep [full] --out DIR   # LayerNorm/RMSNorm at every width and row count vs PyTorch,
                                             # and the dispatcher's prior: _bench/sweep.py
    cudnorm bench --sweep axes --out DIR     # what the default holds fixed: 2^21 elements, fp32 weights,
                                             # fp16 and fp32 input (bare, fp32-weights: other variants)
    cudnorm bench --sweep --quick            # a handful of cells, any device (seconds on a CPU)
    cudnorm bench --sweep --widths 88,96,2240 --elements 21,25 --providers torch,cudnorm,torch-again
    cudnorm bench --from-csv NEW/sweep.csv --against OLD/sweep.csv   # two sweeps cell by cell
    cudnorm bench --models [FILTER] [--quick]   # whole model steps (DiT, SD3, Flux, Llama, GPT-2, and
                                                # diffusers'/transformers' own: _bench/real_models):
                                                # _bench/models.py
    cudnorm bench --models diffusers-all [--quick]  # every diffusers transformer class, default config,
                                                    # 1 layer per kind (_bench/real_models/diffusers_all.py)

(``python -m cudnorm.cli bench ...`` is the same without the console script installed.)
Without ``--out`` a run writes into a new temporary folder, printed first and last. What a
run measures, and the CSV's columns: :mod:`cudnorm._bench`. On a CPU every provider runs
PyTorch's code: the run checks correctness and the pipeline and says its times measure
nothing about cuDNN (model runs add ``torch-again``, PyTorch against itself, to show the
noise). The last thing printed is the results table with its legend. Exits 1 when a cudnorm
row failed.
"""

from __future__ import annotations

import dataclasses
import argparse
import csv
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from .. import _bench
from .._bench import (host_overhead, model_cases, models, models_report, plots, providers, real_models, report, runner,
                      sweep, sweep_compare, sweep_report)
from .._spec import dtype_from_name
from . import _args

CPU_CAVEAT = ("On the CPU every provider runs PyTorch's code (cudnorm's fallback included): these times say "
              "nothing about cuDNN or about cudnorm's speed on a GPU; this run checks correctness and the pipeline.")


def _shapes(text: str) -> list[tuple[int, ...]]:
    try:
        return runner.parse_shapes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers")
    return values


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="a few small shapes that finish in seconds (CI)")
    parser.add_argument("--ops", help=f"comma-separated subset of {','.join(providers.OPS)}")
    parser.add_argument("--providers", help=f"comma-separated subset of {','.join(providers.REGISTRY)}")
    parser.add_argument("--shapes", type=_shapes, help="comma-separated MxN (LN/RMS) and BxSxD (AdaLN) shapes")
    parser.add_argument("--dtype", choices=sorted(_bench.DTYPES), default="bf16",
                        help="activation dtype (default bf16)")
    parser.add_argument("--out", type=_args.output_dir,
                        help="output folder, made if missing (default: a new temporary folder)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="CUDA-graph section (GPU; on by default in a full run)")
    parser.add_argument("--host-overhead", action="store_true",
                        help="host us/call section (GPU; on by default in a full run)")
    parser.add_argument("--host-passes", type=_args.positive_int, metavar="N",
                        help="with --host-overhead: interleaved passes whose median each figure is (default "
                             f"{host_overhead.PASSES}; a backward through autograd's engine moves by 10-20%% "
                             "between passes)")
    parser.add_argument("--models", nargs="?", const="all", metavar="FILTER",
                        help="model-step benchmark instead of the ops (see cudnorm/_bench/models.py); FILTER: "
                             "comma-separated substrings of case ids like dit-1152-b8-s1024:train-compile")
    parser.add_argument("--resume", action="store_true",
                        help="with --models: keep the cases an earlier run into --out finished (models.csv) and "
                             "run the rest; a case the earlier process died in gets a line saying so")
    parser.add_argument("--profile-host", action="store_true",
                        help="with --models: after timing, profile one step of each case and provider with cProfile "
                             "(the Python functions it ran, cudnorm's native table hits and misses) and a few with "
                             "torch.profiler (each op's and autograd node's own host time, against PyTorch's step "
                             "in <case>__ops.txt) into --out/profiles/: where a patched host-bound step spends its "
                             "host time")
    parser.add_argument("--sweep", nargs="?", const="default", choices=sweep.KINDS,
                        help="width x rows sweep of LayerNorm/RMSNorm vs PyTorch and the dispatcher's prior "
                             "(cudnorm/_bench/sweep.py); 'bare': the default's cells without weights, "
                             "'fp32-weights': with fp32 weights; 'axes': 2^21 elements, fp32 weights, fp16 and "
                             "fp32 input, each on the cliffs, narrow and model widths; 'full': every dtype, weight "
                             "dtype and direction")
    parser.add_argument("--widths", type=_ints, help="with --sweep: only these widths (e.g. 88,96,2240)")
    parser.add_argument("--elements", type=_ints, metavar="EXPONENTS",
                        help="with --sweep: only these element counts, as powers of two (e.g. 21,25)")
    parser.add_argument("--jobs", type=_args.positive_int,
                        help=f"with --sweep: processes building cuDNN plans ahead (default min(12, CPUs) = "
                             f"{sweep.default_jobs()})")
    parser.add_argument("--from-csv", metavar="CSV", type=_args.input_file,
                        help="run nothing: redraw the plots and reprint the tables of a bench.csv, models.csv, "
                             "host_overhead.csv or sweep.csv")
    parser.add_argument("--call", help="with --from-csv of a results file with a 'call' column: draw this "
                                       "device call (default: the latest)")
    parser.add_argument("--against", metavar="CSV", type=_args.input_file,
                        help="with --from-csv of a sweep.csv: compare it cell by cell with this earlier "
                             "sweep.csv (how far each provider moved, PyTorch's column the noise floor; the "
                             "cells where what cudnorm serves lost ground; against_<folder>.png beside it)")


def _pick(text: str | None, known, what: str) -> list[str]:
    """The names ``--<what>`` lists (all of ``known`` when the flag is not given)."""
    if text is None:
        return list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        found = f"has unknown {unknown}" if unknown else "names nothing"
        raise _args.UsageError(f"--{what}", f"{found}; expected some of {list(known)}")
    return names


def _command(args) -> str:
    """The command line that reproduces this run, for the summaries."""
    models_filter = getattr(args, "models", None)
    parts = ["cudnorm", "bench"] + (["--models"] + ([] if models_filter == "all" else [models_filter])
                                    if models_filter else [])
    sweep_kind = getattr(args, "sweep", None)
    parts += (["--sweep"] + ([] if sweep_kind == "default" else [sweep_kind])) if sweep_kind else []
    parts += ["--quick"] if args.quick else []
    for flag in ("ops", "providers", "shapes", "widths", "elements", "jobs", "dtype", "out"):
        value = getattr(args, flag, None)
        if flag in ("shapes", "widths", "elements") and value:
            value = ",".join("x".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in value)
        if value and not (flag == "dtype" and value == "bf16"):
            parts += [f"--{flag}", str(value)]
    parts += [f for f, on in (("--cuda-graph", args.cuda_graph), ("--host-overhead", args.host_overhead)) if on]
    parts += ["--host-passes", str(args.host_passes)] if args.host_passes else []
    parts += ["--resume"] if getattr(args, "resume", False) else []
    parts += ["--profile-host"] if getattr(args, "profile_host", False) else []
    return shlex.join(parts)


def _print_tables(rows: list[dict], names: list[str], copy_gbps: float) -> None:
    print("\n" + report.LEGEND)
    for op, lines in report.op_tables(rows, names).items():
        print(f"\n{op}  GB/s  (copy {copy_gbps:.0f} GB/s)\n{report.text_table(lines)}")


def _against(path: Path, earlier: Path) -> int:
    """Print how the sweep in ``path`` compares with the ``earlier`` one, cell by cell."""
    runs = []
    for flag, file in (("--from-csv", path), ("--against", earlier)):
        try:
            with open(file, newline="") as f:
                columns = set(next(csv.reader(f), []))
            if not set(sweep.REQUIRED_COLUMNS) <= columns:
                raise _args.UsageError(flag, f"{str(file)!r} is not a sweep.csv (--against compares two sweeps)")
            runs.append(sweep_report.read_csv(file))
        except (UnicodeDecodeError, csv.Error, KeyError, ValueError, TypeError) as exc:
            raise _args.UsageError(flag, f"{str(file)!r} is not a readable sweep.csv ({type(exc).__name__}: "
                                         f"{str(exc)[:120]})") from None
    new, old = runs
    print(f"{path} against {earlier}\n")
    print("How far each provider's GPU times moved (PyTorch's: the noise floor)\n"
          + report.text_table(sweep_compare.provider_moves(new, old), right=0))
    print("\ncudnorm against PyTorch, in each run's own timing\n"
          + report.text_table(sweep_compare.served_summary(new, old), right=0))
    losses = sweep_compare.served_losses(new, old)
    print("\nCells where cudnorm lost ground against PyTorch\n"
          + (report.text_table(losses, right=0) if len(losses) > 1 else "(none)"))
    png = sweep_compare.plot(new, old, path.with_name(f"against_{earlier.resolve().parent.name}.png"),
                             f"cudnorm vs PyTorch: {path.resolve().parent.name} over {earlier.resolve().parent.name}")
    print(f"\ndrew {png}" if png else "\nno PNG: matplotlib is not installed or no cell is in both")
    return 0


def _from_csv(path: Path, call: str | None) -> int:
    """Redraw the plots of a results CSV next to it and reprint its tables (e.g. where the
    GPU machine that ran the benchmark had no matplotlib): a ``bench.csv`` (``<stem>.png``,
    ``<stem>_speedup.png``), a ``models.csv`` or a ``host_overhead.csv`` (``<stem>.png``),
    told apart by their columns; ``call`` picks one device call of a file that keeps several."""
    try:
        with open(path, newline="") as f:
            columns = set(next(csv.reader(f), []))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise _args.UsageError("--from-csv", f"{str(path)!r} is not a CSV file ({exc})") from None
    if call is not None and "call" not in columns:
        raise _args.UsageError("--call", f"{str(path)!r} has no 'call' column")
    kinds = [(sweep.REQUIRED_COLUMNS, _redraw_sweep), (report.COLUMNS, _redraw_ops), (models.BASE_COLUMNS, _redraw_models),
             (host_overhead.COLUMNS, _redraw_host)]
    redraw = next((redraw for needed, redraw in kinds if set(needed) <= columns), None)
    if redraw is None:
        raise _args.UsageError("--from-csv", f"{str(path)!r} is not a bench.csv, models.csv, host_overhead.csv "
                                             "or sweep.csv "
                                             f"(columns {sorted(columns)[:8]})")
    try:  # the file is the input: a value that does not parse is a usage error
        rows = _typed_rows(redraw, path, call)
    except (KeyError, ValueError, TypeError, csv.Error) as exc:
        raise _args.UsageError("--from-csv", f"{str(path)!r} has a malformed row ({type(exc).__name__}: "
                                             f"{str(exc)[:120]})") from None
    return redraw(rows, path)


def _typed_rows(redraw, path: Path, call: str | None) -> list[dict]:
    """The rows of a results CSV as the benchmark that ``redraw`` redraws made them (numbers
    as numbers), only those of ``call`` when given."""
    if redraw is _redraw_ops:
        rows = report.read_csv(path)
    elif redraw is _redraw_sweep:
        rows = sweep_report.read_csv(path)
    else:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    if call is not None:
        rows = [r for r in rows if r.get("call") == call]
        if not rows:
            raise _args.UsageError("--call", f"{call!r} is not a call of {str(path)!r}")
    if redraw is _redraw_models:
        return [models.typed_row(r) for r in rows]
    if redraw is _redraw_host:
        return [{**r, **{k: float(r[k]) for k in ("same_us", "fresh_us", "vs_torch")}} for r in rows]
    return rows


def _redraw_ops(rows: list[dict], path: Path) -> int:
    copy_gbps = next((100.0 * r["gbps"] / r["pct_copy"] for r in rows if r["pct_copy"]), None)
    if copy_gbps is None:
        raise _args.UsageError("--from-csv", f"{str(path)!r} has no timed row")
    pngs = [p for p in (report.plot(rows, copy_gbps, path.with_suffix(".png")),
                        report.plot_speedups(rows, path.parent.name, path.with_name(f"{path.stem}_speedup.png"))) if p]
    print("redrew " + ", ".join(map(str, pngs)) if pngs else "no PNG: matplotlib is not installed")
    _print_tables(rows, list(dict.fromkeys(r["provider"] for r in rows)), copy_gbps)
    return 0


def _redraw_sweep(rows: list[dict], path: Path) -> int:
    pngs = sweep_report.heatmaps(rows, path.resolve().parent.name, path.parent)
    print("redrew " + ", ".join(map(str, pngs)) if pngs else "no PNG: matplotlib is not installed or nothing was timed")
    _print_sweep(rows)
    return 0


def _print_sweep(rows: list[dict]) -> None:
    print("\n" + report.text_table(sweep_report.worst_per_provider(rows), right=0))
    print("\n" + report.text_table(sweep_report.medians(rows), right=0))
    print("\nGain left (a faster choice on the GPU than what served)\n"
          + report.text_table(sweep_report.gain_left(rows), right=0))
    print(f"\n{SWEEP_LEGEND}\nWorst 20 cells\n" + report.text_table(sweep_report.worst_table(rows), right=0))


SWEEP_LEGEND = ("ratio = PyTorch's GPU time / the provider's (> 1: faster than PyTorch); cudnorm = the default "
                "policy as a user calls it, cudnn = policy='cudnn', kernel = cudnorm's Triton kernel, torch-again = "
                "PyTorch timed again (the noise floor); serves = the dispatcher's decision.")


def _redraw_models(rows: list[dict], path: Path) -> int:
    png = models_report.plot(rows, path.resolve().parent.name, path.with_suffix(".png"))
    print(f"redrew {png}" if png else "no PNG: matplotlib is not installed or nothing was timed")
    call, latest = plots.latest_run(rows)
    print("\n" + models_report.LEGEND)
    for title, lines in models_report.tables(latest).items():
        print(f"\n{title}" + (f" (call {call})" if call else "") + f"\n{report.text_table(lines, right=0)}")
    return 0


def _redraw_host(rows: list[dict], path: Path) -> int:
    png = host_overhead.plot(rows, path.resolve().parent.name, path.with_suffix(".png"))
    print(f"redrew {png}" if png else "no PNG: matplotlib is not installed")
    print(report.text_table(host_overhead.table(rows), right=0))
    return 0


def run(args) -> int:
    if args.against is not None and not args.from_csv:
        raise _args.UsageError("--against", "goes with --from-csv (a sweep.csv)")
    if args.from_csv and args.against is not None:
        return _against(args.from_csv, args.against)
    if args.from_csv:
        return _from_csv(args.from_csv, args.call)
    if args.call is not None:
        raise _args.UsageError("--call", "only goes with --from-csv")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sweep_flags = [f"--{f}" for f in ("widths", "elements", "jobs") if getattr(args, f) is not None]
    for flag, on in (("--resume", args.resume), ("--profile-host", args.profile_host)):
        if on and not args.models:
            raise _args.UsageError(flag, "goes with --models")
    if args.sweep:
        return _run_sweep(args, device)
    if sweep_flags:
        raise _args.UsageError(sweep_flags[0], "goes with --sweep")
    if args.models:  # what to run, checked before anything is written
        for flag, default in (("ops", None), ("shapes", None), ("dtype", "bf16")):
            if getattr(args, flag) != default:
                raise _args.UsageError(f"--{flag}", "does not apply to --models (its cases fix their shapes and dtype)")
        # on a CPU PyTorch against itself shows how far apart equal kernels time (every provider runs PyTorch's code)
        defaults = models.DEFAULT_PROVIDERS + (("torch-again",) if device == "cpu" else ())
        every = model_cases.all_cases(args.quick) + real_models.cases(args.quick, "diffusers-all" in args.models)
        asked = ",".join(defaults) if args.providers is None else args.providers
        chosen = (_pick(asked, models.PROVIDERS, "providers"), model_cases.select(every, args.models, device, args.quick))
        if not chosen[1]:
            raise _args.UsageError("--models", f"no case matches {args.models!r} (case ids look like "
                                               "dit-1152-b8-s1024:train-compile or diffusers-flux.1-dev:train)")
    else:
        chosen = (_pick(args.ops, providers.OPS, "ops"), _pick(args.providers, providers.REGISTRY, "providers"))
    if args.host_passes and (args.models or not args.host_overhead):
        raise _args.UsageError("--host-passes", "sets the passes of the host-overhead section: it goes with "
                                                "--host-overhead, not with --models")
    out = args.out or Path(tempfile.mkdtemp(prefix="cudnorm-bench-"))
    print(f"writing into {out}")
    if device == "cpu":
        print(CPU_CAVEAT)
    if args.models:
        return _run_models(args, device, out, chosen[0], _runnable(chosen[1]))
    return _run_ops(args, device, out, *chosen)


def _run_ops(args, device: str, out: Path, ops: list[str], names: list[str]) -> int:
    """``cudnorm bench``: ``ops`` by the providers ``names`` (those that run here); tables last."""
    import cudnorm  # noqa: PLC0415

    started = time.perf_counter()
    dtype = dtype_from_name(_bench.DTYPES[args.dtype])
    registry = providers.REGISTRY
    custom_shapes = args.shapes
    if not hasattr(cudnorm, "ada_layer_norm"):
        dropped = [op for op in ops if op.startswith("ada")]
        ops = [op for op in ops if op not in dropped]
        if dropped and args.ops:
            print(f"note: {','.join(dropped)} skipped: this cudnorm has no ada_layer_norm")
    chosen = []
    print(f"cudnorm bench on {device} ({_bench.versions()})")
    for name in names:
        why = registry[name].unavailable(device, requested=bool(args.providers))
        print(f"  provider {name:<12} {'available' if why is None else why}")
        if why is None:
            chosen.append(registry[name])
    out.mkdir(parents=True, exist_ok=True)
    timer, timer_text = runner.make_timer(device)
    copy_gbps = runner.copy_bandwidth(device, timer)
    kind = "memory-to-memory copy on the CPU" if device == "cpu" else "device-to-device copy"
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s ({kind}, read + write; timer: {timer_text})")
    plain = not (args.quick or args.ops or args.providers or args.shapes)
    sections = _bench.extras(device, out, graphs=args.cuda_graph, host=args.host_overhead, plain=plain,
                             host_passes=args.host_passes)

    rows = _bench.run_ops(ops, chosen, dtype, device, timer, copy_gbps, out, quick=args.quick, shapes=custom_shapes)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    pngs = [p for p in (report.plot(rows, copy_gbps, out / "bench.png"),
                        report.plot_speedups(rows, device_name, out / "bench_speedup.png")) if p]
    meta = {"command": _command(args), "device": device_name,
            "versions": _bench.versions(), "copy bandwidth": f"{copy_gbps:.0f} GB/s", "timer": timer_text,
            "argv": " ".join(sys.argv), "run time": f"{time.perf_counter() - started:.0f} s"}
    tables = report.op_tables(rows, [p.name for p in chosen])
    (out / "summary.md").write_text(report.summary_markdown(meta, tables, sections))

    for title, how, lines in sections:
        print(f"\n{title}\n{how}\n" + (report.text_table(lines, right=0) if lines else ""))
    print(f"\nwrote {out / 'bench.csv'}, {out / 'summary.md'}"
          + (", " + ", ".join(map(str, pngs)) if pngs else " (no PNG: matplotlib is not installed)")
          + f" after {meta['run time']}")
    failed = [r for r in rows if r["provider"] == "cudnorm" and r["status"] != "ok"]
    for r in failed:
        print(f"FAILED: cudnorm {r['op']} {r['shape']}: {r['status']}")
    if device == "cpu":
        print("\n" + CPU_CAVEAT)
    _print_tables(rows, [p.name for p in chosen], copy_gbps)
    return 1 if failed else 0


def _runnable(cases: list) -> list:
    """``cases`` without the real models whose library is missing or that cannot be built
    (one line per reason says which)."""
    every = [c for c in cases if c.name.startswith(real_models.diffusers_all.PREFIX)]
    if every:
        found, built, skipped = real_models.diffusers_all.census(every[0].quick)
        print(f"diffusers-all: {found} classes found, {built} built with norms cudnorm.patch swaps, "
              f"{len(skipped)} skipped")
    missing = {}
    for case in cases:
        why = case.missing() if isinstance(case, real_models.RealCase) else None
        if why is not None:
            missing.setdefault(why, []).append(case.id)
    for why, ids in missing.items():
        print(f"skipped {len(ids)} case(s): {why} ({', '.join(ids)})")
    return [c for c in cases if not any(c.id in ids for ids in missing.values())]


def _run_models(args, device: str, out: Path, asked: list[str], cases: list) -> int:
    """``cudnorm bench --models [FILTER]``: run ``cases`` with the providers ``asked`` (those
    that run here), write models.csv/.png/.md to ``out``, print the tables last. Returns 1
    when a cudnorm row failed."""
    started = time.perf_counter()
    usable, notes = models.usable_providers(asked, device)
    if any(isinstance(case, real_models.RealCase) for case in cases):
        notes.append(f"{' and '.join(real_models.ALWAYS)}: always in the real models' cases")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    settings = models.QUICK_SETTINGS if args.quick else models.Settings()
    if args.profile_host:
        settings = dataclasses.replace(settings, profile_dir=out / "profiles")
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"cudnorm bench --models on {device_name} ({_bench.versions()}), {str(dtype).removeprefix('torch.')}, "
          f"{len(cases)} cases")
    print("\n".join(f"  provider {note}" for note in notes))
    out.mkdir(parents=True, exist_ok=True)
    rows = models.run_cases(cases, usable, settings, device, dtype, out, resume=args.resume)
    meta = {"command": _command(args), "device": device_name, "versions": _bench.versions(),
            "dtype": str(dtype).removeprefix("torch."),
            "loop": f"{settings.rounds}-{settings.max_rounds} rounds (until {settings.min_timed_s:g} s of steps) x "
                    f"K = {settings.steps} steps ({settings.decode_steps} decode), "
                    f"{settings.warmup} warm-up steps",
            "providers": "; ".join(notes), "run time": f"{time.perf_counter() - started:.0f} s"}
    png, lines_by_title = models_report.write_report(rows, meta, out)
    print(f"\nwrote {out / 'models.csv'}, {out / 'models.md'}"
          + (f", {png}" if png else " (no PNG: matplotlib missing or nothing timed)") + f" after {meta['run time']}")
    failed = [r for r in rows if r["provider"].startswith("cudnorm") and not r["status"].startswith("ok")]
    for r in failed:
        print(f"FAILED: cudnorm {r['case']}: {r['status']}")
    if device == "cpu":
        print("\n" + CPU_CAVEAT)
    print("\n" + models_report.LEGEND)
    for title, lines in lines_by_title.items():
        print(f"\n{title}\n{report.text_table(lines, right=0)}")
    return 1 if failed else 0


def _run_sweep(args, device: str) -> int:
    """``cudnorm bench --sweep``: the grid of :mod:`cudnorm._bench.sweep`; the worst cells last."""
    import cudnorm  # noqa: PLC0415

    for flag in ("ops", "shapes", "models", "cuda_graph", "host_overhead", "host_passes"):
        if getattr(args, flag):
            raise _args.UsageError(f"--{flag.replace('_', '-')}", "does not apply to --sweep (it has its own grid: "
                                                                   "--widths, --elements)")
    names = [n for n in _pick(args.providers, sweep.PROVIDERS, "providers")]
    if "torch" not in names:
        names.insert(0, "torch")  # every ratio is against it
    kind = "quick" if args.quick else args.sweep
    if kind == "axes" and args.dtype != "bf16":
        raise _args.UsageError("--dtype", "does not apply to --sweep axes (it sweeps bf16, fp16 and fp32 itself)")
    grids = [sweep.narrowed(g, args.widths, args.elements) for g in sweep.grids(kind, args.dtype)]
    cells = list(dict.fromkeys(c for g in grids for c in sweep.cells(g)))
    if not cells:
        raise _args.UsageError("--widths", "with --elements leaves no cell")
    started = time.perf_counter()
    out = args.out or Path(tempfile.mkdtemp(prefix="cudnorm-sweep-"))
    out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"writing into {out}\ncudnorm bench --sweep on {device_name} ({_bench.versions()}): {len(cells)} cells")
    chosen = []
    for name in names:
        why = sweep.unavailable(name, device)
        print(f"  provider {name:<12} {'available' if why is None else why}")
        if why is None:
            chosen.append(name)
    if device == "cpu":
        print(CPU_CAVEAT)
    command = _command(args)
    notes = []
    if device == "cuda":
        store = Path(cudnorm.get_config().plan_store_dir or out / "plan-store")
        cudnorm.config(**sweep.store_config(store))
        jobs = args.jobs or sweep.default_jobs()
        build_start = time.perf_counter()
        failed = sweep.prepare(cells, store, jobs)
        notes.append(f"plans built ahead in {jobs} processes into {store} in {time.perf_counter() - build_start:.0f} s"
                     + (f" ({len(failed)} failed, built at first call: {failed[0]})" if failed else ""))
        print(notes[-1])
    rows, prior = sweep.run(cells, chosen, device, out, command)
    pngs = sweep_report.heatmaps(rows, device_name, out)
    meta = {"command": command, "device": device_name, "versions": _bench.versions(), "cells": str(len(cells)),
            "providers": ", ".join(chosen),
            "timing": f"CUDA events around {sweep.ROUNDS} rounds of calls on rotating input sets after a GPU sleep "
                      "covering the host's enqueueing (median); host = perf_counter around the enqueue loop"
                      if device == "cuda" else "perf_counter (CPU)", **{f"note {i}": n for i, n in enumerate(notes)}}
    if prior is not None:
        from .. import _decisions  # noqa: PLC0415

        meta["prior"] = (f"{out / 'prior.json'} ({len(prior)} signatures; copy to cudnorm/priors/"
                         f"{_decisions.gpu_slug(device_name)}.json); prior in effect during the run: "
                         f"{_decisions.prior_file()}")
    meta["run time"] = f"{time.perf_counter() - started:.0f} s"
    (out / "summary.md").write_text(sweep_report.summary_markdown(rows, meta))
    print(f"\nwrote {out / 'sweep.csv'}, {out / 'summary.md'}" + ("" if prior is None else f", {out / 'prior.json'}")
          + (", " + ", ".join(map(str, pngs)) if pngs else " (no PNG: matplotlib is not installed)")
          + f" after {meta['run time']}")
    failed_rows = [r for r in rows if r["provider"] == "cudnorm" and r.get("error")]
    for r in failed_rows[:20]:
        print(f"FAILED: cudnorm {r['op']} {r['direction']} {r['cols']}x{r['rows']}: {r['error']}")
    if device == "cpu":
        print("\n" + CPU_CAVEAT)
    _print_sweep(rows)
    return 1 if failed_rows else 0
