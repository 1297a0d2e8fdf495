"""cudnorm's own LayerNorm/RMSNorm kernels (cudnorm._norm_kernel) against PyTorch's, per width:
GB/s and share of a device copy, forward and backward, over a few launch shapes of each width.

For LayerNorm (bf16 weight and bias) and RMSNorm (bf16 weight) of bf16 rows at widths
64-4096, ``2^25`` elements each (``--elements``), and the per-head widths again at ``2^26``:

* ``triton BMxW/P[sS]``: :func:`_norm_kernel.forward` (training: statistics written) or
  :func:`_norm_kernel.backward` (weight and bias gradients summed) with launch shape
  ``Config(BM rows a tile, W warps, P programs per SM; 0: one per tile, r: as many as the SMs
  hold of the compiled kernel; sS: the backward's loop pipelined over S stages)``: ``_config``'s
  guess (marked ``*``) and a few neighbours (:func:`candidates`). Per-head sizes time the guess
  and the best shape of the ``2^25`` run;
* ``torch``: ATen's ops called directly (``native_layer_norm`` / ``_fused_rms_norm`` and their
  ``_backward``), what ``F.layer_norm`` / ``F.rms_norm`` run;
* ``torch-autograd`` (backward only): ``torch.autograd.grad`` through ``F.layer_norm`` /
  ``F.rms_norm``, as a training step pays it.

GB/s counts the traffic the op cannot avoid (forward: read x, write y and the statistics;
backward: read x, dy and the statistics, write dx); ``%copy`` divides it by a device-to-device
copy's GB/s of the same bytes. Each timing: ``CALLS`` calls enqueued behind a sleeping kernel
(so host launch cost never shows), rotating over ``SETS`` input sets, CUDA events around them,
median of ``ROUNDS``. Every provider's outputs are compared with fp32 PyTorch (``rel_err``,
the largest over y or dx/dw/db); a shape whose error exceeds ``2e-2`` is flagged ``BAD``.

Run (GPU, under 2 minutes on one H100):
  PYTHONPATH=. python benchmarks/norm_kernel.py --out DIR [--ops ln,rms] [--widths 64,88,...]
    [--elements 25] [--per-head 26] [--shapes 3]
Prints one table per op and phase and writes DIR/norm_kernel.csv (one row per measurement).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cudnorm import _norm_kernel as nk
from cudnorm._bench import report

WIDTHS = (64, 88, 96, 128, 192, 256, 1152, 1408, 2240, 4096)
PER_HEAD = (64, 88, 128, 256)  # query/key norms: rows = batch * heads * tokens
EPS = 1e-5
SETS, CALLS, ROUNDS = 3, 12, 3
SLEEP_CYCLES = 10_000_000  # ~5-7 ms: longer than enqueueing CALLS calls of any provider
BAD = 2e-2
COLUMNS = ("op", "phase", "elements", "cols", "rows", "provider", "block_m", "num_warps", "programs_per_sm",
           "stages", "default", "us", "gbps", "pct_copy", "vs_torch", "rel_err")


def _timed_us(call, sets: list) -> float:
    """GPU microseconds per call: median over rounds of CALLS calls (rotating over ``sets``)
    enqueued behind a sleeping kernel, timed by CUDA events."""
    for s in sets:
        call(*s)  # compiles, allocates
    times = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for i in range(CALLS):
            call(*sets[i % len(sets)])
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / CALLS * 1e3)
    return statistics.median(times)


def copy_gbps(elements: int) -> float:
    """A device-to-device copy of ``elements`` bf16 values: GB/s of bytes read plus written."""
    pairs = [(torch.empty(elements, device="cuda", dtype=torch.bfloat16),
              torch.randn(elements, device="cuda").bfloat16()) for _ in range(SETS)]
    us = _timed_us(lambda dst, src: dst.copy_(src), pairs)
    return 2 * elements * 2 / us / 1e3


def candidates(cols: int, rows: int, backward: bool, shapes: int, layer_norm: bool = False) -> list[nk.Config]:
    """``_config``'s guess first, then neighbours: taller/shorter tiles or more/fewer warps
    (the first ``shapes`` distinct tile shapes, each a compile), each on a few grids (free);
    for a narrow backward or LayerNorm forward also the pipelined loop (2048- and 4096-element
    tiles over 3 stages, the grid what the SMs hold) and the plain shape, whichever the guess is not."""
    guess = nk._config(cols, torch.bfloat16, rows, backward, layer_norm_forward=layer_norm)
    bm, w = nk.tile_shape(cols, rows, backward)
    pipelined = []
    if (backward or layer_norm) and bm > 1:
        block_n = nk._pow2(cols)
        pipelined = [nk.Config(min(elements // block_n, nk._pow2(rows)), 4, nk.RESIDENT, 3) for elements in (2048, 4096)]
    if bm > 1:
        tiles = [(bm, w), (bm * 2, w), (max(1, bm // 2), w), (bm * 2, w * 2), (bm * 4, w * 2)]
    else:
        tiles = [(1, w), (1, max(4, w // 2)), (1, min(32, w * 2)), (2, w)]
    tiles = list(dict.fromkeys(tiles))[:shapes]
    out = [guess]
    if pipelined:  # the other loop of a narrow backward, whatever ``shapes``
        out.append(nk.Config(bm, w, max(1, 32 // w) if backward else 0) if guess.stages else pipelined[0])
    for m, warps in tiles:
        resident = max(1, 32 // warps)
        grids = (resident, 2 * resident, 0) if backward else (0, resident, 2 * resident)
        out += [nk.Config(m, warps, p) for p in grids]
    return list(dict.fromkeys(out + pipelined[:shapes]))


def shape_name(config: nk.Config) -> str:
    """``BMxW/P`` (``P`` programs per SM, ``r`` what the SMs hold), ``sS`` for a loop pipelined over S stages."""
    grid = "r" if config.programs_per_sm == nk.RESIDENT else config.programs_per_sm
    return f"{config.block_m}x{config.num_warps}/{grid}" + (f"s{config.stages}" if config.stages else "")


def _inputs(op: str, rows: int, cols: int) -> list[tuple]:
    """SETS of ``(x, w, b, dy)``, bf16 (``b`` None for RMSNorm)."""
    sets = []
    for _ in range(SETS):
        x = (2 * torch.randn(rows, cols, device="cuda") + 0.5).bfloat16()
        w = (1 + 0.5 * torch.randn(cols, device="cuda")).bfloat16()
        b = (0.3 * torch.randn(cols, device="cuda")).bfloat16() if op == "ln" else None
        sets.append((x, w, b, torch.randn_like(x)))
    return sets


def _torch_forward(op):
    if op == "ln":
        return lambda x, w, b: torch.ops.aten.native_layer_norm(x, [x.shape[1]], w, b, EPS)
    return lambda x, w, b: torch.ops.aten._fused_rms_norm(x, [x.shape[1]], w, EPS)


def _torch_backward(op, x, w, b, dy, saved):
    if op == "ln":
        _, mean, rstd = saved
        return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[1]], mean, rstd, w, b, [True, True, True])
    return torch.ops.aten._fused_rms_norm_backward(dy, x, [x.shape[1]], saved[1], w, [True, True]) + (None,)


def _reference(op, x, w, b, dy):
    """fp32 ``(y, dx, dw, db)`` from PyTorch's ops."""
    leaves = [t.float().requires_grad_(True) for t in (x, w) + ((b,) if b is not None else ())]
    if op == "ln":
        y = F.layer_norm(leaves[0], (x.shape[1],), leaves[1], leaves[2], EPS)
    else:
        y = F.rms_norm(leaves[0], (x.shape[1],), leaves[1], EPS)
    grads = torch.autograd.grad(y, leaves, dy.float())
    return (y.detach(),) + grads + ((None,) if b is None else ())


