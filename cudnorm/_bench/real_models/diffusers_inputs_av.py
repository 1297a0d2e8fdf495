"""Per-class tables of ``diffusers-all``, second part: the classes whose forward reads more than one
modality (audio beside video, poses, faces, references) or a sequence layout of its own. Same tables
as :mod:`.diffusers_inputs` (which merges these into its own): changes after depth shrinking
(:data:`AFTER_SHRINK`) and input makers (:data:`INPUTS`, an :class:`~.diffusers_step.Inputs` to
keyword arguments)."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .diffusers_step import Inputs

# ------------------------------------------------------------------------------ configs

def _wan_animate_face(config: dict) -> dict:
    # a face adapter follows every 5th block, counting from block 0: the one block kept has its adapter
    return {"inject_face_latents_blocks": config["num_layers"]}


def _bria_fibo2_injection(config: dict) -> dict:
    # one block of each kind: a plain one, then an injection block (its own cross-attention to the text)
    return {"n_layers": 2, "injection_layer_ids": (1,)}


#: ``config -> changes`` after depth shrinking (as :data:`.diffusers_inputs.AFTER_SHRINK`)
AFTER_SHRINK: dict[str, Callable[[dict], dict]] = {"WanAnimateTransformer3DModel": _wan_animate_face,
                                                   "BriaFibo2Transformer2DModel": _bria_fibo2_injection}


# ------------------------------------------------------------------------------ inputs

def _ltx2_video(c: Inputs) -> dict:
    cfg, b = c.config, c.batch
    # the pipeline's audio length: as many latent frames as the video's seconds hold (pixel frames at
    # 24 fps; audio latents per second: sampling rate / hop length / the audio VAE's 4x compression)
    pixel_frames = (c.frames - 1) * cfg["vae_scale_factors"][0] + 1
    per_second = cfg["audio_sampling_rate"] / cfg["audio_hop_length"] / cfg["audio_scale_factor"]
    audio = max(1, round(pixel_frames / 24 * per_second))
    # packed video [B, F * H * W, C] and audio [B, L, C * mel bins] (patch size 1); both prompts go through
    # the connectors at caption_channels; sigma as the pipeline passes (LTX-2.3 reads it)
    t = c.timestep()
    return {"hidden_states": c.randn(b, c.frames * c.side * c.side, cfg["in_channels"]),
            "audio_hidden_states": c.randn(b, audio, cfg["audio_in_channels"]),
            "encoder_hidden_states": c.randn(b, c.text, cfg["caption_channels"]),
            "audio_encoder_hidden_states": c.randn(b, c.text, cfg["caption_channels"]),
            "timestep": t, "sigma": t, "encoder_attention_mask": c.ones(b, c.text),
            "audio_encoder_attention_mask": c.ones(b, c.text), "num_frames": c.frames, "height": c.side,
            "width": c.side, "fps": 24.0, "audio_num_frames": audio}


def _wan_animate(c: Inputs) -> dict:
    cfg, b = c.config, c.batch
    # the latent's first frame is the reference image's: the pose latents cover the other T; the face
    # video is the segment's pixel frames ((T - 1) * 4 + 1, which the face encoder's two stride-2 convs
    # bring back to T) at the motion encoder's resolution; CLIP's 257 image tokens
    poses = max(1, c.frames - 1)
    face = c.config["motion_encoder_size"]
    return {"hidden_states": c.randn(b, cfg["in_channels"], poses + 1, c.side, c.side),
            "pose_hidden_states": c.randn(b, cfg["latent_channels"], poses, c.side, c.side),
            "face_pixel_values": c.randn(b, 3, (poses - 1) * 4 + 1, face, face),
            "encoder_hidden_states_image": c.randn(b, 257, cfg["image_dim"])}


def _wan_animate2(c: Inputs) -> dict:
    cfg, b = c.config, c.batch
    # the reference pass (kv_cache_mode "extract", dense attention; the denoising pass attends through a
    # flex BlockMask that runs compiled only): 16 latent channels and the 20 (latent, mask) of the condition
    # (in_dim = 2 * 16 + 4); umT5's 512-token table pads the text; CLIP's 257 image tokens
    p = cfg["patch_size"]
    grid = torch.tensor([[c.frames // p[0], c.side // p[1], c.side // p[2]]])
    latent = cfg["out_dim"]
    return {"hidden_states": c.randn(b, latent, c.frames, c.side, c.side), "timestep": c.timestep(),
            "encoder_hidden_states": c.randn(b, c.text, cfg["text_dim"]),
            "condition_latents": c.randn(b, cfg["in_dim"] - latent, c.frames, c.side, c.side),
            "kv_cache": None, "kv_cache_mode": "extract", "seq_len": int(grid.prod()),
            "encoder_hidden_states_image": c.randn(b, 257, 1280), "offset_grid_sizes": grid}


def _joyimage_edit_plus(c: Inputs) -> dict:
    cfg, b = c.config, c.batch
    pt, ph, pw = cfg["patch_size"]
    # already patchified, one [C, pt, ph, pw] patch per token: [B, patches, C, pt, ph, pw]; the target
    # image alone (no reference images: the per-sample component list holds its grid only)
    grid = (max(1, c.frames // pt), c.side // ph, c.side // pw)
    n = grid[0] * grid[1] * grid[2]
    return {"hidden_states": c.randn(b, n, cfg["in_channels"], pt, ph, pw),
            "encoder_hidden_states_mask": c.ones(b, c.text), "shape_list": [[grid]] * b}


def _anyflow(c: Inputs) -> dict:
    # frames first ([B, F, C, H, W]: LAYOUT); the flow map's source and target timesteps, one per frame;
    # r = t as the pipeline's when not using the mean velocity
    t = c.timestep()[:, None].expand(c.batch, c.frames)
    return {"timestep": t, "r_timestep": t}


def _anyflow_far(c: Inputs) -> dict:
    # one chunk holding every frame (the first chunk of the autoregressive rollout: no context, no KV cache)
    return {**_anyflow(c), "chunk_partition": [c.frames]}


def _prior(c: Inputs) -> dict:
    cfg, b = c.config, c.batch
    # unCLIP's prior denoises one CLIP image embedding per sample from the prompt's CLIP text embedding
    # and its num_embeddings (77) token states, which the positional table spans
    width, tokens = cfg["embedding_dim"], cfg["num_embeddings"]
    return {"hidden_states": c.randn(b, width), "proj_embedding": c.randn(b, cfg["embedding_proj_dim"] or width),
            "encoder_hidden_states": c.randn(b, tokens, width),
            "attention_mask": torch.ones(b, tokens, dtype=torch.bool, device=c.device)}


def _t5_film(c: Inputs) -> dict:
    cfg, b = c.config, c.batch
    # spectrogram diffusion's decoder: a targets_length-frame spectrogram segment, a noise time in [0, 1),
    # and the (encoding, mask) pairs of its two encoders (MIDI notes, previous segment), text-length each
    def encoded():
        return c.randn(b, c.text, cfg["d_model"]), torch.ones(b, c.text, dtype=torch.bool, device=c.device)

    return {"decoder_input_tokens": c.randn(b, cfg["targets_length"], cfg["input_dims"]),
            "decoder_noise_time": c.timestep() / 1000, "encodings_and_masks": [encoded(), encoded()]}


def _bria_fibo(c: Inputs) -> dict:
    cfg, b = c.config, c.batch
    # SmolLM3's hidden states (text_encoder_dim wide), one per block (double, then single), beside the
    # last two layers' concatenation the pipeline passes as encoder_hidden_states (joint_attention_dim)
    blocks = cfg["num_layers"] + cfg["num_single_layers"]
    return {"text_encoder_layers": [c.randn(b, c.text, cfg["text_encoder_dim"]) for _ in range(blocks)]}


def _bria_fibo2(c: Inputs) -> dict:
    cfg, b = c.config, c.batch
    # the text features: the Perceiver's bundle, then one per injection block kept; noise level in [0, 1]
    bundles = 1 + len(cfg["injection_layer_ids"])
    return {"timestep": c.timestep() / 1000, "encoder_hidden_states": c.randn(b, bundles, c.text, cfg["cap_feat_dim"])}


def _cosmos3_omni(c: Inputs) -> dict:
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (  # noqa: PLC0415
        get_3d_mrope_ids_text_tokens, get_3d_mrope_ids_vae_tokens)

    cfg, p = c.config, c.config["latent_patch_size"]
    # one packed sequence per sample, as the pipeline's text-to-video pass: the prompt's tokens (causal
    # prefix), then the video's patches, every frame noisy; 3-D mRoPE positions (fps-modulated floats where
    # enable_fps_modulation) with the modality margin between them
    grid = (c.frames, -(-c.side // p), -(-c.side // p))
    vision = grid[0] * grid[1] * grid[2]
    fps = cfg["enable_fps_modulation"]
    text_ids, offset = get_3d_mrope_ids_text_tokens(c.text, 0, use_float_positions=fps)
    vision_ids, _ = get_3d_mrope_ids_vae_tokens(
        *grid, offset + cfg["unified_3d_mrope_temporal_modality_margin"],
        reset_spatial_indices=cfg["unified_3d_mrope_reset_spatial_ids"], fps=cfg["base_fps"] if fps else None,
        base_fps=float(cfg["base_fps"]))
    arange = functools.partial(torch.arange, dtype=torch.long, device=c.device)
    return {"vision_tokens": c.randn(c.batch, cfg["latent_channel"], c.frames, c.side, c.side),
            "input_ids": torch.randint(0, cfg["vocab_size"], (c.batch, c.text), generator=c.gen, device=c.device),
            "text_indexes": arange(c.text), "position_ids": torch.cat([text_ids, vision_ids], 1).to(c.device),
            "und_len": c.text, "sequence_length": c.text + vision, "vision_token_shapes": [grid],
            "vision_sequence_indexes": arange(c.text, c.text + vision),
            "vision_mse_loss_indexes": arange(c.text, c.text + vision),
            "vision_timesteps": c.timestep()[:1].expand(vision), "vision_noisy_frame_indexes": [arange(c.frames)]}


def _ace_step(c: Inputs) -> dict:
    cfg, b = c.config, c.batch
    # [B, L, C] acoustic latents; the context (source latents and chunk masks) fills the rest of the
    # patchify conv's in_channels; L: the image classes' token count (64 x 64 / 4) before 2x patching
    frames, acoustic = c.side * c.side // 4, cfg["audio_acoustic_hidden_dim"]
    t = c.timestep()
    return {"hidden_states": c.randn(b, frames, acoustic), "timestep": t, "timestep_r": t,  # r = t: plain inference
            "encoder_hidden_states": c.randn(b, c.text, cfg["encoder_hidden_size"] or cfg["hidden_size"]),
            "context_latents": c.randn(b, frames, cfg["in_channels"] - acoustic)}


def _stable_audio(c: Inputs) -> dict:
    from diffusers.models.embeddings import get_1d_rotary_pos_embed  # noqa: PLC0415

    cfg, b = c.config, c.batch
    # the pipeline's [B, C, sample_size] latent; its text tokens end with the two duration embeddings, which
    # concatenated (2 x 768) are the global state; the rotary table spans the latent and that global token
    frames = cfg["sample_size"]
    rope = get_1d_rotary_pos_embed(cfg["attention_head_dim"] // 2, frames + 1, use_real=True,
                                   repeat_interleave_real=False)
    return {"hidden_states": c.randn(b, cfg["in_channels"], frames),
            "encoder_hidden_states": c.randn(b, c.text + 2, cfg["cross_attention_input_dim"]),
            "global_hidden_states": c.randn(b, 1, cfg["global_states_input_dim"]),
            "rotary_embedding": tuple(r.to(c.device) for r in rope)}


def _stable_audio3(c: Inputs) -> dict:
    cfg, b = c.config, c.batch
    # a [B, io_channels, T] latent (T as Stable Audio Open's sample_size, 1024; 16 in the toy), prompt tokens
    # [B, L, cond_token_dim] and the global (duration) embedding [B, global_cond_dim]; time in [0, 1]
    frames = 16 if c.toy else 1024
    return {"hidden_states": c.randn(b, cfg["io_channels"], frames), "timestep": c.timestep() / 999,
            "encoder_hidden_states": c.randn(b, c.text, cfg["cond_token_dim"]),
            "global_hidden_states": c.randn(b, cfg["global_cond_dim"])}


class _PackedPerSample(torch.nn.Module):
    """Cosmos 3's forward packs one sample's modalities into a single sequence and takes its video as a
    list: this runs it once per sample of the batch's latent (and prompt) and stacks the predictions."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, vision_tokens: torch.Tensor, input_ids: torch.Tensor, **kwargs):
        out = [self.model(input_ids=ids, vision_tokens=[x[None]], return_dict=False, **kwargs)[0][0]
               for x, ids in zip(vision_tokens.unbind(0), input_ids.unbind(0))]
        return torch.cat(out)


