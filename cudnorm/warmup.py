"""Build the graphs a job needs before the job: record them once, or take them from a preset.

Every new shape is a new cuDNN graph costing 0.1-1.4 s to build (docs/concepts.md, "build
costs"). :func:`record_specs` notes the graphs one real step asks for and writes them to a
spec file; :func:`warmup` (or ``cudnorm warmup``) builds the graphs of a spec file, a list of
specs or a model preset, which puts them in the in-memory cache and the on-disk plan store,
so the job itself loads each in milliseconds.

Spec file (JSON)::

    {"format": "cudnorm-specs", "version": 1, "specs": [NormSpec.to_json(), ...]}
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import _ada_strategies, _cache, _candidates, _decisions, _dispatch, _recording, _runtime, _settings, _warn
from ._progress import progress as _progress
from ._spec import NormSpec, dtype_from_name

SPEC_FORMAT = "cudnorm-specs"
SPEC_VERSION = 1
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


# -- spec files ---------------------------------------------------------------------------
def _sorted(specs: Iterable[NormSpec]) -> list[NormSpec]:
    """Deduplicated, in an order independent of the order the ops ran in."""
    return sorted(set(specs), key=lambda s: (s.op, s.phase, s.cols, s.rows, s.slug()))


def write_spec_file(path: str | os.PathLike, specs: Iterable[NormSpec]) -> None:
    data = {"format": SPEC_FORMAT, "version": SPEC_VERSION, "specs": [s.to_json() for s in _sorted(specs)]}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def read_spec_file(path: str | os.PathLike) -> list[NormSpec]:
    """The specs of a file written by :func:`record_specs`; ``ValueError`` names what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except ValueError as exc:
        raise ValueError(f"cudnorm.warmup: {path} is not JSON ({exc})") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise ValueError(f"cudnorm.warmup: {path} is not JSON (nested too deeply)") from None
    if not isinstance(data, dict) or data.get("format") != SPEC_FORMAT:
        raise ValueError(f"cudnorm.warmup: {path} is not a cudnorm spec file (no \"format\": \"{SPEC_FORMAT}\")")
    if data.get("version") != SPEC_VERSION:
        raise ValueError(f"cudnorm.warmup: {path} has spec file version {data.get('version')!r}; "
                         f"this cudnorm reads version {SPEC_VERSION}")
    try:
        return [NormSpec.from_json(d) for d in data["specs"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"cudnorm.warmup: {path} holds an invalid spec ({exc})") from None


class Recording:
    """What :func:`record_specs` yields; ``specs`` is filled when the block exits."""

    def __init__(self) -> None:
        self.specs: list[NormSpec] = []


@contextlib.contextmanager
def record_specs(path: str | os.PathLike | None = None):
    """Record the cuDNN graphs the ops ask for inside the block (run one real step in it).

    On a normal exit the graphs, deduplicated, are written to ``path`` as a spec file for
    :func:`warmup` / ``cudnorm warmup`` (with ``path=None`` they are only kept on the
    yielded object's ``specs``). Only calls that reach cuDNN are recorded: CPU tensors and
    other PyTorch-path calls ask for no graph. Recording costs one ``if`` per op call while
    no block is open.

    Example::

        import torch
        import cudnorm

        device = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU nothing is recorded (it warns)
        model = torch.nn.Sequential(cudnorm.LayerNorm(4096), cudnorm.RMSNorm(4096)).to(device, torch.bfloat16)
        batch = torch.randn(8, 1024, 4096, device=device, dtype=torch.bfloat16, requires_grad=True)
        with cudnorm.record_specs("step.json"):
            model(batch).float().square().mean().backward()
    """
    recording = Recording()
    with _recording.collecting() as seen:
        yield recording
    recording.specs = _sorted(seen)
    if not recording.specs:
        _warn.warn("cudnorm.record_specs: no cuDNN graph was requested in the block (CPU tensors, cuDNN "
                   f"unavailable: {_runtime.cudnn_status().reason}, only calls the default policy hands to "
                   "PyTorch's ops, or no cudnorm op ran)", RuntimeWarning)
    if path is not None:
        write_spec_file(path, recording.specs)


# -- the specs an op asks for -------------------------------------------------------------
def norm_specs(op: str, rows: int, cols: int, *, x_dtype: torch.dtype, weight_dtype: torch.dtype | None,
               device_index: int, phases: Iterable[str] = ("train", "bwd", "infer")) -> list[NormSpec]:
    """The specs :func:`cudnorm.layer_norm` / :func:`cudnorm.rms_norm` request for a packed
    ``[rows, cols]`` input of ``x_dtype`` with weights of ``weight_dtype`` (``None``: no
    affine parameters), under the current configuration (:func:`cudnorm.get_config`).

    The scale dtype comes from the ops' own rule (``_dispatch.forward_params`` on meta
    tensors) and the spec from the ops' own constructor (``_dispatch.spec_for``);
    tests/test_warmup.py checks them against specs recorded from the ops themselves.
    """
    if op not in ("layer_norm", "rms_norm"):
        raise ValueError(f"cudnorm.warmup: argument 'op' must be 'layer_norm' or 'rms_norm', got {op!r}")
    x = torch.empty((rows, cols), dtype=x_dtype, device="meta")
    param = None if weight_dtype is None else torch.empty(cols, dtype=weight_dtype, device="meta")
    has_bias = op == "layer_norm"
    _, _, scale_dtype = _dispatch.forward_params(x, param, param if has_bias else None, has_bias=has_bias)
    backward_dtype = _dispatch.backward_scale_dtype(param)
    return [_dispatch.spec_for(op, phase, x, backward_dtype if phase == "bwd" else scale_dtype, device_index)
            for phase in phases]


def ada_norm_specs(batch: int, seq: int, cols: int, *, x_dtype: torch.dtype, device_index: int,
                   scale_dtype: torch.dtype | None = None,
                   phases: Iterable[str] = ("train", "bwd", "infer")) -> list[NormSpec]:
    """The specs :func:`cudnorm.ada_layer_norm` requests for ``x: [batch, seq, cols]`` with
    per-sample scale/shift ``[batch, cols]`` of ``scale_dtype`` (default ``x_dtype``, what a
    modulation Linear returns), under the current forward/backward strategy settings: the
    strategies' own ``specs_for`` (:mod:`cudnorm._ada_strategies`)."""
    return _ada_strategies.specs_for(batch, seq, cols, x_dtype, scale_dtype or x_dtype, device_index, phases)


# -- presets ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Preset:
    """The norm layers of a model family: ``specs(batch, seq, dtype, device_index)``."""

    name: str
    model: str
    default_seq: int
    norms: str
    specs: Callable[[int, int, torch.dtype, int], list[NormSpec]]


def _llm(hidden: int):
    """Decoder LLM with RMSNorm (fp32 weights): training step on ``batch*seq`` rows, prefill
    on ``batch*seq`` rows and one decode step (``batch`` rows)."""
    def specs(batch, seq, dtype, device):
        return (norm_specs("rms_norm", batch * seq, hidden, x_dtype=dtype, weight_dtype=torch.float32,
                           device_index=device)
                + norm_specs("rms_norm", batch, hidden, x_dtype=dtype, weight_dtype=torch.float32,
                             device_index=device, phases=("infer",)))
    return specs


def _dit(hidden: int, context_tokens: int = 0):
    """DiT-style blocks: AdaLN (no affine, ``1 + scale``) on the image tokens, including the
    final layer; with ``context_tokens`` also on a text stream (MMDiT)."""
    def specs(batch, seq, dtype, device):
        out = ada_norm_specs(batch, seq, hidden, x_dtype=dtype, device_index=device)
        if context_tokens:
            out += ada_norm_specs(batch, context_tokens, hidden, x_dtype=dtype, device_index=device)
        return out
    return specs


PRESETS = {p.name: p for p in (
    Preset("dit-xl-2", "DiT-XL/2", 256, "AdaLN D=1152 (seq 256 = 256px images, 1024 = 512px)", _dit(1152)),
    Preset("dit-b-2", "DiT-B/2", 256, "AdaLN D=768", _dit(768)),
    Preset("pixart-alpha", "PixArt-alpha XL/2", 4096, "AdaLN D=1152 (seq 4096 = 1024px images)", _dit(1152)),
    Preset("sd3-medium", "Stable Diffusion 3 medium (MMDiT)", 4096,
           "AdaLN D=1536 on image tokens and 333 text tokens (77 CLIP + 256 T5)", _dit(1536, context_tokens=333)),
    Preset("llama-3-8b", "Llama-3-8B", 4096, "RMSNorm D=4096, fp32 weight; train, prefill, decode", _llm(4096)),
    Preset("llama-3-70b", "Llama-3-70B", 4096, "RMSNorm D=8192, fp32 weight; train, prefill, decode", _llm(8192)),
)}


def preset_specs(name: str, *, batch: int = 1, seq: int | None = None, dtype: torch.dtype | str = torch.bfloat16,
                 device_index: int = 0) -> list[NormSpec]:
    """The specs of preset ``name`` (see ``cudnorm warmup --list-presets``) for ``batch``
    samples of ``seq`` tokens (default: the preset's), activations in ``dtype``."""
    if name not in PRESETS:
        raise ValueError(f"cudnorm.warmup: unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    for arg, value in (("batch", batch), ("seq", seq)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"cudnorm.warmup: argument '{arg}' must be a positive int, got {value!r}")
    preset = PRESETS[name]
    return _sorted(preset.specs(batch, seq or preset.default_seq, parse_dtype(dtype), device_index))


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A supported activation dtype from a ``torch.dtype`` or a name (``"bf16"``, ``"bfloat16"``...)."""
    try:
        parsed = dtype if isinstance(dtype, torch.dtype) else dtype_from_name(_DTYPE_ALIASES.get(dtype, dtype))
    except (KeyError, TypeError, ValueError, AttributeError):
        parsed = None
    if parsed not in _runtime.SUPPORTED_DTYPES:
        raise (ValueError if isinstance(dtype, (str, torch.dtype)) else TypeError)(
            f"cudnorm.warmup: argument 'dtype' must be one of bf16, fp16, fp32 (or their torch.dtype), got {dtype!r}")
    return parsed


# -- building -----------------------------------------------------------------------------
def resolve(source, *, batch: int = 1, seq: int | None = None, dtype: torch.dtype | str = torch.bfloat16,
            device: int | str | torch.device | None = None) -> list[NormSpec]:
    """The specs ``source`` names (spec file, list of specs, or preset), moved to ``device``."""
    index = _device_index(device)
    if isinstance(source, str) and source in PRESETS and not Path(source).exists():
        return preset_specs(source, batch=batch, seq=seq, dtype=dtype,
                            device_index=_device_index("cuda") if index is None else index)
    if isinstance(source, (str, os.PathLike)):
        if not Path(source).is_file():
            raise ValueError(f"cudnorm.warmup: argument 'source' {str(source)!r} is neither a spec file nor a "
                             f"preset ({', '.join(sorted(PRESETS))})")
        specs = read_spec_file(source)
    elif isinstance(source, NormSpec):
        specs = [source]
    else:
        if not isinstance(source, Iterable):
            raise TypeError(f"cudnorm.warmup: argument 'source' must be a spec file path, a preset name or a list "
                            f"of NormSpec, got {type(source).__name__}")
        specs = list(source)
        bad = [s for s in specs if not isinstance(s, NormSpec)]
        if bad:
            raise TypeError(f"cudnorm.warmup: argument 'source' must hold NormSpec objects, got {type(bad[0]).__name__}")
    return _sorted(specs if index is None else (s._replace(device_index=index) for s in specs))


def _device_index(device) -> int | None:
    """``cuda:N`` -> N; plain ``cuda`` -> the current device (0 without CUDA); None stays None."""
    if device is None:
        return None
    parsed = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if parsed.type != "cuda":
        raise ValueError(f"cudnorm.warmup: argument 'device' must be a CUDA device, got {device!r}")
    if parsed.index is not None:
        return parsed.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def warmup(source, *, batch: int = 1, seq: int | None = None, dtype: torch.dtype | str = torch.bfloat16,
           device: int | str | torch.device | None = None, progress: bool = True) -> list[dict]:
    """Build every graph of ``source`` now, into the plan cache and the on-disk plan store.

    Args:
        source: a spec file from :func:`record_specs`, a list of ``NormSpec``, or a preset
            name (``"llama-3-8b"``, ``"dit-xl-2"``, ...; see ``cudnorm warmup --list-presets``).
        batch: samples per step, for a preset (ignored otherwise).
        seq: tokens per sample, for a preset (default: the preset's).
        dtype: activation dtype, for a preset (``torch.bfloat16``, or ``"bf16"``/``"fp16"``/``"fp32"``).
        device: build on this CUDA device instead of the one each spec names.
        progress: show a progress bar.

    Returns:
        One dict per spec: ``spec`` (slug), ``source`` (``built``, ``store``: loaded from
        the plan store, ``cached``: already in memory, ``declined``: cuDNN has no engine,
        ``skipped``: cuDNN unavailable here), ``plan`` (plan name), ``seconds`` and ``serves``:
        for a LayerNorm/RMSNorm/adaptive LayerNorm forward, the kernel its measured decision
        picked (``cudnn``, ``torch`` or ``kernel``; :mod:`cudnorm._decisions`), stored in the
        plan store for the job.
    """
    specs = resolve(source, batch=batch, seq=seq, dtype=dtype, device=device)
    status = _runtime.cudnn_status()
    if not status.available:
        _warn.warn(f"cudnorm.warmup: nothing built, cuDNN is unavailable ({status.reason})", RuntimeWarning)
        return [{"spec": s.slug(), "source": "skipped", "plan": "", "seconds": 0.0} for s in specs]
    count = torch.cuda.device_count()
    missing = sorted({s.device_index for s in specs if not 0 <= s.device_index < count})
    if missing:
        raise ValueError(f"cudnorm.warmup: specs name cuda:{missing[0]} but this machine has {count} GPU(s); "
                         "pass device= to build them elsewhere")
    rows = []
    for spec in (_progress(specs, len(specs), "cudnorm warmup") if progress else specs):
        cached = spec in set(_cache.plans.specs())
        start = time.perf_counter()
        plan = _cache.get_plan(spec)
        seconds = time.perf_counter() - start
        where = "declined" if plan is None else "cached" if cached else plan.source
        rows.append({"spec": spec.slug(), "source": where, "plan": "" if plan is None else plan.plan_name,
                     "seconds": seconds, "serves": _decide(spec, specs)})
    return rows


def _decide(spec: NormSpec, specs: list[NormSpec]) -> str:
    """The measured decision (:mod:`cudnorm._decisions`) of a forward spec's call signature, made
    now on a random input of its shape (``""`` for the specs that have none, or where the
    configuration measures nothing): :func:`_decision_call`'s call."""
    if _settings.current.policy != "auto" or _settings.current.disable_cudnn:
        return ""
    call = _decision_call(spec, specs, torch.device("cuda", spec.device_index))
    return "" if call is None else _decisions.server(*call)


def _decision_call(spec: NormSpec, specs: list[NormSpec], device: torch.device) -> tuple | None:
    """``(op, x, cols, weight, bias, training)`` of the call a forward spec stands for, on
    ``device``, or None where no decision serves it (backward specs, a fused residual add, an
    offset; an adaptive LayerNorm with a modulation of another dtype than x's). LayerNorm's and
    RMSNorm's weights are taken to be of the backward spec's dtype (the parameters' own), else
    the forward's, LayerNorm's bias like its weight; an adaptive LayerNorm's scale and shift
    ``[batch, cols]`` of x's dtype."""
    if spec.phase == "bwd" or spec.residual or spec.offset:
        return None
    training = spec.phase == "train"
    if spec.op == "ada_layer_norm":
        if spec.scale_dtype != spec.x_dtype or spec.batch < 1:
            return None
        x = _candidates.random_tensor((spec.batch, spec.rows // spec.batch, spec.cols), spec.x_dtype, device)
        scale = torch.zeros((spec.batch, spec.cols), dtype=spec.x_dtype, device=device)
        return _candidates.ADA_LAYER_NORM, x, spec.cols, scale, torch.zeros_like(scale), training
    if spec.op not in ("layer_norm", "rms_norm"):
        return None
    backward = [s for s in specs if s.phase == "bwd" and (s.op, s.rows, s.cols, s.x_dtype) ==
                (spec.op, spec.rows, spec.cols, spec.x_dtype)]
    weight_dtype = backward[0].scale_dtype if backward else spec.scale_dtype
    x = _candidates.random_tensor((spec.rows, spec.cols), spec.x_dtype, device)
    weight = torch.ones(spec.cols, dtype=weight_dtype, device=device)
    bias = torch.zeros_like(weight) if spec.op == "layer_norm" else None
    return spec.op, x, spec.cols, weight, bias, training
