"""The Python side of the native launch path (cudnorm._native), on a CPU: what a call signature
resolves to (the recipes C++ executes), the Python fallbacks' argument conventions C++ relies
on, the build directory's key, and what happens when the native path cannot be built.

The C++ itself runs on the GPU (tests/test_native_gpu.py). Here plans come from the emulated
cuDNN path (tests/emulated_cudnn.py) and get fake ids in place of the C++ table's.
"""

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import emulated_cudnn as emu
import interpreted

import cudnorm
from cudnorm import _ada_kernel, _entry, _lru, _native, _policy, _runtime

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture
def resolve(monkeypatch):
    """``resolve(kind, x, ints, floats)`` -> the parsed recipe, on emulated plans."""
    ids = {}
    monkeypatch.setattr(_native, "plan_id", lambda plan: ids.setdefault(id(plan), len(ids) + 1))
    saved = emu.install()

    def run(kind, x, ints, floats=(0.0,)):
        out = _native.resolve(kind, x, list(ints), list(floats))
        cacheable, mode, dtype_code, fused, overlap, count, *launches = out
        kernel = launches[3 * count:]  # a KERNEL recipe's launch (recipes.cpp parses 7 ints)
        assert len(kernel) == (7 if mode == _native.KERNEL else 0)
        return {"cacheable": bool(cacheable), "mode": mode, "dtype": _native._DTYPES[dtype_code],
                "fused": bool(fused), "overlap": overlap,
                "launches": [tuple(launches[3 * k:3 * k + 3]) for k in range(count)], "kernel": tuple(kernel)}

    yield run
    emu.uninstall(saved)
    cudnorm.clear_cache()


def _code(dtype):
    return -1 if dtype is None else _native._CODES[dtype]


def _norm_forward(rms=False, training=True, add=False, weight=BF16, bias=BF16, offset=0.0):
    return [int(rms), int(training), int(add), _code(weight), _code(None if rms else bias)], [offset]


def test_an_exact_plan_is_one_launch(resolve):
    x = torch.randn(64, 256, dtype=BF16)
    recipe = resolve("norm_fwd", x, *_norm_forward())
    assert recipe["mode"] == _native.SINGLE and recipe["cacheable"] and recipe["dtype"] is BF16
    assert [launch[1:] for launch in recipe["launches"]] == [(0, 64)]


def test_fp32_weights_are_read_in_the_activation_dtype_unless_native(resolve):
    x = torch.randn(64, 256, dtype=BF16)
    assert resolve("norm_fwd", x, *_norm_forward(weight=torch.float32, bias=torch.float32))["dtype"] is BF16
    cudnorm.config(fp32_weight_fwd="native")
    assert resolve("norm_fwd", x, *_norm_forward(weight=torch.float32, bias=None))["dtype"] is torch.float32


def test_row_chunks_cover_every_row_and_the_remainder_runs_first(resolve):
    cudnorm.config(exact_rows=0)
    for phase, kind in (("train", "norm_fwd"), ("bwd", "norm_bwd")):
        x = torch.randn(5001, 256, dtype=BF16)
        ints, floats = _norm_forward() if kind == "norm_fwd" else ([0, _code(BF16)], [0.0])
        recipe = resolve(kind, x, ints, floats)
        assert recipe["mode"] == _native.CHUNKED and recipe["overlap"] > 0, (phase, recipe)
        covered = set()
        for _, start, rows in recipe["launches"]:
            covered |= set(range(start, start + rows))
        assert covered == set(range(5001))
        _, start, rows = recipe["launches"][0]
        assert start + rows == 5001  # the overlapping chunk ends at row M


def test_too_few_rows_for_a_chunk_run_pytorchs_kernels(resolve):
    cudnorm.config(exact_rows=0)
    x = torch.randn(7, 256, dtype=BF16)
    assert resolve("norm_fwd", x, *_norm_forward())["mode"] == _native.ATEN
    assert resolve("norm_bwd", x, [1, _code(BF16)], [0.0])["mode"] == _native.PYTHON  # the fp32 formula


def test_weight_offsets_cudnn_does_not_take_run_python(resolve):
    x = torch.randn(64, 256, dtype=BF16)
    assert resolve("norm_fwd", x, *_norm_forward(rms=True, offset=1.0))["mode"] == _native.SINGLE
    assert resolve("norm_fwd", x, *_norm_forward(rms=True, offset=0.5))["mode"] == _native.PYTHON
    assert resolve("norm_bwd", x, [1, _code(BF16)], [0.5])["mode"] == _native.PYTHON


def test_residual_add_is_fused_up_to_the_measured_width(resolve):
    narrow, wide = torch.randn(64, 256, dtype=BF16), torch.randn(64, 8192, dtype=BF16)
    assert resolve("norm_fwd", narrow, *_norm_forward(add=True))["fused"]
    recipe = resolve("norm_fwd", wide, *_norm_forward(add=True))  # LayerNorm fuses up to 4096 columns
    assert recipe["mode"] == _native.SINGLE and not recipe["fused"]


LAUNCH = (0x7F00, 256, 0, 4, 2)  # a compiled kernel's (function, threads, shared, chunks, scratch)


@pytest.mark.parametrize("batch, kernel, launch, backward", [
    (2, True, LAUNCH, _native.KERNEL),  # the fused kernel, launched by C++: one call for the batch
    (16, True, LAUNCH, _native.KERNEL),
    (16, True, None, _native.PYTHON),  # a compiled kernel C++ cannot launch plainly: Python launches it
    (16, False, LAUNCH, _native.PER_SAMPLE),  # no Triton: the per-sample LayerNorm backward graph
    (1, True, LAUNCH, _native.PER_SAMPLE)])  # one sample: one LayerNorm backward launch
