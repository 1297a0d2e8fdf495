"""``cudnorm.patch`` on real transformers and diffusers models built from tiny configs (CPU; the
``emulated`` variants run the cuDNN path's code on emulated graphs, the ``gpu`` variants on
cuDNN): Llama, Qwen2, Qwen3, Gemma, Gemma 2, GPT-2, T5, DeepseekV3, Granite, OLMo 2, Cohere
(with q/k norms), Qwen3-Next, ChatGLM (Kolors' text encoder), DiT, SD3, Flux, PixArt,
CogVideoX, HunyuanDiT, Sana and Lumina 2. For each model: what is swapped and what is left; the
same module objects and parameters, state_dict keys untouched and a checkpoint of the original
loading strictly into the patched model; outputs and gradients equal to the unpatched model's
in fp32 (1e-5 relative); bf16 outputs within the 2x-PyTorch-error rule; ``save_pretrained`` /
``from_pretrained`` round trips; ``torch.compile(fullgraph=True)`` of a patched block equal to
eager. Then plain PyTorch models and the arguments. The registry's classes one by one:
``tests/test_patch_registry.py``; hooks, offloading, all-or-nothing: ``tests/test_patch_in_place.py``."""

import contextlib
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

import cudnorm
from cudnorm import reference as ref

import emulated_cudnn as emu

F32_TOL = 1e-5
# compiled vs eager, both fp32: Inductor reorders reductions (Sana's linear attention put its
# input gradient 1.3e-5 from eager's on an H100, torch 2.11); a wrong formula is off by > 1e-3
COMPILED_F32_TOL = 4e-5
# "emulated": CPU tensors through the cuDNN path's own code, the graphs emulated
# (tests/emulated_cudnn.py); the GPU runs cudnorm's cuDNN path itself
DEVICES = ["cpu", "emulated", pytest.param("cuda", marks=pytest.mark.gpu)]


@contextlib.contextmanager
def _on(device: str):
    """The torch device of a ``DEVICES`` entry, with the graph emulator installed for
    ``"emulated"``."""
    if device != "emulated":
        yield device
        return
    with emu.installed():
        yield "cpu"


B, VOCAB = 2, 128
LAYER_NORMS = ("torch.nn.LayerNorm", "layer_norm")


def _tf(name: str) -> str:
    """``"llama.LlamaRMSNorm"`` -> its module-qualified name in transformers."""
    folder, cls = name.split(".")
    return f"transformers.models.{folder}.modeling_{folder}.{cls}"


NORMALIZATION = "diffusers.models.normalization"


class Tiny(NamedTuple):
    """A tiny model family and what patching it must give."""

    make: Callable[[], torch.nn.Module]  # the unpatched model with fresh random weights
    inputs: dict  # forward keyword arguments (CPU tensors)
    swaps: dict  # {(class, formula): count} the report must list
    left: list  # [(module name, class)] the report must list as left
    block: Callable | None  # model -> (a block, a call of it on h [B, 8, width], width), None: not compiled


# ---------------------------------------------------------------- transformers models

def _ids(*shape):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(1))


