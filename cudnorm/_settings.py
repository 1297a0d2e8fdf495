"""Environment settings, read once when cudnorm is imported (per-call reads would cost
microseconds on every op). After changing ``os.environ`` in a running process, call
:func:`reload`.

==========================  =================================================================
``CUDNORM_DISABLE_CUDNN``    ``1``: run PyTorch's kernels everywhere
``CUDNORM_AUTOTUNE``         ``auto`` (default: time candidate plans for large forwards),
                             ``1`` (every graph), ``0`` (never: heuristics' first plan)
``CUDNORM_FP32_WEIGHT_FWD``  ``round`` (default: fp32 weights of a half-precision input are
                             rounded to its dtype for the forward), ``native`` (the forward
                             reads fp32 weights: cuDNN 9.19's slow generic engine)
``CUDNORM_CACHE_SIZE``       plans kept in memory (default 512)
==========================  =================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_CHOICES = {"CUDNORM_AUTOTUNE": {"auto": "auto", "1": "on", "on": "on", "true": "on", "yes": "on", "always": "on",
                                 "0": "off", "off": "off", "false": "off", "no": "off", "never": "off"},
            "CUDNORM_FP32_WEIGHT_FWD": {"round": "round", "native": "native"}}


@dataclass(frozen=True)
class Settings:
    disable_cudnn: bool
    autotune: str  # "auto" | "on" | "off"
    fp32_weight_fwd: str  # "round" | "native"
    cache_size: int


def _choice(name: str, default: str) -> str:
    raw = os.environ.get(name, default).strip().lower()
    try:
        return _CHOICES[name][raw]
    except KeyError:
        raise ValueError(f"cudnorm: {name} must be one of {sorted(set(_CHOICES[name]))}, got {raw!r}") from None


def _read() -> Settings:
    raw_size = os.environ.get("CUDNORM_CACHE_SIZE", "512")
    try:
        size = int(raw_size)
    except ValueError:
        raise ValueError(f"cudnorm: CUDNORM_CACHE_SIZE must be an integer, got {raw_size!r}") from None
    if size < 1:
        raise ValueError(f"cudnorm: CUDNORM_CACHE_SIZE must be >= 1, got {size}")
    return Settings(
        disable_cudnn=os.environ.get("CUDNORM_DISABLE_CUDNN", "").strip().lower() in ("1", "true", "yes", "on"),
        autotune=_choice("CUDNORM_AUTOTUNE", "auto"),
        fp32_weight_fwd=_choice("CUDNORM_FP32_WEIGHT_FWD", "round"),
        cache_size=size,
    )


current = _read()


def reload() -> Settings:
    """Re-read the environment (and resize the plan cache to ``CUDNORM_CACHE_SIZE``)."""
    global current
    current = _read()
    from . import _cache  # noqa: PLC0415 - _cache imports this module

    _cache.plans.resize(current.cache_size)
    return current
