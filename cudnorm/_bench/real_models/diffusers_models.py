"""diffusers' DiT, PixArt-alpha, SD3.5 and Flux.1 transformers at their published widths.

Each config is the ``transformer/config.json`` of the model's Hub repository (named above it)
with ``num_layers`` cut to the bench's default depth; ``full`` restores the published depth.
Inputs are what the pipeline hands the transformer at the stated resolution: latents
(1/8 of the image side), timesteps, and text-encoder states of the pipeline's length.
diffusers is imported when a model is built, never by ``import cudnorm``.
"""

from __future__ import annotations

import torch

from .spec import RealModel


def _randn(gen, device, dtype, *shape) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=dtype)


def _labels(gen, device, batch: int, high: int) -> torch.Tensor:
    return torch.randint(0, high, (batch,), generator=gen, device=device)


def _sample(result) -> torch.Tensor:
    return result.sample


def _patches(config: dict) -> int:
    return (config["sample_size"] // config["patch_size"]) ** 2


def _inner(config: dict) -> int:
    return config["num_attention_heads"] * config["attention_head_dim"]


# ------------------------------------------------------------------------------ DiT-XL/2

def _dit(config: dict) -> torch.nn.Module:
    from diffusers import DiTTransformer2DModel  # noqa: PLC0415

    return DiTTransformer2DModel(**config)


def _dit_inputs(config: dict, batch: int, device: str, dtype: torch.dtype, gen) -> dict:
    size = config["sample_size"]
    return {"hidden_states": _randn(gen, device, dtype, batch, config["in_channels"], size, size),
            "timestep": _labels(gen, device, batch, 1000),
            "class_labels": _labels(gen, device, batch, config["num_embeds_ada_norm"])}


# facebook/DiT-XL-2-256: 256 px -> 32 x 32 latents, 2 x 2 patches: 256 tokens
DIT = RealModel(
    name="diffusers-dit-xl-2", library="diffusers", title="diffusers DiT-XL/2 (DiTTransformer2DModel), 256 px",
    build=_dit,
    config=dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=12,
                sample_size=32, patch_size=2, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                norm_type="ada_norm_zero", norm_elementwise_affine=False, attention_bias=True),
    toy=dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
             sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_type="ada_norm_zero",
             norm_elementwise_affine=False),
    full=dict(num_layers=28), inputs=_dit_inputs, output=_sample, batch=32, toy_batch=2, tokens=_patches,
    width=_inner)


# ------------------------------------------------------------------------------ PixArt-alpha

def _pixart(config: dict) -> torch.nn.Module:
    from diffusers import PixArtTransformer2DModel  # noqa: PLC0415

    return PixArtTransformer2DModel(**{k: v for k, v in config.items() if k != "text_tokens"})


def _pixart_inputs(config: dict, batch: int, device: str, dtype: torch.dtype, gen) -> dict:
    size, text = config["sample_size"], config["text_tokens"]
    return {"hidden_states": _randn(gen, device, dtype, batch, config["in_channels"], size, size),
            "encoder_hidden_states": _randn(gen, device, dtype, batch, text, config["caption_channels"]),
            "timestep": _labels(gen, device, batch, 1000),
            # the pipeline passes the T5 prompt's mask (all ones for a prompt of 120 tokens)
            "encoder_attention_mask": torch.ones(batch, text, device=device, dtype=dtype),
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}


# PixArt-alpha/PixArt-XL-2-512x512: 512 px -> 64 x 64 latents: 1024 tokens; T5 prompt of 120 tokens
PIXART = RealModel(
    name="diffusers-pixart-alpha", library="diffusers",
    title="diffusers PixArt-alpha (PixArtTransformer2DModel), 512 px", build=_pixart,
    config=dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=12,
                cross_attention_dim=1152, caption_channels=4096, sample_size=64, patch_size=2,
                activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                norm_elementwise_affine=False, norm_eps=1e-6, attention_bias=True, use_additional_conditions=False,
                text_tokens=120),
    toy=dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
             cross_attention_dim=16, caption_channels=24, sample_size=8, patch_size=2, norm_type="ada_norm_single",
             norm_elementwise_affine=False, norm_eps=1e-6, use_additional_conditions=False, text_tokens=6),
    full=dict(num_layers=28), inputs=_pixart_inputs, output=_sample, batch=8, toy_batch=2, tokens=_patches,
    width=_inner)


# ------------------------------------------------------------------------------ SD3.5-medium

