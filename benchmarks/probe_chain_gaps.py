"""Where the host time of a backward chain goes: inside cudnorm's backward node vs between nodes.

An 8-layer LayerNorm (or RMSNorm) chain at 32768x1024 bf16 (fp32 weights), one
``autograd.grad`` per pass. The eager Function's ``backward`` is wrapped to record, on the
autograd device thread, the time of each node's entry and exit: ``inside`` is the Python
backward (our implementation and the launch), ``gap`` the time from one node's exit to the
next node's entry (autograd's engine between Python nodes). Compared with a chain of a
trivial ``autograd.Function`` (identity backward) and of ``F.layer_norm`` (a C++ node).
Also the wall time per pass.

Run: PYTHONPATH=. python benchmarks/probe_chain_gaps.py   (GPU only)
"""

from __future__ import annotations

import importlib
import statistics
import time

import torch
import torch.nn.functional as F

import cudnorm

M, N, LAYERS, PASSES = 32768, 1024, 8, 30


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy, None


def timed_backward(cls, marks):
    original = cls.backward

    def backward(ctx, *grads):
        marks.append(("in", time.perf_counter()))
        out = original(ctx, *grads)
        marks.append(("out", time.perf_counter()))
        return out

    cls.backward = staticmethod(backward)
    return original


def chain(fn, x, ws):
    y = x
    for w in ws:
        y = fn(y, w)
    return y


def run(name, fn, cls=None):
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(N, device="cuda", requires_grad=True) for _ in range(LAYERS)]
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    y = chain(fn, x, ws)
    marks: list = []
    original = timed_backward(cls, marks) if cls is not None else None
    try:
        for _ in range(5):
            torch.autograd.grad(y, [x, *ws], dy, retain_graph=True, allow_unused=True)
        torch.cuda.synchronize()
        marks.clear()
        walls, calls = [], []
        for _ in range(PASSES):
            start = time.perf_counter()
            torch.autograd.grad(y, [x, *ws], dy, retain_graph=True, allow_unused=True)
            calls.append(time.perf_counter() - start)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
    finally:
        if cls is not None:
            cls.backward = staticmethod(original)
    inside, gaps = [], []
    for k, (kind, t) in enumerate(marks):
        if kind == "out":
            inside.append(t - marks[k - 1][1])
            if k + 1 < len(marks) and (k + 1) % (2 * LAYERS):
                gaps.append(marks[k + 1][1] - t)
    us = lambda v: f"{1e6 * statistics.median(v):7.1f}" if v else "    n/a"  # noqa: E731
    print(f"{name:34s} grad call {1e6 * statistics.median(calls) / LAYERS:7.1f} us/layer, "
          f"synced pass {1e6 * statistics.median(walls) / LAYERS:7.1f} us/layer, "
          f"inside node {us(inside)} us, gap between nodes {us(gaps)} us", flush=True)


def main() -> int:
    ln = importlib.import_module("cudnorm.layer_norm")
    rms = importlib.import_module("cudnorm.rms_norm")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for _ in range(2):
        run("identity autograd.Function", lambda y, w: Identity.apply(y, w), Identity)
        run("F.layer_norm (C++ node)", lambda y, w: F.layer_norm(y, (N,), w.bfloat16()))
        run("cudnorm.layer_norm", lambda y, w: cudnorm.layer_norm(y, (N,), w, w), ln._LayerNormFunction)
        run("cudnorm.rms_norm", lambda y, w: cudnorm.rms_norm(y, (N,), w), rms._RMSNormFunction)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
