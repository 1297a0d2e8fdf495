"""What identifies a cuDNN norm graph: ``NormSpec``, the one cache key of the library.

A spec holds everything that changes the compiled graph (op, phase, shape, layout, dtypes,
device, options) and nothing that does not: eps is passed by value at execute time and is
deliberately *not* part of the key, so modules with different eps share graphs.
"""

from __future__ import annotations

from collections import namedtuple

import torch

OPS = ("layer_norm", "rms_norm", "ada_layer_norm")
PHASES = ("train", "infer", "bwd")

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_DTYPES_BY_NAME = {v: k for k, v in _DTYPE_NAMES.items()}


_FIELDS = ("op", "phase", "rows", "cols", "x_dtype", "scale_dtype", "device_index", "x_row_stride", "batch",
           "autotune", "dynamic", "offset", "residual")
_INT_FIELDS = ("rows", "cols", "device_index", "x_row_stride", "batch")  # device_index may be None: no CUDA device
_FLAG_FIELDS = ("autotune", "dynamic", "offset", "residual")


class NormSpec(namedtuple("_NormSpecFields", _FIELDS)):
    """One cuDNN norm graph. A tuple, so building and hashing it on every call is cheap
    (about 1 us, a third of a dataclass's).

    Shapes: ``x`` is viewed as ``[rows, cols]`` (LayerNorm/RMSNorm) or
    ``[batch, rows // batch, cols]`` (AdaLN, per-sample scale/shift ``[batch, 1, cols]``).

    Attributes:
        op: ``"layer_norm"``, ``"rms_norm"`` or ``"ada_layer_norm"``.
        phase: ``"train"`` (forward writing fp32 mean/rstd), ``"infer"`` (forward, no
            stats) or ``"bwd"``.
        rows: rows normalised independently (product of the leading dims).
        cols: size of the normalised (trailing) dims.
        x_dtype: activation dtype (fp16, bf16, fp32); y/dx/dy share it.
        scale_dtype: dtype of the scale (and bias) buffer as it lies in memory.
        device_index: CUDA device ordinal.
        x_row_stride: elements between consecutive rows of ``x`` (``None`` -> ``cols``, packed).
        batch: AdaLN batch size ``B`` (1 for the other ops).
        autotune: plans were timed and the fastest kept, rather than heuristics' first.
        dynamic: built as a dynamic-shape graph sharing a kernel cache with its siblings
            (the row-chunk graphs of :mod:`cudnorm._rows`: later builds reuse compiled kernels).
        offset: the graph scales by ``weight + offset`` (Gemma's RMSNorm: ``1 + weight``),
            the offset a pass-by-value input added inside the graph in fp32, so no kernel
            runs before the launch (cuDNN takes only an offset of 1.0).
        residual: a forward with a fused residual add: the graph reads ``residual``
            (``[rows, cols]``, packed), writes ``h = x + residual`` and normalises ``h``
            (the backward is the plain one on ``h``: cuDNN declines an add after it).
    """

    __slots__ = ()

    def __new__(cls, op, phase, rows, cols, x_dtype, scale_dtype, device_index, x_row_stride=None, batch=1,
                autotune=False, dynamic=False, offset=False, residual=False):
        return tuple.__new__(cls, (op, phase, rows, cols, x_dtype, scale_dtype, device_index,
                                   cols if x_row_stride is None else x_row_stride, batch, autotune, dynamic, offset,
                                   residual))

    def validate(self) -> "NormSpec":
        """Raise ``ValueError`` for a field of the wrong type, an unknown op/phase or a shape
        that is not positive (a spec read from a file is checked field by field)."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if type(value) is not int and not (name == "device_index" and value is None):
                raise ValueError(f"cudnorm: NormSpec field {name!r} must be an int, got {value!r}")
        for name in _FLAG_FIELDS:
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"cudnorm: NormSpec field {name!r} must be a bool, got {getattr(self, name)!r}")
        for name in ("x_dtype", "scale_dtype"):
            if not isinstance(getattr(self, name), torch.dtype) or getattr(self, name) not in _DTYPE_NAMES:
                raise ValueError(f"cudnorm: NormSpec field {name!r} must be one of {sorted(_DTYPES_BY_NAME)}, "
                                 f"got {getattr(self, name)!r}")
        if self.device_index is not None and self.device_index < 0:
            raise ValueError(f"cudnorm: NormSpec field 'device_index' must be >= 0, got {self.device_index}")
        if self.op not in OPS:
            raise ValueError(f"cudnorm: unknown op {self.op!r}; expected one of {OPS}")
        if self.phase not in PHASES:
            raise ValueError(f"cudnorm: unknown phase {self.phase!r}; expected one of {PHASES}")
        if self.offset and self.op == "ada_layer_norm":
            raise ValueError("cudnorm: a weight offset is for LayerNorm/RMSNorm graphs, not AdaLN")
        if self.residual and (self.op == "ada_layer_norm" or self.phase == "bwd"):
            raise ValueError("cudnorm: a fused residual add is for LayerNorm/RMSNorm forward graphs")
        if min(self.rows, self.cols, self.batch) < 1 or self.rows % self.batch or self.x_row_stride < self.cols:
            raise ValueError(f"cudnorm: inconsistent NormSpec sizes {self!r}")
        return self

    @property
    def seq(self) -> int:
        """Tokens per sample for AdaLN (``rows // batch``)."""
        return self.rows // self.batch

    def to_json(self) -> dict:
        """A JSON-able dict (dtypes by name); inverse of :meth:`from_json`."""
        d = self._asdict()
        d["x_dtype"] = _DTYPE_NAMES[self.x_dtype]
        d["scale_dtype"] = _DTYPE_NAMES[self.scale_dtype]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "NormSpec":
        unknown = set(d) - set(_FIELDS)
        if unknown:
            raise ValueError(f"cudnorm: unknown NormSpec field(s) {sorted(unknown)}")
        d = dict(d)
        d["x_dtype"] = dtype_from_name(d["x_dtype"])
        d["scale_dtype"] = dtype_from_name(d["scale_dtype"])
        return cls(**d).validate()

    def slug(self) -> str:
        """A short stable text form, used in file names and tables."""
        parts = [self.op, self.phase, f"{self.rows}x{self.cols}", _DTYPE_NAMES[self.x_dtype],
                 f"s{_DTYPE_NAMES[self.scale_dtype]}", f"cuda{self.device_index}"]
        if self.x_row_stride != self.cols:
            parts.append(f"rs{self.x_row_stride}")
        if self.batch != 1:
            parts.append(f"b{self.batch}")
        if self.autotune:
            parts.append("autotune")
        if self.dynamic:
            parts.append("dynamic")
        if self.offset:
            parts.append("offset")
        if self.residual:
            parts.append("residual")
        return "-".join(parts)


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES_BY_NAME[name]
    except (KeyError, TypeError):  # TypeError: an unhashable value read from a file
        raise ValueError(f"cudnorm: unsupported dtype name {name!r}; expected one of {sorted(_DTYPES_BY_NAME)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]
