"""``cudnorm.patch(model)``: swap, in place, the norms of a PyTorch or transformers model for
cudnorm's modules, keeping every parameter (the same ``Parameter`` objects, so state_dict
keys, tied weights, optimizer state and ``save_pretrained``/``from_pretrained`` are
unchanged), and report what was swapped and what was left and why.

Swapped:

* ``torch.nn.LayerNorm`` -> :class:`cudnorm.LayerNorm`, ``torch.nn.RMSNorm`` ->
  :class:`cudnorm.RMSNorm` (exact classes: a subclass may change the forward);
* transformers' Llama-family RMSNorms (:data:`LLAMA_STYLE_RMS_NORMS`: ``weight *
  normalized(x).to(x.dtype)``) -> :class:`LlamaStyleRMSNorm`, which keeps their output dtype
  (the promotion of the weight's and the input's) and their ``variance_epsilon`` attribute;
* transformers' Gemma RMSNorms (:data:`GEMMA_STYLE_RMS_NORMS`: ``normalized(x) * (1 + weight)``
  in fp32, cast to ``x``'s dtype once) -> :class:`GemmaStyleRMSNorm`, whose graph adds the
  offset itself (``rms_norm(..., weight_offset=1.0)``);
* diffusers' AdaLN classes (``AdaLayerNorm``, ``AdaLayerNormContinuous``, ``AdaLayerNormZero``,
  ``AdaLayerNormZeroSingle``, ``SD35AdaLayerNormZeroX``; exact classes) -> the class of that
  name in :mod:`cudnorm.diffusers`, holding the original's own linear, embedding and norm
  parameters (:func:`cudnorm.diffusers.from_diffusers`). The modules inside a swapped module
  belong to the new one and are not visited again.

Left, with the reason: other Gemma-family norms (Gemma 3n/4 variants with other formulas),
T5's LayerNorm (its output takes the weight's dtype), diffusers' other norm classes and any
other class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .diffusers import from_diffusers
from .modules import LayerNorm, RMSNorm
from .rms_norm import rms_norm

# transformers classes whose forward is Llama's: fp32 rstd, x_hat cast to x's dtype, times weight
LLAMA_STYLE_RMS_NORMS = frozenset((
    "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm", "Qwen3RMSNorm",
    "Qwen3MoeRMSNorm", "Phi3RMSNorm",
))
# transformers classes whose forward is Gemma's: fp32 x_hat * (1 + weight.float()), cast to x's dtype
GEMMA_STYLE_RMS_NORMS = frozenset(("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"))
_WHY_LEFT = {
    "Gemma": "a Gemma-family norm with another formula than Gemma's (1 + weight) RMSNorm",
    "T5LayerNorm": "returns the weight's dtype, which cudnorm's RMSNorm does not",
}


class LlamaStyleRMSNorm(RMSNorm):
    """:class:`cudnorm.RMSNorm` with the output dtype of transformers' Llama-family RMSNorm:
    ``torch.promote_types(weight.dtype, input.dtype)`` (fp32 for fp32 weights on bf16
    input). ``variance_epsilon`` reads and writes ``eps``, as the original attribute did."""

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input [*, hidden]`` -> ``[*, hidden]`` in the promoted dtype."""
        y = super().forward(input)
        dtype = torch.promote_types(self.weight.dtype, input.dtype)
        return y if y.dtype == dtype else y.to(dtype)


class GemmaStyleRMSNorm(torch.nn.Module):
    """transformers' Gemma RMSNorm on cudnorm: ``rms_norm(x) * (1 + weight)`` in fp32, one
    rounding to ``x``'s dtype (the offset is added inside the cuDNN graph, no extra kernel).

    Args:
        dim: the normalised (last) size.
        eps: added to the mean square.
    Parameters: ``weight [dim]``, initialised to zeros (the scale starts at 1), as Gemma's.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input [*, dim]`` -> ``[*, dim]`` in ``input``'s dtype."""
        return rms_norm(input, self.weight.shape, self.weight, self.eps, weight_offset=1.0)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


