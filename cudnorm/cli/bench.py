"""``cudnorm bench``: cudnorm against its peers (:mod:`cudnorm._bench` measures; this module
parses, prints and picks the exit status).

Run::

    cudnorm bench                      # full run on the GPU (sized for < 8 min on one H100;
                                       # summary.md records the real run time)
    cudnorm bench --quick              # two small shapes, any device (CI runs this on CPU)
    cudnorm bench --ops ln_bwd,rms_bwd --providers cudnorm,quack --shapes 32768x4096
    cudnorm bench --cuda-graph --host-overhead --ops rms_fwd --shapes 256x256
    cudnorm bench --from-csv benchmarks/results/<gpu>/bench.csv   # redraw the PNG, reprint
    cudnorm bench --models [FILTER] [--quick]   # whole model steps (DiT, SD3, Flux, Llama, GPT-2):
                                                # _bench/models.py

(``python -m cudnorm.cli bench ...`` is the same without the console script installed.)
What a run measures, and the CSV's columns: :mod:`cudnorm._bench`. The last thing printed is
the results table with its legend. Exits 1 when a cudnorm row failed.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import torch

from .. import _bench
from .._bench import model_zoo, models, providers, report, runner
from .._spec import dtype_from_name


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="a few small shapes that finish in seconds (CI)")
    parser.add_argument("--ops", help=f"comma-separated subset of {','.join(providers.OPS)}")
    parser.add_argument("--providers", help=f"comma-separated subset of {','.join(providers.REGISTRY)}")
    parser.add_argument("--shapes", help="comma-separated MxN (LN/RMS) and BxSxD (AdaLN) shapes")
    parser.add_argument("--dtype", choices=sorted(_bench.DTYPES), default="bf16",
                        help="activation dtype (default bf16)")
    parser.add_argument("--out", help="output folder (default benchmarks/results/<gpu-name or cpu>)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="CUDA-graph section (GPU; on by default in a full run)")
    parser.add_argument("--host-overhead", action="store_true",
                        help="host us/call section (GPU; on by default in a full run)")
    parser.add_argument("--models", nargs="?", const="all", metavar="FILTER",
                        help="model-step benchmark instead of the ops (see cudnorm/_bench/models.py); FILTER: "
                             "comma-separated substrings of case ids like dit-1152-b8-s1024:train-compile")
    parser.add_argument("--from-csv", metavar="CSV",
                        help="run nothing: redraw the PNG and reprint the tables of a bench.csv")


def _pick(text: str | None, known, what: str) -> list[str]:
    if not text:
        return list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"cudnorm bench: argument '--{what}' has unknown {unknown}; expected some of {list(known)}")
    return names


def _command(args) -> str:
    """The command line that reproduces this run, for the summaries."""
    models_filter = getattr(args, "models", None)
    parts = ["cudnorm", "bench"] + (["--models"] + ([] if models_filter == "all" else [models_filter])
                                    if models_filter else [])
    parts += ["--quick"] if args.quick else []
    for flag in ("ops", "providers", "shapes", "dtype", "out"):
        value = getattr(args, flag)
        if value and not (flag == "dtype" and value == "bf16"):
            parts += [f"--{flag}", value]
    parts += [f for f, on in (("--cuda-graph", args.cuda_graph), ("--host-overhead", args.host_overhead)) if on]
    return shlex.join(parts)


def _print_tables(rows: list[dict], names: list[str], copy_gbps: float) -> None:
    print("\n" + report.LEGEND)
    for op, lines in report.op_tables(rows, names).items():
        print(f"\n{op}  GB/s  (copy {copy_gbps:.0f} GB/s)\n{report.text_table(lines)}")


def _from_csv(path: Path) -> int:
    """Redraw ``bench.png`` next to ``path`` and reprint its tables (e.g. where the GPU
    machine that ran the benchmark had no matplotlib)."""
    rows = report.read_csv(path)
    copy_gbps = next(100.0 * r["gbps"] / r["pct_copy"] for r in rows if r["pct_copy"])
    png = report.plot(rows, copy_gbps, path.with_suffix(".png"))
    print(f"redrew {png}" if png else "no PNG: matplotlib is not installed")
    _print_tables(rows, list(dict.fromkeys(r["provider"] for r in rows)), copy_gbps)
    return 0


def run(args) -> int:
    if args.from_csv:
        return _from_csv(Path(args.from_csv))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out or _bench.default_out(device))
    if getattr(args, "models", None):
        return _run_models(args, device, out)
    return _run_ops(args, device, out)


def _run_ops(args, device: str, out: Path) -> int:
    import cudnorm  # noqa: PLC0415

    started = time.perf_counter()
    dtype = dtype_from_name(_bench.DTYPES[args.dtype])
    ops = _pick(args.ops, providers.OPS, "ops")
    registry = providers.REGISTRY
    names = _pick(args.providers, registry, "providers")
    custom_shapes = runner.parse_shapes(args.shapes) if args.shapes else None
    if not hasattr(cudnorm, "ada_layer_norm"):
        dropped = [op for op in ops if op.startswith("ada")]
        ops = [op for op in ops if op not in dropped]
        if dropped and args.ops:
            print(f"note: {','.join(dropped)} skipped: this cudnorm has no ada_layer_norm")
    chosen = []
    print(f"cudnorm bench on {device} ({_bench.versions()})")
    for name in names:
        why = registry[name].unavailable(device, requested=bool(args.providers))
        print(f"  provider {name:<10} {'available' if why is None else why}")
        if why is None:
            chosen.append(registry[name])
    out.mkdir(parents=True, exist_ok=True)
    timer, timer_text = runner.make_timer(device)
    copy_gbps = runner.copy_bandwidth(device, timer)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s (device-to-device copy, read + write; timer: {timer_text})")
    plain = not (args.quick or args.ops or args.providers or args.shapes)
    sections = _bench.extras(device, out, graphs=args.cuda_graph, host=args.host_overhead, plain=plain)

    rows = _bench.run_ops(ops, chosen, dtype, device, timer, copy_gbps, out, quick=args.quick, shapes=custom_shapes)
    png = report.plot(rows, copy_gbps, out / "bench.png")
    meta = {"command": _command(args), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "versions": _bench.versions(), "copy bandwidth": f"{copy_gbps:.0f} GB/s", "timer": timer_text,
            "argv": " ".join(sys.argv), "run time": f"{time.perf_counter() - started:.0f} s"}
    tables = report.op_tables(rows, [p.name for p in chosen])
    (out / "summary.md").write_text(report.summary_markdown(meta, tables, sections))

    for title, how, lines in sections:
        print(f"\n{title}\n{how}\n" + (report.text_table(lines, right=0) if lines else ""))
    print(f"\nwrote {out / 'bench.csv'}, {out / 'summary.md'}"
          + (f", {png}" if png else " (no PNG: matplotlib is not installed)") + f" after {meta['run time']}")
    failed = [r for r in rows if r["provider"] == "cudnorm" and r["status"] != "ok"]
    for r in failed:
        print(f"FAILED: cudnorm {r['op']} {r['shape']}: {r['status']}")
    _print_tables(rows, [p.name for p in chosen], copy_gbps)
    return 1 if failed else 0


def _run_models(args, device: str, out: Path) -> int:
    """``cudnorm bench --models [FILTER]``: run, write models.csv/.png/.md to ``out``, print
    the tables last. Returns 1 when a cudnorm row failed, 2 when the arguments select nothing."""
    started = time.perf_counter()
    asked = [n.strip() for n in (args.providers or ",".join(models.DEFAULT_PROVIDERS)).split(",") if n.strip()]
    unknown = [n for n in asked if n not in models.PROVIDERS]
    cases = model_zoo.select(model_zoo.all_cases(args.quick), args.models, device, args.quick)
    if unknown or not cases:
        print(f"cudnorm bench --models: unknown providers {unknown}; expected some of {list(models.PROVIDERS)}"
              if unknown else f"cudnorm bench --models: no case matches {args.models!r}", file=sys.stderr)
        return 2
    usable, notes = models.usable_providers(asked, device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    settings = models.QUICK_SETTINGS if args.quick else models.Settings()
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"cudnorm bench --models on {device_name} ({_bench.versions()}), {str(dtype).removeprefix('torch.')}, "
          f"{len(cases)} cases")
    print("\n".join(f"  provider {note}" for note in notes))
    out.mkdir(parents=True, exist_ok=True)
    rows = models.run_cases(cases, usable, settings, device, dtype, out)
    meta = {"command": _command(args), "device": device_name, "versions": _bench.versions(),
            "dtype": str(dtype).removeprefix("torch."),
            "loop": f"{settings.rounds}-{settings.max_rounds} rounds (until {settings.min_timed_s:g} s of steps) x "
                    f"K = {settings.steps} steps ({settings.decode_steps} decode), "
                    f"{settings.warmup} warm-up steps",
            "providers": "; ".join(notes), "run time": f"{time.perf_counter() - started:.0f} s"}
    png, lines_by_title = models.write_report(rows, meta, out)
    print(f"\nwrote {out / 'models.csv'}, {out / 'models.md'}"
          + (f", {png}" if png else " (no PNG: matplotlib missing or nothing timed)") + f" after {meta['run time']}")
    failed = [r for r in rows if r["provider"].startswith("cudnorm") and not r["status"].startswith("ok")]
    for r in failed:
        print(f"FAILED: cudnorm {r['case']}: {r['status']}")
    print("\n" + models.LEGEND)
    for title, lines in lines_by_title.items():
        print(f"\n{title}\n{report.text_table(lines, right=0)}")
    return 1 if failed else 0
