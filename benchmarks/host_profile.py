"""Where the host time of one cudnorm call goes, layer by layer (GPU only).

Each row is the wall time per call of 2000 back-to-back calls with one synchronize at the
end, at a shape small enough that the GPU is idle most of the time, so the figure is host
time. Layers, innermost first: the frontend's ordered execute on fixed buffers, the same with
a freshly allocated output, ``Plan.run``, the op implementation, and the public API; torch's
own kernel for comparison. Then the same for the backward; cudnorm's Triton kernels launched
from Python, through Triton's launcher and through C++'s ``launch`` (the native path's), a norm
forward alone and a per-token adaptive LayerNorm's training call (its Python autograd function
by either launcher, C++'s node and launches, the public function) beside PyTorch's formula, the
same for the adaptive RMSNorm (per-sample modulation) and the gated residual into an adaptive
LayerNorm; and
cProfiles of the API calls and of that training call (autograd on the calling thread, so the
profile sees its backward).

Run: PYTHONPATH=. python benchmarks/host_profile.py [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import cProfile
import csv
import io
import os
import pstats

import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _cache, _graphs, _runtime
from cudnorm._bench.cuda_graph import wall_us_per_call

ln_mod = importlib.import_module("cudnorm.layer_norm")  # the package exports the function under this name

M, N = 64, 4096
CALLS = 2000


def _plan(op: str, phase: str, rows: int):
    return [_cache.plans.lookup(s) for s in _cache.plans.specs() if (s.op, s.phase, s.rows) == (op, phase, rows)][-1]


def _raw(plan, buffers):
    ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")
    h = _runtime.handle(0)
    return lambda: plan.graph.execute(buffers, ws, handle=h, tensor_uids=plan.uids)


def forward_layers(dtype) -> dict:
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=dtype)
    b = torch.randn_like(w)
    with torch.no_grad():
        cudnorm.layer_norm(x, (N,), w, b)
        plan = _plan("layer_norm", "infer", M)
        fixed = _graphs.dummy_buffers(plan.spec)  # in _graphs.roles order: x, scale, bias, eps, y
        at_y = _graphs.roles(plan.spec).index("y")
        layers = {
            "raw execute, fixed buffers": _raw(plan, fixed),
            "raw execute, new output": lambda: _raw(plan, [*fixed[:at_y], torch.empty_like(x), *fixed[at_y + 1:]])(),
            "Plan.run, fixed buffers": lambda: plan.run(*fixed),
            "layer_norm._infer": lambda: ln_mod._infer(x, w, b, 1e-5),
            "cudnorm.layer_norm": lambda: cudnorm.layer_norm(x, (N,), w, b),
        }
        if dtype is x.dtype:  # torch's CUDA LayerNorm refuses mixed bf16 input / fp32 weight
            layers["torch F.layer_norm"] = lambda: F.layer_norm(x, (N,), w, b)
        times = {name: wall_us_per_call(fn, CALLS, warmup=50) for name, fn in layers.items()}
    # the training forward: grad enabled, parameters requiring grad (autograd node, saved stats)
    xg, wg, bg = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    times["cudnorm.layer_norm, grad enabled"] = wall_us_per_call(lambda: cudnorm.layer_norm(xg, (N,), wg, bg), CALLS,
                                                                 warmup=50)
    times["cudnorm.rms_norm, grad enabled"] = wall_us_per_call(lambda: cudnorm.rms_norm(xg, (N,), wg), CALLS, warmup=50)
    return times


CHAIN = 8


def chain_backward_us(op: str, rows: int, cols: int, dtype) -> float:
    """Wall time per layer of one ``autograd.grad`` through ``CHAIN`` norms (autograd's fixed
    per-call cost shared by the layers, as inside a model)."""
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(cols, device="cuda", dtype=dtype, requires_grad=True) for _ in range(CHAIN)]
    bs = [torch.randn_like(w, requires_grad=True) for w in ws]
    y = x
    for w, b in zip(ws, bs):
        y = cudnorm.layer_norm(y, (cols,), w, b) if op == "layer_norm" else cudnorm.rms_norm(y, (cols,), w)
    params = [x, *ws, *(bs if op == "layer_norm" else ())]
    dy = torch.randn_like(y)
    calls = CALLS // 8 if rows <= 4096 else 100
    return wall_us_per_call(lambda: torch.autograd.grad(y, params, dy, retain_graph=True), calls, warmup=10) / CHAIN


def backward_layers(rows: int, cols: int, dtype) -> dict:
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(cols, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn_like(w, requires_grad=True)
    dy = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    y = cudnorm.layer_norm(x, (cols,), w, b)
    _, stats = ln_mod._forward(x.detach(), w.detach(), b.detach(), 1e-5, True)  # stats: [mean; rstd]
    yt = F.layer_norm(x, (cols,), w.to(x.dtype), b.to(x.dtype))
    ln_mod._backward_impl(dy, x.detach(), w.detach(), stats)
    plan = _plan("layer_norm", "bwd", rows)
    fixed = _graphs.dummy_buffers(plan.spec)  # in _graphs.roles order
    layers = {
        "raw execute, fixed buffers": _raw(plan, fixed),
        "Plan.run, fixed buffers": lambda: plan.run(*fixed),
        "layer_norm._backward_impl": lambda: ln_mod._backward_impl(dy, x.detach(), w.detach(), stats),
        "autograd.grad cudnorm": lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True),
        "autograd.grad torch": lambda: torch.autograd.grad(yt, (x, w, b), dy, retain_graph=True),
    }
    times = {name: wall_us_per_call(fn, CALLS if rows <= 4096 else 300, warmup=30) for name, fn in layers.items()}
    for op in ("layer_norm", "rms_norm"):
        times[f"{op}: per layer of an {CHAIN}-layer autograd.grad"] = chain_backward_us(op, rows, cols, dtype)
    return times


def _token_training(fn, x, mod, dy):
    """One training call of a per-token adaptive LayerNorm ``fn`` (its forward and
    ``autograd.grad`` to x and the modulation's Linear output ``mod``, chunked as a model does)."""
    def call():
        scale, shift = mod.chunk(2, dim=-1)
        return torch.autograd.grad(fn(x, scale, shift, 1e-6, False, True), (x, mod), dy)
    return call


def launch_layers() -> dict:
    """Host us per call of cudnorm's Triton kernels launched from Python, by launcher."""
    from cudnorm import _ada_rms, _entry, _norm_kernel, _token_ada, _triton_launch

    cpp = _triton_launch.native  # set once an earlier section's call activated the native path
    served = _entry.native  # the modulated ops' nodes and launches in C++ (csrc/kernel.cpp)
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    mod = torch.randn(M, 2 * N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    # the adaptive RMSNorm: 2 samples of M / 2 tokens, a [2, D] scale and shift
    x_s = x.view(2, M // 2, N).clone().requires_grad_()
    mod_s = torch.randn(2, 2 * N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy_s = dy.view(2, M // 2, N)

    def ada_rms(x, scale, shift, eps, rms, one_plus):
        return _ada_rms.kernel(x, scale, shift, eps, one_plus)

    times = {}
    for via, launcher in (("Triton's launcher", None), ("C++ launch", cpp)):
        if via == "C++ launch" and cpp is None:
            continue
        _triton_launch.native, _entry.native = launcher, False  # the Python autograd function
        try:
            times[f"norm kernel forward, {via}"] = wall_us_per_call(
                lambda: _norm_kernel.forward(x, w, w, 1e-5, False, True), CALLS, warmup=50)
            times[f"per-token kernel, training, Python autograd, {via}"] = wall_us_per_call(
                _token_training(_token_ada.kernel, xg, mod, dy), CALLS // 4, warmup=20)
            times[f"ada_rms_norm kernel, training, Python autograd, {via}"] = wall_us_per_call(
                _token_training(ada_rms, x_s, mod_s, dy_s), CALLS // 4, warmup=20)
        finally:
            _triton_launch.native, _entry.native = cpp, served
    x3, mod3 = xg.detach().view(1, M, N).requires_grad_(), mod.detach().view(1, M, 2 * N).requires_grad_()
    public = {"kernel": _token_ada.kernel, "formula": _token_ada.formula,
              "ada_layer_norm": lambda x, scale, shift, eps, rms, one_plus: cudnorm.ada_layer_norm(x, scale, shift, eps,
                                                                                                  one_plus)}
    public["ada_rms_norm kernel"] = ada_rms
    public["ada_rms_norm formula"] = lambda x, scale, shift, eps, rms, one_plus: _ada_rms.formula(x, scale, shift, eps,
                                                                                                  one_plus)
    for kind, fn in public.items():
        args = ((x3, mod3, dy.view(1, M, N)) if kind == "ada_layer_norm" else
                (x_s, mod_s, dy_s) if kind.startswith("ada_rms_norm") else (xg, mod, dy))
        kind = kind if kind.startswith("ada_rms_norm") else f"per-token {kind}"
        times[f"{kind}, training"] = wall_us_per_call(_token_training(fn, *args), CALLS // 4, warmup=20)
        with torch.autograd.set_multithreading_enabled(False):  # no hand-off to autograd's device thread
            times[f"{kind}, training, one thread"] = wall_us_per_call(
                _token_training(fn, *args), CALLS // 4, warmup=20)
    times.update(gated_layers(x_s, dy_s))
    return times


def gated_layers(x_s: torch.Tensor, dy_s: torch.Tensor) -> dict:
    """Host us per training call of the gated residual into an adaptive LayerNorm (DiT's, SD3's
    and Flux's blocks under ``blocks=True``): 2 samples of M / 2 tokens, gate, scale and shift
    chunks of one ``[2, 3D]`` projection; by C++'s node, the Python autograd function, PyTorch's
    formula and the public function."""
    from cudnorm import _entry, _gated

    residual = x_s.detach().clone().requires_grad_()
    branch = torch.randn_like(residual, requires_grad=True)
    mod = torch.randn(2, 3 * N, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def training(fn):
        def call():
            gate, scale, shift = mod.chunk(3, dim=-1)
            y, h = fn(residual, branch, gate, scale, shift, 1e-6, True)
            return torch.autograd.grad((y, h), (residual, branch, mod), (dy_s, dy_s))
        return call

    kinds = {"C++ node" if _entry.native else "fused op": _gated.fused,
             "Python autograd function": _gated._FusedGated.apply, "formula": _gated.formula,
             "gated_ada_layer_norm": cudnorm.gated_ada_layer_norm}
    return {f"gated residual, training, {kind}": wall_us_per_call(training(fn), CALLS // 4, warmup=20)
            for kind, fn in kinds.items()}


def profile(fn, calls=CALLS, top=18) -> str:
    for _ in range(50):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    cudnorm.config(policy="cudnn")  # the default policy hands these small calls to PyTorch's ops
    print(f"device {torch.cuda.get_device_name()}  cudnn {cudnorm.info()['cudnn_backend']}")
    rows = []
    for wdtype in (torch.bfloat16, torch.float32):
        for name, us in forward_layers(wdtype).items():
            rows.append(dict(direction="fwd infer", shape=f"{M}x{N}", weight=str(wdtype)[6:], layer=name, us_per_call=us))
    for shape in ((M, N), (32768, 1024)):
        for wdtype in (torch.bfloat16, torch.float32):
            for name, us in backward_layers(*shape, wdtype).items():
                rows.append(dict(direction="bwd", shape="x".join(map(str, shape)), weight=str(wdtype)[6:], layer=name,
                                 us_per_call=us))
    for name, us in launch_layers().items():
        rows.append(dict(direction="python launch", shape=f"{M}x{N}", weight="bfloat16", layer=name, us_per_call=us))
    with open(os.path.join(args.out, "host_profile.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for r in rows:
        print(f"{r['direction']:13s} {r['shape']:>10s} w={r['weight']:8s} {r['layer']:30s} {r['us_per_call']:8.1f} us")
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        print(profile(lambda: cudnorm.layer_norm(x, (N,), w, w)))
    dy = torch.randn_like(x)
    _, stats = ln_mod._forward(x, w, w, 1e-5, True)
    print(profile(lambda: ln_mod._backward_impl(dy, x, w, stats)))
    from cudnorm import _token_ada

    mod = torch.randn(M, 2 * N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.set_multithreading_enabled(False):  # the backward on this thread: in the profile
        print(profile(_token_training(_token_ada.kernel, x.clone().requires_grad_(), mod, dy), calls=CALLS // 4,
                      top=30))


if __name__ == "__main__":
    main()
