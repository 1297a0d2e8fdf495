"""Whole diffusers transformer blocks on cudnorm: ``cudnorm.patch(model, blocks=True)``.

Many diffusers blocks normalise with a plain norm module and then modulate in the block's own
forward, ``norm(h) * (1 + scale) + shift`` with per-sample chunks of the block's conditioning:
a norm and two elementwise kernels forward, and their backward, where :func:`cudnorm.ada_layer_norm`
(or :func:`cudnorm.ada_rms_norm`) is one op each way. Patching the norm module cannot reach that
modulation; these forwards run the whole block, calling the same children in the same order,
with each such norm and its modulation one fused op. :data:`BLOCKS` is the table; the forwards
of DiT, PixArt, SD3 and Flux (and Chroma's, Flux's with another modulation) are here, the
others in :mod:`cudnorm._diffusers_block_forwards`:

* ``BasicTransformerBlock`` with ``norm_type="ada_norm_zero"`` (DiT: ``norm3`` and the MLP's
  modulation) or ``"ada_norm_single"`` (PixArt: ``norm1`` with the attention's modulation,
  ``norm2`` with the MLP's, from ``scale_shift_table``);
* ``JointTransformerBlock`` (SD3/SD3.5: ``norm2`` and ``norm2_context``);
* ``FluxTransformerBlock`` (Flux.1 double-stream blocks: ``norm2`` and ``norm2_context``; the
  same forward in Bria FIBO's, LongCat-Image's and Ovis-Image's blocks, :data:`FLUX_BODIES`, and
  with Chroma's pruned modulation in ``ChromaTransformerBlock``);
* ``SanaTransformerBlock`` and ``AllegroTransformerBlock`` (Sana, Allegro: ``norm1`` and
  ``norm2``, PixArt's modulation);
* ``QwenImageTransformerBlock`` (Qwen-Image: both streams' ``norm1`` and ``norm2``);
* ``Flux2TransformerBlock`` and ``Flux2SingleTransformerBlock`` (FLUX.2: four modulated norms
  in a double-stream block, one in a single-stream block);
* ``HiDreamImageTransformerBlock`` and ``HiDreamImageSingleTransformerBlock`` (HiDream-I1: four
  modulated norms in a dual-stream block, two in a single-stream block);
* ``LTXVideoTransformerBlock`` (LTX-Video: weightless RMSNorms, one :func:`cudnorm.ada_rms_norm`
  each);
* ``AuraFlowJointTransformerBlock`` and ``AuraFlowSingleTransformerBlock`` (AuraFlow: each
  stream's ``norm2``, an FP32LayerNorm);
* ``Flux3TransformerBlock`` and ``Flux3SingleTransformerBlock`` (FLUX.3: ``norm`` modulated per
  token, one or two streams: :func:`cudnorm.ada_layer_norm`'s per-token path).

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

from . import _diffusers_block_ops as ops
from ._diffusers_block_forwards import (_allegro_block, _auraflow_joint_block, _auraflow_single_block,
                                        _cogview4_block, _flux2_block, _flux2_single_block, _flux3_block,
                                        _flux3_single_block, _hidream_block,
                                        _hidream_single_block, _hunyuan_image_block, _hunyuan_video_block,
                                        _ltx_block, _qwen_image_block, _sana_block, _skyreels_v2_block, _wan_block,
                                        _why_not_allegro, _why_not_auraflow, _why_not_cogview4, _why_not_flux2,
                                        _why_not_flux3,
                                        _why_not_hidream, _why_not_hunyuan, _why_not_ltx, _why_not_qwen_image,
                                        _why_not_sana, _why_not_wan)

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
            or kwargs.get("scale") is not None or not ops.fusable(*norms)):
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
        h = ops.modulated(self.norm1, hidden_states, scale_msa, shift_msa)
    attn_output = self.attn1(h, encoder_hidden_states=encoder_hidden_states if self.only_cross_attention else None,
                             attention_mask=attention_mask, **kwargs)
    hidden_states = gate_msa * attn_output + hidden_states
    if hidden_states.ndim == 4:
        hidden_states = hidden_states.squeeze(1)
    if self.attn2 is not None:  # cross-attention: PixArt's reads the residual stream as it is
        h = self.norm2(hidden_states) if zero else hidden_states
        hidden_states = self.attn2(h, encoder_hidden_states=encoder_hidden_states,
                                   attention_mask=encoder_attention_mask, **kwargs) + hidden_states
    h = ops.modulated(norms[-1], hidden_states, scale_mlp, shift_mlp)
    hidden_states = gate_mlp * self.ff(h) + hidden_states
    if hidden_states.ndim == 4:
        hidden_states = hidden_states.squeeze(1)
    return hidden_states


def _why_not_basic(block) -> str | None:
    norms = _basic_fused_norms(block)
    if norms is None:
        return f"norm_type {block.norm_type!r}: no modulation in the block's forward"
    return ops.why_not_layer_norms(norms)


# ---------------------------------------------------------------- JointTransformerBlock (SD3, SD3.5)

def _joint_fused_norms(block) -> tuple:
    return (block.norm2,) if block.context_pre_only else (block.norm2, block.norm2_context)


def _joint_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                 joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``JointTransformerBlock.forward``: image tokens ``hidden_states [B, S, D]`` and text tokens
    ``encoder_hidden_states [B, T, D]`` -> ``(encoder_hidden_states or None, hidden_states)``."""
    if self._chunk_size is not None or not ops.fusable(*_joint_fused_norms(self)):
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
    gate, branch = gate_msa, attn_output  # the last gated add before norm2 fuses into it
    if self.use_dual_attention:
        hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
        gate, branch = gate_msa2, self.attn2(hidden_states=h2, **kwargs)
    h, hidden_states = ops.gated_modulated(self.norm2, hidden_states, gate, branch, scale_mlp, shift_mlp)
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(h)
    if self.context_pre_only:  # the last block: the text stream ends here
        return None, hidden_states
    c, encoder_hidden_states = ops.gated_modulated(self.norm2_context, encoder_hidden_states, c_gate_msa,
                                                   context_attn_output, c_scale_mlp, c_shift_mlp)
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * self.ff_context(c)
    return encoder_hidden_states, hidden_states


