"""Per-class tables of ``diffusers-all`` (:mod:`.diffusers_all`) for the classes its generic rules
cannot build or feed: the published config values a class's defaults lack (:data:`CONFIGS`,
each with where it comes from), what shrinking to one layer per kind must keep consistent
(:data:`AFTER_SHRINK`) and the forward arguments only that class reads (:data:`INPUTS`).

An input maker takes an :class:`Inputs` (the step's sizes and a ``randn``) and returns keyword
arguments that replace or add to the generic ones. Sizes follow the module docstring of
:mod:`.diffusers_all`; text lengths a model's positional tables fix (HunyuanDiT's 77 + 256) are
kept at every width.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import diffusers_inputs_av
from .diffusers_step import Inputs

# ------------------------------------------------------------------------------ configs

#: published config values that replace a class's ``__init__`` defaults before depth shrinking
#: (where a default is None a class cannot be built; the others are where a default is not the
#: published checkpoint's width). Each names the checkpoint whose ``transformer/config.json`` it is.
CONFIGS: dict[str, dict[str, Any]] = {
    # Tencent-Hunyuan/HunyuanDiT-v1.2-Diffusers (the pipeline's docstring checkpoint): 1408 wide
    # (16 x 88), 40 layers, mlp_ratio 4.3637; v1.2 dropped the style / image-size conditions
    "HunyuanDiT2DModel": {"in_channels": 4, "patch_size": 2, "sample_size": 128, "hidden_size": 1408,
                          "mlp_ratio": 4.3637, "num_layers": 40, "use_style_cond_and_image_meta_size": False},
    # maxin-cn/Latte-1 (LattePipeline's docstring): PixArt-alpha's widths (16 x 72), T5-XXL captions
    "LatteTransformer3DModel": {"in_channels": 4, "out_channels": 8, "patch_size": 2, "sample_size": 64,
                                "attention_head_dim": 72, "num_layers": 28, "caption_channels": 4096,
                                "cross_attention_dim": 1152, "norm_type": "ada_norm_single",
                                "num_embeds_ada_norm": 1000, "activation_fn": "gelu-approximate",
                                "norm_elementwise_affine": False, "norm_eps": 1e-6},
    # Alpha-VLLM/Lumina-Next-SFT-diffusers (LuminaPipeline's docstring): 24 layers, 8 KV heads
    "LuminaNextDiT2DModel": {"num_layers": 24, "num_kv_heads": 8},
    # alibaba-pai/EasyAnimateV5.1-12b-zh (the model doc's checkpoint): 16-channel MagVIT latents,
    # 2 x 2 patches, Qwen2-VL-7B's 3584-wide text
    "EasyAnimateTransformer3DModel": {"in_channels": 16, "out_channels": 16, "patch_size": 2},
    # HiDream-ai/HiDream-I1-Full (the model doc's checkpoint): T5-XXL and Llama-3.1-8B captions
    # (4096 wide each), one Llama layer per block (layers 0-31, then 31 for the other 16)
    "HiDreamImageTransformer2DModel": {"patch_size": 2, "in_channels": 16, "out_channels": 16,
                                       "caption_channels": [4096, 4096], "axes_dims_rope": (64, 32, 32),
                                       "llama_layers": [*range(32), *[31] * 16]},
    # Shitao/OmniGen-v1-diffusers (OmniGenPipeline's docstring) is Phi-3's widths with its "su" rotary
    # scaling; the 48 per-frequency factors are left at 1 (plain RoPE: no width depends on them)
    "OmniGenTransformer2DModel": {"rope_scaling": {"short_factor": [1.0] * 48, "long_factor": [1.0] * 48}},
    # no checkpoint of its own: the temporal transformer UNet3DConditionModel puts first
    # (damo-vilab/text-to-video-ms-1.7b's transformer_in: 320 channels, 8 heads x 64)
    "TransformerTemporalModel": {"in_channels": 320, "num_attention_heads": 8, "attention_head_dim": 64},
    # no checkpoint of its own: a block of DreamLiteUNetModel, here its deepest (1280 channels) with the
    # UNet's defaults (2048-wide text, RMS q/k norms, ff_mult 6; not its one KV head,
    # which diffusers' attention processor does not pair with q/k norms) and SDXL's 20 heads x 64
    # (not a published config: the UNet's head count goes through legacy naming)
    "DreamLiteTransformer2DModel": {"in_channels": 1280, "num_attention_heads": 20, "attention_head_dim": 64,
                                    "cross_attention_dim": 2048, "qk_norm": "rms_norm", "ff_mult": 6},
    # kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers (the pipeline's docstring): HunyuanVideo's
    # 16-channel latents with the image condition and its mask concatenated (visual_cond), 1792 wide
    "Kandinsky5Transformer3DModel": {"in_visual_dim": 16, "out_visual_dim": 16, "model_dim": 1792,
                                     "ff_dim": 7168, "visual_cond": True},
    # lllyasviel/FramePackI2V_HY (the pipeline's docstring): SigLIP image tokens and the clean-latent embedder
    "HunyuanVideoFramepackTransformer3DModel": {"has_image_proj": True, "has_clean_x_embedder": True},
    # PixArt-alpha/PixArt-XL-2-1024-MS, whose transformer was a Transformer2DModel before
    # PixArtTransformer2DModel existed
    "Transformer2DModel": {"in_channels": 4, "out_channels": 8, "patch_size": 2, "sample_size": 128,
                           "attention_head_dim": 72, "num_layers": 28, "caption_channels": 4096,
                           "cross_attention_dim": 1152, "norm_type": "ada_norm_single",
                           "num_embeds_ada_norm": 1000, "activation_fn": "gelu-approximate",
                           "norm_elementwise_affine": False, "norm_eps": 1e-6, "attention_bias": True},
}


def _hidream_layers(config: dict) -> dict:
    # one Llama layer per block: the published list's entries for the blocks kept (double, then single)
    layers = CONFIGS["HiDreamImageTransformer2DModel"]["llama_layers"]
    double, single = config["num_layers"], config["num_single_layers"]
    return {"llama_layers": layers[:double] + layers[16:16 + single]}


#: ``config -> changes`` run after depth shrinking, for fields that count layers
AFTER_SHRINK: dict[str, Callable[[dict], dict]] = {"HiDreamImageTransformer2DModel": _hidream_layers,
                                                 **diffusers_inputs_av.AFTER_SHRINK}


def configure(name: str, config: dict) -> dict:
    """``config`` (a class's defaults) with :data:`CONFIGS`' published values."""
    return {**config, **CONFIGS.get(name, {})}


def after_shrink(name: str, config: dict) -> dict:
    """``config`` after depth shrinking, with :data:`AFTER_SHRINK`'s changes."""
    if name in AFTER_SHRINK:
        config = {**config, **AFTER_SHRINK[name](config)}
    return config


# ------------------------------------------------------------------------------ inputs

#: classes whose latent the rules of ``diffusers_all._layout`` get wrong: video latents frames
#: first, ``[B, F, C, H, W]``; HiDream takes img_ids but patchifies a ``[B, C, H, W]`` latent itself;
#: Krea 2 takes packed latents
LAYOUT = {"CogVideoXTransformer3DModel": "frames-first", "ConsisIDTransformer3DModel": "frames-first",
          "HiDreamImageTransformer2DModel": "image", "Krea2Transformer2DModel": "packed", **diffusers_inputs_av.LAYOUT}

#: the argument that is a class's latent where it is not its forward's first (see diffusers_inputs_av)
LATENT_ARG = diffusers_inputs_av.LATENT_ARG

#: classes whose text mask is not a float one: Lumina 2 counts its tokens (.sum().tolist()) to size tensors
MASK_DTYPES = {"Lumina2Transformer2DModel": torch.bool}

def _hunyuan_dit(c: Inputs) -> dict:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed  # noqa: PLC0415

    cfg, b = c.config, c.batch
    grid = c.side // cfg["patch_size"]
    # the pipeline's rotary table (a 512 px base grid, here the whole latent)
    rope = get_2d_rotary_pos_embed(cfg["hidden_size"] // cfg["num_attention_heads"], ((0, 0), (grid, grid)),
                                   (grid, grid), device=c.device, output_type="pt")
    # CLIP (77 tokens) and mT5 (256) captions: text_embedding_padding spans exactly these lengths
    return {"encoder_hidden_states": c.randn(b, cfg["text_len"], cfg["cross_attention_dim"]),
            "text_embedding_mask": c.ones(b, cfg["text_len"]),
            "encoder_hidden_states_t5": c.randn(b, cfg["text_len_t5"], cfg["cross_attention_dim_t5"]),
            "text_embedding_mask_t5": c.ones(b, cfg["text_len_t5"]),
            "image_meta_size": c.ones(b, 6) * c.side * 8, "style": c.zeros(b, dtype=torch.long),
            "image_rotary_emb": rope}  # float32 as the pipeline's (the model applies it in float32)


def _lumina_next(c: Inputs) -> dict:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina  # noqa: PLC0415

    cfg = c.config
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    # the pipeline's table: 384 x 384 patches, sliced by the model to the latent's grid
    rope = get_2d_rotary_pos_embed_lumina(head_dim, 384, 384).to(c.device)
    # cross_attention_kwargs: its blocks unpack it (** of None fails)
    return {"encoder_mask": c.ones(c.batch, c.text), "image_rotary_emb": rope, "cross_attention_kwargs": {}}


def _hidream(c: Inputs) -> dict:
    cfg, b = c.config, c.batch
    t5, llama = cfg["caption_channels"]
    # Llama-3.1's hidden states, one per layer a block reads: [layers, B, tokens, 4096]
    return {"timesteps": c.timestep(), "encoder_hidden_states_t5": c.randn(b, c.text, t5),
            "encoder_hidden_states_llama3": c.randn(max(cfg["llama_layers"]) + 1, b, c.text, llama),
            "pooled_embeds": c.randn(b, cfg["text_emb_dim"])}


def _omnigen(c: Inputs) -> dict:
    b, p = c.batch, c.config["patch_size"]
    # a text-only prompt: its tokens, the time token, then the image's
    seq = c.text + 1 + (c.side // p) ** 2
    ids = torch.randint(0, c.config["vocab_size"], (b, c.text), generator=c.gen, device=c.device)
    return {"input_ids": ids, "input_img_latents": [], "input_image_sizes": {},
            "attention_mask": c.ones(b, seq, seq),
            "position_ids": torch.arange(seq, device=c.device).expand(b, seq)}


def _temporal(c: Inputs) -> dict:
    # a UNet's feature map, frames folded into the batch: [B * F, C, H, W]
    return {"hidden_states": c.randn(c.batch * c.frames, c.config["in_channels"], c.side, c.side),
            "num_frames": c.frames, "encoder_hidden_states": None}  # UNet3D's transformer_in: self-attention only


def _kandinsky5(c: Inputs) -> dict:
    cfg, p = c.config, c.config["patch_size"][-1]
    # channels last: [B, F, H, W, C + C + 1] (latent, image condition, its mask; zeros for text-to-video)
    latent = c.randn(c.batch, c.frames, c.side, c.side, 2 * cfg["in_visual_dim"] + 1)
    rope = [torch.arange(n, device=c.device) for n in (c.frames, c.side // p, c.side // p)]
    return {"hidden_states": latent, "visual_rope_pos": rope, "text_rope_pos": torch.arange(c.text, device=c.device),
            "pooled_projections": c.randn(c.batch, cfg["in_text_dim2"])}


def _hunyuan_video15(c: Inputs) -> dict:
    cfg, b = c.config, c.batch
    # ByT5 glyph text beside the Qwen text, and SigLIP's 729 image tokens: zeros, as the pipeline's text-to-video
    return {"encoder_hidden_states_2": c.randn(b, c.text, cfg["text_embed_2_dim"]),
            "encoder_attention_mask_2": c.ones(b, c.text),
            "image_embeds": c.zeros(b, 729, cfg["image_embed_dim"])}


def _framepack(c: Inputs) -> dict:
    # SigLIP's 729 image tokens; the pipeline's history at the latent's size: the start frame and 1 clean
    # frame, 2 frames at 2x and 16 at 4x downsampling; the frame index of each (1-D: a meshgrid's axis)
    b, ch, f = c.batch, c.config["in_channels"], c.frames
    # (latents, their indices' argument, frames)
    history = (("latents_clean", "indices_latents_clean", 2), ("latents_history_2x", "indices_latents_history_2x", 2),
               ("latents_history_4x", "indices_latents_history_4x", 16))
    made = {"image_embeds": c.randn(b, 729, c.config["image_proj_dim"]),
            "indices_latents": torch.arange(f, device=c.device)}
    start = f
    for latents, indices, n in history:
        made[latents] = c.randn(b, ch, n, c.side, c.side)
        made[indices] = torch.arange(start, start + n, device=c.device)
        start += n
    return made


def _cosmos(c: Inputs) -> dict:
    # the pipeline's padding mask (none padded) and frame rate; the model resizes the mask with torchvision
    return {"padding_mask": c.zeros(1, 1, c.side * 8, c.side * 8), "fps": 30}


def _wan_vace(c: Inputs) -> dict:
    # the control video (masked frames, mask and reference: vace_in_channels) at the latent's size
    return {"control_hidden_states": c.randn(c.batch, c.config["vace_in_channels"], c.frames, c.side, c.side)}


def _glm_image(c: Inputs) -> dict:
    # one prior (AR-generated) token per patch, none dropped (the conditional pass)
    b, n = c.batch, (c.side // c.config["patch_size"]) ** 2
    ids = torch.randint(0, c.config["prior_vq_quantizer_codebook_size"], (b, n), generator=c.gen, device=c.device)
    return {"prior_token_id": ids, "prior_token_drop": torch.zeros(b, n, dtype=torch.bool, device=c.device)}


def _ltx_video(c: Inputs) -> dict:
    cfg = c.config
    # packed [B, F * H * W, C] (patch size 1) and the grid it came from; the pipeline's rope scale: the VAE's
    # compression (8 frames, 32 px) over a 25 fps frame rate
    return {"hidden_states": c.randn(c.batch, c.frames * c.side * c.side, cfg["in_channels"]),
            "num_frames": c.frames, "height": c.side, "width": c.side, "rope_interpolation_scale": (8 / 25, 32, 32)}


def _qwen_image21(c: Inputs) -> dict:
    # the vision-language sequence: the prompt's tokens, then one slot per 2 x 2 target tokens (the
    # pipeline's append_target_slots for text-to-image)
    slots = c.side * c.side // 4
    mask = torch.cat([torch.zeros(c.batch, c.text, dtype=torch.bool, device=c.device),
                      torch.ones(c.batch, slots, dtype=torch.bool, device=c.device)], dim=1)
    return {"img_mask": mask}


def _ernie_image(c: Inputs) -> dict:
    # the text encoder's states and each prompt's length (all tokens used)
    return {"text_bth": c.randn(c.batch, c.text, c.config["text_in_dim"]),
            "text_lens": torch.full((c.batch,), c.text, dtype=torch.long, device=c.device)}


def _z_image(c: Inputs) -> dict:
    return {"cap_feats": c.randn(c.batch, c.text, c.config["cap_feat_dim"])}  # split per sample by _PerSample


def _krea2(c: Inputs) -> dict:
    cfg, b, side = c.config, c.batch, c.side
    # packed latents [B, side * side, C]; the text encoder's hidden states tapped at num_text_layers layers
    # [B, L, layers, D]; rotary (t, h, w) coordinates of [text; image] tokens, text rows zero, image rows
    # the latent grid; the flow-matching time in [0, 1]
    h, w = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    image = torch.stack([torch.zeros_like(h), h, w], -1).reshape(-1, 3)
    ids = torch.cat([torch.zeros(c.text, 3, dtype=image.dtype), image]).to(c.device)
    return {"hidden_states": c.randn(b, side * side, cfg["in_channels"]),
            "encoder_hidden_states": c.randn(b, c.text, cfg["num_text_layers"], cfg["text_hidden_dim"]),
            "timestep": c.timestep() / 999, "position_ids": ids}


#: ``Inputs -> kwargs`` of the classes whose forward reads what the generic rules cannot make
INPUTS: dict[str, Callable[[Inputs], dict]] = {
    "HunyuanDiT2DModel": _hunyuan_dit,
    "LuminaNextDiT2DModel": _lumina_next,
    "HiDreamImageTransformer2DModel": _hidream,
    "OmniGenTransformer2DModel": _omnigen,
    "TransformerTemporalModel": _temporal,
    "Kandinsky5Transformer3DModel": _kandinsky5,
    "HunyuanVideo15Transformer3DModel": _hunyuan_video15,
    "HunyuanVideoFramepackTransformer3DModel": _framepack,
    "CosmosTransformer3DModel": _cosmos,
    "WanVACETransformer3DModel": _wan_vace,
    "GlmImageTransformer2DModel": _glm_image,
    "LTXVideoTransformer3DModel": _ltx_video,
    "QwenImage21Transformer2DModel": _qwen_image21,
    "ErnieImageTransformer2DModel": _ernie_image,
    "ZImageTransformer2DModel": _z_image,
    "Krea2Transformer2DModel": _krea2,
    **diffusers_inputs_av.INPUTS,
}


class _PerSample(torch.nn.Module):
    """Z-Image's forward takes a list of ``[C, 1, H, W]`` latents and one of ``[L, D]`` captions (one per
    sample) and returns a list: this takes the batch's tensors, splits them as the pipeline does and
    stacks the outputs, so the bench can hand it a latent and take its gradient."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, t: torch.Tensor, cap_feats: torch.Tensor, **kwargs):
        out = self.model(list(x.unsqueeze(2).unbind(0)), t, list(cap_feats.unbind(0)), return_dict=False, **kwargs)[0]
        return torch.stack(out).squeeze(2)


#: classes built inside an adapter module (see each)
WRAPPERS: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {"ZImageTransformer2DModel": _PerSample,
                                                                 **diffusers_inputs_av.WRAPPERS}


def build(cls: type, config: dict) -> torch.nn.Module:
    """``cls(**config)``, inside its adapter where :data:`WRAPPERS` has one."""
    model = cls(**config)
    return WRAPPERS[cls.__name__](model) if cls.__name__ in WRAPPERS else model
