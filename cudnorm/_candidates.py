"""The kernels that can serve a LayerNorm/RMSNorm call, in one table, and how they are timed.

cuDNN's norm engines are not fast at every width: on an H100 (cuDNN 9.19) they are 7-16x
slower than PyTorch's kernels at widths 88, 96 and 2240 (RMSNorm also 1152 and 1408), mostly
in the backward's weight-gradient reduction, and lose 10-45% at many other widths
(docs/performance.md, "Width sweep"). So which kernel serves a call signature is measured
(:mod:`cudnorm._policy`), and this module is what is measured: each :class:`Candidate` turns
a call's tensors into a closure that runs the work once (the forward, or forward and
backward for a training call), the same closure :func:`time_closures` times for the
dispatcher and ``cudnorm bench --sweep`` times for the width sweep. Adding a kernel is one
entry in :data:`CANDIDATES`; both then measure it. Each candidate is charged its GPU time plus
its host time per call (:func:`_elapsed_ms` says why).

Candidates:

* ``cudnn``: cudnorm's cuDNN path (its custom ops, C++ kernels on the native launch path);
* ``torch``: PyTorch's own fused kernels (``native_layer_norm``, ``_fused_rms_norm`` and their
  backwards), which ``torch.nn.functional`` runs;
* ``kernel``: cudnorm's own Triton kernel (:mod:`cudnorm._norm_kernel`), for the widths and
  row counts where neither of the others reaches the memory bandwidth; launched from C++ on
  the native path (csrc/kernel.cpp), from Python without it.

On the native path a plain norm's inference call is timed as a user's call runs: through the
public function's C++ entry with the candidate forced (:func:`_through_entry`).

An affine LayerNorm modulated per sample (op ``"modulated_layer_norm"``: diffusers'
``layer_norm(x, w, b) * (1 + scale) + shift`` with ``[N]`` weight and bias in the input's dtype,
``[B, N]`` scale and shift; the signature's weight is the scale's dtype, its bias the shift's):
``torch`` is that formula in PyTorch's ops, ``cudnn`` the weight and bias folded into the
modulation and one adaptive LayerNorm (``csrc/fold.cpp``, ``cudnorm.ada_layer_norm``), native
path only. Both run as a training call does, through autograd, whose nodes' host time (ten
small ops against two cudnorm nodes) decides host-bound steps.

The adaptive LayerNorm itself (op ``"ada_layer_norm"``, :func:`cudnorm.ada_layer_norm`: no
affine parameters, ``[B, N]`` scale and shift) has the same two candidates without the fold:
``torch`` the formula, ``cudnn`` cudnorm's AdaLN (cuDNN's graphs and its fused backward), on
either launch path, both through autograd; its backward runs cuDNN's norm engines, which have
the cliffs above.

Adaptive RMSNorm (op ``"ada_rms_norm"``: the signature's weight is the scale's dtype, its bias
the shift's) has no cuDNN candidate: ``torch`` is its fp32 formula, ``kernel`` cudnorm's
kernels (:mod:`cudnorm._ada_rms`). A fused diffusers block's weightless RMSNorm and modulation
(op ``"modulated_rms_norm"``) weighs the same kernels against the block's own formula in the
input's dtype, which the plain patch runs. A gated residual into an adaptive LayerNorm (op
``"gated_ada_layer_norm"``, :mod:`cudnorm._gated`) has the formula in PyTorch's ops and, as
``kernel``, cudnorm's fused op. A norm modulated per token (ops ``"token_ada_layer_norm"`` and
``"token_ada_rms_norm"``, :mod:`cudnorm._token_ada`: ``[M, N]`` scale and shift, one row per row
of the input) has diffusers' formula in PyTorch's ops and, as ``kernel``, cudnorm's kernels.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import _ada_kernel, _ada_rms, _entry, _gated, _norm_kernel, _sleep_timing, _token_ada

_F32 = torch.float32
_LN_FORWARD = torch.ops.aten.native_layer_norm.default
_LN_BACKWARD = torch.ops.aten.native_layer_norm_backward.default
_RMS_FORWARD = getattr(getattr(torch.ops.aten, "_fused_rms_norm", None), "default", None)
_RMS_BACKWARD = getattr(getattr(torch.ops.aten, "_fused_rms_norm_backward", None), "default", None)
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", None: "none"}
_ENTRY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the native entry points serve


class Signature(NamedTuple):
    """What decides which kernel serves a call: one measurement serves every call that has it.

    ``rows_bucket`` is ``rows.bit_length()``: row counts within a factor of two share a
    decision (a model's calls vary their rows with batch and sequence; measuring each count
    would time every new shape)."""

    op: str  # "layer_norm" | "rms_norm" | "ada_rms_norm" | "ada_layer_norm" | "modulated_layer_norm" |
    # "modulated_rms_norm" | "gated_ada_layer_norm" | "token_ada_layer_norm" | "token_ada_rms_norm"
    training: bool  # forward and backward, or the forward alone
    dtype: torch.dtype  # the input's
    weight: torch.dtype | None  # None: no weight (the per-sample ops: the scale's)
    bias: torch.dtype | None  # None: no bias (always None for RMSNorm; the per-sample ops: the shift's)
    cols: int
    rows_bucket: int

    def key(self) -> str:
        """A stable text form (the on-disk decisions and the prior tables are keyed by it)."""
        return (f"{self.op}/{'train' if self.training else 'infer'}/{_DTYPE_NAMES[self.dtype]}/"
                f"w={_DTYPE_NAMES[self.weight]}/b={_DTYPE_NAMES[self.bias]}/n={self.cols}/r={self.rows_bucket}")


def signature(op: str, training: bool, x: torch.Tensor, weight, bias, cols: int) -> Signature:
    """The :class:`Signature` of a call on ``x`` (any shape; its rows are ``numel // cols``)."""
    rows = x.numel() // cols
    return Signature(op, training, x.dtype, None if weight is None else weight.dtype,
                     None if bias is None else bias.dtype, cols, rows.bit_length())


@dataclass(frozen=True)
class Candidate:
    """One kernel that may serve a signature.

    ``supports(sig)`` says whether it computes that call at all; ``prepare(sig, x, weight,
    bias, eps, dy=None)`` returns a closure that runs the call's work once on those tensors
    (``x``: ``[M, N]`` packed rows; weight and bias ``[N]``, adaptive RMSNorm's ``[B, N]``; a
    training call's backward takes ``dy``, ``x``'s shape and dtype, as the incoming gradient:
    :func:`gradient` makes one where it is None, which callers timing several candidates share); ``deterministic``:
    bitwise-reproducible results, the only kind allowed under
    ``torch.use_deterministic_algorithms(True)``."""

    name: str
    deterministic: bool
    supports: Callable[[Signature], bool]
    prepare: Callable[..., Callable[[], object]]


def random_tensor(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Normal random values of ``shape``, drawn from a generator of cudnorm's own (seeded, so
    the same every time): a measurement must not move the caller's random number streams, or
    a seeded job would draw other dropout masks in a process that measured a signature than
    in one that loaded the stored decision."""
    generator = torch.Generator(device=device).manual_seed(0)
    return torch.randn(shape, dtype=dtype, device=device, generator=generator)


def gradient(x: torch.Tensor) -> torch.Tensor:
    """An incoming gradient for a training closure's backward: a tensor of ``x``'s shape, dtype
    and device of its own, normally distributed (:func:`random_tensor`). Not ``x`` itself: a
    backward reading one tensor as both its input and its gradient finds half of it in L2,
    which made PyTorch's backward look 20-25% faster than a step gets it, and cudnorm's kernel
    4% (LayerNorm 7360 x 4559 bf16, H200: 0.168 against 0.210 ms; docs/performance.md,
    Decisions). Where there is no memory for it, ``x`` (the measurement still runs, biased as
    before)."""
    try:
        return random_tensor(x.shape, x.dtype, x.device)
    except torch.OutOfMemoryError:
        return x


# the per-token ops: [M, N] scale and shift, a row for each row of the input
TOKEN_LAYER_NORM = "token_ada_layer_norm"
TOKEN_RMS_NORM = "token_ada_rms_norm"
TOKEN = (TOKEN_LAYER_NORM, TOKEN_RMS_NORM)
# the ops with a per-sample [B, N] (per-token [M, N]) weight and bias, which only these candidates serve
MODULATED = ("ada_rms_norm", "modulated_layer_norm", "ada_layer_norm", "modulated_rms_norm",
             "gated_ada_layer_norm") + TOKEN
AFFINE_MODULATED = "modulated_layer_norm"
ADA_LAYER_NORM = "ada_layer_norm"
MODULATED_RMS = "modulated_rms_norm"
GATED = "gated_ada_layer_norm"
# the per-sample LayerNorms: PyTorch's formula against cudnorm's adaptive LayerNorm
_LAYER_NORM_MODULATED = (AFFINE_MODULATED, ADA_LAYER_NORM)


_MODE_KEYS = tuple(getattr(torch._C.DispatchKey, k) for k in ("Python", "PythonTLSSnapshot", "FuncTorchDynamicLayerFrontMode"))


def _dispatch_modes() -> bool:
    """Whether a Python dispatch mode or a functorch transform is active on this thread (the
    native entry points then hand every call to Python)."""
    included = torch._C._dispatch_tls_local_include_set()
    return any(included.has(k) for k in _MODE_KEYS)


def _through_entry(sig: Signature, x, weight, bias, eps, name: str):
    """An inference closure of a plain LayerNorm/RMSNorm that calls the public function's C++
    entry point (the native path) with candidate ``name`` forced, as a user's call served by
    ``name`` runs: timed through its custom op called from Python instead, cuDNN was charged up
    to 16 us more host time a call than a user's call on cuDNN pays (docs/performance.md, width
    sweep). None where the native path is off, for a training call (its backward runs in
    autograd's engine, not in the call), and where the entry would hand the call to Python
    (which would ask for the decision being measured): under a Python dispatch mode or
    functorch's transforms, as ``no_dispatch_modes`` in csrc/launch.cpp."""
    if (sig.training or sig.op not in ("layer_norm", "rms_norm") or not _entry.native or not x.is_cuda
            or x.dtype not in _ENTRY_DTYPES or not x.numel() or _dispatch_modes()
            or any(t is not None and t.dtype not in (x.dtype, _F32) for t in (weight, bias))):
        return None
    # detached: a weight that requires grad would make the entry record a training call
    x, weight, bias = (None if t is None else t.detach() for t in (x, weight, bias))
    code, n = _entry.SERVERS[name], [sig.cols]
    if sig.op == "layer_norm":
        call = _entry.layer_norm
        return lambda: call(x, n, weight, bias, eps, code)
    call = _entry.rms_norm
    return lambda: call(x, n, weight, eps, 0.0, code)


def _torch_supports(sig: Signature) -> bool:
    if sig.op in MODULATED:  # the fp32 formula takes every dtype
        return True
    if sig.op == "layer_norm":  # ATen's LayerNorm takes fp32 weights on half-precision input too
        return sig.bias is None or sig.weight is None or sig.bias == sig.weight
    return _RMS_FORWARD is not None and sig.weight in (None, sig.dtype)


def _torch_prepare(sig: Signature, x, weight, bias, eps, dy=None):
    dy = None if not sig.training else gradient(x) if dy is None else dy
    if sig.op in TOKEN:
        return _token_prepare(sig, x, weight, bias, eps, dy, _token_ada.formula)
    if sig.op in _LAYER_NORM_MODULATED:
        return _modulated_prepare(sig, x, weight, bias, eps, dy, _modulated_formula)
    if sig.op == MODULATED_RMS:
        return _modulated_prepare(sig, x, weight, bias, eps, dy, _modulated_rms_formula)
    if sig.op == GATED:
        return _gated_prepare(sig, x, weight, bias, eps, dy, _gated.formula)
    if sig.op in MODULATED:
        return _ada_rms_prepare(sig, x, weight, bias, eps, dy, _ada_rms_torch_run)
    as_called = _through_entry(sig, x, weight, bias, eps, "torch")
    if as_called is not None:
        return as_called
    n = [sig.cols]
    if sig.op == "layer_norm":
        mask = [True, weight is not None, bias is not None]
        if not sig.training:
            return lambda: _LN_FORWARD(x, n, weight, bias, eps)

        def run():
            _, mean, rstd = _LN_FORWARD(x, n, weight, bias, eps)
            return _LN_BACKWARD(dy, x, n, mean, rstd, weight, bias, mask)
        return run
    if not sig.training:
        return lambda: _RMS_FORWARD(x, n, weight, eps)
    mask = [True, weight is not None]

    def run_rms():
        _, rstd = _RMS_FORWARD(x, n, weight, eps)
        return _RMS_BACKWARD(dy, x, n, rstd, weight, mask)
    return run_rms


def _ada_rms_torch_run(x3, scale, shift, eps, dy3):
    """The formula's forward, and with an incoming gradient ``dy3`` its backward through
    PyTorch's autograd."""
    if dy3 is None:
        return _ada_rms.formula(x3, scale, shift, eps, True)
    with torch.enable_grad():
        leaves = [t.requires_grad_() for t in (x3, scale, shift) if t is not None]
        return torch.autograd.grad(_ada_rms.formula(x3, scale, shift, eps, True), leaves, dy3)


def _ada_rms_kernel_run(x3, scale, shift, eps, dy3):
    """The kernel as a call runs it: a training call (an incoming gradient ``dy3``) through its
    autograd function and PyTorch's autograd engine (host time that a call launched from
    Python pays)."""
    if dy3 is None:
        return _ada_rms.kernel(x3, scale, shift, eps, True)
    with torch.enable_grad():
        leaves = [t.requires_grad_() for t in (x3, scale, shift) if t is not None]
        return torch.autograd.grad(_ada_rms.kernel(x3, scale, shift, eps, True), leaves, dy3)


def _ada_rms_prepare(sig: Signature, x, scale, shift, eps, dy, run):
    """A closure running ``run`` on the call's ``[B, S, N]`` tokens (detached copies of the
    modulation, so the formula's autograd leaves are its own), a training call's backward
    with ``dy`` as its gradient. ``one_plus_scale`` is not in the signature: the gain's add
    costs the same either way, so both time with it."""
    x3 = x.view(scale.shape[0], -1, sig.cols)
    dy3 = None if dy is None else dy.view(x3.shape)
    scale, shift = (None if t is None else t.detach().clone() for t in (scale, shift))
    return lambda: run(x3, scale, shift, eps, dy3)


def _modulated_formula(x3, w, b, scale, shift, eps):
    """diffusers' modulated LayerNorm in PyTorch's ops (``scale``/``shift`` ``[B, N]``; ``w``/``b``
    ``[N]`` or None)."""
    return torch.nn.functional.layer_norm(x3, (x3.shape[-1],), w, b, eps) * (1 + scale[:, None]) + shift[:, None]


def _modulated_fold(x3, w, b, scale, shift, eps):
    """The same on the native path: the fold's node, then one adaptive LayerNorm node."""
    gain, shift = _entry.affine_fold(scale[:, None], shift[:, None], w, b, True, x3)
    return _entry.ada_layer_norm(x3, gain, shift, eps, False)


def _modulated_rms_formula(x3, w, b, scale, shift, eps):
    """A diffusers block's weightless RMSNorm, then its modulation, in ``x3``'s dtype (what the
    plain patch leaves of LTX-Video's blocks)."""
    return torch.nn.functional.rms_norm(x3, (x3.shape[-1],), None, eps) * (1 + scale[:, None]) + shift[:, None]


def _modulated_rms_kernel(x3, w, b, scale, shift, eps):
    """The same as one fused op: cudnorm's adaptive RMSNorm kernels."""
    return _ada_rms.kernel(x3, scale, shift, eps, True)


def _token_prepare(sig: Signature, x, scale, shift, eps, dy, fn):
    """A closure running ``fn`` (:mod:`cudnorm._token_ada`'s formula or kernel) on the call's
    ``[M, N]`` rows with ``[M, N]`` scale and shift (detached copies: leaves of its own), a
    training call's backward through autograd with ``dy`` as its gradient."""
    rms = sig.op == TOKEN_RMS_NORM
    leaves = [None if t is None else t.detach().clone().requires_grad_(sig.training) for t in (x, scale, shift)]
    if not sig.training:
        return lambda: fn(*leaves, eps, rms, True)
    inputs = [t for t in leaves if t is not None]

    def run():
        with torch.enable_grad():
            return torch.autograd.grad(fn(*leaves, eps, rms, True), inputs, dy)
    return run


def _gated_prepare(sig: Signature, x, scale, shift, eps, dy, fn):
    """A closure running ``fn`` (:mod:`cudnorm._gated`'s formula or fused op) on the call's
    ``[B, S, N]`` stream, copies of the stream standing for the branch and the scale for the
    gate (their values do not change the work); a training call's backward through autograd,
    with gradients arriving at both outputs: ``dy`` at ``y``, the call's own ``x`` (no leaf's
    memory) at the stream ``h``, two tensors as in a step."""
    x3 = x.view(scale.shape[0], -1, sig.cols)
    leaves = [t.detach().clone().requires_grad_(sig.training) for t in (x3, x3, scale, scale, shift)]
    if not sig.training:
        return lambda: fn(*leaves, eps, True)

    def run():
        with torch.enable_grad():
            return torch.autograd.grad(fn(*leaves, eps, True), leaves, (dy.view(x3.shape), x3))
    return run


def _ada_cudnn(x3, w, b, scale, shift, eps):
    """cudnorm's adaptive LayerNorm op as a served call runs it (past the decision that times it):
    cuDNN's forward graph, its autograd node and fused backward."""
    return torch.ops.cudnorm.ada_layer_norm_fwd(x3, scale, shift, eps, True, torch.is_grad_enabled())[0]


def _modulated_prepare(sig: Signature, x, scale, shift, eps, dy, fn):
    """A closure running ``fn`` on the call's ``[B, S, N]`` tokens, the signature's training call
    through autograd with ``dy`` as its gradient; the affine op's with a weight of ones and a
    bias of zeros in the input's dtype, the adaptive LayerNorm's with none."""
    x3 = x.view(scale.shape[0], -1, sig.cols)
    w = b = None
    if sig.op == AFFINE_MODULATED:
        w, b = (torch.ones(sig.cols, dtype=x.dtype, device=x.device),
                torch.zeros(sig.cols, dtype=x.dtype, device=x.device))
    scale, shift = scale.detach().clone(), shift.detach().clone()
    if not sig.training:
        return lambda: fn(x3, w, b, scale, shift, eps)
    leaves = [None if t is None else t.detach().requires_grad_() for t in (x3, w, b, scale, shift)]
    inputs = [t for t in leaves if t is not None]

    def run():
        with torch.enable_grad():
            return torch.autograd.grad(fn(*leaves, eps), inputs, dy.view(x3.shape))
    return run


def _cudnn_supports(sig: Signature) -> bool:
    # cudnorm's own path serves every plain call (its ops fall back where no graph does); the
    # affine modulated LayerNorm's fold is a native-path node; no cuDNN graph for adaptive RMSNorm
    if sig.op == AFFINE_MODULATED:
        return _entry.native
    return sig.op == ADA_LAYER_NORM or sig.op not in MODULATED


def _cudnn_prepare(sig: Signature, x, weight, bias, eps, dy=None):
    dy = None if not sig.training else gradient(x) if dy is None else dy
    if sig.op == AFFINE_MODULATED:
        return _modulated_prepare(sig, x, weight, bias, eps, dy, _modulated_fold)
    if sig.op == ADA_LAYER_NORM:
        return _modulated_prepare(sig, x, weight, bias, eps, dy, _ada_cudnn)
    as_called = _through_entry(sig, x, weight, bias, eps, "cudnn")
    if as_called is not None:
        return as_called
    ops = torch.ops.cudnorm
    if sig.op == "layer_norm":
        if not sig.training:
            return lambda: ops.layer_norm_fwd(x, weight, bias, eps, False)

        def run():
            _, stats = ops.layer_norm_fwd(x, weight, bias, eps, True)
            return ops.layer_norm_bwd(dy, x, weight, stats)
        return run
    if not sig.training:
        return lambda: ops.rms_norm_fwd(x, weight, eps, False, 0.0)

    def run_rms():
        _, rstd = ops.rms_norm_fwd(x, weight, eps, True, 0.0)
        return ops.rms_norm_bwd(dy, x, weight, rstd, 0.0)
    return run_rms


def _kernel_supports(sig: Signature) -> bool:
    if sig.op in TOKEN:
        return _token_ada.supports(sig.cols, sig.dtype, sig.weight, sig.bias)
    if sig.op in _LAYER_NORM_MODULATED:
        return False
    if sig.op == GATED:  # the fused op's backward kernel (its forward: a multiply-add and the AdaLN op)
        return (_norm_kernel.available() and sig.cols <= _ada_kernel.MAX_COLS
                and sig.weight == sig.dtype and sig.bias == sig.dtype)
    if sig.op in MODULATED:
        return _ada_rms.supports(sig.cols, sig.dtype, sig.weight, sig.bias)
    return _norm_kernel.available() and _norm_kernel.supports(sig.cols, sig.dtype, sig.weight, sig.bias)


def _kernel_prepare(sig: Signature, x, weight, bias, eps, dy=None):
    dy = None if not sig.training else gradient(x) if dy is None else dy
    if sig.op in TOKEN:
        return _token_prepare(sig, x, weight, bias, eps, dy, _token_ada.kernel)
    if sig.op == GATED:
        return _gated_prepare(sig, x, weight, bias, eps, dy, _gated.fused)
    if sig.op == MODULATED_RMS:
        return _modulated_prepare(sig, x, weight, bias, eps, dy, _modulated_rms_kernel)
    if sig.op in MODULATED:
        return _ada_rms_prepare(sig, x, weight, bias, eps, dy, _ada_rms_kernel_run)
    as_called = _through_entry(sig, x, weight, bias, eps, "kernel")
    if as_called is not None:
        return as_called
    rms = sig.op == "rms_norm"
    if _entry.native and x.is_cuda:  # launched from C++ as a real call is (csrc/kernel.cpp)
        ops = torch.ops.cudnorm_native
        if not sig.training:
            return lambda: ops.kernel_fwd(x, weight, bias, eps, False, rms)

        def run_native():
            _, stats = ops.kernel_fwd(x, weight, bias, eps, True, rms)
            return ops.kernel_bwd(dy, x, weight, stats, rms, None if bias is None else bias.dtype)
        return run_native
    if not sig.training:
        return lambda: _norm_kernel.norm(x, weight, bias, eps, rms)
    # as a training call runs it: its autograd function, then PyTorch's autograd engine calling
    # its backward (host time a call launched from Python pays; leaves of its own)
    xl, wl, bl = (None if t is None else t.detach().requires_grad_() for t in (x, weight, bias))
    inputs = [t for t in (xl, wl, bl) if t is not None]

    def run():
        with torch.enable_grad():
            return torch.autograd.grad(_norm_kernel.norm(xl, wl, bl, eps, rms), inputs, dy)
    return run


# Which implementation of the candidates a stored decision measured: bumped whenever a change
# to a candidate would change what its measurement finds, so decisions stored by an earlier
# revision are measured again (2: cudnorm's kernel launched from C++ on the native path; 3: every
# candidate charged its GPU plus its host time, not its GPU time alone; 4: the kernel's backward
# sums its parameter gradients in one more launch of its own, not PyTorch's sum and casts; 5: the
# modulated ops' kernels, per token and the adaptive RMSNorm's, launch from C++ with their autograd
# nodes, a third to a half of the host time of their Python autograd functions; 6: a lead inside
# the two timings' spreads is settled in paired rounds, where before it kept PyTorch's op:
# decisions stored by revision 5 would keep such signatures on PyTorch's op for good; 7: a
# training call's backward takes a gradient of its own (:func:`gradient`), not the input, which
# L2 served half of to PyTorch's backward; 8: on the native path an inference call's candidates
# run through the public function's C++ entry with the candidate forced (:func:`_through_entry`),
# charged the host time a user's call pays, cuDNN's up to 16 us less than through its custom op;
# and every candidate ahead by MIN_GAIN is settled in the same paired rounds as the leader).
REVISION = 8
# candidate -> the revision in which it last changed what its measurement finds: a prior written
# at an earlier revision (``cudnorm/priors/``, key ``candidates_revision``, 1 where absent) does
# not stand for it (its kernel timings there include the Python launch's host time). Revision 3
# changed no candidate: a prior's GPU times still screen out cliffs (a candidate 3x slower on
# the GPU stays slower with its host time added), and a call that may not measure (CUDA-graph
# capture) takes the prior's choice by GPU time, as before. Revision 4 made the kernel's backward
# faster, so a prior of revisions 2-3 can only understate it: it still stands. Revision 5 changed
# only the modulated ops, which no prior holds (the sweep writes LayerNorm and RMSNorm cells).
# Revision 6 changed the rule that reads the timings, not the timings. Revision 7 changed every
# training timing by at most a quarter (PyTorch's backward most), far inside the prior's 2x cliff
# screen (``_decisions.PRIOR_CLIFF``): a prior of revision 5 stands. Revision 8 changed only
# inference closures' host time, not their GPU time, which is what a prior screens by.
CHANGED_IN = {"kernel": 2}

# The order is the preference among equals: PyTorch's op first (the reference a candidate has
# to beat), then cuDNN, then cudnorm's own kernel.
CANDIDATES: dict[str, Candidate] = {
    "torch": Candidate("torch", True, _torch_supports, _torch_prepare),
    # cuDNN documents no determinism for its norm engines: kept out under deterministic algorithms
    "cudnn": Candidate("cudnn", False, _cudnn_supports, _cudnn_prepare),
    "kernel": Candidate("kernel", True, _kernel_supports, _kernel_prepare),
}


def candidates_for(sig: Signature, *, deterministic: bool = False) -> list[str]:
    """The names of the candidates that serve ``sig`` (deterministic ones only, if asked)."""
    return [name for name, c in CANDIDATES.items() if c.supports(sig) and (c.deterministic or not deterministic)]


class Timing(NamedTuple):
    """Milliseconds per call (GPU plus host time): the median of ``rounds`` timed rounds, and
    their relative spread ((max - min) / median: how far this measurement can be trusted);
    ``samples``: each round's ms per call, in the order the rounds ran (candidates timed in one
    round pair up); ``gpu_samples``: the same rounds' GPU time alone, where it was kept."""

    ms: float
    spread: float
    rounds: int
    samples: tuple = ()
    gpu_samples: tuple = ()

    @property
    def gpu_ms(self) -> float | None:
        """The median GPU ms per call, or None where only the sum was kept."""
        return statistics.median(self.gpu_samples) if self.gpu_samples else None

    @classmethod
    def of(cls, samples, gpu_samples=()) -> Timing:
        """The timing of these per-round ms per call (and GPU ms per call)."""
        samples = tuple(samples)
        mid = statistics.median(samples)
        return cls(mid, (max(samples) - min(samples)) / mid if mid > 0 else 0.0, len(samples), samples,
                   tuple(gpu_samples))


# A first measurement costs at most about this much GPU time per signature (builds and
# compiles aside: the first call pays those whichever kernel serves).
BUDGET_MS = 20.0
ROUNDS = 3
# A candidate whose first timed call is this many times the best one's is out (a cliff): no
# rounds are spent on it. Its single time is still reported.
CLIFF = 3.0


def time_closures(closures: dict[str, Callable[[], object]], *, budget_ms: float = BUDGET_MS,
                  rounds: int = ROUNDS, device=None, errors: dict | None = None,
                  cost: dict | None = None) -> dict[str, Timing]:
    """Time each closure on ``device``'s current CUDA stream: one untimed call (builds, compiles,
    caches), two timed calls (the faster screens out cliffs), then ``rounds`` interleaved rounds
    of as many calls as fit the budget; events around each round give its time per call.
    Closures that fail on their first call are left out of the result (and named in ``errors``
    with what they raised). ``cost`` gets the wall ms of the untimed first calls (``"first"``:
    loading each candidate's kernels, which a call pays for its own kernel anyway) and of the
    timed ones (``"timing"``: what measuring costs)."""
    with _on(device):
        return _time_closures(closures, budget_ms, rounds, torch.cuda.current_stream(device), errors, cost)


def _on(device):
    """``device`` made current (the GPU sleep and the events of :func:`_elapsed_ms` go to the
    current device's stream, where the closures' kernels go); nothing where ``device`` is None."""
    return torch.cuda.device(device) if device is not None else contextlib.nullcontext()


def _time_closures(closures, budget_ms, rounds, stream, errors, cost) -> dict[str, Timing]:
    began = time.perf_counter()
    alive = {}
    for name, fn in closures.items():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run this call is not a candidate
            if errors is not None:
                errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        alive[name] = fn
    stream.synchronize()
    first_done = time.perf_counter()
    if cost is not None:
        cost["first"] = round((first_done - began) * 1e3, 2)
    if not alive:
        return {}
    hosts: dict = {}
    first = {name: min(_elapsed_ms(fn, 1, hosts), _elapsed_ms(fn, 1, hosts))
             for name, fn in alive.items()}
    best = min(first.values())
    out = {name: Timing(ms, 0.0, 1) for name, ms in first.items() if ms > CLIFF * best}
    timed = {name: fn for name, fn in alive.items() if name not in out}
    per_round = budget_ms / (rounds * len(timed))
    reps = {name: max(1, min(50, int(per_round / max(first[name], 1e-3)))) for name in timed}
    samples = {name: [] for name in timed}
    gpu = {name: [] for name in timed}
    for _ in range(rounds):
        for name, fn in timed.items():
            samples[name].append(_elapsed_ms(fn, reps[name], hosts))
            gpu[name].append(samples[name][-1] - hosts[fn])
    for name, values in samples.items():
        out[name] = Timing.of(values, gpu[name])
    if cost is not None:
        cost["timing"] = round((time.perf_counter() - first_done) * 1e3, 2)
    return out


def _elapsed_ms(fn, reps: int, hosts: dict) -> float:
    """ms per call of ``fn`` over ``reps`` back-to-back calls: its GPU time (between events,
    behind a GPU sleep that covers the host's enqueueing: :func:`cudnorm._sleep_timing.timed_burst`)
    plus its host time per call. A step bound by its GPU pays a norm's GPU time, one bound by its
    host pays its host time, and a candidate cannot know which step calls it: charged both, cuDNN
    (whose execute costs more host time than PyTorch's launch) or cudnorm's kernel replaces
    PyTorch's op only where it saves more GPU time than it adds host time, so a host-bound step
    does not lose what a GPU-bound one gains (docs/performance.md, Decisions). ``hosts``: host
    ms per call of each closure seen last, which sizes its next sleep."""

    def burst():
        for _ in range(reps):
            fn()

    timed = _sleep_timing.timed_burst(burst, hosts.get(fn, 0.2) * reps)
    host = timed.host_ms / reps
    hosts[fn] = host
    return timed.gpu_ms / reps + host


# cuDNN (or cudnorm's kernel) replaces PyTorch's op only where it is faster by more than the
# two measurements' spreads together and at least this much (docs/performance.md, Decisions)
MIN_GAIN = 0.03
# A lead beyond MIN_GAIN but inside the spreads is timed again: the leader and the baseline alone,
# this many more rounds of one timing each, in about this much GPU time; then it is decided on the
# rounds' pairs (:func:`winner`). One slow round (a host thread preempted, a clock change) no
# longer hides a 10-40% lead (docs/performance.md, Decisions).
SETTLE_ROUNDS = 6
SETTLE_BUDGET_MS = 10.0


def _eligible(timings: dict[str, Timing], baseline: str) -> dict[str, Timing]:
    """The timings of ``baseline`` and of the candidates whose GPU time is not over the
    baseline's by more than :data:`MIN_GAIN` (where both were kept). Charged GPU plus host
    time, a candidate saving host time could serve with more GPU time than PyTorch's op, which
    a step bound by its GPU pays: cudnorm's kernel served LayerNorm inference at widths
    5568-5696 with 4-6% more GPU time and 3-10 us less host time, 0.96-0.97x in the width
    sweep (docs/performance.md, Decisions)."""
    base = timings.get(baseline)
    if base is None or base.gpu_ms is None:
        return timings
    limit = base.gpu_ms * (1.0 + MIN_GAIN)
    return {name: t for name, t in timings.items() if name == baseline or t.gpu_ms is None or t.gpu_ms <= limit}


def _leader(timings: dict[str, Timing], baseline: str) -> str | None:
    """The fastest eligible candidate (:func:`_eligible`) by median, if it is not ``baseline``
    and the baseline was timed."""
    if baseline not in timings:
        return None
    timings = _eligible(timings, baseline)
    best = min(timings, key=lambda name: timings[name].ms)
    return None if best == baseline else best


def _paired_leads(best: Timing, base: Timing) -> list[float]:
    """``base / best - 1`` round by round (the two were timed in the same rounds), or ``[]``
    where they were not timed in the same rounds long enough to decide on pairs."""
    if len(best.samples) != len(base.samples) or len(best.samples) < ROUNDS + SETTLE_ROUNDS:
        return []
    return [b / a - 1.0 for a, b in zip(best.samples, base.samples) if a > 0]


def unsettled(timings: dict[str, Timing], baseline: str = "torch") -> str | None:
    """The candidate whose lead over ``baseline`` is beyond :data:`MIN_GAIN` but inside the two
    timings' spreads and not yet timed in paired rounds (:func:`settle` times it), else None."""
    best = _leader(timings, baseline)
    if best is None or _paired_leads(timings[best], timings[baseline]):
        return None
    lead = timings[baseline].ms / timings[best].ms - 1.0 if timings[best].ms > 0 else float("inf")
    return best if MIN_GAIN < lead <= timings[best].spread + timings[baseline].spread else None


def settle(closures: dict[str, Callable[[], object]], timings: dict[str, Timing], baseline: str = "torch", *,
           device=None, cost: dict | None = None) -> dict[str, Timing]:
    """``timings`` with the :func:`unsettled` candidate and ``baseline`` timed
    :data:`SETTLE_ROUNDS` more rounds (their order alternating, each round one timing of each),
    their samples appended; unchanged where no lead is unsettled. Every other eligible candidate
    also ahead of ``baseline`` by more than :data:`MIN_GAIN` is timed in the same rounds: should
    the leader's lead not hold, the next one has pairs of its own to be judged on (judged on the
    spreads instead, it met the baseline's spread as the rounds widened it, and kept PyTorch's
    op where cudnorm's kernel was 22% faster: docs/performance.md, Decisions).
    ``cost["settle"]``: the wall ms it took."""
    contender = unsettled(timings, baseline)
    if contender is None:
        return timings
    began = time.perf_counter()
    base_ms = timings[baseline].ms
    ahead = [name for name, t in _eligible(timings, baseline).items()
             if name not in (contender, baseline) and 0 < t.ms and base_ms / t.ms - 1.0 > MIN_GAIN]
    pair = (contender, *ahead, baseline)
    per_round = SETTLE_BUDGET_MS / (SETTLE_ROUNDS * len(pair))
    reps = {name: max(1, min(50, int(per_round / max(timings[name].ms, 1e-3)))) for name in pair}
    samples = {name: list(timings[name].samples) for name in pair}
    gpu = {name: list(timings[name].gpu_samples) for name in pair}
    hosts: dict = {}
    with _on(device):
        for r in range(SETTLE_ROUNDS):
            for name in pair if r % 2 else pair[::-1]:
                samples[name].append(_elapsed_ms(closures[name], reps[name], hosts))
                gpu[name].append(samples[name][-1] - hosts[closures[name]])
    if cost is not None:
        cost["settle"] = round((time.perf_counter() - began) * 1e3, 2)
    return {**timings, **{name: Timing.of(values, gpu[name]) for name, values in samples.items()}}


def winner(timings: dict[str, Timing], baseline: str = "torch") -> str:
    """The candidate that serves: the fastest of those not slower than ``baseline`` (PyTorch's
    op) on the GPU (:func:`_eligible`), where it beats the baseline by more
    than :data:`MIN_GAIN`, and either by more than the two timings' spreads or, once
    :func:`settle` timed the two in paired rounds, in three rounds of four (the pairs' lower
    quartile of leads beyond :data:`MIN_GAIN`); else the baseline. Without a baseline timing,
    the fastest."""
    if not timings:
        return baseline
    best = _leader(timings, baseline)
    if best is None:
        return baseline if baseline in timings else min(timings, key=lambda name: timings[name].ms)
    leads = _paired_leads(timings[best], timings[baseline])
    if leads:
        return best if statistics.quantiles(leads, n=4)[0] > MIN_GAIN else baseline
    margin = max(MIN_GAIN, timings[best].spread + timings[baseline].spread)
    return best if timings[best].ms * (1.0 + margin) < timings[baseline].ms else baseline
