"""Host time per call of every op and direction, with the same tensors every call and with
fresh ones, beside PyTorch's own op.

A model makes new activations every step, so a cost that appears only when addresses change
(a capture, a cache keyed on pointers, an allocation) shows up in the fresh column. Each
figure is the wall time of ``CALLS`` calls enqueued while a sleeping kernel keeps the stream
busy, divided by ``CALLS``: the calls only enqueue work, so this is host time, whatever the
GPU time of the work. Median of 5 rounds, then of :data:`PASSES` interleaved passes
(``cudnorm bench --host-passes`` sets another count).

Directions: ``fwd-infer`` (under ``torch.no_grad()``), ``fwd-train`` (grad mode, inputs
requiring grad: builds the autograd node), ``bwd`` (``torch.autograd.backward`` of one
forward's output: the autograd engine's fixed cost included, as a training step pays it).
For ``bwd`` the fresh column runs each call on its own forward graph made beforehand; the
same column runs one graph again (``retain_graph=True``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from . import model_norms, plots

CALLS = 40
ROUNDS = 5
POOL = 64  # distinct input sets cycled by the fresh column
# Passes through every op and provider: one pass read PyTorch against itself at 0.79-1.10x on a
# lent H200's host (call R), the providers being timed minutes apart
PASSES = 3
SLEEP_CYCLES = 400_000_000  # ~0.2-0.3 s on H100/H200 clocks: longer than CALLS calls of any case here

HOW = ("Host us per call: {calls} calls enqueued behind a sleeping kernel (so the GPU never bounds them), "
       "median of {rounds} rounds, then the median over {passes} passes through every op and provider "
       "(interleaved, so a drift of the host's speed reaches all of them). 'same': the same input tensors "
       "every call; 'fresh': a new input set every call (a pool of {pool}); bwd = torch.autograd.backward of "
       "one forward output (engine cost included), fresh = a forward graph per call. cudnorm = the default policy (cudnorm._policy); cudnorm-cudnn = every "
       "call on cuDNN (policy='cudnn'), through the native launch path when it is active; cudnorm-python = the "
       "same on the Python launch path (native='off'); torch = PyTorch's own op "
       "(F.layer_norm, F.rms_norm, and the eager AdaLN formula `F.layer_norm(x) * (1 + scale[:, None]) + "
       "shift[:, None]`). Shapes: LN/RMS {rows}x{cols} bf16 with bf16 weights; AdaLN {ada} bf16 with "
       "scale/shift chunks of one [B, 6D] tensor (DiT).")


def host_us(fn: Callable[[], object], calls: int | None = None, rounds: int | None = None) -> float:
    """Median over ``rounds`` (default :data:`ROUNDS`) of the wall time per call of ``calls``
    (default :data:`CALLS`) calls of ``fn`` enqueued behind a sleeping kernel. Valid while
    those calls' launches fit in CUDA's launch queue: a call of tens of launches (the
    per-sample AdaLN backward at B = 32: 64 and more) fills it, the host then waits for the
    sleeping kernel, and the figure is about its sleep / ``calls`` (5.3 ms on an H100), not
    host time."""
    calls, rounds = calls or CALLS, rounds or ROUNDS
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2]


OPS = ("layer_norm", "rms_norm", "ada_layer_norm")
# cudnorm-python: every call on cuDNN through the Python launch path (native="off");
# torch-again: PyTorch's op timed a second time, the run's noise floor (the plot's band)
PROVIDERS = ("cudnorm", "cudnorm-cudnn", "cudnorm-python", "torch", "torch-again")
MINE = PROVIDERS[:3]


def _dit_formula(x, scale, shift):
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]


def _ops(rows: int, cols: int, ada_shape: tuple[int, int, int]):
    """``(op, provider, make_inputs, forward)``: ``make_inputs(requires_grad)`` returns a fresh
    input tuple, ``forward(*inputs)`` the output."""
    import cudnorm  # noqa: PLC0415

    dev, bf16 = "cuda", torch.bfloat16
    w = torch.randn(cols, device=dev, dtype=bf16, requires_grad=True)
    b = torch.randn(cols, device=dev, dtype=bf16, requires_grad=True)

    def rows_input(grad):
        return (torch.randn(rows, cols, device=dev, dtype=bf16, requires_grad=grad),)

    bsz, seq, dim = ada_shape

    def ada_input(grad):
        x = torch.randn(bsz, seq, dim, device=dev, dtype=bf16, requires_grad=grad)
        emb = (0.1 * torch.randn(bsz, 6 * dim, device=dev, dtype=bf16)).requires_grad_(grad)
        shift, scale = emb.chunk(6, dim=1)[:2]
        return x, scale, shift

    def ada(x, scale, shift):
        return cudnorm.ada_layer_norm(x, scale, shift, 1e-6, one_plus_scale=True)

    ops = []
    for mine in MINE:  # cudnorm (default policy), cudnorm-cudnn / -python (every call on cuDNN)
        ops += [("layer_norm", mine, rows_input, lambda x: cudnorm.layer_norm(x, (cols,), w, b)),
                ("rms_norm", mine, rows_input, lambda x: cudnorm.rms_norm(x, (cols,), w, 1e-6)),
                ("ada_layer_norm", mine, ada_input, ada)]
    for theirs in PROVIDERS[len(MINE):]:  # torch, then torch-again
        ops += [("layer_norm", theirs, rows_input, lambda x: F.layer_norm(x, (cols,), w, b)),
                ("rms_norm", theirs, rows_input, lambda x: F.rms_norm(x, (cols,), w, 1e-6)),
                ("ada_layer_norm", theirs, ada_input, _dit_formula)]
    return ops


def _cycle(items: list):
    state = [0]

    def take():
        state[0] = (state[0] + 1) % len(items)
        return items[state[0]]

    return take


def _measure(make, forward) -> dict[str, float]:
    """``{"<direction> same|fresh": us}`` for one op and provider."""
    out = {}
    fixed = make(False)
    pool = [make(False) for _ in range(POOL)]
    with torch.no_grad():
        forward(*fixed)  # builds plans, warms caches
        out["fwd-infer same"] = host_us(lambda: forward(*fixed))
        take = _cycle(pool)
        out["fwd-infer fresh"] = host_us(lambda: forward(*take()))
    leaves = make(True)
    grad_pool = [make(True) for _ in range(POOL)]
    forward(*leaves)
    out["fwd-train same"] = host_us(lambda: forward(*leaves))
    take = _cycle(grad_pool)
    out["fwd-train fresh"] = host_us(lambda: forward(*take()))
    y = forward(*leaves)
    dy = torch.randn_like(y)
    torch.autograd.backward(y, dy, retain_graph=True)
    out["bwd same"] = host_us(lambda: torch.autograd.backward(y, dy, retain_graph=True))
    samples = []
    for _ in range(ROUNDS):  # a forward graph per call, made before the timed region
        outputs = _cycle([forward(*grad_pool[k % POOL]) for k in range(CALLS)])
        samples.append(host_us(lambda: torch.autograd.backward(outputs(), dy), rounds=1))
    out["bwd fresh"] = sorted(samples)[len(samples) // 2]
    for t in (*leaves, *(t for item in grad_pool for t in item)):
        t.grad = None
    return out


def bench(rows: int = 256, cols: int = 4096, ada_shape: tuple[int, int, int] = (8, 256, 1152),
          passes: int | None = None) -> tuple[list[dict], str]:
    """``([{"op", "direction", "provider", "same_us", "fresh_us"}], how it was measured)`` on the
    current CUDA device: the median over ``passes`` (default :data:`PASSES`) interleaved passes."""
    passes = passes or PASSES
    ops = sorted(_ops(rows, cols, ada_shape), key=lambda o: OPS.index(o[0]))
    _measure(*ops[-1][2:])  # warm-up, not kept: the first op measured in a process pays one-time costs
    samples: dict[tuple, list[float]] = {}
    for k in range(passes):  # each pass starts at another op, so none is always measured first
        start = k * len(ops) // passes
        for op, provider, make, forward in ops[start:] + ops[:start]:
            with model_norms.provider_settings(provider):
                measured = _measure(make, forward)
            for key, us in measured.items():
                samples.setdefault((op, provider, key), []).append(us)
    results = []
    for op, provider, _, _ in ops:
        for direction in ("fwd-infer", "fwd-train", "bwd"):
            same, fresh = (statistics.median(samples[(op, provider, f"{direction} {kind}")])
                           for kind in ("same", "fresh"))
            results.append({"op": op, "direction": direction, "provider": provider, "same_us": same,
                            "fresh_us": fresh})
    torch_fresh = {(r["op"], r["direction"]): r["fresh_us"] for r in results if r["provider"] == "torch"}
    for r in results:
        r["vs_torch"] = r["fresh_us"] / torch_fresh[(r["op"], r["direction"])]
    how = HOW.format(calls=CALLS, rounds=ROUNDS, passes=passes, pool=POOL, rows=rows, cols=cols,
                     ada="x".join(map(str, ada_shape)))
    return results, how


COLUMNS = ("op", "direction", "provider", "same_us", "fresh_us", "vs_torch")


def plot(results: list[dict], device_name: str, path: Path) -> Path | None:
    """PyTorch's host time per call over each provider's (fresh tensors), one panel per
    direction, ``torch-again`` as the noise band (:func:`.plots.ratio_plot`)."""
    return plots.ratio_plot(plots.host_panels(results), title=f"Host time per call on {device_name}",
                            xlabel="PyTorch's host time per call / the provider's (> 1: less host time)", path=path)


def table(results: list[dict]) -> list[list[str]]:
    """One row per op, direction and provider; ``x torch`` is the fresh figure over torch's."""
    lines = [["op", "direction", "provider", "same us", "fresh us", "x torch (fresh)"]]
    for r in results:
        lines.append([r["op"], r["direction"], r["provider"], f"{r['same_us']:.1f}", f"{r['fresh_us']:.1f}",
                      f"{r['vs_torch']:.2f}"])
    return lines


