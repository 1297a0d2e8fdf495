"""What a norm patched by ``cudnorm.patch`` runs in Python per call, beside the original module
(CPU, deterministic: counted, not timed). A host-bound training step (DiT-XL/2 at 256 tokens on
an H100) pays every microsecond of it in every block, forward and backward; timings are
``benchmarks/patched_host.py``'s job."""

import copy
import sys

import pytest
import torch

dn = pytest.importorskip("diffusers.models.normalization")
GemmaRMSNorm = pytest.importorskip("transformers.models.gemma.modeling_gemma").GemmaRMSNorm

import cudnorm

B, S, D = 2, 16, 64
# cudnorm's public functions: a patched forward's one call into cudnorm, counted as one call
ENTRIES = {cudnorm.ada_layer_norm.__code__, cudnorm.layer_norm.__code__, cudnorm.rms_norm.__code__,
           cudnorm.gated_ada_layer_norm.__code__}


def _x():
    return torch.randn(B, S, D)


def _emb():
    return torch.randn(B, D)


# diffusers' AdaLN classes as DiT, SD3, SD3.5 and Flux build them: (module, args, calls into cudnorm)
ADALN = {
    "AdaLayerNormZero": (lambda: dn.AdaLayerNormZero(D), lambda: (_x(), None, None, None, _emb()), 1),
    "AdaLayerNormZero(DiT)": (lambda: dn.AdaLayerNormZero(D, 10),
                              lambda: (_x(), torch.tensor([3.0, 7.0]), torch.tensor([1, 2]), torch.float32), 1),
    "AdaLayerNormZeroSingle": (lambda: dn.AdaLayerNormZeroSingle(D), lambda: (_x(), _emb()), 1),
    "SD35AdaLayerNormZeroX": (lambda: dn.SD35AdaLayerNormZeroX(D), lambda: (_x(), _emb()), 2),
    "AdaLayerNormContinuous": (lambda: dn.AdaLayerNormContinuous(D, D, False, 1e-6), lambda: (_x(), _emb()), 1),
}
NORMS = {
    "torch.nn.LayerNorm": (lambda: torch.nn.LayerNorm(D), lambda: (_x(),), 1),
    "torch.nn.RMSNorm": (lambda: torch.nn.RMSNorm(D, eps=1e-6), lambda: (_x(),), 1),
    "diffusers RMSNorm": (lambda: dn.RMSNorm(D, eps=1e-6), lambda: (_x(),), 1),
    "diffusers FP32LayerNorm": (lambda: dn.FP32LayerNorm(D, eps=1e-6), lambda: (_x(),), 1),
    "diffusers MochiRMSNorm": (lambda: dn.MochiRMSNorm(D, eps=1e-6), lambda: (_x(),), 1),
    "GemmaRMSNorm": (lambda: GemmaRMSNorm(D, eps=1e-6), lambda: (_x(),), 1),
    **ADALN,
}


def _python_calls(call) -> int:
    """Python function calls ``call()`` makes, a call into cudnorm's public functions counted
    as one (what runs inside is the dispatch's, the same for every caller)."""
    count, inside = 0, None

    def profile(frame, event, arg):
        nonlocal count, inside
        if inside is None and event == "call":
            count += 1
            if frame.f_code in ENTRIES:
                inside = frame
        elif event == "return" and frame is inside:
            inside = None

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count


def _pair(build):
    original = build()
    patched = copy.deepcopy(original)
    assert cudnorm.patch(patched).swapped
    return original, patched


@pytest.mark.parametrize("name", NORMS)
def test_patched_forward_runs_about_what_the_original_runs(name):
    """Per call into cudnorm, at most three Python calls more than the original forward
    (whose norm module or function calls are counted whole): for the AdaLN classes the
    patched class's forward checking the norm for hooks, the call itself and the reads of
    the norm's attributes; for torch's norms on the CPU, the kernel policy's. Before this
    bound the patched AdaLN forwards ran 13-20 more (index views, dtype promotion, the
    broadcast tests of any modulation, a generator over the children's hooks), torch's
    LayerNorm and RMSNorm 4-5 more (cudnorm's argument checks before PyTorch's op)."""
    build, make_args, entries = NORMS[name]
    original, patched = _pair(build)
    args = make_args()
    with torch.no_grad(), cudnorm.config(policy="auto"):  # the default: PyTorch's kernels on the CPU
        original(*args), patched(*args)  # first calls: lazy imports, caches
        theirs = _python_calls(lambda: original(*args))
        mine = _python_calls(lambda: patched(*args))
    assert mine <= theirs + 3 * entries, (mine, theirs)


@pytest.mark.parametrize("name", NORMS)
@pytest.mark.parametrize("grad", [False, True])
def test_patched_forward_raises_nothing_in_the_common_call(name, grad):
    """No exception is raised (and caught) inside a patched forward's common call: a missing
    attribute read through ``nn.Module.__getattr__`` (the eps of a norm without
    ``variance_epsilon``) costs several us of host time on every call."""
    build, make_args, _ = NORMS[name]
    _, patched = _pair(build)
    args = make_args()
    if grad:
        args[0].requires_grad_(True)
    raised = []

    def trace(frame, event, arg):
        if event == "exception":
            raised.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {arg[0].__name__}")
        return trace

    with torch.set_grad_enabled(grad), cudnorm.config(policy="auto"):
        patched(*args)
        sys.settrace(trace)
        try:
            patched(*args)
        finally:
            sys.settrace(None)
    assert raised == []
