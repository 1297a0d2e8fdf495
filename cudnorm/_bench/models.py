"""``cudnorm bench --models``: whole model steps with cudnorm's norms against PyTorch's own.

Op benchmarks call one kernel on the same tensors again and again; a model step makes new
tensors every time (the caching allocator hands out different buffers, shapes meet plans
already built or not, the host enqueues hundreds of ops). Users judge cudnorm by that step
time, so this suite times whole steps of five models (:mod:`.model_zoo`, configured by :mod:`.model_cases`), where each
provider swaps *only* the norms and the weights are identical (seeded):

* DiT (adaLN-Zero): torch's eager ``norm(x) * (1 + scale) + shift`` vs
  ``cudnorm.ada_layer_norm``; modes ``train``, ``train-compile`` (each block compiled),
  ``infer``, and ``train-autocast`` (fp32 master weights under bf16 autocast) for DiT-XL B=8.
* SD3-like MMDiT joint blocks and Flux-like single-stream blocks: AdaLN as DiT's and
  per-head qk RMSNorm (``nn.RMSNorm`` vs ``cudnorm.RMSNorm``; Liger's provider swaps only
  these); modes ``train``, ``train-autocast``, ``infer``.
* Llama-style decoder (RMSNorm): ``train`` and one-token ``decode-b1``/``decode-b32`` with
  a KV cache; providers torch, cudnorm, liger.
* GPT-2-style stack (LayerNorm): ``train``; providers torch, cudnorm, liger.
* The models people run (:mod:`.real_models`): diffusers' DiT, PixArt, SD3.5 and Flux.1 and
  transformers' Llama and Qwen3, their own classes at published widths, each provider a deep
  copy of one model (``cudnorm``: ``cudnorm.patch``); modes ``train`` and ``sample``
  (``torch.inference_mode``), each ``-compile`` on request. Always with ``torch-again`` and
  ``limit`` (norms and AdaLN modulation costing nothing): ``share_of_limit`` = (torch ms -
  provider ms) / (torch ms - limit ms), the share of the possible gain a provider takes.

How a case is measured (:func:`run_case`):

1. Each provider's model is built and warmed up (``compile_s``: the warm-up's wall time, in
   compile modes; decode warm-ups visit every cache length once), then run once on the same
   seeded inputs: ``rel_diff`` (and in training ``grad_rel_diff``, of the first block's
   first Linear weight; of the latent input for the real models, checked in eval mode) is
   its relative L2 distance from the torch provider's result. For the real models also
   ``fp32_err``, the output's distance from an fp32 copy of the unpatched model on the same
   inputs, and ``fp32_err_vs_torch``, its ratio to the torch provider's: a cudnorm provider
   above :data:`FP32_ERROR_RULE` (1.25x) fails its row.
2. Rounds: in every round each provider runs ``K`` back-to-back steps in turn (so drift of
   clocks or temperature hits all alike), one synchronize at the end: ``step_ms`` is the
   median over rounds of wall time / K. At least 5 rounds, more (up to 40) until every
   provider has 3 s of timed steps. Every step draws fresh ``torch.randn`` inputs inside
   the timed loop, the same code for every provider; training steps set grads to None, run
   forward, ``out.float().square().mean().backward()``; no optimizer. Then a few single steps,
   each after a synchronize: ``host_ms`` is the median time until the Python call of
   backward (or of the forward) returns, i.e. the host's enqueue time on an empty queue.
3. ``norm_ms`` (GPU): only the norm work of one step (``count`` norm calls at the model's
   shapes, forward and, in training, backward) captured in a CUDA graph and timed by CUDA
   events over replays, so it is GPU time without host gaps.

``speedup`` = torch's step_ms / the provider's and ``host_ratio`` likewise (> 1: faster than
PyTorch's norms in the same run); ``again_ratio`` = torch's step_ms / torch-again's, the run's
noise floor, on every row of the case.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import host_profile, model_cases, model_norms, model_zoo, real_models, report, runner
from .model_cases import Case
from .real_models import RealCase
from .._progress import progress

# the columns a models.csv has had since issue 32 (how --from-csv tells one), then the newer ones
BASE_COLUMNS = ("model", "case", "mode", "provider", "batch", "seq", "width", "step_ms", "host_ms", "speedup",
                "host_ratio", "norm_ms", "rel_diff", "grad_rel_diff", "max_mem_gib", "compile_s", "status")
COLUMNS = BASE_COLUMNS + ("again_ratio", "share_of_limit", "fp32_err", "fp32_err_vs_torch", "speedup_q1", "speedup_q3")
# A patched model's output error against an fp32 copy of the unpatched model may be at most
# this many times the unpatched model's own error in the same dtype (issue 46's rule for real models)
FP32_ERROR_RULE = 1.25
# Asked for by name: cudnorm-cudnn, cudnorm with every call on cuDNN (policy="cudnn"),
# the evidence for the default policy's choices (cudnorm._policy); cudnorm-python, the same
# on the Python launch path (what the native one saves); cudnorm-torch, cudnorm's modules with
# every call on PyTorch's ops (policy="torch": what cudnorm's own Python costs a step);
# torch-again, PyTorch's norms in a
# second model instance, whose ratio to torch is the run's noise floor
# limit: the real models with norms and modulation costing nothing (real_models.limit)
# cudnorm-blocks (real models only): cudnorm.patch(model, blocks=True), diffusers' blocks with
# their modulated norms fused (cudnorm._diffusers_blocks)
PROVIDERS = ("torch", "cudnorm", "liger", "cudnorm-cudnn", "cudnorm-python", "cudnorm-torch", "torch-again",
             "cudnorm-blocks", "limit")
DEFAULT_PROVIDERS = ("torch", "cudnorm", "liger")
_ZOO_PROVIDERS = tuple(p for p in PROVIDERS if p not in ("cudnorm-blocks", "limit"))
MODEL_PROVIDERS = {"dit": tuple(p for p in _ZOO_PROVIDERS if p != "liger"),  # Liger has no AdaLN
                   "sd3": _ZOO_PROVIDERS, "flux": _ZOO_PROVIDERS, "llama": _ZOO_PROVIDERS, "gpt2": _ZOO_PROVIDERS}
MODEL_PROVIDERS.update({name: spec.providers for name, spec in real_models.MODELS.items()})
MODEL_TITLES = {"dit": "DiT (AdaLN)", "sd3": "SD3-like MMDiT (AdaLN, qk RMSNorm)",
                "flux": "Flux-like single-stream (AdaLN, qk RMSNorm)", "llama": "Llama (RMSNorm)",
                "gpt2": "GPT-2 (LayerNorm)", **{name: spec.title for name, spec in real_models.MODELS.items()}}


@dataclass(frozen=True)
class Settings:
    """Timing loop sizes: ``rounds`` R, ``steps`` K per round (``decode_steps`` for decode,
    ``real_steps`` for the real models, whose steps take 20-200 ms on an H100), ``warmup``
    steps, single-step host samples per round (at least 1)."""

    rounds: int = 5
    steps: int = 10
    decode_steps: int = 50
    real_steps: int = 4
    warmup: int = 3
    # more rounds, up to max_rounds, until each provider has min_timed_s of timed steps: steps
    # of a few ms are host-bound, and a lent host's jitter moved 5-round medians by +-10%
    min_timed_s: float = 3.0
    max_rounds: int = 40
    # cudnorm bench --models --profile-host: host profiles of each case and provider (host_profile), written here
    profile_dir: Path | None = None

    def k(self, case: Case | RealCase) -> int:
        return self.real_steps if isinstance(case, RealCase) else self.decode_steps if case.decode else self.steps

    def timed_s(self, case: Case | RealCase) -> float:
        """Seconds of timed steps each provider gets at least: ``min_timed_s``, less where a
        real model asks for less (``RealModel.timed_s``) and the run is not a quick one."""
        own = case.spec.timed_s if isinstance(case, RealCase) else None
        return self.min_timed_s if own is None else min(own, self.min_timed_s)

    def host_samples(self, case: Case) -> int:
        return max(1, self.k(case) // 5)


QUICK_SETTINGS = Settings(rounds=2, steps=2, decode_steps=2, real_steps=2, warmup=1, min_timed_s=0.0)


# ---------------------------------------------------------------------------------------
# Providers and workloads


def unavailable(provider: str, device: str) -> str | None:
    """Why ``provider`` cannot run here, or ``None``."""
    if provider != "liger":
        return None
    if device != "cuda":
        return "unavailable: Liger-Kernel needs triton and a CUDA GPU"
    try:
        import liger_kernel.transformers.layer_norm  # noqa: F401, PLC0415
        import liger_kernel.transformers.rms_norm  # noqa: F401, PLC0415
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        return f"unavailable: {runner.describe(exc)}"
    return None


@dataclass
class Workload:
    """One provider's model for one case. ``inputs(gen)`` draws fresh random inputs
    (``gen``: a seeded generator for the equivalence check, else the global RNG);
    ``forward(*inputs)`` returns the model's output. ``grad_off``: the context a forward
    without backward runs in; ``check(gen)``: ``(output, gradient or None)`` of the
    equivalence check, when the case does not use :func:`_check_result`'s; ``note``: a remark
    for the provider's row (what ``cudnorm.patch`` left)."""

    model: torch.nn.Module
    forward: Callable[..., torch.Tensor]
    inputs: Callable[[torch.Generator | None], tuple]
    train: bool
    # compiled in a CUDA-graph mode: each step starts a new round of CUDA-graph replays
    # (the previous step's graph outputs may be overwritten; nothing keeps them)
    new_graph_step: bool = False
    grad_off: Callable = torch.no_grad
    check: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor | None]] | None = None
    note: str | None = None
    # the output of an fp32 copy of the unpatched model on the check's inputs (real models)
    fp32_reference: Callable[[torch.Generator], torch.Tensor] | None = None

    def step(self, gen: torch.Generator | None = None) -> torch.Tensor:
        """One step on fresh inputs; returns once backward (or the forward) has been enqueued."""
        if self.new_graph_step:
            torch.compiler.cudagraph_mark_step_begin()
        inputs = self.inputs(gen)
        if not self.train:
            with self.grad_off():
                return self.forward(*inputs)
        self.model.zero_grad(set_to_none=True)
        out = self.forward(*inputs)
        out.float().square().mean().backward()
        return out