BREAKDOWN_HOW = ("Host us of each stage of cudnorm's path timed alone, as host_overhead does (same tensors, GPU "
                 "held busy), beside the whole call (native launch path and Python launch path) and PyTorch's own; "
                 "the stages are not additive to the microsecond (each is timed with its own Python call around "
                 "it). 'cuDNN execute, C++ loop' is the plan's execute alone, back to back in C++: the floor of any "
                 "launch path.")


def breakdown(rows: int = 256, cols: int = 4096, ada_shape: tuple[int, int, int] = (8, 256, 1152)) -> list[dict]:
    """Where the host time of a call goes: each stage of cudnorm's path timed alone (same
    tensors, GPU held busy), beside the whole call. ``[{"call", "stage", "us"}]``. Every
    call runs cudnorm's cuDNN path (``policy="cudnn"``), the path it takes apart."""
    with model_norms.provider_settings("cudnorm-cudnn"):
        return _breakdown(rows, cols, ada_shape)


def _breakdown(rows, cols, ada_shape):
    import importlib  # noqa: PLC0415

    import cudnorm  # noqa: PLC0415
    from .. import _ada_strategies as strategies  # noqa: PLC0415
    from .. import _call_plans, _checks, _dispatch, _graphs, _native, _runtime  # noqa: PLC0415
    from .. import _settings as settings  # noqa: PLC0415

    # the modules, not the package's functions of the same names
    ada = importlib.import_module("cudnorm.ada_layer_norm")
    ln = importlib.import_module("cudnorm.layer_norm")

    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(rows, cols, device=dev, dtype=bf16, requires_grad=True)
    w = torch.randn(cols, device=dev, dtype=bf16, requires_grad=True)
    b = torch.randn(cols, device=dev, dtype=bf16, requires_grad=True)
    params = {"weight": w, "bias": b}
    y = cudnorm.layer_norm(x, (cols,), w, b)
    dy = torch.randn_like(y)
    xd = x.detach()
    _, plan = _call_plans.rows_plan("layer_norm", "train", xd, bf16)
    stats = _dispatch.stats_buffer(rows, 2, xd.device)
    out = torch.empty_like(xd)
    pointers = [xd.data_ptr(), w.data_ptr(), b.data_ptr(), _graphs.eps_scalar(1e-5)[1], out.data_ptr(), stats.data_ptr(),
                stats.data_ptr() + 4 * stats.shape[1]]
    state, workspace = _runtime.launch_context(0, plan.workspace_size)
    with settings.config(native="off"):  # the Python path's autograd node exposes what it saved
        python_y = cudnorm.layer_norm(x, (cols,), w, b)
    python_saved = python_y.grad_fn.saved_tensors
    stages = [
        ("layer_norm fwd-train", "argument checks", lambda: _checks.norm_call("layer_norm", x, (cols,), params, 1e-5)),
        ("layer_norm fwd-train", "plan lookup (signature memo)",
         lambda: _call_plans.rows_plan("layer_norm", "train", xd, bf16)),
        ("layer_norm fwd-train", "allocate y and stats",
         lambda: (torch.empty_like(xd), _dispatch.stats_buffer(rows, 2, xd.device))),
        ("layer_norm fwd-train", "cuDNN execute (raw, prebuilt addresses)",
         lambda: plan.raw.launch(pointers, workspace, state.backend)),
        ("layer_norm fwd-train", "Plan.launch (stream, workspace, address array, execute)",
         lambda: plan.launch(pointers)),
        ("layer_norm fwd-train", "implementation (_forward, no autograd node)",
         lambda: ln._forward(xd, w.detach(), b.detach(), 1e-5, True)),
        ("layer_norm fwd-train", "whole call (autograd node included)", lambda: cudnorm.layer_norm(x, (cols,), w, b)),
        ("layer_norm fwd-train", "torch F.layer_norm", lambda: F.layer_norm(x, (cols,), w, b)),
        ("layer_norm bwd", "implementation (_backward_impl)", lambda: ln._backward_impl(dy, *python_saved)),
        ("layer_norm bwd", "whole backward (autograd engine)",
         lambda: torch.autograd.backward(y, dy, retain_graph=True)),
    ]
    bsz, seq, dim = ada_shape
    xa = torch.randn(bsz, seq, dim, device=dev, dtype=bf16, requires_grad=True)
    emb = (0.1 * torch.randn(bsz, 6 * dim, device=dev, dtype=bf16)).requires_grad_(True)
    shift, scale = emb.chunk(6, dim=1)[:2]
    ya = cudnorm.ada_layer_norm(xa, scale, shift, 1e-6, one_plus_scale=True)
    dya = torch.randn_like(ya)
    xs, ss, hs = xa.detach(), scale.detach(), shift.detach()
    with settings.config(native="off"):
        python_ya = cudnorm.ada_layer_norm(xa, scale, shift, 1e-6, one_plus_scale=True)
    asaved = python_ya.grad_fn.saved_tensors
    stages += [
        ("ada_layer_norm fwd-train", "1 + scale and packed shift (one foreach kernel)",
         lambda: strategies.modulation(ss, hs, True, bf16)),
        ("ada_layer_norm fwd-train", "implementation (_forward)", lambda: ada._forward(xs, ss, hs, 1e-6, True, True)),
        ("ada_layer_norm fwd-train", "whole call", lambda: cudnorm.ada_layer_norm(xa, scale, shift, 1e-6,
                                                                                   one_plus_scale=True)),
        ("ada_layer_norm fwd-train", "torch eager formula", lambda: _dit_formula(xa, scale, shift)),
        ("ada_layer_norm bwd", "implementation (_backward_impl)",
         lambda: ada._backward_impl(dya, *asaved, True, bf16)),
        ("ada_layer_norm bwd", "whole backward (autograd engine)",
         lambda: torch.autograd.backward(ya, dya, retain_graph=True)),
    ]
    yr = cudnorm.rms_norm(x, (cols,), w)
    yt = F.rms_norm(x, (cols,), w)
    stages += [
        ("rms_norm bwd", "whole backward (autograd engine)",
         lambda: torch.autograd.backward(yr, dy, retain_graph=True)),
        ("rms_norm bwd", "torch F.rms_norm backward", lambda: torch.autograd.backward(yt, dy, retain_graph=True)),
    ]
    ye = _dit_formula(xa, scale, shift)
    stages.append(("ada_layer_norm bwd", "torch eager formula backward",
                   lambda: torch.autograd.backward(ye, dya, retain_graph=True)))
    results = []
    for call, stage, fn in stages:
        fn()
        results.append({"call": call, "stage": stage, "us": host_us(fn)})
        if stage.startswith("whole call"):  # the same forward on the Python launch path
            with settings.config(native="off"):
                fn()
                results.append({"call": call, "stage": stage + ", Python launch path", "us": host_us(fn)})
    if _native.status()["active"]:
        _, backward_plan = _call_plans.rows_plan("layer_norm", "bwd", xd, bf16)
        _, rms_backward_plan = _call_plans.rows_plan("rms_norm", "bwd", xd, bf16)
        for call, timed in (("layer_norm fwd-train", plan), ("layer_norm bwd", backward_plan),
                            ("rms_norm bwd", rms_backward_plan)):
            results.append({"call": call, "stage": "cuDNN execute, C++ loop (the floor)",
                            "us": _native.execute_floor_us(timed)})
    return results
