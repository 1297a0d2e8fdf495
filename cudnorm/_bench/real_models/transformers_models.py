"""transformers' Llama and Qwen3 at Llama-3-8B's and Qwen3-8B's widths, and the swap of their
RMSNorms for Liger's (the ``liger`` provider).

The configs are the ``config.json`` of meta-llama/Meta-Llama-3-8B and Qwen/Qwen3-8B with 4
layers (32 and 36 published). The bench runs the base model (``LlamaModel``/``Qwen3Model``) on
``inputs_embeds``: no token embedding lookup and no LM head. At 4 layers a 128k/152k-vocab
head would be a third of the step's GEMM work (a tenth at full depth); without it the step
weighs its layers as the full model does. The embedding table is still built (the published
vocab; about 1 GB per copy in bf16, unused). A step is B 1 x 4096 tokens, causal SDPA.
transformers is imported when a model is built.
"""

from __future__ import annotations

import torch

from .spec import RealModel


def _llama(config: dict) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaModel  # noqa: PLC0415

    return LlamaModel(LlamaConfig(**_without_seq(config), attn_implementation="sdpa", use_cache=False))


def _qwen3(config: dict) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3Model  # noqa: PLC0415

    return Qwen3Model(Qwen3Config(**_without_seq(config), attn_implementation="sdpa", use_cache=False))


def _without_seq(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "seq"}


def _inputs(config: dict, batch: int, device: str, dtype: torch.dtype, gen) -> dict:
    return {"inputs_embeds": torch.randn((batch, config["seq"], config["hidden_size"]), generator=gen,
                                         device=device, dtype=dtype)}


def _last_hidden_state(result) -> torch.Tensor:
    return result.last_hidden_state


_SHARED = dict(inputs=_inputs, output=_last_hidden_state, batch=1, toy_batch=2, tokens=lambda c: c["seq"],
               width=lambda c: c["hidden_size"], cfg=False, liger=True)

LLAMA = RealModel(
    name="transformers-llama-3-8b", library="transformers", title="transformers Llama-3-8B widths (LlamaModel)",
    build=_llama,
    config=dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                num_hidden_layers=4, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=8192, seq=4096),
    toy=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             vocab_size=64, rms_norm_eps=1e-5, max_position_embeddings=64, seq=16),
    full=dict(num_hidden_layers=32), **_SHARED)

QWEN3 = RealModel(
    name="transformers-qwen3-8b", library="transformers",
    title="transformers Qwen3-8B widths (Qwen3Model; qk RMSNorm)", build=_qwen3,
    config=dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                num_hidden_layers=4, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                max_position_embeddings=40960, seq=4096),
    toy=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             num_hidden_layers=2, vocab_size=64, rms_norm_eps=1e-6, max_position_embeddings=64, seq=16),
    full=dict(num_hidden_layers=36), **_SHARED)

MODELS = (LLAMA, QWEN3)

# the RMSNorm classes of these models: weight * x_hat.to(x.dtype), x_hat in fp32
_RMS_NORMS = ("LlamaRMSNorm", "Qwen3RMSNorm")


def use_liger(model: torch.nn.Module) -> None:
    """Replace every Llama/Qwen3 RMSNorm of ``model`` by Liger's ``LigerRMSNorm`` holding the
    same weight (``casting_mode="llama"``: the same rounding order), in place. Liger's own
    ``apply_liger_kernel_to_llama`` patches the classes, which would change the torch copies too."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm  # noqa: PLC0415

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ not in _RMS_NORMS:
                continue
            weight = child.weight
            liger = LigerRMSNorm(weight.shape[0], eps=child.variance_epsilon, offset=0.0, casting_mode="llama",
                                 in_place=False).to(device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                liger.weight.copy_(weight)
            setattr(parent, name, liger)