def _why_not_joint(block) -> str | None:
    return ops.why_not_layer_norms(_joint_fused_norms(block))


# ---------------------------------------------------------------- FluxTransformerBlock (Flux.1)

def _flux_streams(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb_img: torch.Tensor,
                  temb_txt: torch.Tensor, attention_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The body of Flux's double-stream block (:func:`_flux_block`, :func:`_chroma_block`): each
    stream's AdaLN (``norm1``, ``norm1_context``, modules of their own), the joint attention called
    with ``attention_kwargs``, then each stream's gated residual add, ``norm2`` and its modulation
    fused (:func:`cudnorm._diffusers_block_ops.gated_modulated`)."""
    h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb_img)
    c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(encoder_hidden_states, emb=temb_txt)
    outputs = self.attn(hidden_states=h, encoder_hidden_states=c, **attention_kwargs)
    attn_output, context_attn_output = outputs[0], outputs[1]  # a third: IP-Adapter's attention
    h, hidden_states = ops.gated_modulated(self.norm2, hidden_states, gate_msa, attn_output, scale_mlp, shift_mlp)
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(h)
    if len(outputs) == 3:
        hidden_states = hidden_states + outputs[2]
    c, encoder_hidden_states = ops.gated_modulated(self.norm2_context, encoder_hidden_states, c_gate_msa,
                                                   context_attn_output, c_scale_mlp, c_shift_mlp)
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * self.ff_context(c)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _flux_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxTransformerBlock.forward``: image tokens ``hidden_states [B, S, D]`` and text tokens
    ``encoder_hidden_states [B, T, D]`` -> ``(encoder_hidden_states, hidden_states)``."""
    if not ops.fusable(self.norm2, self.norm2_context):
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
    if not ops.fusable(self.norm2, self.norm2_context):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb,
                                               image_rotary_emb=image_rotary_emb, attention_mask=attention_mask,
                                               joint_attention_kwargs=joint_attention_kwargs)
    if attention_mask is not None:
        attention_mask = attention_mask[:, None, None, :] * attention_mask[:, None, :, None]
    return _flux_streams(self, hidden_states, encoder_hidden_states, temb[:, :6], temb[:, 6:],
                         {"image_rotary_emb": image_rotary_emb, "attention_mask": attention_mask,
                          **(joint_attention_kwargs or {})})


