"""Mixed dtypes: every combination of input and weight dtypes of ``layer_norm``, ``rms_norm``
and ``ada_layer_norm`` (weight only, bias only, both; with and without ``requires_grad``;
fp32 weights on half-precision input and half-precision weights on fp32 input), under each
policy, finishes its forward and backward or raises cudnorm's error naming the function and
the argument: never PyTorch's ``RuntimeError`` from inside a backward.

Where PyTorch's own op finishes the forward and the backward for a combination, a CPU call
under the default policy runs that op (PyTorch's autograd node, PyTorch's result); where it does
not (LayerNorm's fp32 bias without a weight fails in ATen's CPU backward; one fp32 and one
half-precision weight fail in its forward), cudnorm's own fp32 path serves the call
(:func:`cudnorm._policy._mixed_off_cuda`). Every result is held to the fp64 reference by the
2x-PyTorch-error rule. The ``gpu`` cases run the same table on CUDA."""

import functools
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import reference as ref

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
N, EPS = 48, 1e-5
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
POLICIES = ["auto", "torch", "cudnn"]
# which tensors require grad: input, the weights, both, none (an inference call)
GRADS = {"x": (True, False), "weights": (False, True), "both": (True, True), "none": (False, False)}
# the autograd nodes of cudnorm's own path (eager autograd.Functions)
_CUDNORM_NODES = ("_LayerNormFunctionBackward", "_RMSNormFunctionBackward", "_AdaLayerNormFunctionBackward",
                  "_FusedAddNormBackward")


def _weight_dtypes(x_dtype):
    """A weight may be absent, of x's dtype or fp32; with fp32 x also bf16 (which layer_norm
    refuses, naming the argument, as PyTorch's op fails on it; rms_norm and ada_layer_norm
    promote, rms_norm through PyTorch's op)."""
    return (None, x_dtype, F32) if x_dtype is not F32 else (None, F32, BF16)


# (op, x dtype, weight dtypes): LayerNorm's (weight, bias), RMSNorm's (weight,), AdaLN's
# (scale, shift), which are never absent
CASES = ([("layer_norm", xd, wd) for xd in (BF16, F16, F32) for wd in itertools.product(_weight_dtypes(xd), repeat=2)]
         + [("rms_norm", xd, (w,)) for xd in (BF16, F16, F32) for w in _weight_dtypes(xd)]
         + [("ada_layer_norm", xd, wd) for xd in (BF16, F16, F32)
            for wd in itertools.product(_weight_dtypes(xd)[1:], repeat=2)])
_NAMES = {"layer_norm": ("weight", "bias"), "rms_norm": ("weight",), "ada_layer_norm": ("scale", "shift")}


def _case_id(case):
    op, xd, wd = case
    short = {None: "none", BF16: "bf16", F16: "fp16", F32: "fp32"}
    return f"{op}-x{short[xd]}-" + "-".join(f"{name}{short[d]}" for name, d in zip(_NAMES[op], wd))


def _cudnorm_op(op):
    return {"layer_norm": lambda x, w, b: cudnorm.layer_norm(x, (N,), w, b, EPS),
            "rms_norm": lambda x, w: cudnorm.rms_norm(x, N, w, EPS),
            "ada_layer_norm": lambda x, sc, sh: cudnorm.ada_layer_norm(x, sc, sh, EPS, one_plus_scale=True)}[op]


def _torch_op(op):
    """PyTorch's own op, which takes the call's dtypes as they are (or raises)."""
    return {"layer_norm": lambda x, w, b: F.layer_norm(x, (N,), w, b, EPS),
            "rms_norm": lambda x, w: F.rms_norm(x, (N,), w, EPS),
            "ada_layer_norm": lambda x, sc, sh: ref.ada_layer_norm_eager(x, sc, sh, EPS, True)}[op]


def _baseline_op(op):
    """PyTorch in x's dtype (weights rounded to it): the baseline of the 2x error rule."""
    theirs = _torch_op(op)
    return lambda x, *ws: theirs(x, *(None if w is None else w.to(x.dtype) for w in ws))


