"""Capturing a training step that uses cudnorm modules in a CUDA graph, and what it saves.

:func:`capture_train_step` is the recipe the docs point to: warm up on a side stream (this
builds and caches every cuDNN plan the step needs, since building cannot happen inside a
capture), then capture forward + backward with ``torch.cuda.graph``. cudnorm binds its cuDNN
handle to torch's current stream on every call, so the captured kernels land on the capture
stream. :func:`bench` checks replay against eager and times both at small shapes, where
launch cost dominates.
"""

from __future__ import annotations

import time

import torch

from ..reference import rel_error


def capture_train_step(model: torch.nn.Module, static_input: torch.Tensor, static_grad: torch.Tensor,
                       warmup_iters: int = 3):
    """Capture ``out = model(static_input); out.backward(static_grad)`` in a CUDA graph.

    Args:
        model: a CUDA module (e.g. with :class:`cudnorm.LayerNorm`/:class:`cudnorm.RMSNorm`).
        static_input: ``[*, features]`` CUDA tensor; copy new data into it before each replay.
        static_grad: gradient of the output, shaped like the output.
        warmup_iters: eager iterations on a side stream before capture (builds the plans).

    Returns:
        ``(graph, static_output)``. ``graph.replay()`` reruns the step; ``static_output`` and
        every ``param.grad`` are overwritten in place by each replay (they are allocated
        inside the capture, so call ``model.zero_grad(set_to_none=True)`` only before it).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_iters):
            model.zero_grad(set_to_none=True)
            model(static_input).backward(static_grad)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_output = model(static_input)
        static_output.backward(static_grad)
    return graph, static_output


def small_model(width: int = 4096, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """LayerNorm -> Linear -> RMSNorm with fp32 norm parameters and a ``dtype`` Linear, on CUDA."""
    import cudnorm  # noqa: PLC0415

    return torch.nn.Sequential(cudnorm.LayerNorm(width), torch.nn.Linear(width, width).to(dtype),
                               cudnorm.RMSNorm(width)).cuda()


def wall_us_per_call(fn, iters: int, warmup: int = 20) -> float:
    """Microseconds per call of ``iters`` back-to-back calls, one synchronize at the end."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


# Replay runs the very kernels eager runs; only reduction order (atomics in dW) may differ.
MATCH_TOLERANCE = 1e-3

HOW = ("Model: cudnorm.LayerNorm(4096) -> Linear(4096, 4096) bf16 -> cudnorm.RMSNorm(4096), fp32 norm "
       "weights, bf16 input [M, 4096]. One step = forward + backward. Eager: zero_grad(set_to_none) + "
       "forward + backward; graph: replay of capture_train_step(). Both: wall clock of back-to-back "
       "steps, one synchronize at the end, per step. match: largest relative error of output and "
       "parameter grads between one replay and one eager step on the same input.")


def bench(rows=(1, 64, 512), width: int = 4096, dtype: torch.dtype = torch.bfloat16, iters: int = 200) -> list[dict]:
    """Eager step vs CUDA-graph replay at each ``M`` in ``rows``."""
    return [_eager_vs_replay(m, width, dtype, iters) for m in rows]


def _eager_vs_replay(m: int, width: int, dtype: torch.dtype, iters: int) -> dict:
    torch.manual_seed(0)
    model = small_model(width, dtype)
    x = torch.randn(m, width, device="cuda", dtype=dtype)
    dy = torch.randn(m, width, device="cuda", dtype=dtype)

    def eager_step():
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.backward(dy)
        return out

    expected_out = eager_step().detach().clone()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    graph, static_out = capture_train_step(model, x, dy)
    graph.replay()
    torch.cuda.synchronize()
    pairs = [(static_out, expected_out), *zip((p.grad for p in model.parameters()), expected_grads, strict=True)]
    match = max(rel_error(got, want) for got, want in pairs)
    replay_us = wall_us_per_call(graph.replay, iters)
    eager_us = wall_us_per_call(eager_step, iters)
    return {"M": m, "N": width, "eager_us": eager_us, "replay_us": replay_us,
            "speedup": eager_us / replay_us, "match": match}


def table(results: list[dict]) -> list[list[str]]:
    lines = [["M x N", "eager us/step", "graph us/step", "speed-up", "replay vs eager"]]
    for r in results:
        verdict = "same" if r["match"] <= MATCH_TOLERANCE else "DIFFERS"
        lines.append([f"{r['M']}x{r['N']}", f"{r['eager_us']:.1f}", f"{r['replay_us']:.1f}",
                      f"{r['speedup']:.2f}x", f"{verdict} ({r['match']:.1e})"])
    return lines
