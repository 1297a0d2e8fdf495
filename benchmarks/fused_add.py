"""Fused residual add + norm (``y, h = norm(x + r), x + r``): forward and forward+backward
against the peers, at M = 32768 rows, bf16, weights in bf16 (as the peers' modules hold them).

Providers: cudnorm (``rms_norm``/``layer_norm(..., residual=)``), PyTorch eager (the add, then
the norm: what model code writes), ``torch.compile`` of that, Liger's ``LigerFusedAddRMSNorm``
and QuACK's ``rmsnorm(..., residual=, prenorm=True)`` where installed. Every timed call gets
new input tensors: one of three input sets in turn, so no two consecutive calls share an
address. Providers are timed in interleaved rounds (each round runs every provider's forward,
then its forward+backward, ``--iters`` calls each) and the median round is kept: a lent host's
CPU jitter moved single 30-call means of one provider by up to 1.5x within one process
(docs/performance.md, "Fused residual add"). ``fwd_bwd_host_ms`` is the host time per call of
the median round's loop: where it nears ``fwd_bwd_ms`` the loop is host-bound and the GPU
waited on Python. Bandwidth counts what an ideal fused kernel moves (forward: read x, r, write h, y;
backward: read h, dy, dh, write dx; statistics and weights left out) and is given against a
device-to-device copy of the same size on the same GPU. The backward returns the gradients
(``torch.autograd.grad``) rather than accumulating them into ``.grad``, which would add
passes that no kernel choice changes. ``cudnorm-unfused`` is cudnorm with PyTorch's add
before the plain graph at every width (the choice ``FUSED_FORWARD_MAX_COLS`` makes).

    python benchmarks/fused_add.py --out benchmarks/results/<gpu>/fused_add.csv
"""

from __future__ import annotations

import argparse
import csv
import importlib
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import cudnorm  # noqa: E402

EPS = 1e-6
SETS = 3
ROUNDS = 7
_NAMES = ("cudnorm", "cudnorm-unfused", "torch", "compile", "liger", "quack")