def _decoder(name, swaps, left=(), block_layer=0, **extra):
    """A Llama-shaped causal LM of transformers' family ``name``; the block is its decoder layer
    ``block_layer``, given the rotary embedding of the model."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, name + "Config")(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, **extra)

    def block(model):
        layer, positions = model.model.layers[block_layer], torch.arange(8, device=model.device)[None]
        return layer, lambda h: layer(h, position_embeddings=model.model.rotary_emb(h, positions),
                                      position_ids=positions), 64

    return Tiny(lambda: getattr(transformers, name + "ForCausalLM")(config), {"input_ids": _ids(B, 16)}, swaps,
                list(left), block)


def _llama():  # 2 a layer + the final norm
    return _decoder("Llama", {(_tf("llama.LlamaRMSNorm"), "llama_rms_norm"): 5}, num_key_value_heads=2)


def _qwen2():
    return _decoder("Qwen2", {(_tf("qwen2.Qwen2RMSNorm"), "llama_rms_norm"): 5}, num_key_value_heads=2)


def _qwen3():  # q_norm and k_norm (over head_dim) too: 4 a layer + final
    return _decoder("Qwen3", {(_tf("qwen3.Qwen3RMSNorm"), "llama_rms_norm"): 9}, num_key_value_heads=2,
                    head_dim=16)


def _gemma():
    return _decoder("Gemma", {(_tf("gemma.GemmaRMSNorm"), "gemma_rms_norm"): 5}, num_key_value_heads=1, head_dim=16)


def _gemma2():  # pre- and post-norms around attention and MLP: 4 a layer + final
    return _decoder("Gemma2", {(_tf("gemma2.Gemma2RMSNorm"), "gemma_rms_norm"): 9}, num_key_value_heads=1,
                    head_dim=16)


def _deepseek_v3():
    """Multi-head latent attention (norms on the compressed q and kv: 4 a layer + final) and
    a mixture of experts in its second layer (eager experts: the grouped matmul takes no fp64)."""
    return _decoder("DeepseekV3", {(_tf("deepseek_v3.DeepseekV3RMSNorm"), "llama_rms_norm"): 9},
                    num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                    n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
                    experts_implementation="eager")


def _granite():
    return _decoder("Granite", {(_tf("granite.GraniteRMSNorm"), "llama_rms_norm"): 5}, num_key_value_heads=2)


def _olmo2():
    """Norms after the attention and the MLP, and q/k norms over the whole projection (4 a
    layer + final), each ``(weight * x_hat).to(x.dtype)`` in fp32."""
    return _decoder("Olmo2", {(_tf("olmo2.Olmo2RMSNorm"), "fp32_rms_norm"): 9}, num_key_value_heads=2,
                    eos_token_id=0, pad_token_id=0)


def _cohere():
    """LayerNorm without bias in fp32; q/k norms with a ``[heads, head_dim]`` weight (one norm
    before attention and MLP together, 3 a layer + final)."""
    return _decoder("Cohere", {(_tf("cohere.CohereLayerNorm"), "cohere_layer_norm"): 7}, num_key_value_heads=2,
                    use_qk_norm=True, eos_token_id=0, pad_token_id=0, bos_token_id=0)


def _qwen3_next():
    """Gemma-style (1 + weight) RMSNorms, and in its linear-attention layer a gated RMSNorm,
    which is left. Dense MLPs: PyTorch's compiler takes neither eager experts (a loop over the
    experts hit) nor the linear-attention layer's backward (unpatched too, torch 2.13), so the
    compiled block is the full-attention layer."""
    return _decoder("Qwen3Next", {(_tf("qwen3_next.Qwen3NextRMSNorm"), "gemma_rms_norm"): 7},
                    [("model.layers.0.linear_attn.norm", _tf("qwen3_next.Qwen3NextRMSNormGated"))],
                    num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                    linear_key_head_dim=16, linear_value_head_dim=16, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                    layer_types=["linear_attention", "full_attention"], mlp_only_layers=[0, 1], block_layer=1)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)

    def block(model):
        layer = model.transformer.h[0]
        return layer, layer, 64

    return Tiny(lambda: transformers.GPT2LMHeadModel(config), {"input_ids": _ids(B, 16)}, {LAYER_NORMS: 5}, [], block)


def _t5():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0)

    def block(model):
        layer = model.encoder.block[0]  # the first holds the relative attention bias
        return layer, layer, 32

    # encoder: 2 a layer + final; decoder: 3 a layer (self-, cross-attention, MLP) + final
    return Tiny(lambda: transformers.T5ForConditionalGeneration(config),
                {"input_ids": _ids(B, 12), "decoder_input_ids": _ids(B, 8)},
                {(_tf("t5.T5LayerNorm"), "t5_rms_norm"): 12}, [], block)


def _chatglm():
    """ChatGLM's RMSNorm (``(weight * x_hat).to(x.dtype)``, eps in ``eps``), as Kolors' text
    encoder in diffusers has it: 2 a layer + final."""
    text_encoder = pytest.importorskip("diffusers.pipelines.kolors.text_encoder")
    config = text_encoder.ChatGLMConfig(num_layers=2, padded_vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=128,
                                        kv_channels=16, num_attention_heads=4, seq_length=32, original_rope=True,
                                        multi_query_attention=True, multi_query_group_num=2)

    def make():
        model = text_encoder.ChatGLMModel(config)
        with torch.no_grad():  # its weights start uninitialised (no _init_weights): a checkpoint sets them
            for name, p in model.named_parameters():
                p.copy_(torch.ones_like(p) if "layernorm" in name else 0.05 * torch.randn_like(p))
        return model

    return Tiny(make, {"input_ids": _ids(B, 12)},
                {("diffusers.pipelines.kolors.text_encoder.RMSNorm", "fp32_rms_norm"): 5}, [], None)


# ---------------------------------------------------------------- diffusers models

def _adaln(name, formula, count):
    """The swap of diffusers' class ``name`` (in its normalization module) for ``formula``."""
    return {(f"{NORMALIZATION}.{name}", formula): count}


