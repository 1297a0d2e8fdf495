"""Which kernels serve a call: cuDNN's graphs, or PyTorch's own ops where those make the
model faster.

On the Python launch path a cudnorm call costs more host time than PyTorch's C++ op
(argument handling, plan lookup, an ``autograd.Function`` node and a Python backward;
docs/performance.md, "Where the host time goes"). When a model step is bound by the host,
the GPU runs each kernel as soon as it is enqueued and that extra host time is added to the
step, while the kernel saving of a small norm is a few microseconds; so that path keeps
cuDNN for large calls only (:data:`CUDNN_MIN_ELEMENTS`). The native launch path
(:mod:`cudnorm._native`) costs about PyTorch's host time, and with it every eager call but
the smallest (:data:`NATIVE_CUDNN_MIN_ELEMENTS`: one-token decode calls) runs on cuDNN.
Under ``torch.compile`` Inductor fuses PyTorch's norm with the ops around it (the modulation,
residual adds), which an opaque custom op prevents: the native op inside a compiled graph
still lost (docs/performance.md, Decisions).

Rules for ``cudnorm.config(policy="auto")`` (the default), for a call whose weights (scale/shift)
have the input's dtype; where PyTorch's ops serve, the public functions call them directly,
with no cudnorm op or autograd node in between:

0. float64 input (weights must then be float64 too): PyTorch's ops at every policy, since
   cuDNN has no double-precision normalization (float64 serves references and
   ``gradcheck``, not speed);
1. tensors not on a CUDA device (CPU, meta) and tensor subclasses such as ``DTensor``:
   PyTorch's ops. Off CUDA there is no cuDNN path. A DTensor call could run cudnorm's op on
   each rank's shard (the rules of :mod:`cudnorm._sharding`), but it reaches the op through
   the dispatcher and DTensor's sharding propagation, and the case that meets DTensors (TP +
   SP's sequence shards) cannot be flattened into rows on torch 2.11; FSDP2's norms see plain
   tensors and take rule 3 (two H200s: 1.005x, docs/distributed.md). Other subclasses have
   rules for PyTorch's ops only;
2. traced by ``torch.compile``: PyTorch's ops, which Inductor compiles with their neighbours;
3. eager with fewer than :data:`CUDNN_MIN_ELEMENTS` input elements (while the native launch
   path serves, :data:`NATIVE_CUDNN_MIN_ELEMENTS`): PyTorch's ops;
4. otherwise the measured decision of the call's signature (below): cuDNN, PyTorch's op or
   cudnorm's own kernel, whichever measured fastest (an adaptive LayerNorm: cuDNN's AdaLN or
   the formula in PyTorch's ops).

Calls with fp32 weights on half-precision input skip rule 3 on CUDA: at every size they take
the measured decision (cuDNN's path rounds the weights as cuDNN reads them and keeps its weight
gradients fp32; PyTorch's mixed-dtype LayerNorm and cudnorm's kernel compute with the fp32
weights). Off CUDA a plain tensor with fp32 weights takes PyTorch's mixed-dtype op where that op
finishes the forward and the backward (:func:`_mixed_off_cuda`), as rule 1 has it: results and cost are PyTorch's (cudnorm's own fp32 path cost up to 4.5x PyTorch's time
on a CPU, its Python autograd node a fixed 15-40 us; docs/performance.md, Decisions), so a
patched model's LayerNorms on a CPU compute what the unpatched ones do (RMSNorm: ATen's fused
kernel, :func:`cudnorm._norm.torch_rms_norm`). PyTorch's CPU LayerNorm backward sums the
dW/dB of half-precision input in that precision (bf16, 256-4096 rows: 1.3-5% error);
``policy="cudnn"`` keeps cudnorm's fp32 sums on a CPU.

Rule 4 is measured, not assumed (:func:`cudnorm._decisions.server`): cuDNN's norm engines fall off cliffs at
some widths (7-16x slower than PyTorch at 88, 96 and 2240 on an H100; docs/performance.md,
"Width sweep"). For each call signature (op, training or inference, dtypes, width, a bucket
of row counts: :class:`cudnorm._candidates.Signature`) the first eager call times the
candidates of :mod:`cudnorm._candidates` (cuDNN, PyTorch's op, cudnorm's own kernel) on
tensors of its shape, each charged its GPU plus its host time, and the fastest serves every
later call; cuDNN or the kernel replace
PyTorch's op only where they beat it by more than the measurement's spread. Decisions are
kept in memory, in C++ on the native path (a lookup beside the recipe's), and in the plan
store (:mod:`cudnorm._plan_store`), so a later process on the same GPU and software measures
nothing, and every process sharing the store serves a signature the same way (the first
decision written wins). Before measuring, the committed prior for this GPU
(``cudnorm/priors/<gpu>.json``, written by ``cudnorm bench --sweep``) drops candidates it
measured far slower, so a known cliff is never built or timed. Where timing is not allowed
(CUDA-graph capture) or not wanted (``Config.measure=False``) a call takes the stored
decision, else the prior's, else PyTorch's op, without keeping it. Under
``torch.use_deterministic_algorithms(True)`` only deterministic candidates compete (cuDNN
documents none for its norm engines). :func:`cudnorm.serving_decisions` lists what was decided and why;
``cudnorm info`` and ``cudnorm warmup`` print them.

``policy="cudnn"`` sends every call to cudnorm's own path: cuDNN wherever it can serve
(benchmarks and tests of that path use it).
``policy="torch"`` sends every call whose weights have the input's dtype to PyTorch's ops
through cudnorm's functions and modules, at any size: a model patched by :func:`cudnorm.patch`
then runs PyTorch's kernels plus cudnorm's own Python, which that control measures. Where a
DTensor takes cudnorm's own path (either of these), cudnorm's ops run on each rank's local
shard and return DTensors placed by the rules of :mod:`cudnorm._sharding`.
"""

