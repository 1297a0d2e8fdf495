"""What identifies a cuDNN norm graph: ``NormSpec``, the one cache key of the library.

A spec holds everything that changes the compiled graph (op, phase, shape, layout, dtypes,
device, options) and nothing that does not: eps is passed by value at execute time and is
deliberately *not* part of the key, so modules with different eps share graphs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch

OPS = ("layer_norm", "rms_norm", "ada_layer_norm")
PHASES = ("train", "infer", "bwd")

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_DTYPES_BY_NAME = {v: k for k, v in _DTYPE_NAMES.items()}


@dataclass(frozen=True)
class NormSpec:
    """One cuDNN norm graph.

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
        x_row_stride: elements between consecutive rows of ``x`` (``cols`` when packed).
        batch: AdaLN batch size ``B`` (1 for the other ops).
        scale_cast: the graph casts an fp32 scale/bias to ``x_dtype`` itself (forward).
        dit: AdaLN uses ``1 + scale`` (the DiT ``modulate`` convention), added in-graph.
        autotune: plans were timed and the fastest kept, rather than heuristics' first.
    """

    op: str
    phase: str
    rows: int
    cols: int
    x_dtype: torch.dtype
    scale_dtype: torch.dtype
    device_index: int
    x_row_stride: int = -1
    batch: int = 1
    scale_cast: bool = False
    dit: bool = False
    autotune: bool = False

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"cudnorm: unknown op {self.op!r}; expected one of {OPS}")
        if self.phase not in PHASES:
            raise ValueError(f"cudnorm: unknown phase {self.phase!r}; expected one of {PHASES}")
        if self.x_row_stride == -1:
            object.__setattr__(self, "x_row_stride", self.cols)

    @property
    def seq(self) -> int:
        """Tokens per sample for AdaLN (``rows // batch``)."""
        return self.rows // self.batch

    def with_rows(self, rows: int) -> "NormSpec":
        """The same graph for another row count (packed rows)."""
        return replace(self, rows=rows, x_row_stride=self.cols, batch=1 if self.op != "ada_layer_norm" else self.batch)

    def to_json(self) -> dict:
        """A JSON-able dict (dtypes by name); inverse of :meth:`from_json`."""
        d = asdict(self)
        d["x_dtype"] = _DTYPE_NAMES[self.x_dtype]
        d["scale_dtype"] = _DTYPE_NAMES[self.scale_dtype]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "NormSpec":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"cudnorm: unknown NormSpec field(s) {sorted(unknown)}")
        d = dict(d)
        d["x_dtype"] = dtype_from_name(d["x_dtype"])
        d["scale_dtype"] = dtype_from_name(d["scale_dtype"])
        return cls(**d)

    def slug(self) -> str:
        """A short stable text form, used in file names and tables."""
        parts = [self.op, self.phase, f"{self.rows}x{self.cols}", _DTYPE_NAMES[self.x_dtype],
                 f"s{_DTYPE_NAMES[self.scale_dtype]}", f"cuda{self.device_index}"]
        if self.x_row_stride != self.cols:
            parts.append(f"rs{self.x_row_stride}")
        if self.batch != 1:
            parts.append(f"b{self.batch}")
        for flag in ("scale_cast", "dit", "autotune"):
            if getattr(self, flag):
                parts.append(flag)
        return "-".join(parts)


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES_BY_NAME[name]
    except KeyError:
        raise ValueError(f"cudnorm: unsupported dtype name {name!r}; expected one of {sorted(_DTYPES_BY_NAME)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]
