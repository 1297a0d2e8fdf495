"""What a per-class input maker of ``diffusers-all`` is handed (:class:`Inputs`): a step's sizes and
its random tensors. Shared by :mod:`.diffusers_inputs` and :mod:`.diffusers_inputs_av`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Inputs:
    """What an input maker knows of a step."""

    config: dict
    batch: int
    side: int  # latent side (packed layouts: tokens per side)
    frames: int
    text: int  # text tokens
    toy: bool
    device: Any
    dtype: torch.dtype
    gen: torch.Generator | None
    latent: torch.Tensor

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=self.dtype)

    def ones(self, *shape, dtype=None) -> torch.Tensor:
        return torch.ones(shape, device=self.device, dtype=dtype or self.dtype)

    def zeros(self, *shape, dtype=None) -> torch.Tensor:
        return torch.zeros(shape, device=self.device, dtype=dtype or self.dtype)

    def timestep(self) -> torch.Tensor:
        return torch.rand(self.batch, generator=self.gen, device=self.device, dtype=self.dtype) * 999
