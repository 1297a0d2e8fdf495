"""Whole diffusers transformer blocks on cudnorm: ``cudnorm.patch(model, blocks=True)``.

diffusers' DiT, PixArt, SD3, Flux, FLUX.2, Sana, Qwen-Image and LTX-Video blocks normalise with a plain ``nn.LayerNorm`` and then
modulate in the block's own forward, ``norm(h) * (1 + scale[:, None]) + shift[:, None]`` with
per-sample chunks of the block's conditioning: a LayerNorm and two elementwise kernels forward,
and their backward, where :func:`cudnorm.ada_layer_norm` is one op each way. Patching the norm
module cannot reach that modulation; these forwards run the whole block, calling the same
children in the same order, with each such norm and its modulation one fused op.

* ``BasicTransformerBlock`` with ``norm_type="ada_norm_zero"`` (DiT: ``norm3`` and the MLP's
  modulation) or ``"ada_norm_single"`` (PixArt: ``norm1`` with the attention's modulation,
  ``norm2`` with the MLP's, from ``scale_shift_table``);
* ``JointTransformerBlock`` (SD3/SD3.5: ``norm2`` and ``norm2_context``);
* ``FluxTransformerBlock`` (Flux.1 double-stream blocks: ``norm2`` and ``norm2_context``; the
  same forward in Bria FIBO's, LongCat-Image's and Ovis-Image's blocks, :data:`FLUX_BODIES`, and
  with Chroma's pruned modulation in ``ChromaTransformerBlock``);
* ``SanaTransformerBlock`` (Sana: ``norm1`` and ``norm2``, PixArt's modulation);
* ``QwenImageTransformerBlock`` (Qwen-Image: both streams' ``norm1`` and ``norm2``);
* ``Flux2TransformerBlock`` and ``Flux2SingleTransformerBlock`` (FLUX.2: four modulated norms
  in a double-stream block, one in a single-stream block);
* ``LTXVideoTransformerBlock`` (LTX-Video: weightless RMSNorms, one :func:`cudnorm.ada_rms_norm`
  each).

Everything else in each forward is the block's own computation, op for op; the fused op rounds
once where the block's formula rounds three times (one rounding step of the activation dtype
apart, as cudnorm's AdaLN modules are). A call the fused forward does not cover runs the
block's own forward: a feed-forward chunk size, GLIGEN or a deprecated ``scale`` in the
attention kwargs, a norm that is not a LayerNorm over the last dim, and a norm whose call is
observed (hooks on it, an instance ``forward`` such as accelerate's offloading hook, or global
module hooks), so those fire as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .ada_layer_norm import ada_layer_norm
from .ada_rms_norm import ada_rms_norm
from ._diffusers_forwards import _modulated_layer_norm
from .diffusers import _norm_kind, layer_norm_class

# torch's module-global hook registries (dicts mutated in place, never rebound): module calls
# run their hooks while any holds one
GLOBAL_HOOKS = tuple(getattr(torch.nn.modules.module, name) for name in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))


def observed(child: torch.nn.Module) -> bool:
    """Whether a call of ``child`` is observed: hooks on it, an instance ``forward`` (accelerate's
    offloading hook, which must load its weights) or global module hooks. A forward that reads
    ``child``'s parameters instead of calling it must then call the original forward. The test is
    ``nn.Module.__call__``'s own: attribute and dict reads, on every call."""
    return bool(child._forward_hooks or child._forward_pre_hooks or child._backward_hooks
                or child._backward_pre_hooks or "forward" in child.__dict__ or any(GLOBAL_HOOKS))


def _fusable(*norms) -> bool:
    """The norms a fused forward reads instead of calling: LayerNorms over the last dim
    (:func:`cudnorm.diffusers.layer_norm_class`: ``nn.LayerNorm``'s is an identity test, on
    every call of every block), unobserved."""
    for norm in norms:
        if not layer_norm_class(type(norm)) or len(norm.normalized_shape) != 1 or observed(norm):
            return False
    return True


