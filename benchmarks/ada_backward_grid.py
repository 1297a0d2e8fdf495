"""AdaLN backward: GPU and host microseconds per call over a grid of DiT shapes.

For B in {1, 2, 8, 32, 128} x S in {256, 1024, 4096} x D in {1152, 3072} (bf16 x, scale and
shift chunks of one [B, 6D] bf16 tensor, as DiT's adaLN-Zero hands them), the backward of
``layer_norm(x) * (1 + scale) + shift`` through ``torch.autograd.grad`` (engine cost included,
as a training step pays it), by:

* ``cudnorm``: ``cudnorm.ada_layer_norm`` with the default rules (``fused`` from 2 samples);
* ``cudnorm-per_sample``: the same with ``ada_backward="per_sample"`` (the previous rule for
  more than 8 samples: one LayerNorm backward launch per sample);
* ``cudnorm-cudnn``: ``ada_backward="cudnn"``, cuDNN's AdaLN backward graph (the previous rule
  for 2-8 samples; only up to :data:`CUDNN_GRAPH_MAX`);
* ``eager``: PyTorch's eager formula; ``compile``: that formula under ``torch.compile``
  (``dynamic=True``: one compile serves the grid).

Host and GPU us from one loop: calls enqueued behind a sleeping kernel, each on a fresh ``dy``
from a pool; the wall time of enqueueing them is host time, the CUDA-event time over them GPU
time (:func:`_timed`). Per-sample launches at large B fill CUDA's launch queue, so that
provider's host figure there is a bound, not host time.
Every provider's dx is checked against the fp32 formula (``rel_err``).

Run (GPU): PYTHONPATH=. python benchmarks/ada_backward_grid.py --csv OUT.csv [--png OUT.png]
  [--batches 1,2,8,32,128] [--seqs 256,1024,4096] [--dims 1152,3072] [--providers ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import cudnorm
from cudnorm._bench import host_overhead, report

PROVIDERS = ("cudnorm", "cudnorm-per_sample", "cudnorm-cudnn", "eager", "compile")
# cuDNN's AdaLN backward graph collapses beyond a few samples (3.5 ms at 32 x 256 x 1152):
# timed only up to this batch and size
CUDNN_GRAPH_MAX = (8, 1 << 24)
COLUMNS = ("shape", "batch", "seq", "dim", "provider", "gpu_us", "host_us", "gpu_vs_eager", "host_vs_eager",
           "gpu_vs_compile", "rel_err")
POOL = 4


def _formula(x, scale, shift):
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]


# dynamic shapes: one compile serves the grid (a static compile per shape would take minutes)
_compiled = torch.compile(_formula, dynamic=True)
# the timed calls re-run one backward graph (retain_graph=True), which a compiled backward
# that donates its saved buffers refuses
torch._functorch.config.donated_buffer = False


def _forward(provider: str):
    if provider.startswith("cudnorm"):
        return lambda x, scale, shift: cudnorm.ada_layer_norm(x, scale, shift, 1e-6, one_plus_scale=True)
    return _compiled if provider == "compile" else _formula


def _timed(call, calls: int, rounds: int = 5) -> tuple[float, float]:
    """``(host us, GPU us)`` per call, medians over ``rounds``: ``calls`` calls enqueued behind
    a sleeping kernel; the wall time of enqueueing them is host time (the GPU never bounds it),
    the CUDA-event time from the first call's start to the last one's end is GPU time (the
    calls were all queued before the GPU reached them, so it has no host gaps)."""
    host, gpu = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(host_overhead.SLEEP_CYCLES)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        host.append((time.perf_counter() - start) / calls * 1e6)
        end.record()
        torch.cuda.synchronize()
        gpu.append(begin.elapsed_time(end) / calls * 1e3)
    return statistics.median(host), statistics.median(gpu)


def measure(b: int, s: int, d: int, provider: str) -> dict:
    x = torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    emb = (0.1 * torch.randn(b, 6 * d, device="cuda")).bfloat16().requires_grad_(True)
    shift, scale = emb.chunk(6, dim=1)[:2]
    setting = {"ada_backward": provider.split("-")[1]} if provider.startswith("cudnorm-") else {}
    with cudnorm.config(**setting):
        y = _forward(provider)(x, scale, shift)
        pool = [torch.randn_like(y) for _ in range(POOL)]
        turn = iter(range(1 << 30))

        def call():
            return torch.autograd.grad(y, [x, emb], pool[next(turn) % POOL], retain_graph=True)

        for _ in range(3):
            call()  # compiles kernels, builds plans
        # per-sample launches fill CUDA's launch queue behind the sleeping kernel: fewer calls
        calls = 20 if provider != "cudnorm-per_sample" else max(2, min(20, 256 // b))
        host, gpu = _timed(call, calls)
        dx = call()[0]
    xf = x.detach().float().requires_grad_(True)
    want = torch.autograd.grad(_formula(xf, scale.detach().float(), shift.detach().float()), xf,
                               pool[(next(turn) - 1) % POOL].float())[0]
    err = ((dx.float() - want).norm() / want.norm()).item()
    return {"shape": f"{b}x{s}x{d}", "batch": b, "seq": s, "dim": d, "provider": provider, "gpu_us": gpu,
            "host_us": host, "rel_err": err}


def add_ratios(rows: list[dict]) -> None:
    by = {(r["shape"], r["provider"]): r for r in rows}
    for r in rows:
        eager, comp = by.get((r["shape"], "eager")), by.get((r["shape"], "compile"))
        r["gpu_vs_eager"] = r["gpu_us"] / eager["gpu_us"] if eager else None
        r["host_vs_eager"] = r["host_us"] / eager["host_us"] if eager else None
        r["gpu_vs_compile"] = r["gpu_us"] / comp["gpu_us"] if comp else None


def table(rows: list[dict], providers: list[str]) -> list[list[str]]:
    """One line per shape: GPU us / host us of each provider, cudnorm's GPU ratio to eager."""
    lines = [["B x S x D"] + [f"{p} GPU/host us" for p in providers] + ["cudnorm GPU vs eager", "vs compile"]]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = {r["provider"]: r for r in rows if r["shape"] == shape}
        cells = [f"{mine[p]['gpu_us']:.1f} / {mine[p]['host_us']:.1f}" if p in mine else "-" for p in providers]
        ours = mine.get("cudnorm", {})
        ratio = lambda key: f"{ours[key]:.2f}x" if ours.get(key) else "-"  # noqa: E731
        lines.append([shape] + cells + [ratio("gpu_vs_eager"), ratio("gpu_vs_compile")])
    return lines


