# %% [markdown]
# # 60 · Patching a transformers model
#
# `cudnorm.patch(model)` makes the norms of a PyTorch, transformers or diffusers model run
# cudnorm's ops, in place: `torch.nn.LayerNorm`, `torch.nn.RMSNorm`, 185 transformers
# norm classes (Llama's family, Gemma's, OLMo 2's, T5's, Cohere's, ...) and diffusers' RMSNorm
# and AdaLN classes (docs/patching.md lists them). It swaps the computation,
# not the module: each norm stays **the same object** with the same parameters and hooks and
# gets a subclass of its class whose forward runs cudnorm, so state_dict keys, tied weights,
# optimizer state and `save_pretrained` / `from_pretrained` are untouched. It returns a report
# of what it swapped and what it left, with the reason.
#
# **The math** of Llama's RMSNorm, per row $x \in \mathbb{R}^N$, in fp32 and then cast back
# to the input's dtype before the weight:
#
# $$y = w \cdot \mathrm{cast}\Big(\frac{x}{\sqrt{\tfrac{1}{N}\sum_i x_i^2+\epsilon}}\Big)$$
#
# cudnorm computes the same in one kernel and rounds once, so outputs agree to one rounding
# step of the activation dtype (exactly, in fp32 on the CPU).

# %%
import tempfile

import torch
import transformers

import cudnorm

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
print(device, dtype, "transformers", transformers.__version__)

# %% [markdown]
# ## A small Llama from a config
#
# Random weights, with norm weights away from 1 so that the norms matter.

# %%
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
model = transformers.LlamaForCausalLM(config).to(device, dtype).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.1 * torch.randn_like(p))
ids = torch.randint(0, 256, (2, 64), device=device)
with torch.no_grad():
    before = model(ids).logits

# %% [markdown]
# ## Patch

# %%
keys = list(model.state_dict())
norm = model.model.layers[0].input_layernorm
report = cudnorm.patch(model)
print(report)
print(norm, "is a", type(norm).__mro__[1].__name__, "running", type(norm)._cudnorm_formula.name)
assert model.model.layers[0].input_layernorm is norm  # the same module, its class swapped
assert list(model.state_dict()) == keys  # checkpoints load as before

# %% [markdown]
# ## Check against the unpatched model
#
# Tolerance: in fp32 (CPU) the patched model computes exactly what the original does; in bf16
# (GPU) each norm may round once differently (cudnorm rounds the product $w \cdot \hat x$ once,
# Llama rounds $\hat x$ and then the product), and the difference travels through two layers:
# a few bf16 steps on logits of size ~1.

# %%
with torch.no_grad():
    after = model(ids).logits
print("max |logits difference|:", (after.float() - before.float()).abs().max().item())
tolerance = {torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
torch.testing.assert_close(after.float(), before.float(), atol=tolerance, rtol=tolerance)

# %% [markdown]
# ## Save and load
#
# The saved checkpoint is a plain Llama checkpoint: the unpatched class loads it.

# %%
with tempfile.TemporaryDirectory() as folder:
    model.save_pretrained(folder)
    loaded = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=dtype).to(device)
for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
    assert torch.equal(a, b), name
print("round trip through save_pretrained / from_pretrained: equal")

# %% [markdown]
# ## Gemma: a weight offset
#
# Gemma's RMSNorm scales by $(1 + w)$ and keeps its weights around zero. `patch` runs it on
# the formula `gemma_rms_norm`, which calls `cudnorm.rms_norm(..., weight_offset=1.0)`: the offset is
# added inside cuDNN's graph in fp32, as Gemma adds it, with no extra kernel. The logits
# match the unpatched model.

# %%
torch.manual_seed(0)
gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16)).eval()
with torch.no_grad():
    for name, p in gemma.named_parameters():
        if "norm" in name:
            p.copy_(0.3 * torch.randn_like(p))
gemma = gemma.to(device)
ids = torch.randint(0, 256, (2, 16), device=device)
with torch.no_grad():
    before = gemma(ids).logits
    print(cudnorm.patch(gemma))
    after = gemma(ids).logits
print(f"largest logit difference after patching: {(after - before).abs().max().item():.2e}")
assert torch.allclose(after, before, rtol=1e-4, atol=1e-4)

# %% [markdown]
# ## T5: the weight's dtype
#
# T5's LayerNorm is an RMSNorm that normalises in fp32 and, when its weight is fp16/bf16,
# casts $\hat x$ to the weight's dtype before multiplying, so it returns the **weight's**
# dtype. That matters in a bf16 T5: `from_pretrained(..., dtype=torch.bfloat16)` keeps the
# `wo` layers in fp32, the residual stream becomes fp32, and the norms get fp32 input with
# bf16 weights and return bf16. `patch` runs T5's norms (and mT5's, UMT5's, LongT5's, ...) on
# the formula `t5_rms_norm`, which returns T5's dtype for every pair of weight and input dtypes.

# %%
torch.manual_seed(0)
t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
    vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0)).eval()
with torch.no_grad():
    for name, p in t5.named_parameters():
        if "layer_norm" in name:
            p.add_(0.1 * torch.randn_like(p))
t5 = t5.to(device)
inputs = {"input_ids": torch.randint(0, 256, (2, 16), device=device),
          "decoder_input_ids": torch.randint(0, 256, (2, 8), device=device)}
with torch.no_grad():
    before = t5(**inputs).logits
    print(cudnorm.patch(t5))
    after = t5(**inputs).logits
print(f"largest logit difference after patching: {(after - before).abs().max().item():.2e}")
assert torch.allclose(after, before, rtol=1e-4, atol=1e-4)

# %% [markdown]
# One norm with a bf16 weight on fp32 input, before and after patching: both return bf16.
# Tolerance: T5 rounds $\hat x$ to bf16 and then the product; cudnorm computes in fp32 and
# rounds once, so they differ by about one bf16 step ($2^{-8}$ relative).

# %%
norm = transformers.models.t5.modeling_t5.T5LayerNorm(64).to(device, torch.bfloat16)
x = torch.randn(4, 64, device=device)
want = norm(x)
print(cudnorm.patch(norm))  # a single norm patches too
got = norm(x)
print("patched returns", got.dtype, "| T5LayerNorm returned", want.dtype)
assert got.dtype == want.dtype == torch.bfloat16
torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