def _dit():
    diffusers = pytest.importorskip("diffusers")
    config = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2, sample_size=8,
                  patch_size=2, num_embeds_ada_norm=10)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), timestep=torch.tensor([3, 500]),
                  class_labels=torch.tensor([1, 2]))

    def block(model):
        layer, dev = model.transformer_blocks[0], model.device
        return layer, lambda h: layer(h, timestep=torch.tensor([3, 500], device=dev),
                                      class_labels=torch.tensor([1, 2], device=dev)), 16

    # norm1 of each block: AdaLayerNormZero (its nn.LayerNorm swapped too); norm3 of each block
    # and norm_out: nn.LayerNorm
    return Tiny(lambda: diffusers.DiTTransformer2DModel(**config), inputs,
                {**_adaln("AdaLayerNormZero", "adaln_zero", 2), LAYER_NORMS: 5}, [], block)


def _joint_block(model):
    """The first block of SD3 or Flux: ``(hidden_states, encoder_hidden_states, temb)``."""
    layer, dev = model.transformer_blocks[0], model.device
    context, temb = torch.randn(B, 3, 16, device=dev), torch.randn(B, 16, device=dev)
    return layer, lambda h: layer(h, context, temb), 16


def _sd3():
    diffusers = pytest.importorskip("diffusers")
    config = dict(sample_size=8, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8,
                  out_channels=4, pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm")
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), encoder_hidden_states=torch.randn(B, 3, 16),
                  pooled_projections=torch.randn(B, 8), timestep=torch.tensor([3, 500]))
    # block 0: SD35AdaLayerNormZeroX + AdaLayerNormZero (context); block 1 (the last, context
    # pre-only): AdaLayerNormZero + AdaLayerNormContinuous; the output norm: AdaLayerNormContinuous;
    # each with its nn.LayerNorm; q/k norms: diffusers' RMSNorm (4 a joint attention, 2 in block
    # 0's second attention); 3 nn.LayerNorms of the blocks' MLPs
    return Tiny(lambda: diffusers.SD3Transformer2DModel(**config), inputs, {
        **_adaln("SD35AdaLayerNormZeroX", "sd35_adaln_zero_x", 1), **_adaln("AdaLayerNormZero", "adaln_zero", 2),
        **_adaln("AdaLayerNormContinuous", "adaln_continuous", 2), **_adaln("RMSNorm", "t5_rms_norm", 10),
        LAYER_NORMS: 8}, [], _joint_block)


def _flux():
    diffusers = pytest.importorskip("diffusers")
    config = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                  num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))
    inputs = dict(hidden_states=torch.randn(B, 6, 4), encoder_hidden_states=torch.randn(B, 3, 16),
                  pooled_projections=torch.randn(B, 8), timestep=torch.tensor([0.3, 0.5]),
                  img_ids=torch.randn(6, 3), txt_ids=torch.zeros(3, 3))
    return Tiny(lambda: diffusers.FluxTransformer2DModel(**config), inputs, {
        **_adaln("AdaLayerNormZero", "adaln_zero", 2), **_adaln("AdaLayerNormZeroSingle", "adaln_zero_single", 1),
        **_adaln("AdaLayerNormContinuous", "adaln_continuous", 1), ("torch.nn.RMSNorm", "rms_norm"): 6,
        LAYER_NORMS: 6}, [], _joint_block)