def _randn(device: str, dtype: torch.dtype, *shapes) -> Callable:
    """``inputs(gen)`` of a :class:`Workload`: one random tensor per shape."""
    return lambda gen: tuple(torch.randn(shape, generator=gen, device=device, dtype=dtype) for shape in shapes)


def _under_autocast(forward: Callable, device: str) -> Callable:
    """``forward`` under bf16 autocast; the loss and backward stay outside it, as in
    PyTorch's mixed-precision recipe."""
    def run(*inputs):
        with torch.autocast(device, dtype=torch.bfloat16):
            return forward(*inputs)

    return run


def build(case: Case, provider: str, device: str, dtype: torch.dtype) -> Workload:
    """The seeded model of ``case`` with ``provider``'s norms, on ``device`` in ``dtype``
    (``train-autocast``: fp32 parameters, bf16 inputs, the forward under autocast)."""
    b, s, d = case.batch, case.seq, case.width
    params, act = model_cases.dtypes(case, dtype)
    inputs = _randn(device, act, (b, s, d))
    if case.model == "dit":
        model = model_zoo.build_dit(d, case.heads, case.depth, provider).to(device, params)
        blocks = [case.compile(blk) for blk in model.blocks]

        def forward(x, c):
            for block in blocks:
                x = block(x, c)
            return x

        inputs = _randn(device, act, (b, s, d), (b, d))
    elif case.model == "sd3":
        model = forward = model_zoo.build_sd3(d, case.heads, case.depth, provider).to(device, params)
        inputs = _randn(device, act, (b, s, d), (b, case.text, d), (b, d))
    elif case.model == "flux":
        model = forward = model_zoo.build_flux(d, case.heads, case.depth, provider, max_pos=s).to(device, params)
        inputs = _randn(device, act, (b, s, d), (b, d))
    elif case.model == "gpt2":
        model = model_zoo.build_gpt(d, case.heads, case.depth, provider).to(device, params)
        forward = case.compile(model)
    else:
        model = model_zoo.build_llama(d, case.heads, case.intermediate, case.depth, provider,
                                      max_pos=max(case.context, s)).to(device, params)
        if case.decode:
            model.make_cache(b, case.context, prefill=s)
            return Workload(model, model.decode_step, _randn(device, act, (b, 1, d)), train=False)
        forward = case.compile(model)
    return Workload(model, _under_autocast(forward, device) if case.autocast else forward, inputs, case.train,
                    new_graph_step=case.cuda_graphs)


