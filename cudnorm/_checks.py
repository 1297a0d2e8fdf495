"""Argument checks shared by every public op: one message style, naming the op and argument.

Every check runs before any kernel is launched (and at trace time under ``torch.compile``),
so a bad call raises ``TypeError``/``ValueError`` instead of a CUDA fault or a wrong answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import _ops
from ._runtime import SUPPORTED_DTYPES

#: Input dtypes the public ops take: cuDNN's, plus float64, which PyTorch's own ops serve
#: (cuDNN has no double-precision normalization; cudnorm._policy, rule 0).
INPUT_DTYPES = (*SUPPORTED_DTYPES, torch.float64)


_ERRORS = {"TypeError": TypeError, "ValueError": ValueError}


def _raise_argument_error(like, kind: str, message: str):
    raise _ERRORS[kind](message)


def _fake_argument_error(like, kind: str, message: str):
    return torch.empty(0) if like is None else torch.empty_like(like)


# An argument error found while torch.compile traces a call, raised when the compiled code runs:
# the error eager raises, with its message. Raised while tracing it would not be: Dynamo reports a
# mistake its fake tensors meet as TorchRuntimeError, and under fullgraph=True any exception the
# traced code raises as Unsupported ("Observed exception", torch 2.13). A side effect, so that
# dead-code elimination keeps it where the result goes unused.
_argument_error = _ops.define_op("argument_error", "(Tensor? like, str kind, str message) -> Tensor",
                                 _raise_argument_error, _fake_argument_error)
torch.fx.node.has_side_effect(_argument_error)


def traced_error(check, input, *args) -> torch.Tensor | None:
    """Under ``torch.compile``: run the argument check ``check(*args)`` in the traced code (plain
    Python on shapes and dtypes, which Dynamo traces) before any PyTorch op meets the
    arguments. ``None`` when the call is valid; otherwise an ``input``-like tensor from an op
    that raises the check's ``TypeError``/``ValueError`` when the compiled code runs: return it
    as the call's result."""
    try:
        check(*args)
    except (TypeError, ValueError) as error:
        like = input.detach() if isinstance(input, torch.Tensor) else None  # no gradient: the op raises
        return _argument_error(like, type(error).__name__, str(error))
    return None


def dims(shape) -> str:
    """``shape`` written as its tuple, for an error message. Built from f-strings of ints: a
    traced call's symbolic sizes (dynamic shapes) are specialised, so the message is a constant
    the compiled code can carry (Dynamo cannot format a tuple of them)."""
    text = ""
    for d in shape:
        text = f"{text}, {int(d)}" if text else f"{int(d)}"
    return f"({text},)" if len(shape) == 1 else f"({text})"


def _fail(exc_type, op: str, arg: str, message: str):
    raise exc_type(f"cudnorm.{op}: argument '{arg}' {message}")