def _pixart():
    """adaLN-single: one AdaLayerNormSingle for the model (a timestep embedding and a linear, no
    norm); each block adds its ``scale_shift_table`` and modulates the output of a non-affine
    ``nn.LayerNorm`` inline, and those LayerNorms are what patch swaps."""
    diffusers = pytest.importorskip("diffusers")
    config = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
                  sample_size=8, patch_size=2, cross_attention_dim=16, caption_channels=12)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), encoder_hidden_states=torch.randn(B, 3, 12),
                  timestep=torch.tensor([3, 500]))

    def block(model):
        layer, dev = model.transformer_blocks[0], model.device
        context, timestep = torch.randn(B, 3, 16, device=dev), torch.randn(B, 6 * 16, device=dev)
        return layer, lambda h: layer(h, encoder_hidden_states=context, timestep=timestep), 16

    # norm1 and norm2 of each block, and norm_out
    return Tiny(lambda: diffusers.PixArtTransformer2DModel(**config), inputs, {LAYER_NORMS: 5},
                [("adaln_single", f"{NORMALIZATION}.AdaLayerNormSingle")], block)


def _cogvideox():
    """CogVideoXLayerNormZero (video and text tokens, one projection) twice a block, and an
    AdaLayerNorm with ``chunk_dim=1`` at the output; the blocks' q/k LayerNorms."""
    diffusers = pytest.importorskip("diffusers")
    config = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=4,
                  text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
                  temporal_compression_ratio=4, max_text_seq_length=8)
    inputs = dict(hidden_states=torch.randn(B, 3, 4, 8, 8), encoder_hidden_states=torch.randn(B, 8, 16),
                  timestep=torch.tensor([3, 500]))

    def block(model):
        layer, dev = model.transformer_blocks[0], model.device
        context, temb = torch.randn(B, 3, 16, device=dev), torch.randn(B, 4, device=dev)
        return layer, lambda h: layer(h, context, temb), 16

    return Tiny(lambda: diffusers.CogVideoXTransformer3DModel(**config), inputs, {
        **_adaln("CogVideoXLayerNormZero", "cogvideox_adaln_zero", 4), **_adaln("AdaLayerNorm", "adaln", 1),
        LAYER_NORMS: 10}, [], block)


def _hunyuan_dit():
    """AdaLayerNormShift (an FP32LayerNorm plus a per-sample shift) and FP32LayerNorms in the
    blocks, q/k LayerNorms, an AdaLayerNormContinuous at the output."""
    diffusers = pytest.importorskip("diffusers")
    config = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2, hidden_size=16,
                  num_layers=2, sample_size=8, cross_attention_dim=16, cross_attention_dim_t5=16,
                  pooled_projection_dim=8, text_len=4, text_len_t5=4, mlp_ratio=2.0,
                  use_style_cond_and_image_meta_size=False)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), timestep=torch.tensor([3.0, 500.0]),
                  encoder_hidden_states=torch.randn(B, 4, 16), text_embedding_mask=torch.ones(B, 4),
                  encoder_hidden_states_t5=torch.randn(B, 4, 16), text_embedding_mask_t5=torch.ones(B, 4))

    def block(model):
        layer, dev = model.blocks[0], model.device
        context, temb = torch.randn(B, 4, 16, device=dev), torch.randn(B, 16, device=dev)
        return layer, lambda h: layer(h, encoder_hidden_states=context, temb=temb), 16

    hunyuan = "diffusers.models.transformers.hunyuan_transformer_2d"
    return Tiny(lambda: diffusers.HunyuanDiT2DModel(**config), inputs, {
        (f"{hunyuan}.AdaLayerNormShift", "adaln_shift"): 2, **_adaln("FP32LayerNorm", "fp32_layer_norm", 6),
        **_adaln("AdaLayerNormContinuous", "adaln_continuous", 1), LAYER_NORMS: 9}, [], block)