def real_builder(case: RealCase, device: str, dtype: torch.dtype) -> Callable[[str], Workload]:
    """``make(provider)`` -> the :class:`Workload` of a real model: one seeded model is built
    (on first use) and each provider gets a deep copy of it (:func:`.real_models.provider_copy`).
    Eager training steps run in train mode, compiled ones and sampling in eval mode
    (:func:`.real_models.build_base` says why), sampling under ``torch.inference_mode``; the
    check compares in eval mode (DiT's class-label dropout draws random numbers in train
    mode), the output and in training the latent input's gradient. Training steps take that
    gradient too: a language model's ``inputs_embeds`` come from its embedding, which trains;
    for the diffusers models it adds the patch embedding's input gradient (a GEMM of 16-64
    channels, well under 1% of the step); and a compiled model sees the same graph in its
    steps and in the check (a latent requiring grad or not would compile the model twice)."""
    spec, base = case.spec, []

    def inputs(gen):
        kwargs = spec.inputs(case.config, case.batch, device, dtype, gen)
        next(iter(kwargs.values())).requires_grad_(case.train)
        return (kwargs,)

    def make(provider: str) -> Workload:
        if not base:
            base.append(real_models.build_base(case, device, dtype))
        model, note = real_models.provider_copy(base[0], provider)
        compiled = case.compile(model)

        def forward(kwargs):
            return spec.output(compiled(**kwargs))

        def check(gen):
            if not case.train:
                with torch.inference_mode():
                    return forward(*inputs(gen)).clone(), None
            (kwargs,) = inputs(gen)
            latent = next(iter(kwargs.values()))
            training = model.training
            model.eval()
            try:
                model.zero_grad(set_to_none=True)
                out = forward(kwargs)
                out.float().square().mean().backward()
            finally:
                model.train(training)
            return out.detach().clone(), latent.grad

        def fp32_reference(gen):
            model32 = torch.nn.Module.to(copy.deepcopy(base[0]), dtype=torch.float32).eval()
            (kwargs,) = inputs(gen)
            kwargs = {k: v.detach().float() if torch.is_tensor(v) and v.is_floating_point() else v
                      for k, v in kwargs.items()}
            with torch.inference_mode():
                return spec.output(model32(**kwargs)).float().clone()

        return Workload(model, forward, inputs, case.train, grad_off=torch.inference_mode, check=check, note=note,
                        fp32_reference=fp32_reference)

    return make


