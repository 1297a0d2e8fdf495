"""What serves each op here, and the cache counters: the answers behind ``cudnorm info``."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import platform

import torch

from . import _cache, _decisions, _entry, _graphs, _lru, _plan_store, _policy, _runtime, _settings
from ._cache import CacheInfo
from ._version import __version__

OPS = ("layer_norm", "rms_norm", "ada_layer_norm")


def cache_info() -> CacheInfo:
    """Counters of the in-memory plan cache: hits, misses, builds, build seconds, plans
    loaded from the on-disk store, specs cuDNN declined, evictions, size and capacity; and
    ``caches``, the size/capacity/hits/misses/evictions of every cache of the package by
    name (plans, call-signature memos, row-count history, constant vectors, host scalars,
    kernel caches). ``hits`` includes the calls the native launch path served from its
    table of resolved call signatures (``caches["native"]``: its calls served, signatures
    resolved, recipes and plans held)."""
    info = _cache.plans.info()
    counters = _entry.counters() if _entry.counters is not None else {}
    if counters:
        info.hits += counters["hits"]
        info.caches["native"] = counters
    return info


def clear_cache() -> None:
    """Empty every cache of the package (:func:`cudnorm._lru.registry`: plans, memos, the
    row-count history of the chunking policy, this process's measured decisions), zero the plan
    counters and drop this thread's cached workspaces (the on-disk store is untouched)."""
    _lru.clear_all()
    _cache.plans.clear()  # also zeroes its counters
    _runtime.release_workspaces()


@atexit.register
def _release_at_exit() -> None:
    """Free every cuDNN-frontend object (plans, graphs, this thread's handles) before the
    interpreter shuts down: objects still alive when the frontend's binding module is torn
    down make it print "nanobind: leaked ..." lists at the exit of every process that ran
    a plan, a scare with no leak behind it."""
    clear_cache()
    _runtime.release_handles()
    gc.collect()


def serving_path(op: str, input: torch.Tensor | None = None) -> str:
    """``"cudnn"`` or ``"torch (<reason>)"``: which kernels serve ``op`` for ``input``.

    With ``input=None`` the answer is for a large bf16 tensor on the current CUDA device (or
    the CPU when there is none). With ``input`` it includes the kernel policy
    (:mod:`cudnorm._policy`: small calls run PyTorch's op), for weights of ``input``'s dtype.
    A configuration cuDNN declines at build time also falls back; ``cache_info().declined``
    counts those. Asked about a CUDA tensor before any call has tried the native launch path,
    it tries it as that call would (loading it, or building it once with a progress line), so
    the answer names the threshold the call gets.
    """
    if op not in OPS:
        raise ValueError(f"cudnorm.serving_path: argument 'op' must be one of {OPS}, got {op!r}")
    if input is not None and not isinstance(input, torch.Tensor):
        raise TypeError(f"cudnorm.serving_path: argument 'input' must be a torch.Tensor or None, "
                        f"got {type(input).__name__}")
    if input is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return _path(_runtime.route(torch.empty(0, dtype=torch.bfloat16, device=device)))
    reason = _runtime.route(input)
    if reason is None and _entry.pending and type(input) is torch.Tensor:
        # the call itself would switch the native path on first (its threshold differs): answer for that path
        _entry.try_native(input)
    if reason is None and input.dtype is torch.float64:
        reason = "float64: cuDNN has no double-precision normalization"
    elif reason is None and _settings.current.policy == "torch":
        reason = "policy 'torch': PyTorch's ops serve every call whose weights have the input's dtype"
    elif reason is None and _entry.native and type(input) is torch.Tensor and not torch.compiler.is_compiling():
        # the native entry points' policy (cudnorm/csrc/entry.cpp)
        threshold = _policy.NATIVE_CUDNN_MIN_ELEMENTS
        if _settings.current.policy == "auto" and input.numel() < threshold:
            reason = f"small call: policy 'auto', {threshold} elements or more run on cuDNN"
    elif reason is None and _policy.torch_serves(input):
        reason = (f"{'traced by torch.compile' if torch.compiler.is_compiling() else 'small call'}: "
                  f"policy 'auto', {_policy.CUDNN_MIN_ELEMENTS} elements or more run on cuDNN")
    if reason is None and input.dim() >= (2 if op == "ada_layer_norm" else 1) and input.numel():
        # the measured decision of the call's signature (weights of the input's dtype; an adaptive
        # LayerNorm's scale and shift [B, D]), made now if need be
        d = input.shape[-1]
        weight = input.new_empty((input.shape[0], d) if op == "ada_layer_norm" else (d,))
        training = torch.is_grad_enabled() and input.requires_grad
        serves = _decisions.serves(op, input, d, weight, None if op == "rms_norm" else weight, training)
        if serves != "cudnn":
            return f"{serves} ({_decisions.explain(op, input, weight, training)})"
    return _path(reason)


def share_decisions(group=None, src: int = 0) -> int:
    """Make every rank serve each decided call signature as rank ``src`` does: a collective
    (``torch.distributed.broadcast_object_list``) that every rank of ``group`` must call, e.g.
    once after ``cudnorm.warmup`` or a first step. Ranks on one machine already agree through the
    plan store (the first decision written wins); ranks on several machines with stores of their
    own may measure differently, and then compute with different kernels. Returns the number of
    decisions taken from ``src``. Raises ``RuntimeError`` when ``torch.distributed`` is not
    initialized."""
    return _decisions.share(group, src)


def serving_decisions() -> list[dict]:
    """The measured decisions of this process (:mod:`cudnorm._decisions`): one dict per call
    signature with ``signature`` (op/phase/dtypes/width/row bucket), ``device``,
    ``deterministic``, ``serves`` (``"cudnn"``, ``"torch"`` or ``"kernel"``), ``source``
    (``measured``, ``stored``, ``prior``, ...), ``ms`` (each candidate's measured ms per call,
    GPU plus host time: what decides), ``gpu_ms`` (the same calls' GPU time alone, where it was
    kept), ``spread`` (each timing's relative spread over its rounds), ``rounds`` (how many: 3,
    or 9 for a close lead timed again in paired rounds), ``prior_ms``, ``errors`` (what a
    candidate raised, if one did) and ``cost_ms`` (the wall ms the measurement took, by part)."""
    return _decisions.decisions()


def _native_status() -> str:
    """The native launch path's state (cudnorm._native.status)."""
    if not torch.cuda.is_available() and _settings.current.native != "off":
        return "not used (no CUDA device)"
    return _entry.status()["state"]


def _path(reason: str | None) -> str:
    return "cudnn" if reason is None else f"torch ({reason})"


def info() -> dict:
    """Versions, device, cuDNN availability, how plans are launched, the serving path of
    every op and the configuration (:func:`cudnorm.get_config`, with ``plan_store_dir`` the
    directory the plan store uses, the default one when the option is ``None``)."""
    status = _runtime.cudnn_status()

    fe = _runtime.cudnn_module()
    out = {
        "cudnorm": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn_frontend": getattr(fe, "__version__", None),
        "cudnn_backend": status.backend_version,
        "cudnn_available": status.available,
        "cudnn_reason": status.reason,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())) if torch.cuda.is_available() else None,
    }
    out["plan_launch"] = _graphs.RawExecute.mode() if status.available else "none (cuDNN not available)"
    out["native"] = _native_status()
    out["native_build"] = _entry.status()["build"]  # read from the build cache: built here even before the first CUDA call
    out["paths"] = {op: serving_path(op) for op in OPS}
    out["decisions"] = {"this process": len(_decisions.decisions()),
                        "in the plan store": _plan_store.current_store().info()["decisions"],
                        "prior": _decisions.prior_file() if torch.cuda.is_available() else "none (no CUDA device)"}
    out["config"] = dataclasses.asdict(_settings.current)
    # the directory in use, as `cudnorm cache info` shows it (None in the Config means the default one)
    out["config"]["plan_store_dir"] = str(_plan_store.current_store().root)
    return out