def _sana():
    """SanaModulatedNorm at the output; the blocks modulate non-affine nn.LayerNorms inline (as
    PixArt's), whose AdaLayerNormSingle is left; an RMSNorm on the caption."""
    diffusers = pytest.importorskip("diffusers")
    config = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=2,
                  num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=8,
                  sample_size=8, patch_size=1, mlp_ratio=2.0)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), encoder_hidden_states=torch.randn(B, 3, 8),
                  timestep=torch.tensor([3, 500]))

    def block(model):
        layer, dev = model.transformer_blocks[0], model.device
        context, timestep = torch.randn(B, 3, 16, device=dev), torch.randn(B, 6 * 16, device=dev)
        return layer, lambda h: layer(h, None, context, None, timestep, 2, 4), 16

    sana = "diffusers.models.transformers.sana_transformer"
    return Tiny(lambda: diffusers.SanaTransformer2DModel(**config), inputs, {
        (f"{sana}.SanaModulatedNorm", "sana_modulated_norm"): 1, **_adaln("RMSNorm", "t5_rms_norm", 1),
        LAYER_NORMS: 5}, [("time_embed", f"{NORMALIZATION}.AdaLayerNormSingle")], block)


def _lumina2():
    """LuminaRMSNormZero (one adaptive RMSNorm each), diffusers' RMSNorms everywhere else, the
    output LuminaLayerNormContinuous (one adaptive LayerNorm): nothing left."""
    diffusers = pytest.importorskip("diffusers")
    config = dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
                  num_attention_heads=2, num_kv_heads=1, multiple_of=16, cap_feat_dim=16, axes_dim_rope=(4, 6, 6),
                  axes_lens=(32, 32, 32))
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), timestep=torch.tensor([0.3, 0.5]),
                  encoder_hidden_states=torch.randn(B, 4, 16),
                  encoder_attention_mask=torch.ones(B, 4, dtype=torch.bool))
    return Tiny(lambda: diffusers.Lumina2Transformer2DModel(**config), inputs, {
        **_adaln("RMSNorm", "t5_rms_norm", 25), LAYER_NORMS: 1, **_adaln("LuminaRMSNormZero", "lumina_rms_norm_zero", 3),
        **_adaln("LuminaLayerNormContinuous", "lumina_layer_norm_continuous", 1)}, [], None)


FAMILIES = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "gemma": _gemma, "gemma2": _gemma2, "gpt2": _gpt2,
            "t5": _t5, "deepseek_v3": _deepseek_v3, "granite": _granite, "olmo2": _olmo2, "cohere": _cohere,
            "qwen3_next": _qwen3_next, "chatglm": _chatglm, "dit": _dit, "sd3": _sd3, "flux": _flux,
            "pixart": _pixart, "cogvideox": _cogvideox, "hunyuan_dit": _hunyuan_dit, "sana": _sana,
            "lumina2": _lumina2}


# ---------------------------------------------------------------- helpers

