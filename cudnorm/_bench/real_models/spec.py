"""What a real model of the bench is made of (:class:`RealModel`), apart from the registry so
that the model families can use it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# the providers of a real model: unpatched, cudnorm.patch (also under policy "cudnn", and on
# the Python launch path), Liger's RMSNorm modules, a second unpatched copy, norms costing nothing
PROVIDERS = ("torch", "cudnorm", "liger", "cudnorm-cudnn", "cudnorm-python", "cudnorm-torch", "torch-again",
             "cudnorm-blocks", "limit")


@dataclass(frozen=True)
class RealModel:
    """A published model: how to build it and draw its inputs.

    ``build(config)`` returns the module (random init; the caller seeds and places it);
    ``config``/``toy``: constructor arguments at the published widths (default depth) and at
    toy widths (the CPU quick mode); ``full``: the arguments that give the published depth.
    ``inputs(config, batch, device, dtype, gen)`` -> the forward's keyword arguments, the
    first of them the latent (whose gradient is compared); ``output(result)`` -> the tensor
    the loss is taken of. ``batch``/``toy_batch``: the prompt batch; ``cfg``: sampling runs
    2x the prompt batch. ``tokens(config)`` and ``width(config)``: the rows' seq and width."""

    name: str
    library: str
    title: str
    build: Callable[[dict], torch.nn.Module]
    config: dict
    toy: dict
    full: dict
    inputs: Callable[..., dict]
    output: Callable[[Any], torch.Tensor]
    batch: int
    toy_batch: int
    tokens: Callable[[dict], int]
    width: Callable[[dict], int]
    cfg: bool = True
    liger: bool = False
    # why its training step runs with cuDNN's SDPA backend off on a GPU (None: it keeps it)
    cudnn_sdpa_off: str | None = None
    # seconds of timed steps each provider gets at least (None: the run's Settings.min_timed_s);
    # diffusers-all's 70-odd classes take less, to fit one run in minutes
    timed_s: float | None = None

    @property
    def providers(self) -> tuple[str, ...]:
        """Its providers: all of :data:`PROVIDERS`, Liger's only where it has Liger's norm."""
        return tuple(p for p in PROVIDERS if p != "liger" or self.liger)


