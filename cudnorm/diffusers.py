"""diffusers-compatible adaptive LayerNorm modules running cudnorm's ops.

Each class here has the constructor (positional order, defaults), the submodule and parameter
names (so ``state_dict`` keys), the forward signature and the returned tuple of the
diffusers 0.42 class of the same name, so a pretrained checkpoint loads with
``strict=True`` and model code written for diffusers runs unchanged:

* :class:`AdaLayerNormZero` (DiT with its timestep/class embedding ``emb``; SD3/Flux/AuraFlow
  with a given ``emb``), :class:`AdaLayerNormZeroSingle` (Flux), :class:`SD35AdaLayerNormZeroX`,
* :class:`AdaLayerNormContinuous` (``layer_norm`` and ``rms_norm``),
* :class:`AdaLayerNorm` (diffusers' class of that name, with its own linear layer; not
  :class:`cudnorm.AdaLayerNorm`, which has no parameters).

What runs: a LayerNorm followed by ``* (1 + scale) + shift`` with per-sample ``scale``/``shift``
is one :func:`cudnorm.ada_layer_norm` call; an affine LayerNorm's weight and bias are folded
into the per-sample gain and shift first (``[B, D]`` work), so it is still one call; a shared
``[D]`` scale/shift (diffusers' ``AdaLayerNorm`` with ``chunk_dim=0``) is one
:func:`cudnorm.layer_norm` call with the folded weight and bias. The RMSNorm variant runs
:func:`cudnorm.rms_norm` and modulates in PyTorch (cuDNN has no adaptive RMSNorm). Any other
broadcast of the modulation (a batch of one against many samples, say) runs diffusers'
formula as written, with the norm on cudnorm.

Dtypes follow diffusers: the result takes the promotion of ``x``'s and the modulation's
dtypes (bf16 ``x`` with an fp32 module gives fp32, fp32 ``x`` with a bf16 module gives
fp32). The conditioning is cast to the linear layer's dtype before it: diffusers'
``AdaLayerNormContinuous`` casts it to ``x``'s dtype and ``AdaLayerNormZero`` not at all,
and both give the same numbers wherever diffusers' call runs; the cast lets a bf16 module
take fp32 conditioning as well.

The forwards of these classes read only attributes that diffusers' classes of the same names
have too, so :func:`cudnorm.patch` runs them on diffusers' own modules (:data:`FUSED`, with the
forwards of ``CogVideoXLayerNormZero``, ``AdaLayerNormShift`` and ``SanaModulatedNorm``, and
of the modulated RMSNorms ``LuminaRMSNormZero``, ``MochiRMSNormZero`` and
``MochiModulatedRMSNorm`` on :func:`cudnorm.ada_rms_norm`, and ``LuminaLayerNormContinuous``);
:func:`from_diffusers` builds the class here around a diffusers module's children. This module
never imports diffusers.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import NamedTuple

import torch

from . import _checks
from ._patch_table import qualified_name
from .ada_layer_norm import ada_layer_norm
from .ada_rms_norm import ada_rms_norm
from .layer_norm import layer_norm
from .modules import LayerNorm, RMSNorm
from .rms_norm import rms_norm

__all__ = [
    "AdaLayerNorm",
    "AdaLayerNormContinuous",
    "AdaLayerNormZero",
    "AdaLayerNormZeroSingle",
    "SD35AdaLayerNormZeroX",
    "from_diffusers",
]

_HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- argument checks

def _fail(exc_type, cls: str, arg: str, message: str):
    _checks._fail(exc_type, f"diffusers.{cls}", arg, message)


def _int(cls: str, arg: str, value, *, minimum: int = 1, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(TypeError, cls, arg, f"must be an int{' or None' if optional else ''}, got {type(value).__name__}")
    if value < minimum:
        _fail(ValueError, cls, arg, f"must be >= {minimum}, got {value}")
    return int(value)


def _eps(cls: str, arg: str, value) -> float:
    """As :func:`cudnorm._checks.check_eps`, naming the argument (``eps`` or ``norm_eps``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(TypeError, cls, arg, f"must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        _fail(ValueError, cls, arg, f"must be finite and >= 0, got {value}")
    return float(value)


def _flag(cls: str, arg: str, value) -> bool:
    """A bool; ``None`` and ints are read by truth value, as ``nn.Linear``'s ``bias`` reads
    them (diffusers' ``BasicTransformerBlock`` passes ``ada_norm_bias=None`` as ``bias``)."""
    if value is not None and not isinstance(value, numbers.Integral):
        _fail(TypeError, cls, arg, f"must be a bool, got {type(value).__name__}")
    return bool(value)


def _choice(cls: str, arg: str, value, choices) -> str:
    if not isinstance(value, str):
        _fail(TypeError, cls, arg, f"must be a str, got {type(value).__name__}")
    if value not in choices:
        _fail(ValueError, cls, arg, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _tensor(cls: str, arg: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        _fail(TypeError, cls, arg, f"must be a torch.Tensor, got {type(value).__name__}")
    return value


_INPUT_DTYPES = frozenset(_checks.INPUT_DTYPES)


def _input(cls: str, arg: str, value) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.dtype in _INPUT_DTYPES:  # every call: no message to build
        return value
    return _checks.check_tensor(f"diffusers.{cls}", arg, value, dtypes=_checks.INPUT_DTYPES)


# ---------------------------------------------------------------- the math

def _project(cls: str, arg: str, linear: torch.nn.Module, silu: torch.nn.Module, emb) -> torch.Tensor:
    """``linear(silu(emb))``, ``emb [B, C]`` (the forward's argument ``arg``) cast to the
    linear's dtype after the SiLU (a no-op wherever diffusers' own call runs, and under
    autocast the linear casts again)."""
    h = silu(_input(cls, arg, emb))
    # the registered weight without nn.Module.__getattr__'s detour (every call); else an
    # attribute such as a LoRA wrapper's property. A quantized linear keeps its own input rule
    params = linear._parameters
    weight = params["weight"] if "weight" in params else getattr(linear, "weight", None)
    if isinstance(weight, torch.Tensor) and h.dtype is not weight.dtype and weight.is_floating_point():
        h = h.to(weight.dtype)
    return linear(h)


def _modulated_layer_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float,
                          weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' ``layer_norm(x, weight, bias) * (1 + scale) + shift`` over the last dim.

    ``scale``/``shift`` come indexed as diffusers broadcasts them: ``[B, 1, D]`` per sample
    for ``x [B, S, D]``, or ``[D]`` shared. Per-sample pairs run one :func:`ada_layer_norm`,
    shared pairs one :func:`layer_norm`; an affine weight/bias is folded into the gain and
    shift first: ``(xhat * w + b) * (1 + s) + t == xhat * (w * (1 + s)) + (b * (1 + s) + t)``.
    Returns the promotion of ``x``'s and the modulation's dtypes, as diffusers' formula does.
    """
    d = x.shape[-1]
    per_sample = (scale.dim() == x.dim() >= 2 and scale.shape == shift.shape and scale.shape[0] == x.shape[0]
                  and scale.shape[-1] == d and scale.numel() == x.shape[0] * d)
    shared = scale.dim() == shift.dim() == 1 and scale.shape[0] == shift.shape[0] == d
    if not (per_sample or shared):  # any other broadcast: the formula as written
        return layer_norm(x, d, weight, bias, eps) * (1 + scale) + shift
    dtype = torch.promote_types(x.dtype, torch.promote_types(scale.dtype, shift.dtype))
    x = x.to(dtype)
    if per_sample and weight is None and bias is None:
        return ada_layer_norm(x, scale.to(dtype), shift.to(dtype), eps, one_plus_scale=True)
    # fold in fp32 (or fp64): [B, D] or [D] elements, each folded value rounded once to x's
    # dtype, as the op rounds its own 1 + scale (and so the default policy may hand small or
    # compiled calls to PyTorch's ops, which it does only for parameters of x's dtype)
    wide = torch.promote_types(dtype, torch.float32)
    gain = 1 + scale.to(wide)
    shift = shift.to(wide) if bias is None else shift.to(wide) + bias.to(wide) * gain
    gain = gain if weight is None else gain * weight.to(wide)
    gain, shift = gain.to(dtype), shift.to(dtype)
    if per_sample:
        return ada_layer_norm(x, gain, shift, eps)
    return layer_norm(x, d, gain, shift, eps)


def _chunks(cls: str, module: torch.nn.Module, x, x_arg: str, emb, count: int) -> tuple[torch.Tensor, ...]:
    """``count`` chunks ``[B, D]`` of ``module.linear(module.silu(emb))`` after checking the
    forward's ``x`` (argument ``x_arg``)."""
    _input(cls, x_arg, x)
    return _project(cls, "emb", module.linear, module.silu, emb).chunk(count, dim=1)


def _modulate(norm: torch.nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``norm(x) * (1 + scale[:, None]) + shift[:, None]`` for ``scale``/``shift`` ``[B, D]``
    chunks of one projection, one fused op.

    DiT's, SD3's and Flux's call (``x [B, S, D]`` of the chunks' dtype, a non-affine norm) goes
    straight to :func:`ada_layer_norm`, which takes ``[B, D]`` chunks as they are: this runs in
    every block of a host-bound training step, so it does no more than diffusers' forward
    (reading the norm's attributes) plus that one call. Any other call:
    :func:`_modulated_layer_norm`."""
    weight, bias = norm.weight, norm.bias
    if (weight is None and bias is None and x.dtype is scale.dtype and x.dim() == 3
            and scale.shape[0] == x.shape[0] and scale.shape[1] == x.shape[2] and shift.shape == scale.shape):
        return ada_layer_norm(x, scale, shift, norm.eps, one_plus_scale=True)
    return _modulated_layer_norm(x, scale[:, None], shift[:, None], norm.eps, weight, bias)


def _modulated_rms_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, norm: torch.nn.RMSNorm
                        ) -> torch.Tensor:
    """diffusers' ``RMSNorm(x) * (1 + scale) + shift``: the norm on :func:`rms_norm`, the
    modulation in PyTorch. diffusers' RMSNorm returns ``x``'s dtype without a weight, the
    weight's dtype with a half-precision weight, and fp32 (or wider) with an fp32 weight
    (the fp32 statistics are not rounded to a bf16 ``x``'s dtype); so does this."""
    weight, d = norm.weight, x.shape[-1]
    if weight is None or weight.dtype is x.dtype:
        y = rms_norm(x, d, weight, norm.eps)
    else:
        wide = torch.promote_types(x.dtype, weight.dtype)
        y = rms_norm(x.to(wide), d, weight.to(wide), norm.eps)
        y = y.to(weight.dtype) if weight.dtype in _HALF else y
    return y * (1 + scale) + shift


# ---------------------------------------------------------------- DiT's conditioning embedding

def _timestep_features(timestep: torch.Tensor, channels: int = 256) -> torch.Tensor:
    """DiT's sinusoidal timestep features, ``[B] -> [B, channels]`` fp32, cosines first
    (diffusers' ``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1)``)."""
    half = channels // 2
    exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=timestep.device)
    angles = timestep[:, None].float() * torch.exp(exponent / (half - 1))[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class _LabelEmbedding(torch.nn.Module):
    """Class-label embedding with DiT's label dropout for classifier-free guidance: in
    training, each label becomes the extra "null" class ``num_classes`` with probability
    ``dropout_prob`` (one ``torch.rand`` draw per sample, as diffusers' ``LabelEmbedding``)."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float) -> None:
        super().__init__()
        self.embedding_table = torch.nn.Embedding(num_classes + (dropout_prob > 0), hidden_size)
        self.num_classes, self.dropout_prob = num_classes, dropout_prob

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        """``labels [B]`` int64 -> ``[B, hidden_size]`` in the table's dtype."""
        if self.training and self.dropout_prob > 0:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            labels = torch.where(drop, self.num_classes, labels)
        return self.embedding_table(labels)


class _TimestepLabelEmbedding(torch.nn.Module):
    """DiT's conditioning: an MLP of the timestep's sinusoidal features plus the class
    embedding. Parameter names are those of diffusers' ``CombinedTimestepLabelEmbeddings``
    (``timestep_embedder.linear_1/linear_2``, ``class_embedder.embedding_table``)."""

    def __init__(self, num_classes: int, embedding_dim: int, class_dropout_prob: float = 0.1) -> None:
        super().__init__()
        self.timestep_embedder = torch.nn.Sequential()
        self.timestep_embedder.add_module("linear_1", torch.nn.Linear(256, embedding_dim))
        self.timestep_embedder.add_module("act", torch.nn.SiLU())
        self.timestep_embedder.add_module("linear_2", torch.nn.Linear(embedding_dim, embedding_dim))
        self.class_embedder = _LabelEmbedding(num_classes, embedding_dim, class_dropout_prob)

    def forward(self, timestep: torch.Tensor, class_labels: torch.Tensor,
                hidden_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``timestep [B]`` (int or float), ``class_labels [B]`` int64 -> ``[B, D]``. The
        features enter the MLP in ``hidden_dtype`` (default: the MLP's dtype)."""
        cls = "AdaLayerNormZero"
        if _tensor(cls, "timestep", timestep).dim() != 1:
            _fail(ValueError, cls, "timestep", f"must be 1-D (one timestep per sample), got shape {tuple(timestep.shape)}")
        _tensor(cls, "class_labels", class_labels)
        if hidden_dtype is not None and not isinstance(hidden_dtype, torch.dtype):
            _fail(TypeError, cls, "hidden_dtype", f"must be a torch.dtype or None, got {type(hidden_dtype).__name__}")
        dtype = self.timestep_embedder.linear_1.weight.dtype if hidden_dtype is None else hidden_dtype
        return self.timestep_embedder(_timestep_features(timestep).to(dtype)) + self.class_embedder(class_labels)


# ---------------------------------------------------------------- adaLN-Zero family

class _AdaLayerNormZeroBase(torch.nn.Module):
    """``emb -> SiLU -> Linear(D, chunks * D)`` and a non-affine LayerNorm ``norm``; the
    subclasses' forwards chunk the projection and modulate with it, reading only attributes
    that diffusers' classes of the same names have too (``cudnorm.patch`` runs them on
    diffusers' own modules)."""

    _CHUNKS = 0
    _EPS = {"layer_norm": 1e-6}  # norm_type -> the eps diffusers' norm of that type uses

    def __init__(self, embedding_dim: int, norm_type: str, bias: bool, emb: torch.nn.Module | None = None) -> None:
        name = type(self).__name__
        dim = _int(name, "embedding_dim", embedding_dim)
        eps = self._EPS[_choice(name, "norm_type", norm_type, tuple(self._EPS))]
        bias = _flag(name, "bias", bias)
        super().__init__()
        if emb is not None:
            self.emb = emb  # registered first: diffusers' key order
        self.silu = torch.nn.SiLU()
        self.linear = torch.nn.Linear(dim, self._CHUNKS * dim, bias=bias)
        self.norm = LayerNorm(dim, eps=eps, elementwise_affine=False)


class AdaLayerNormZero(_AdaLayerNormZeroBase):
    """diffusers' ``AdaLayerNormZero`` (adaLN-Zero of DiT, SD3, Flux, AuraFlow) on
    :func:`cudnorm.ada_layer_norm`.

    ``AdaLayerNormZero(embedding_dim, num_embeddings=None, norm_type="layer_norm", bias=True)``:

    * ``num_embeddings`` (DiT): the module embeds the conditioning itself: ``emb`` is DiT's
      timestep MLP plus a class embedding of ``num_embeddings`` classes (+1 null class for
      label dropout), with diffusers' parameter names;
    * ``norm_type``: ``"layer_norm"`` (eps 1e-6) or ``"fp32_layer_norm"`` (eps 1e-5; the
      LayerNorm in fp32, which cudnorm's op does for every dtype);
    * ``bias``: whether ``linear`` has a bias.

    ``forward(x, timestep=None, class_labels=None, hidden_dtype=None, emb=None)``: ``x``
    ``[B, S, D]``; with ``num_embeddings``, ``timestep [B]`` and ``class_labels [B]`` (int64)
    and ``hidden_dtype`` (the dtype the timestep features enter the MLP in), otherwise
    ``emb [B, D]``. Returns ``(norm(x) * (1 + scale_msa) + shift_msa, gate_msa, shift_mlp,
    scale_mlp, gate_mlp)``, the first ``[B, S, D]``, the others ``[B, D]`` in the linear's
    dtype. The first is one fused op.
    """

    _CHUNKS = 6
    _EPS = {"layer_norm": 1e-6, "fp32_layer_norm": 1e-5}

    def __init__(self, embedding_dim: int, num_embeddings: int | None = None, norm_type: str = "layer_norm",
                 bias: bool = True) -> None:
        dim = _int("AdaLayerNormZero", "embedding_dim", embedding_dim)
        classes = _int("AdaLayerNormZero", "num_embeddings", num_embeddings, optional=True)
        emb = None if classes is None else _TimestepLabelEmbedding(classes, dim)
        super().__init__(dim, norm_type, bias, emb)
        if emb is None:
            self.emb = None

    def forward(self, x: torch.Tensor, timestep: torch.Tensor | None = None, class_labels: torch.Tensor | None = None,
                hidden_dtype: torch.dtype | None = None, emb: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(modulated x [B, S, D], gate_msa, shift_mlp, scale_mlp, gate_mlp)`` (see the class)."""
        if self.emb is not None:
            emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
        chunks = _chunks("AdaLayerNormZero", self, x, "x", emb, 6)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = chunks
        return _modulate(self.norm, x, scale_msa, shift_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroSingle(_AdaLayerNormZeroBase):
    """diffusers' ``AdaLayerNormZeroSingle`` (Flux's single-stream blocks) on
    :func:`cudnorm.ada_layer_norm`.

    ``AdaLayerNormZeroSingle(embedding_dim, norm_type="layer_norm", bias=True)``;
    ``forward(x, emb=None)`` with ``x [B, S, D]``, ``emb [B, D]`` returns
    ``(norm(x) * (1 + scale_msa) + shift_msa, gate_msa)`` (one fused op; ``gate_msa [B, D]``).
    """

    _CHUNKS = 3

    def __init__(self, embedding_dim: int, norm_type: str = "layer_norm", bias: bool = True) -> None:
        super().__init__(embedding_dim, norm_type, bias)

    def forward(self, x: torch.Tensor, emb: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(modulated x [B, S, D], gate_msa [B, D])``."""
        shift_msa, scale_msa, gate_msa = _chunks("AdaLayerNormZeroSingle", self, x, "x", emb, 3)
        return _modulate(self.norm, x, scale_msa, shift_msa), gate_msa


class SD35AdaLayerNormZeroX(_AdaLayerNormZeroBase):
    """diffusers' ``SD35AdaLayerNormZeroX`` (SD 3.5's dual-attention blocks) on
    :func:`cudnorm.ada_layer_norm`.

    ``SD35AdaLayerNormZeroX(embedding_dim, norm_type="layer_norm", bias=True)``;
    ``forward(hidden_states, emb=None)`` with ``hidden_states [B, S, D]``, ``emb [B, D]``
    returns ``(norm(x) * (1 + scale_msa) + shift_msa, gate_msa, shift_mlp, scale_mlp,
    gate_mlp, norm(x) * (1 + scale_msa2) + shift_msa2, gate_msa2)``. The two modulated
    outputs are two fused calls, each reading ``x`` once and writing its output once.
    """

    _CHUNKS = 9

    def __init__(self, embedding_dim: int, norm_type: str = "layer_norm", bias: bool = True) -> None:
        super().__init__(embedding_dim, norm_type, bias)

    def forward(self, hidden_states: torch.Tensor, emb: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """``(modulated [B, S, D], gate_msa, shift_mlp, scale_mlp, gate_mlp, modulated2 [B, S, D],
        gate_msa2)``, the gates/shifts/scales ``[B, D]``."""
        chunks = _chunks("SD35AdaLayerNormZeroX", self, hidden_states, "hidden_states", emb, 9)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2, gate_msa2 = chunks
        norm = self.norm
        return (_modulate(norm, hidden_states, scale_msa, shift_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp,
                _modulate(norm, hidden_states, scale_msa2, shift_msa2), gate_msa2)


# ---------------------------------------------------------------- continuous and plain AdaLN

class AdaLayerNormContinuous(torch.nn.Module):
    """diffusers' ``AdaLayerNormContinuous`` (the output norm of SD3, Flux and most DiTs).

    ``AdaLayerNormContinuous(embedding_dim, conditioning_embedding_dim, elementwise_affine=True,
    eps=1e-5, bias=True, norm_type="layer_norm")`` (diffusers' defaults; the models pass
    ``elementwise_affine=False, eps=1e-6``): ``linear`` is ``Linear(conditioning_embedding_dim,
    2 * embedding_dim, bias=bias)``; ``norm`` is a LayerNorm (``norm.weight``/``norm.bias``
    with ``elementwise_affine``, the bias only with ``bias``) or, with ``norm_type="rms_norm"``,
    an RMSNorm (``norm.weight`` with ``elementwise_affine``).

    ``forward(x, conditioning_embedding)``: ``x [B, S, D]``, ``conditioning_embedding [B, C]``
    -> ``norm(x) * (1 + scale) + shift`` with ``(scale, shift)`` the two halves of the
    projection. ``layer_norm``: one :func:`cudnorm.ada_layer_norm` call, the affine weight
    and bias folded into the per-sample gain and shift. ``rms_norm``: :func:`cudnorm.rms_norm`,
    then the modulation in PyTorch, with diffusers' RMSNorm output dtype.
    """

    def __init__(self, embedding_dim: int, conditioning_embedding_dim: int, elementwise_affine: bool = True,
                 eps: float = 1e-5, bias: bool = True, norm_type: str = "layer_norm") -> None:
        name = "AdaLayerNormContinuous"
        dim = _int(name, "embedding_dim", embedding_dim)
        cond_dim = _int(name, "conditioning_embedding_dim", conditioning_embedding_dim)
        affine = _flag(name, "elementwise_affine", elementwise_affine)
        eps = _eps(name, "eps", eps)
        bias = _flag(name, "bias", bias)
        rms = _choice(name, "norm_type", norm_type, ("layer_norm", "rms_norm")) == "rms_norm"
        super().__init__()
        self.silu = torch.nn.SiLU()
        self.linear = torch.nn.Linear(cond_dim, 2 * dim, bias=bias)
        if rms:
            self.norm = RMSNorm(dim, eps=eps, elementwise_affine=affine)
        else:
            self.norm = LayerNorm(dim, eps=eps, elementwise_affine=affine, bias=bias)

    def forward(self, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
        """``x [B, S, D]``, ``conditioning_embedding [B, C]`` -> ``[B, S, D]`` (see the class)."""
        _input("AdaLayerNormContinuous", "x", x)
        scale, shift = _project("AdaLayerNormContinuous", "conditioning_embedding", self.linear, self.silu,
                                conditioning_embedding).chunk(2, dim=1)
        norm = self.norm  # an RMSNorm: this class's, or diffusers' own in a patched diffusers module
        if not isinstance(norm, torch.nn.LayerNorm):
            return _modulated_rms_norm(x, scale[:, None, :], shift[:, None, :], norm)
        return _modulate(norm, x, scale, shift)


class AdaLayerNorm(torch.nn.Module):
    """diffusers' ``AdaLayerNorm``: a LayerNorm modulated by a projected timestep embedding
    (UniDiffuser, CogVideoX, OmniGen, ...). Not :class:`cudnorm.AdaLayerNorm`, which takes
    ``shift``/``scale`` from the caller.

    ``AdaLayerNorm(embedding_dim, num_embeddings=None, output_dim=None,
    norm_elementwise_affine=False, norm_eps=1e-5, chunk_dim=0)``: ``emb`` is
    ``Embedding(num_embeddings, embedding_dim)`` when ``num_embeddings`` is given; ``linear``
    is ``Linear(embedding_dim, output_dim)`` (default ``2 * embedding_dim``); ``norm`` is a
    LayerNorm over ``output_dim // 2`` features.

    ``forward(x, timestep=None, temb=None)``: ``temb = linear(silu(emb(timestep)))`` (or of
    the given ``temb``). ``chunk_dim=1``: ``temb [B, output_dim]`` splits into ``(shift,
    scale)``, per sample, and the result is one :func:`cudnorm.ada_layer_norm` call.
    ``chunk_dim=0`` (diffusers' default): ``temb`` splits along its first dim into ``(scale,
    shift)``: from a single timestep, ``[D]`` each, shared by every sample, and the result is
    one :func:`cudnorm.layer_norm` call. An affine ``norm``'s weight and bias are folded in.
    Returns ``norm(x) * (1 + scale) + shift`` of ``x``'s shape.
    """

    def __init__(self, embedding_dim: int, num_embeddings: int | None = None, output_dim: int | None = None,
                 norm_elementwise_affine: bool = False, norm_eps: float = 1e-5, chunk_dim: int = 0) -> None:
        name = "AdaLayerNorm"
        dim = _int(name, "embedding_dim", embedding_dim)
        classes = _int(name, "num_embeddings", num_embeddings, optional=True)
        output_dim = _int(name, "output_dim", output_dim, optional=True) or 2 * dim
        if output_dim % 2:
            _fail(ValueError, name, "output_dim", f"must be even (it holds scale and shift), got {output_dim}")
        affine = _flag(name, "norm_elementwise_affine", norm_elementwise_affine)
        eps = _eps(name, "norm_eps", norm_eps)
        if _int(name, "chunk_dim", chunk_dim, minimum=0) > 1:
            _fail(ValueError, name, "chunk_dim", f"must be 0 or 1, got {chunk_dim}")
        super().__init__()
        self.chunk_dim = int(chunk_dim)
        self.emb = None if classes is None else torch.nn.Embedding(classes, dim)
        self.silu = torch.nn.SiLU()
        self.linear = torch.nn.Linear(dim, output_dim)
        self.norm = LayerNorm(output_dim // 2, eps=eps, elementwise_affine=affine)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor | None = None, temb: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``norm(x) * (1 + scale) + shift`` (see the class for the shapes)."""
        _input("AdaLayerNorm", "x", x)
        if self.emb is not None:
            temb = self.emb(_tensor("AdaLayerNorm", "timestep", timestep))
        temb = _project("AdaLayerNorm", "temb", self.linear, self.silu, temb)
        if self.chunk_dim == 1:
            shift, scale = temb.chunk(2, dim=1)
            scale, shift = scale[:, None, :], shift[:, None, :]
        else:
            scale, shift = temb.chunk(2, dim=0)
        norm = self.norm
        return _modulated_layer_norm(x, scale, shift, norm.eps, norm.weight, norm.bias)


# ---------------------------------------------------------------- forwards of diffusers' other classes

def _cogvideox_layer_norm_zero(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                               temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' ``CogVideoXLayerNormZero.forward`` (CogVideoX, ConsisID) on cudnorm: ``temb [B, C]``
    projects to the shift, scale and gate of the video tokens ``hidden_states [B, S, D]`` and of
    the text tokens ``encoder_hidden_states [B, T, D]``; each modulated LayerNorm is one
    :func:`cudnorm.ada_layer_norm` call (the norm's affine weight and bias folded in). Returns
    ``(hidden_states, encoder_hidden_states, gate [B, 1, D], enc_gate [B, 1, D])``."""
    cls = "CogVideoXLayerNormZero"
    _input(cls, "encoder_hidden_states", encoder_hidden_states)
    shift, scale, gate, enc_shift, enc_scale, enc_gate = _chunks(cls, self, hidden_states, "hidden_states", temb, 6)
    norm = self.norm
    return (_modulate(norm, hidden_states, scale, shift), _modulate(norm, encoder_hidden_states, enc_scale, enc_shift),
            gate[:, None, :], enc_gate[:, None, :])


def _ada_layer_norm_shift(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """diffusers' ``AdaLayerNormShift.forward`` (HunyuanDiT) on cudnorm: the fp32 LayerNorm of
    ``x [B, S, D]`` plus a per-sample shift ``linear(silu(emb))`` (the SiLU in fp32, as diffusers
    computes it), one :func:`cudnorm.ada_layer_norm` call with the norm's weight as the gain.
    Returns the promotion of ``x``'s and the shift's dtypes, as diffusers' sum does."""
    cls = "AdaLayerNormShift"
    _input(cls, "x", x)
    shift = self.linear(self.silu(_input(cls, "emb", emb).to(torch.float32)).to(emb.dtype))
    norm = self.norm
    return _modulated_layer_norm(x, torch.zeros_like(shift)[:, None], shift[:, None], norm.eps, norm.weight, norm.bias)


def _sana_modulated_norm(self, hidden_states: torch.Tensor, temb: torch.Tensor,
                         scale_shift_table: torch.Tensor) -> torch.Tensor:
    """diffusers' ``SanaModulatedNorm.forward`` (Sana's output norm) on cudnorm: the per-sample
    shift and scale ``scale_shift_table [2, D] + temb [B, D]`` modulate the LayerNorm of
    ``hidden_states [B, S, D]`` in one :func:`cudnorm.ada_layer_norm` call."""
    _input("SanaModulatedNorm", "hidden_states", hidden_states)
    shift, scale = (scale_shift_table[None] + temb[:, None].to(scale_shift_table.device)).chunk(2, dim=1)
    norm = self.norm
    return _modulated_layer_norm(hidden_states, scale, shift, norm.eps, norm.weight, norm.bias)


def _modulate_any(norm: torch.nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``norm(x) * (1 + scale[:, None]) + shift[:, None]`` for ``[B, D]`` chunks and a LayerNorm
    (one fused op: :func:`_modulate`) or diffusers' RMSNorm (:func:`_modulated_rms_norm`)."""
    if isinstance(norm, torch.nn.LayerNorm):
        return _modulate(norm, x, scale, shift)
    return _modulated_rms_norm(x, scale[:, None, :], shift[:, None, :], norm)


def _chroma_adaln_zero_pruned(self, x: torch.Tensor, timestep: torch.Tensor | None = None,
                              class_labels: torch.Tensor | None = None, hidden_dtype: torch.dtype | None = None,
                              emb: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """diffusers' ``ChromaAdaLayerNormZeroPruned.forward`` on cudnorm: ``emb [B, 6, D]`` (Chroma's
    pruned modulation, no projection here) gives the six chunks; ``norm(x) * (1 + scale_msa) +
    shift_msa`` of ``x [B, S, D]`` is one :func:`ada_layer_norm` call. Returns ``(modulated x,
    gate_msa, shift_mlp, scale_mlp, gate_mlp)``."""
    cls = "ChromaAdaLayerNormZeroPruned"
    _input(cls, "x", x)
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    chunks = _input(cls, "emb", emb).flatten(1, 2).chunk(6, dim=1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = chunks
    return _modulate(self.norm, x, scale_msa, shift_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp


def _chroma_adaln_zero_single_pruned(self, x: torch.Tensor, emb: torch.Tensor | None = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``ChromaAdaLayerNormZeroSinglePruned.forward`` on cudnorm: ``emb [B, 3, D]``;
    one :func:`ada_layer_norm` call. Returns ``(modulated x, gate_msa)``."""
    cls = "ChromaAdaLayerNormZeroSinglePruned"
    _input(cls, "x", x)
    shift_msa, scale_msa, gate_msa = _input(cls, "emb", emb).flatten(1, 2).chunk(3, dim=1)
    return _modulate(self.norm, x, scale_msa, shift_msa), gate_msa


def _chroma_adaln_continuous_pruned(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """diffusers' ``ChromaAdaLayerNormContinuousPruned.forward`` (Chroma's output norm) on cudnorm:
    ``(shift, scale)`` from ``emb [B, 2, D]`` in ``x``'s dtype; a LayerNorm is one
    :func:`ada_layer_norm` call (its weight and bias folded in), an RMSNorm :func:`rms_norm`
    and the modulation in PyTorch."""
    cls = "ChromaAdaLayerNormContinuousPruned"
    _input(cls, "x", x)
    shift, scale = _input(cls, "emb", emb).flatten(1, 2).to(x.dtype).chunk(2, dim=1)
    return _modulate_any(self.norm, x, scale, shift)


def _cogview4_adaln_zero(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                         temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """diffusers' ``CogView4AdaLayerNormZero.forward`` on cudnorm: ``linear(temb)`` (no SiLU) gives
    twelve ``[B, D]`` chunks; the image tokens ``hidden_states [B, S, D]`` and the text tokens
    ``encoder_hidden_states [B, T, D]`` are one :func:`ada_layer_norm` call each. Returns
    diffusers' ten outputs in its order."""
    cls = "CogView4AdaLayerNormZero"
    _input(cls, "hidden_states", hidden_states)
    _input(cls, "encoder_hidden_states", encoder_hidden_states)
    (shift_msa, c_shift_msa, scale_msa, c_scale_msa, gate_msa, c_gate_msa, shift_mlp, c_shift_mlp, scale_mlp,
     c_scale_mlp, gate_mlp, c_gate_mlp) = self.linear(_input(cls, "temb", temb)).chunk(12, dim=1)
    return (_modulate(self.norm, hidden_states, scale_msa, shift_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp,
            _modulate(self.norm_context, encoder_hidden_states, c_scale_msa, c_shift_msa), c_gate_msa, c_shift_mlp,
            c_scale_mlp, c_gate_mlp)


def _cogview3plus_adaln_zero_text_image(self, x: torch.Tensor, context: torch.Tensor,
                                        emb: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """diffusers' ``CogView3PlusAdaLayerNormZeroTextImage.forward`` on cudnorm: ``linear(silu(emb))``
    gives twelve ``[B, D]`` chunks; the image tokens ``x`` (``norm_x``) and the text tokens
    ``context`` (``norm_c``) are one :func:`ada_layer_norm` call each. Returns diffusers' ten
    outputs in its order."""
    cls = "CogView3PlusAdaLayerNormZeroTextImage"
    _input(cls, "context", context)
    (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, c_shift_msa, c_scale_msa, c_gate_msa,
     c_shift_mlp, c_scale_mlp, c_gate_mlp) = _chunks(cls, self, x, "x", emb, 12)
    return (_modulate(self.norm_x, x, scale_msa, shift_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp,
            _modulate(self.norm_c, context, c_scale_msa, c_shift_msa), c_gate_msa, c_shift_mlp, c_scale_mlp,
            c_gate_mlp)


def _cogview4_adaln_continuous(self, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
    """diffusers' ``CogView4AdaLayerNormContinuous.forward`` (CogView4's output norm) on cudnorm:
    ``(scale, shift) = linear(conditioning_embedding)`` (no SiLU), then as
    :func:`_chroma_adaln_continuous_pruned`."""
    cls = "CogView4AdaLayerNormContinuous"
    _input(cls, "x", x)
    scale, shift = self.linear(_input(cls, "conditioning_embedding", conditioning_embedding).to(x.dtype)).chunk(2, 1)
    return _modulate_any(self.norm, x, scale, shift)


def _qwenimage21_adaln_continuous(self, hidden_states: torch.Tensor, conditioning_embedding: torch.Tensor,
                                  target_token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' ``QwenImage21AdaLayerNormContinuous.forward`` (QwenImage 2.1's output norm, scale
    only) on cudnorm: ``norm(x) * (1 + scale)`` with ``scale = linear(silu(cond))`` ``[B, D]``, one
    :func:`ada_layer_norm` call. With ``target_token_mask`` (rows chosen per token) diffusers'
    own forward runs, its LayerNorm on cudnorm."""
    if target_token_mask is not None:
        return type(self)._cudnorm_unpatched.forward(self, hidden_states, conditioning_embedding, target_token_mask)
    cls = "QwenImage21AdaLayerNormContinuous"
    _input(cls, "hidden_states", hidden_states)
    scale = self.linear(self.silu(_input(cls, "conditioning_embedding", conditioning_embedding)).to(hidden_states.dtype))
    return _modulate(self.norm, hidden_states, scale, torch.zeros_like(scale))


def _audio_dit_adaln_zero_final(self, hidden_states: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
    """diffusers' ``AudioDiTAdaLayerNormZeroFinal.forward`` (LongCat-AudioDiT's output norm) on
    cudnorm: ``norm(x) * (1 + scale) + shift`` from ``linear(silu(embedding))``; a per-sample
    ``[B, C]`` embedding is one :func:`ada_layer_norm` call (computed in fp32, rounded once), a
    per-token one runs the formula with the norm on cudnorm."""
    cls = "AudioDiTAdaLayerNormZeroFinal"
    _input(cls, "hidden_states", hidden_states)
    scale, shift = self.linear(self.silu(_input(cls, "embedding", embedding))).chunk(2, dim=-1)
    if scale.ndim == 2:
        return _modulate(self.norm, hidden_states, scale, shift)
    norm = self.norm
    y = layer_norm(hidden_states.float(), hidden_states.shape[-1], norm.weight, norm.bias, norm.eps)
    return y.type_as(hidden_states) * (1 + scale) + shift


def _cosmos_modulation(self, embedded_timestep: torch.Tensor, temb: torch.Tensor | None, chunks: int,
                       width: int | None) -> tuple[torch.Tensor, ...]:
    """Cosmos' ``linear_2(linear_1(silu(embedded_timestep)))`` plus ``temb`` (its first ``width``
    features where given), in ``chunks`` chunks, each ``[B, 1, D]`` from a per-sample ``[B, C]``
    embedding or ``[B, T, D]`` from a per-token one."""
    e = self.linear_2(self.linear_1(self.activation(embedded_timestep)))
    if temb is not None:
        e = e + (temb if width is None else temb[..., :width])
    parts = e.chunk(chunks, dim=-1)
    return tuple(p.unsqueeze(1) for p in parts) if e.ndim == 2 else parts


def _cosmos_adaln(self, hidden_states: torch.Tensor, embedded_timestep: torch.Tensor,
                  temb: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' ``CosmosAdaLayerNorm.forward`` on cudnorm: ``norm(x) * (1 + scale) + shift`` of
    ``hidden_states [B, S, D]``, one :func:`ada_layer_norm` call for a per-sample embedding
    ``[B, C]``; a per-token one ``[B, S, C]`` runs the formula with the norm on cudnorm."""
    cls = "CosmosAdaLayerNorm"
    _input(cls, "hidden_states", hidden_states)
    shift, scale = _cosmos_modulation(self, _input(cls, "embedded_timestep", embedded_timestep), temb, 2,
                                      2 * self.embedding_dim)
    norm = self.norm
    return _modulated_layer_norm(hidden_states, scale, shift, norm.eps, norm.weight, norm.bias)


def _cosmos_adaln_zero(self, hidden_states: torch.Tensor, embedded_timestep: torch.Tensor,
                       temb: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``CosmosAdaLayerNormZero.forward`` on cudnorm: as :func:`_cosmos_adaln`, three
    chunks; returns ``(modulated hidden_states, gate)``."""
    cls = "CosmosAdaLayerNormZero"
    _input(cls, "hidden_states", hidden_states)
    shift, scale, gate = _cosmos_modulation(self, _input(cls, "embedded_timestep", embedded_timestep), temb, 3, None)
    norm = self.norm
    return _modulated_layer_norm(hidden_states, scale, shift, norm.eps, norm.weight, norm.bias), gate


# ---------------------------------------------------------------- modulated RMSNorms

def _ada_rms_dtype(x: torch.Tensor, scale: torch.Tensor) -> torch.dtype | None:
    """The dtype :func:`ada_rms_norm` reads ``scale`` in for ``x`` (fp32 or ``x``'s: a
    half-precision scale of the other kind widens to fp32, exactly), or None where ``scale``
    is not a per-sample ``[B, D]`` or ``[B, 1, D]`` modulation of ``x [B, S, D]``."""
    b, d = x.shape[0], x.shape[-1]
    if not (x.dim() == 3 and scale.dim() in (2, 3) and scale.shape[0] == b and scale.shape[-1] == d
            and scale.numel() == b * d and x.dtype in _INPUT_DTYPES and x.dtype is not torch.float64):
        return None
    return scale.dtype if scale.dtype in (x.dtype, torch.float32) else torch.float32


def _rms_norm_zero(x: torch.Tensor, scale: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """diffusers' ``RMSNorm(x) * (1 + scale[:, None])`` (Lumina's ``LuminaRMSNormZero``) for a
    ``[B, D]`` chunk ``scale``: one :func:`ada_rms_norm` call, the norm's weight folded into the
    per-sample gain ``weight * (1 + scale)`` in fp32. Returns the dtype diffusers' formula
    does: the promotion of the RMSNorm's output dtype (:func:`_modulated_rms_norm`) and ``scale``'s."""
    weight = norm.weight
    if weight is None or weight.dtype is x.dtype:
        norm_dtype = x.dtype
    else:
        norm_dtype = weight.dtype if weight.dtype in _HALF else torch.promote_types(x.dtype, weight.dtype)
    dtype = torch.promote_types(norm_dtype, scale.dtype)
    xd = x.to(dtype)
    if _ada_rms_dtype(xd, scale) is None:  # any other shape: the formula as written
        return _modulated_rms_norm(x, scale[:, None], torch.zeros((), dtype=scale.dtype, device=scale.device), norm)
    if weight is None:
        return ada_rms_norm(xd, scale.to(_ada_rms_dtype(xd, scale)), None, norm.eps, one_plus_scale=True)
    wide = torch.promote_types(dtype, torch.float32)
    gain = (1 + scale.to(wide)) * weight.to(wide)
    return ada_rms_norm(xd, gain, None, norm.eps, one_plus_scale=False)


def _lumina_rms_norm_zero(self, x: torch.Tensor, emb: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' ``LuminaRMSNormZero.forward`` (Lumina-Next, Lumina 2) on cudnorm: ``emb [B, C]``
    projects to ``(scale_msa, gate_msa, scale_mlp, gate_mlp)``; ``RMSNorm(x) * (1 + scale_msa)``
    of ``x [B, S, D]`` is one :func:`ada_rms_norm` call. Returns ``(modulated x, gate_msa,
    scale_mlp, gate_mlp)``, the last three ``[B, D]``."""
    scale_msa, gate_msa, scale_mlp, gate_mlp = _chunks("LuminaRMSNormZero", self, x, "x", emb, 4)
    return _rms_norm_zero(x, scale_msa, self.norm), gate_msa, scale_mlp, gate_mlp


def _lumina_layer_norm_continuous(self, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
    """diffusers' ``LuminaLayerNormContinuous.forward`` (Lumina's output norm) on cudnorm:
    ``norm(x) * (1 + scale)`` with ``scale = linear_1(silu(conditioning_embedding))`` ``[B, D]``,
    one :func:`ada_layer_norm` call (a LayerNorm's weight and bias folded in) or one
    :func:`ada_rms_norm` call (an RMSNorm's weight folded in), then ``linear_2`` where the
    module has one."""
    cls = "LuminaLayerNormContinuous"
    _input(cls, "x", x)
    scale = self.linear_1(self.silu(_input(cls, "conditioning_embedding", conditioning_embedding)).to(x.dtype))
    norm = self.norm
    if isinstance(norm, torch.nn.LayerNorm):
        x = _modulated_layer_norm(x, scale[:, None, :], torch.zeros_like(scale)[:, None, :], norm.eps, norm.weight,
                                  norm.bias)
    else:
        x = _rms_norm_zero(x, scale, norm)
    return x if self.linear_2 is None else self.linear_2(x)


def _mochi_rms_norm_zero(self, hidden_states: torch.Tensor, emb: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' ``MochiRMSNormZero.forward`` on cudnorm: the fp32 RMSNorm of ``hidden_states
    [B, S, D]`` times ``1 + scale_msa`` (fp32), rounded once to its dtype: one
    :func:`ada_rms_norm` call (which computes exactly that). Returns ``(modulated, gate_msa,
    scale_mlp, gate_mlp)``, the last three ``[B, D]``."""
    cls = "MochiRMSNormZero"
    scale_msa, gate_msa, scale_mlp, gate_mlp = _chunks(cls, self, hidden_states, "hidden_states", emb, 4)
    dtype = _ada_rms_dtype(hidden_states, scale_msa)
    if dtype is None:
        y = rms_norm(hidden_states.to(torch.float32), hidden_states.shape[-1], None, self.norm.eps)
        return (y * (1 + scale_msa[:, None].to(torch.float32))).to(hidden_states.dtype), gate_msa, scale_mlp, gate_mlp
    return (ada_rms_norm(hidden_states, scale_msa.to(dtype), None, self.norm.eps, one_plus_scale=True),
            gate_msa, scale_mlp, gate_mlp)


def _mochi_modulated_rms_norm(self, hidden_states: torch.Tensor, scale: torch.Tensor | None = None
                              ) -> torch.Tensor:
    """diffusers' ``MochiModulatedRMSNorm.forward`` (Mochi's gated residual norms and its output
    norm) on cudnorm: the fp32 RMSNorm of ``hidden_states [B, S, D]``, times ``scale [B, 1, D]``
    where given (Mochi passes ``tanh(gate)`` or ``1 + scale``), rounded once to its dtype: one
    :func:`rms_norm` or :func:`ada_rms_norm` call."""
    x = _input("MochiModulatedRMSNorm", "hidden_states", hidden_states)
    d, eps = x.shape[-1], self.norm.eps
    if scale is None:
        return rms_norm(x.to(torch.float32), d, None, eps).to(x.dtype)
    dtype = _ada_rms_dtype(x, scale)
    if dtype is None:  # any other broadcast: the formula as written
        return (rms_norm(x.to(torch.float32), d, None, eps) * scale).to(x.dtype)
    return ada_rms_norm(x, scale.to(dtype), None, eps, one_plus_scale=False)


# ---------------------------------------------------------------- diffusers' modules on these forwards

class Fused(NamedTuple):
    """How a diffusers class runs on cudnorm: ``forward(module, ...)`` computes the class's
    forward from the module's own children (``children``; the call of ``norm`` is replaced by
    reading its parameters) for a norm of a kind in ``norms``: ``"layer_norm"``
    (``nn.LayerNorm``, diffusers' ``FP32LayerNorm``) or ``"rms_norm"`` (diffusers' ``RMSNorm``
    without a bias), over the last dim."""

    forward: Callable
    children: frozenset[str]
    norms: tuple[str, ...] = ("layer_norm",)


_NORMALIZATION = "diffusers.models.normalization"
_MOCHI = "diffusers.models.transformers.transformer_mochi"
_CHROMA = "diffusers.models.transformers.transformer_chroma"
_COGVIEW4 = "diffusers.models.transformers.transformer_cogview4"
_COSMOS = "diffusers.models.transformers.transformer_cosmos"
_QWENIMAGE21 = "diffusers.models.transformers.transformer_qwenimage21"
_ADALN = frozenset(("silu", "linear", "norm"))
#: diffusers class (module-qualified name) -> how it runs on cudnorm (:func:`cudnorm.patch`)
FUSED = {
    f"{_NORMALIZATION}.AdaLayerNormZero": Fused(AdaLayerNormZero.forward, _ADALN | {"emb"}),
    f"{_NORMALIZATION}.AdaLayerNormZeroSingle": Fused(AdaLayerNormZeroSingle.forward, _ADALN),
    f"{_NORMALIZATION}.SD35AdaLayerNormZeroX": Fused(SD35AdaLayerNormZeroX.forward, _ADALN),
    f"{_NORMALIZATION}.AdaLayerNormContinuous": Fused(AdaLayerNormContinuous.forward, _ADALN,
                                                      ("layer_norm", "rms_norm")),
    f"{_NORMALIZATION}.AdaLayerNorm": Fused(AdaLayerNorm.forward, _ADALN | {"emb"}),
    f"{_NORMALIZATION}.CogVideoXLayerNormZero": Fused(_cogvideox_layer_norm_zero, _ADALN),
    "diffusers.models.transformers.hunyuan_transformer_2d.AdaLayerNormShift": Fused(_ada_layer_norm_shift, _ADALN),
    "diffusers.models.transformers.sana_transformer.SanaModulatedNorm": Fused(_sana_modulated_norm,
                                                                             frozenset(("norm",))),
    f"{_NORMALIZATION}.LuminaRMSNormZero": Fused(_lumina_rms_norm_zero, _ADALN, ("rms_norm",)),
    f"{_NORMALIZATION}.LuminaLayerNormContinuous": Fused(_lumina_layer_norm_continuous,
                                                         frozenset(("silu", "linear_1", "norm", "linear_2")),
                                                         ("layer_norm", "rms_norm")),
    f"{_MOCHI}.MochiRMSNormZero": Fused(_mochi_rms_norm_zero, _ADALN, ("rms_norm",)),
    f"{_CHROMA}.ChromaAdaLayerNormZeroPruned": Fused(_chroma_adaln_zero_pruned, frozenset(("emb", "norm"))),
    f"{_CHROMA}.ChromaAdaLayerNormZeroSinglePruned": Fused(_chroma_adaln_zero_single_pruned, frozenset(("norm",))),
    f"{_CHROMA}.ChromaAdaLayerNormContinuousPruned": Fused(_chroma_adaln_continuous_pruned, frozenset(("norm",)),
                                                           ("layer_norm", "rms_norm")),
    f"{_QWENIMAGE21}.QwenImage21AdaLayerNormContinuous": Fused(_qwenimage21_adaln_continuous, _ADALN),
    "diffusers.models.transformers.transformer_longcat_audio_dit.AudioDiTAdaLayerNormZeroFinal": Fused(
        _audio_dit_adaln_zero_final, _ADALN),
    f"{_COSMOS}.CosmosAdaLayerNorm": Fused(_cosmos_adaln, frozenset(("norm", "activation", "linear_1", "linear_2"))),
    f"{_COSMOS}.CosmosAdaLayerNormZero": Fused(_cosmos_adaln_zero,
                                               frozenset(("norm", "activation", "linear_1", "linear_2"))),
    f"{_NORMALIZATION}.CogView3PlusAdaLayerNormZeroTextImage": Fused(
        _cogview3plus_adaln_zero_text_image, frozenset(("silu", "linear", "norm_x", "norm_c"))),
    f"{_COGVIEW4}.CogView4AdaLayerNormZero": Fused(_cogview4_adaln_zero,
                                                   frozenset(("norm", "norm_context", "linear"))),
    f"{_COGVIEW4}.CogView4AdaLayerNormContinuous": Fused(_cogview4_adaln_continuous, frozenset(("norm", "linear")),
                                                         ("layer_norm", "rms_norm")),
    f"{_MOCHI}.MochiModulatedRMSNorm": Fused(_mochi_modulated_rms_norm, frozenset(("norm",)), ("rms_norm",)),
}
# the classes of this file, by the name of the diffusers class each mirrors
_MIRRORS = {cls.__name__: cls for cls in (AdaLayerNorm, AdaLayerNormContinuous, AdaLayerNormZero,
                                          AdaLayerNormZeroSingle, SD35AdaLayerNormZeroX)}


def layer_norm_class(cls: type) -> bool:
    """Whether ``cls`` is ``nn.LayerNorm`` or diffusers' ``FP32LayerNorm`` (the same function in
    fp32), or ``cudnorm.patch``'s subclass of one (it names its original in ``_cudnorm_unpatched``)."""
    cls = getattr(cls, "_cudnorm_unpatched", cls)
    return cls is torch.nn.LayerNorm or qualified_name(cls) == f"{_NORMALIZATION}.FP32LayerNorm"


def _norm_kind(norm) -> str | None:
    """``"layer_norm"``, ``"rms_norm"`` (see :class:`Fused`) or None."""
    cls = getattr(type(norm), "_cudnorm_unpatched", type(norm))
    if layer_norm_class(cls):
        return "layer_norm" if len(norm.normalized_shape) == 1 else None
    if qualified_name(cls) == f"{_NORMALIZATION}.RMSNorm" and norm.bias is None and len(norm.dim) == 1:
        return "rms_norm"
    return None


def why_not_fused(module: torch.nn.Module, fused: Fused) -> str | None:
    """Why ``module``, of a class of :data:`FUSED`, cannot run ``fused.forward`` (its children
    or its norm are not what its class builds), or None."""
    children = dict(module.named_children())
    norms = {name for name in fused.children if name.startswith("norm")}  # "norm", CogView4's "norm_context", ...
    if not set(children) <= fused.children or not norms <= set(children):
        return f"children {sorted(children)} where its class builds {sorted(fused.children)}"
    for name in sorted(norms):
        if _norm_kind(children[name]) not in fused.norms:
            return (f"its {name} is a {qualified_name(type(children[name]))}, which cudnorm does not fuse into it")
    if getattr(module, "chunk_dim", 0) not in (0, 1):  # diffusers' AdaLayerNorm
        return f"chunk_dim={module.chunk_dim!r}, where diffusers' AdaLayerNorm takes 0 or 1"
    return None


def from_diffusers(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module of this file that computes what diffusers' ``module`` computes, or ``None``.

    Args:
        module: an instance of diffusers' ``AdaLayerNorm``, ``AdaLayerNormContinuous``,
            ``AdaLayerNormZero``, ``AdaLayerNormZeroSingle`` or ``SD35AdaLayerNormZeroX``
            (exact classes: a subclass may change the forward).

    Returns:
        A new module holding ``module``'s own children (``linear``, ``silu``, ``emb`` and
        ``norm``, whose parameters it reads), so its ``state_dict`` has the same keys, order
        and tensors. ``None`` for any other module, or one whose children or norm are not what
        the class builds. (:func:`cudnorm.patch` keeps diffusers' module itself, with its
        hooks, and swaps its class.)
    """
    kind = type(module)
    fused, cls = FUSED.get(qualified_name(kind)), _MIRRORS.get(kind.__name__)
    if cls is None or fused is None or why_not_fused(module, fused) is not None:
        return None
    children = dict(module.named_children())
    norm = children["norm"]
    dim = norm.normalized_shape[0] if isinstance(norm, torch.nn.LayerNorm) else norm.dim[0]
    with torch.device("meta"):  # sizes only: every child is replaced by module's own
        if cls is AdaLayerNormContinuous:
            new = cls(dim, 1)
        elif cls in (AdaLayerNormZero, AdaLayerNorm):
            new = cls(dim, 1 if "emb" in children else None)
        else:
            new = cls(dim)
    for name, child in children.items():
        setattr(new, name, child)
    if cls is AdaLayerNorm:
        new.chunk_dim = module.chunk_dim
    mine, theirs = new.state_dict(keep_vars=True), module.state_dict(keep_vars=True)
    if list(mine) != list(theirs) or any(mine[k] is not theirs[k] for k in mine):
        return None
    new.training = module.training  # not .train(): the children are module's own, left as they are
    return new