def test_adaln_strategies_follow_the_rules(resolve, monkeypatch, batch, kernel, launch, backward):
    monkeypatch.setattr(_ada_kernel, "available", lambda x2, dtype: kernel)
    monkeypatch.setattr(_ada_kernel, "native_launch", lambda x2, b, dtype, dit: launch)
    x2 = torch.randn(batch * 256, 64, dtype=BF16)
    forward = resolve("ada_fwd", x2, [1, batch, _code(BF16), _code(BF16), 1], [])
    assert forward["mode"] == _native.SINGLE
    recipe = resolve("ada_bwd", x2, [batch, _code(BF16), 1], [])
    assert recipe["mode"] == backward
    assert recipe["kernel"] == ((*LAUNCH, 0, 0) if backward == _native.KERNEL else ())
    cudnorm.config(ada_forward="torch")
    assert resolve("ada_fwd", x2, [1, batch, _code(BF16), _code(BF16), 1], [])["mode"] == _native.PYTHON


NORM_LAUNCH = (0x7F00, 128, 0, 0, 2, 528, 4096)  # (function, threads, shared, 0, scratch, programs, tiles)


@pytest.mark.parametrize("launch", [NORM_LAUNCH, None])
def test_kernel_recipes_carry_the_compiled_launch(resolve, monkeypatch, launch):
    """A signature the dispatcher gave to cudnorm's kernel: C++ launches what Python compiled
    (kernel.cpp), or, where the compiled kernel is not a plain launch, Python launches it."""
    asked = []

    def native_launch(x, rms, training, weight_dtype, bias_dtype, backward=False):
        asked.append((tuple(x.shape), rms, training, weight_dtype, bias_dtype, backward))
        return launch

    monkeypatch.setattr(_native._norm_kernel, "native_launch", native_launch)
    x = torch.randn(1 << 14, 96, dtype=BF16)
    forward = resolve("kernel_fwd", x, [0, 1, _code(torch.float32), _code(BF16)], [])
    backward = resolve("kernel_bwd", x, [1, -1, -1], [])
    for recipe in (forward, backward):
        assert recipe["mode"] == (_native.KERNEL if launch else _native.PYTHON)
        assert recipe["kernel"] == (launch or ())
    assert asked == [((1 << 14, 96), False, True, torch.float32, BF16, False),
                     ((1 << 14, 96), True, True, None, None, True)]


@pytest.mark.parametrize("launch", [NORM_LAUNCH, None])
def test_per_token_recipes_carry_the_compiled_launches(resolve, monkeypatch, launch):
    """A norm modulated per token or per sample (kernel.cpp): the forward compiles the norm
    kernel modulated with the call's row strides, the per-token backward its kernel; a width the
    kernels do not take resolves to the formula's ops (ATEN), which the entry runs instead."""
    asked = []

    def norm_launch(x, rms, training, weight_dtype, bias_dtype, backward=False, per_token=None):
        asked.append(("fwd", tuple(x.shape), rms, training, weight_dtype, bias_dtype, per_token))
        return launch

    def token_launch(x, scale_dtype, rms, one_plus, stride):
        asked.append(("bwd", tuple(x.shape), scale_dtype, rms, one_plus, stride))
        return launch

    monkeypatch.setattr(_native._norm_kernel, "native_launch", norm_launch)
    monkeypatch.setattr(_native._token_ada, "native_launch", token_launch)
    monkeypatch.setattr(_native._norm_kernel, "available", lambda: True)  # Triton (none in CPU CI)
    x = torch.randn(4096, 96, dtype=BF16)
    forward = resolve("mod_fwd", x, [1, 1, 1, _code(torch.float32), -1, 288, 96], [])
    backward = resolve("token_bwd", x, [0, 1, _code(BF16), 288], [])
    for recipe in (forward, backward):
        assert recipe["mode"] == (_native.KERNEL if launch else _native.PYTHON)
        assert recipe["kernel"] == (launch or ())
    assert asked == [("fwd", (4096, 96), True, True, torch.float32, None, (True, 288, 96)),
                     ("bwd", (4096, 96), BF16, False, True, 288)]
    wide = torch.randn(8, _native._norm_kernel.MAX_COLS + 8, dtype=BF16)
    assert resolve("mod_fwd", wide, [0, 1, 1, _code(BF16), _code(BF16), wide.shape[1], wide.shape[1]],
                   [])["mode"] == _native.ATEN


def test_triton_launch_takes_only_plain_launches():
    """What C++ launches by handle: a 1-CTA, non-cooperative, non-PDL kernel without scratch
    memory whose non-constexpr parameters are the kinds C++ passes, in order."""
    from types import SimpleNamespace

    from cudnorm import _triton_launch

    def compiled(signature, function=0x7F00, **meta):
        info = SimpleNamespace(**{"num_warps": 4, "shared": 512, "num_ctas": 1, "global_scratch_size": 0, **meta})
        return SimpleNamespace(metadata=info, function=function,
                               src=SimpleNamespace(signature=dict(enumerate(signature))))

    kinds = ["*bf16", "*fp32", "constexpr", "i32", "fp32"]
    want = ["*", "*", "i32", "fp32"]
    assert _triton_launch.handle(compiled(kinds), want) == (0x7F00, 128, 512, 1)  # one scratch field: 1 null
    assert _triton_launch.handle(compiled(kinds), ["*", "*", "i32", "i32"]) is None  # an fp32 where C++ passes i32
    assert _triton_launch.handle(compiled(kinds[:-1]), want) is None  # a parameter short
    for meta in ({"num_ctas": 2}, {"launch_pdl": True}, {"launch_cooperative_grid": True},
                 {"global_scratch_size": 64}):
        assert _triton_launch.handle(compiled(kinds, **meta), want) is None, meta
    assert _triton_launch.handle(compiled(kinds, function=0), want) is None  # module not loaded


