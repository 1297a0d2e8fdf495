"""Measured decisions: which kernel serves each LayerNorm/RMSNorm/adaptive LayerNorm/adaptive RMSNorm call
signature (rule 4 of :mod:`cudnorm._policy`).

:func:`server` answers ``"torch"``, ``"cudnn"`` or ``"kernel"`` for an eager CUDA call the size
rules left to cudnorm. A signature (:class:`cudnorm._candidates.Signature`) is decided once:

1. a decision already made in this process;
2. a decision in the plan store for this GPU and software (:func:`cudnorm._plan_store.load_decision`);
   the first decision written for a signature is the one every process sharing the store
   keeps, so the ranks of a job on one machine (or sharing a store directory) agree;
3. the prior (``cudnorm/priors/<gpu>.json``, written by ``cudnorm bench --sweep`` on that GPU)
   drops candidates it measured :data:`PRIOR_CLIFF` times slower than its best, so known cliffs
   are neither built nor timed;
4. the remaining candidates are timed on the call's own input (:func:`cudnorm._candidates.time_closures`,
   a few ms) and the winner is stored.

Where timing is not allowed (the stream is being captured into a CUDA graph) or not wanted
(``Config.measure=False``), steps 3-4 give the prior's fastest candidate, else PyTorch's op,
and that answer is not kept: a later eager call still measures. Everything here runs once per
signature; later calls find the answer in :data:`DECIDED` (and, on the native path, in C++).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch

from . import _candidates, _dispatch, _lru, _plan_store, _runtime, _settings
from ._candidates import Signature

# A candidate the prior measured this many times slower than the prior's fastest is not
# built or timed (a cliff: 7-16x at the widths it was written for; docs/performance.md, Decisions)
PRIOR_CLIFF = 2.0
PRIORS = Path(__file__).parent / "priors"

# (signature, device index, deterministic) -> (choice, how it was made); evicting or clearing
# it (cudnorm.clear_cache()) also empties C++'s table (cudnorm._native registers that)
DECIDED = _lru.LRU("decisions", 4096)


def serves(op: str, input: torch.Tensor, cols: int, weight, bias, training: bool) -> str:
    """What serves an eager call the size rules of :mod:`cudnorm._policy` left to cudnorm:
    :func:`server`'s measured answer under ``policy="auto"`` for a plain CUDA tensor, else
    ``"cudnn"`` (cudnorm's own path, as ``policy="cudnn"`` and DTensors have it; adaptive
    RMSNorm, with no cuDNN graph, takes cudnorm's kernel for it)."""
    if _settings.current.policy != "auto" or type(input) is not torch.Tensor or not input.is_cuda:
        return "cudnn"
    return server(op, input, cols, weight, bias, training)


def server(op: str, input: torch.Tensor, cols: int, weight, bias, training: bool) -> str:
    """``"torch"``, ``"cudnn"`` or ``"kernel"`` for an eager call on a plain CUDA ``input``
    (``[*, cols]``) with these parameters; decided once per signature, measured where allowed."""
    return server_kept(op, input, cols, weight, bias, training)[0]


def server_kept(op: str, input: torch.Tensor, cols: int, weight, bias, training: bool) -> tuple[str, bool]:
    """:func:`server`'s answer, and whether it was kept (not a stand-in while timing is not allowed)."""
    sig = _candidates.signature(op, training, input, weight, bias, cols)
    if input.numel() == 0:  # nothing to time (any kernel returns the empty result): the baseline, not kept
        return ("torch" if "torch" in _candidates.candidates_for(sig) else "cudnn"), False
    key = (sig, input.get_device(), torch.are_deterministic_algorithms_enabled())
    known = DECIDED.peek(key)
    if known is not None:
        return known[0], True
    choice = decide(key, input, weight, bias)
    return choice, key in DECIDED


def decide(key: tuple, input: torch.Tensor, weight, bias, *, eps: float = 1e-5) -> str:
    """Decide ``key`` = ``(signature, device index, deterministic)`` (the steps of the module
    docstring), keep it where it may be kept, and return it. ``input`` is a tensor of the
    signature (its values are only read)."""
    sig, device, deterministic = key
    names = _candidates.candidates_for(sig, deterministic=deterministic)
    baseline = "torch" if "torch" in names else "cudnn"
    if len(names) == 1:
        return _keep(key, names[0], {"source": "only candidate"})
    stored = _plan_store.load_decision(_store_key(sig), device, deterministic)
    if stored is not None and stored.get("choice") in names:
        return _keep(key, stored["choice"], {**stored, "source": "stored"})
    prior = prior_times(sig, device)
    if prior:
        fastest = min(prior[n] for n in names if n in prior) if any(n in prior for n in names) else None
        if fastest is not None:
            names = [n for n in names if n not in prior or prior[n] <= PRIOR_CLIFF * fastest]
    if len(names) == 1:
        return _keep(key, names[0], {"source": "prior", "prior_ms": prior})
    if _runtime.capturing() or not _settings.current.measure:
        known = [n for n in names if prior and n in prior]
        return min(known, key=prior.__getitem__) if known else baseline  # a stand-in, not kept
    errors: dict = {}
    cost: dict = {}
    timings = measure(sig, input, weight, bias, names, eps, errors, cost, baseline=baseline)
    choice = _candidates.winner(timings, baseline if baseline in timings else next(iter(timings), baseline))
    record = {"choice": choice, "ms": {n: round(t.ms, 5) for n, t in timings.items()},
              "spread": {n: round(t.spread, 4) for n, t in timings.items()},
              "rounds": {n: t.rounds for n, t in timings.items()},
              "gpu_ms": {n: round(t.gpu_ms, 5) for n, t in timings.items() if t.gpu_ms is not None},
              "measured": time.time(),
              "errors": errors, "cost_ms": cost}
    kept = _plan_store.save_decision(_store_key(sig), device, deterministic, record)
    if kept.get("choice") in names and kept.get("choice") != choice:  # another process decided first
        return _keep(key, kept["choice"], {**kept, "source": "stored (another process decided first)"})
    return _keep(key, choice, {**record, "source": "measured"})


def _store_key(sig: Signature) -> str:
    """The plan store's key of ``sig``'s decision: its key and the candidates' revision (a
    decision measured on other implementations is not reused)."""
    return f"{sig.key()}/candidates={_candidates.REVISION}"


def _keep(key: tuple, choice: str, why: dict) -> str:
    DECIDED.put(key, (choice, why))
    return choice


def measure(sig: Signature, input: torch.Tensor, weight, bias, names, eps: float = 1e-5,
            errors: dict | None = None, cost: dict | None = None, *, baseline: str | None = None) -> dict:
    """``{candidate: Timing}`` of ``names`` on ``input`` (flattened to packed ``[rows, cols]``,
    the parameters to ``[cols]``, an adaptive RMSNorm's modulation to ``[B, cols]``), a lead
    over ``baseline`` inside the spreads timed again in paired rounds
    (:func:`cudnorm._candidates.settle`); candidates that raised are named in ``errors``;
    ``cost`` gets the wall ms the measurement took: ``"prepare"`` (building the candidates'
    plans and kernels), ``"first"`` (their first, untimed runs), ``"timing"`` (the runs that
    time them: what measuring itself costs) and ``"settle"`` (the paired rounds, where run)."""
    x = _dispatch.cudnn_rows(input.detach().reshape(-1, sig.cols))
    shape = (-1, sig.cols) if sig.op in _candidates.MODULATED else (sig.cols,)  # per-sample: [B, N]
    w = None if weight is None else weight.detach().reshape(shape)
    b = None if bias is None else bias.detach().reshape(shape)
    cost = {} if cost is None else cost
    with torch.no_grad():
        began = time.perf_counter()
        dy = _candidates.gradient(x) if sig.training else None  # one incoming gradient for every candidate
        closures = {n: _candidates.CANDIDATES[n].prepare(sig, x, w, b, eps, dy) for n in names}
        cost["prepare"] = round((time.perf_counter() - began) * 1e3, 2)
        timings = _candidates.time_closures(closures, device=x.device, errors=errors, cost=cost)
        if baseline is None:
            return timings
        return _candidates.settle(closures, timings, baseline, device=x.device, cost=cost)


def decisions() -> list[dict]:
    """What :func:`cudnorm.serving_decisions` returns: one dict per decided signature."""
    rows = []
    for key in DECIDED.keys():
        known = DECIDED.peek(key)
        if known is None:  # evicted meanwhile
            continue
        (sig, device, deterministic), (choice, why) = key, known
        rows.append({"signature": sig.key(), "device": device, "deterministic": deterministic,
                     "serves": choice, "source": why.get("source", ""), "ms": why.get("ms", {}),
                     "spread": why.get("spread", {}), "rounds": why.get("rounds") or {},
                     "gpu_ms": why.get("gpu_ms") or {},
                     "prior_ms": why.get("prior_ms") or {},
                     "errors": why.get("errors") or {}, "cost_ms": why.get("cost_ms") or {}})
    return rows


def share(group=None, src: int = 0) -> int:
    """What :func:`cudnorm.share_decisions` does: rank ``src``'s decisions of ``group``
    (``torch.distributed``) replace every other rank's, for the same signatures on each rank's
    current CUDA device. Returns how many decisions this rank now holds from ``src``."""
    import torch.distributed as dist  # noqa: PLC0415 - only jobs that call this use it

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("cudnorm.share_decisions: torch.distributed is not initialized; call it in a job after "
                           "init_process_group, on every rank")
    mine = [(sig, det, choice, why) for (sig, _device, det), (choice, why) in
            ((key, DECIDED.peek(key)) for key in DECIDED.keys()) if choice is not None] \
        if dist.get_rank(group) == src else None
    payload = [mine]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, src) if group is not None else src,
                               group=group)
    device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    for sig, det, choice, why in payload[0]:
        DECIDED.put((sig, device, det), (choice, {**why, "source": f"rank {src} (share_decisions)"}))
    DECIDED.changed()  # C++'s table drops what it kept of this rank's own decisions
    return len(payload[0])