def _builder(case: Case | RealCase, device: str, dtype: torch.dtype) -> Callable[[str], Workload]:
    """``make(provider)`` -> the provider's :class:`Workload` of ``case``."""
    if isinstance(case, RealCase):
        return real_builder(case, device, dtype)
    return lambda provider: build(case, provider, device, dtype)


# ---------------------------------------------------------------------------------------
# Measurement


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_steps(w: Workload, k: int, device: str) -> float:
    """ms per step of ``k`` back-to-back steps, one synchronize at the end (the one before
    the start keeps the previous provider's queued work out of this time)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(k):
        w.step()
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / k


def _host_step(w: Workload, device: str) -> float:
    """ms of host time of one step started on an empty queue (nothing blocks a launch)."""
    _sync(device)
    start = time.perf_counter()
    w.step()
    elapsed = (time.perf_counter() - start) * 1e3
    _sync(device)
    return elapsed


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in fp32."""
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def _check_result(w: Workload, case: Case, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Output (and first-Linear weight grad in training) of one step on seeded inputs."""
    gen = torch.Generator(device=device).manual_seed(1234)
    if w.check is not None:
        return w.check(gen)
    if case.decode:
        w.model.position = w.model.prefill  # the same cache contents for every provider
    out = w.step(gen).detach().clone()  # a CUDA-graph output is overwritten by the next replay
    grad = model_zoo.first_linear_weight(w.model).grad if case.train else None
    return out, None if grad is None else grad.detach().clone()


@contextlib.contextmanager
def _recompiles_allowed(enabled: bool):
    """Raise dynamo's recompile limits (every case is a new static shape) and drop the
    compiled code afterwards, so the next case compiles fresh and ``compile_s`` means it."""
    if not enabled:
        yield
        return
    import torch._dynamo  # noqa: PLC0415

    config, saved = torch._dynamo.config, {}
    for names in (("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit",
                                                            "accumulated_cache_size_limit")):
        name = next((n for n in names if hasattr(config, n)), None)
        if name is not None:
            saved[name] = getattr(config, name)
            setattr(config, name, max(saved[name], 1024))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
        torch._dynamo.reset()


_INTS = ("batch", "seq", "width")
_FLOATS = ("step_ms", "host_ms", "speedup", "host_ratio", "norm_ms", "rel_diff", "grad_rel_diff", "max_mem_gib",
           "compile_s", "again_ratio", "share_of_limit", "fp32_err", "fp32_err_vs_torch", "speedup_q1", "speedup_q3")


def typed_row(row: dict) -> dict:
    """A ``models.csv`` row as :func:`run_case` makes it: numbers as numbers, blanks as ``None``."""
    return {k: None if v == "" and k in _INTS + _FLOATS else int(v) if k in _INTS else float(v) if k in _FLOATS
            else v for k, v in row.items()}


def blank_row(case: Case | RealCase, provider: str) -> dict:
    return {"model": case.model, "case": case.id, "mode": case.mode, "provider": provider, "batch": case.batch,
            "seq": case.seq, "width": case.width, "step_ms": None, "host_ms": None, "speedup": None,
            "host_ratio": None, "norm_ms": None, "rel_diff": None, "grad_rel_diff": None, "max_mem_gib": None,
            "compile_s": None, "status": "ok", "again_ratio": None, "share_of_limit": None, "fp32_err": None,
            "fp32_err_vs_torch": None, "speedup_q1": None, "speedup_q3": None}


def _prepare(case, providers, settings, device, dtype, rows) -> dict[str, Workload]:
    """Build, warm up and check every provider; return those that work (failures go in
    their row's status)."""
    live, reference, outputs = {}, None, {}
    make = _builder(case, device, dtype)
    for p in providers:
        try:
            with model_norms.provider_settings(p):
                reference = _prepare_one(case, p, make, settings, device, rows, live, reference, outputs)
        except Exception as exc:  # noqa: BLE001 - OOM, missing kernel...: reported, the rest runs
            rows[p]["status"] = runner.describe(exc)
            live.pop(p, None)  # drop a half-built model before the next provider is built
            runner.free(device, collect=True)
    _fp32_errors(live, outputs, device, rows)
    return live


def _fp32_errors(live: dict[str, Workload], outputs: dict, device: str, rows: dict) -> None:
    """Each provider's output error against an fp32 copy of the unpatched model (real models),
    and its ratio to the torch provider's: a cudnorm provider over :data:`FP32_ERROR_RULE`
    gets a failed status (a patched model must be as accurate as the unpatched one)."""
    w = next((w for w in live.values() if w.fp32_reference is not None), None)
    if w is None or "torch" not in outputs:
        return
    try:
        want = w.fp32_reference(torch.Generator(device=device).manual_seed(1234))
    except Exception as exc:  # noqa: BLE001 - e.g. no memory for an fp32 copy: said, not fatal
        rows["torch"]["status"] = f"{rows['torch']['status']} (no fp32 reference: {runner.describe(exc)})"
        return
    for p, out in outputs.items():
        rows[p]["fp32_err"] = _rel(out, want)
    base = rows["torch"]["fp32_err"]
    for p in outputs:
        if base:
            rows[p]["fp32_err_vs_torch"] = rows[p]["fp32_err"] / base
        if (model_norms.norm_provider(p) == "cudnorm" and rows[p]["fp32_err_vs_torch"] is not None
                and rows[p]["fp32_err_vs_torch"] > FP32_ERROR_RULE):
            rows[p]["status"] = (f"failed: output error vs fp32 {rows[p]['fp32_err_vs_torch']:.2f}x the unpatched "
                                 f"model's (at most {FP32_ERROR_RULE}x)")


def _prepare_one(case, p, make, settings, device, rows, live, reference, outputs):
    """Build (``make(p)``), warm up and check provider ``p`` into ``live`` (its checked output
    into ``outputs``); returns the torch provider's ``(output, grad)`` once it has run (the
    reference of the others)."""
    _mark(case, p, "build and first steps")
    w = make(p)
    if w.note:
        rows[p]["status"] = f"ok ({w.note})"
    start = time.perf_counter()
    # decode: walk the whole cache once. SDPA can plan a kernel per key length on first
    # use (tens of ms each on an H100 at small head sizes, cached process-wide), so the
    # first provider to reach each length would otherwise pay for all of them
    for _ in range(settings.warmup + (case.context - case.seq if case.decode else 0)):
        w.step()
    _sync(device)
    if case.compiled:
        rows[p]["compile_s"] = time.perf_counter() - start
    out, grad = _check_result(w, case, device)
    outputs[p] = out
    if p == "torch":
        reference = (out, grad)
    if reference is not None:
        rows[p]["rel_diff"] = _rel(out, reference[0])
        if grad is not None:
            rows[p]["grad_rel_diff"] = _rel(grad, reference[1])
    live[p] = w
    return reference


def _interleave(case, live, settings, device, rows) -> None:
    """R rounds; in each, every provider runs K timed steps and a few host samples in turn
    (the starting provider rotates). Fills step_ms, host_ms and max_mem_gib."""
    steps = {p: [] for p in live}
    hosts = {p: [] for p in live}
    names = list(live)
    rounds, r = settings.rounds, 0
    while r < rounds:
        for p in names[r % len(names):] + names[:r % len(names)]:
            if p not in live:
                continue
            try:
                if device == "cuda":
                    _sync(device)
                    torch.cuda.reset_peak_memory_stats()
                _mark(case, p, "timed steps")
                with model_norms.provider_settings(p):
                    steps[p].append(_timed_steps(live[p], settings.k(case), device))
                    hosts[p] += [_host_step(live[p], device) for _ in range(settings.host_samples(case))]
                if device == "cuda":
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    rows[p]["max_mem_gib"] = max(rows[p]["max_mem_gib"] or 0.0, peak)
            except Exception as exc:  # noqa: BLE001
                rows[p]["status"] = runner.describe(exc)
                del live[p]
                runner.free(device, collect=True)
        if r == 0 and steps and any(steps.values()):  # cheap steps get more rounds: host noise
            slowest = max(v[0] for v in steps.values() if v) * settings.k(case) / 1e3
            rounds = max(settings.rounds, min(settings.max_rounds, math.ceil(settings.timed_s(case) / slowest)))
        r += 1
    for p in live:
        rows[p]["step_ms"] = statistics.median(steps[p])
        rows[p]["host_ms"] = statistics.median(hosts[p])
        rows[p]["_round_ms"] = steps[p]  # for _ratios' round-by-round spread; not a column


def norm_ms(case: Case, provider: str, device: str, dtype: torch.dtype) -> float:
    """GPU ms of one step's norm work for ``provider`` at ``case``'s shapes: as many norm
    calls as one forward makes, each forward (+ autograd backward in training), captured in
    a CUDA graph after a side-stream warm-up (plans, compilation, autotuning must happen
    outside the capture) and timed over replays with CUDA events."""
    work = model_cases.norm_work(case, provider, device, dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            work()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for reps in [1] * 3 + [0] * 5:
        if not reps:  # replays per sample: about 2 ms of GPU time, from the first samples
            reps = max(1, min(200, int(2.0 / max(min(samples), 1e-3))))
        begin.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / reps)
    del graph
    return statistics.median(samples[3:])


@contextlib.contextmanager
def _without_cudnn_sdpa(why: str | None, rows: dict):
    """Turn cuDNN's SDPA backend off while the case runs when ``why`` says it must (and say
    so, on the terminal and in every row's status); restore it after."""
    if why is None:
        yield
        return
    print(f"note: cuDNN SDPA is off for {next(iter(rows.values()))['case']}: {why}")
    for row in rows.values():
        row["status"] = "ok (cuDNN SDPA off)"
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)


def run_case(case: Case | RealCase, providers: list[str], settings: Settings, device: str,
             dtype: torch.dtype) -> list[dict]:
    """Rows of one case, one per provider (see the module docstring for what each holds)."""
    rows = {p: blank_row(case, p) for p in providers}
    real = isinstance(case, RealCase)
    with _recompiles_allowed(case.compiled), _without_cudnn_sdpa(case.sdpa_note(device) if real else None, rows):
        live = _prepare(case, providers, settings, device, dtype, rows)
        if live:
            _interleave(case, live, settings, device, rows)
            if settings.profile_dir is not None:
                host_profile.profile(case, live, settings.profile_dir, device)
        live.clear()
        runner.free(device, collect=True)
        for p in providers:
            # norm_ms replays the zoo's norm calls; a real model's norms are its library's classes
            if device != "cuda" or rows[p]["step_ms"] is None or real:
                continue
            try:
                with model_norms.provider_settings(p):
                    rows[p]["norm_ms"] = norm_ms(case, p, device, dtype)
            except Exception as exc:  # noqa: BLE001 - the step numbers stand without it
                rows[p]["status"] = f"ok (norm_ms: {runner.describe(exc)})"
            runner.free(device, collect=True)
    _ratios(rows)
    return list(rows.values())


def _ratios(rows: dict[str, dict]) -> None:
    """Fill ``speedup``, ``host_ratio``, ``again_ratio`` and ``share_of_limit`` of one case's
    rows (by provider) from their times."""
    base = rows.get("torch")
    if not (base and base["step_ms"]):
        return
    again, limit = rows.get("torch-again"), rows.get("limit")
    again_ratio = base["step_ms"] / again["step_ms"] if again and again["step_ms"] else None
    gain = base["step_ms"] - limit["step_ms"] if limit and limit["step_ms"] else None
    for row in rows.values():
        if row["step_ms"]:
            row["speedup"] = base["step_ms"] / row["step_ms"]
            row["speedup_q1"], row["speedup_q3"] = paired_quartiles(base.get("_round_ms"), row.get("_round_ms"))
            row["host_ratio"] = base["host_ms"] / row["host_ms"]
            row["again_ratio"] = again_ratio
            # no share where the limit is no faster than torch: nothing to take a share of
            row["share_of_limit"] = (base["step_ms"] - row["step_ms"]) / gain if gain and gain > 0 else None


def paired_quartiles(base: list[float] | None, mine: list[float] | None) -> tuple[float | None, float | None]:
    """The first and third quartiles of ``base[r] / mine[r]`` over the rounds ``r`` both
    providers were timed in (ms per step of each round): the spread of a speed-up with the
    drift between rounds cancelled, since both ran in each round. ``(None, None)`` for fewer
    than four rounds, or for rows read back from a CSV."""
    ratios = [b / m for b, m in zip(base or (), mine or ()) if m]
    if len(ratios) < 4:
        return None, None
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return q1, q3


def against_noise(row: dict, again: dict | None) -> str:
    """``"slower"`` or ``"faster"`` where the middle half of ``row``'s round-by-round speed-ups
    lies wholly below or above PyTorch again's (the same model unpatched, a second copy: the
    run's noise), else ``""``: issue 46's "beyond PyTorch again's spread", read off one run."""
    if not again or None in (row.get("speedup_q1"), row.get("speedup_q3"), again.get("speedup_q1"),
                             again.get("speedup_q3")):
        return ""
    if row["speedup_q3"] < again["speedup_q1"]:
        return "slower"
    return "faster" if row["speedup_q1"] > again["speedup_q3"] else ""


def usable_providers(names: list[str], device: str) -> tuple[list[str], list[str]]:
    """(the providers of ``names`` that can run here, torch first; a note on each asked for)."""
    names = ["torch", *(n for n in dict.fromkeys(names) if n != "torch")]  # every ratio is against torch
    why = {n: unavailable(n, device) for n in names}
    return [n for n in names if why[n] is None], [f"{n} {why[n] or 'available'}" for n in names]


# Where a run says what it is doing (case, provider, phase), so that a run resumed after the
# process died (a CUDA error such as an illegal memory access cannot be recovered from in the
# process) knows what killed it
RUNNING = "running.txt"
_marker: Path | None = None


def _mark(case, provider: str, phase: str) -> None:
    if _marker is not None:
        _marker.write_text(f"{case.id}\t{provider}\t{phase}\n")


def resumed(out: Path) -> list[dict]:
    """The rows of an earlier run into ``out`` (``models.csv``), plus one for the case it died
    in (``running.txt``): skipped where the unpatched model was running, a failure of cudnorm's
    where a patched one was."""
    path = out / "models.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        rows = [typed_row(r) for r in csv.DictReader(f)]
    marker = out / RUNNING
    if marker.exists():
        case_id, provider, phase = (marker.read_text().strip().split("\t") + ["", "", ""])[:3]
        if case_id and not any(r["case"] == case_id for r in rows):
            model, mode = case_id.rsplit(":", 1)
            verdict = "failed" if model_norms.norm_provider(provider) == "cudnorm" else "skipped"
            rows.append({**{c: None for c in COLUMNS}, "model": model, "case": case_id, "mode": mode,
                         "provider": provider or "torch",
                         "status": f"{verdict}: the process died in provider {provider}'s {phase} (a CUDA error "
                                   "such as an illegal memory access ends a process; the run resumed after it)"})
        marker.unlink()
    return rows


def run_cases(cases: list[Case], providers: list[str], settings: Settings, device: str, dtype: torch.dtype,
              out: Path, *, resume: bool = False) -> list[dict]:
    """:func:`run_case` for every case, with those of ``providers`` its model has;
    ``out/models.csv`` is kept current after every case, so an interrupted run leaves data.
    ``resume``: keep the rows of an earlier run into ``out`` (:func:`resumed`) and run only the
    cases it has none for."""
    global _marker
    rows: list[dict] = resumed(out) if resume else []
    done = {r["case"] for r in rows}
    cases = [c for c in cases if c.id not in done]
    _marker = out / RUNNING
    for case in progress(cases, len(cases), "cudnorm bench --models"):
        mine = real_models.providers(case, providers) if isinstance(case, RealCase) else [
            p for p in providers if p in MODEL_PROVIDERS[case.model]]
        every = case.model.startswith(real_models.diffusers_all.PREFIX)
        if every and case.mode == "train":
            print(f"{case.model}: {real_models.diffusers_all.patch_note(case.model, case.quick)}")
        got = run_case(case, mine, settings, device, dtype)
        torch_row = next(r for r in got if r["provider"] == "torch")
        if every and torch_row["step_ms"] is None:
            # a class the generic inputs cannot run, unpatched: skipped, not a cudnorm failure
            got = [{**torch_row, "status": f"skipped: {torch_row['status']}"}]
            print(f"skipped {case.id}: {torch_row['status']}")
        rows += got
        report.write_csv(rows, out / "models.csv", columns=COLUMNS)
    report.write_csv(rows, out / "models.csv", columns=COLUMNS)  # a resumed run may have had nothing left to run
    _marker.unlink(missing_ok=True)
    _marker = None
    return rows