class _OnDevice(torch.Tensor):
    """A CPU tensor that says it is on CUDA device 0 (what :func:`_triton_launch.launch` reads)."""

    is_cuda = property(lambda self: True)

    def get_device(self):
        return 0


def _stand_in_kernel(signature: dict, compiles: list, launched: list):
    """A jitted kernel's stand-in: ``warmup`` returns a loaded compiled kernel of ``signature``
    (counted in ``compiles``), ``kernel[grid](...)`` (Triton's launcher) records in ``launched``."""
    from types import SimpleNamespace

    class Kernel:
        def warmup(self, *args, grid, **meta):
            compiles.append(meta)
            info = SimpleNamespace(num_warps=meta["num_warps"], shared=256, num_ctas=1)
            return SimpleNamespace(run=None, function=0x7F00, metadata=info, src=SimpleNamespace(signature=signature))

        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append(("triton", grid, args))

    return Kernel()


def test_python_launches_go_through_cpp_while_native_serves(monkeypatch):
    """A kernel Python launches goes to C++'s launch with its pointers, then its 32-bit
    scalars (an int of 1, compiled in, left out; a float as its fp32 bits), compiled once per
    specialisation (a misaligned pointer is another); Triton's launcher where the native path
    does not serve or the compiled parameters are not the kinds C++ passes."""
    import struct

    from cudnorm import _triton_launch

    launched, compiles, switched = [], [], []
    monkeypatch.setattr(_triton_launch, "native", lambda *args: launched.append(("cpp", *args)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    signature = {"x": "*bf16", "y": "*fp32", "rows": "i32", "seq": "constexpr", "eps": "fp32", "BLOCK": "constexpr"}
    kernel = _stand_in_kernel(signature, compiles, launched)
    x = torch.Tensor._make_subclass(_OnDevice, torch.zeros(64, dtype=BF16))
    y = torch.Tensor._make_subclass(_OnDevice, torch.zeros(64))
    meta = {"BLOCK": 64, "num_warps": 4}
    for rows in (100, 200):  # one compile: neither is 1 or a multiple of 16
        _triton_launch.launch(kernel, 7, (x, y, rows, 1, 1e-5), meta)
    eps_bits = struct.unpack("<i", struct.pack("<f", 1e-5))[0]
    assert len(compiles) == 1 and len(launched) == 2
    for (via, function, blocks, threads, shared, scratch, pointers, ints), rows in zip(launched, (100, 200)):
        assert (via, function, blocks, threads, shared, scratch) == ("cpp", 0x7F00, 7, 128, 256, 0)
        assert pointers[0] is x and pointers[1] is y and ints == (rows, eps_bits)
    _triton_launch.launch(kernel, 7, (x[1:], y, 100, 1, 1e-5), meta)  # 2 bytes off: another specialisation
    assert len(compiles) == 2
    launched.clear()
    monkeypatch.setattr(_triton_launch, "native", None)  # native="off"
    _triton_launch.launch(kernel, 7, (x, y, 100, 1, 1e-5), meta)
    assert [entry[:2] for entry in launched] == [("triton", (7,))]
    monkeypatch.setattr(_triton_launch, "native", lambda *args: launched.append(("cpp", *args)))
    launched.clear()
    odd = _stand_in_kernel({"x": "*bf16", "rows": "i64"}, compiles, launched)  # a 64-bit scalar
    for _ in range(2):
        _triton_launch.launch(odd, 3, (x, 5), meta)
    assert [entry[:2] for entry in launched] == [("triton", (3,))] * 2
    # tensors on another device than the current one: the launch switches to theirs first
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device", lambda device: switched.append(device) or contextlib.nullcontext())
    launched.clear()
    _triton_launch.launch(kernel, 7, (x, y, 100, 1, 1e-5), meta)
    assert len(switched) == 1 and [entry[0] for entry in launched] == ["cpp"]


def test_one_key_serves_the_grid_and_the_launch(monkeypatch):
    """A launch whose grid is sized by the compiled kernel (``loaded``) builds the lookup key once
    and hands it to both lookups: neither builds it again; a launch without it builds its own."""
    from cudnorm import _triton_launch

    launched, compiles = [], []
    monkeypatch.setattr(_triton_launch, "native", lambda *args: launched.append(("cpp", *args)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    kernel = _stand_in_kernel({"x": "*bf16", "rows": "i32"}, compiles, launched)
    x = torch.Tensor._make_subclass(_OnDevice, torch.zeros(64, dtype=BF16))
    args, meta = (x, 100), {"BLOCK": 64, "num_warps": 4}
    found_by = _triton_launch.key(kernel, args, meta)
    built, specialised = [], _triton_launch._specialised
    monkeypatch.setattr(_triton_launch, "_specialised", lambda value: built.append(value) or specialised(value))
    _triton_launch.loaded(kernel, args, meta, found_by)
    _triton_launch.launch(kernel, 5, args, meta, found_by)
    assert built == [] and [entry[:3] for entry in launched] == [("cpp", 0x7F00, 5)]
    _triton_launch.launch(kernel, 5, args, meta)
    assert len(built) == len(args) and len(launched) == 2


def test_kernel_fallbacks_match_pytorch():
    """What kernel.cpp asks Python for where it cannot launch the kernel: the kernel's own
    forward and backward (run under Triton's interpreter, in a child process)."""
    interpreted.run("test_native", "_check_kernel_fallbacks")


def _check_kernel_fallbacks():
    x = torch.randn(24, 40)
    w, b = 1 + 0.1 * torch.randn(40), 0.1 * torch.randn(40)
    dy = torch.randn(24, 40)
    for rms in (False, True):
        bias = None if rms else b
        y, stats = _native._kernel("kernel_fwd", [x.t().contiguous().t(), w, bias], [1e-5, 1.0, float(rms)])
        assert stats.shape == ((24,) if rms else (2, 24))  # RMSNorm's rstd [M], as C++'s buffers
        bias_code = -1.0 if rms else float(_native._CODES[b.dtype])
        dx, dw, db = _native._kernel("kernel_bwd", [dy, x, w, stats], [float(rms), bias_code])
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        bl = None if rms else b.clone().requires_grad_()
        want = F.rms_norm(xl, (40,), wl, 1e-5) if rms else F.layer_norm(xl, (40,), wl, bl, 1e-5)
        want.backward(dy)
        torch.testing.assert_close(y, want)
        torch.testing.assert_close(dx, xl.grad)
        torch.testing.assert_close(dw, wl.grad)
        assert db.numel() == 0 if rms else torch.allclose(db, bl.grad, atol=1e-5)
    # a norm modulated per token: scale [M, N] read in place (rows 3N apart), shift or none
    from cudnorm import _token_ada
    mod = 0.3 * torch.randn(24, 120)
    for rms, shift in ((False, mod[:, 40:80]), (True, None)):
        scale = mod[:, :40]
        y, stats = _native._kernel("mod_fwd", [x, scale, shift], [1e-5, 1.0, float(rms), 1.0, 1.0])
        assert stats.shape == ((24,) if rms else (2, 24))
        dx, dscale = _native._kernel("token_bwd", [dy, x, scale, stats], [1.0, float(rms)])
        leaves = [t.clone().requires_grad_() for t in (x, scale)]
        want = _token_ada.formula(*leaves, shift, 1e-5, rms, True)
        want.backward(dy)
        torch.testing.assert_close(y, want)
        torch.testing.assert_close(dx, leaves[0].grad)
        torch.testing.assert_close(dscale, leaves[1].grad)
    # the adaptive RMSNorm: [B, D] scale and shift, 8 rows a sample
    from cudnorm import _ada_rms
    scale, shift = mod[:3, :40], mod[:3, 40:80]
    y, rstd = _native._kernel("mod_fwd", [x, scale, shift], [1e-5, 1.0, 1.0, 1.0, 8.0])
    dx, dscale, dshift = _native._kernel("ada_rms_bwd", [dy, x, scale, rstd], [1.0, float(_native._CODES[F32])])
    leaves = [t.clone().requires_grad_() for t in (x, scale, shift)]
    want = _ada_rms.formula(leaves[0].view(3, 8, 40), *leaves[1:], 1e-5, True)
    want.backward(dy.view(3, 8, 40))
    torch.testing.assert_close(y, want.view(24, 40))
    for got, leaf in zip((dx, dscale, dshift), leaves):
        torch.testing.assert_close(got, leaf.grad)
    # the gated residual's backward: 3 samples of 8 rows, gradients at y and h
    from cudnorm import _gated
    residual, branch = x.view(3, 8, 40), torch.randn(3, 8, 40)
    gate, scale, shift = mod[:3, :40], mod[:3, 40:80], mod[:3, 80:]
    h = residual + gate[:, None] * branch
    stats = torch.zeros(2, 24)
    stats[0] = h.reshape(24, 40).mean(-1)
    stats[1] = torch.rsqrt(h.reshape(24, 40).var(-1, unbiased=False) + 1e-6)
    dh = torch.randn(3, 8, 40)
    dres, dbranch, sums = _native._kernel("gated_bwd", [dy.view(3, 8, 40), dh, h, branch, gate, scale, stats], [1.0])
    leaves = [t.clone().requires_grad_() for t in (residual, branch, gate, scale, shift)]
    want_y, want_h = _gated.formula(*leaves, 1e-6, True)
    torch.autograd.backward((want_y, want_h), (dy.view(3, 8, 40), dh))
    for got, leaf in zip((dres.view(3, 8, 40), dbranch.view(3, 8, 40), sums[2], sums[0], sums[1]), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-4, atol=1e-4)
    print("interpreted cases ok")


def test_fallbacks_take_the_arguments_cpp_passes():
    """cudnorm/csrc calls _kernel_py / _composite_py with these lists (norm.cpp, ada.cpp,
    entry.cpp, autograd.cpp): each must compute what the public function computes."""
    x, r = torch.randn(8, 64), torch.randn(8, 64)
    w, b = 1 + 0.1 * torch.randn(64), 0.1 * torch.randn(64)
    y, h, stats = _native._kernel("norm_fwd", [x, r, w, b], [1e-5, 1.0, 0.0, 0.0])
    torch.testing.assert_close(y, F.layer_norm(x + r, (64,), w, b))
    torch.testing.assert_close(h, x + r)
    y, _, rstd = _native._kernel("norm_fwd", [x, None, w, None], [1e-6, 1.0, 1.0, 0.0])
    dx, dw, db = _native._kernel("norm_bwd", [torch.ones_like(x), x, w, rstd], [1.0, 0.0])
    assert db.numel() == 0  # RMSNorm: a placeholder where the op has no output
    (y,) = _native._composite("layer_norm", [x, w, b], [1e-5], [64])
    torch.testing.assert_close(y, F.layer_norm(x, (64,), w, b))
    (y,) = _native._composite("rms_norm", [x, w], [0.0, 0.0, 1.0], [64])  # eps None, offset 1
    torch.testing.assert_close(y, F.rms_norm(x, (64,), None, torch.finfo(x.dtype).eps) * (w + 1))
    y, h = _native._composite("add_rms_norm", [x, r, w], [1.0, 1e-6, 0.0], [64])
    torch.testing.assert_close(y, F.rms_norm(x + r, (64,), w, 1e-6))
    xa, emb = torch.randn(2, 8, 64), 0.1 * torch.randn(2, 128)
    (y,) = _native._composite("ada_layer_norm", [xa, emb[:, 64:], emb[:, :64]], [1e-6, 1.0], [])
    torch.testing.assert_close(y, F.layer_norm(xa, (64,), eps=1e-6) * (1 + emb[:, None, 64:]) + emb[:, None, :64])


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("shift", [False, True])
def test_per_token_fallbacks_take_the_arguments_cpp_passes(rms, shift):
    """entry.cpp hands a call it does not serve to "token_ada_norm" (the Python path);
    autograd.cpp asks "token_ada_grad" for differentiable gradients under create_graph=True:
    PyTorch's own autograd of the formula, to first and second order."""
    from cudnorm import _token_ada

    x = torch.randn(2, 8, 64, dtype=torch.float64, requires_grad=True)
    scale = (0.3 * torch.randn(2, 8, 64, dtype=torch.float64)).requires_grad_()
    sh = (0.3 * torch.randn(2, 8, 64, dtype=torch.float64)).requires_grad_() if shift else None
    (y,) = _native._composite("token_ada_norm", [x, scale, sh], [1e-6, 1.0, float(rms)], [])
    want = _token_ada.formula(x, scale, sh, 1e-6, rms, True)
    torch.testing.assert_close(y, want)
    dy = torch.randn_like(x)
    code = float(_native._CODES[torch.float64]) if shift else -1.0
    dx, dscale, dshift = _native._composite("token_ada_grad", [dy.view(16, 64), x.view(16, 64), scale.view(16, 64)],
                                            [1e-6, float(rms), 1.0, code], [])
    inputs = [x, scale] + ([sh] if shift else [])
    grads = torch.autograd.grad(want, inputs, dy, create_graph=True)
    torch.testing.assert_close(dx.view_as(x), grads[0])
    torch.testing.assert_close(dscale.view_as(x), grads[1])
    assert dshift.numel() == 0 if not shift else torch.equal(dshift.view_as(x), grads[2])
    # second order: the gradients' own gradients agree
    mine = torch.autograd.grad((dx.square().sum() + dscale.square().sum()), [x, scale])
    theirs = torch.autograd.grad((grads[0].square().sum() + grads[1].square().sum()), [x, scale])
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.view_as(b), b)


@pytest.mark.parametrize("shift", [False, True])
def test_adaptive_rms_norm_gradients_for_create_graph(shift):
    """autograd.cpp's "ada_rms_grad" (create_graph=True on the adaptive RMSNorm's node): the
    formula's own autograd, to first and second order; its backward "ada_rms_bwd" recipe
    compiles the fused AdaLN backward for RMSNorm."""
    from cudnorm import _ada_rms

    x = torch.randn(3, 8, 64, dtype=torch.float64, requires_grad=True)
    scale = (0.3 * torch.randn(3, 64, dtype=torch.float64)).requires_grad_()
    sh = (0.3 * torch.randn(3, 64, dtype=torch.float64)).requires_grad_() if shift else None
    dy = torch.randn_like(x)
    code = float(_native._CODES[torch.float64]) if shift else -1.0
    dx, dscale, dshift = _native._composite("ada_rms_grad", [dy.view(24, 64), x.view(24, 64), scale],
                                            [1e-6, 1.0, 1.0, code], [])
    want = _ada_rms.formula(x, scale, sh, 1e-6, True)
    grads = torch.autograd.grad(want, [x, scale] + ([sh] if shift else []), dy, create_graph=True)
    torch.testing.assert_close(dx.view_as(x), grads[0])
    torch.testing.assert_close(dscale, grads[1])
    assert dshift.numel() == 0 if not shift else torch.allclose(dshift, grads[2])
    mine = torch.autograd.grad(dx.square().sum() + dscale.square().sum(), [x, scale])
    theirs = torch.autograd.grad(grads[0].square().sum() + grads[1].square().sum(), [x, scale])
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b)


def test_adaptive_rms_norm_backward_recipe(resolve, monkeypatch):
    asked = []
    monkeypatch.setattr(_ada_kernel, "available", lambda x2, dtype: True)
    monkeypatch.setattr(_ada_kernel, "native_launch",
                        lambda x2, b, dtype, one_plus, rms=False: asked.append((b, dtype, one_plus, rms)) or LAUNCH)
    recipe = resolve("ada_rms_bwd", torch.randn(4 * 256, 64, dtype=BF16), [4, _code(torch.float32), 1], [])
    assert recipe["mode"] == _native.KERNEL and recipe["kernel"] == (*LAUNCH, 0, 0)
    assert asked == [(4, torch.float32, True, True)]
    monkeypatch.setattr(_ada_kernel, "available", lambda x2, dtype: False)  # no Triton: Python's implementation
    assert resolve("ada_rms_bwd", torch.randn(4 * 256, 64, dtype=BF16), [4, _code(BF16), 0], [])["mode"] == \
        _native.PYTHON


@pytest.mark.parametrize("dy, dh", [(True, True), (True, False), (False, True)])
def test_gated_residual_gradients_for_create_graph(dy, dh):
    """autograd.cpp's "gated_grad" (create_graph=True on the gated residual's node): the formula's
    own autograd, to first and second order, with gradients reaching y, h or both."""
    from cudnorm import _gated

    f64 = torch.float64
    leaves = [torch.randn(2, 8, 64, dtype=f64), torch.randn(2, 8, 64, dtype=f64)] + \
        [0.3 * torch.randn(2, 64, dtype=f64) for _ in range(3)]
    leaves = [t.requires_grad_() for t in leaves]
    y, h = _gated.formula(*leaves, 1e-6, True)
    gy = torch.randn_like(y) if dy else None
    gh = torch.randn_like(h) if dh else None
    mine = _native._composite("gated_grad", [gy, gh, h, leaves[1], leaves[2], leaves[3]], [1e-6, 1.0], [])
    outputs, cotangents = zip(*[(o, c) for o, c in ((y, gy), (h, gh)) if c is not None])
    theirs = torch.autograd.grad(outputs, leaves, cotangents, create_graph=True, allow_unused=True)
    theirs = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(theirs, leaves)]  # h alone: no dscale
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b)
    def second_order(grads):
        return torch.autograd.grad(sum(g.square().sum() for g in grads), leaves[:4], retain_graph=True,
                                   allow_unused=True)

    for a, b in zip(second_order(mine), second_order(theirs)):
        assert (a is None) == (b is None) or (a if b is None else b).abs().max() == 0
        if a is not None and b is not None:
            torch.testing.assert_close(a, b)


