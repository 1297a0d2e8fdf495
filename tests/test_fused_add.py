"""LayerNorm/RMSNorm with a fused residual add (``residual=``, ``FusedAdd*`` modules): numerics
against fp64 within the 2x-PyTorch rule, gradients of both summands, outputs used alone,
custom ops (opcheck, compile), modules and argument errors. CPU: PyTorch's kernels behind
cudnorm's implementation (``policy="cudnn"`` sends every call through it)."""

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _fused_add
from cudnorm import reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _both(fn):
    """One tensor out of ``(y, h)``, so one upstream gradient reaches both outputs."""
    return lambda *args: torch.cat(fn(*args), dim=-1)


def _cudnorm(rms, offset=0.0):
    if rms:
        return lambda x, r, w: cudnorm.rms_norm(x, (x.shape[-1],), w, 1e-6, residual=r, weight_offset=offset)
    return lambda x, r, w, b: cudnorm.layer_norm(x, (x.shape[-1],), w, b, 1e-5, residual=r)


def _torch(rms, offset=0.0):
    """What model code writes, in the input's dtype (the 2x rule's baseline)."""
    def rms_fn(x, r, w):
        h = x + r
        scale = None if w is None else (w.float() + offset).to(x.dtype)
        return F.rms_norm(h, (x.shape[-1],), scale, 1e-6), h

    def ln_fn(x, r, w, b):
        h = x + r
        cast = lambda p: None if p is None else p.to(x.dtype)  # noqa: E731
        return F.layer_norm(h, (x.shape[-1],), cast(w), cast(b), 1e-5), h

    return rms_fn if rms else ln_fn


def _reference(rms, offset=0.0):
    if rms:
        return lambda x, r, w: (ref.rms_norm(x + r, None if w is None else w + offset, 1e-6), x + r)
    return lambda x, r, w, b: (ref.layer_norm(x + r, w, b, 1e-5), x + r)