def _modulated(norm: torch.nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``norm(x) * (1 + scale[:, None]) + shift[:, None]`` as one op for ``x [B, S, D]`` and
    per-sample chunks ``scale``/``shift`` ``[B, D]`` (or ``[B, 1, D]``), ``norm`` a LayerNorm
    read, not called. The blocks' own case (no affine parameters, one dtype) goes straight to
    :func:`cudnorm.ada_layer_norm`; any other, :func:`cudnorm._diffusers_forwards._modulated_layer_norm`."""
    weight, bias, b, d = norm.weight, norm.bias, x.shape[0], x.shape[-1]
    if (weight is None and bias is None and x.dtype is scale.dtype and shift.dtype is scale.dtype and x.dim() == 3
            and scale.shape[0] == b and scale.shape[-1] == d and scale.numel() == b * d and shift.shape == scale.shape):
        return ada_layer_norm(x, scale, shift, norm.eps, one_plus_scale=True)
    if scale.dim() == 2:  # diffusers' formula indexes [B, D] chunks as [B, 1, D]
        scale, shift = scale[:, None], shift[:, None]
    return _modulated_layer_norm(x, scale, shift, norm.eps, weight, bias)


# ---------------------------------------------------------------- BasicTransformerBlock (DiT, PixArt)

def _basic_fused_norms(block) -> tuple | None:
    """The norms the fused forward reads for ``block``'s norm type, or None where it fuses none."""
    if block.norm_type == "ada_norm_zero":
        return (block.norm3,)
    if block.norm_type == "ada_norm_single":
        return block.norm1, block.norm2
    return None


def _basic_block(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                 timestep: torch.Tensor | None = None, cross_attention_kwargs: dict | None = None,
                 class_labels: torch.Tensor | None = None, added_cond_kwargs: dict | None = None) -> torch.Tensor:
    """``BasicTransformerBlock.forward``: ``hidden_states [B, S, D]`` -> ``[B, S, D]``."""
    kwargs = cross_attention_kwargs or {}
    norms = _basic_fused_norms(self)
    if (norms is None or self.pos_embed is not None or self._chunk_size is not None or "gligen" in kwargs
            or kwargs.get("scale") is not None or not _fusable(*norms)):
        return self._cudnorm_unpatched.forward(
            self, hidden_states, attention_mask=attention_mask, encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask, timestep=timestep,
            cross_attention_kwargs=cross_attention_kwargs, class_labels=class_labels,
            added_cond_kwargs=added_cond_kwargs)
    zero = self.norm_type == "ada_norm_zero"
    if zero:  # DiT: the AdaLN module returns the attention's input and the MLP's chunks [B, D]
        h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(
            hidden_states, timestep, class_labels, hidden_dtype=hidden_states.dtype)
        gate_msa, gate_mlp = gate_msa.unsqueeze(1), gate_mlp.unsqueeze(1)
    else:  # PixArt: six chunks [B, 1, D] of the table plus the timestep embedding
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            self.scale_shift_table[None] + timestep.reshape(hidden_states.shape[0], 6, -1)).chunk(6, dim=1)
        h = _modulated(self.norm1, hidden_states, scale_msa, shift_msa)
    attn_output = self.attn1(h, encoder_hidden_states=encoder_hidden_states if self.only_cross_attention else None,
                             attention_mask=attention_mask, **kwargs)
    hidden_states = gate_msa * attn_output + hidden_states
    if hidden_states.ndim == 4:
        hidden_states = hidden_states.squeeze(1)
    if self.attn2 is not None:  # cross-attention: PixArt's reads the residual stream as it is
        h = self.norm2(hidden_states) if zero else hidden_states
        hidden_states = self.attn2(h, encoder_hidden_states=encoder_hidden_states,
                                   attention_mask=encoder_attention_mask, **kwargs) + hidden_states
    h = _modulated(norms[-1], hidden_states, scale_mlp, shift_mlp)
    hidden_states = gate_mlp * self.ff(h) + hidden_states
    if hidden_states.ndim == 4:
        hidden_states = hidden_states.squeeze(1)
    return hidden_states


def _why_not_basic(block) -> str | None:
    norms = _basic_fused_norms(block)
    if norms is None:
        return f"norm_type {block.norm_type!r}: no modulation in the block's forward"
    if not all(_norm_kind(norm) == "layer_norm" for norm in norms):
        return "a norm it modulates is not a LayerNorm over the last dim"
    return None


# ---------------------------------------------------------------- JointTransformerBlock (SD3, SD3.5)

def _joint_fused_norms(block) -> tuple:
    return (block.norm2,) if block.context_pre_only else (block.norm2, block.norm2_context)


