"""``cudnorm.patch(model)``: swap, in place, the norms of a PyTorch, transformers or diffusers
model for cudnorm's modules, keeping every parameter (the same ``Parameter`` objects, so
state_dict keys, tied weights, optimizer state and ``save_pretrained``/``from_pretrained`` are
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
* transformers' T5-family LayerNorms (:data:`T5_STYLE_RMS_NORMS`: an RMSNorm normalising in
  fp32, cast to the weight's dtype when that is fp16/bf16, times the weight) and diffusers'
  ``RMSNorm``, which computes the same (SD3's and others' q/k norms) ->
  :class:`T5StyleRMSNorm`, which keeps their output dtype (and ``variance_epsilon``); a
  diffusers ``RMSNorm`` without a weight (``x_hat`` in ``x``'s dtype) -> :class:`cudnorm.RMSNorm`;
* diffusers' AdaLN classes (``AdaLayerNorm``, ``AdaLayerNormContinuous``, ``AdaLayerNormZero``,
  ``AdaLayerNormZeroSingle``, ``SD35AdaLayerNormZeroX``; exact classes) -> the class of that
  name in :mod:`cudnorm.diffusers`, holding the original's own linear, embedding and norm
  parameters (:func:`cudnorm.diffusers.from_diffusers`). The modules inside a swapped module
  belong to the new one and are not visited again.

transformers' norms take a half-precision weight on input of another dtype (a bf16 model fed
fp32) and promote it; the stand-ins pass such a weight to :func:`cudnorm.rms_norm`, which
takes only fp32 or the input's dtype, as fp32.

Left, with the reason: other Gemma-family norms (Gemma 3n/4 variants with other formulas),
diffusers' ``RMSNorm`` with a bias (Sana's output norm), diffusers' ``AdaLayerNormSingle``
(PixArt's timestep embedding: it normalises nothing; the blocks modulate their
``nn.LayerNorm``, which is swapped), diffusers' other norm classes and any other class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import _warn
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
# transformers classes whose forward is T5's: x * rsqrt(mean(x.float()^2) + eps), cast to the
# weight's dtype if that is fp16/bf16, times weight (the "Copied from T5" family)
T5_STYLE_RMS_NORMS = frozenset((
    "T5LayerNorm", "MT5LayerNorm", "UMT5LayerNorm", "LongT5LayerNorm", "SwitchTransformersLayerNorm",
    "Pix2StructLayerNorm", "Pop2PianoLayerNorm", "UdopLayerNorm",
))
_WHY_LEFT = {  # class name prefix -> why
    "Gemma": "a Gemma-family norm with another formula than Gemma's (1 + weight) RMSNorm",
}
_WHY_LEFT_DIFFUSERS = {  # diffusers class name -> why
    "RMSNorm": "a bias after the norm (or a weight of several dims), which cudnorm's RMSNorm does not take",
    "AdaLayerNormSingle": "normalises nothing (PixArt's timestep embedding and modulation linear; "
                          "the blocks' nn.LayerNorms it modulates are swapped)",
}
_HALF = (torch.float16, torch.bfloat16)


def _param_for(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in a dtype cudnorm's ops take with ``input``: as it is when that is the
    input's or fp32, else cast to fp32 (float64 for float64 input). transformers' norms take a
    half weight on other input (bf16 weights on an fp32 residual stream) and promote it."""
    if weight.dtype is input.dtype or (weight.dtype is torch.float32 and input.dtype is not torch.float64):
        return weight
    return weight.to(torch.float64 if input.dtype is torch.float64 else torch.float32)


class _TransformersRMSNorm(RMSNorm):
    """:class:`cudnorm.RMSNorm` whose ``variance_epsilon`` reads and writes ``eps``, as the
    attribute of transformers' RMSNorms did (model code and hooks read it)."""

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value


class LlamaStyleRMSNorm(_TransformersRMSNorm):
    """:class:`cudnorm.RMSNorm` with the output dtype of transformers' Llama-family RMSNorm:
    ``torch.promote_types(weight.dtype, input.dtype)`` (fp32 for fp32 weights on bf16
    input). ``variance_epsilon`` reads and writes ``eps``, as the original attribute did."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input [*, hidden]`` -> ``[*, hidden]`` in the promoted dtype."""
        weight = _param_for(input, self.weight)
        if weight is self.weight:
            y = super().forward(input)
        else:
            y = rms_norm(input, self.normalized_shape, weight, self.eps)
        dtype = torch.promote_types(self.weight.dtype, input.dtype)
        return y if y.dtype == dtype else y.to(dtype)


