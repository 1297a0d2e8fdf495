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
forwards :mod:`cudnorm._diffusers_forwards` holds for diffusers' other AdaLN and modulated-norm
classes: CogVideoX's, HunyuanDiT's, Sana's, Chroma's, CogView's, Cosmos', Lumina's, Mochi's, ...);
:func:`from_diffusers` builds the class here around a diffusers module's children. This module
never imports diffusers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ._diffusers_forwards import (_ada_layer_norm_shift, _audio_dit_adaln_zero_final, _chroma_adaln_continuous_pruned,
                                  _chroma_adaln_zero_pruned, _chroma_adaln_zero_single_pruned, _chunks,
                                  _cogvideox_layer_norm_zero, _cogview3plus_adaln_zero_text_image,
                                  _easyanimate_layer_norm_zero,
                                  _cogview4_adaln_continuous, _cogview4_adaln_zero, _cosmos_adaln, _cosmos_adaln_zero,
                                  _choice, _eps, _fail, _flag, _input, _int, _lumina_layer_norm_continuous,
                                  _lumina_rms_norm_zero, _mochi_modulated_rms_norm, _mochi_rms_norm_zero, _modulate,
                                  _modulated_layer_norm, _modulated_rms_norm, _project,
                                  _qwenimage21_adaln_continuous, _sana_modulated_norm, _tensor,
                                  _sana_video_modulated_norm, _flux3_adaln, _helios_output_norm)
from ._patch_table import qualified_name
from .modules import LayerNorm, RMSNorm

__all__ = [
    "AdaLayerNorm",
    "AdaLayerNormContinuous",
    "AdaLayerNormZero",
    "AdaLayerNormZeroSingle",
    "SD35AdaLayerNormZeroX",
    "from_diffusers",
]



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
    "diffusers.models.transformers.transformer_easyanimate.EasyAnimateLayerNormZero": Fused(
        _easyanimate_layer_norm_zero, _ADALN),
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
    # modulated per token (cudnorm.ada_layer_norm's per-token kernels)
    "diffusers.models.transformers.transformer_sana_video.SanaModulatedNorm": Fused(_sana_video_modulated_norm,
                                                                                   frozenset(("norm",))),
    "diffusers.models.transformers.transformer_flux3.Flux3AdaLayerNorm": Fused(
        _flux3_adaln, frozenset(("act_fn", "linear", "norm"))),
    "diffusers.models.transformers.transformer_helios.HeliosOutputNorm": Fused(_helios_output_norm,
                                                                              frozenset(("norm",))),
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
