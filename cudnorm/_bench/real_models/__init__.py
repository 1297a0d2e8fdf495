"""The models people run, in ``cudnorm bench --models``: diffusers' and transformers' own
classes at their published widths (random weights, fewer layers), each provider a deep copy
of one seeded model (:func:`provider_copy`): ``torch`` and ``torch-again`` unpatched,
``cudnorm`` through ``cudnorm.patch`` (``cudnorm-blocks`` with ``blocks=True``), ``liger`` with Liger's RMSNorm modules (Llama, Qwen3),
``limit`` with norms and AdaLN modulation costing nothing (:mod:`.limit`).

Models (:data:`MODELS`; builders in :mod:`.diffusers_models` and :mod:`.transformers_models`):
DiT-XL/2 (B 32, 256 px), PixArt-alpha (B 8, 512 px), SD3.5-medium (B 2, 1024 px) and
Flux.1-dev (B 1, 1024 px, 512 text tokens), Llama-3-8B and Qwen3-8B widths (B 1, 4096
tokens). Modes: ``train`` (forward, loss, backward), ``sample`` (a forward under
``torch.inference_mode`` in eval mode; the diffusers models at the classifier-free guidance
batch, 2x the prompt batch, but guidance-distilled Flux.1-dev at its prompt batch, as its
pipeline runs it; the language models a prefill), each also ``-compile``
(``torch.compile`` of the whole model; only run when a filter term names it).

Depth: the issue's (DiT 12, PixArt 12, SD3.5 8, Flux 2 double + 6 single blocks, Llama/Qwen3
4 layers) by default: every case then times four copies (torch, torch-again, cudnorm, limit)
within a few seconds and its copies, their gradients and one step's activations fit an 80 GB
GPU with room (Flux.1's, the largest: 1.6B parameters, 3 GiB and as much for gradients per
copy). ``RealCase(..., full_depth=True)`` builds the published depth: DiT-XL/2 and PixArt (28
layers, 0.75B/0.6B parameters) fit four copies; SD3.5-medium (24 layers, 2.2B) fits four
tightly; Llama-3-8B/Qwen3-8B (32/36 layers, 7.5B: 27 GiB a copy with gradients) two; Flux.1
(19 + 38 blocks, 11.9B) one.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import model_cases, model_norms, model_zoo
from . import diffusers_all, diffusers_models, limit, transformers_models
from .spec import RealModel

MODELS = {m.name: m for m in (*diffusers_models.MODELS, *transformers_models.MODELS)}
MODES = ("train", "sample", "train-compile", "sample-compile")
# every real case times these, whatever --providers says: the noise floor and the ceiling
ALWAYS = ("torch-again", "limit")


@dataclass(frozen=True)
class RealCase(model_cases.CaseMode):
    """One real model in one mode, with the attributes :mod:`..models` reads of a case."""

    model: str  # a key of MODELS
    mode: str  # one of MODES
    quick: bool = False  # toy widths
    full_depth: bool = False

    # compiled only when a filter term names it, on a GPU too (a whole model takes minutes)
    compile_on_request: ClassVar[bool] = True
    decode: ClassVar[bool] = False  # no KV-cache decode steps (models.py reads it of every case)

    @property
    def spec(self) -> RealModel:
        return spec(self.model)

    @property
    def name(self) -> str:
        return self.model + ("-full" if self.full_depth else "")

    @property
    def config(self) -> dict:
        spec = self.spec
        return spec.toy if self.quick else {**spec.config, **(spec.full if self.full_depth else {})}

    @property
    def batch(self) -> int:
        """The batch a step runs: the prompt batch, twice it when sampling with CFG."""
        prompts = self.spec.toy_batch if self.quick else self.spec.batch
        return prompts * (2 if self.spec.cfg and not self.train else 1)

    @property
    def seq(self) -> int:
        return self.spec.tokens(self.config)

    @property
    def width(self) -> int:
        return self.spec.width(self.config)

    def compile(self, fn: Callable) -> Callable:
        return torch.compile(fn, dynamic=False) if self.compiled else fn

    def missing(self) -> str | None:
        """Why this case cannot run here (its library is not installed; a diffusers-all class
        that cannot be built or has no norm ``cudnorm.patch`` swaps), or None."""
        library = MODELS[self.model].library if self.model in MODELS else "diffusers"
        if not importlib.util.find_spec(library):
            return f"{library} is not installed"
        if self.model in MODELS:
            return None
        probed = diffusers_all.probe(self.model.removeprefix(diffusers_all.PREFIX), self.quick)
        if isinstance(probed, str):
            return probed
        return diffusers_all.not_quick(self.model) if self.quick else None

    def sdpa_note(self, device: str) -> str | None:
        """Why this case turns cuDNN's SDPA backend off, or None when it keeps it."""
        return self.spec.cudnn_sdpa_off if device == "cuda" and self.train else None