@pytest.mark.parametrize("policy", ["cudnn", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wkind", ["fp32", "same", "none"])
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_matches_reference(rms, wkind, dtype, policy):
    n = 384
    x, r, dy = (torch.randn(3, 5, n).to(dtype) for _ in range(3))
    wdtype = torch.float32 if wkind == "fp32" else dtype
    params = () if wkind == "none" else ((1 + 0.1 * torch.randn(n)).to(wdtype),)
    if not rms:
        params = (params[0], (0.1 * torch.randn(n)).to(wdtype)) if params else (None, None)
    elif not params:
        params = (None,)
    names = ("y", "dx", "dresidual", "dweight", "dbias")[:2 + len(params) + 1]
    with cudnorm.config(policy=policy):
        rows = ref.accuracy_report(_both(_cudnorm(rms)), _both(_torch(rms)), _both(_reference(rms)), (x, r, *params),
                                   torch.cat([dy, torch.randn_like(dy)], dim=-1), names, dtype)
    assert all(row["ok"] for row in rows), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_offset_with_residual(dtype):
    n = 256
    x, r = torch.randn(7, n).to(dtype), torch.randn(7, n).to(dtype)
    w = (0.3 * torch.randn(n)).to(dtype)
    with cudnorm.config(policy="cudnn"):
        rows = ref.accuracy_report(_both(_cudnorm(True, 1.0)), _both(_torch(True, 1.0)),
                                   _both(_reference(True, 1.0)), (x, r, w),
                                   torch.randn(7, 2 * n).to(dtype), ("y", "dx", "dresidual", "dweight"), dtype)
    assert all(row["ok"] for row in rows), rows


@pytest.mark.parametrize("use", ["y", "h"])
def test_one_output_used(use):
    """Only ``y`` (the residual stream dropped) or only ``h`` (the norm unused) reaches the loss:
    the gradients are those of that output alone."""
    x, r = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    with cudnorm.config(policy="cudnn"):
        y, h = cudnorm.rms_norm(x, 64, w, 1e-6, residual=r)
    ((y if use == "y" else h) * torch.arange(64.0)).sum().backward()
    got = (x.grad, r.grad, w.grad)
    x2, r2, w2 = (t.detach().clone().requires_grad_() for t in (x, r, w))
    h2 = x2 + r2
    y2 = F.rms_norm(h2, (64,), w2, 1e-6)
    ((y2 if use == "y" else h2) * torch.arange(64.0)).sum().backward()
    torch.testing.assert_close(got[0], x2.grad)
    torch.testing.assert_close(got[1], r2.grad)
    if use == "y":
        torch.testing.assert_close(got[2], w2.grad)
    else:
        assert got[2] is None or not got[2].any()


def test_double_backward_matches_pytorch():
    x, r = torch.randn(6, 32, requires_grad=True), torch.randn(6, 32, requires_grad=True)
    w, b = torch.randn(32, requires_grad=True), torch.randn(32, requires_grad=True)

    def penalty(fn):
        y, h = fn(x, r, w, b)
        g = torch.autograd.grad((y * y).sum() + (h * y).sum(), (x, w), create_graph=True)
        return torch.autograd.grad(sum((t * t).sum() for t in g), (x, r, w))

    with cudnorm.config(policy="cudnn"):
        got = penalty(_cudnorm(False))
    want = penalty(_torch(False))
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-5)


def test_gradcheck_float64():
    x, r = torch.randn(3, 8, dtype=torch.float64, requires_grad=True), torch.randn(3, 8, dtype=torch.float64,
                                                                                   requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, r, w: cudnorm.rms_norm(x, 8, w, 1e-6, residual=r), (x, r, w))


@pytest.mark.parametrize("case", ["rms_train", "ln_infer", "rms_offset"])
def test_opcheck(case):
    x, r = torch.randn(5, 48), torch.randn(5, 48)
    w, b = torch.randn(48, requires_grad=True), torch.randn(48, requires_grad=True)
    x.requires_grad_()
    args = {"rms_train": (x, r, w, None, 1e-6, True, True, 0.0),
            "ln_infer": (x.detach(), r, w.detach(), b.detach(), 1e-5, False, False, 0.0),
            "rms_offset": (x, r, w, None, 1e-6, True, True, 1.0)}[case]
    torch.library.opcheck(_fused_add.add_norm_fwd, args)
    y, h, stats = _fused_add.add_norm_fwd(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    if case != "ln_infer":
        torch.library.opcheck(_fused_add.add_norm_bwd, (torch.randn_like(y), torch.randn_like(h), h, w.detach(),
                                                        stats, True, args[-1]))


def test_compiled_fullgraph_through_the_custom_op():
    x, r = torch.randn(8, 128, requires_grad=True), torch.randn(8, 128, requires_grad=True)
    norm = cudnorm.FusedAddRMSNorm(128, eps=1e-6)

    def block(x, r):
        y, h = norm(x, r)
        return (y.square() + h).sum()

    with cudnorm.config(policy="cudnn"):
        torch._dynamo.reset()
        loss = torch.compile(block, fullgraph=True, backend="aot_eager")(x, r)
        loss.backward()
    x2, r2 = (t.detach().clone().requires_grad_() for t in (x, r))
    h2 = x2 + r2
    want = (F.rms_norm(h2, (128,), norm.weight.detach(), 1e-6).square() + h2).sum()
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(r.grad, r2.grad)


@pytest.mark.parametrize("cls, base", [(cudnorm.FusedAddRMSNorm, torch.nn.RMSNorm),
                                       (cudnorm.FusedAddLayerNorm, torch.nn.LayerNorm)])
def test_modules_keep_pytorch_state_dicts(cls, base):
    theirs = base(96, eps=1e-6)
    with torch.no_grad():
        theirs.weight.normal_()
    mine = cls(96, eps=1e-6)
    mine.load_state_dict(theirs.state_dict(), strict=True)
    x, r = torch.randn(2, 3, 96), torch.randn(2, 3, 96)
    y, h = mine(x, r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, theirs(x + r), rtol=1e-5, atol=1e-5)


def test_inference_returns_without_grad():
    with torch.no_grad():
        y, h = cudnorm.layer_norm(torch.randn(4, 32), 32, residual=torch.randn(4, 32))
    assert not y.requires_grad and not h.requires_grad and y.shape == h.shape == (4, 32)


@pytest.mark.parametrize("residual, exc, text", [
    ([1.0], TypeError, "argument 'residual' must be a torch.Tensor"),
    (torch.randn(4, 31), ValueError, "argument 'residual' has shape (4, 31) but input has shape (4, 32)"),
    (torch.randn(4, 32, dtype=torch.float16), TypeError, "argument 'residual' has dtype torch.float16 but input has dtype torch.float32"),
    (torch.randn(4, 32, device="meta"), ValueError, "argument 'residual' is on meta but input is on cpu"),
])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_bad_residual_is_named(op, residual, exc, text):
    fn = getattr(cudnorm, op)
    with pytest.raises(exc, match=f"cudnorm.{op}: " + text.replace("(", r"\(").replace(")", r"\)")):
        fn(torch.randn(4, 32), 32, residual=residual)
