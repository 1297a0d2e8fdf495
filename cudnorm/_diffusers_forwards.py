"""What ``cudnorm.diffusers`` computes with: its argument checks and modulation arithmetic, and
the forwards :func:`cudnorm.patch` runs on the diffusers AdaLN and modulated-norm classes that
``cudnorm.diffusers`` has no class of its own for (:data:`cudnorm.diffusers.FUSED` maps each
class to its forward).

Each forward is written against the diffusers 0.42 class of the name in its docstring: it reads
only that class's children and parameters (``self`` is diffusers' own module, its class swapped by
``cudnorm.patch``) and returns what diffusers' forward returns, in the same dtypes. A modulated
norm becomes one :func:`cudnorm.ada_layer_norm` or :func:`cudnorm.ada_rms_norm` call where the
modulation is per sample; any other broadcast runs diffusers' formula with the norm on cudnorm.
This module never imports diffusers.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import _candidates, _checks, _decisions, _entry
from .ada_layer_norm import ada_layer_norm
from .ada_rms_norm import ada_rms_norm
from .layer_norm import layer_norm
from .rms_norm import rms_norm

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
_TENSOR = torch.Tensor  # a plain tensor, as the native entry serves it (its subclasses are not)


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
    for ``x [B, S, D]``, ``[B, S, D]`` per token, or ``[D]`` shared. Per-sample pairs run one
    :func:`ada_layer_norm`, as do per-token pairs of a non-affine norm (its per-token kernels,
    :mod:`cudnorm._token_ada`), shared pairs one :func:`layer_norm`; an affine weight/bias is folded into the gain and
    shift first: ``(xhat * w + b) * (1 + s) + t == xhat * (w * (1 + s)) + (b * (1 + s) + t)``,
    except where the measured decision of a per-sample affine call picks diffusers' formula
    itself (:func:`_formula_serves`).
    Returns the promotion of ``x``'s and the modulation's dtypes, as diffusers' formula does.
    While the native path serves, an affine per-sample call of one dtype is C++'s whole
    (csrc/entry.cpp: these rules, the decision and the fold without the Python in front of them:
    CogVideoX's host-bound sampling steps pay that Python in every block).
    """
    if (weight is not None or bias is not None) and _entry.native and type(x) is _TENSOR and (
            not _entry.is_compiling()):
        out = _entry.modulated_layer_norm(x, scale, shift, eps, weight, bias)
        if out is not None:
            return out
    d = x.shape[-1]
    per_sample = (scale.dim() == x.dim() >= 2 and scale.shape == shift.shape and scale.shape[0] == x.shape[0]
                  and scale.shape[-1] == d and scale.numel() == x.shape[0] * d)
    shared = scale.dim() == shift.dim() == 1 and scale.shape[0] == shift.shape[0] == d
    per_token = (not (per_sample or shared) and weight is None and bias is None and x.dim() >= 3
                 and scale.shape == shift.shape == x.shape and scale.shape[-2] != 1)
    if not (per_sample or shared or per_token):  # any other broadcast: the formula as written
        return layer_norm(x, d, weight, bias, eps) * (1 + scale) + shift
    dtype = torch.promote_types(x.dtype, torch.promote_types(scale.dtype, shift.dtype))
    x = x.to(dtype)
    if per_token:
        return ada_layer_norm(x, scale.to(dtype), shift.to(dtype), eps, one_plus_scale=True)
    if per_sample and weight is None and bias is None:
        return ada_layer_norm(x, scale.to(dtype), shift.to(dtype), eps, one_plus_scale=True)
    # fold in fp32 (or fp64): [B, D] or [D] elements, each folded value rounded once to x's
    # dtype, as the op rounds its own 1 + scale (and so the default policy may hand small or
    # compiled calls to PyTorch's ops, which it does only for parameters of x's dtype)
    if _native_fold(x, scale, shift, weight, bias):
        if per_sample and _formula_serves(x, scale, shift, weight, bias):
            return torch.nn.functional.layer_norm(x, (d,), weight, bias, eps) * (1 + scale) + shift
        gain, shift = _entry.affine_fold(scale, shift, weight, bias, True, x)
    else:
        wide = torch.promote_types(dtype, torch.float32)
        gain = 1 + scale.to(wide)
        shift = shift.to(wide) if bias is None else shift.to(wide) + bias.to(wide) * gain
        gain = gain if weight is None else gain * weight.to(wide)
        gain, shift = gain.to(dtype), shift.to(dtype)
    if per_sample:
        return ada_layer_norm(x, gain, shift, eps)
    return layer_norm(x, d, gain, shift, eps)