class T5StyleRMSNorm(_TransformersRMSNorm):
    """transformers' T5 LayerNorm (an RMSNorm: no mean, no bias) on cudnorm, with its output
    dtype: the weight's for fp16/bf16 weights (whatever the input's), otherwise the promotion
    of the input's, the weight's and fp32 (fp32 for an fp32 weight on bf16 input).
    ``variance_epsilon`` reads and writes ``eps``, as the original attribute did.

    T5 normalises in fp32, rounds ``x_hat`` to a half-precision weight's dtype, then
    multiplies. Input and weight of one dtype run one :func:`cudnorm.rms_norm`, which rounds
    once where T5 rounds twice (the same numbers in fp32). Any other pair runs it in fp32,
    where T5's own arithmetic happens (or float64 where a float64 tensor takes part), and
    rounds the result once to the output dtype: a bf16 model whose residual stream became
    fp32 (T5 keeps its ``wo`` layers in fp32) gets bf16 out, as from T5, and an fp32-weight
    norm on bf16 input gets the fp32 result T5 computes rather than a bf16 one. diffusers'
    ``RMSNorm`` with a weight computes the same and is swapped for this class too.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input [*, hidden]`` -> ``[*, hidden]`` in T5's output dtype (class docstring)."""
        weight = self.weight
        if input.dtype is weight.dtype:
            return super().forward(input)
        compute = torch.promote_types(torch.promote_types(input.dtype, weight.dtype), torch.float32)
        y = rms_norm(input.to(compute), self.normalized_shape, weight.to(compute), self.eps)
        return y.to(weight.dtype) if weight.dtype in _HALF else y


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
        return rms_norm(input, self.weight.shape, _param_for(input, self.weight), self.eps, weight_offset=1.0)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


# transformers class name -> the module standing in for it, for classes holding ``weight`` and
# ``variance_epsilon``
_VARIANCE_EPSILON_STYLES = {**dict.fromkeys(LLAMA_STYLE_RMS_NORMS, LlamaStyleRMSNorm),
                            **dict.fromkeys(T5_STYLE_RMS_NORMS, T5StyleRMSNorm)}


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
        return _WHY_LEFT_DIFFUSERS.get(
            name, "no cudnorm counterpart for this diffusers class (or an unexpected layout of it)")
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
    style = _VARIANCE_EPSILON_STYLES.get(kind.__name__)
    if (style is not None and isinstance(weight, torch.nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float)):
        new = style(weight.shape[0], eps=module.variance_epsilon, device="meta")
        new.weight = weight
        return new
    if (kind.__name__ in GEMMA_STYLE_RMS_NORMS and isinstance(weight, torch.nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "eps", None), float)):
        new = GemmaStyleRMSNorm(weight.shape[0], eps=module.eps, device="meta")
        new.weight = weight
        return new
    if kind.__name__ == "RMSNorm" and kind.__module__.startswith("diffusers."):
        return _from_diffusers_rms_norm(module)
    return from_diffusers(module)


def _from_diffusers_rms_norm(module: torch.nn.Module) -> torch.nn.Module | None:
    """diffusers' ``RMSNorm`` computes T5's formula, and without a weight ``x_hat`` cast to
    ``x``'s dtype, which is :class:`cudnorm.RMSNorm`'s; one with a bias is left (None)."""
    dim, weight, eps = getattr(module, "dim", ()), getattr(module, "weight", None), getattr(module, "eps", None)
    if len(dim) != 1 or getattr(module, "bias", None) is not None or not isinstance(eps, float):
        return None
    if weight is None:
        return RMSNorm(dim, eps=eps, elementwise_affine=False)
    if not isinstance(weight, torch.nn.Parameter) or weight.shape != dim:
        return None
    new = T5StyleRMSNorm(dim, eps=eps, device="meta")
    new.weight = weight
    return new


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
    if not report.swapped:  # a model without supported norms, or one patched already
        _warn.warn(f"cudnorm.patch: swapped no norm in {type(model).__name__} ({len(report.left)} norm-like "
                   "module(s) left, listed in the returned report)", RuntimeWarning)
    return report
