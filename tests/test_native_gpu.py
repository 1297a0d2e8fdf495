"""The native launch path (cudnorm/csrc) on a GPU: it serves the calls, computes what the
Python launch path computes with the same plans, and its own machinery holds (recipes, row
chunks, per-sample launches, autograd, fallbacks, errors, compiled graphs, CUDA graphs).

Each case runs once on the native path and once with ``cudnorm.config(native="off")`` (the
Python launch path): forward outputs must be bit-identical (the same plans run on the same
buffers), gradients equal within the dtype's rounding. Accuracy against fp64 references is
the other GPU tests' job, which run on whichever path is active. The suite skips this file
when run with ``CUDNORM_NATIVE=off``.
"""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _native

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def native():
    if cudnorm.get_config().native == "off":
        pytest.skip("the native launch path is switched off (CUDNORM_NATIVE=off)")
    cudnorm.layer_norm(torch.randn(8, 64, device="cuda"), (64,))  # the first CUDA call activates it
    status = _native.status()
    assert status["active"], status
    cudnorm.config(autotune="off")


def _served(fn):
    """``fn()``'s result and how many calls the C++ recipe table served during it."""
    before = _native.counters()["hits"]
    out = fn()
    return out, _native.counters()["hits"] - before


def _grads(fn, inputs):
    """Output and gradients of ``fn(*inputs)`` for a fixed random cotangent."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) if t is not None else None for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator(device="cuda").manual_seed(1)
    cotangents = [torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, cotangents)
    return [o.detach() for o in outs], [None if t is None else t.grad for t in inputs]


def _compare(fn, inputs, *, served=True):
    """``fn`` on both paths: equal forwards, close gradients; native calls served in C++."""
    for _ in range(2):  # the first call resolves the signature; the second must be a table hit
        (native_out, native_grads), hits = _served(lambda: _grads(fn, inputs))
    with cudnorm.config(native="off"):
        python_out, python_grads = _grads(fn, inputs)
    for a, b in zip(native_out, python_out):
        assert torch.equal(a, b)
    for a, b in zip(native_grads, python_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
    if served:
        assert hits >= 2, f"the native path served {hits} calls from its table"


def _pin_decision(monkeypatch, op: str, decision: str) -> list:
    """Every decision of ``op`` answers ``decision`` (kept, as a measured one is); returns the
    list of the times Python was asked, which C++'s decision table should make one."""
    from cudnorm import _decisions

    cudnorm.clear_cache()
    asked, real = [], _decisions.server_kept

    def pinned(name, *args):
        if name != op:
            return real(name, *args)
        asked.append(name)
        return decision, True

    monkeypatch.setattr(_decisions, "server_kept", pinned)
    return asked


def _bf16(*shape, scale=1.0):
    return (scale * torch.randn(*shape, device="cuda")).to(torch.bfloat16)


@pytest.mark.parametrize("weights", ["bf16", "fp32", "none"])
@pytest.mark.parametrize("shape", [(512, 1024), (4, 128, 4096)])
def test_layer_norm_matches_python_path(weights, shape):
    n = shape[-1]
    x = _bf16(*shape)
    w = None if weights == "none" else (1 + 0.1 * torch.randn(n, device="cuda")).to(
        torch.float32 if weights == "fp32" else torch.bfloat16)
    b = None if weights == "none" else (0.1 * torch.randn(n, device="cuda")).to(w.dtype)
    _compare(lambda x, w, b: cudnorm.layer_norm(x, (n,), w, b, 1e-5), [x, w, b])
    with torch.no_grad():  # the inference graph
        y, hits = _served(lambda: cudnorm.layer_norm(x, (n,), w, b, 1e-5))
        with cudnorm.config(native="off"):
            assert torch.equal(y, cudnorm.layer_norm(x, (n,), w, b, 1e-5))