def _formula_serves(x, scale, shift, weight, bias) -> bool:
    """Whether diffusers' own formula (PyTorch's LayerNorm, then the modulation) serves a per-sample
    affine call: the measured decision of its signature (op ``"modulated_layer_norm"``,
    :mod:`cudnorm._candidates`), charged GPU plus host time. The fold and one adaptive LayerNorm
    save the modulation's passes over ``x`` but cost two cudnorm nodes' host time, which a
    host-bound step pays (CogVideoX's steps at 1,350 tokens: 0.87-0.90x, docs/performance.md)."""
    tensors = (x, scale, shift, weight, bias)
    if x.numel() == 0 or any(t is not None and t.dtype is not x.dtype for t in tensors):
        return False  # nothing to time, or not the signature's dtypes (its candidates run in x's)
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    return _decisions.serves(_candidates.AFFINE_MODULATED, x, x.shape[-1], scale, shift, training) == "torch"


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FOLDS = frozenset((torch.float16, torch.bfloat16, torch.float32))


def _native_fold(x: torch.Tensor, *tensors) -> bool:
    """Whether the native path's fold (``csrc/fold.cpp``, one autograd node) computes the
    folded gain and shift: an eager CUDA call whose tensors (``None`` for an absent weight or
    bias) are plain, of the ops' dtypes. The formula it replaces records about ten autograd
    ops per call, which a host-bound step pays in host time (CogVideoX trained at 0.81x);
    traced calls and other tensors (a DTensor) keep the formula."""
    if not (_entry.native and x.is_cuda) or _entry.is_compiling():
        return False
    return all(t is None or (type(t) in _PLAIN and t.dtype in _FOLDS) for t in tensors)


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



# ---------------------------------------------------------------- forwards of diffusers' other classes

def _layer_norm_zero_pair(cls: str, self, hidden_states, encoder_hidden_states, temb):
    """``(hidden_states, encoder_hidden_states, gate, enc_gate)`` of a zero-initialised AdaLN over
    two token streams sharing one norm: ``temb [B, C]`` projects to the shift, scale and gate of
    the video or image tokens ``hidden_states [B, S, D]`` and of the text tokens
    ``encoder_hidden_states [B, T, D]``; each modulated LayerNorm is one
    :func:`cudnorm.ada_layer_norm` call (the norm's affine weight and bias folded in). Gates ``[B, D]``."""
    _input(cls, "encoder_hidden_states", encoder_hidden_states)
    shift, scale, gate, enc_shift, enc_scale, enc_gate = _chunks(cls, self, hidden_states, "hidden_states", temb, 6)
    norm = self.norm
    return (_modulate(norm, hidden_states, scale, shift), _modulate(norm, encoder_hidden_states, enc_scale, enc_shift),
            gate, enc_gate)


