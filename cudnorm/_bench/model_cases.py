"""The configurations ``cudnorm bench --models`` runs (:class:`Case`: a model of
:mod:`.model_zoo` at one width, batch and sequence, in one mode) for the full and the quick
run, how a filter selects them, and :func:`norm_work`: one step's norm calls alone (for
``norm_ms``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from .model_norms import ada_factory, ln_factory, rms_factory


class CaseMode:
    """What the ``name`` and ``mode`` of a case (:class:`Case`, ``real_models.RealCase``) say."""

    name: str
    mode: str

    @property
    def id(self) -> str:
        return f"{self.name}:{self.mode}"

    @property
    def train(self) -> bool:
        return self.mode.startswith("train")

    @property
    def compiled(self) -> bool:
        return "compile" in self.mode


@dataclass(frozen=True)
class Case(CaseMode):
    """One model configuration in one mode. ``seq``: tokens per sequence (SD3: image tokens;
    Flux: image and text tokens; decode: the prefilled cache length when timing starts; each
    step adds one token). Mode ``train-autocast``: fp32 parameters (fp32 master weights, norm
    weights included), bf16 inputs and the forward under ``torch.autocast(bfloat16)``, so
    the norms see bf16 activations with fp32 weights."""

    model: str  # "dit" | "sd3" | "flux" | "llama" | "gpt2"
    name: str  # e.g. "dit-1152-b8-s1024"
    # "train" | "train-compile[-<torch.compile mode>]" | "train-autocast" | "infer" | "decode-b<N>"
    mode: str
    batch: int
    seq: int
    width: int
    heads: int
    depth: int
    intermediate: int = 0  # Llama MLP width
    context: int = 0  # decode: KV-cache length
    text: int = 0  # SD3: text-stream tokens

    # compiled only when a filter term names it, even in a full run on a GPU (see select)
    compile_on_request: ClassVar[bool] = False

    @property
    def compile_mode(self) -> str | None:
        """``torch.compile``'s ``mode`` (``"max-autotune"``, ``"reduce-overhead"``) of a
        ``train-compile-<mode>`` case; ``None`` for its default (and uncompiled cases)."""
        return self.mode.partition("compile")[2].lstrip("-") or None

    @property
    def cuda_graphs(self) -> bool:
        """Compiled in a mode whose graphs Inductor replays as CUDA graphs (``reduce-overhead``
        and ``max-autotune``)."""
        return self.compile_mode in ("reduce-overhead", "max-autotune")

    def compile(self, fn: Callable) -> Callable:
        """``fn`` compiled as this case asks (static shapes: each new (B, S, D) is a
        recompile, as for a fixed-resolution job), or ``fn`` itself when not compiled."""
        return torch.compile(fn, dynamic=False, mode=self.compile_mode) if self.compiled else fn

    @property
    def autocast(self) -> bool:
        return self.mode.endswith("autocast")

    @property
    def decode(self) -> bool:
        return self.mode.startswith("decode")


# torch.compile's modes besides its default, for a host-bound and a GPU-bound DiT step:
# mode="reduce-overhead" replays CUDA graphs (no host cost left, only kernels and fusions count;
# docs/performance.md, call Q); max-autotune also tunes GEMMs (minutes per model) and replays CUDA graphs (call U)
EXTRA_COMPILE_MODES = ("train-compile-max-autotune", "train-compile-reduce-overhead")


def _dit_cases(dims, seqs, batches, depth) -> list[Case]:
    return [Case("dit", f"dit-{d}-b{b}-s{s}", mode, b, s, d, h, depth)
            for mode in ("train", "train-compile", "infer") for d, h in dims for s in seqs for b in batches]


def _autocast_cases(cases: list[Case]) -> list[Case]:
    """The ``train-autocast`` twin of each case."""
    return [replace(c, mode="train-autocast") for c in cases]


_DIFFUSION_MODES = ("train", "train-autocast", "infer")


def _sd3_cases(b, s, t, d, h, depth) -> list[Case]:
    return [Case("sd3", f"sd3-{d}-b{b}-s{s}-t{t}", mode, b, s, d, h, depth, text=t) for mode in _DIFFUSION_MODES]


def _flux_cases(b, s, d, h, depth) -> list[Case]:
    return [Case("flux", f"flux-{d}-b{b}-s{s}", mode, b, s, d, h, depth) for mode in _DIFFUSION_MODES]


def _llama_cases(hidden, heads, inter, layers, train_bs, decode_batches, context) -> list[Case]:
    b, s = train_bs
    cases = [Case("llama", f"llama-{hidden}-b{b}-s{s}", mode, b, s, hidden, heads, layers, inter)
             for mode in ("train", "train-compile")]
    return cases + [Case("llama", f"llama-{hidden}", f"decode-b{n}", n, context // 2, hidden, heads, layers, inter,
                         context) for n in decode_batches]


def all_cases(quick: bool) -> list[Case]:
    """Every configuration of the full run, or of the quick run (tiny, seconds on a CPU).

    SD3-like: SD3-medium's width and heads (D = 1536, 24 x 64), 4096 image tokens (a
    1024 x 1024 image: 128 x 128 latents in 2 x 2 patches) and 154 text tokens, B = 2, 6
    joint blocks (SD3-medium has 24). Flux-like: Flux's single-stream width and heads
    (D = 3072, 24 x 128), 4096 image + 512 text tokens, B = 1, 4 blocks (Flux has 38).
    Depths keep a step within tens of ms on an H100.
    """
    if quick:
        dit = _dit_cases([(64, 4)], [16], [2], depth=2)
        return (dit + _autocast_cases([c for c in dit if c.mode == "train"])
                + _sd3_cases(2, 16, 8, 64, 4, depth=2) + _flux_cases(1, 24, 64, 4, depth=2)
                + _llama_cases(64, 4, 128, 2, (2, 32), (1, 2), context=64)
                + [Case("gpt2", "gpt2-64-b2-s32", mode, 2, 32, 64, 4, 2) for mode in ("train", "train-compile")])
    dit = _dit_cases([(1152, 16), (3072, 24)], [256, 1024], [2, 8, 32], depth=4)
    dit += [replace(c, mode=mode) for c in dit if c.mode == "train" and c.name in ("dit-1152-b8-s256", "dit-1152-b32-s1024")
            for mode in EXTRA_COMPILE_MODES]
    return (dit + _autocast_cases([c for c in dit if c.mode == "train" and c.name.startswith("dit-1152-b8-")])
            + _sd3_cases(2, 4096, 154, 1536, 24, depth=6) + _flux_cases(1, 4608, 3072, 24, depth=4)
            + _llama_cases(4096, 32, 11008, 4, (2, 4096), (1, 32), context=1024)
            + [Case("gpt2", "gpt2-1024-b8-s1024", mode, 8, 1024, 1024, 16, 4) for mode in ("train", "train-compile")])


def select(cases: list, filter_text: str | None, device: str, quick: bool) -> list:
    """Cases (these and :mod:`.real_models`') whose id contains any comma-separated term of
    ``filter_text`` ("all": every case); a term that is a whole case id selects that case only
    (``dit-1152-b8-s256:train`` not its ``:train-compile``). Compile modes run on a GPU in a
    full run, elsewhere (and those of cases ``compile_on_request``) only when a term names them."""
    terms = [] if filter_text in (None, "", "all") else [t.strip() for t in filter_text.split(",") if t.strip()]
    ids = {c.id for c in cases}
    exact, parts = {t for t in terms if t in ids}, [t for t in terms if t not in ids]
    chosen = [c for c in cases if not terms or c.id in exact or any(t in c.id for t in parts)]
    named = any("compile" in t for t in terms)
    opt_in = device != "cuda" or quick
    return [c for c in chosen if not c.compiled or named or not (opt_in or c.compile_on_request)]


def dtypes(case: Case, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """``(parameters, activations)`` of ``case`` in a run of ``dtype``: fp32 and bf16 in
    ``train-autocast``, else both ``dtype``."""
    return (torch.float32, torch.bfloat16) if case.autocast else (dtype, dtype)


def norm_work(case: Case, provider: str, device: str, dtype: torch.dtype) -> Callable[[], None]:
    """A zero-argument function running one step's norm calls on static tensors: as many
    calls as one forward makes, each at its activation shape (per block: DiT 2 AdaLN; SD3 2
    AdaLN and a q and a k RMSNorm per stream; Flux 1 AdaLN, q and k RMSNorm; Llama/GPT-2 2
    norms per layer and the final one), followed in training by its autograd backward (grads
    of the input and of the norm's parameters, or of the AdaLN modulation), under autocast in
    ``train-autocast``. Compile modes compile the norm functions alone (a stand-in: inside a
    compiled block inductor may fuse them)."""
    b, d, hd = case.batch, case.width, case.width // case.heads
    s = 1 if case.decode else case.seq
    params, act = dtypes(case, dtype)
    calls = []  # (norm, its arguments, the leaves its backward reaches, dy), one per call

    def randn(*shape):
        return torch.randn(shape, device=device, dtype=act, requires_grad=case.train)

    def compiled(fn):
        # torch.compile's default mode whatever the case's: this work is itself captured in a
        # CUDA graph (models.norm_ms), which mode="reduce-overhead"'s own graphs cannot nest in
        return torch.compile(fn, dynamic=False) if case.compiled else fn

    def ada(tokens: int, chunks: int, count: int) -> None:
        x, mod = randn(b, tokens, d), randn(b, chunks * d)
        fn = compiled(ada_factory(provider))
        calls.extend([(fn, lambda: (x, *mod.chunk(chunks, dim=1)[:2]), [x, mod], torch.randn_like(x))] * count)

    def norm(factory, shape: tuple, eps: float, count: int) -> None:
        x = randn(*shape)
        module = factory(provider)(shape[-1], eps).to(device, params)
        calls.extend([(compiled(module), lambda: (x,), [x, *module.parameters()], torch.randn_like(x))] * count)

    n = case.depth
    if case.model == "dit":
        ada(s, 6, 2 * n)
    elif case.model == "sd3":
        for tokens in (s, case.text):
            ada(tokens, 6, 2 * n)
            norm(rms_factory, (b, tokens, case.heads, hd), 1e-6, 2 * n)
    elif case.model == "flux":
        ada(s, 3, n)
        norm(rms_factory, (b, s, case.heads, hd), 1e-6, 2 * n)
    else:
        llama = case.model == "llama"
        norm(rms_factory if llama else ln_factory, (b, s, d), 1e-6 if llama else 1e-5, 2 * n + 1)

    def work():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=case.autocast):
            for fn, args, leaves, dy in calls:
                y = fn(*args())
                if case.train:
                    torch.autograd.grad(y, leaves, dy)

    return work
