"""From a call's tensors to what a graph reads: the spec and the buffers.

* :func:`spec_for` makes a call's :class:`NormSpec` (with the autotune choice).
* :func:`forward_params` decides which scale/bias buffers the forward graph reads. With
  fp32 master weights and half-precision activations it rounds them to the activation
  dtype, because cuDNN 9.19 serves an fp32 scale only on a generic engine 3-4x slower
  (see docs/concepts.md, "fp32 weights"); the backward reads the fp32 weight unchanged.
* Policies come from the configuration (:class:`cudnorm.Config`): ``autotune`` and
  ``fp32_weight_fwd``.

Everything here runs on every call: keep it to attribute reads and dictionary lookups.
"""

from __future__ import annotations

import torch

from . import _lru, _runtime, _settings
from ._spec import NormSpec

# Autotuning times every candidate plan once per spec; it pays where a call is long enough
# for a 1.1-1.5x plan difference to outweigh a few hundred ms of tuning (facts section 2;
# docs/performance.md, Decisions).
AUTOTUNE_MIN_ELEMENTS = 1 << 22
# Forwards up to this many elements are tuned. At 32768 x 32768 (= 2**30) tuning took 8-12 s
# and gained 1.22x on RMSNorm (3147 -> 3839 GB/s, H200); at 2**31 (16384 x 131072,
# 8192 x 262144) it took 36-103 s per graph for <= 1.01x, so those keep the first plan
# (docs/performance.md, Decisions).
AUTOTUNE_MAX_ELEMENTS = 1 << 30
# LayerNorm backwards of these widths are tuned too (from AUTOTUNE_MIN_ELEMENTS): on a lent
# H100 the heuristics' first plan took 353 us at 32768 x 4096 and 720 us at 32768 x 8192
# against 279 and 562 for the tuned plan (1.27-1.28x); at 1024, 2048 and 16384 columns, and
# for every RMSNorm backward measured (1024-4096), the tuned plan was no faster, up to 18%
# slower (RMSNorm 2048) (docs/performance.md, Decisions)
TUNED_LAYER_NORM_BACKWARD_COLS = (4096, 8192)
# Forwards with at least this many columns run PyTorch's fused kernel instead of cuDNN's graph
# (issue 4 allows a PyTorch kernel where it is measured faster). H200, bf16 x, fp32 weights
# rounded to bf16, ``cudnorm bench`` (benchmarks/results/nvidia-h200/bench.csv): at
# 8192 x 262144 the LayerNorm forward took 12.8 ms on cuDNN's plan (16% of copy; no other
# candidate plan was faster) against 3.9 ms for PyTorch's kernel, the RMSNorm forward 3.8 vs
# 3.3 ms. At 16384 x 131072 cuDNN was faster for both (3240 vs 2294 and 3857 vs 2636 GB/s).
# Evidence and commands: docs/performance.md, Decisions.
NATIVE_FORWARD_MIN_COLS = 1 << 18
_F32 = torch.float32
_new_tuple = tuple.__new__

def autotune_wanted(op: str, phase: str, rows: int, cols: int) -> bool:
    """Whether a new graph for this call should be autotuned (``Config.autotune``)."""
    mode = _settings.current.autotune
    if mode == "auto":
        # Not cuDNN's AdaLN forward graph: with every plan timed, its first plan was the fastest
        # at three DiT shapes, and one tuning at 16x4096x3072 picked a plan 14% slower (0.308
        # vs 0.270 ms; H200; docs/performance.md, Decisions)
        if phase == "bwd" and not (op == "layer_norm" and TUNED_LAYER_NORM_BACKWARD_COLS[0] <= cols
                                   <= TUNED_LAYER_NORM_BACKWARD_COLS[1]):
            return False
        return op != "ada_layer_norm" and AUTOTUNE_MIN_ELEMENTS <= rows * cols <= AUTOTUNE_MAX_ELEMENTS
    return mode == "on"


def spec_for(op: str, phase: str, x: torch.Tensor, scale_dtype: torch.dtype, device_index: int,
             batch: int = 1, offset: bool = False, residual: bool = False) -> NormSpec:
    """The one place a call's :class:`NormSpec` is made: ``x`` is the ``[rows, N]`` view
    the graph reads (real or meta tensor). The ops and ``cudnorm.warmup`` both use it, so a
    warmed-up spec is exactly the one a later call asks for. ``scale_dtype`` is the dtype
    the graph reads the scale in (a backward also writes dW/dB in it); ``offset``: the graph
    scales by ``weight + offset`` (a nonzero weight offset); ``residual``: a fused residual add."""
    rows, cols = x.shape
    # tuple.__new__ skips NormSpec.__new__'s defaults handling: this runs on every call
    return _new_tuple(NormSpec, (op, phase, rows, cols, x.dtype, scale_dtype, device_index, x.stride(0), batch,
                                 autotune_wanted(op, phase, rows, cols), False, offset, residual))


def native_forward(x: torch.Tensor) -> bool:
    """Whether the forward of ``x: [M, N]`` runs PyTorch's fused kernel (measured faster than
    cuDNN from :data:`NATIVE_FORWARD_MIN_COLS` columns); the backward stays on cuDNN."""
    return x.shape[-1] >= NATIVE_FORWARD_MIN_COLS


def forward_param_dtype(x: torch.Tensor, param: torch.Tensor) -> torch.dtype:
    """The dtype a forward uses for ``param`` (weight/bias/AdaLN scale): fp32 parameters
    of a half-precision input are rounded to the input's dtype unless
    ``Config.fp32_weight_fwd`` is ``"native"``. The PyTorch fallback follows the same rule, so
    both paths compute the same function."""
    if param.dtype is _F32 and x.dtype is not _F32 and _settings.current.fp32_weight_fwd == "round":
        return x.dtype
    return param.dtype


