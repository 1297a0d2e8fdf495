"""A norm modulated per token (FLUX.3's, Helios', Sana-Video's output norms; FLUX.3's blocks):
cudnorm's kernels against PyTorch's formula, eager and compiled, per shape.

For adaptive LayerNorm and RMSNorm of bf16 ``[1, rows, D]`` tokens with bf16 per-token scale and
shift read in place from one ``[1, rows, 3D]`` Linear output (as diffusers' chunks are), training
(forward and backward through autograd, gradients to x and the modulation) and inference:

* ``formula``: diffusers' ``norm(x) * (1 + scale) + shift`` in PyTorch's eager ops;
* ``compiled``: the same under ``torch.compile`` (what a compiled model runs);
* ``kernel``: :func:`cudnorm._token_ada.kernel` (its launches and autograd node in C++ while
  the native path serves, else launched from Python);
* ``cudnorm``: ``cudnorm.ada_layer_norm`` / ``ada_rms_norm`` under the default policy (the
  measured decision's choice, ``serves``).

``gpu_us``: CUDA events around ``CALLS`` calls rotating over ``SETS`` input sets, enqueued behind
a GPU sleep (host time hidden), median of ``ROUNDS``; ``host_us``: the host time of the same
enqueue loop. Every provider's outputs and gradients are compared with fp64 (``rel_err``, the
largest relative error).

Run (GPU, about a minute): PYTHONPATH=. python benchmarks/token_ada.py --out DIR
Writes DIR/token_ada.csv and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import torch

import cudnorm
from cudnorm import _candidates, _token_ada

SHAPES = ((4608, 3072), (8192, 3072), (32760, 3072), (32760, 5120), (16384, 1536), (4096, 128))
COMPILED_SHAPES = ((4608, 3072), (32760, 3072))  # each shape and phase compiles (8-20 s): two shapes
EPS = 1e-6
SETS, CALLS, ROUNDS = 3, 10, 5
SLEEP_CYCLES = 40_000_000  # ~20 ms: longer than enqueueing CALLS training calls of any provider
PROVIDERS = ["formula", "compiled", "kernel", "cudnorm"]
COLUMNS = ("op", "phase", "rows", "cols", "provider", "gpu_us", "host_us", "vs_formula", "serves", "rel_err")


def _time(call, sets) -> tuple[float, float]:
    """``(GPU us, host us)`` per call."""
    for s in sets:
        call(*s)
    gpu, host = [], []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        started = time.perf_counter()
        for i in range(CALLS):
            call(*sets[i % len(sets)])
        host.append((time.perf_counter() - started) / CALLS * 1e6)
        end.record()
        torch.cuda.synchronize()
        gpu.append(begin.elapsed_time(end) / CALLS * 1e3)
    return statistics.median(gpu), statistics.median(host)


def _providers(rms: bool, compiled: bool) -> dict:
    public = cudnorm.ada_rms_norm if rms else cudnorm.ada_layer_norm
    out = {"formula": lambda x, sc, sh: _token_ada.formula(x, sc, sh, EPS, rms, True)}
    if compiled and "compiled" in PROVIDERS:
        formula = torch.compile(_token_ada.formula, dynamic=False)
        out["compiled"] = lambda x, sc, sh: formula(x, sc, sh, EPS, rms, True)
    out["kernel"] = lambda x, sc, sh: _token_ada.kernel(x, sc, sh, EPS, rms, True)
    out["cudnorm"] = lambda x, sc, sh: public(x, sc, sh, EPS, one_plus_scale=True)
    return out


def _train(fn):
    def run(x, mod):
        xl, ml = x.detach().requires_grad_(), mod.detach().requires_grad_()
        scale, shift, _ = ml.chunk(3, -1)
        return torch.autograd.grad(fn(xl, scale, shift), (xl, ml), x)
    return run


def _infer(fn):
    def run(x, mod):
        scale, shift, _ = mod.chunk(3, -1)
        return fn(x, scale, shift)
    return run


def _error(fn, x, mod, rms) -> float:
    want = _train(lambda x, sc, sh: _token_ada.formula(x, sc, sh, EPS, rms, True))(x.double(), mod.double())
    want_y = _token_ada.formula(x.double(), *mod.double().chunk(3, -1)[:2], EPS, rms, True)
    got = _train(fn)(x, mod)
    got_y = _infer(fn)(x, mod)
    pairs = [(got_y, want_y)] + list(zip(got, want))
    return max(((g.double() - w).norm() / w.norm()).item() for g, w in pairs)


def decision_text(record: dict) -> str:
    """A decision of :func:`cudnorm.serving_decisions` in one cell: the choice, then each
    candidate's measured ms (GPU plus host time) and spread, so a choice can be checked."""
    timings = "; ".join(f"{name} {ms:.3f} ms +-{100 * record.get('spread', {}).get(name, 0.0):.0f}%"
                        for name, ms in sorted(record.get("ms", {}).items()))
    return f"{record['serves']} ({timings})" if timings else record["serves"]


def measure(rows: int, cols: int, rms: bool) -> list[dict]:
    torch.manual_seed(0)
    # [1, rows, D]: a 2-D [rows, D] call with [rows, D] chunks is per sample (one token each),
    # the same numbers on cudnorm's per-sample path
    sets = [((2 * torch.randn(1, rows, cols, device="cuda") + 0.5).bfloat16(),
             (0.3 * torch.randn(1, rows, 3 * cols, device="cuda")).bfloat16()) for _ in range(SETS)]
    op = _candidates.TOKEN_RMS_NORM if rms else _candidates.TOKEN_LAYER_NORM
    out = []
    for name, fn in _providers(rms, (rows, cols) in COMPILED_SHAPES).items():
        if name not in PROVIDERS and name != "formula":  # the formula: every ratio's baseline
            continue
        err = _error(fn, *sets[0], rms)
        for phase, wrap in (("train", _train), ("infer", _infer)):
            gpu, host = _time(wrap(fn), sets)
            serves = ""
            if name == "cudnorm":
                served = [r for r in cudnorm.serving_decisions()
                          if r["signature"].startswith(f"{op}/{phase}/") and f"/n={cols}/" in r["signature"]]
                serves = decision_text(served[-1]) if served else "torch (size rule)"
            out.append({"op": op, "phase": phase, "rows": rows, "cols": cols, "provider": name,
                        "gpu_us": round(gpu, 1), "host_us": round(host, 1), "serves": serves,
                        "rel_err": f"{err:.2e}"})
    for r in out:
        base = next(b for b in out if b["phase"] == r["phase"] and b["provider"] == "formula")  # always timed
        r["vs_formula"] = round(base["gpu_us"] / r["gpu_us"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--providers", default="formula,compiled,kernel,cudnorm",
                        help="comma-separated, of formula, compiled, kernel, cudnorm")
    args = parser.parse_args()
    global PROVIDERS
    PROVIDERS = args.providers.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    torch._dynamo.config.cache_size_limit = 64  # one compiled formula per shape, phase and op
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for rms in (False, True):
        for shape in SHAPES:
            for r in measure(*shape, rms):
                rows.append(r)
                print(" ".join(f"{k}={r[k]}" for k in COLUMNS), flush=True)
    with open(args.out / "token_ada.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