def _why_not_flux(block) -> str | None:
    return ops.why_not_layer_norms((block.norm2, block.norm2_context))


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
#: block classes whose forward is Wan's ``WanTransformerBlock``'s, body for body: :func:`_wan_block` runs them
WAN_BODIES = (f"{_TRANSFORMERS}.transformer_wan.WanTransformerBlock",
              f"{_TRANSFORMERS}.transformer_chronoedit.WanTransformerBlock",
              f"{_TRANSFORMERS}.transformer_wan_animate.WanTransformerBlock")
#: block classes whose forward is ``HunyuanVideoTransformerBlock``'s, body for body: :func:`_hunyuan_video_block`
HUNYUAN_VIDEO_BODIES = (f"{_TRANSFORMERS}.transformer_hunyuan_video.HunyuanVideoTransformerBlock",
                        f"{_TRANSFORMERS}.transformer_hunyuan_video15.HunyuanVideo15TransformerBlock")
#: diffusers block class (module-qualified name) -> how it runs (``cudnorm.patch(..., blocks=True)``)
BLOCKS = {
    f"{_ATTENTION}.BasicTransformerBlock": Block(_basic_block, _why_not_basic),
    f"{_ATTENTION}.JointTransformerBlock": Block(_joint_block, _why_not_joint),
    "diffusers.models.transformers.transformer_flux.FluxTransformerBlock": Block(_flux_block, _why_not_flux),
    "diffusers.models.transformers.sana_transformer.SanaTransformerBlock": Block(_sana_block, _why_not_sana),
    **dict.fromkeys(FLUX_BODIES, Block(_flux_block, _why_not_flux)),
    f"{_TRANSFORMERS}.transformer_qwenimage.QwenImageTransformerBlock": Block(_qwen_image_block, _why_not_qwen_image),
    f"{_TRANSFORMERS}.transformer_chroma.ChromaTransformerBlock": Block(_chroma_block, _why_not_flux),
    f"{_TRANSFORMERS}.auraflow_transformer_2d.AuraFlowSingleTransformerBlock": Block(_auraflow_single_block,
                                                                                     _why_not_auraflow),
    f"{_TRANSFORMERS}.auraflow_transformer_2d.AuraFlowJointTransformerBlock": Block(_auraflow_joint_block,
                                                                                    _why_not_auraflow),
    f"{_TRANSFORMERS}.transformer_allegro.AllegroTransformerBlock": Block(_allegro_block, _why_not_allegro),
    f"{_TRANSFORMERS}.transformer_hidream_image.HiDreamImageTransformerBlock": Block(_hidream_block,
                                                                                       _why_not_hidream),
    f"{_TRANSFORMERS}.transformer_hidream_image.HiDreamImageSingleTransformerBlock": Block(_hidream_single_block,
                                                                                             _why_not_hidream),
    f"{_TRANSFORMERS}.transformer_ltx.LTXVideoTransformerBlock": Block(_ltx_block, _why_not_ltx),
    f"{_TRANSFORMERS}.transformer_flux2.Flux2TransformerBlock": Block(_flux2_block, _why_not_flux2),
    f"{_TRANSFORMERS}.transformer_flux2.Flux2SingleTransformerBlock": Block(_flux2_single_block, _why_not_flux2),
    **dict.fromkeys(WAN_BODIES, Block(_wan_block, _why_not_wan)),
    **dict.fromkeys(HUNYUAN_VIDEO_BODIES, Block(_hunyuan_video_block, _why_not_hunyuan)),
    f"{_TRANSFORMERS}.transformer_hunyuanimage.HunyuanImageTransformerBlock": Block(_hunyuan_image_block,
                                                                                      _why_not_hunyuan),
    f"{_TRANSFORMERS}.transformer_cogview4.CogView4TransformerBlock": Block(_cogview4_block, _why_not_cogview4),
    f"{_TRANSFORMERS}.transformer_skyreels_v2.SkyReelsV2TransformerBlock": Block(_skyreels_v2_block, _why_not_wan),
    f"{_TRANSFORMERS}.transformer_flux3.Flux3TransformerBlock": Block(_flux3_block, _why_not_flux3),
    f"{_TRANSFORMERS}.transformer_flux3.Flux3SingleTransformerBlock": Block(_flux3_single_block, _why_not_flux3),
}