def _ref_op(op):
    return {"layer_norm": lambda x, w, b: ref.layer_norm(x, w, b, EPS),
            "rms_norm": lambda x, w: ref.rms_norm(x, w, EPS),
            "ada_layer_norm": lambda x, sc, sh: ref.ada_layer_norm(x, sc, sh, EPS, dit=True)}[op]


def _inputs(op, x_dtype, weight_dtypes, device, grads):
    g = torch.Generator().manual_seed(0)
    x_grad, w_grad = GRADS[grads]
    if op == "ada_layer_norm":
        x = torch.randn(2, 5, N, generator=g)
        weights = [0.1 * torch.randn(2, N, generator=g) for _ in weight_dtypes]
    else:
        x = torch.randn(6, N, generator=g)
        weights = [1 + 0.1 * torch.randn(N, generator=g), 0.1 * torch.randn(N, generator=g)][:len(weight_dtypes)]
    dy = torch.randn(x.shape, generator=g).to(x_dtype).to(device)
    x = x.to(x_dtype).to(device).requires_grad_(x_grad)
    weights = [None if d is None else w.to(d).to(device).requires_grad_(w_grad) for w, d in zip(weights, weight_dtypes)]
    return x, weights, dy


def _run(fn, x, weights, dy):
    """``(y, grads)``: ``grads`` of every tensor that requires grad (``None`` for the others)."""
    tensors = [x, *weights]
    y = fn(*tensors)
    wanted = [t for t in tensors if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(y, wanted, dy) if wanted else ())
    return y, [next(got) if t is not None and t.requires_grad else None for t in tensors]


def _detached(x, weights):
    """Fresh leaves of the call's tensors, each requiring grad as it did."""
    return [t if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in (x, *weights)]


@functools.cache
def _torch_finishes(op, x_dtype, weight_dtypes, device):
    """Whether PyTorch's own op runs the forward and the backward of this dtype combination
    (every tensor requiring grad)."""
    x, weights, dy = _inputs(op, x_dtype, weight_dtypes, device, "both")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # F.rms_norm's warning that it cannot fuse mixed dtypes
            _run(_torch_op(op), x, weights, dy)
    except RuntimeError:
        return False
    return True


def _promoted(op, x_dtype, weight_dtypes):
    """A weight of a dtype cudnorm's kernels do not take, which PyTorch's RMSNorm promotes (a
    patched model that upcasts its activations for the norm must compute what it did)."""
    return op == "rms_norm" and any(d not in (None, x_dtype, F32) for d in weight_dtypes)


def _refused(op, x_dtype, weight_dtypes):
    """The argument cudnorm's layer_norm refuses (documented: a weight is fp32 or x's dtype;
    PyTorch's op fails too), or None."""
    if op != "layer_norm":
        return None
    return next((name for name, d in zip(_NAMES[op], weight_dtypes) if d not in (None, x_dtype, F32)), None)


def _check(op, x_dtype, weight_dtypes, device, grads, policy):
    cudnorm.config(policy=policy)
    x, weights, dy = _inputs(op, x_dtype, weight_dtypes, device, grads)
    refused = _refused(op, x_dtype, weight_dtypes)
    if refused is not None:
        with pytest.raises(TypeError, match=rf"cudnorm\.{op}: argument '{refused}' has dtype torch.bfloat16"):
            _run(_cudnorm_op(op), x, weights, dy)
        return
    y, got = _run(_cudnorm_op(op), x, weights, dy)  # no RuntimeError, forward or backward
    assert y.dtype is x_dtype and y.shape == x.shape
    for t, grad in zip((x, *weights), got):
        assert grad is None or (grad.dtype is t.dtype and grad.shape == t.shape)
    finishes = _torch_finishes(op, x_dtype, weight_dtypes, device)
    node = type(y.grad_fn).__name__ if y.grad_fn is not None else None
    if node is not None and device == "cpu" and op != "ada_layer_norm":
        # PyTorch's op exactly where it finishes (under "auto" and "torch"); "cudnn" keeps cudnorm's,
        # but for a weight only PyTorch's op takes
        promoted = _promoted(op, x_dtype, weight_dtypes)
        assert (node in _CUDNORM_NODES) == (not promoted and (policy == "cudnn" or not finishes)), node
    leaves = _detached(x, weights)
    doubles = [t if t is None else t.double().requires_grad_(t.requires_grad) for t in leaves]
    want_y, want = _run(_ref_op(op), doubles[0], doubles[1:], dy.double())
    base_y, base = _run(_baseline_op(op), leaves[0], leaves[1:], dy)
    for name, mine, baseline, wanted in zip(("y", "dx", *(f"d{n}" for n in _NAMES[op])), (y, *got),
                                            (base_y, *base), (want_y, *want)):
        if wanted is None:
            continue
        bound = ref.error_bound(ref.rel_error(baseline, wanted), x_dtype)
        assert ref.rel_error(mine, wanted) <= bound, (name, ref.rel_error(mine, wanted), bound)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("grads", list(GRADS))
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_finish_or_raise_cudnorms_error(device, case, grads, policy):
    _check(*case, device, grads, policy)