def _providers(norm: str, n: int):
    """name -> ``forward(x, r, w, b) -> (y, h)`` for the providers available here."""
    out = {}
    if norm == "rms":
        out["cudnorm"] = lambda x, r, w, b: cudnorm.rms_norm(x, (n,), w, EPS, residual=r)

        def eager(x, r, w, b):
            h = x + r
            return F.rms_norm(h, (n,), w, EPS), h
    else:
        out["cudnorm"] = lambda x, r, w, b: cudnorm.layer_norm(x, (n,), w, b, EPS, residual=r)

        def eager(x, r, w, b):
            h = x + r
            return F.layer_norm(h, (n,), w, b, EPS), h
    out["cudnorm-unfused"] = _unfused(out["cudnorm"])
    out["torch"] = eager
    torch._dynamo.reset()
    out["compile"] = torch.compile(eager, fullgraph=True, dynamic=False)
    if norm == "rms":
        try:
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction  # noqa: PLC0415
            # what LigerFusedAddRMSNorm.forward calls (defaults: offset 0, llama casting, not in place)
            out["liger"] = lambda x, r, w, b: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)
        except Exception as exc:  # an absent peer is reported, not fatal
            print(f"liger unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        try:
            quack = importlib.import_module("quack.rmsnorm")
            out["quack"] = lambda x, r, w, b: quack.rmsnorm(x, w, residual=r, eps=EPS, prenorm=True)
        except Exception as exc:
            print(f"quack unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
    return out


def _unfused(forward):
    """cudnorm with PyTorch's add before the plain norm graph at every width (the alternative
    ``_fused_add.FUSED_FORWARD_MAX_COLS`` chooses against)."""
    from cudnorm import _fused_add  # noqa: PLC0415

    def run(*args):
        limit, _fused_add.FUSED_FORWARD_MAX_COLS = _fused_add.FUSED_FORWARD_MAX_COLS, {"rms_norm": 0, "layer_norm": 0}
        try:
            return forward(*args)
        finally:
            _fused_add.FUSED_FORWARD_MAX_COLS = limit
    return run


def _warm(fn, sets) -> None:
    for k in range(2 * SETS):
        fn(*sets[k % SETS])
    torch.cuda.synchronize()


def _round(fn, sets, iters: int) -> tuple[float, float]:
    """``(GPU ms, host ms)`` per call over one round of ``iters`` back-to-back calls cycling
    through ``sets``; host ms is the time the Python loop took to enqueue them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    t0 = time.perf_counter()
    for k in range(iters):
        fn(*sets[k % SETS])
    host = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, host * 1e3 / iters


def _step(forward, grads):
    """forward + backward of ``forward`` on leaf inputs; the call counter picks the gradient set.
    Gradients are returned, not accumulated into ``.grad`` (that would add passes)."""
    calls = [0]

    def step(x, r, w, b):
        y, h = forward(x, r, w, b)
        torch.autograd.grad([y, h], [x, r, w], list(grads[calls[0] % SETS]))
        calls[0] += 1
    return step


def _copy_gbs(numel: int, device: str) -> float:
    src = torch.empty(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    pair = [(dst, src)] * SETS  # copy_(dst, src)
    _warm(torch.Tensor.copy_, pair)
    ms = statistics.median(_round(torch.Tensor.copy_, pair, 20)[0] for _ in range(ROUNDS))
    return 2 * numel * 2 / ms / 1e6


def _check(forward, args, ref) -> str:
    y, h = forward(*args)
    ry, rh = ref
    err = max(((y.double() - ry).abs().max() / ry.abs().max()).item(), ((h.double() - rh).abs().max() / rh.abs().max()).item())
    return f"{err:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cols", default="1024,2048,4096,8192,16384")
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--norms", default="rms,ln")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = "cuda"
    rows_out = []
    copy = {}
    for norm in args.norms.split(","):
        for n in map(int, args.cols.split(",")):
            numel = args.rows * n
            copy.setdefault(n, _copy_gbs(numel, device))
            gen = torch.Generator(device=device).manual_seed(0)

            def rand(*shape):
                return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

            sets = [(rand(args.rows, n), rand(args.rows, n), rand(n), rand(n)) for _ in range(SETS)]
            grads = [(rand(args.rows, n), rand(args.rows, n)) for _ in range(SETS)]
            x, r, w, b = (t.double() for t in sets[0])
            h = x + r
            ref = (F.rms_norm(h, (n,), w, EPS) if norm == "rms" else F.layer_norm(h, (n,), w, b, EPS), h)
            leaves = [tuple(t.detach().requires_grad_(True) for t in s) for s in sets]
            timed = {}  # name -> (forward, step, max_rel_err)
            for name, forward in _providers(norm, n).items():
                step = _step(forward, grads)
                try:
                    err = _check(forward, sets[0], ref)
                    with torch.no_grad():
                        _warm(forward, sets)
                    _warm(step, leaves)
                except Exception as exc:
                    print(f"{norm} {n} {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                timed[name] = (forward, step, err)
            rounds = {name: [] for name in timed}
            for _ in range(ROUNDS):
                for name, (forward, step, _err) in timed.items():
                    with torch.no_grad():
                        fwd = _round(forward, sets, args.iters)
                    rounds[name].append((fwd[0], *_round(step, leaves, args.iters)))
            for name, (_f, _s, err) in timed.items():
                fwd_ms = statistics.median(r[0] for r in rounds[name])
                step_ms, host_ms = sorted(r[1:] for r in rounds[name])[ROUNDS // 2]
                act = numel * 2
                row = dict(norm=norm, rows=args.rows, cols=n, provider=name, max_rel_err=err,
                           fwd_ms=round(fwd_ms, 4), fwd_bwd_ms=round(step_ms, 4), fwd_bwd_host_ms=round(host_ms, 4),
                           fwd_gbs=round(4 * act / fwd_ms / 1e6), fwd_bwd_gbs=round(8 * act / step_ms / 1e6),
                           copy_gbs=round(copy[n]))
                row["fwd_bwd_pct_copy"] = round(100 * row["fwd_bwd_gbs"] / row["copy_gbs"], 1)
                rows_out.append(row)
                print(row, flush=True)
            del sets, grads, leaves, timed
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        writer.writeheader()
        writer.writerows(rows_out)
    print(f"\n{'norm':4s} {'cols':>6s} " + " ".join(f"{p:>16s}" for p in _NAMES))
    for norm in args.norms.split(","):
        for n in map(int, args.cols.split(",")):
            cells = []
            for p in _NAMES:
                hit = [r for r in rows_out if r["norm"] == norm and r["cols"] == n and r["provider"] == p]
                if hit:
                    r = hit[0]
                    mark = "*" if r["fwd_bwd_host_ms"] > 0.9 * r["fwd_bwd_ms"] else " "
                    cells.append(f"{r['fwd_ms']:6.3f}/{r['fwd_bwd_ms']:7.3f}{mark}")
                else:
                    cells.append("-")
            print(f"{norm:4s} {n:6d} " + " ".join(f"{c:>16s}" for c in cells))
    print(f"(fwd ms / fwd+bwd ms; median of {ROUNDS} interleaved rounds; *: host-bound, the loop's host time "
          "was over 90% of the GPU time)")


if __name__ == "__main__":
    main()