def _joint_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                 joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``JointTransformerBlock.forward``: image tokens ``hidden_states [B, S, D]`` and text tokens
    ``encoder_hidden_states [B, T, D]`` -> ``(encoder_hidden_states or None, hidden_states)``."""
    if self._chunk_size is not None or not _fusable(*_joint_fused_norms(self)):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb,
                                               joint_attention_kwargs=joint_attention_kwargs)
    kwargs = joint_attention_kwargs or {}
    if self.use_dual_attention:
        h, gate_msa, shift_mlp, scale_mlp, gate_mlp, h2, gate_msa2 = self.norm1(hidden_states, emb=temb)
    else:
        h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    if self.context_pre_only:
        c = self.norm1_context(encoder_hidden_states, temb)
    else:
        c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(encoder_hidden_states, emb=temb)
    attn_output, context_attn_output = self.attn(hidden_states=h, encoder_hidden_states=c, **kwargs)
    hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
    if self.use_dual_attention:
        hidden_states = hidden_states + gate_msa2.unsqueeze(1) * self.attn2(hidden_states=h2, **kwargs)
    h = _modulated(self.norm2, hidden_states, scale_mlp, shift_mlp)
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(h)
    if self.context_pre_only:  # the last block: the text stream ends here
        return None, hidden_states
    encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
    c = _modulated(self.norm2_context, encoder_hidden_states, c_scale_mlp, c_shift_mlp)
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * self.ff_context(c)
    return encoder_hidden_states, hidden_states


def _why_not_joint(block) -> str | None:
    if not all(_norm_kind(norm) == "layer_norm" for norm in _joint_fused_norms(block)):
        return "a norm it modulates is not a LayerNorm over the last dim"
    return None


# ---------------------------------------------------------------- FluxTransformerBlock (Flux.1)

def _flux_streams(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb_img: torch.Tensor,
                  temb_txt: torch.Tensor, attention_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The body of Flux's double-stream block (:func:`_flux_block`, :func:`_chroma_block`): each
    stream's AdaLN (``norm1``, ``norm1_context``, modules of their own), the joint attention called
    with ``attention_kwargs``, then each stream's ``norm2`` and its modulation fused."""
    h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb_img)
    c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(encoder_hidden_states, emb=temb_txt)
    outputs = self.attn(hidden_states=h, encoder_hidden_states=c, **attention_kwargs)
    attn_output, context_attn_output = outputs[0], outputs[1]  # a third: IP-Adapter's attention
    hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
    h = _modulated(self.norm2, hidden_states, scale_mlp, shift_mlp)
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(h)
    if len(outputs) == 3:
        hidden_states = hidden_states + outputs[2]
    encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
    c = _modulated(self.norm2_context, encoder_hidden_states, c_scale_mlp, c_shift_mlp)
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * self.ff_context(c)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _flux_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxTransformerBlock.forward``: image tokens ``hidden_states [B, S, D]`` and text tokens
    ``encoder_hidden_states [B, T, D]`` -> ``(encoder_hidden_states, hidden_states)``."""
    if not _fusable(self.norm2, self.norm2_context):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb,
                                               image_rotary_emb=image_rotary_emb,
                                               joint_attention_kwargs=joint_attention_kwargs)
    return _flux_streams(self, hidden_states, encoder_hidden_states, temb, temb,
                         {"image_rotary_emb": image_rotary_emb, **(joint_attention_kwargs or {})})


def _chroma_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                  image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                  attention_mask: torch.Tensor | None = None,
                  joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ChromaTransformerBlock.forward``: Flux's block with the pruned modulation (``temb [B, 12,
    D]``: six rows per stream, precomputed) and a text mask made pairwise for the attention."""
    if not _fusable(self.norm2, self.norm2_context):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb,
                                               image_rotary_emb=image_rotary_emb, attention_mask=attention_mask,
                                               joint_attention_kwargs=joint_attention_kwargs)
    if attention_mask is not None:
        attention_mask = attention_mask[:, None, None, :] * attention_mask[:, None, :, None]
    return _flux_streams(self, hidden_states, encoder_hidden_states, temb[:, :6], temb[:, 6:],
                         {"image_rotary_emb": image_rotary_emb, "attention_mask": attention_mask,
                          **(joint_attention_kwargs or {})})


def _why_not_flux(block) -> str | None:
    if not all(_norm_kind(norm) == "layer_norm" for norm in (block.norm2, block.norm2_context)):
        return "a norm it modulates is not a LayerNorm over the last dim"
    return None


# ---------------------------------------------------------------- SanaTransformerBlock (Sana)

