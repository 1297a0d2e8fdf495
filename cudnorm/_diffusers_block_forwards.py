"""Fused forwards of diffusers blocks beyond the first four families (:mod:`cudnorm._diffusers_blocks`
holds the table): FLUX.2's, Qwen-Image's, Sana's, Allegro's, HiDream's, LTX-Video's, AuraFlow's,
Wan's, SkyReels-V2's, HunyuanVideo's, HunyuanImage's, CogView4's and FLUX.3's blocks. Each calls the
block's children in the block's order, with each modulated norm one op
(:mod:`cudnorm._diffusers_block_ops`), and runs the block's own forward where it cannot fuse."""

from __future__ import annotations

import torch

from . import _diffusers_block_ops as ops


# ---------------------------------------------------------------- SanaTransformerBlock (Sana)

def _sana_block(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                timestep: torch.Tensor | None = None, height: int | None = None,
                width: int | None = None) -> torch.Tensor:
    """``SanaTransformerBlock.forward``: image tokens ``hidden_states [B, H * W, D]`` ->
    ``[B, H * W, D]``; PixArt's modulation (``scale_shift_table`` plus the timestep embedding,
    chunks ``[B, 1, D]``) of ``norm1`` and ``norm2``, the feed-forward a convolution over the
    ``height x width`` grid."""
    if not ops.fusable(self.norm1, self.norm2):
        return self._cudnorm_unpatched.forward(
            self, hidden_states, attention_mask=attention_mask, encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask, timestep=timestep, height=height, width=width)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        self.scale_shift_table[None] + timestep.reshape(hidden_states.shape[0], 6, -1)).chunk(6, dim=1)
    h = ops.modulated(self.norm1, hidden_states, scale_msa, shift_msa).to(hidden_states.dtype)
    hidden_states = hidden_states + gate_msa * self.attn1(h)
    if self.attn2 is not None:
        hidden_states = self.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                   attention_mask=encoder_attention_mask) + hidden_states
    h = ops.modulated(self.norm2, hidden_states, scale_mlp, shift_mlp)
    ff_output = self.ff(h.unflatten(1, (height, width)).permute(0, 3, 1, 2)).flatten(2, 3).permute(0, 2, 1)
    return hidden_states + gate_mlp * ff_output


def _why_not_sana(block) -> str | None:
    return ops.why_not_layer_norms((block.norm1, block.norm2))


# ---------------------------------------------------------------- AllegroTransformerBlock (Allegro)

def _allegro_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                   temb: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                   encoder_attention_mask: torch.Tensor | None = None, image_rotary_emb=None) -> torch.Tensor:
    """``AllegroTransformerBlock.forward``: video tokens ``hidden_states [B, S, D]`` -> ``[B, S,
    D]``; PixArt's modulation (``scale_shift_table`` plus ``temb``, chunks ``[B, 1, D]``) of
    ``norm1`` and ``norm2``."""
    if not ops.fusable(self.norm1, self.norm2):
        return self._cudnorm_unpatched.forward(
            self, hidden_states, encoder_hidden_states=encoder_hidden_states, temb=temb,
            attention_mask=attention_mask, encoder_attention_mask=encoder_attention_mask,
            image_rotary_emb=image_rotary_emb)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        self.scale_shift_table[None] + temb.reshape(hidden_states.shape[0], 6, -1)).chunk(6, dim=1)
    h = ops.modulated(self.norm1, hidden_states, scale_msa, shift_msa).squeeze(1)
    hidden_states = gate_msa * self.attn1(h, encoder_hidden_states=None, attention_mask=attention_mask,
                                          image_rotary_emb=image_rotary_emb) + hidden_states
    if hidden_states.ndim == 4:
        hidden_states = hidden_states.squeeze(1)
    if self.attn2 is not None:  # cross-attention reads the residual stream as it is (PixArt's)
        hidden_states = self.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                   attention_mask=encoder_attention_mask, image_rotary_emb=None) + hidden_states
    h = ops.modulated(self.norm2, hidden_states, scale_mlp, shift_mlp)
    hidden_states = gate_mlp * self.ff(h) + hidden_states
    if hidden_states.ndim == 4:
        hidden_states = hidden_states.squeeze(1)
    return hidden_states


