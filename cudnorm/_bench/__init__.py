"""``cudnorm bench``: cudnorm against its peers, checked, timed, tabulated and plotted.

Run::

    cudnorm bench                      # full run on the GPU (sized for < 8 min on one H100;
                                       # summary.md records the real run time)
    cudnorm bench --quick              # two small shapes, any device (CI runs this on CPU)
    cudnorm bench --ops ln_bwd,rms_bwd --providers cudnorm,quack --shapes 32768x4096
    cudnorm bench --cuda-graph --host-overhead --ops rms_fwd --shapes 256x256
    cudnorm bench --from-csv benchmarks/results/<gpu>/bench.csv   # redraw the PNG, reprint
    cudnorm bench --models [FILTER] [--quick]   # whole model steps (DiT, Llama, GPT-2): models.py

(``python -m cudnorm.cli bench ...`` is the same without the console script installed.)

What it does, in order: measures the copy bandwidth (a 2 GiB device-to-device copy; 64 MiB
on the CPU); on a GPU, unless filtered, captures a small training step in a CUDA graph and
measures host overhead per call; then for every op and shape checks each provider against
the fp64 reference and times the ones that pass. Results go to ``--out`` (default
``benchmarks/results/<gpu-name>/`` or ``.../cpu/``): ``bench.csv``, ``bench.png`` (when
matplotlib is installed), ``summary.md`` (the command, versions and every table) and CSVs of
the two extra sections. The last thing printed is the results table with its legend.

Ops: ``ln_fwd``, ``ln_bwd``, ``rms_fwd``, ``rms_bwd`` (bf16 x, fp32 weight and LN bias, eps 1e-6;
forward = training forward), ``ada_fwd``, ``ada_bwd`` (DiT AdaLN ``norm(x) * (1 + scale) + shift``, when
``cudnorm.ada_layer_norm`` exists). Shapes: the PyTorch genai_layers seed (M=32768, N=256 ..
65536 for LN, .. 32768 for RMS) plus (16384, 131072) and (8192, 262144); DiT (B, S, D) shapes
for AdaLN. Providers: cudnorm (its cuDNN path at every size, ``policy="cudnn"``: the
default policy runs PyTorch's op for small calls, which the torch row times), torch (eager,
weights in x's dtype), compile
(``torch.compile(fullgraph=True)`` of the fp32-upcast reference), liger, quack, cudnn_ops
(``cudnn.ops.norm``) -- each when importable on this device.

CSV columns:

* ``op, shape, M, N, provider``: the case (``M`` = rows normalised, ``N`` = their size).
* ``status``: ``ok``; ``wrong: <qty> <err> > <bound>`` (failed the check, not timed);
  ``OOM``; ``error: <type>: <message>``.
* ``path``, ``plan``, ``build_s`` (cudnorm rows): ``cudnorm.serving_path`` of the op, or
  ``torch (cuDNN declined)`` when ``cudnorm.cache_info().declined`` grew; the cuDNN plan
  that ran (``tuned N`` when autotuning timed N candidates); seconds spent building plans.
* ``error``, ``bound``: the provider's worst relative error against the fp64 reference and
  its bound: 2x eager PyTorch's error in the same dtype, at least the dtype's floor
  (``cudnorm.reference.error_bound``).
* ``ms``: median time; ``gbps``: ``bytes / ms`` where ``bytes`` reads every input once and
  writes every output once (the seed's formula, same for every provider); ``pct_copy``:
  ``gbps`` as a percentage of the measured copy bandwidth.
* ``speedup``, ``best_peer`` (cudnorm rows): the fastest *other* provider's ms over
  cudnorm's ms in the same run (> 1 means cudnorm is faster), and which provider that was.
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import sys
import time
from pathlib import Path

import torch

from . import cuda_graph, host_overhead, report, runner
from .._progress import progress
from .._spec import dtype_from_name
from . import providers as _providers
from .providers import OPS

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
PEER_DISTRIBUTIONS = ("nvidia-cudnn-frontend", "triton", "liger-kernel", "quack-kernels")


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="a few small shapes that finish in seconds (CI)")
    parser.add_argument("--ops", help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--providers", help=f"comma-separated subset of {','.join(_providers.REGISTRY)}")
    parser.add_argument("--shapes", help="comma-separated MxN (LN/RMS) and BxSxD (AdaLN) shapes")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype (default bf16)")
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


def _device_slug(device: str) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _command(args) -> str:
    models = getattr(args, "models", None)
    parts = ["cudnorm", "bench"] + (["--models"] + ([] if models == "all" else [models]) if models else [])
    parts += ["--quick"] if args.quick else []
    for flag in ("ops", "providers", "shapes", "dtype", "out"):
        value = getattr(args, flag)
        if value and not (flag == "dtype" and value == "bf16"):
            parts += [f"--{flag}", value]
    parts += [f for f, on in (("--cuda-graph", args.cuda_graph), ("--host-overhead", args.host_overhead)) if on]
    return shlex.join(parts)


def _versions() -> str:
    import cudnorm  # noqa: PLC0415

    found = [f"cudnorm {cudnorm.__version__}", f"torch {torch.__version__}"]
    for dist in PEER_DISTRIBUTIONS:
        try:
            found.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.backends.cudnn.is_available():
        found.append(f"cuDNN backend {torch.backends.cudnn.version()}")
    return ", ".join(found)


def _cuda_graph_section(out: Path):
    results = cuda_graph.bench()
    report.write_csv(results, out / "cuda_graph.csv", columns=tuple(results[0]))
    return cuda_graph.HOW, cuda_graph.table(results)


def _host_overhead_section(out: Path):
    results, how = host_overhead.bench()
    report.write_csv(results, out / "host_overhead.csv", columns=host_overhead.COLUMNS)
    return how, host_overhead.table(results)


def _host_breakdown_section(out: Path):
    results = host_overhead.breakdown()
    report.write_csv(results, out / "host_breakdown.csv", columns=("call", "stage", "us"))
    lines = [["call", "stage", "host us"]] + [[r["call"], r["stage"], f"{r['us']:.1f}"] for r in results]
    return host_overhead.BREAKDOWN_HOW, lines


def _extras(args, device: str, out: Path) -> list[tuple[str, str, list]]:
    """The CUDA-graph and host-overhead sections: ``(title, how measured, table)``. On a GPU
    they run when asked for, or in a plain (unfiltered, non-quick) run; a failure is reported
    in its section and the benchmark goes on."""
    plain = not (args.quick or args.ops or args.providers or args.shapes)
    wanted = [("CUDA graphs: training step, eager vs replay", args.cuda_graph, _cuda_graph_section),
              ("Host time per call, same and fresh tensors", args.host_overhead, _host_overhead_section),
              ("Where the host time of a call goes", args.host_overhead, _host_breakdown_section)]
    sections = []
    for title, asked, section in wanted:
        if device != "cuda":
            if asked:
                sections.append((title, "skipped: no CUDA device", []))
            continue
        if asked or plain:
            try:
                sections.append((title, *section(out)))
            except Exception as exc:  # noqa: BLE001 - reported in its section, the rest still runs
                sections.append((title, f"FAILED: {runner.describe(exc)}", []))
            runner.free(device, collect=True)
    return sections


def _print_tables(rows: list[dict], providers: list[str], copy_gbps: float) -> dict:
    tables = report.op_tables(rows, providers)
    print("\n" + report.LEGEND)
    for op, lines in tables.items():
        print(f"\n{op}  GB/s  (copy {copy_gbps:.0f} GB/s)\n{report.text_table(lines)}")
    return tables


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
    import cudnorm  # noqa: PLC0415

    if args.from_csv:
        return _from_csv(Path(args.from_csv))
    if getattr(args, "models", None):
        from . import models  # noqa: PLC0415 - imports this package's helpers

        device = "cuda" if torch.cuda.is_available() else "cpu"
        return models.run(args, Path(args.out or Path("benchmarks") / "results" / _device_slug(device)))

    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype_from_name(DTYPES[args.dtype])
    ops = _pick(args.ops, OPS, "ops")
    registry = _providers.REGISTRY
    names = _pick(args.providers, registry, "providers")
    custom_shapes = runner.parse_shapes(args.shapes) if args.shapes else None
    if not hasattr(cudnorm, "ada_layer_norm"):
        dropped = [op for op in ops if op.startswith("ada")]
        ops = [op for op in ops if op not in dropped]
        if dropped and args.ops:
            print(f"note: {','.join(dropped)} skipped: this cudnorm has no ada_layer_norm")
    chosen = []
    print(f"cudnorm bench on {device} ({_versions()})")
    for name in names:
        why = registry[name].unavailable(device, requested=bool(args.providers))
        print(f"  provider {name:<10} {'available' if why is None else why}")
        if why is None:
            chosen.append(registry[name])
    out = Path(args.out or Path("benchmarks") / "results" / _device_slug(device))
    out.mkdir(parents=True, exist_ok=True)
    timer, timer_text = runner.make_timer(device)
    copy_gbps = runner.copy_bandwidth(device, timer)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s (device-to-device copy, read + write; timer: {timer_text})")
    sections = _extras(args, device, out)

    families = [f for f in ("ln", "rms", "ada") if any(op.startswith(f + "_") for op in ops)]
    cases = [(f, s) for f in families for s in runner.shapes_for(f, args.quick, custom_shapes)]
    rows: list[dict] = []
    for family, shape in progress(cases, len(cases), "cudnorm bench"):
        rows += runner.run_case(family, shape, ops, chosen, dtype, device, timer, copy_gbps)
        report.write_csv(rows, out / "bench.csv")  # kept current, so an interrupted run leaves data
    report.add_speedups(rows)
    report.write_csv(rows, out / "bench.csv")
    png = report.plot(rows, copy_gbps, out / "bench.png")
    meta = {"command": _command(args), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "versions": _versions(), "copy bandwidth": f"{copy_gbps:.0f} GB/s", "timer": timer_text,
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
