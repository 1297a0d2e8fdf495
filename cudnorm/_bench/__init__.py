"""The benchmark behind ``cudnorm bench`` (:mod:`cudnorm.cli.bench` parses and prints):
cudnorm against its peers, checked, timed, tabulated and plotted.

What it does, in order: measures the copy bandwidth (a 2 GiB device-to-device copy; a 64 MiB
memory-to-memory copy on the CPU); on a GPU, unless filtered, captures a small training step in a CUDA graph and
measures host overhead per call; then for every op and shape checks each provider against
the fp64 reference and times the ones that pass. Results go to ``--out`` (default: a new
temporary folder, printed): ``bench.csv``, ``bench.png`` (GB/s against N, every provider)
and ``bench_speedup.png`` (cudnorm against eager PyTorch, :mod:`.plots`) when matplotlib is
installed, ``summary.md`` (the command, versions and every table) and the CSVs (and, for the
host overhead, the plot) of the extra sections. The last thing printed is the results table
with its legend. On a CPU every provider runs PyTorch's code, so the times say nothing about
cuDNN's speed: the run checks correctness and the pipeline, and says so.

Ops: ``ln_fwd``, ``ln_bwd``, ``rms_fwd``, ``rms_bwd`` (bf16 x, fp32 weight and LN bias, eps 1e-6;
forward = training forward), ``ada_fwd``, ``ada_bwd`` (DiT AdaLN ``norm(x) * (1 + scale) + shift``, when
``cudnorm.ada_layer_norm`` exists). Shapes: the PyTorch genai_layers seed (M=32768, N=256 ..
65536 for LN, .. 32768 for RMS) plus (16384, 131072) and (8192, 262144); DiT (B, S, D) shapes
for AdaLN. Providers: cudnorm (its cuDNN path at every size, ``policy="cudnn"``: the
default policy runs PyTorch's op for small calls, which the torch row times), torch (eager,
weights in x's dtype), compile
(``torch.compile(fullgraph=True)`` of the fp32-upcast reference), liger, quack, cudnn_ops
(``cudnn.ops.norm``) -- each when importable on this device; ``torch-again`` (eager PyTorch
timed a second time, the A/A control whose ratio to torch is the run's noise) when named.

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
from pathlib import Path

import torch

from . import cuda_graph, host_overhead, report, runner
from .._progress import progress

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
PEER_DISTRIBUTIONS = ("nvidia-cudnn-frontend", "triton", "liger-kernel", "quack-kernels")


def versions() -> str:
    """cudnorm, torch, the peers' distributions that are installed and cuDNN, on one line."""
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


def _host_overhead_section(out: Path, passes: int | None = None):
    results, how = host_overhead.bench(passes=passes)
    report.write_csv(results, out / "host_overhead.csv", columns=host_overhead.COLUMNS)
    host_overhead.plot(results, torch.cuda.get_device_name(), out / "host_overhead.png")
    return how, host_overhead.table(results)


def _host_breakdown_section(out: Path):
    results = host_overhead.breakdown()
    report.write_csv(results, out / "host_breakdown.csv", columns=("call", "stage", "us"))
    lines = [["call", "stage", "host us"]] + [[r["call"], r["stage"], f"{r['us']:.1f}"] for r in results]
    return host_overhead.BREAKDOWN_HOW, lines


def extras(device: str, out: Path, *, graphs: bool, host: bool, plain: bool,
           host_passes: int | None = None) -> list[tuple[str, str, list]]:
    """The CUDA-graph and host-overhead sections: ``(title, how measured, table)``, their CSVs
    written to ``out``. On a GPU they run when asked for (``graphs``, ``host``), or in a
    ``plain`` (unfiltered, non-quick) run; a failure is reported in its section and the
    benchmark goes on. ``host_passes``: the host-overhead section's interleaved passes
    (default :data:`host_overhead.PASSES`)."""
    wanted = [("CUDA graphs: training step, eager vs replay", graphs, _cuda_graph_section),
              ("Host time per call, same and fresh tensors", host,
               lambda out: _host_overhead_section(out, host_passes)),
              ("Where the host time of a call goes", host, _host_breakdown_section)]
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


def run_ops(ops: list[str], providers: list, dtype: torch.dtype, device: str, timer, copy_gbps: float, out: Path, *,
            quick: bool, shapes: list[tuple[int, ...]] | None) -> list[dict]:
    """Every op of ``ops`` at every shape of its family (``shapes``, or the defaults), each
    provider checked and, when right, timed. ``out/bench.csv`` is kept current, so an
    interrupted run leaves data; the returned rows carry the speed-ups."""
    families = [f for f in ("ln", "rms", "ada") if any(op.startswith(f + "_") for op in ops)]
    cases = [(f, s) for f in families for s in runner.shapes_for(f, quick, shapes)]
    rows: list[dict] = []
    for family, shape in progress(cases, len(cases), "cudnorm bench"):
        rows += runner.run_case(family, shape, ops, providers, dtype, device, timer, copy_gbps)
        report.write_csv(rows, out / "bench.csv")
    report.add_speedups(rows)
    report.write_csv(rows, out / "bench.csv")
    return rows