@pytest.mark.parametrize("offset", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rms_norm_matches_python_path(offset, dtype):
    x = torch.randn(256, 2048, device="cuda").to(dtype)
    w = (0.1 * torch.randn(2048, device="cuda")).to(dtype)
    # an offset of 0.5 is not one cuDNN takes: the recipe hands it to the Python implementation
    _compare(lambda x, w: cudnorm.rms_norm(x, (2048,), w, 1e-6, weight_offset=offset), [x, w],
             served=offset != 0.5)


def test_padded_and_misaligned_inputs():
    base = _bf16(300, 1040)
    _compare(lambda x: cudnorm.layer_norm(x[:, :1024], (1024,)), [base])  # rows 1040 apart
    flat = _bf16(300 * 1024 + 3)
    _compare(lambda x: cudnorm.rms_norm(x[3:].view(300, 1024), (1024,)), [flat])  # 6-byte offset: copied


def _serve_by_kernel(op, x, weight, bias):
    """Make cudnorm's own kernel serve this call's signature, training and inference (the
    decision a measurement may reach), under the default policy."""
    from cudnorm import _candidates, _decisions

    for training in (True, False):
        sig = _candidates.signature(op, training, x, weight, bias, x.shape[-1])
        _decisions._keep((sig, x.get_device(), False), "kernel", {"source": "test"})
    _native.forget()


@pytest.mark.parametrize("case", ["ln", "ln-fp32-weights", "ln-no-affine", "rms", "rms-no-weight", "misaligned",
                                  "strided", "ln-residual", "rms-residual"])
def test_kernel_served_calls_launch_from_cpp(case, monkeypatch):
    """A signature decided for cudnorm's kernel: C++ launches the compiled kernel (kernel.cpp),
    forward and backward, with the same results as Python's launch of the same kernel."""
    from cudnorm import _norm_kernel

    # 2^24 elements and more: the Python launch path (native="off") also leaves such calls to the
    # dispatcher's decision, so both paths run the kernel
    rows, n = 1 << 18, 96
    rms = case.startswith("rms")
    x = _bf16(rows, n)
    if case == "misaligned":  # a 2-byte offset: C++ packs a copy for the kernel
        x = _bf16(rows * n + 1)[1:].view(rows, n)
    elif case == "strided":  # rows 128 apart
        x = _bf16(rows, 128)[:, :n]
    wdtype = torch.float32 if case == "ln-fp32-weights" else torch.bfloat16
    w = None if case in ("ln-no-affine", "rms-no-weight") else (1 + 0.1 * torch.randn(n, device="cuda")).to(wdtype)
    b = None if rms or w is None else (0.1 * torch.randn(n, device="cuda")).to(wdtype)
    with cudnorm.config(policy="auto"):
        _serve_by_kernel("rms_norm" if rms else "layer_norm", x, w, b)
        fn = (lambda x, w: cudnorm.rms_norm(x, (n,), w, 1e-5)) if rms else \
            (lambda x, w, b: cudnorm.layer_norm(x, (n,), w, b, 1e-5))
        inputs = [x, w] if rms else [x, w, b]
        if case.endswith("residual"):  # PyTorch's add, then the kernel on the sum: (y, h)
            r = _bf16(rows, n)
            fn = (lambda x, r, w: cudnorm.rms_norm(x, (n,), w, 1e-5, residual=r)) if rms else \
                (lambda x, r, w, b: cudnorm.layer_norm(x, (n,), w, b, 1e-5, residual=r))
            inputs = [x, r, *inputs[1:]]
        _grads(fn, inputs)  # resolves the recipes (Python compiles the kernel once)
        # from here on Python must not launch it
        for name in ("forward", "backward"):
            monkeypatch.setattr(_norm_kernel, name, lambda *a, **k: pytest.fail("launched from Python"))
        (native_out, native_grads), hits = _served(lambda: _grads(fn, inputs))
        with torch.no_grad():
            y_infer = fn(*inputs)
        y_infer = y_infer[0] if isinstance(y_infer, tuple) else y_infer
        monkeypatch.undo()
        assert hits >= 2, f"the native path served {hits} calls from its table"
        # the inference build of the kernel (no statistics written) may round an element apart
        torch.testing.assert_close(y_infer, native_out[0], msg=lambda m: f"inference forward: {m}")
        with cudnorm.config(native="off"):  # Python's launch of the same kernel, compiled for its own call
            python_out, python_grads = _grads(fn, inputs)
    # two compilations of one kernel (C++'s for aligned pointers, Python's for the call's) may
    # round an element apart
    for k, (a, c) in enumerate(zip(native_out, python_out)):
        torch.testing.assert_close(a, c, msg=lambda m, k=k: f"output {k}: {m}")
    for k, (a, c) in enumerate(zip(native_grads, python_grads)):
        assert (a is None) == (c is None)
        if a is not None:
            torch.testing.assert_close(a, c, msg=lambda m, k=k: f"gradient of input {k}: {m}")


def test_kernel_served_calls_capture_into_cuda_graphs():
    x = _bf16(1 << 14, 128)
    w = (1 + 0.1 * torch.randn(128, device="cuda")).to(torch.bfloat16)
    with cudnorm.config(policy="auto"):
        _serve_by_kernel("rms_norm", x, w, None)
        static_x = x.clone().requires_grad_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                cudnorm.rms_norm(static_x, (128,), w).square().mean().backward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        static_x.grad = None
        with torch.cuda.graph(graph):
            loss = cudnorm.rms_norm(static_x, (128,), w).float().square().mean()
            loss.backward()
        fresh = _bf16(1 << 14, 128)
        with torch.no_grad():
            static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        want = F.rms_norm(fresh.float(), (128,), w.float()).square().mean()
        assert loss.item() == pytest.approx(want.item(), rel=1e-2)


@pytest.mark.parametrize("rms", [False, True])
def test_python_kernel_launches_go_through_cpp(rms, monkeypatch):
    """A kernel Python launches (the norm kernel's own autograd function: its forward, backward
    and the weight gradient's sum) goes through C++'s launch while the native path serves: the
    same results as Triton's own launcher (``native="off"``), bit for bit, and a capture into a
    CUDA graph replays it."""
    from cudnorm import _norm_kernel, _triton_launch

    real = _triton_launch.native
    assert real is not None
    launched = []
    monkeypatch.setattr(_triton_launch, "native", lambda *args: (launched.append(args[1]), real(*args)))
    x = _bf16(600, 1152)
    w = 1 + 0.1 * torch.randn(1152, device="cuda")

    def call(x, w):
        return _norm_kernel.norm(x, w, None, 1e-6, rms)

    via_cpp = _grads(call, [x, w])
    assert len(launched) == 3  # forward, backward, the weight gradient's sum
    with cudnorm.config(native="off"):
        assert _triton_launch.native is None
        via_triton = _grads(call, [x, w])
    for a, b in zip(via_cpp[0] + via_cpp[1], via_triton[0] + via_triton[1]):
        assert torch.equal(a, b)
    static_x = x.clone()
    with torch.no_grad():
        call(static_x, w)  # compiled and its handle found before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = call(static_x, w)
        static_x.copy_(x.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, call(x.flip(0), w))


@pytest.mark.parametrize("case", ["shift", "no-shift", "fp32-mod", "one-sample"])
def test_adaptive_rms_norm_is_served_in_cpp(case):
    """The adaptive RMSNorm's kernels (policy "cudnn") launch from C++ with its autograd node,
    the second call from the recipe table; bit for bit Python's launches (``native="off"``)."""
    b = 1 if case == "one-sample" else 2
    x = _bf16(b * 300, 1152).view(b, 300, 1152)
    mod = _bf16(b, 3 * 1152)
    if case == "fp32-mod":
        mod = mod.float()

    def call(x, mod):
        scale, shift, _ = mod.chunk(3, dim=-1)
        return cudnorm.ada_rms_norm(x, scale, None if case == "no-shift" else shift, 1e-6)

    node, hits = _modulated_in_cpp(call, x, mod)
    assert node == "CudnormAdaRMSNormBackward"
    assert hits >= 2


@pytest.mark.parametrize("case", ["ln", "ln-no-shift", "rms", "rms-no-shift", "rms-fp32-mod", "misaligned"])
def test_per_token_calls_are_served_in_cpp(case):
    """A norm modulated per token (scale and shift chunks of a Linear's output, read in place) is
    served in C++ under policy "cudnn" (its kernels): the launches and the autograd node, the
    second call from the recipe table; bit for bit the results of Python's kernel launches
    (``native="off"``). A modulation starting off 16 bytes takes Python's launch from C++."""
    rms = case.startswith("rms")
    fn = cudnorm.ada_rms_norm if rms else cudnorm.ada_layer_norm
    x = _bf16(2 * 300, 1152).view(2, 300, 1152)
    mod = _bf16(2 * 300, 3 * 1152 + 8).view(2, 300, -1)
    if case == "rms-fp32-mod":
        mod = mod.float()
    start = 1 if case == "misaligned" else 0

    def call(x, mod):
        scale, shift = mod[..., start:start + 1152], mod[..., start + 1152:start + 2304]
        return fn(x, scale, None if case.endswith("no-shift") else shift, 1e-6, one_plus_scale=True)

    node, hits = _modulated_in_cpp(call, x, mod)
    assert node == ("CudnormTokenAdaRMSNormBackward" if rms else "CudnormTokenAdaLayerNormBackward")
    assert hits >= (1 if case == "misaligned" else 2)  # forward and backward (misaligned: the forward's key only)


def _modulated_in_cpp(call, x, mod) -> tuple[str, int]:
    """``call(x, mod)`` (a modulated norm under policy "cudnn": its kernels) twice through the
    native path: its autograd node's name and the recipe-table hits of the second call; its
    output and gradients bit for bit those of Python's launches (``native="off"``)."""
    with cudnorm.config(policy="cudnn"):
        for _ in range(2):
            (y, grads), hits = _served(lambda: _grads(call, [x, mod]))
        with torch.enable_grad():
            node = call(x, mod.detach().requires_grad_()).grad_fn.next_functions[0][0].name()  # under y's view
        with cudnorm.config(native="off"):
            y_py, grads_py = _grads(call, [x, mod])
    for a, b in zip(y + grads, y_py + grads_py):
        assert torch.equal(a, b)
    return node, hits


@pytest.mark.parametrize("outputs", ["y and h", "y"])
def test_gated_residual_is_served_in_cpp(outputs):
    """The gated residual's fused op (DiT's chunks of one Linear output, [B, 1, 6D]) runs in C++:
    its forward, its autograd node and the backward kernel, the second call from the recipe
    table; bit for bit Python's autograd function (``native="off"``), with gradients reaching
    both outputs or y alone."""
    from cudnorm import _gated

    residual, branch = _bf16(2 * 300, 1152).view(2, 300, 1152), _bf16(2 * 300, 1152).view(2, 300, 1152)
    mod = _bf16(2, 6 * 1152).view(2, 1, -1)

    def call(residual, branch, mod):
        shift, scale, gate = mod.chunk(6, dim=-1)[:3]
        y, h = _gated.fused(residual, branch, gate, scale, shift, 1e-6, True)
        return (y, h) if outputs == "y and h" else y

    for _ in range(2):
        (out, grads), hits = _served(lambda: _grads(call, [residual, branch, mod]))
    with torch.enable_grad():
        y = call(residual, branch, mod.detach().requires_grad_())
    node = (y[0] if isinstance(y, tuple) else y).grad_fn.name()
    with cudnorm.config(native="off"):
        out_py, grads_py = _grads(call, [residual, branch, mod])
    assert node == "CudnormGatedAdaLayerNormBackward"
    assert hits >= 2  # the AdaLN forward's recipe and the backward's
    for a, b in zip(out + grads, out_py + grads_py):
        assert torch.equal(a, b)


@pytest.mark.parametrize("decision", ["kernel", "torch"])
def test_gated_public_call_is_served_in_cpp(decision, monkeypatch):
    """cudnorm.gated_ada_layer_norm's training call runs in C++ from the public function on
    (csrc/entry.cpp): its signature's measured decision asked once, then the fused op's node or
    the formula; none of Python's path runs, and the results are bit for bit those of the op
    the decision names (``_gated.fused`` or ``_gated.formula``)."""
    from cudnorm import _candidates, _gated

    asked = _pin_decision(monkeypatch, _candidates.GATED, decision)

    def python_path(*args):
        raise AssertionError("Python's path ran")

    residual, branch, mod = _bf16(2, 300, 1152), _bf16(2, 300, 1152), _bf16(2, 1, 6 * 1152, scale=0.3)

    def call(op):
        def run(residual, branch, mod):
            shift, scale, gate = mod.chunk(6, dim=-1)[:3]
            return op(residual, branch, gate, scale, shift, 1e-6, True)
        return run

    with cudnorm.config(policy="auto"), monkeypatch.context() as patched:
        patched.setattr(_gated, "supports", python_path)
        for _ in range(2):
            out, grads = _grads(call(cudnorm.gated_ada_layer_norm), [residual, branch, mod])
        with torch.enable_grad():
            y, _ = call(cudnorm.gated_ada_layer_norm)(residual, branch, mod.detach().requires_grad_())
    assert asked == [_candidates.GATED]  # the second call found it in C++'s table
    assert (y.grad_fn.name() == "CudnormGatedAdaLayerNormBackward") == (decision == "kernel")
    want_out, want_grads = _grads(call(_gated.fused if decision == "kernel" else _gated.formula),
                                  [residual, branch, mod])
    for a, b in zip(out + grads, want_out + want_grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rms", [False, True])
def test_per_token_double_backward_and_capture(rms):
    """Gradients of gradients through the per-token node (create_graph: PyTorch's differentiable
    formula) match the formula's own; a CUDA graph captures the C++ launches of a training step."""
    from cudnorm import _token_ada

    fn = cudnorm.ada_rms_norm if rms else cudnorm.ada_layer_norm
    x = _bf16(4 * 64, 256).view(4, 64, 256).float()
    scale, shift = 0.3 * torch.randn_like(x), 0.3 * torch.randn_like(x)

    def penalty(norm):
        leaves = [t.detach().requires_grad_() for t in (x, scale, shift)]
        y = norm(*leaves)
        gx, = torch.autograd.grad(y.square().sum(), leaves[0], create_graph=True)
        gx.square().sum().backward()
        return [t.grad for t in leaves[:2]]  # dx and dscale of the penalty (it does not reach shift)

    with cudnorm.config(policy="cudnn"):
        got = penalty(lambda x, sc, sh: fn(x, sc, sh, 1e-6, one_plus_scale=True))
    want = penalty(lambda x, sc, sh: _token_ada.formula(x, sc, sh, 1e-6, rms, True))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    static = [t.detach().clone().requires_grad_() for t in (x, scale, shift)]
    with cudnorm.config(policy="cudnn"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*static, 1e-6, one_plus_scale=True).square().mean().backward()
        torch.cuda.current_stream().wait_stream(side)
        for t in static:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*static, 1e-6, one_plus_scale=True).square().mean().backward()
        new_x = torch.randn_like(x)
        static[0].detach().copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        want = [t.detach().clone().requires_grad_() for t in (new_x, scale, shift)]
        fn(*want, 1e-6, one_plus_scale=True).square().mean().backward()
    for a, b in zip(static, want):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("n", [2048, 16384])  # fused in the graph / PyTorch's add then the plain graph
def test_fused_residual_add_matches_python_path(rms, n):
    x, r = _bf16(64, n), _bf16(64, n)
    w = 1 + 0.1 * torch.randn(n, device="cuda")
    if rms:
        _compare(lambda x, r, w: cudnorm.rms_norm(x, (n,), w, 1e-6, residual=r), [x, r, w])
    else:
        b = 0.1 * torch.randn(n, device="cuda")
        _compare(lambda x, r, w, b: cudnorm.layer_norm(x, (n,), w, b, residual=r), [x, r, w, b])


@pytest.mark.parametrize("rows", [5001, 20002])  # chunks with an overlapping, unaligned remainder
def test_row_chunks_match_python_path(rows):
    cudnorm.config(exact_rows=0)  # every row count on the shared chunk graphs
    x = _bf16(rows, 1024)
    w, b = torch.randn(1024, device="cuda", dtype=torch.bfloat16), torch.randn(1024, device="cuda")
    _compare(lambda x, w, b: cudnorm.layer_norm(x, (1024,), w, b.to(torch.bfloat16)), [x, w, b])
    _compare(lambda x, w: cudnorm.rms_norm(x, (1024,), w), [x, w])
    assert cudnorm.cache_info().chunked_calls > 0


def test_small_rows_and_wide_rows_run_pytorchs_kernels():
    cudnorm.config(exact_rows=0)
    _compare(lambda x: cudnorm.layer_norm(x, (1024,)), [_bf16(7, 1024)])  # too few rows to chunk
    n = cudnorm._dispatch.NATIVE_FORWARD_MIN_COLS
    with torch.no_grad():
        x = _bf16(4, n)
        y, hits = _served(lambda: cudnorm.layer_norm(x, (n,)))
        y, hits = _served(lambda: cudnorm.layer_norm(x, (n,)))
        assert hits == 1
        torch.testing.assert_close(y, F.layer_norm(x, (n,)))


@pytest.mark.parametrize("case", [
    (2, 256, 1152, "auto", "auto"),  # cuDNN's AdaLN graphs
    (16, 256, 1152, "auto", "auto"),  # backward per sample
    (4, 250, 1152, "per_sample", "per_sample"),  # samples whose statistics need padding
])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_ada_layer_norm_matches_python_path(case, scale_dtype):
    b, s, d, forward, backward = case
    cudnorm.config(ada_forward=forward, ada_backward=backward)
    x = _bf16(b, s, d)
    emb = (0.1 * torch.randn(b, 6 * d, device="cuda")).to(scale_dtype)
    # DiT's chunks of one Linear output: neither scale nor shift is packed
    _compare(lambda x, emb: cudnorm.ada_layer_norm(x, emb.chunk(6, 1)[1], emb.chunk(6, 1)[0], 1e-6,
                                                   one_plus_scale=True), [x, emb],
             served=forward == "auto" or s % 4 == 0)


@pytest.mark.parametrize("affine", ["weight+bias", "weight", "bias"])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shared", [False, True])
def test_affine_fold_matches_the_formula(affine, param_dtype, shared):
    """An affine LayerNorm then a modulation (CogVideoXLayerNormZero's), folded into one
    ada_layer_norm / layer_norm call: the native fold (csrc/fold.cpp, one autograd node) against
    the formula the Python path records op by op. Both compute in fp32 and round once; the
    fold's multiply-add may round the fp32 shift differently (one bf16 ulp at most)."""
    from cudnorm._diffusers_forwards import _modulated_layer_norm

    b, s, d = 2, 256, 1152
    shape = (d,) if shared else (b, 1, d)
    weight = (1 + 0.1 * torch.randn(d, device="cuda")).to(param_dtype) if "weight" in affine else None
    bias = (0.1 * torch.randn(d, device="cuda")).to(param_dtype) if "bias" in affine else None
    inputs = [_bf16(b, s, d), _bf16(*shape, scale=0.1), _bf16(*shape, scale=0.1), weight, bias]

    def fn(x, scale, shift, weight, bias):
        return _modulated_layer_norm(x, scale, shift, 1e-6, weight, bias)

    with cudnorm.config(policy="cudnn"):  # the fold, not the formula a measured decision may pick
        native_out, native_grads = _grads(fn, inputs)
    with cudnorm.config(native="off"):
        python_out, python_grads = _grads(fn, inputs)
    torch.testing.assert_close(native_out[0], python_out[0], atol=2e-2, rtol=1e-2)
    for name, a, b_ in zip(["x", "scale", "shift", "weight", "bias"], native_grads, python_grads):
        assert (a is None) == (b_ is None), name
        if a is not None:
            assert a.dtype == b_.dtype, name
            torch.testing.assert_close(a.float(), b_.float(), atol=5e-2, rtol=2e-2,
                                       msg=lambda message, name=name: f"the gradient of {name}: {message}")
    with cudnorm.config(policy="cudnn"):
        y = fn(*[None if t is None else t.detach().clone().requires_grad_() for t in inputs])
    names, frontier = [], [y.grad_fn]
    for _ in range(3):  # the native forward's graph, a few nodes deep: the fold is one node
        frontier = [n for node in frontier for n, _ in node.next_functions if n is not None]
        names += [n.name() for n in frontier]
    assert any("AffineFold" in name for name in names), names


@pytest.mark.parametrize("decision", ["torch", "cudnn"])
def test_affine_modulated_call_is_served_in_cpp(decision, monkeypatch):
    """An affine LayerNorm's per-sample modulated call (CogVideoX's) runs in C++ from
    ``_modulated_layer_norm`` on (csrc/entry.cpp: its decision asked once, then diffusers'
    formula or the fold and one adaptive LayerNorm), bit for bit what the Python route
    computes under the same decision."""
    from cudnorm import _candidates, _entry
    from cudnorm._diffusers_forwards import _modulated_layer_norm

    asked = _pin_decision(monkeypatch, _candidates.AFFINE_MODULATED, decision)
    b, s, d = 2, 300, 1920
    weight = (1 + 0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16)
    bias = (0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16)
    inputs = [_bf16(b, s, d), _bf16(b, 1, d, scale=0.1), _bf16(b, 1, d, scale=0.1), weight, bias]

    def fn(x, scale, shift, weight, bias):
        return _modulated_layer_norm(x, scale, shift, 1e-6, weight, bias)

    with cudnorm.config(policy="auto"):
        for _ in range(2):
            native_out, native_grads = _grads(fn, inputs)
        assert asked == [_candidates.AFFINE_MODULATED]  # the second call found it in C++'s table
        monkeypatch.setattr(_entry, "modulated_layer_norm", lambda *args: None)  # the Python route
        python_out, python_grads = _grads(fn, inputs)
    for a, b_ in zip(native_out + native_grads, python_out + python_grads):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("tokens", [256, 8192])
def test_modulated_layer_norm_is_served_by_measurement(tokens):
    """A per-sample affine modulated LayerNorm (CogVideoX's) takes the measured decision of its
    signature: diffusers' formula or the fold plus one adaptive LayerNorm, both timed through
    autograd; either meets the 2x rule against fp64."""
    from cudnorm._diffusers_forwards import _modulated_layer_norm

    cudnorm.clear_cache()
    b, d = 2, 1920
    weight = (1 + 0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16)
    bias = (0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16)
    inputs = [_bf16(b, tokens, d), _bf16(b, 1, d, scale=0.1), _bf16(b, 1, d, scale=0.1), weight, bias]

    def formula(x, scale, shift, weight, bias):
        return torch.nn.functional.layer_norm(x, (d,), weight, bias, 1e-6) * (1 + scale) + shift

    with cudnorm.config(policy="auto"):  # the tests' default is policy="cudnn": the fold
        ours, our_grads = _grads(lambda *t: _modulated_layer_norm(*t[:3], 1e-6, *t[3:]), inputs)
    theirs, their_grads = _grads(formula, inputs)
    ref, ref_grads = _grads(formula, [t.double() for t in inputs])
    rows = [r for r in cudnorm.serving_decisions() if r["signature"].startswith("modulated_layer_norm/train")]
    assert len(rows) == 1 and rows[0]["source"] == "measured", rows
    assert set(rows[0]["ms"]) == {"torch", "cudnn"}, rows[0]

    def rel(a, r):
        return ((a.double() - r).norm() / r.norm()).item()
    for name, a, t, r in zip(["y", "x", "scale", "shift", "weight", "bias"], ours + our_grads, theirs + their_grads,
                             ref + ref_grads):
        assert rel(a, r) <= 2 * rel(t, r) + 1e-3, f"{name} ({rows[0]['serves']}): {rel(a, r):.3g} vs {rel(t, r):.3g}"


# the Python launch path leaves calls below 2^24 elements to PyTorch's ops (cudnorm._policy, rule
# 3): its case is above that
# (not named `native`: that is this file's autouse fixture, which skips it where the native path is off)
@pytest.mark.parametrize(("tokens", "launch"), [(256, "auto"), (8192, "auto"), (8192, "off")])
def test_ada_layer_norm_is_served_by_measurement(tokens, launch):
    """An adaptive LayerNorm (DiT's, and every fused block's) takes the measured decision of its
    signature on both launch paths: cuDNN's AdaLN or the formula in PyTorch's ops, both timed
    through autograd; either meets the 2x rule against fp64."""
    cudnorm.clear_cache()
    b, d = 2, 2304
    inputs = [_bf16(b, tokens, d), _bf16(b, d, scale=0.1), _bf16(b, d, scale=0.1)]

    def formula(x, scale, shift):
        return F.layer_norm(x, (d,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]

    with cudnorm.config(policy="auto", native=launch):  # the tests' default is policy="cudnn"
        ours, our_grads = _grads(lambda *t: cudnorm.ada_layer_norm(*t, 1e-6, one_plus_scale=True), inputs)
        path = cudnorm.serving_path("ada_layer_norm", inputs[0].detach().requires_grad_())
    theirs, their_grads = _grads(formula, inputs)
    ref, ref_grads = _grads(formula, [t.double() for t in inputs])
    rows = [r for r in cudnorm.serving_decisions() if r["signature"].startswith("ada_layer_norm/train")]
    # the other launch path's run may have stored it (the same signature): measured either way
    assert len(rows) == 1 and rows[0]["source"] in ("measured", "stored"), rows
    assert set(rows[0]["ms"]) == {"torch", "cudnn"}, rows[0]
    assert path.startswith("cudnn" if rows[0]["serves"] == "cudnn" else "torch ("), (path, rows[0])

    def rel(a, r):
        return ((a.double() - r).norm() / r.norm()).item()
    for name, a, t, r in zip(["y", "x", "scale", "shift"], ours + our_grads, theirs + their_grads, ref + ref_grads):
        assert rel(a, r) <= 2 * rel(t, r) + 1e-3, f"{name} ({rows[0]['serves']}): {rel(a, r):.3g} vs {rel(t, r):.3g}"


def test_double_backward_matches_python_path():
    x, w = _bf16(64, 512).float(), 1 + 0.1 * torch.randn(512, device="cuda")

    def penalty(x, w):
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = cudnorm.layer_norm(x, (512,), w)
        (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        gx.square().sum().backward()
        return w.grad

    got = penalty(x, w)
    with cudnorm.config(native="off"):
        torch.testing.assert_close(got, penalty(x, w))


def test_inference_mode_is_served():
    x = _bf16(128, 1024)
    with torch.inference_mode():
        (y, hits) = _served(lambda: cudnorm.rms_norm(x, (1024,)))
        (y, hits) = _served(lambda: cudnorm.rms_norm(x, (1024,)))
    assert hits == 1
    with cudnorm.config(native="off"):
        assert torch.equal(y, cudnorm.rms_norm(x, (1024,)))


def test_compiled_graph_calls_the_native_kernels():
    model = torch.nn.Sequential(cudnorm.LayerNorm(1024), torch.nn.Linear(1024, 1024), cudnorm.RMSNorm(1024)).cuda()
    x = torch.randn(4, 64, 1024, device="cuda", requires_grad=True)
    compiled = torch.compile(model, fullgraph=True)
    compiled(x).sum().backward()  # traced with policy="cudnn": the graph calls cudnorm's ops
    out, hits = _served(lambda: compiled(x))
    out.sum().backward()
    assert hits >= 2
    torch.testing.assert_close(out, model(x))


def test_cuda_graph_capture_replays_native_launches():
    model = torch.nn.Sequential(cudnorm.LayerNorm(512), torch.nn.Linear(512, 512), cudnorm.RMSNorm(512)).cuda()
    static_x = torch.randn(64, 512, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model(static_x).square().mean().backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = model(static_x).square().mean()
    for _ in range(2):
        static_x.copy_(torch.randn(64, 512, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert loss.item() == pytest.approx(model(static_x).square().mean().item(), rel=1e-6)


def test_malformed_arguments_raise_cudnorms_errors():
    x = _bf16(8, 64)
    with pytest.raises(TypeError, match="cudnorm.layer_norm: argument 'weight' must be a torch.Tensor"):
        cudnorm.layer_norm(x, (64,), weight="ones")
    with pytest.raises(ValueError, match="cudnorm.layer_norm: argument 'normalized_shape'"):
        cudnorm.layer_norm(x, (32,))
    with pytest.raises(ValueError, match="cudnorm.rms_norm: argument 'eps'"):
        cudnorm.rms_norm(x, (64,), eps=-1.0)
    with pytest.raises(ValueError, match="cudnorm.ada_layer_norm: argument 'scale'"):
        cudnorm.ada_layer_norm(_bf16(2, 4, 64), _bf16(3, 64), _bf16(2, 64))


def test_cpu_and_float64_calls_take_the_python_implementation():
    x = torch.randn(8, 64)
    torch.testing.assert_close(cudnorm.layer_norm(x, (64,)), F.layer_norm(x, (64,)))
    xd = torch.randn(8, 64, device="cuda", dtype=torch.float64)
    torch.testing.assert_close(cudnorm.rms_norm(xd, (64,)), F.rms_norm(xd, (64,)))


def test_threads_share_recipes_safely():
    x = _bf16(256, 1024)
    expected = cudnorm.layer_norm(x, (1024,))
    errors = []

    def work():
        try:
            for _ in range(50):
                assert torch.equal(cudnorm.layer_norm(x, (1024,)), expected)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# A new process (so that PyTorch's autograd worker thread is new too): the kernel served first
# from a thread of the user's, then as the first backward of the process. Neither thread has a
# current CUDA context when it starts, and the caching allocator holds blocks for every buffer
# the calls take, so that no cudaMalloc binds one before the kernel's launch does.
NO_CONTEXT_CHILD = """
import ctypes, threading, torch
import cudnorm
from cudnorm import _entry

libcuda = ctypes.CDLL("libcuda.so.1")

def current_context():
    ctx = ctypes.c_void_p()
    assert libcuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value

rows, n = 1 << 16, 64
gen = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
w = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).requires_grad_()  # fp32, as the sweep's cell
b = (0.1 * torch.randn(n, device="cuda", generator=gen)).requires_grad_()
dy = torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16)
assert _entry.try_native(x)
kernel = _entry.SERVERS["kernel"]

def call():
    return _entry.layer_norm(x, [n], w, b, 1e-5, kernel)

with torch.no_grad():
    expected = call()
for size in (1 << 28, 1 << 10):  # a large and a small segment, cached once freed
    block = torch.empty(size, dtype=torch.uint8, device="cuda")
    del block
found = {}

def users_thread():
    try:
        found["context"] = current_context()
        with torch.no_grad():
            found["y"] = call()
    except Exception as exc:
        found["error"] = exc

thread = threading.Thread(target=users_thread)
thread.start()
thread.join()
assert found["context"] is None, "a new thread had a current context: nothing is tested"
assert "error" not in found, found.get("error")
assert torch.equal(found["y"], expected)
grads = torch.autograd.grad(call(), (x, w, b), dy)
reference = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
for got, want in zip(grads, torch.autograd.grad(reference, (x, w, b), dy.double())):
    torch.testing.assert_close(got.double(), want.double(), atol=0.05, rtol=0.05)
print("launched")
"""


def test_kernel_launches_from_threads_without_a_cuda_context():
    """cuLaunchKernel needs the thread's current context, which c10 does not bind on a thread
    whose device is already the one asked for: the fp32-weights sweep's first training cell
    failed with CUresult 201 (CUDA_ERROR_INVALID_CONTEXT) in the kernel's backward, the first
    CUDA call of PyTorch's autograd worker thread."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", NO_CONTEXT_CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "launched" in done.stdout, done.stderr[-3000:]


def test_a_configuration_block_keeps_the_recipes_of_the_one_around_it():
    # the configuration is part of the recipe key: a `with cudnorm.config(...)` block resolves
    # its own recipes, and the code after it finds the earlier ones (no call into Python)
    x = _bf16(64, 1024)
    cudnorm.layer_norm(x, (1024,))
    before = _native.counters()
    assert before["recipes"] > 0
    with cudnorm.config(autotune="on"):
        cudnorm.layer_norm(x, (1024,))
    inside = _native.counters()
    assert inside["resolved"] == before["resolved"] + 1
    cudnorm.layer_norm(x, (1024,))
    after = _native.counters()
    assert after["resolved"] == inside["resolved"] and after["hits"] == inside["hits"] + 1
    cudnorm.clear_cache()  # what changes a resolution still empties the table
    assert _native.counters()["recipes"] == 0