class _ReferencePass(torch.nn.Module):
    """Wan-Animate-2's forward takes per-sample lists and a KV cache it fills: this takes the batch's
    tensors, splits them per sample, hands it a fresh cache and stacks the outputs, so the bench can
    hand it a latent and take its gradient."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, hidden_states, timestep, encoder_hidden_states, condition_latents, kv_cache=None, **kwargs):
        from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache  # noqa: PLC0415

        cache = kv_cache or WanAnimate2KVCache(len(self.model.blocks))
        out = self.model(list(hidden_states.unbind(0)), timestep, list(encoder_hidden_states.unbind(0)),
                         list(condition_latents.unbind(0)), cache, return_dict=False, **kwargs)[0]
        return torch.stack(out)


#: classes built inside an adapter module (as :data:`.diffusers_inputs.WRAPPERS`)
WRAPPERS: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {"WanAnimate2Transformer3DModel": _ReferencePass,
                                                                 "Cosmos3OmniTransformer": _PackedPerSample}


#: ``Inputs -> kwargs`` (as :data:`.diffusers_inputs.INPUTS`)
INPUTS: dict[str, Callable[[Inputs], dict]] = {
    "LTX2VideoTransformer3DModel": _ltx2_video,
    "WanAnimateTransformer3DModel": _wan_animate,
    "WanAnimate2Transformer3DModel": _wan_animate2,
    "BriaFiboTransformer2DModel": _bria_fibo,
    "BriaFibo2Transformer2DModel": _bria_fibo2,
    "Cosmos3OmniTransformer": _cosmos3_omni,
    "AceStepTransformer1DModel": _ace_step,
    "StableAudioDiTModel": _stable_audio,
    "StableAudio3DiTModel": _stable_audio3,
    "JoyImageEditPlusTransformer3DModel": _joyimage_edit_plus,
    "AnyFlowTransformer3DModel": _anyflow,
    "AnyFlowFARTransformer3DModel": _anyflow_far,
    "PriorTransformer": _prior,
    "T5FilmDecoder": _t5_film,
}

#: classes whose latent is not their forward's first argument: it leads the made arguments all the same
#: (the bench takes the first as the latent), their adapter (:data:`WRAPPERS`) taking it first
LATENT_ARG = {"Cosmos3OmniTransformer": "vision_tokens", "T5FilmDecoder": "decoder_input_tokens"}

#: classes whose latent the rules of ``diffusers_all._layout`` get wrong (as :data:`.diffusers_inputs.LAYOUT`)
LAYOUT = {"Cosmos3OmniTransformer": "video", "AnyFlowTransformer3DModel": "frames-first",
          "AnyFlowFARTransformer3DModel": "frames-first"}