def _sana_block(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                timestep: torch.Tensor | None = None, height: int | None = None,
                width: int | None = None) -> torch.Tensor:
    """``SanaTransformerBlock.forward``: image tokens ``hidden_states [B, H * W, D]`` ->
    ``[B, H * W, D]``; PixArt's modulation (``scale_shift_table`` plus the timestep embedding,
    chunks ``[B, 1, D]``) of ``norm1`` and ``norm2``, the feed-forward a convolution over the
    ``height x width`` grid."""
    if not _fusable(self.norm1, self.norm2):
        return self._cudnorm_unpatched.forward(
            self, hidden_states, attention_mask=attention_mask, encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask, timestep=timestep, height=height, width=width)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        self.scale_shift_table[None] + timestep.reshape(hidden_states.shape[0], 6, -1)).chunk(6, dim=1)
    h = _modulated(self.norm1, hidden_states, scale_msa, shift_msa).to(hidden_states.dtype)
    hidden_states = hidden_states + gate_msa * self.attn1(h)
    if self.attn2 is not None:
        hidden_states = self.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                   attention_mask=encoder_attention_mask) + hidden_states
    h = _modulated(self.norm2, hidden_states, scale_mlp, shift_mlp)
    ff_output = self.ff(h.unflatten(1, (height, width)).permute(0, 3, 1, 2)).flatten(2, 3).permute(0, 2, 1)
    return hidden_states + gate_mlp * ff_output


def _why_not_sana(block) -> str | None:
    if not all(_norm_kind(norm) == "layer_norm" for norm in (block.norm1, block.norm2)):
        return "a norm it modulates is not a LayerNorm over the last dim"
    return None


# ---------------------------------------------------------------- Flux2TransformerBlock, Flux2SingleTransformerBlock (FLUX.2)

def _flux2_split(mod: torch.Tensor, sets: int) -> tuple:
    """``Flux2Modulation.split``: ``sets`` triples (shift, scale, gate) of ``mod [B, 3 * sets * D]``
    (chunks ``[B, 1, D]``) or of a per-token ``[B, S, 3 * sets * D]``."""
    if mod.ndim == 2:
        mod = mod.unsqueeze(1)
    chunks = torch.chunk(mod, 3 * sets, dim=-1)
    return tuple(chunks[3 * i:3 * (i + 1)] for i in range(sets))


def _flux2_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 temb_mod_img: torch.Tensor, temb_mod_txt: torch.Tensor,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                 joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``Flux2TransformerBlock.forward`` (double-stream): image tokens ``hidden_states [B, S, D]``
    and text tokens ``encoder_hidden_states [B, T, D]`` -> ``(encoder_hidden_states,
    hidden_states)``; four modulated norms a block."""
    if not _fusable(self.norm1, self.norm1_context, self.norm2, self.norm2_context):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt,
                                               image_rotary_emb=image_rotary_emb,
                                               joint_attention_kwargs=joint_attention_kwargs)
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = _flux2_split(temb_mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = _flux2_split(temb_mod_txt, 2)
    h = _modulated(self.norm1, hidden_states, scale_msa, shift_msa)
    c = _modulated(self.norm1_context, encoder_hidden_states, c_scale_msa, c_shift_msa)
    attn_output, context_attn_output = self.attn(hidden_states=h, encoder_hidden_states=c,
                                                 image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    hidden_states = hidden_states + gate_msa * attn_output
    h = _modulated(self.norm2, hidden_states, scale_mlp, shift_mlp)
    hidden_states = hidden_states + gate_mlp * self.ff(h)
    encoder_hidden_states = encoder_hidden_states + c_gate_msa * context_attn_output
    c = _modulated(self.norm2_context, encoder_hidden_states, c_scale_mlp, c_shift_mlp)
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp * self.ff_context(c)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _flux2_single_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None,
                        temb_mod: torch.Tensor, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                        joint_attention_kwargs: dict | None = None, split_hidden_states: bool = False,
                        text_seq_len: int | None = None):
    """``Flux2SingleTransformerBlock.forward``: the text and image tokens as one sequence (joined
    here when ``encoder_hidden_states`` is given) -> that sequence, or split back into
    ``(encoder_hidden_states, hidden_states)``; one modulated norm."""
    if not _fusable(self.norm):
        return self._cudnorm_unpatched.forward(
            self, hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb=image_rotary_emb,
            joint_attention_kwargs=joint_attention_kwargs, split_hidden_states=split_hidden_states,
            text_seq_len=text_seq_len)
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    shift, scale, gate = _flux2_split(temb_mod, 1)[0]
    h = _modulated(self.norm, hidden_states, scale, shift)
    hidden_states = hidden_states + gate * self.attn(hidden_states=h, image_rotary_emb=image_rotary_emb,
                                                     **(joint_attention_kwargs or {}))
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states


def _why_not_flux2(block) -> str | None:
    norms = (block.norm,) if hasattr(block, "norm") else (block.norm1, block.norm1_context, block.norm2,
                                                          block.norm2_context)
    if not all(_norm_kind(norm) == "layer_norm" for norm in norms):
        return "a norm it modulates is not a LayerNorm over the last dim"
    return None


# ---------------------------------------------------------------- QwenImageTransformerBlock (Qwen-Image)

def _qwen_modulated(block, norm, x: torch.Tensor, params: torch.Tensor, index=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's ``_modulate(norm(x), params, index)``: ``(norm(x) * (1 + scale) + shift, gate)``
    with ``params [B, 3 * D]`` (shift, scale, gate), the modulated norm one fused op where it is per
    sample; a per-token choice between two modulations (``index``, Qwen-Image-Edit's
    ``zero_cond_t``) runs the block's own."""
    if index is not None:
        return block._modulate(norm(x), params, index)
    shift, scale, gate = params.chunk(3, dim=-1)
    return _modulated(norm, x, scale, shift), gate.unsqueeze(1)