def check_tensor(op: str, arg: str, value, *, dtypes=SUPPORTED_DTYPES) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        _fail(TypeError, op, arg, f"must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        _fail(TypeError, op, arg, f"has dtype {value.dtype}; supported: {names}")
    return value


def check_input(op: str, value) -> torch.Tensor:
    """A tensor of a dtype the ops take; an empty one (no rows) is valid and gives an empty result."""
    return check_tensor(op, "input", value, dtypes=INPUT_DTYPES)


def normalized_size(op: str, input: torch.Tensor, normalized_shape) -> tuple[tuple[int, ...], int]:
    """Validate ``normalized_shape`` against ``input``; return it as a tuple and its product."""
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        shape = (normalized_shape,)
    elif isinstance(normalized_shape, (Sequence, torch.Size)) and not isinstance(normalized_shape, str) and all(
            isinstance(d, int) and not isinstance(d, bool) for d in normalized_shape):
        shape = tuple(normalized_shape)
    else:
        _fail(TypeError, op, "normalized_shape", f"must be an int or a sequence of ints, got {normalized_shape!r}")
    if not shape or any(d <= 0 for d in shape):
        _fail(ValueError, op, "normalized_shape", f"must be non-empty with positive sizes, got {dims(shape)}")
    if input.dim() < len(shape) or tuple(input.shape[input.dim() - len(shape):]) != shape:
        _fail(ValueError, op, "normalized_shape",
              f"{dims(shape)} does not match the trailing dims of input of shape {dims(input.shape)}")
    return shape, math.prod(shape)


def check_param(op: str, arg: str, value, input: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """Weight/bias: shape ``normalized_shape``, dtype float32 or the input's (the input's only
    for a float64 input, as PyTorch's ops require), same device."""
    if value is None:
        return None
    check_tensor(op, arg, value, dtypes=param_dtypes(input.dtype))
    if tuple(value.shape) != shape:
        _fail(ValueError, op, arg, f"has shape {dims(value.shape)} but normalized_shape is {dims(shape)}")
    check_same_device(op, arg, value, input)
    return value


def param_dtypes(input_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """Dtypes a weight-like argument may have for an input of ``input_dtype``."""
    return (input_dtype,) if input_dtype is torch.float64 else tuple(dict.fromkeys((input_dtype, torch.float32)))


def check_same_device(op: str, arg: str, value: torch.Tensor, input: torch.Tensor) -> None:
    if value.device != input.device:
        _fail(ValueError, op, arg, f"is on {value.device} but input is on {input.device}")


def check_width(op: str, arg: str, value, dim: int) -> torch.Tensor:
    """An input of a module built for ``dim`` features: a tensor of a supported dtype,
    ``[B, *, dim]`` (at least 2-D)."""
    check_input(op, value)
    if value.dim() < 2 or value.shape[-1] != dim:
        _fail(ValueError, op, arg, f"has shape {dims(value.shape)}; expected [B, *, {dim}] (the module's dim is {dim})")
    return value


def check_conditioning(op: str, arg: str, value, input: torch.Tensor, cond_dim: int) -> torch.Tensor:
    """A conditioning embedding: ``[B, cond_dim]`` with ``input``'s batch size ``B``."""
    check_input(op, value)
    if value.dim() != 2 or value.shape[0] != input.shape[0] or value.shape[1] != cond_dim:
        _fail(ValueError, op, arg, f"has shape {dims(value.shape)}; expected [B, cond_dim] = "
                                   f"[{int(input.shape[0])}, {cond_dim}] for input of shape {dims(input.shape)}")
    return value


def check_eps(op: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        _fail(TypeError, op, "eps", f"must be a float, got {type(eps).__name__}")
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        _fail(ValueError, op, "eps", f"must be finite and >= 0, got {eps}")
    return eps


def check_offset(op: str, offset) -> float:
    """A weight offset (``weight_offset=``): a finite real number."""
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        _fail(TypeError, op, "weight_offset", f"must be a float, got {type(offset).__name__}")
    offset = float(offset)
    if not math.isfinite(offset):
        _fail(ValueError, op, "weight_offset", f"must be finite, got {offset}")
    return offset


def check_residual(op: str, residual, input: torch.Tensor) -> torch.Tensor:
    """A residual (``residual=``): a tensor of ``input``'s shape, dtype and device."""
    if type(residual) is torch.Tensor and residual.shape == input.shape and residual.dtype is input.dtype and (
            residual.device == input.device):
        return residual  # the common case: three comparisons
    check_tensor(op, "residual", residual, dtypes=INPUT_DTYPES)
    if residual.shape != input.shape:
        _fail(ValueError, op, "residual", f"has shape {dims(residual.shape)} but input has shape {dims(input.shape)}")
    if residual.dtype is not input.dtype:
        _fail(TypeError, op, "residual", f"has dtype {residual.dtype} but input has dtype {input.dtype}")
    check_same_device(op, "residual", residual, input)
    return residual


_FAST_DTYPES = frozenset(SUPPORTED_DTYPES)
_F32 = torch.float32


def norm_call(op: str, input, normalized_shape, params: dict, eps) -> tuple[int, float]:
    """Validate a whole norm call; return ``(N, eps)`` where ``N = prod(normalized_shape)``.

    The common case costs a few attribute reads (this runs on every call, and the whole
    call budget is ~20 us); anything unusual goes through the detailed checks above, which
    raise the descriptive error.
    """
    try:
        shape = (normalized_shape,) if type(normalized_shape) is int else tuple(normalized_shape)
        fast = (isinstance(input, torch.Tensor) and input.dtype in _FAST_DTYPES and 0 < len(shape) <= input.dim()
                and all(type(d) is int for d in shape)
                and input.shape[-len(shape):] == shape and input.numel() > 0
                and type(eps) is float and 0.0 <= eps < math.inf)
        if fast:
            for p in params.values():
                if p is not None and (p.shape != shape or (p.dtype is not input.dtype and p.dtype is not _F32)
                                      or p.get_device() != input.get_device() or p.is_meta != input.is_meta):
                    fast = False
                    break
    except (AttributeError, TypeError):  # a non-tensor weight, a non-iterable shape: the checks below
        fast = False
    if fast:
        return math.prod(shape), eps
    check_input(op, input)
    shape, n = normalized_size(op, input, normalized_shape)
    for name, p in params.items():
        check_param(op, name, p, input, shape)
    return n, check_eps(op, eps)


def rows(op: str, arg: str, value: torch.Tensor, n: int) -> torch.Tensor:
    """``value: [*, N]`` as ``[M, N]`` rows (a view where its strides allow), the layout
    cudnorm's ops take. A DTensor that this torch cannot flatten (a sequence shard before
    torch 2.13, a batch that does not divide over the mesh) raises ``ValueError`` naming the
    op, the argument and the ways out, instead of DTensor's own message."""
    try:
        return value.reshape(-1, n)
    except RuntimeError as error:
        placements = getattr(value, "placements", None)
        if placements is None:  # not a DTensor: not ours to explain
            raise
        raise ValueError(
            f"cudnorm.{op}: argument '{arg}' is a DTensor of shape {tuple(value.shape)} placed "
            f"{list(placements)}, which torch {torch.__version__} cannot flatten into the rows of "
            f"cudnorm's op ({str(error).splitlines()[0]}); PyTorch's own op takes it: the default "
            "policy='auto' hands DTensors to it when the parameters have the input's dtype; or shard a dim "
            "that divides evenly over the mesh (torch >= 2.13 flattens sequence shards)") from error