def _build(tiny):
    """The unpatched model in eval mode (no dropout), every parameter moved off its init: norm
    weights off ones (Gemma's off zeros), diffusers' zero-initialised modulation off zero, so
    a wrong formula or a dropped parameter shows."""
    torch.manual_seed(0)
    model = tiny.make().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _bf16(model):
    """``model`` in bf16 as ``from_pretrained(..., dtype=torch.bfloat16)`` gives it: modules the
    class keeps in fp32 stay fp32 (T5's ``wo``, after which T5's residual stream is fp32 and
    its norms get fp32 input with bf16 weights)."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    model.to(torch.bfloat16)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in keep:
            module.float()
    return model


def _output(model, inputs):
    out = model(**inputs)
    for name in ("logits", "sample", "last_hidden_state"):
        if hasattr(out, name):
            return getattr(out, name)
    raise AssertionError(f"no output tensor in {type(out).__name__}")


def _output_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = _output(model, inputs)
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got, want, tol=None):
    """Per-tensor relative error <= ``tol`` (F32_TOL); gradients that are zero in exact arithmetic (an
    attention key's bias: softmax ignores it) carry only rounding noise, about 1e-8 of the
    largest gradient's norm in fp32 (PixArt under compile on an H100), held to F32_TOL of 1% of it."""
    largest = max(w.norm() for w in want.values())
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert (got[name] - w).norm() <= (tol or F32_TOL) * max(w.norm(), 1e-2 * largest), name


# ---------------------------------------------------------------- patched models

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_models_load_strictly_and_match(family, device):
    with _on(device) as device:
        _load_strictly_and_match(FAMILIES[family](), device)


def _load_strictly_and_match(tiny, device):
    inputs = {k: v.to(device) for k, v in tiny.inputs.items()}
    base = _build(tiny).to(device)
    want, want_grads = _output_and_grads(base, inputs)
    model = tiny.make().to(device).eval()
    keys = {k: id(v) for k, v in model.state_dict(keep_vars=True).items()}
    modules = {name: (id(m), type(m)) for name, m in model.named_modules()}
    report = cudnorm.patch(model)
    assert Counter((cls, formula) for _, cls, formula in report.swapped) == tiny.swaps, report
    assert [(name, cls) for name, cls, _ in report.left] == tiny.left, report
    assert {k: id(v) for k, v in model.state_dict(keep_vars=True).items()} == keys  # same keys, same Parameters
    for name, module in model.named_modules():  # the same objects; swapped ones of a subclass of their class
        assert id(module) == modules[name][0] and isinstance(module, modules[name][1]), name
    assert {name for name, m in model.named_modules() if type(m) is not modules[name][1]} == {
        name for name, _, _ in report.swapped}
    model.load_state_dict(base.state_dict(), strict=True)  # the original's checkpoint loads as before
    got, got_grads = _output_and_grads(model, inputs)
    assert got.dtype == want.dtype and ref.rel_error(got, want) <= F32_TOL
    _assert_grads_close(got_grads, want_grads)
    tiny.make().load_state_dict(model.state_dict(), strict=True)  # and the patched model's into the original
    # a second call finds nothing left to swap, and says the model is patched already
    with pytest.warns(RuntimeWarning, match=r"swapped no norm in \w+: it is patched already \(\d+ module\(s\) run on cudnorm"):
        assert not cudnorm.patch(model).swapped


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_models_bf16_meet_the_error_rule(family, device):
    """bf16 outputs within twice the unpatched bf16 model's error, both against the same
    weights in fp64."""
    with _on(device) as device:
        _bf16_meets_the_rule(FAMILIES[family](), device)


def _bf16_meets_the_rule(tiny, device):
    base = _bf16(_build(tiny)).to(device)
    exact = tiny.make().eval()
    exact.load_state_dict({k: v.double() for k, v in base.state_dict().items()})
    exact.to(device, torch.float64)
    patched = _bf16(tiny.make().eval()).to(device)
    cudnorm.patch(patched)
    patched.load_state_dict(base.state_dict(), strict=True)
    inputs = {k: v.to(device) for k, v in tiny.inputs.items()}
    wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    half = {k: v.to(torch.bfloat16) if v.is_floating_point() and not k.endswith("_ids") else v  # Flux's ids stay fp32
            for k, v in inputs.items()}
    with torch.no_grad():
        want, theirs, ours = _output(exact, wide), _output(base, half), _output(patched, half)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    bound = ref.error_bound(ref.rel_error(theirs, want), torch.bfloat16)
    assert ref.rel_error(ours, want) <= bound, (ref.rel_error(ours, want), bound)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_models_round_trip_through_save_pretrained(family, tmp_path):
    """The checkpoint of a patched model is the original class's: it loads unpatched."""
    tiny = FAMILIES[family]()
    model = _build(tiny)
    cudnorm.patch(model)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert list(loaded.state_dict()) == list(model.state_dict())
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert ref.rel_error(_output(model, tiny.inputs), _output(loaded, tiny.inputs)) <= F32_TOL


# Inductor on the GPU; on the CPU aot_eager, which traces what Inductor would (Dynamo's full
# graph, the custom ops' fake and autograd registrations) without 2-9 s of C++ codegen per
# block, and cudnorm's ops on the CPU are PyTorch's kernels either way
COMPILE_BACKEND = {"cpu": "aot_eager", "cuda": "inductor"}


# ChatGLM's and Lumina 2's blocks take rotary tables and masks their models build: no block here
COMPILED = [family for family in FAMILIES if family not in ("chatglm", "lumina2")]


@pytest.mark.slow  # torch.compile of every model family on the CPU
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", COMPILED)
def test_compiled_patched_block_matches_eager(family, device):
    with _on(device) as device:
        _compiled_matches_eager(FAMILIES[family](), device)


def _compiled_matches_eager(tiny, device, blocks=False):
    model = _build(tiny).to(device)
    cudnorm.patch(model, blocks=blocks)
    layer, call, width = tiny.block(model)
    h = torch.randn(B, 8, width, device=device, requires_grad=True)
    params = dict(layer.named_parameters())

    def loss(h):
        out = call(h)
        return sum(o.float().square().mean() for o in (out if isinstance(out, tuple) else (out,)) if o is not None)

    traced = []

    def backend(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes)
        return torch._dynamo.lookup_backend(COMPILE_BACKEND[device])(gm, example_inputs)

    torch._dynamo.reset()
    got = torch.compile(loss, fullgraph=True, backend=backend)(h)
    got_grads = torch.autograd.grad(got, [h, *params.values()], allow_unused=True)
    torch._dynamo.reset()
    assert any("cudnorm" in t for t in traced)  # the patched norms' ops are in the graph
    want = loss(h)
    want_grads = torch.autograd.grad(want, [h, *params.values()], allow_unused=True)
    assert ref.rel_error(got, want) <= COMPILED_F32_TOL
    names = ["input", *params]
    assert [n for n, g in zip(names, got_grads) if g is None] == [n for n, g in zip(names, want_grads) if g is None]
    _assert_grads_close({n: g for n, g in zip(names, got_grads) if g is not None},
                        {n: g for n, g in zip(names, want_grads) if g is not None}, COMPILED_F32_TOL)


# ---------------------------------------------------------------- plain models, arguments

def test_plain_models():
    shared = torch.nn.LayerNorm(8)
    plain = torch.nn.Sequential(shared, torch.nn.Linear(8, 8), shared, torch.nn.RMSNorm(8, elementwise_affine=False))
    x = torch.randn(4, 8)
    want = plain(x)
    report = cudnorm.patch(plain)
    assert plain[0] is shared and plain[2] is shared and isinstance(shared, torch.nn.LayerNorm)
    assert type(shared) is not torch.nn.LayerNorm and type(plain[3]) is not torch.nn.RMSNorm
    # a shared norm is listed under each of its names
    assert report.swapped == [("0", "torch.nn.LayerNorm", "layer_norm"), ("2", "torch.nn.LayerNorm", "layer_norm"),
                              ("3", "torch.nn.RMSNorm", "rms_norm")] and not report.left
    assert torch.equal(plain(x), want)
    assert "3 norm(s)" in str(report) and "2 x torch.nn.LayerNorm -> layer_norm" in str(report)


def test_a_norm_itself_is_patched():
    norm = torch.nn.LayerNorm(8)
    report = cudnorm.patch(norm)
    assert report.swapped == [("", "torch.nn.LayerNorm", "layer_norm")] and isinstance(norm, torch.nn.LayerNorm)
    assert not cudnorm.patch(cudnorm.LayerNorm(8)).swapped  # cudnorm's own modules are passed over


def test_patch_arguments():
    with pytest.raises(TypeError, match=r"cudnorm\.patch: argument 'model'"):
        cudnorm.patch("llama")
