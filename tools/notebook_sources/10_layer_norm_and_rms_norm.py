# %% [markdown]
# # 10 · LayerNorm and RMSNorm: phases, dtypes, modules, `torch.compile`
#
# For each row $x \in \mathbb{R}^N$:
#
# $$\text{LayerNorm:}\quad y = \frac{x-\mu}{\sqrt{\sigma^2+\epsilon}}\, w + b,
# \qquad \mu = \tfrac{1}{N}\textstyle\sum_i x_i,\quad \sigma^2 = \tfrac{1}{N}\sum_i (x_i-\mu)^2$$
#
# $$\text{RMSNorm:}\quad y = \frac{x}{\sqrt{\tfrac{1}{N}\sum_i x_i^2+\epsilon}}\, w$$
#
# The backward needs the per-row statistics: `mean` and `rstd` $= 1/\sqrt{\sigma^2+\epsilon}$
# for LayerNorm, `rstd` alone for RMSNorm. cuDNN therefore has three graphs per op:
#
# | phase | runs when | writes |
# |---|---|---|
# | `train` | grad mode on and an argument requires grad | `y`, fp32 `mean`/`rstd` |
# | `infer` | otherwise (`torch.no_grad()`, inference) | `y` only |
# | `bwd` | in `loss.backward()` | `dx`, fp32 `dw` (and `db`) |
#
# cudnorm picks the phase from the call, so nothing changes in user code.

# %%
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import reference

device = "cuda" if torch.cuda.is_available() else "cpu"
rows, hidden = (8192, 2048) if device == "cuda" else (256, 512)
print(device, cudnorm.serving_path("rms_norm", torch.empty(0, device=device)))

# %% [markdown]
# Tolerances for comparing two results of the same dtype: both round to the dtype at the
# end, so they may differ by a rounding step or two (the spacing of numbers near 1.0 is
# $2^{-23}$ in fp32, $2^{-10}$ in fp16, $2^{-7}$ in bf16). fp32 gets more room than one step
# because the two sides sum the row in a different order.

# %%
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}

# %% [markdown]
# ## Phases
#
# The same call runs the inference graph under `torch.no_grad()` and the training graph
# when autograd needs the statistics. On a GPU each is built once and then served from the
# plan cache; `cache_info()` counts builds and hits (on the CPU there is nothing to build).

# %%
torch.manual_seed(0)
x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
w = torch.ones(hidden, device=device, requires_grad=True)

cudnorm.clear_cache()
with torch.no_grad():
    cudnorm.rms_norm(x, (hidden,), w)          # infer graph
y = cudnorm.rms_norm(x, (hidden,), w)          # train graph (w requires grad)
y.float().square().mean().backward()           # bwd graph
cudnorm.rms_norm(x, (hidden,), w)              # train graph again: a cache hit
print(cudnorm.cache_info())

# %% [markdown]
# ## Dtypes
#
# fp32, fp16 and bf16 activations, each with fp32 weights (mixed-precision master weights)
# and with weights in the activation dtype. The forward is compared with PyTorch at the
# tolerances above. Gradients are sums over rows, whose elementwise error grows with their
# size, so they are judged the way the test suite judges them: the relative error against an
# fp64 reference must be at most twice PyTorch's own error in the same dtype
# (`cudnorm.reference.accuracy_report`).

# %%
def check(op, dtype, weight_dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, hidden, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, weight_dtype)
    b = (0.1 * torch.randn(hidden, generator=g)).to(device, weight_dtype)
    dy = torch.randn(rows, hidden, generator=g).to(device, dtype)
    if op == "layer_norm":
        # PyTorch's baseline rounds the weights to x's dtype, as cudnorm's forward does
        mine = lambda x, w, b: cudnorm.layer_norm(x, (hidden,), w, b, 1e-5)
        theirs = lambda x, w, b: F.layer_norm(x, (hidden,), w.to(x.dtype), b.to(x.dtype), 1e-5)
        ref = lambda x, w, b: reference.layer_norm(x, w, b, 1e-5)
        inputs, names = (x, w, b), ["y", "dx", "dw", "db"]
    else:
        mine = lambda x, w: cudnorm.rms_norm(x, (hidden,), w, 1e-6)
        theirs = lambda x, w: F.rms_norm(x, (hidden,), w.to(x.dtype), 1e-6)
        ref = lambda x, w: reference.rms_norm(x, w, 1e-6)
        inputs, names = (x, w), ["y", "dx", "dw"]
    with torch.no_grad():
        torch.testing.assert_close(mine(*inputs), theirs(*inputs), **TOLERANCE[dtype])
    report = reference.accuracy_report(mine, theirs, ref, inputs, dy, names, dtype)
    for r in report:
        assert r["ok"], (op, dtype, weight_dtype, r)
    return {r["name"]: f"{r['error']:.1e} (torch {r['torch_error']:.1e})" for r in report}


for op in ("layer_norm", "rms_norm"):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for weight_dtype in dict.fromkeys((torch.float32, dtype)):
            errors = check(op, dtype, weight_dtype)
            print(f"{op:<10} x {str(dtype)[6:]:<8} w {str(weight_dtype)[6:]:<8}", errors)

# %% [markdown]
# ## Modules
#
# `cudnorm.LayerNorm` and `cudnorm.RMSNorm` subclass PyTorch's modules: same constructor,
# parameters and `state_dict` keys, so checkpoints move both ways.

# %%
torch_ln = torch.nn.LayerNorm(hidden, eps=1e-6, device=device)
torch.nn.init.normal_(torch_ln.weight, 1.0, 0.1)
ours = cudnorm.LayerNorm(hidden, eps=1e-6, device=device)
ours.load_state_dict(torch_ln.state_dict())
torch_rms = torch.nn.RMSNorm(hidden, device=device)
ours_rms = cudnorm.RMSNorm(hidden, device=device)
ours_rms.load_state_dict(torch_rms.state_dict())
print(ours, ours_rms)

x = torch.randn(4, rows // 4, hidden, device=device)
with torch.no_grad():
    torch.testing.assert_close(ours(x), torch_ln(x), **TOLERANCE[torch.float32])
    torch.testing.assert_close(ours_rms(x), torch_rms(x), **TOLERANCE[torch.float32])
print("modules match torch.nn.LayerNorm / torch.nn.RMSNorm")

# %% [markdown]
# ## `torch.compile`
#
# The ops are `torch.library` custom ops with fake (meta) implementations and registered
# autograd, so a model using them compiles with `fullgraph=True` (no graph breaks): the
# compiler fuses the code around the norm and calls cudnorm for the norm itself.

# %%
class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = cudnorm.RMSNorm(dim, eps=1e-6)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.proj(torch.nn.functional.gelu(self.norm(x)))


torch.manual_seed(0)
block = Block(hidden).to(device)
compiled = torch.compile(block, fullgraph=True)
x = torch.randn(rows, hidden, device=device, requires_grad=True)

eager_out = block(x)
eager_out.sum().backward()
eager_grad, x.grad = x.grad, None
compiled_out = compiled(x)
compiled_out.sum().backward()

# fp32 throughout; the compiled graph fuses the pointwise ops, which reorders roundings
torch.testing.assert_close(compiled_out, eager_out, atol=1e-4, rtol=1e-4)
torch.testing.assert_close(x.grad, eager_grad, atol=1e-4, rtol=1e-4)
print("compiled == eager, forward and backward")