def spec(model: str) -> RealModel:
    """The :class:`RealModel` named ``model``: one of :data:`MODELS` or ``diffusers-all:<Class>``."""
    return MODELS[model] if model in MODELS else diffusers_all.spec(model)


def is_real(model: str) -> bool:
    """Whether ``model`` (a row's) names a real model."""
    return model in MODELS or model.startswith(diffusers_all.PREFIX)


def cases(quick: bool, diffusers_every: bool = False) -> list[RealCase]:
    """Every real model in every mode (toy widths when ``quick``); with ``diffusers_every``
    (a filter naming ``diffusers-all``) also every diffusers transformer class
    (:mod:`.diffusers_all`; imports diffusers), eager modes only."""
    every = [RealCase(name, mode, quick) for name in MODELS for mode in MODES]
    if diffusers_every and importlib.util.find_spec("diffusers"):
        every += [RealCase(name, mode, quick) for name in diffusers_all.names() for mode in ("train", "sample")]
    return every


def providers(case: RealCase, asked: list[str]) -> list[str]:
    """The providers ``case`` runs: those asked for that its model has, then :data:`ALWAYS`."""
    return [p for p in dict.fromkeys([*asked, *ALWAYS]) if p in case.spec.providers]


def build_base(case: RealCase, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The seeded model of ``case`` on ``device`` in ``dtype``, built once per case and copied
    for each provider; in train mode for eager training, else in eval mode. Compiled training
    steps run in eval mode too: the check compares in eval mode, and a model switching modes
    compiles twice (minutes at these widths). The six models' dropouts are all 0: eval mode
    only skips DiT's class-label dropout, a ``[B]`` rand."""
    torch.manual_seed(0)
    with torch.device(device):
        model = case.spec.build(case.config)
    # buffers made from numpy (sin-cos position tables) land on the CPU whatever the default device
    # nn.Module.to: diffusers' own .to warns of casting a model not loaded by from_pretrained
    model = torch.nn.Module.to(model, device=device, dtype=dtype)
    # norm weights start at ones: randomised as a trained model's are, or the loss of Llama's
    # final norm would not depend on its input (model_zoo.randomize_norms says why)
    return model_zoo.randomize_norms(model).train(case.train and not case.compiled)


def provider_copy(base: torch.nn.Module, provider: str) -> tuple[torch.nn.Module, str | None]:
    """A deep copy of ``base`` with ``provider``'s norms, and a note for its row (what
    ``cudnorm.patch`` left, when it left something)."""
    model = copy.deepcopy(base)
    kind = model_norms.norm_provider(provider)
    if kind == "cudnorm":
        import cudnorm  # noqa: PLC0415

        report = cudnorm.patch(model, blocks=provider == "cudnorm-blocks")
        if report.left:
            left = sorted({cls.rpartition(".")[2] for _, cls, _ in report.left})
            return model, f"patch left {len(report.left)} ({', '.join(left)})"
    elif kind == "limit":
        limit.free_norms(model)
    elif kind == "liger":
        transformers_models.use_liger(model)
    return model, None