def test_gated_residual_backward_recipe(resolve, monkeypatch):
    asked = []
    monkeypatch.setattr(_ada_kernel, "available", lambda x2, dtype: True)
    monkeypatch.setattr(_ada_kernel, "gated_native_launch",
                        lambda h2, b, dtype, one_plus, has_dh: asked.append((b, dtype, one_plus, has_dh)) or LAUNCH)
    h2 = torch.randn(4 * 256, 64, dtype=BF16)
    recipe = resolve("gated_bwd", h2, [4, 1, 1, _code(BF16)], [])
    assert recipe["mode"] == _native.KERNEL and recipe["kernel"] == (*LAUNCH, 0, 0)
    assert asked == [(4, BF16, True, True)]
    monkeypatch.setattr(_ada_kernel, "available", lambda x2, dtype: False)  # no Triton: Python's implementation
    assert resolve("gated_bwd", h2, [4, 0, 1, _code(BF16)], [])["mode"] == _native.PYTHON


def test_differentiable_gradients_for_create_graph():
    """What a native node returns under create_graph=True: gradients connected to the graph."""
    x = torch.randn(8, 64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(64)).requires_grad_()
    dy = torch.randn(8, 64)
    dx, dw, db = _native._composite("layer_norm_grad", [dy, x, w], [1e-5, 0.0], [])
    want_dx, want_dw = torch.autograd.grad(F.layer_norm(x, (64,), w, None, 1e-5), [x, w], dy, create_graph=True)
    torch.testing.assert_close(dx, want_dx)
    torch.testing.assert_close(dw, want_dw)
    assert dx.requires_grad and dw.requires_grad
    torch.testing.assert_close(db, dy.sum(0))