def _rel(got, want) -> float:
    return max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(got, want) if r is not None)


def measure(op: str, elements: int, cols: int, shapes: int, only: list[nk.Config] | None = None) -> list[dict]:
    """Rows of one (op, size, width): every provider, forward and backward, on
    ``elements // cols`` rows (``elements``: the nominal size the row is filed under)."""
    rows = elements // cols
    sets = _inputs(op, rows, cols)
    rms = op == "rms"
    want = _reference(op, *sets[0])
    stat_rows = 1 if rms else 2
    traffic = {"fwd": 2 * rows * cols * 2 + 4 * stat_rows * rows, "bwd": 3 * rows * cols * 2 + 4 * stat_rows * rows}
    out = []

    def row(phase, provider, us, err, config=None, default=False):
        out.append({"op": op, "phase": phase, "elements": elements, "cols": cols, "rows": rows,
                    "provider": provider, "block_m": config and config.block_m,
                    "num_warps": config and config.num_warps, "programs_per_sm": config and config.programs_per_sm,
                    "stages": config and config.stages, "default": default, "us": us, "gbps": traffic[phase] / us / 1e3, "rel_err": err})

    fwd = _torch_forward(op)
    saved = [fwd(x, w, b) for x, w, b, _ in sets]
    row("fwd", "torch", _timed_us(lambda x, w, b, dy: fwd(x, w, b), sets), _rel(saved[0][:1], want[:1]))
    torch_sets = [s + (t,) for s, t in zip(sets, saved)]
    bwd = lambda x, w, b, dy, t: _torch_backward(op, x, w, b, dy, t)  # noqa: E731
    try:
        row("bwd", "torch", _timed_us(bwd, torch_sets), _rel(bwd(*torch_sets[0]), want[1:]))
    except NotImplementedError:  # a torch without this device's _fused_rms_norm_backward: autograd's only
        pass
    graphs = []
    for x, w, b, dy in sets:
        leaves = [t.detach().requires_grad_(True) for t in (x, w) + ((b,) if b is not None else ())]
        y = F.layer_norm(leaves[0], (cols,), *leaves[1:], EPS) if not rms else F.rms_norm(leaves[0], (cols,),
                                                                                          leaves[1], EPS)
        graphs.append((y, leaves, dy))
    grad = lambda y, leaves, dy: torch.autograd.grad(y, leaves, dy, retain_graph=True)  # noqa: E731
    row("bwd", "torch-autograd", _timed_us(grad, graphs), _rel(grad(*graphs[0]) + ((None,) if rms else ()), want[1:]))
    del graphs

    bias_dtype = None if rms else torch.bfloat16
    for phase in ("fwd", "bwd"):
        guess = nk._config(cols, torch.bfloat16, rows, phase == "bwd", layer_norm_forward=not rms)
        for config in only or candidates(cols, rows, phase == "bwd", shapes, layer_norm=not rms):
            if phase == "fwd":
                call = lambda x, w, b, dy, c=config: nk.forward(x, w, b, EPS, rms, True, config=c)  # noqa: E731
                err = _rel(call(*sets[0])[:1], want[:1])
            else:
                stats = [nk.forward(x, w, b, EPS, rms, True)[1] for x, w, b, _ in sets]
                kernel_sets = [(dy, x, w, s) for (x, w, b, dy), s in zip(sets, stats)]
                call = lambda dy, x, w, s, c=config: nk.backward(dy, x, w, s, rms, bias_dtype, config=c)  # noqa: E731
                err = _rel(call(*kernel_sets[0]), want[1:])
            us = _timed_us(call, sets if phase == "fwd" else kernel_sets)
            name = "triton " + shape_name(config)
            row(phase, name + ("*" if config == guess else ""), us, err, config, config == guess)
    return out