def _cogvideox_layer_norm_zero(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                               temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' ``CogVideoXLayerNormZero.forward`` (CogVideoX, ConsisID) on cudnorm
    (:func:`_layer_norm_zero_pair`); its gates come as ``[B, 1, D]``."""
    h, enc, gate, enc_gate = _layer_norm_zero_pair("CogVideoXLayerNormZero", self, hidden_states,
                                                   encoder_hidden_states, temb)
    return h, enc, gate[:, None, :], enc_gate[:, None, :]


def _easyanimate_layer_norm_zero(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                                 temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' ``EasyAnimateLayerNormZero.forward`` on cudnorm (:func:`_layer_norm_zero_pair`):
    CogVideoX's with gates ``[B, D]`` and an ``FP32LayerNorm`` by default (diffusers rounds its
    output to x's dtype before modulating; the fused op modulates in fp32 and rounds once)."""
    return _layer_norm_zero_pair("EasyAnimateLayerNormZero", self, hidden_states, encoder_hidden_states, temb)


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


def _sana_video_modulated_norm(self, hidden_states: torch.Tensor, temb: torch.Tensor,
                               scale_shift_table: torch.Tensor) -> torch.Tensor:
    """diffusers' Sana-Video ``SanaModulatedNorm.forward`` (its output norm) on cudnorm: shift and
    scale ``scale_shift_table [2, D] + temb [B, T, D]`` (a row per token, or ``T = 1`` per sample)
    modulate the LayerNorm of ``hidden_states [B, S, D]`` in one :func:`cudnorm.ada_layer_norm`
    call."""
    _input("SanaModulatedNorm", "hidden_states", hidden_states)
    shift, scale = (scale_shift_table[None, None] + temb[:, :, None].to(scale_shift_table.device)).unbind(dim=2)
    norm = self.norm
    return _modulated_layer_norm(hidden_states, scale, shift, norm.eps, norm.weight, norm.bias)


def _flux3_adaln(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """diffusers' ``Flux3AdaLayerNorm.forward`` (FLUX.3's output norm) on cudnorm: ``(scale, shift) =
    linear(silu(temb))`` per token (``temb [B, S, C]``), then one :func:`cudnorm.ada_layer_norm`
    call modulating the LayerNorm of ``hidden_states [B, S, D]``."""
    cls = "Flux3AdaLayerNorm"
    _input(cls, "hidden_states", hidden_states)
    scale, shift = self.linear(self.act_fn(_input(cls, "temb", temb))).chunk(2, dim=-1)
    norm = self.norm
    return _modulated_layer_norm(hidden_states, scale, shift, norm.eps, norm.weight, norm.bias)


def _helios_output_norm(self, hidden_states: torch.Tensor, temb: torch.Tensor,
                        original_context_length: int) -> torch.Tensor:
    """diffusers' ``HeliosOutputNorm.forward`` on cudnorm: the last ``original_context_length``
    tokens, shift and scale ``scale_shift_table [1, 2, D] + temb`` per token, diffusers' fp32
    LayerNorm and modulation as one :func:`cudnorm.ada_layer_norm` call (computed in fp32,
    rounded once to the input's dtype, as diffusers' ``.type_as`` does). A modulation of
    neither the input's dtype nor fp32 runs diffusers' own forward."""
    cls = "HeliosOutputNorm"
    _input(cls, "hidden_states", hidden_states)
    rows = _input(cls, "temb", temb)[:, -original_context_length:, :]
    shift, scale = (self.scale_shift_table.unsqueeze(0).to(rows.device) + rows.unsqueeze(2)).chunk(2, dim=2)
    shift, scale = shift.squeeze(2).to(hidden_states.device), scale.squeeze(2).to(hidden_states.device)
    x = hidden_states[:, -original_context_length:, :]
    if (scale.dtype not in (x.dtype, torch.float32) or shift.dtype is not scale.dtype or scale.shape != x.shape
            or x.dtype is torch.float64):
        return type(self)._cudnorm_unpatched.forward(self, hidden_states, temb, original_context_length)
    return ada_layer_norm(x, scale, shift, self.norm.eps, one_plus_scale=True)


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
    ``[B, C]`` embedding is one :func:`ada_layer_norm` call (computed in fp32, rounded once), as
    is a per-token one of a non-affine norm; any other runs the formula with the norm on cudnorm."""
    cls = "AudioDiTAdaLayerNormZeroFinal"
    _input(cls, "hidden_states", hidden_states)
    scale, shift = self.linear(self.silu(_input(cls, "embedding", embedding))).chunk(2, dim=-1)
    if scale.ndim == 2:
        return _modulate(self.norm, hidden_states, scale, shift)
    norm = self.norm
    if norm.weight is None and norm.bias is None and scale.shape == hidden_states.shape:
        return _modulated_layer_norm(hidden_states, scale, shift, norm.eps)
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