def test_build_directory_names_versions_and_sources(monkeypatch, tmp_path):
    cudnorm.config(native_dir=str(tmp_path))
    first = _native.build_directory()
    assert first.parent == tmp_path and torch.__version__.replace("+", "_") in first.name
    assert sys.implementation.cache_tag in first.name
    sources = tmp_path / "csrc"
    sources.mkdir()
    for path in (*_native._sources(), _native.CSRC / "native.h"):
        (sources / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(_native, "CSRC", sources)
    assert _native.build_directory() == first
    (sources / "plans.cpp").write_text((sources / "plans.cpp").read_text() + "\n// changed\n")
    assert _native.build_directory() != first


@pytest.fixture
def untried(monkeypatch):
    """The native path's state as in a fresh process, restored afterwards."""
    monkeypatch.setattr(_native, "_state", _native._State())
    monkeypatch.setattr(_entry, "pending", True)
    monkeypatch.setattr(_entry, "native", False)


def test_a_failed_build_warns_once_and_python_serves(untried, monkeypatch):
    monkeypatch.setattr(_runtime, "cudnn_status", lambda: _runtime.CudnnStatus(True, "ok"))

    def no_compiler(verbose=False):
        raise _native.Unavailable("no C++ compiler ('c++' not found)", "install g++")

    monkeypatch.setattr(_native, "build", no_compiler)
    with pytest.warns(RuntimeWarning, match=r"native launch path is not available \(no C\+\+ compiler.*Fix: "
                                            r"install g\+\+.*native='off'"):
        assert _native.activate() is False
    assert not _entry.pending and not _entry.native
    assert _native.activate() is False  # tried once: no second warning, no second build
    assert _native.status()["state"].startswith("no C++ compiler")
    x = torch.randn(4, 32)
    torch.testing.assert_close(cudnorm.layer_norm(x, 32), F.layer_norm(x, (32,)))


def test_native_off_is_never_tried(untried, monkeypatch):
    monkeypatch.setattr(_native, "build", lambda verbose=False: pytest.fail("built with native='off'"))
    cudnorm.config(native="off")
    assert _native.activate() is False and not _entry.pending
    assert _native.status()["state"] == "off (Config.native='off')"


def _library(directory):
    directory.mkdir(parents=True)
    (directory / f"{_native.LIBRARY_NAME}.so").write_bytes(b"")  # read by its name only: never loaded


def test_status_on_a_cpu_build_of_torch_says_it_cannot_be_built_here(untried, tmp_path, monkeypatch):
    """Issue 48: on a CPU build of torch ``cudnorm info`` says why there is no build (what
    ``cudnorm build`` answers), not "not built yet"."""
    monkeypatch.setattr(torch.version, "cuda", None)
    cudnorm.config(native_dir=str(tmp_path))
    why = "cannot be built here: this torch is not a CUDA build (install a CUDA build of torch)"
    assert _native.build_status() == (False, why) and cudnorm.info()["native_build"] == why


def test_status_says_whether_a_build_exists_for_these_versions(untried, tmp_path, monkeypatch):
    """Before the first CUDA call (a new process) the state reads the build cache alone:
    built here (where, for which versions), built only for other versions, or not built."""
    monkeypatch.setattr(_native, "build", lambda verbose=False: pytest.fail("status built the library"))
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build of torch, which can build it
    cudnorm.config(native_dir=str(tmp_path))
    versions = _native._versions()
    these = f"torch {versions['torch']}, cuDNN {versions['cudnn']}, frontend {versions['frontend']}"

    state = _native.status()["state"]
    assert state.startswith(f"not loaded yet: not built yet (none in {tmp_path})") and "builds it" in state

    _library(tmp_path / "torch2.0.0-cudnn8900-fe1.0.0-cpython-39-0123456789ab")
    state = _native.status()["state"]
    assert f"not built for {these}" in state and "torch2.0.0-cudnn8900-fe1.0.0-cpython-39-0123456789ab" in state
    assert "builds it" in state

    _library(_native.build_directory())
    assert _native.build_status() == (True, f"built for {these} in {_native.build_directory()}")
    assert _native.status()["state"] == (f"not loaded yet: built for {these} in {_native.build_directory()}; "
                                         "loads at the first CUDA call")
    assert cudnorm.info()["native_build"] == _native.build_status()[1]
    assert _entry.pending and not _entry.native  # nothing was loaded


def test_cpu_tensors_never_try_the_native_path(untried, monkeypatch):
    monkeypatch.setattr(_native, "build", lambda verbose=False: pytest.fail("a CPU call built the native path"))
    cudnorm.layer_norm(torch.randn(4, 32), (32,))
    assert _entry.pending


@pytest.mark.parametrize("module", [cudnorm.LayerNorm, cudnorm.RMSNorm])
def test_a_module_call_tries_the_native_path_first(untried, monkeypatch, module):
    """A model made of cudnorm's modules whose calls are all small (a decode step) must still
    switch the native path on: the modules hand small calls to PyTorch themselves on the
    Python path, so they try the native path before that (a decode step on an H100 ran the
    Python path's checks on every call, 0.95x)."""
    tried = []

    def try_native(input):  # as the real one on a machine without the native path: tried once
        tried.append(input)
        _entry.pending = False
        return False

    monkeypatch.setattr(_entry, "try_native", try_native)
    norm, x = module(32), torch.randn(2, 32)
    with cudnorm.config(policy="auto"):  # small calls: the modules' own hand-off to PyTorch
        norm(x)
        norm(x)
    assert len(tried) == 1 and tried[0] is x


class _Subclass(torch.Tensor):
    """A tensor subclass standing in for a DTensor: not a plain tensor, as the native entry needs."""


@pytest.mark.parametrize("call", ["layer_norm", "rms_norm", "ada_layer_norm"])
def test_tensor_subclasses_skip_the_native_entry(untried, monkeypatch, call):
    """On the native path a plain tensor goes to the C++ entry and a subclass (a DTensor)
    straight to the Python implementation, which the entry would hand it back to through the
    dispatcher: 52 against PyTorch's 35 us per DTensor RMSNorm forward (lent H100)."""
    entered = []
    monkeypatch.setattr(_entry, "native", True)
    monkeypatch.setattr(_entry, "pending", False)
    monkeypatch.setattr(_entry, call, lambda *args: entered.append(args[0]) or args[0])
    x = torch.randn(2, 4, 32)
    args = {"layer_norm": (32,), "rms_norm": (32,),
            "ada_layer_norm": (torch.randn(2, 32), torch.randn(2, 32))}[call]
    function = getattr(cudnorm, call)
    assert function(x, *args) is x and entered == [x]  # the (stubbed) C++ entry served the plain tensor
    sub = x.as_subclass(_Subclass)
    want = {"layer_norm": lambda: F.layer_norm(x, (32,)), "rms_norm": lambda: F.rms_norm(x, (32,)),
            "ada_layer_norm": lambda: F.layer_norm(x, (32,), eps=1e-6) * args[0][:, None] + args[1][:, None]}
    torch.testing.assert_close(function(sub, *args).as_subclass(torch.Tensor), want[call]())
    assert entered == [x]


def _gated_args():
    return [torch.randn(2, 4, 32), torch.randn(2, 4, 32)] + [torch.randn(2, 32) for _ in range(3)]


def test_gated_calls_go_to_the_native_entry_first(untried, monkeypatch):
    """On the native path cudnorm.gated_ada_layer_norm hands a plain tensor's call to C++ (its
    rules and decision: csrc/entry.cpp), takes the Python path where C++ answers None, and
    sends a subclass (a DTensor) straight to Python."""
    from cudnorm import _gated

    entered, answer = [], []
    monkeypatch.setattr(_entry, "native", True)
    monkeypatch.setattr(_entry, "pending", False)
    monkeypatch.setattr(_entry, "gated_ada_layer_norm", lambda *args: entered.append(args) or answer[0])
    args = _gated_args()
    answer.append((args[0], args[1]))  # served: C++'s (y, h) comes back as it is
    assert cudnorm.gated_ada_layer_norm(*args) == answer[0] and len(entered) == 1
    assert entered[0][5:] == (1e-6, True)  # the defaults reach the entry
    answer[0] = None  # not served: Python's path, the formula for a CPU training call
    args = [t.requires_grad_() for t in args]
    for got, want in zip(cudnorm.gated_ada_layer_norm(*args), _gated.formula(*args, 1e-6, True)):
        torch.testing.assert_close(got, want)
    sub = [t.as_subclass(_Subclass) for t in args]
    cudnorm.gated_ada_layer_norm(*sub)
    assert len(entered) == 2


def test_gated_entry_refusals_raise_cudnorms_error(untried, monkeypatch):
    """An argument the C++ entry cannot parse (it raises TypeError) gets cudnorm's error naming
    it; a refusal of valid arguments is re-raised as it is."""
    def refuse(*args):
        raise TypeError("cudnorm native entry: expected a tensor")

    monkeypatch.setattr(_entry, "native", True)
    monkeypatch.setattr(_entry, "pending", False)
    monkeypatch.setattr(_entry, "gated_ada_layer_norm", refuse)
    args = _gated_args()
    with pytest.raises(TypeError, match=r"cudnorm.gated_ada_layer_norm: argument 'gate'"):
        cudnorm.gated_ada_layer_norm(args[0], args[1], "gate", args[3], args[4])
    with pytest.raises(TypeError, match="cudnorm native entry"):
        cudnorm.gated_ada_layer_norm(*args)


def test_affine_modulated_calls_go_to_the_native_entry_first(untried, monkeypatch):
    """On the native path an affine LayerNorm's modulated call (CogVideoX's) goes to C++ first
    (csrc/entry.cpp) and takes the Python route where C++ answers None; a non-affine call and a
    subclass (a DTensor) do not ask it."""
    from cudnorm import _diffusers_forwards as forwards

    entered, answer = [], []
    monkeypatch.setattr(_entry, "native", True)
    monkeypatch.setattr(_entry, "pending", False)
    monkeypatch.setattr(_entry, "modulated_layer_norm", lambda *args: entered.append(args) or answer[0])
    x, scale, shift, w, b = torch.randn(2, 4, 32), torch.randn(2, 1, 32), torch.randn(2, 1, 32), torch.randn(32), None
    answer.append(x)
    assert forwards._modulated_layer_norm(x, scale, shift, 1e-5, w, b) is x
    assert len(entered) == 1 and entered[0][3:] == (1e-5, w, None)
    answer[0] = None  # not served: the Python route, its fold then one adaptive LayerNorm
    routed = []

    def ada(x, gain, shift, eps, one_plus_scale=False):
        routed.append(type(x))
        return F.layer_norm(x.as_subclass(torch.Tensor), (32,), eps=eps) * (gain + one_plus_scale) + shift

    monkeypatch.setattr(forwards, "ada_layer_norm", ada)
    want = F.layer_norm(x, (32,), w, None, 1e-5) * (1 + scale) + shift
    torch.testing.assert_close(forwards._modulated_layer_norm(x, scale, shift, 1e-5, w, b), want)
    forwards._modulated_layer_norm(x.as_subclass(_Subclass), scale, shift, 1e-5, w, b)
    forwards._modulated_layer_norm(x, scale, shift, 1e-5, None, None)  # not affine: cudnorm.ada_layer_norm's own
    assert len(entered) == 2 and routed == [torch.Tensor, _Subclass, torch.Tensor]


def test_the_ops_cpp_asks_decisions_for_are_candidates_ops():
    """decisions.cpp sends each MeasuredOp to cudnorm::_serve_py by name: every name must be an
    op of cudnorm._candidates (a misspelt one would fail only on a GPU, at its first call)."""
    import re

    from cudnorm import _candidates

    source = (Path(_native.__file__).parent / "csrc" / "decisions.cpp").read_text()
    names = re.findall(r'"(\w+)"', re.search(r"names\[\] = \{(.*?)\};", source, re.S).group(1))
    header = (Path(_native.__file__).parent / "csrc" / "native.h").read_text()
    ops = re.search(r"enum class MeasuredOp : int64_t \{(.*?)\};", header, re.S).group(1)
    assert len(names) == len(re.findall(r"= \d+", ops)) == 7
    sig = _candidates.Signature
    for name in names:
        assert _candidates.candidates_for(sig(name, True, torch.bfloat16, torch.bfloat16, torch.bfloat16, 1024, 14)), name


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch can build the native path")
def test_build_command_says_why_it_cannot_build_here():
    done = subprocess.run([sys.executable, "-m", "cudnorm.cli", "build"], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip() == ("cudnorm build: the native launch path cannot be built here: this torch is not "
                                   "a CUDA build. Fix: install a CUDA build of torch")


def test_serving_path_answers_for_the_path_the_call_would_take(untried, monkeypatch):
    """Before any call has switched the native path on, ``serving_path`` tries it as the call
    itself would, and names the native path's threshold: the notebooks, asked first, printed
    the Python path's 16777216 while their calls then ran with 65536."""
    def try_native(input):  # as on a GPU where the native path builds
        _entry.pending, _entry.native = False, True
        return True

    monkeypatch.setattr(_entry, "try_native", try_native)
    monkeypatch.setattr(_runtime, "route", lambda x: None)  # as for a CUDA tensor with cuDNN available
    with cudnorm.config(policy="auto"):
        path = cudnorm.serving_path("layer_norm", torch.randn(4, 32))
    assert path == f"torch (small call: policy 'auto', {_policy.NATIVE_CUDNN_MIN_ELEMENTS} elements or more run on cuDNN)"
    assert _entry.native


def test_a_configuration_set_again_keys_the_same_recipes():
    # C++ keys recipes and decisions by this number, so `with cudnorm.config(...)` blocks that
    # come and go find their recipes again instead of asking Python for every signature
    auto, torch_policy = _native.config_id(cudnorm.Config()), _native.config_id(cudnorm.Config(policy="torch"))
    assert auto != torch_policy
    assert _native.config_id(cudnorm.Config()) == auto
    assert _native.config_id(cudnorm.Config(autotune="on")) not in (auto, torch_policy)


def test_a_configuration_the_cache_let_go_gets_a_new_number(monkeypatch):
    # numbers are never reused: the recipes of a configuration that left are unreachable
    monkeypatch.setattr(_native, "_CONFIG_IDS", _lru.LRU("configs", 2, register=False))
    first = _native.config_id(cudnorm.Config(cache_size=10))
    second = _native.config_id(cudnorm.Config(cache_size=20))
    assert _native.config_id(cudnorm.Config(cache_size=20)) == second
    third = _native.config_id(cudnorm.Config(cache_size=30))  # evicts cache_size=10
    again = _native.config_id(cudnorm.Config(cache_size=10))
    assert len({first, second, third, again}) == 4