def plot(rows: list[dict], path: Path, providers: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["dim"] for r in rows})
    fig, axes = plt.subplots(1, len(dims), figsize=(6 * len(dims), 4.5), squeeze=False)
    for ax, d in zip(axes[0], dims):
        for p in providers:
            mine = sorted((r for r in rows if r["dim"] == d and r["provider"] == p),
                          key=lambda r: r["batch"] * r["seq"])
            ax.plot([r["batch"] * r["seq"] for r in mine], [r["gpu_us"] for r in mine], "o-", label=p)
        ax.set(xscale="log", yscale="log", xlabel="rows B x S", ylabel="GPU us per backward", title=f"D = {d}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"AdaLN backward, bf16 ({torch.cuda.get_device_name()})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=ints, default=[1, 2, 8, 32, 128])
    parser.add_argument("--seqs", type=ints, default=[256, 1024, 4096])
    parser.add_argument("--dims", type=ints, default=[1152, 3072])
    parser.add_argument("--providers", type=lambda t: t.split(","), default=list(PROVIDERS))
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    rows = []
    for d in args.dims:
        for s in args.seqs:
            for b in args.batches:
                for p in args.providers:
                    if p == "cudnorm-cudnn" and (b > CUDNN_GRAPH_MAX[0] or b * s * d > CUDNN_GRAPH_MAX[1]):
                        continue
                    try:
                        rows.append(measure(b, s, d, p))
                    except torch.OutOfMemoryError:
                        print(f"{b}x{s}x{d} {p}: out of memory, skipped")
                    torch.cuda.empty_cache()
                print(f"{b}x{s}x{d}: " + ", ".join(f"{r['provider']} {r['gpu_us']:.1f}/{r['host_us']:.1f}"
                                                  for r in rows if r["shape"] == f"{b}x{s}x{d}"), flush=True)
    add_ratios(rows)
    report.write_csv(rows, args.csv, COLUMNS)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU us / host us per backward call")
    print(report.text_table(table(rows, args.providers)))
    ours = [r for r in rows if r["provider"] == "cudnorm" and r["gpu_vs_eager"]]
    if ours:
        print(f"cudnorm GPU / eager: median {statistics.median(r['gpu_vs_eager'] for r in ours):.2f}x, "
              f"max {max(r['gpu_vs_eager'] for r in ours):.2f}x; host / eager: max "
              f"{max(r['host_vs_eager'] for r in ours):.2f}x")
    if args.png:
        plot(rows, args.png, args.providers)


if __name__ == "__main__":
    main()