@dataclass
class PatchReport:
    """What :func:`patch` did: ``swapped`` ``(module name, old class, new class)`` and
    ``left`` ``(module name, class, why)`` for norm-like modules it did not swap."""

    swapped: list[tuple[str, str, str]] = field(default_factory=list)
    left: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"cudnorm.patch: swapped {len(self.swapped)} norm(s), left {len(self.left)}"]
        counts: dict[tuple[str, str], int] = {}
        for _, old, new in self.swapped:
            counts[(old, new)] = counts.get((old, new), 0) + 1
        lines += [f"  {n} x {old} -> {new}" for (old, new), n in counts.items()]
        lines += [f"  left {name} ({cls}): {why}" for name, cls, why in self.left]
        return "\n".join(lines)


def _label(kind: type) -> str:
    """``torch.nn.LayerNorm``, ``cudnorm.RMSNorm``, ``transformers.LlamaRMSNorm``."""
    home = kind.__module__
    if home == "cudnorm.diffusers":  # not cudnorm.AdaLayerNormZero, which is another class
        return f"{home}.{kind.__name__}"
    return f"torch.nn.{kind.__name__}" if home.startswith("torch.nn") else f"{home.split('.')[0]}.{kind.__name__}"


def _is_norm_like(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return "Norm" in name and not type(module).__module__.startswith("cudnorm")


def _why_left(module: torch.nn.Module) -> str:
    name = type(module).__name__
    for prefix, why in _WHY_LEFT.items():
        if name.startswith(prefix):
            return why
    if type(module).__module__.startswith("diffusers"):
        return "no cudnorm counterpart for this diffusers class (or an unexpected layout of it)"
    return "not a class cudnorm knows to compute the same function"


def _replacement(module: torch.nn.Module) -> torch.nn.Module | None:
    """A cudnorm module computing what ``module`` computes, holding its parameters; or None."""
    kind = type(module)
    if kind is torch.nn.LayerNorm:
        new = LayerNorm(module.normalized_shape, eps=module.eps, elementwise_affine=module.elementwise_affine,
                        bias=module.bias is not None, device="meta")
        new.weight, new.bias = module.weight, module.bias
        return new
    if kind is torch.nn.RMSNorm:
        new = RMSNorm(module.normalized_shape, eps=module.eps, elementwise_affine=module.elementwise_affine,
                      device="meta")
        new.weight = module.weight
        return new
    weight = getattr(module, "weight", None)
    if (kind.__name__ in LLAMA_STYLE_RMS_NORMS and isinstance(weight, torch.nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float)):
        new = LlamaStyleRMSNorm(weight.shape[0], eps=module.variance_epsilon, device="meta")
        new.weight = weight
        return new
    if (kind.__name__ in GEMMA_STYLE_RMS_NORMS and isinstance(weight, torch.nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "eps", None), float)):
        new = GemmaStyleRMSNorm(weight.shape[0], eps=module.eps, device="meta")
        new.weight = weight
        return new
    return from_diffusers(module)


def patch(model: torch.nn.Module) -> PatchReport:
    """Swap the supported norms inside ``model`` for cudnorm's, in place (see the module
    docstring). A norm reachable under several names (shared) is replaced everywhere by one
    new module.

    Args:
        model: any ``nn.Module`` holding norms (a transformers ``PreTrainedModel``, a plain
            PyTorch model); not a norm itself (use the cudnorm module directly).

    Returns:
        A :class:`PatchReport`; ``print(report)`` summarises it. Outputs match the original
        modules to one rounding step of the activation dtype; parameters are the same objects.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"cudnorm.patch: argument 'model' must be a torch.nn.Module, got {type(model).__name__}")
    if _replacement(model) is not None:
        raise ValueError(f"cudnorm.patch: argument 'model' is itself a norm ({type(model).__name__}); "
                         "use the cudnorm module directly")
    report, made, inside = PatchReport(), {}, None
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if inside is not None and name.startswith(inside):
            continue  # a child of a swapped module: the new module holds it as it needs it
        if id(module) not in made:
            made[id(module)] = _replacement(module)
            if made[id(module)] is None and _is_norm_like(module):
                report.left.append((name, _label(type(module)), _why_left(module)))
        new = made[id(module)]
        if new is None:
            continue
        new.train(module.training)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        report.swapped.append((name, _label(type(module)), _label(type(new))))
        inside = name + "."
    return report