def test_the_bias_of_issue_48_takes_cudnorms_path_on_cpu():
    """The call of issue 48: bf16 x, no weight, an fp32 bias. ATen's CPU LayerNorm runs its
    forward and raises "expected scalar type BFloat16 but found Float" in its backward (torch
    2.13), so cudnorm's own path serves it under the default policy."""
    cudnorm.config(policy="auto")
    x = torch.randn(4, 16, dtype=BF16, requires_grad=True)
    bias = torch.randn(16, requires_grad=True)
    y = cudnorm.layer_norm(x, (16,), None, bias)
    y.float().sum().backward()
    assert type(y.grad_fn).__name__ == "_LayerNormFunctionBackward"
    assert bias.grad.dtype is F32 and torch.allclose(bias.grad, torch.full((16,), 4.0))
    assert not _torch_finishes("layer_norm", BF16, (None, F32), "cpu")


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("x_dtype", [BF16, F16])
def test_fused_residual_add_with_mixed_dtypes(x_dtype, rms):
    """``residual=``: the same rule (an fp32 bias alone, fp32 and half weights mixed) on the
    fused add's path, forward and backward."""
    cudnorm.config(policy="auto")
    combos = [(F32,)] if rms else [(None, F32), (F32, None), (F32, F32), (F32, x_dtype), (x_dtype, F32)]
    for dtypes in combos:
        x, weights, dy = _inputs("rms_norm" if rms else "layer_norm", x_dtype, dtypes, "cpu", "both")
        r = torch.randn_like(x).requires_grad_()
        if rms:
            y, h = cudnorm.rms_norm(x, N, weights[0], EPS, residual=r)
            want = ref.rms_norm(x.double() + r.double(), weights[0], EPS)
        else:
            y, h = cudnorm.layer_norm(x, (N,), *weights, EPS, residual=r)
            want = ref.layer_norm(x.double() + r.double(), *weights, EPS)
        tensors = [t for t in (x, r, *weights) if t is not None]
        grads = torch.autograd.grad((y, h), tensors, (dy, torch.zeros_like(h)))
        assert all(g.dtype is t.dtype for g, t in zip(grads, tensors))
        # one rounding of the residual sum and one of y: a few units of x's dtype
        assert ref.rel_error(y, want) <= 2 * ref.ERROR_FLOOR[x_dtype], dtypes


def test_a_patched_rmsnorm_with_a_half_weight_on_fp32_input_computes_as_before():
    """As diffusers' Flux3 does (activations upcast for the norm, the module's weight bf16):
    the patched model runs, and computes what the unpatched one did."""
    norm = torch.nn.RMSNorm(N, eps=EPS).to(BF16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(N))
    model = torch.nn.Sequential(norm)
    x = torch.randn(3, 7, N, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.rms_norm's own: it cannot fuse the mixed dtypes
        want = model(x)
        (dx_want,) = torch.autograd.grad(want.sum(), x)
        report = cudnorm.patch(model)
        assert "swapped 1 norm(s)" in str(report) and type(model[0]) is not torch.nn.RMSNorm
        got = model(x)
        (dx_got,) = torch.autograd.grad(got.sum(), x)
    assert got.dtype is want.dtype is F32
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(dx_got, dx_want)
