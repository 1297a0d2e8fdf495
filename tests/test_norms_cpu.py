"""LayerNorm/RMSNorm on the PyTorch fallback path (CPU): numerics, autograd, modules,
torch.compile, opcheck and every argument error."""

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ln(x, w, b):
    return cudnorm.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def _ln_torch(x, w, b):
    cast = lambda p: None if p is None else p.to(x.dtype)  # noqa: E731
    return F.layer_norm(x, (x.shape[-1],), cast(w), cast(b), 1e-5)


def _rms(x, w):
    return cudnorm.rms_norm(x, (x.shape[-1],), w, 1e-6)


def _rms_torch(x, w):
    return F.rms_norm(x, (x.shape[-1],), None if w is None else w.to(x.dtype), 1e-6)


def _params(n, wdtype, affine):
    if not affine:
        return None, None
    return (1 + 0.1 * torch.randn(n)).to(wdtype), (0.1 * torch.randn(n)).to(wdtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", ["fp32", "same", "none"])
@pytest.mark.parametrize("shape", [(37, 256), (2, 5, 1000)])
def test_layer_norm_matches_reference(dtype, wdtype, shape):
    x = torch.randn(shape).to(dtype)
    w, b = _params(shape[-1], torch.float32 if wdtype == "fp32" else dtype, wdtype != "none")
    dy = torch.randn(shape).to(dtype)
    rows = ref.accuracy_report(_ln, _ln_torch, lambda x, w, b: ref.layer_norm(x, w, b, 1e-5),
                               (x, w, b), dy, ("y", "dx", "dweight", "dbias"), dtype)
    assert all(r["ok"] for r in rows), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", ["fp32", "same", "none"])
def test_rms_norm_matches_reference(dtype, wdtype):
    x = torch.randn(3, 7, 512).to(dtype)
    w = None if wdtype == "none" else (1 + 0.1 * torch.randn(512)).to(torch.float32 if wdtype == "fp32" else dtype)
    dy = torch.randn_like(x)
    rows = ref.accuracy_report(_rms, _rms_torch, lambda x, w: ref.rms_norm(x, w, 1e-6), (x, w), dy,
                               ("y", "dx", "dweight"), dtype)
    assert all(r["ok"] for r in rows), rows


def test_layer_norm_weight_without_bias_and_multi_dim_normalized_shape():
    x = torch.randn(4, 6, 8, 16)
    w = torch.randn(8, 16)
    y = cudnorm.layer_norm(x, (8, 16), w, None)
    torch.testing.assert_close(y, F.layer_norm(x, (8, 16), w, None))


def test_non_contiguous_input_gives_same_result():
    x = torch.randn(64, 32, dtype=torch.bfloat16).t()  # [32, 64] with stride (1, 32)
    w = torch.randn(64)
    torch.testing.assert_close(cudnorm.layer_norm(x, (64,), w), cudnorm.layer_norm(x.contiguous(), (64,), w))
    torch.testing.assert_close(cudnorm.rms_norm(x, (64,), w), cudnorm.rms_norm(x.contiguous(), (64,), w))


def test_rms_norm_default_eps_is_dtype_eps():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(cudnorm.rms_norm(x, (64,)), F.rms_norm(x, (64,)))


@pytest.mark.parametrize("rows", [8, 7])  # 7: the statistics rows are padded to 8 (16-byte aligned rstd)
def test_inference_phase_returns_no_stats_and_training_does(rows):
    x = torch.randn(rows, 64)
    _, stats = torch.ops.cudnorm.layer_norm_fwd(x, None, None, 1e-5, False)
    assert stats.numel() == 0
    _, stats = torch.ops.cudnorm.layer_norm_fwd(x, None, None, 1e-5, True)
    assert stats.shape == (2, 8)
    torch.testing.assert_close(stats[0, :rows], x.mean(-1))
    torch.testing.assert_close(stats[1, :rows], torch.rsqrt(x.var(-1, correction=0) + 1e-5))


def test_modules_are_drop_in_and_state_dict_compatible():
    for ours, theirs in [(cudnorm.LayerNorm(32), torch.nn.LayerNorm(32)),
                         (cudnorm.LayerNorm(32, bias=False), torch.nn.LayerNorm(32, bias=False)),
                         (cudnorm.RMSNorm(32), torch.nn.RMSNorm(32))]:
        with torch.no_grad():
            for p in theirs.parameters():
                p.normal_()
        ours.load_state_dict(theirs.state_dict())
        assert list(ours.state_dict()) == list(theirs.state_dict())
        x = torch.randn(3, 32)
        torch.testing.assert_close(ours(x), theirs(x))
        theirs.load_state_dict(ours.state_dict())


def test_modules_compile_fullgraph_and_train():
    model = torch.nn.Sequential(cudnorm.LayerNorm(16), torch.nn.Linear(16, 16), cudnorm.RMSNorm(16))
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(4, 16, requires_grad=True)
    compiled(x).square().sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for a, b in zip(eager, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("op, args", [
    (torch.ops.cudnorm.layer_norm_fwd.default, lambda: (torch.randn(8, 64, requires_grad=True),
                                                        torch.randn(64, requires_grad=True), torch.randn(64), 1e-5, True)),
    (torch.ops.cudnorm.layer_norm_fwd.default, lambda: (torch.randn(8, 64), None, None, 1e-5, False)),
    (torch.ops.cudnorm.rms_norm_fwd.default, lambda: (torch.randn(8, 64, requires_grad=True),
                                                      torch.randn(64, requires_grad=True), 1e-6, True)),
    (torch.ops.cudnorm.layer_norm_bwd.default, lambda: (torch.randn(8, 64), torch.randn(8, 64), None,
                                                        torch.rand(2, 8))),
    (torch.ops.cudnorm.layer_norm_bwd.default, lambda: (torch.randn(8, 64), torch.randn(8, 64),
                                                        torch.randn(64, dtype=torch.bfloat16), torch.rand(2, 8))),
    (torch.ops.cudnorm.rms_norm_bwd.default, lambda: (torch.randn(8, 64), torch.randn(8, 64), torch.randn(64),
                                                      torch.rand(8))),
    (torch.ops.cudnorm.rms_norm_fwd.default, lambda: (torch.randn(8, 64, requires_grad=True),
                                                      torch.randn(64, requires_grad=True), 1e-6, True, 1.0)),
    (torch.ops.cudnorm.rms_norm_bwd.default, lambda: (torch.randn(8, 64), torch.randn(8, 64), torch.randn(64),
                                                      torch.rand(8), 1.0)),
])
def test_opcheck(op, args):
    torch.library.opcheck(op, args())


@pytest.mark.parametrize("policy", ["cudnn", "auto"])  # cudnorm's own path (PyTorch's kernels here); the formula
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_weight_offset(policy, dtype, with_weight):
    """``weight_offset=c`` scales by ``weight + c`` in fp32 (Gemma: c = 1), forward and
    backward, within the 2x rule against the same formula in PyTorch's ops."""
    x = torch.randn(2, 16, 96).to(dtype)
    w = (0.3 * torch.randn(96)).to(dtype) if with_weight else None
    with cudnorm.config(policy=policy):
        rows = ref.accuracy_report(
            lambda x, *w: cudnorm.rms_norm(x, (96,), w[0] if w else None, 1e-6, weight_offset=1.0),
            lambda x, *w: (F.rms_norm(x.float(), (96,), None, 1e-6) * ((w[0].float() if w else 1.0) + 1.0)).to(x.dtype),
            lambda x, *w: ref.rms_norm(x, (w[0] if w else torch.zeros(96, dtype=x.dtype)) + 1.0, 1e-6),
            (x, w) if with_weight else (x,), torch.randn_like(x), ("y", "dx", "dw") if with_weight else ("y", "dx"), dtype)
    assert all(r["ok"] for r in rows), rows
    with pytest.raises(TypeError, match="rms_norm: argument 'weight_offset'"):
        cudnorm.rms_norm(x, (96,), w, weight_offset="1")
    with pytest.raises(ValueError, match="'weight_offset' must be finite"):
        cudnorm.rms_norm(x, (96,), w, weight_offset=float("nan"))


@pytest.mark.parametrize("call, exc, words", [
    (lambda: cudnorm.layer_norm([1.0], (1,)), TypeError, "layer_norm: argument 'input'"),
    (lambda: cudnorm.layer_norm(torch.ones(2, 4, dtype=torch.int64), (4,)), TypeError, "'input' has dtype"),
    (lambda: cudnorm.layer_norm(torch.randn(2, 4).int(), (4,)), TypeError, "'input' has dtype"),
    (lambda: cudnorm.layer_norm(torch.randn(2, 4), (5,)), ValueError, "'normalized_shape'"),
    (lambda: cudnorm.layer_norm(torch.randn(2, 4), ()), ValueError, "'normalized_shape'"),
    (lambda: cudnorm.layer_norm(torch.randn(2, 4), "4"), TypeError, "'normalized_shape'"),
    (lambda: cudnorm.layer_norm(torch.randn(2, 4), (4,), torch.randn(5)), ValueError, "'weight' has shape"),
    (lambda: cudnorm.layer_norm(torch.randn(2, 4), (4,), None, torch.randn(3)), ValueError, "'bias' has shape"),
    (lambda: cudnorm.layer_norm(torch.randn(2, 4, dtype=torch.bfloat16), (4,), torch.randn(4, dtype=torch.float16)),
     TypeError, "'weight' has dtype"),
    (lambda: cudnorm.layer_norm(torch.randn(2, 4), (4,), eps=-1e-5), ValueError, "'eps' must be finite and >= 0"),
    (lambda: cudnorm.layer_norm(torch.randn(2, 4), (4,), eps=float("nan")), ValueError, "'eps'"),
    (lambda: cudnorm.layer_norm(torch.randn(2, 4), (4,), eps=float("inf")), ValueError, "'eps'"),
    (lambda: cudnorm.layer_norm(torch.randn(2, 4), (4,), eps="1e-5"), TypeError, "'eps' must be a float"),
    (lambda: cudnorm.rms_norm(torch.randn(2, 4), (4,), torch.randn(4, device="meta")), ValueError, "'weight' is on meta"),
    (lambda: cudnorm.rms_norm(torch.randn(2, 4), (3,)), ValueError, "rms_norm: argument 'normalized_shape'"),
    (lambda: cudnorm.rms_norm(torch.randn(2, 4), (4,), eps=-1.0), ValueError, "rms_norm: argument 'eps'"),
    (lambda: cudnorm.serving_path("group_norm"), ValueError, "argument 'op'"),
])
def test_errors_name_op_and_argument(call, exc, words):
    with pytest.raises(exc, match=words.replace("(", r"\(")):
        call()


def test_backward_through_inference_forward_is_refused():
    x = torch.randn(4, 8, requires_grad=True)
    y, stats = torch.ops.cudnorm.layer_norm_fwd(x, None, None, 1e-5, False)
    with pytest.raises(RuntimeError, match="inference-phase forward"):
        y.sum().backward()


def test_serving_path_and_info_on_cpu():
    assert cudnorm.serving_path("layer_norm", torch.randn(2, 2)) == "torch (cpu tensor)"
    info = cudnorm.info()
    assert info["cudnorm"] == cudnorm.__version__
    assert set(info["paths"]) >= {"layer_norm", "rms_norm"}
    if not torch.cuda.is_available():
        assert info["plan_launch"] == "none (cuDNN not available)"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_weights_are_rounded_in_forward_only(dtype):
    """The documented consequence of the fast fp32-weight forward: y is exactly what the
    weights rounded to the input dtype give; gradients stay fp32 and unrounded."""
    x = torch.randn(16, 128).to(dtype).requires_grad_(True)
    w32 = (1 + 0.01 * torch.randn(128)).requires_grad_(True)
    b32 = (0.01 * torch.randn(128)).requires_grad_(True)
    y = cudnorm.layer_norm(x, (128,), w32, b32)
    assert torch.equal(y, cudnorm.layer_norm(x, (128,), w32.to(dtype), b32.to(dtype)))
    assert torch.equal(cudnorm.rms_norm(x, (128,), w32), cudnorm.rms_norm(x, (128,), w32.to(dtype)))
    y.float().square().sum().backward()
    assert w32.grad.dtype == torch.float32 and b32.grad.dtype == torch.float32
    cudnorm.config(fp32_weight_fwd="native")
    assert not torch.equal(cudnorm.layer_norm(x, (128,), w32, b32), y), "native mode does not round"


# -- the CPU fallback with fp32 weights and half-precision input: PyTorch's kernels and cost --
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_fallback_with_fp32_weights_is_pytorchs_kernel(dtype):
    """With fp32 weights the fallback computes exactly what PyTorch's own op computes with
    the weights rounded to x's dtype (its one-rounding fp32 kernel), at a shape where fp32
    copies of x computed in another order differ in the last bit."""
    x = (2 * torch.randn(300, 1000) + 0.5).to(dtype)
    w, b = 1 + 0.1 * torch.randn(1000), 0.1 * torch.randn(1000)
    with torch.enable_grad():
        y = cudnorm.layer_norm(x.requires_grad_(True), (1000,), w.requires_grad_(True), b)
    assert torch.equal(y, F.layer_norm(x.detach(), (1000,), w.detach().to(dtype), b.to(dtype)))
    assert torch.equal(cudnorm.rms_norm(x.detach(), (1000,), w.detach(), 1e-6),
                       F.rms_norm(x.detach(), (1000,), w.detach().to(dtype), 1e-6))


def test_cpu_fallback_makes_no_fp32_copy_of_the_activations(largest_fp32_tensor):
    """The cost of the fallback: no fp32 tensor of x's size in the LayerNorm forward or
    backward (the backward's fp32 dW/dB sums read x in blocks), so it costs PyTorch's time."""
    rows, n = 1024, 512
    x = torch.randn(rows, n, dtype=torch.bfloat16, requires_grad=True)
    w, b = torch.randn(n, requires_grad=True), torch.randn(n, requires_grad=True)
    y = cudnorm.layer_norm(x, (n,), w, b)
    assert largest_fp32_tensor(lambda: cudnorm.layer_norm(x, (n,), w, b)) < rows * n
    assert largest_fp32_tensor(lambda: y.backward(torch.randn_like(y))) < rows * n


def test_cpu_fallback_weight_gradients_are_fp32_sums():
    """dW/dB of fp32 weights with bf16 x are fp32-accurate over many rows (PyTorch's CPU
    kernel sums them in bf16: percent-level errors here)."""
    x = torch.randn(4096, 256, dtype=torch.bfloat16).requires_grad_(True)
    w, b = torch.randn(256, requires_grad=True), torch.randn(256, requires_grad=True)
    dy = torch.randn(4096, 256, dtype=torch.bfloat16)
    cudnorm.layer_norm(x, (256,), w, b).backward(dy)
    xd, dyd = x.detach().double(), dy.double()
    xhat = (xd - xd.mean(1, keepdim=True)) * torch.rsqrt(xd.var(1, unbiased=False, keepdim=True) + 1e-5)
    for got, want in ((w.grad, (dyd * xhat).sum(0)), (b.grad, dyd.sum(0))):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_issue_48_compiled_call_raises_the_eager_value_error(fullgraph, dynamic):
    """Issue 48's call, on Inductor, with static and dynamic shapes (the message's sizes are
    formatted so that a symbolic size still gives a constant message)."""
    torch._dynamo.reset()
    for fn, op in ((lambda x: cudnorm.layer_norm(x, (5,)), "layer_norm"), (lambda x: cudnorm.rms_norm(x, (5,)), "rms_norm"),
                   (lambda x: cudnorm.ada_layer_norm(x.view(4, 2, 8), torch.zeros(4, 5), torch.zeros(4, 5)),
                    "ada_layer_norm")):
        compiled = torch.compile(fn, fullgraph=fullgraph, dynamic=dynamic)
        arg = "normalized_shape" if op != "ada_layer_norm" else "scale"
        with pytest.raises(ValueError, match=rf"^cudnorm\.{op}: argument '{arg}' .* input of shape \((4, 16|4, 2, 8)\)"):
            compiled(torch.randn(4, 16))


@pytest.mark.slow
@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("cls, op", [(cudnorm.LayerNorm, "layer_norm"), (cudnorm.RMSNorm, "rms_norm")])
def test_compiled_module_raises_the_eager_value_error(cls, op, fullgraph):
    """The modules' mistakes under torch.compile raise what they raise eagerly (issue 48)."""
    torch._dynamo.reset()
    module = cls(5)
    with pytest.raises(ValueError, match=rf"^cudnorm\.{op}: argument 'normalized_shape' .* input of shape \(4, 16\)"):
        module(torch.randn(4, 16))
    with pytest.raises(ValueError, match=rf"^cudnorm\.{op}: argument 'normalized_shape' .* input of shape \(4, 16\)"):
        torch.compile(module, backend="aot_eager", fullgraph=fullgraph)(torch.randn(4, 16))