def _why_not_allegro(block) -> str | None:
    return ops.why_not_layer_norms((block.norm1, block.norm2))


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
    if not ops.fusable(self.norm1, self.norm1_context, self.norm2, self.norm2_context):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt,
                                               image_rotary_emb=image_rotary_emb,
                                               joint_attention_kwargs=joint_attention_kwargs)
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = _flux2_split(temb_mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = _flux2_split(temb_mod_txt, 2)
    h = ops.modulated(self.norm1, hidden_states, scale_msa, shift_msa)
    c = ops.modulated(self.norm1_context, encoder_hidden_states, c_scale_msa, c_shift_msa)
    attn_output, context_attn_output = self.attn(hidden_states=h, encoder_hidden_states=c,
                                                 image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    hidden_states = hidden_states + gate_msa * attn_output
    h = ops.modulated(self.norm2, hidden_states, scale_mlp, shift_mlp)
    hidden_states = hidden_states + gate_mlp * self.ff(h)
    encoder_hidden_states = encoder_hidden_states + c_gate_msa * context_attn_output
    c = ops.modulated(self.norm2_context, encoder_hidden_states, c_scale_mlp, c_shift_mlp)
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
    if not ops.fusable(self.norm):
        return self._cudnorm_unpatched.forward(
            self, hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb=image_rotary_emb,
            joint_attention_kwargs=joint_attention_kwargs, split_hidden_states=split_hidden_states,
            text_seq_len=text_seq_len)
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    shift, scale, gate = _flux2_split(temb_mod, 1)[0]
    h = ops.modulated(self.norm, hidden_states, scale, shift)
    hidden_states = hidden_states + gate * self.attn(hidden_states=h, image_rotary_emb=image_rotary_emb,
                                                     **(joint_attention_kwargs or {}))
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states


def _why_not_flux2(block) -> str | None:
    return ops.why_not_layer_norms((block.norm,) if hasattr(block, "norm") else (
        block.norm1, block.norm1_context, block.norm2, block.norm2_context))


# ---------------------------------------------------------------- QwenImageTransformerBlock (Qwen-Image)

def _qwen_modulated(block, norm, x: torch.Tensor, params: torch.Tensor, index=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's ``_modulate(norm(x), params, index)``: ``(norm(x) * (1 + scale) + shift, gate)``
    with ``params [B, 3 * D]`` (shift, scale, gate), the modulated norm one fused op where it is per
    sample; a per-token choice between two modulations (``index``, Qwen-Image-Edit's
    ``zero_cond_t``) runs the block's own."""
    if index is not None:
        return block._modulate(norm(x), params, index)
    shift, scale, gate = params.chunk(3, dim=-1)
    return ops.modulated(norm, x, scale, shift), gate.unsqueeze(1)


def _qwen_image_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                      encoder_hidden_states_mask: torch.Tensor, temb: torch.Tensor,
                      image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                      joint_attention_kwargs: dict | None = None,
                      modulate_index: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``QwenImageTransformerBlock.forward``: image tokens ``hidden_states [B, S, D]`` and text
    tokens ``encoder_hidden_states [B, T, D]`` -> ``(encoder_hidden_states, hidden_states)``; four
    modulated norms a block (each stream's ``norm1`` and ``norm2``)."""
    norms = (self.img_norm1, self.txt_norm1, self.img_norm2, self.txt_norm2)
    if not ops.fusable(*norms):
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
    return ops.why_not_layer_norms((block.img_norm1, block.txt_norm1, block.img_norm2, block.txt_norm2))


# ---------------------------------------------------------------- HiDream-I1's blocks

def _hidream_single_block(self, hidden_states: torch.Tensor, hidden_states_masks: torch.Tensor | None = None,
                          encoder_hidden_states: torch.Tensor | None = None, temb: torch.Tensor | None = None,
                          image_rotary_emb: torch.Tensor = None) -> torch.Tensor:
    """``HiDreamImageSingleTransformerBlock.forward``: ``hidden_states [B, S, D]`` -> ``[B, S, D]``;
    ``norm1_i`` and ``norm3_i`` with the chunks ``[B, 1, D]`` of ``adaLN_modulation(temb)``."""
    if not ops.fusable(self.norm1_i, self.norm3_i):
        return self._cudnorm_unpatched.forward(self, hidden_states, hidden_states_masks, encoder_hidden_states,
                                               temb, image_rotary_emb=image_rotary_emb)
    wtype = hidden_states.dtype
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(temb)[:, None].chunk(6, dim=-1)
    h = ops.modulated(self.norm1_i, hidden_states, scale_msa, shift_msa)
    hidden_states = gate_msa * self.attn1(h, hidden_states_masks, image_rotary_emb=image_rotary_emb) + hidden_states
    h = ops.modulated(self.norm3_i, hidden_states, scale_mlp, shift_mlp)
    return gate_mlp * self.ff_i(h.to(dtype=wtype)) + hidden_states


def _hidream_block(self, hidden_states: torch.Tensor, hidden_states_masks: torch.Tensor | None = None,
                   encoder_hidden_states: torch.Tensor | None = None, temb: torch.Tensor | None = None,
                   image_rotary_emb: torch.Tensor = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``HiDreamImageTransformerBlock.forward`` (dual-stream): image tokens ``hidden_states [B, S,
    D]`` and text tokens ``encoder_hidden_states [B, T, D]`` -> ``(hidden_states,
    encoder_hidden_states)``; four modulated norms a block."""
    if not ops.fusable(self.norm1_i, self.norm1_t, self.norm3_i, self.norm3_t):
        return self._cudnorm_unpatched.forward(self, hidden_states, hidden_states_masks, encoder_hidden_states,
                                               temb, image_rotary_emb=image_rotary_emb)
    (shift_msa_i, scale_msa_i, gate_msa_i, shift_mlp_i, scale_mlp_i, gate_mlp_i, shift_msa_t, scale_msa_t, gate_msa_t,
     shift_mlp_t, scale_mlp_t, gate_mlp_t) = self.adaLN_modulation(temb)[:, None].chunk(12, dim=-1)
    h = ops.modulated(self.norm1_i, hidden_states, scale_msa_i, shift_msa_i)
    c = ops.modulated(self.norm1_t, encoder_hidden_states, scale_msa_t, shift_msa_t)
    attn_output_i, attn_output_t = self.attn1(h, hidden_states_masks, c, image_rotary_emb=image_rotary_emb)
    hidden_states = gate_msa_i * attn_output_i + hidden_states
    encoder_hidden_states = gate_msa_t * attn_output_t + encoder_hidden_states
    h = ops.modulated(self.norm3_i, hidden_states, scale_mlp_i, shift_mlp_i)
    c = ops.modulated(self.norm3_t, encoder_hidden_states, scale_mlp_t, shift_mlp_t)
    hidden_states = gate_mlp_i * self.ff_i(h) + hidden_states
    encoder_hidden_states = gate_mlp_t * self.ff_t(c) + encoder_hidden_states
    return hidden_states, encoder_hidden_states


def _why_not_hidream(block) -> str | None:
    return ops.why_not_layer_norms((block.norm1_i, block.norm1_t, block.norm3_i, block.norm3_t)
                                   if hasattr(block, "norm1_t") else (block.norm1_i, block.norm3_i))


# ---------------------------------------------------------------- AuraFlow's blocks

def _auraflow_stream(norm2, ff, residual: torch.Tensor, gated_attention: torch.Tensor, scale: torch.Tensor,
                     shift: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """AuraFlow's second half of a stream: ``norm2`` of ``residual`` plus the gated attention,
    modulated (one fused op), through the feed-forward, gated and added to ``residual`` (the
    block's input: AuraFlow keeps no residual after the attention)."""
    h = ops.modulated(norm2, residual + gated_attention, scale, shift)
    return residual + gate.unsqueeze(1) * ff(h)


def _auraflow_single_block(self, hidden_states: torch.Tensor, temb: torch.Tensor,
                           attention_kwargs: dict | None = None) -> torch.Tensor:
    """``AuraFlowSingleTransformerBlock.forward``: ``hidden_states [B, S, D]`` -> ``[B, S, D]``."""
    if not ops.fusable(self.norm2):
        return self._cudnorm_unpatched.forward(self, hidden_states, temb, attention_kwargs=attention_kwargs)
    h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    attn_output = self.attn(hidden_states=h, **(attention_kwargs or {}))
    return _auraflow_stream(self.norm2, self.ff, hidden_states, gate_msa.unsqueeze(1) * attn_output, scale_mlp,
                            shift_mlp, gate_mlp)


def _auraflow_joint_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                          attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``AuraFlowJointTransformerBlock.forward``: image tokens ``hidden_states [B, S, D]`` and text
    tokens ``encoder_hidden_states [B, T, D]`` -> ``(encoder_hidden_states, hidden_states)``."""
    if not ops.fusable(self.norm2, self.norm2_context):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb,
                                               attention_kwargs=attention_kwargs)
    h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(encoder_hidden_states, emb=temb)
    attn_output, context_attn_output = self.attn(hidden_states=h, encoder_hidden_states=c, **(attention_kwargs or {}))
    hidden_states_out = _auraflow_stream(self.norm2, self.ff, hidden_states, gate_msa.unsqueeze(1) * attn_output,
                                         scale_mlp, shift_mlp, gate_mlp)
    encoder_out = _auraflow_stream(self.norm2_context, self.ff_context, encoder_hidden_states,
                                   c_gate_msa.unsqueeze(1) * context_attn_output, c_scale_mlp, c_shift_mlp, c_gate_mlp)
    return encoder_out, hidden_states_out


def _why_not_auraflow(block) -> str | None:
    return ops.why_not_layer_norms((block.norm2, block.norm2_context) if hasattr(block, "norm2_context")
                                   else (block.norm2,))


# ---------------------------------------------------------------- LTXVideoTransformerBlock (LTX-Video)

def _ltx_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
               image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
               encoder_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``LTXVideoTransformerBlock.forward``: video tokens ``hidden_states [B, S, D]`` -> ``[B, S,
    D]``; ``norm1`` and ``norm2`` (weightless RMSNorms) with the modulation of
    ``scale_shift_table`` plus ``temb [B, T, 6 * D]`` (``T`` 1: per sample)."""
    if not ops.fusable_rms(self.norm1, self.norm2):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb,
                                               image_rotary_emb=image_rotary_emb,
                                               encoder_attention_mask=encoder_attention_mask)
    sets = self.scale_shift_table.shape[0]
    ada_values = self.scale_shift_table[None, None].to(temb.device) + temb.reshape(
        hidden_states.size(0), temb.size(1), sets, -1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada_values.unbind(dim=2)
    h = ops.rms_modulated(self.norm1, hidden_states, scale_msa, shift_msa)
    hidden_states = hidden_states + self.attn1(hidden_states=h, encoder_hidden_states=None,
                                               image_rotary_emb=image_rotary_emb) * gate_msa
    hidden_states = hidden_states + self.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                               image_rotary_emb=None, attention_mask=encoder_attention_mask)
    h = ops.rms_modulated(self.norm2, hidden_states, scale_mlp, shift_mlp)
    return hidden_states + self.ff(h) * gate_mlp


def _why_not_ltx(block) -> str | None:
    return ops.why_not_weightless_rms_norms((block.norm1, block.norm2))


# ---------------------------------------------------------------- WanTransformerBlock (Wan, ChronoEdit), SkyReels-V2's

def _wan_body(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
              rotary_emb: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The body of Wan's block for a per-sample modulation (``temb [B, 6, D]``): Wan computes each
    modulated norm in fp32 and rounds it once to the stream's dtype, ``(norm(x.float()) * (1 +
    scale) + shift).type_as(x)``, the modulation ``scale_shift_table`` plus ``temb`` in fp32 (chunks
    ``[B, 1, D]``); here ``norm1`` and ``norm3`` with theirs are one fp32
    :func:`cudnorm.ada_layer_norm` each, the same arithmetic."""
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
        self.scale_shift_table + temb.float()).chunk(6, dim=1)
    h = ops.modulated(self.norm1, hidden_states.float(), scale_msa, shift_msa).type_as(hidden_states)
    attn_output = self.attn1(h, None, attention_mask, rotary_emb)
    hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)
    h = self.norm2(hidden_states.float()).type_as(hidden_states)
    hidden_states = hidden_states + self.attn2(h, encoder_hidden_states, None, None)
    h = ops.modulated(self.norm3, hidden_states.float(), c_scale_msa, c_shift_msa).type_as(hidden_states)
    ff_output = self.ffn(h)
    return (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)


def _wan_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
               rotary_emb: torch.Tensor) -> torch.Tensor:
    """``WanTransformerBlock.forward``: video tokens ``hidden_states [B, S, D]`` -> ``[B, S, D]``
    (:func:`_wan_body`). A modulation per token (Wan 2.2 TI2V's ``temb [B, S, 6, D]``) runs the
    block's own forward."""
    if temb.ndim != 3 or not ops.fusable(self.norm1, self.norm3):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb)
    return _wan_body(self, hidden_states, encoder_hidden_states, temb, rotary_emb, None)


def _skyreels_v2_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                       rotary_emb: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``SkyReelsV2TransformerBlock.forward``: Wan's block with a self-attention mask
    (:func:`_wan_body`). A modulation per frame token (Diffusion Forcing's ``temb [B, 6, S, D]``)
    runs the block's own forward."""
    if temb.ndim != 3 or not ops.fusable(self.norm1, self.norm3):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb,
                                               attention_mask)
    return _wan_body(self, hidden_states, encoder_hidden_states, temb, rotary_emb, attention_mask)


def _why_not_wan(block) -> str | None:
    return ops.why_not_layer_norms((block.norm1, block.norm3))


# ---------------------------------------------------------------- HunyuanVideo's and HunyuanImage's blocks

def _hunyuan_streams(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                     attention_mask: torch.Tensor | None, rotary_emb) -> tuple[torch.Tensor, torch.Tensor]:
    """Flux's double-stream body as HunyuanVideo's and HunyuanImage's blocks write it: video (or
    image) tokens ``hidden_states [B, S, D]`` and text tokens ``encoder_hidden_states [B, T, D]``
    -> ``(hidden_states, encoder_hidden_states)``; each stream's AdaLN (``norm1``,
    ``norm1_context``), the joint attention, then each stream's gated residual add, ``norm2`` and
    its modulation as one op (:func:`cudnorm._diffusers_block_ops.gated_modulated`)."""
    h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(encoder_hidden_states, emb=temb)
    attn_output, context_attn_output = self.attn(hidden_states=h, encoder_hidden_states=c,
                                                 attention_mask=attention_mask, image_rotary_emb=rotary_emb)
    h, hidden_states = ops.gated_modulated(self.norm2, hidden_states, gate_msa, attn_output, scale_mlp, shift_mlp)
    c, encoder_hidden_states = ops.gated_modulated(self.norm2_context, encoder_hidden_states, c_gate_msa,
                                                   context_attn_output, c_scale_mlp, c_shift_mlp)
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(h)
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * self.ff_context(c)
    return hidden_states, encoder_hidden_states


def _hunyuan_video_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                         attention_mask: torch.Tensor | None = None, freqs_cis=None, *args,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``HunyuanVideoTransformerBlock.forward`` (:func:`_hunyuan_streams`)."""
    if not ops.fusable(self.norm2, self.norm2_context):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb, attention_mask,
                                               freqs_cis, *args, **kwargs)
    return _hunyuan_streams(self, hidden_states, encoder_hidden_states, temb, attention_mask, freqs_cis)


def _hunyuan_image_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                         attention_mask: torch.Tensor | None = None, image_rotary_emb=None, *args,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``HunyuanImageTransformerBlock.forward`` (:func:`_hunyuan_streams`)."""
    if not ops.fusable(self.norm2, self.norm2_context):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb, attention_mask,
                                               image_rotary_emb, *args, **kwargs)
    return _hunyuan_streams(self, hidden_states, encoder_hidden_states, temb, attention_mask, image_rotary_emb)


def _why_not_hunyuan(block) -> str | None:
    return ops.why_not_layer_norms((block.norm2, block.norm2_context))


# ---------------------------------------------------------------- CogView4TransformerBlock (CogView4)

def _cogview4_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                    temb: torch.Tensor | None = None, image_rotary_emb=None, attention_mask=None,
                    attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``CogView4TransformerBlock.forward``: image tokens ``hidden_states [B, S, D]`` and text
    tokens ``encoder_hidden_states [B, T, D]`` -> ``(hidden_states, encoder_hidden_states)``; one
    AdaLN module (``norm1``) for both streams, the joint attention, then each stream's gated
    residual add, ``norm2``/``norm2_context`` and its modulation as one op
    (:func:`cudnorm._diffusers_block_ops.gated_modulated`); one feed-forward for both streams."""
    if not ops.fusable(self.norm2, self.norm2_context):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                               attention_mask, attention_kwargs)
    (h, gate_msa, shift_mlp, scale_mlp, gate_mlp,
     c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp) = self.norm1(hidden_states, encoder_hidden_states, temb)
    attn_output, context_attn_output = self.attn1(hidden_states=h, encoder_hidden_states=c,
                                                  image_rotary_emb=image_rotary_emb, attention_mask=attention_mask,
                                                  **(attention_kwargs or {}))
    h, hidden_states = ops.gated_modulated(self.norm2, hidden_states, gate_msa, attn_output, scale_mlp, shift_mlp)
    c, encoder_hidden_states = ops.gated_modulated(self.norm2_context, encoder_hidden_states, c_gate_msa,
                                                   context_attn_output, c_scale_mlp, c_shift_mlp)
    hidden_states = hidden_states + self.ff(h) * gate_mlp.unsqueeze(1)
    encoder_hidden_states = encoder_hidden_states + self.ff(c) * c_gate_mlp.unsqueeze(1)
    return hidden_states, encoder_hidden_states


def _why_not_cogview4(block) -> str | None:
    return ops.why_not_layer_norms((block.norm2, block.norm2_context))


# ---------------------------------------------------------------- FLUX.3's blocks (modulated per token)

def _flux3_block(self, hidden_states: torch.Tensor, temb_mod: torch.Tensor,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``Flux3TransformerBlock.forward`` (a token mode's own blocks): ``hidden_states [B, S, D]``,
    ``temb_mod [B, S, 3 * D]`` (shift, scale, gate per token); the norm and its per-token
    modulation one op (:func:`cudnorm.ada_layer_norm`'s per-token path)."""
    if not ops.fusable(self.norm):
        return self._cudnorm_unpatched.forward(self, hidden_states, temb_mod, image_rotary_emb)
    mod_shift, mod_scale, mod_gate = torch.chunk(temb_mod, 3, dim=-1)
    h = ops.modulated(self.norm, hidden_states, mod_scale, mod_shift)
    attn_output = self.attn(hidden_states=h, image_rotary_emb=image_rotary_emb)
    return hidden_states + mod_gate * (attn_output + self.ff(h))


def _flux3_single_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                        temb_mod: torch.Tensor, temb_mod_context: torch.Tensor,
                        image_rotary_emb: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``Flux3SingleTransformerBlock.forward``: content ``hidden_states [B, S, D]`` and text
    ``encoder_hidden_states [B, T, D]``, each with its per-token modulation, one shared norm ->
    ``(encoder_hidden_states, hidden_states)``; each stream's modulated norm one op."""
    if not ops.fusable(self.norm):
        return self._cudnorm_unpatched.forward(self, hidden_states, encoder_hidden_states, temb_mod, temb_mod_context,
                                               image_rotary_emb)
    mod_shift, mod_scale, mod_gate = torch.chunk(temb_mod, 3, dim=-1)
    c_mod_shift, c_mod_scale, c_mod_gate = torch.chunk(temb_mod_context, 3, dim=-1)
    h = ops.modulated(self.norm, hidden_states, mod_scale, mod_shift)
    c = ops.modulated(self.norm, encoder_hidden_states, c_mod_scale, c_mod_shift)
    combined = torch.cat([c, h], dim=1)
    output = self.attn(hidden_states=combined, image_rotary_emb=image_rotary_emb) + self.ff(combined)
    context_output, content_output = torch.split(
        output, [encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
    return encoder_hidden_states + c_mod_gate * context_output, hidden_states + mod_gate * content_output


def _why_not_flux3(block) -> str | None:
    return ops.why_not_layer_norms((block.norm,))