def _sd3(config: dict) -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel  # noqa: PLC0415

    return SD3Transformer2DModel(**{k: v for k, v in config.items() if k != "text_tokens"})


def _sd3_inputs(config: dict, batch: int, device: str, dtype: torch.dtype, gen) -> dict:
    size = config["sample_size"]
    return {"hidden_states": _randn(gen, device, dtype, batch, config["in_channels"], size, size),
            "encoder_hidden_states": _randn(gen, device, dtype, batch, config["text_tokens"],
                                            config["joint_attention_dim"]),
            "pooled_projections": _randn(gen, device, dtype, batch, config["pooled_projection_dim"]),
            # flow-matching timesteps in [0, 1000), as the pipeline's scheduler gives them
            "timestep": torch.rand(batch, generator=gen, device=device, dtype=dtype) * 1000}


# stabilityai/stable-diffusion-3.5-medium: 1024 px -> 128 x 128 latents: 4096 tokens; prompt of
# 77 CLIP + 256 T5 tokens (the pipeline's max_sequence_length); dual attention in layers 0-12
SD35 = RealModel(
    name="diffusers-sd3.5-medium", library="diffusers",
    title="diffusers SD3.5-medium (SD3Transformer2DModel; qk RMSNorm, dual attention), 1024 px", build=_sd3,
    config=dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=8, attention_head_dim=64,
                num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                pooled_projection_dim=2048, pos_embed_max_size=384, dual_attention_layers=tuple(range(8)),
                qk_norm="rms_norm", text_tokens=333),
    toy=dict(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
             num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=16, pooled_projection_dim=12,
             pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm", text_tokens=5),
    full=dict(num_layers=24, dual_attention_layers=tuple(range(13))), inputs=_sd3_inputs, output=_sample, batch=2,
    toy_batch=1, tokens=lambda c: _patches(c) + c["text_tokens"], width=_inner)


# ------------------------------------------------------------------------------ Flux.1-dev

def _flux(config: dict) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel  # noqa: PLC0415

    return FluxTransformer2DModel(**{k: v for k, v in config.items() if k not in ("image_side", "text_tokens")})


def _flux_inputs(config: dict, batch: int, device: str, dtype: torch.dtype, gen) -> dict:
    side, text = config["image_side"], config["text_tokens"]
    img_ids = torch.zeros(side, side, 3, device=device, dtype=dtype)  # (0, row, column) of each packed latent
    img_ids[..., 1] = torch.arange(side, device=device)[:, None]
    img_ids[..., 2] = torch.arange(side, device=device)[None, :]
    return {"hidden_states": _randn(gen, device, dtype, batch, side * side, config["in_channels"]),
            "encoder_hidden_states": _randn(gen, device, dtype, batch, text, config["joint_attention_dim"]),
            "pooled_projections": _randn(gen, device, dtype, batch, config["pooled_projection_dim"]),
            "timestep": torch.rand(batch, generator=gen, device=device, dtype=dtype),
            "img_ids": img_ids.flatten(0, 1), "txt_ids": torch.zeros(text, 3, device=device, dtype=dtype),
            "guidance": torch.full((batch,), 3.5, device=device, dtype=dtype)}


FLUX_SDPA = ("torch 2.11 + cuDNN 9.19: the unpatched Flux.1-width training step fails in cuDNN SDPA's backward "
             "(CUBLAS_STATUS_EXECUTION_FAILED; with CUDA_LAUNCH_BLOCKING=1 'mha_graph.execute ... is_good()')")

# black-forest-labs/FLUX.1-dev: 1024 px -> 128 x 128 latents packed 2 x 2 into 64 channels: 4096
# tokens; T5 prompt of 512 tokens. Guidance-distilled: the pipeline runs the prompt batch alone
# (no negative-prompt half), so sampling runs B 1, not 2
FLUX = RealModel(
    name="diffusers-flux.1-dev", library="diffusers", title="diffusers Flux.1-dev (FluxTransformer2DModel), 1024 px",
    build=_flux,
    config=dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=6, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56), image_side=64, text_tokens=512),
    toy=dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=True,
             axes_dims_rope=(4, 6, 6), image_side=4, text_tokens=6),
    full=dict(num_layers=19, num_single_layers=38), inputs=_flux_inputs, output=_sample, batch=1, toy_batch=1,
    tokens=lambda c: c["image_side"] ** 2 + c["text_tokens"], width=_inner, cfg=False, cudnn_sdpa_off=FLUX_SDPA)

MODELS = (DIT, PIXART, SD35, FLUX)