def _torch_best(rows: list[dict], r: dict) -> dict:
    """PyTorch's fastest row (``torch`` or ``torch-autograd``) of ``r``'s op, phase, size and width."""
    key = ("op", "phase", "elements", "cols")
    return min((t for t in rows if t["provider"].startswith("torch") and all(t[k] == r[k] for k in key)),
               key=lambda t: t["us"])


def add_ratios(rows: list[dict], copy: dict[int, float]) -> None:
    for r in rows:
        r["pct_copy"] = 100 * r["gbps"] / copy[r["elements"]]
        r["vs_torch"] = _torch_best(rows, r)["us"] / r["us"]


def table(rows: list[dict], op: str, phase: str) -> list[list[str]]:
    """One line per (size, width): PyTorch's GB/s (its faster provider), the guess's and the
    best shape's, %copy, the best shape's speedup over PyTorch."""
    lines = [["width", "2^elems", "torch GB/s", "%copy", "guess GB/s", "%copy", "best shape", "GB/s", "%copy",
              "vs torch", "rel_err", "note"]]
    keys = dict.fromkeys((r["elements"], r["cols"]) for r in rows if r["op"] == op and r["phase"] == phase)
    for elements, cols in keys:
        mine = [r for r in rows if (r["op"], r["phase"], r["elements"], r["cols"]) == (op, phase, elements, cols)]
        torch_row = _torch_best(mine, mine[0])
        ours = [r for r in mine if r["provider"].startswith("triton") and r["rel_err"] < BAD]
        guess = next((r for r in mine if r["default"]), None)
        best = max(ours, key=lambda r: r["gbps"], default=None)
        bad = [r["provider"] for r in mine if r["rel_err"] >= BAD]
        cells = [str(cols), f"{elements.bit_length() - 1}", f"{torch_row['gbps']:.0f}", f"{torch_row['pct_copy']:.0f}"]
        cells += [f"{guess['gbps']:.0f}", f"{guess['pct_copy']:.0f}"] if guess else ["-", "-"]
        cells += ([best["provider"].removeprefix("triton "), f"{best['gbps']:.0f}", f"{best['pct_copy']:.0f}",
                   f"{best['vs_torch']:.2f}x", f"{best['rel_err']:.1e}"] if best else ["-"] * 5)
        lines.append(cells + ["BAD " + ",".join(bad) if bad else ""])
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for norm_kernel.csv")
    parser.add_argument("--ops", default="ln,rms")
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    parser.add_argument("--elements", type=int, default=25, help="log2 of elements per case")
    parser.add_argument("--per-head", type=int, default=26, help="log2 of elements of the per-head cases (0: none)")
    parser.add_argument("--shapes", type=int, default=3, help="tile shapes (compiles) tried per width and phase")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    widths = [int(w) for w in args.widths.split(",")]
    start = time.perf_counter()
    sizes = [1 << args.elements] + ([1 << args.per_head] if args.per_head else [])
    copy = {n: copy_gbps(n) for n in sizes}
    print(f"{torch.cuda.get_device_name()}: copy {', '.join(f'2^{n.bit_length() - 1}: {g:.0f} GB/s' for n, g in copy.items())}")
    rows = []
    for op in args.ops.split(","):
        for cols in widths:
            found = measure(op, 1 << args.elements, cols, args.shapes)
            rows += found
            print(f"  {op} {cols}: {time.perf_counter() - start:.0f} s", flush=True)
            if args.per_head and cols in PER_HEAD:
                best = [max((r for r in found if r["phase"] == phase and r["provider"].startswith("triton")
                             and r["rel_err"] < BAD), key=lambda r: r["gbps"]) for phase in ("fwd", "bwd")]
                only = list(dict.fromkeys(
                    [nk.Config(r["block_m"], r["num_warps"], r["programs_per_sm"], r["stages"]) for r in best]
                    + [nk._config(cols, torch.bfloat16, (1 << args.per_head) // cols, b, layer_norm_forward=op == "ln")
                       for b in (False, True)]))
                rows += measure(op, 1 << args.per_head, cols, args.shapes, only)
            add_ratios(rows, copy)
            report.write_csv(rows, args.out / "norm_kernel.csv", COLUMNS)  # kept as it grows: a cut-off run still says
    for op in args.ops.split(","):
        for phase in ("fwd", "bwd"):
            print(f"\n{op} {phase} (bf16; shape BMxW/P[sS], * = _config's guess)")
            print(report.text_table(table(rows, op, phase), left=1, right=1))
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s -> {args.out / 'norm_kernel.csv'}")


if __name__ == "__main__":
    main()