from __future__ import annotations

import torch

from . import _entry, _settings

_F32 = torch.float32

# Eager calls with at least this many input elements run on cuDNN. Model steps with fresh
# inputs on a lent H100, bf16, every call on cuDNN (docs/performance.md, Decisions): every
# configuration below it lost (GPT-2 1024-wide LayerNorm at 8 x 1024 tokens = 2**23 elements
# 0.86x, DiT 1152 AdaLN at 512-2048 tokens 0.81-0.94x, decode 0.75-0.83x: host-bound steps),
# every one above it won (Llama RMSNorm at 2 x 4096 x 4096 = 2**25 1.01x, DiT AdaLN at
# 25-38M elements 1.02-1.07x: GPU-bound steps).
CUDNN_MIN_ELEMENTS = 1 << 24
# The same threshold while the native launch path serves (cudnorm._native): its cuDNN call costs
# about PyTorch's host time (0.78-1.04x for LayerNorm/RMSNorm forwards and backwards, 0.64-0.79x
# for AdaLN against the eager formula; lent H100, `cudnorm bench --host-overhead`, call Z), so all but
# the smallest eager calls run on cuDNN. Below 2**16 elements the kernel saves about 1 us of GPU
# time per call, less than the few us of host time cuDNN's execute adds in a host-bound step:
# a one-token Llama decode step (4096-element calls) read 0.95-0.96x with them on cuDNN and
# 1.00x with PyTorch's op, while at 32 tokens (2**17 elements) cuDNN held 0.99-1.00x
# (docs/performance.md, Decisions).
NATIVE_CUDNN_MIN_ELEMENTS = 1 << 16


def torch_serves(input: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether PyTorch's own op should serve this call (rules in the module docstring).
    ``params``: the call's weight-like tensors, the scale first (``weight``, AdaLN's ``scale``)
    and ``None`` for absent ones. Runs on every
    call: attribute reads and one comparison."""
    if not isinstance(input, torch.Tensor):
        return False  # cudnorm's own path raises the argument error
    if input.dtype is torch.float64:
        return True  # rule 0, at every policy
    policy = _settings.current.policy
    if policy == "cudnn":
        return False
    for p in params:
        if p is not None and p.dtype is not input.dtype:
            return _mixed_off_cuda(input, params)
    if _entry.pending and input.is_cuda:  # the size rule reads whether the native path serves: try it first
        _entry.try_native(input)
    return policy == "torch" or prefers_torch(type(input) is torch.Tensor and input.is_cuda, input.numel())


def _mixed_off_cuda(input: torch.Tensor, params) -> bool:
    """Rule 1 for half-precision input with fp32 weights: a plain tensor off CUDA (a CPU one)
    takes PyTorch's mixed-dtype kernels, which compute in fp32, at PyTorch's cost, where they
    finish both the forward and the backward. Where they do not, cudnorm's own path serves the
    call: one weight fp32 and another not (the forward refuses the mix), and an fp32 shift
    without a scale (``params[0]``: LayerNorm's bias without a weight), whose forward runs but
    whose backward raises "expected scalar type BFloat16 but found Float" (CPU, torch 2.13;
    tests/test_mixed_dtypes.py checks this rule against PyTorch's ops)."""
    return (type(input) is torch.Tensor and not input.is_cuda and params[0] is not None
            and all(p is None or p.dtype is _F32 for p in params))


def prefers_torch(plain_cuda: bool, numel: int) -> bool:
    """Rules 1-3 of the module docstring for a call whose weights have the input's dtype:
    ``plain_cuda``, the input is a plain CUDA tensor; ``numel``, its element count. While the
    native path serves, a call it hands to Python (to run cudnorm's own kernel) was past its
    threshold already."""
    return not plain_cuda or torch.compiler.is_compiling() or numel < (
        NATIVE_CUDNN_MIN_ELEMENTS if _entry.native else CUDNN_MIN_ELEMENTS)
