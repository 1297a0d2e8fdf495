"""Which transformers and diffusers classes compute which formula of :mod:`cudnorm.patching`:
the classes ``cudnorm.patch`` swaps, by module-qualified name (remote code and copies that
reuse a class's name are other classes), and the reasons it gives for notable classes it leaves.

Facts read from the sources of transformers 5.24 and diffusers 0.42: every class listed under
a formula has, body for body, the forward (and the helpers it calls) of one of the formula's
:data:`ANCHORS`, which the tests run against cudnorm (``tests/test_patch_registry.py`` checks
both against the installed versions). Data only: no package imports.
"""

from __future__ import annotations


def qualified_name(cls: type) -> str:
    """``cls``'s module and qualified name (``diffusers.models.normalization.RMSNorm``): what
    tells apart classes of one name from different libraries, remote code or copies."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _transformers(*names: str) -> tuple[str, ...]:
    """``"llama.LlamaRMSNorm"`` -> ``"transformers.models.llama.modeling_llama.LlamaRMSNorm"``."""
    return tuple(f"transformers.models.{folder}.modeling_{folder}.{cls}"
                 for folder, cls in (name.split(".") for name in names))


_NORMALIZATION = "diffusers.models.normalization"

#: formula name -> the classes computing it
CLASSES = {
    # weight * (x * rsqrt(mean(x^2) + variance_epsilon) in fp32).to(x.dtype)
    "llama_rms_norm": _transformers(
    "aimv2.Aimv2RMSNorm", "apertus.ApertusRMSNorm", "apertus1p5.Apertus1p5TextRMSNorm", "arcee.ArceeRMSNorm",
    "aria.AriaTextRMSNorm", "axk1.AXK1RMSNorm", "axk2.AXK2RMSNorm", "bailing_hybrid.BailingHybridRMSNorm",
    "bamba.BambaRMSNorm", "bitnet.BitNetRMSNorm", "blt.BltRMSNorm", "chameleon.ChameleonRMSNorm",
    "clvp.ClvpRMSNorm", "cohere2_moe.Cohere2MoeRMSNorm", "cosmos3_edge.Cosmos3EdgeTextRMSNorm",
    "csm.CsmRMSNorm", "cwm.CwmRMSNorm", "deepseek_ocr2.DeepseekOcr2TextRMSNorm",
    "deepseek_ocr2.DeepseekOcr2VisionRMSNorm", "deepseek_v2.DeepseekV2RMSNorm", "deepseek_v3.DeepseekV3RMSNorm",
    "deepseek_v32.DeepseekV32RMSNorm", "deimv2.Deimv2RMSNorm", "dia.DiaRMSNorm", "diffllama.DiffLlamaRMSNorm",
    "doge.DogeRMSNorm", "dots1.Dots1RMSNorm", "dots3_note.Dots3NoteRMSNorm", "emu3.Emu3RMSNorm",
    "ernie4_5.Ernie4_5RMSNorm", "ernie4_5_moe.Ernie4_5_MoeRMSNorm", "ernie4_5_vl_moe.Ernie4_5_VLMoeRMSNorm",
    "eurobert.EuroBertRMSNorm", "evolla.EvollaRMSNorm", "exaone4.Exaone4RMSNorm", "exaone4_5.Exaone4_5_RMSNorm",
    "exaone_moe.ExaoneMoeRMSNorm", "falcon_h1.FalconH1RMSNorm", "falcon_mamba.FalconMambaRMSNorm",
    "glm.GlmRMSNorm", "glm4.Glm4RMSNorm", "glm4_moe.Glm4MoeRMSNorm", "glm4_moe_lite.Glm4MoeLiteRMSNorm",
    "glm4v.Glm4vRMSNorm", "glm4v_moe.Glm4vMoeRMSNorm", "glm4v_moe.Glm4vMoeTextRMSNorm",
    "glm5_next.Glm5NextRMSNorm", "glm5_next.Glm5NextTextRMSNorm", "glm_image.GlmImageRMSNorm",
    "glm_moe_dsa.GlmMoeDsaRMSNorm", "glm_ocr.GlmOcrRMSNorm", "granite.GraniteRMSNorm",
    "granite4_vision.Granite4VisionTextRMSNorm", "granite_docling.GraniteDoclingTextRMSNorm",
    "granite_swa.GraniteSWARMSNorm", "granitemoe.GraniteMoeRMSNorm", "granitemoe_swa.GraniteMoeSWARMSNorm",
    "granitemoehybrid.GraniteMoeHybridRMSNorm", "granitemoeshared.GraniteMoeSharedRMSNorm",
    "higgs_audio_v2.HiggsAudioV2RMSNorm", "hunyuan_v1_dense.HunYuanDenseV1RMSNorm",
    "hunyuan_v1_moe.HunYuanMoEV1RMSNorm", "hunyuan_vl.HunYuanVLRMSNorm", "hy_v3.HYV3RMSNorm",
    "hy_v4.HYV4RMSNorm", "hy_v4_vl.HYV4VLRMSNorm", "hyperclovax.HyperCLOVAXRMSNorm", "idefics2.Idefics2RMSNorm",
    "idefics3.Idefics3RMSNorm", "inkling.InklingRMSNorm", "internvl.InternVLVisionRMSNorm",
    "jamba.JambaRMSNorm", "jetmoe.JetMoeRMSNorm", "kimi_linear.KimiLinearRMSNorm", "kolibri1.Kolibri1RMSNorm",
    "laguna.LagunaRMSNorm", "lfm2.Lfm2RMSNorm", "lfm2_moe.Lfm2MoeRMSNorm", "lfm3.Lfm3RMSNorm",
    "lfm3_vl.Lfm3VlVisionRMSNorm", "lighton_ocr.LightOnOcrRMSNorm", "llama.LlamaRMSNorm",
    "longcat_flash.LongcatFlashRMSNorm", "mamba.MambaRMSNorm", "mamba2.Mamba2RMSNorm", "mellum.MellumRMSNorm",
    "mimo_v2_flash.MiMoV2FlashRMSNorm", "minicpm3.MiniCPM3RMSNorm", "minimax.MiniMaxRMSNorm",
    "minimax_m2.MiniMaxM2RMSNorm", "ministral.MinistralRMSNorm", "ministral3.Ministral3RMSNorm",
    "mistral.MistralRMSNorm", "mistral3.Mistral3RMSNorm", "mistral4.Mistral4RMSNorm",
    "mistral_large4.MistralLarge4RMSNorm", "mixtral.MixtralRMSNorm", "mllama.MllamaTextRMSNorm",
    "molmo2.Molmo2RMSNorm", "muse_glimmer_assistant.MuseGlimmerAssistantRMSNorm", "neucodec.NeuCodecRMSNorm",
    "olmoe.OlmoeRMSNorm", "ovis2.Ovis2RMSNorm", "paddleocr_vl.PaddleOCRRMSNorm",
    "pe_audio.PeAudioEncoderRMSNorm", "pe_audio_video.PeAudioVideoEncoderRMSNorm",
    "pe_video.PeVideoEncoderRMSNorm", "phi3.Phi3RMSNorm", "phi4_multimodal.Phi4MultimodalRMSNorm",
    "pixtral.PixtralRMSNorm", "qianfan_ocr.QianfanOCRVisionRMSNorm", "qwen2.Qwen2RMSNorm",
    "qwen2_5_omni.Qwen2_5OmniRMSNorm", "qwen2_5_vl.Qwen2_5_VLRMSNorm", "qwen2_moe.Qwen2MoeRMSNorm",
    "qwen2_vl.Qwen2VLRMSNorm", "qwen3.Qwen3RMSNorm", "qwen3_moe.Qwen3MoeRMSNorm",
    "qwen3_omni_moe.Qwen3OmniMoeCode2WavRMSNorm", "qwen3_omni_moe.Qwen3OmniMoeRMSNorm",
    "qwen3_omni_moe.Qwen3OmniMoeTextRMSNorm", "qwen3_omni_moe.Qwen3OmniMoeThinkerTextRMSNorm",
    "qwen3_vl.Qwen3VLTextRMSNorm", "qwen3_vl_moe.Qwen3VLMoeTextRMSNorm", "sapiens2.Sapiens2RMSNorm",
    "seed_oss.SeedOssRMSNorm", "smollm3.SmolLM3RMSNorm", "solar_open.SolarOpenRMSNorm",
    "timesfm.TimesFmRMSNorm", "timesfm2_5.TimesFm2_5RMSNorm", "ultrabert.UltrabertRMSNorm",
    "ultravbert.UltraVBertRMSNorm", "unlimited_ocr.UnlimitedOcrTextRMSNorm", "vibevoice.VibeVoiceRMSNorm",
    "vibevoice_acoustic_tokenizer.VibeVoiceAcousticTokenizerRMSNorm", "vibevoice_asr.VibeVoiceAsrRMSNorm",
    "voxtral_realtime.VoxtralRealtimeRMSNorm", "xcodec2.Xcodec2RMSNorm", "youtu.YoutuRMSNorm",
    "zamba.ZambaRMSNorm", "zamba2.Zamba2RMSNorm", "zaya.ZayaRMSNorm",
    ),
    # (x_hat * (1 + weight.float())) in fp32, cast to x's dtype (eps: ``eps``)
    "gemma_rms_norm": _transformers(
    "gemma.GemmaRMSNorm", "gemma2.Gemma2RMSNorm", "gemma3.Gemma3RMSNorm", "minimax_m3_vl.MiniMaxM3VLRMSNorm",
    "muse_glimmer.MuseGlimmerTextCenteredRMSNorm", "qwen3_5.Qwen3_5RMSNorm", "qwen3_5_moe.Qwen3_5MoeRMSNorm",
    "qwen3_next.Qwen3NextRMSNorm", "recurrent_gemma.RecurrentGemmaRMSNorm", "step3p7.Step3p7RMSNorm",
    "t5gemma.T5GemmaRMSNorm", "t5gemma2.T5Gemma2RMSNorm", "vaultgemma.VaultGemmaRMSNorm",
    ) + ("diffusers.models.transformers.transformer_qwenimage21.QwenImage21ZeroCenterRMSNorm",
         "diffusers.models.transformers.transformer_krea2.Krea2RMSNorm"),
    # (weight * x_hat) in fp32, cast to x's dtype (OLMo 2's q/k norms normalise the whole projection)
    "fp32_rms_norm": _transformers(
    "afmoe.AfmoeRMSNorm", "beam.BeamRMSNorm", "deepseek_v4.DeepseekV4RMSNorm", "flex_olmo.FlexOlmoRMSNorm",
    "flint.FlintRMSNorm", "gpt_oss.GptOssRMSNorm", "helium.HeliumRMSNorm", "inkling2.Inkling2RMSNorm",
    "inkling2_loop.Inkling2LoopRMSNorm", "lara_mini.LaraMiniRMSNorm", "nemotron_h.NemotronHRMSNorm",
    "nemotron_h_omni.NemotronH_Omni_RMSNorm", "olmo2.Olmo2RMSNorm", "olmo3.Olmo3RMSNorm",
    "olmo_hybrid.OlmoHybridRMSNorm", "openai_privacy_filter.OpenAIPrivacyFilterRMSNorm",
    ) + (
        "diffusers.pipelines.kolors.text_encoder.RMSNorm",  # ChatGLM's, Kolors' text encoder
        f"{_NORMALIZATION}.MochiRMSNorm",
    ),
    # x_hat in fp32, cast to a half-precision weight's dtype, times the weight (T5's "LayerNorm")
    "t5_rms_norm": _transformers(
    "idefics.IdeficsRMSNorm", "kosmos2_5.Kosmos2_5LayerNorm", "longt5.LongT5LayerNorm", "mt5.MT5LayerNorm",
    "pix2struct.Pix2StructLayerNorm", "pop2piano.Pop2PianoLayerNorm",
    "switch_transformers.SwitchTransformersLayerNorm", "t5.T5LayerNorm", "udop.UdopLayerNorm",
    "umt5.UMT5LayerNorm",
    ) + (
        f"{_NORMALIZATION}.RMSNorm",  # without a weight: x_hat in x's dtype; with a bias: left
        "diffusers.models.transformers.t5_film_transformer.T5LayerNorm",
    ),
    # (weight.float() * LayerNorm(x.float()) without bias), cast to x's dtype; a [heads, head_dim]
    # weight for the q/k norms
    "cohere_layer_norm": _transformers(
    "cohere.CohereLayerNorm", "cohere2.Cohere2LayerNorm", "cohere2_moe.Cohere2MoeLayerNorm",
    "cohere_compass.CohereCompassLayerNorm",
    ),
    # (gamma * x_hat) in fp32 (force_fp32) or in x's dtype, cast to x's dtype: fp32_rms_norm's
    # arithmetic with the weight named gamma (Stable Audio 3's DiT)
    "stable_audio3_rms_norm": ("diffusers.models.transformers.transformer_stable_audio3.StableAudio3RMSNorm",),
    # F.layer_norm of x and the parameters in fp32, cast to x's dtype
    "fp32_layer_norm": (f"{_NORMALIZATION}.FP32LayerNorm",),
    # diffusers' AdaLN classes (cudnorm.diffusers.FUSED says how each runs)
    "adaln_zero": (f"{_NORMALIZATION}.AdaLayerNormZero",),
    "adaln_zero_single": (f"{_NORMALIZATION}.AdaLayerNormZeroSingle",),
    "sd35_adaln_zero_x": (f"{_NORMALIZATION}.SD35AdaLayerNormZeroX",),
    "adaln_continuous": (f"{_NORMALIZATION}.AdaLayerNormContinuous",),
    "adaln": (f"{_NORMALIZATION}.AdaLayerNorm",),
    "cogvideox_adaln_zero": (f"{_NORMALIZATION}.CogVideoXLayerNormZero",),
    "easyanimate_adaln_zero": ("diffusers.models.transformers.transformer_easyanimate.EasyAnimateLayerNormZero",),
    "adaln_shift": ("diffusers.models.transformers.hunyuan_transformer_2d.AdaLayerNormShift",),
    "sana_modulated_norm": ("diffusers.models.transformers.sana_transformer.SanaModulatedNorm",),
    # diffusers' modulated RMSNorms, on cudnorm.ada_rms_norm
    "lumina_rms_norm_zero": (f"{_NORMALIZATION}.LuminaRMSNormZero",),
    "lumina_layer_norm_continuous": (f"{_NORMALIZATION}.LuminaLayerNormContinuous",),
    "mochi_rms_norm_zero": ("diffusers.models.transformers.transformer_mochi.MochiRMSNormZero",),
    "mochi_modulated_rms_norm": ("diffusers.models.transformers.transformer_mochi.MochiModulatedRMSNorm",),
    # Chroma's pruned AdaLN (the modulation comes precomputed) and CogView4's (no SiLU)
    "chroma_adaln_zero_pruned": ("diffusers.models.transformers.transformer_chroma.ChromaAdaLayerNormZeroPruned",),
    "chroma_adaln_zero_single_pruned": (
        "diffusers.models.transformers.transformer_chroma.ChromaAdaLayerNormZeroSinglePruned",),
    "chroma_adaln_continuous_pruned": (
        "diffusers.models.transformers.transformer_chroma.ChromaAdaLayerNormContinuousPruned",),
    "cogview3plus_adaln_zero_text_image": (f"{_NORMALIZATION}.CogView3PlusAdaLayerNormZeroTextImage",),
    "qwenimage21_adaln_continuous": (
        "diffusers.models.transformers.transformer_qwenimage21.QwenImage21AdaLayerNormContinuous",),
    "audio_dit_adaln_zero_final": (
        "diffusers.models.transformers.transformer_longcat_audio_dit.AudioDiTAdaLayerNormZeroFinal",),
    "cosmos_adaln": ("diffusers.models.transformers.transformer_cosmos.CosmosAdaLayerNorm",),
    "cosmos_adaln_zero": ("diffusers.models.transformers.transformer_cosmos.CosmosAdaLayerNormZero",),
    # GLM-Image's two classes have CogView4's bodies (constructor and forward)
    "cogview4_adaln_zero": ("diffusers.models.transformers.transformer_cogview4.CogView4AdaLayerNormZero",
                            "diffusers.models.transformers.transformer_glm_image.GlmImageAdaLayerNormZero"),
    # modulated per token: FLUX.3's, Helios' and Sana-Video's output norms
    "sana_video_modulated_norm": ("diffusers.models.transformers.transformer_sana_video.SanaModulatedNorm",),
    "flux3_adaln": ("diffusers.models.transformers.transformer_flux3.Flux3AdaLayerNorm",),
    "helios_output_norm": ("diffusers.models.transformers.transformer_helios.HeliosOutputNorm",),
    "cogview4_adaln_continuous": ("diffusers.models.transformers.transformer_cogview4.CogView4AdaLayerNormContinuous",
                                  "diffusers.models.transformers.transformer_glm_image.GlmImageAdaLayerNormContinuous"),
}

#: formula name -> the classes of it that the tests run against cudnorm, one for each way the
#: formula's forward is written (a formula of one class: that class); every other class of the
#: formula has, body for body, the forward of one of them
ANCHORS = {
    "llama_rms_norm": _transformers("llama.LlamaRMSNorm"),
    "gemma_rms_norm": _transformers("gemma.GemmaRMSNorm") + (
        "diffusers.models.transformers.transformer_qwenimage21.QwenImage21ZeroCenterRMSNorm",
        "diffusers.models.transformers.transformer_krea2.Krea2RMSNorm"),
    "cohere_layer_norm": _transformers("cohere.CohereLayerNorm"),
    "fp32_rms_norm": _transformers("olmo2.Olmo2RMSNorm", "helium.HeliumRMSNorm") + (
        "diffusers.pipelines.kolors.text_encoder.RMSNorm", f"{_NORMALIZATION}.MochiRMSNorm"),
    "t5_rms_norm": _transformers("t5.T5LayerNorm") + (f"{_NORMALIZATION}.RMSNorm",),
    "cogview4_adaln_zero": ("diffusers.models.transformers.transformer_cogview4.CogView4AdaLayerNormZero",),
    # modulated per token: FLUX.3's, Helios' and Sana-Video's output norms
    "sana_video_modulated_norm": ("diffusers.models.transformers.transformer_sana_video.SanaModulatedNorm",),
    "flux3_adaln": ("diffusers.models.transformers.transformer_flux3.Flux3AdaLayerNorm",),
    "helios_output_norm": ("diffusers.models.transformers.transformer_helios.HeliosOutputNorm",),
    "cogview4_adaln_continuous": ("diffusers.models.transformers.transformer_cogview4.CogView4AdaLayerNormContinuous",),
}

_GATED = ("a gated RMSNorm: it also multiplies by an activation of a second input (the gate), which no "
          "cudnorm op takes")
_GEMMA_4 = ("Gemma 3n/4's RMSNorm: x_hat * weight in fp32 with an optional weight (with_scale) and "
            "pow(-0.5) for rsqrt; not registered")

#: module-qualified class name -> why ``cudnorm.patch`` leaves it, where the general reasons
#: would say less
LEFT = {
    **dict.fromkeys(_transformers(
        "bamba.BambaRMSNormGated", "granitemoehybrid.GraniteMoeHybridRMSNormGated", "mamba2.MambaRMSNormGated",
        "nemotron_h.NemotronHRMSNormGated", "zamba2.Zamba2RMSNormGated", "olmo_hybrid.OlmoHybridRMSNormGated",
        "qwen3_5.Qwen3_5RMSNormGated", "qwen3_5_moe.Qwen3_5MoeRMSNormGated", "qwen3_next.Qwen3NextRMSNormGated",
        "qwen4_exp.Qwen4ExpTextRMSNormGated", "bailing_hybrid.BailingHybridRMSNormGated",
        "glm5_next.Glm5NextTextRMSNormGated", "kimi_linear.KimiLinearRMSNormGated",
        "lara_mini.LaraMiniRMSNormGated"), _GATED),
    **dict.fromkeys(_transformers(
        "diffusion_gemma.DiffusionGemmaRMSNorm", "embedding_gemma2.EmbeddingGemma2RMSNorm", "gemma3n.Gemma3nRMSNorm",
        "gemma4.Gemma4RMSNorm", "gemma4_unified.Gemma4UnifiedRMSNorm", "muse_glimmer.MuseGlimmerRMSNorm",
        "muse_spark.MuseSparkRMSNorm", "neomme.NeoMMERMSNorm"), _GEMMA_4),
    "torch.nn.modules.normalization.GroupNorm": (
        "normalises groups of channels ([B, C, *] statistics over C / groups channels and every position), not "
        "the last dims, which is all cudnorm's ops normalise (diffusers' UNet-style blocks: proj_in's input norm)"),
    f"{_NORMALIZATION}.AdaLayerNormSingle": (
        "normalises nothing: PixArt's timestep embedding and modulation linear (the blocks' nn.LayerNorms "
        "it modulates are swapped)"),
    **dict.fromkeys((
        "diffusers.models.transformers.transformer_hunyuan_video.HunyuanVideoAdaNorm",
        "diffusers.models.transformers.transformer_hunyuanimage.HunyuanImageAdaNorm",
        "diffusers.models.transformers.transformer_hunyuan_video15.HunyuanVideo15AdaNorm"), (
        "normalises nothing: the gate projection linear(silu(temb)) of HunyuanVideo's and HunyuanImage's blocks "
        "(their modulated norms are swapped)")),
    **dict.fromkeys((
        "diffusers.models.transformers.transformer_ltx2.LTX2AdaLayerNormSingle",
        "diffusers.models.transformers.transformer_sana_wm_refiner.SanaWMLTX2AdaLayerNormSingle"), (
        "normalises nothing: LTX-2's timestep embedding and modulation linear, as PixArt's AdaLayerNormSingle")),
    "diffusers.models.transformers.transformer_minimax_h3.MiniMaxH3AdaLayerNormModulation": (
        "normalises nothing: MiniMax-H3's block modulation projection (its blocks' norms are swapped)"),
    "diffusers.models.transformers.transformer_minimax_h3.MiniMaxH3AdaLayerNormOut": (
        "an affine RMSNorm modulated per row of the packed sequence (index_select by timestep): cudnorm's "
        "per-token adaptive RMSNorm has no weight; its RMSNorm (norm) is swapped"),
    "diffusers.models.transformers.transformer_rfd4_proteina.RFD4ProteinaAdaptiveNorm": (
        "a sigmoid gain, a shift and a mask after the norm, from a normalised condition; its norms are swapped"),
    "diffusers.models.transformers.transformer_mochi.MochiLayerNormContinuous": (
        "its modulated RMSNorm (norm, a MochiModulatedRMSNorm) is swapped and runs cudnorm.ada_rms_norm; what "
        "remains is its projection of the conditioning"),
}