def _qwen_image_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                      encoder_hidden_states_mask: torch.Tensor, temb: torch.Tensor,
                      image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                      joint_attention_kwargs: dict | None = None,
                      modulate_index: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``QwenImageTransformerBlock.forward``: image tokens ``hidden_states [B, S, D]`` and text
    tokens ``encoder_hidden_states [B, T, D]`` -> ``(encoder_hidden_states, hidden_states)``; four
    modulated norms a block (each stream's ``norm1`` and ``norm2``)."""
    norms = (self.img_norm1, self.txt_norm1, self.img_norm2, self.txt_norm2)
    if not _fusable(*norms):
        return self._cudnorm_unpatched.forward(
            self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
            image_rotary_emb=image_rotary_emb, joint_attention_kwargs=joint_attention_kwargs,
            modulate_index=modulate_index)
    img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
    if self.zero_cond_t:  # the image stream's modulation came twice (per token, by modulate_index)
        temb = torch.chunk(temb, 2, dim=0)[0]
    txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)
    img, img_gate1 = _qwen_modulated(self, self.img_norm1, hidden_states, img_mod1, modulate_index)
    txt, txt_gate1 = _qwen_modulated(self, self.txt_norm1, encoder_hidden_states, txt_mod1)
    img_attn_output, txt_attn_output = self.attn(
        hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=encoder_hidden_states_mask,
        image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    hidden_states = hidden_states + img_gate1 * img_attn_output
    encoder_hidden_states = encoder_hidden_states + txt_gate1 * txt_attn_output
    img, img_gate2 = _qwen_modulated(self, self.img_norm2, hidden_states, img_mod2, modulate_index)
    hidden_states = hidden_states + img_gate2 * self.img_mlp(img)
    txt, txt_gate2 = _qwen_modulated(self, self.txt_norm2, encoder_hidden_states, txt_mod2)
    encoder_hidden_states = encoder_hidden_states + txt_gate2 * self.txt_mlp(txt)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _why_not_qwen_image(block) -> str | None:
    if not all(_norm_kind(norm) == "layer_norm"
               for norm in (block.img_norm1, block.txt_norm1, block.img_norm2, block.txt_norm2)):
        return "a norm it modulates is not a LayerNorm over the last dim"
    return None


# ---------------------------------------------------------------- LTXVideoTransformerBlock (LTX-Video)

def _fusable_rms(*norms) -> bool:
    """diffusers' RMSNorms without a weight (LTX-Video's blocks), unobserved: what
    :func:`cudnorm.ada_rms_norm` normalises."""
    return all(_norm_kind(norm) == "rms_norm" and norm.weight is None and not observed(norm) for norm in norms)


def _rms_modulated(norm: torch.nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift`` for a weightless RMSNorm: one :func:`cudnorm.ada_rms_norm`
    where ``scale``/``shift`` are per sample (``[B, 1, D]``, x's dtype), else the formula (a
    modulation per token, LTX-Video's conditioning frames)."""
    b, d = x.shape[0], x.shape[-1]
    if (x.dim() == 3 and scale.dtype is x.dtype and shift.dtype is x.dtype and scale.shape[0] == b
            and scale.shape[-1] == d and scale.numel() == b * d and shift.shape == scale.shape):
        return ada_rms_norm(x, scale, shift, norm.eps, one_plus_scale=True)
    return norm(x) * (1 + scale) + shift


def _ltx_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
               image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
               encoder_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``LTXVideoTransformerBlock.forward``: video tokens ``hidden_states [B, S, D]`` -> ``[B, S,
    D]``; ``norm1`` and ``norm2`` (weightless RMSNorms) with the modulation of
    ``scale_shift_table`` plus ``temb [B, T, 6 * D]`` (``T`` 1: per sample)."""
    if not _fusable_rms(self.norm1, self.norm2):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb,
                                               image_rotary_emb=image_rotary_emb,
                                               encoder_attention_mask=encoder_attention_mask)
    sets = self.scale_shift_table.shape[0]
    ada_values = self.scale_shift_table[None, None].to(temb.device) + temb.reshape(
        hidden_states.size(0), temb.size(1), sets, -1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada_values.unbind(dim=2)
    h = _rms_modulated(self.norm1, hidden_states, scale_msa, shift_msa)
    hidden_states = hidden_states + self.attn1(hidden_states=h, encoder_hidden_states=None,
                                               image_rotary_emb=image_rotary_emb) * gate_msa
    hidden_states = hidden_states + self.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                               image_rotary_emb=None, attention_mask=encoder_attention_mask)
    h = _rms_modulated(self.norm2, hidden_states, scale_mlp, shift_mlp)
    return hidden_states + self.ff(h) * gate_mlp


def _why_not_ltx(block) -> str | None:
    if not all(_norm_kind(norm) == "rms_norm" and norm.weight is None for norm in (block.norm1, block.norm2)):
        return "a norm it modulates is not a weightless RMSNorm over the last dim"
    return None


# ---------------------------------------------------------------- the table

class Block(NamedTuple):
    """How a diffusers block class runs with its modulated norms fused: ``forward(block, ...)``
    and ``why_not(block)`` (why an instance cannot, or None)."""

    forward: Callable
    why_not: Callable[[torch.nn.Module], str | None]


_ATTENTION = "diffusers.models.attention"
_TRANSFORMERS = "diffusers.models.transformers"
#: block classes whose forward is ``FluxTransformerBlock``'s, body for body (their constructors
#: differ in the attention class and the feed-forward's activation only): :func:`_flux_block` runs them
FLUX_BODIES = (f"{_TRANSFORMERS}.transformer_bria_fibo.BriaFiboTransformerBlock",
               f"{_TRANSFORMERS}.transformer_longcat_image.LongCatImageTransformerBlock",
               f"{_TRANSFORMERS}.transformer_ovis_image.OvisImageTransformerBlock")
#: diffusers block class (module-qualified name) -> how it runs (``cudnorm.patch(..., blocks=True)``)
BLOCKS = {
    f"{_ATTENTION}.BasicTransformerBlock": Block(_basic_block, _why_not_basic),
    f"{_ATTENTION}.JointTransformerBlock": Block(_joint_block, _why_not_joint),
    "diffusers.models.transformers.transformer_flux.FluxTransformerBlock": Block(_flux_block, _why_not_flux),
    "diffusers.models.transformers.sana_transformer.SanaTransformerBlock": Block(_sana_block, _why_not_sana),
    **dict.fromkeys(FLUX_BODIES, Block(_flux_block, _why_not_flux)),
    f"{_TRANSFORMERS}.transformer_qwenimage.QwenImageTransformerBlock": Block(_qwen_image_block, _why_not_qwen_image),
    f"{_TRANSFORMERS}.transformer_chroma.ChromaTransformerBlock": Block(_chroma_block, _why_not_flux),
    f"{_TRANSFORMERS}.transformer_ltx.LTXVideoTransformerBlock": Block(_ltx_block, _why_not_ltx),
    f"{_TRANSFORMERS}.transformer_flux2.Flux2TransformerBlock": Block(_flux2_block, _why_not_flux2),
    f"{_TRANSFORMERS}.transformer_flux2.Flux2SingleTransformerBlock": Block(_flux2_single_block, _why_not_flux2),
}
