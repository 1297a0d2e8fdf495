"""Environment settings, read once when cudnorm is imported (per-call reads would cost
microseconds on every op). After changing ``os.environ`` in a running process, call
:func:`reload`.

==========================  =================================================================
``CUDNORM_DISABLE_CUDNN``    ``1``: run PyTorch's kernels everywhere
``CUDNORM_POLICY``           ``auto`` (default): PyTorch's own ops serve CUDA calls where they
                             make models faster (small calls, ``torch.compile``;
                             :mod:`cudnorm._policy`); ``cudnn``: cuDNN wherever it can serve
``CUDNORM_AUTOTUNE``         ``auto`` (default: time candidate plans for large forwards),
                             ``1`` (every graph), ``0`` (never: heuristics' first plan)
``CUDNORM_AUTOTUNE_CANDIDATES``  candidate plans autotuning times, heuristics' order
                             (default 8; ``all``: every candidate, 25-28 for LN/RMS forwards,
                             16-39 s per graph at 32768 x 8192..32768 on an H200)
``CUDNORM_FP32_WEIGHT_FWD``  ``round`` (default: fp32 weights of a half-precision input are
                             rounded to its dtype for the forward), ``native`` (the forward
                             reads fp32 weights: cuDNN 9.19's slow generic engine)
``CUDNORM_CACHE_SIZE``       plans kept in memory (default 512)
``CUDNORM_EXACT_ROWS``       row counts per norm family that may get their own graphs
                             (default 1); other counts run on shared row-chunk graphs
``CUDNORM_EXACT_AFTER``      calls at one row count before it gets its own graphs (default 1;
                             ``cudnorm._rows``)
``CUDNORM_ADA_FWD``          AdaLN forward strategy: ``auto`` (default: the rule table in
                             ``cudnorm.ada_layer_norm``), ``cudnn``, ``per_sample``, ``torch``
``CUDNORM_ADA_BWD``          AdaLN backward strategy: ``auto`` (default), ``cudnn``,
                             ``per_sample``, ``torch``
``CUDNORM_RAW_EXECUTE``      ``1`` (default): launch plans through the frontend's raw-pointer
                             execute where the frontend version was verified for it
                             (``cudnorm._graphs``); ``0``: always the public ``execute``
==========================  =================================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass

_CHOICES = {"CUDNORM_AUTOTUNE": {"auto": "auto", "1": "on", "on": "on", "true": "on", "yes": "on", "always": "on",
                                 "0": "off", "off": "off", "false": "off", "no": "off", "never": "off"},
            "CUDNORM_FP32_WEIGHT_FWD": {"round": "round", "native": "native"},
            "CUDNORM_POLICY": {"auto": "auto", "cudnn": "cudnn"},
            "CUDNORM_ADA_FWD": {name: name for name in ("auto", "cudnn", "per_sample", "torch")},
            "CUDNORM_ADA_BWD": {name: name for name in ("auto", "cudnn", "per_sample", "torch")}}


@dataclass(frozen=True)
class Settings:
    disable_cudnn: bool
    policy: str  # "auto" | "cudnn" (cudnorm._policy)
    autotune: str  # "auto" | "on" | "off"
    autotune_candidates: int  # 0: every candidate
    fp32_weight_fwd: str  # "round" | "native"
    cache_size: int
    exact_rows: int
    exact_after: int
    ada_forward: str  # "auto" | an AdaLN forward strategy (cudnorm.ada_layer_norm)
    ada_backward: str  # "auto" | an AdaLN backward strategy
    raw_execute: bool


def _choice(name: str, default: str) -> str:
    raw = os.environ.get(name, default).strip().lower()
    try:
        return _CHOICES[name][raw]
    except KeyError:
        raise ValueError(f"cudnorm: {name} must be one of {sorted(set(_CHOICES[name]))}, got {raw!r}") from None


def _count(name: str, default: str) -> int:
    raw = os.environ.get(name, default).strip()
    if not raw.isdigit():
        raise ValueError(f"cudnorm: {name} must be an integer >= 0, got {raw!r}")
    return int(raw)


def _candidates() -> int:
    name = "CUDNORM_AUTOTUNE_CANDIDATES"
    if os.environ.get(name, "").strip().lower() == "all":
        return 0
    count = _count(name, "8")
    if count < 1:
        raise ValueError(f"cudnorm: {name} must be an integer >= 1 or 'all', got {count}")
    return count


def _read() -> Settings:
    size = _count("CUDNORM_CACHE_SIZE", "512")
    if size < 1:
        raise ValueError(f"cudnorm: CUDNORM_CACHE_SIZE must be >= 1, got {size}")
    return Settings(
        disable_cudnn=os.environ.get("CUDNORM_DISABLE_CUDNN", "").strip().lower() in ("1", "true", "yes", "on"),
        policy=_choice("CUDNORM_POLICY", "auto"),
        autotune=_choice("CUDNORM_AUTOTUNE", "auto"),
        autotune_candidates=_candidates(),
        fp32_weight_fwd=_choice("CUDNORM_FP32_WEIGHT_FWD", "round"),
        cache_size=size,
        exact_rows=_count("CUDNORM_EXACT_ROWS", "1"),
        exact_after=max(1, _count("CUDNORM_EXACT_AFTER", "1")),
        ada_forward=_choice("CUDNORM_ADA_FWD", "auto"),
        ada_backward=_choice("CUDNORM_ADA_BWD", "auto"),
        raw_execute=os.environ.get("CUDNORM_RAW_EXECUTE", "1").strip().lower() not in ("0", "false", "no", "off"),
    )


current = _read()


def reload() -> Settings:
    """Re-read the environment (and resize the plan cache to ``CUDNORM_CACHE_SIZE``)."""
    global current
    current = _read()
    from . import _cache  # noqa: PLC0415 - _cache imports this module

    _cache.plans.resize(current.cache_size)
    return current


_replacements: dict = {}


@contextlib.contextmanager
def replaced(**changes) -> Iterator[Settings]:
    """Run a block with some settings changed (``replaced(policy="cudnn")``), restoring the
    previous settings afterwards; for benchmarks and tests comparing paths in one process."""
    global current
    saved = current
    key = (saved, tuple(sorted(changes.items())))
    # the same object for the same change: compiled code guarding on the settings and the
    # per-device route memo (keyed on this object) stay valid from one block to the next
    current = _replacements.get(key) or _replacements.setdefault(key, dataclasses.replace(saved, **changes))
    try:
        yield current
    finally:
        current = saved