def forward_params(x: torch.Tensor, weight, bias, *, has_bias: bool):
    """``(scale, bias, scale_dtype)`` buffers for a forward graph on ``x: [M, N]``.

    Scale and bias share one dtype (``x.dtype``, or fp32 in ``native`` mode when a
    parameter is fp32). Absent weight/bias become cached ones/zeros so one graph
    formulation serves every affine variant (the extra ``N``-element read is negligible).
    Parameters of another dtype are rounded into this thread's per-stream rounding rows
    (:func:`cudnorm._runtime.rounding_rows`) by one kernel; ``x`` may also be a meta tensor
    (``cudnorm.warmup`` asks for the dtype only), then fresh buffers are made.
    """
    dtype = x.dtype
    if dtype is not _F32 and _settings.current.fp32_weight_fwd == "native" and (
            (weight is not None and weight.dtype is _F32) or (bias is not None and bias.dtype is _F32)):
        dtype = _F32
    n = x.shape[-1]
    round_weight = weight is not None and weight.dtype is not dtype
    round_bias = has_bias and bias is not None and bias.dtype is not dtype
    scale, shift = weight, bias
    if round_weight or round_bias:  # only those of another dtype; the other one is read as it is
        rounded_weight, rounded_bias = _rounded(x, n, dtype, weight if round_weight else None,
                                                bias if round_bias else None)
        scale = rounded_weight if round_weight else weight
        shift = rounded_bias if round_bias else bias
    if scale is None:
        scale = constant(1.0, n, dtype, x.device)
    if has_bias and shift is None:
        shift = constant(0.0, n, dtype, x.device)
    return scale, shift, dtype


def backward_scale_dtype(weight: torch.Tensor | None) -> torch.dtype:
    """The dtype a LayerNorm/RMSNorm backward graph reads the weight in and writes dW/dB in:
    the weight's own (fp32 when there is none: the graph then reads cached fp32 ones)."""
    return _F32 if weight is None else weight.dtype


def _rounded(x: torch.Tensor, n: int, dtype: torch.dtype, weight, bias):
    """``(weight, bias)`` converted to ``dtype`` (``None`` stays ``None``), both in one
    multi-tensor kernel when both are given. On CUDA they land in the stream's rounding rows,
    16-byte aligned as cuDNN requires."""
    if x.is_cuda:
        scale_row, shift_row = _runtime.rounding_rows(x.get_device(), n, dtype)
    else:
        scale_row, shift_row = torch.empty((2, n), dtype=dtype, device=x.device).unbind(0)
    if weight is not None and bias is not None:
        torch._foreach_copy_([scale_row, shift_row], [weight, bias])
        return scale_row, shift_row
    if weight is not None:
        return scale_row.copy_(weight), None
    return None, shift_row.copy_(bias)


_constants = _lru.LRU("constant_vectors", 64)


def constant(value: float, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached read-only vector filled with ``value`` (stands in for an absent weight/bias).
    On CUDA it comes from :func:`cudnorm._runtime.kept_full` (kept buffers must stay out of
    CUDA-graph pools); while the stream is being captured a fresh one comes from the graph's pool."""
    key = (value, n, dtype, device)
    tensor = _constants.get(key)
    if tensor is not None:
        return tensor
    device = torch.device(device)
    if device.type != "cuda":
        tensor = torch.full((n,), value, dtype=dtype, device=device)
    elif _runtime.capturing():
        return torch.full((n,), value, dtype=dtype, device=device)
    else:
        tensor = _runtime.kept_full(device.index if device.index is not None else torch.cuda.current_device(),
                                    n, value, dtype)
    _constants.put(key, tensor)
    return tensor


def cudnn_rows(x: torch.Tensor) -> torch.Tensor:
    """``x: [rows, N]`` in a layout cuDNN takes: packed rows (row stride N, unit column
    stride) at a 16-byte aligned address. Copies only when ``x`` is not already so (run
    inside the ops, on real tensors: the pointer is not known while tracing). Padded rows
    (a slice of a wider buffer) are copied too: cuDNN 9.19 declines a norm graph whose ``x``
    rows lie further apart than its output's (``CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH``,
    ``!xDesc.hasSameShape(&yDesc)``), and PyTorch's own kernels copy such an input as well."""
    if x.shape[0] == 1 and x.stride(0) != x.shape[1] and x.stride(1) == 1:
        x = x.as_strided(x.shape, (x.shape[1], 1))  # one row: its row stride means nothing
    if x.stride(1) != 1 or x.stride(0) != x.shape[1]:
        x = x.contiguous()
    if x.data_ptr() % 16:  # e.g. a view starting mid-row: contiguous() would return it as is
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def stats_buffer(rows: int, count: int, device: torch.device) -> torch.Tensor:
    """Fresh fp32 ``[count, ceil4(rows)]`` statistics (LayerNorm/AdaLN: mean, rstd): one
    allocation whose rows each start 16-byte aligned, as cuDNN's descriptors require. A
    forward's statistics live in one buffer because an allocation costs 3-5 us of host time."""
    return torch.empty((count, -(-rows // 4) * 4), dtype=_F32, device=device)


def is_packed(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous with a 16-byte aligned address, as cuDNN's tensor
    descriptors promise (``dy`` from autograd, or a chunk of a Linear output, may be neither)."""
    return t.is_contiguous() and not t.data_ptr() & 15


def packed(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when :func:`is_packed`, else a packed copy."""
    return t if is_packed(t) else t.clone(memory_format=torch.contiguous_format)