# -- the prior ---------------------------------------------------------------------------------

def gpu_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"`` (the results folders' names)."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


@functools.cache
def _prior_table(slug: str) -> dict:
    """The prior's cells for GPU ``slug``, without the timings of candidates that changed since
    the prior was written (:data:`cudnorm._candidates.CHANGED_IN`): those are measured."""
    path = PRIORS / f"{slug}.json"
    try:
        document = json.loads(path.read_text())
        cells, revision = document.get("cells", {}), int(document.get("candidates_revision", 1))
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
    stale = {name for name, changed in _candidates.CHANGED_IN.items() if changed > revision}
    if not stale:
        return cells
    return {key: {name: ms for name, ms in cell.items() if name not in stale} for key, cell in cells.items()}


def prior_times(sig: Signature, device: int) -> dict[str, float]:
    """``{candidate: ms}`` the prior holds for ``sig`` on this GPU (its own row bucket, else a
    neighbouring one), or ``{}``."""
    table = _prior_table(gpu_slug(torch.cuda.get_device_name(device)))
    if not table:
        return {}
    for bucket in (sig.rows_bucket, sig.rows_bucket - 1, sig.rows_bucket + 1):
        cell = table.get(sig._replace(rows_bucket=bucket).key())
        if cell:
            return dict(cell)
    return {}


def prior_file() -> str:
    """The prior file for the current CUDA device, or a line saying there is none."""
    slug = gpu_slug(torch.cuda.get_device_name())
    path = PRIORS / f"{slug}.json"
    return str(path) if path.is_file() else f"none for {slug} (every signature is measured at its first call)"


def explain(op: str, input: torch.Tensor, weight, training: bool) -> str:
    """Why a decided signature is served as it is (for :func:`cudnorm.serving_path`)."""
    bias = weight if op in ("layer_norm", _candidates.ADA_LAYER_NORM) else None  # an AdaLN's: its shift
    sig = _candidates.signature(op, training, input, weight, bias, input.shape[-1])
    why = (DECIDED.peek((sig, input.get_device(), torch.are_deterministic_algorithms_enabled())) or ("", {}))[1]
    times = ", ".join(f"{name} {ms:.4g} ms" for name, ms in sorted(why.get("ms", {}).items(), key=lambda kv: kv[1]))
    return f"{why.get('source', 'decided')} for {sig.key()}" + (f": {times}" if times else "")
