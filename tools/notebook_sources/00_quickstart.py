# %% [markdown]
# # 00 · Quickstart
#
# cudnorm runs LayerNorm, RMSNorm and adaptive LayerNorm on cuDNN-frontend graphs. On a
# CUDA tensor the call runs a cached cuDNN graph; anywhere else (a CPU tensor, no cuDNN,
# a configuration cuDNN declines) the same call runs PyTorch's kernels. This notebook
# runs on both.
#
# **The math.** LayerNorm normalises each row $x \in \mathbb{R}^N$ of the input:
#
# $$\mu = \frac{1}{N}\sum_i x_i,\qquad \sigma^2 = \frac{1}{N}\sum_i (x_i-\mu)^2,\qquad
# y = \frac{x-\mu}{\sqrt{\sigma^2+\epsilon}}\cdot w + b$$

# %% [markdown]
# ## Install
#
# From a checkout of the repository (cudnorm is not on PyPI). On a GPU, pick the extra that
# matches the CUDA major version of your PyTorch build (it brings the cuDNN frontend and
# runtime); on a CPU, install PyTorch's CPU build first and no extra:
#
# ```bash
# pip install -e ".[cu13]"   # torch built for CUDA 13.x (".[cu12]" for CUDA 12.x)
# pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install -e .   # CPU only
# ```
#
# ## Setup
#
# `cudnorm info` (here called in-process; in a shell run `cudnorm info`) prints the
# versions and which kernels serve each op on this machine.

# %%
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm.cli import main as cudnorm_cli

cudnorm_cli(["info"])

# %%
device = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 is the usual training dtype on Ampere and newer; the CPU fallback runs it too
dtype = torch.bfloat16
print(device, dtype, "->", cudnorm.serving_path("layer_norm", torch.empty(0, device=device, dtype=dtype)))

# %% [markdown]
# ## Run
#
# `cudnorm.layer_norm` takes the arguments of `torch.nn.functional.layer_norm`. Weight and
# bias may stay in fp32 (mixed-precision master weights) while the activations are bf16.

# %%
torch.manual_seed(0)
tokens, hidden = (4096, 1024) if device == "cuda" else (256, 1024)
x = torch.randn(tokens, hidden, device=device, dtype=dtype)
weight = 1 + 0.1 * torch.randn(hidden, device=device)
bias = 0.1 * torch.randn(hidden, device=device)

y = cudnorm.layer_norm(x, (hidden,), weight, bias, eps=1e-5)
print(y.shape, y.dtype, y.device)

# %% [markdown]
# ## Check against PyTorch
#
# The forward rounds fp32 weights to the activation dtype (as `torch.autocast` does), so
# the PyTorch baseline gets bf16 weights too. Both results are bf16, whose spacing near
# 1.0 is $2^{-7} \approx 7.8\cdot10^{-3}$: one rounding step apart is the expected
# disagreement, hence `atol = rtol = 1.6e-2` (two bf16 steps).

# %%
expected = F.layer_norm(x, (hidden,), weight.to(dtype), bias.to(dtype), eps=1e-5)
torch.testing.assert_close(y, expected, atol=1.6e-2, rtol=1.6e-2)
print("matches torch.nn.functional.layer_norm")

# %% [markdown]
# A cuDNN graph is built once per configuration (op, phase, shape, dtypes, device) and
# cached; later calls with the same configuration reuse it. On the CPU nothing is built.

# %%
cudnorm.layer_norm(x, (hidden,), weight, bias)
print(cudnorm.cache_info())
