# %% [markdown]
# # 30 · Training a DiT block with `AdaLayerNormZero`
#
# A diffusion transformer (DiT) block modulates both of its sub-layers with adaLN-Zero:
# from the conditioning vector $c$ (timestep, class), a linear layer that starts at zero
# produces six per-sample vectors, and
#
# $$h = x + g_1 \odot \text{Attn}\big(\text{LN}(x)\,(1+s_1) + t_1\big),\qquad
# y = h + g_2 \odot \text{MLP}\big(\text{LN}(h)\,(1+s_2) + t_2\big)$$
#
# with shifts $t_i$, scales $s_i$ and gates $g_i$ in $\mathbb{R}^{B\times D}$, broadcast over
# the tokens. $\text{LN}$ has no parameters of its own. Because the gates start at zero,
# the block starts as the identity.
#
# `cudnorm.AdaLayerNormZero` is the SiLU → Linear → chunk → modulated LayerNorm part;
# `cudnorm.AdaLayerNorm` is the second modulated LayerNorm. The model, the synthetic data
# and the training loop come from `examples/dit_block.py`, which builds the same block twice:
# on cudnorm's modules and as the DiT reference code writes it in plain PyTorch.

# %%
import sys
import tempfile
from pathlib import Path

import torch
from IPython.display import Image, display

sys.path.insert(0, str(Path.cwd().parent / "examples"))  # the notebooks run from notebooks/
import dit_block  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 autocast is how DiTs train on GPUs; the CPU run stays in fp32
dtype_name = "bfloat16" if device == "cuda" else "float32"
steps = 300
print(device, dtype_name, steps, "steps")

# %% [markdown]
# ## One block, checked against PyTorch
#
# Both models are built from one seed with identical weights. At initialisation the
# modulation is zero, which would make any comparison trivial, so for this check the
# modulation layers get the same random weights first. Both blocks then run in fp32, and the
# only difference is the order of rounding inside the norm: the tolerance is a few fp32
# steps ($2^{-23}$ relative), amplified by the attention and MLP that follow.

# %%
dim, heads, in_dim, cond_dim = 64, 4, 16, 32
plain, fused = dit_block.build_models(dim, heads, in_dim, cond_dim, seed=0)
print(fused.block)

with torch.no_grad():
    modulation = torch.randn(6 * dim, cond_dim) * 0.1
    plain.block.adaLN_modulation[1].weight.copy_(modulation)
    fused.block.norm1.linear.weight.copy_(modulation)

plain, fused = plain.to(device), fused.to(device)
g = torch.Generator().manual_seed(0)
x = torch.randn(8, 32, in_dim, generator=g).to(device)
c = torch.randn(8, cond_dim, generator=g).to(device)
x_plain, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
out_plain, out_fused = plain(x_plain, c), fused(x_fused, c)
torch.testing.assert_close(out_fused, out_plain, atol=1e-5, rtol=1e-5)
out_plain.square().sum().backward()
out_fused.square().sum().backward()
torch.testing.assert_close(x_fused.grad, x_plain.grad, atol=1e-5, rtol=1e-5)
weight_grad_plain = plain.block.adaLN_modulation[1].weight.grad
torch.testing.assert_close(fused.block.norm1.linear.weight.grad, weight_grad_plain, atol=1e-4, rtol=1e-4)
print("forward, input gradient and modulation-weight gradient match PyTorch")

# %% [markdown]
# ## Training
#
# `dit_block.run` trains both models from the same initial weights (modulation at zero, as
# DiT initialises it) on the same synthetic batches: a fixed "teacher" function mixes the
# tokens and gates them by the condition, and the model learns it with AdamW on an MSE loss.

# %%
plot_path = Path(tempfile.mkdtemp(prefix="cudnorm-dit-")) / "dit_block_loss.png"
result = dit_block.run(device, dtype_name, steps=steps, out=str(plot_path))
if plot_path.exists():
    display(Image(filename=str(plot_path)))

# %% [markdown]
# ## Check
#
# The two loss curves must agree step by step within the example's tolerance for this dtype
# (fp32: the models differ only by rounding order; bf16: PyTorch's LayerNorm runs in fp32
# under autocast while cudnorm runs in bf16, so the curves drift apart by bf16 rounding),
# and the model must have learned something.

# %%
curves = result["curves"]
torch_curve, cudnorm_curve = curves["PyTorch (nn.LayerNorm + modulate)"], curves["cudnorm (AdaLayerNormZero)"]
tolerance = dit_block.TOLERANCE[dtype_name]
print(f"largest relative gap between the curves: {result['max_relative_gap']:.2e} (tolerance {tolerance:.0e})")
print(f"loss: first step {cudnorm_curve[0]:.4f}, last step {cudnorm_curve[-1]:.4f}")
assert result["max_relative_gap"] <= tolerance
assert cudnorm_curve[-1] < 0.5 * cudnorm_curve[0], "the loss did not fall"

# %%
import shutil  # noqa: E402

shutil.rmtree(plot_path.parent)
