# %% [markdown]
# # 20 · Adaptive LayerNorm: forward training and backward
#
# Adaptive LayerNorm (AdaLN) normalises each token like a LayerNorm without its own
# parameters, then modulates it with a scale and shift that belong to the *sample*
# (in diffusion transformers they are computed from the timestep and class or text):
#
# $$y_{b,t} = \frac{x_{b,t}-\mu_{b,t}}{\sqrt{\sigma^2_{b,t}+\epsilon}}\cdot\gamma_b+\beta_b$$
#
# $\mu_{b,t}$ and $\sigma^2_{b,t}$ are the mean and variance of token $t$ of sample $b$ over
# its $D$ features; $\gamma_b, \beta_b \in \mathbb{R}^D$ are shared by the tokens of sample
# $b$ only (a plain LayerNorm shares one $\gamma, \beta$ across the whole batch). DiT's
# `modulate` uses $(1+\gamma_b)$ instead of $\gamma_b$: pass `one_plus_scale=True`.
#
# This notebook follows the flow of cuDNN-frontend's adaptive LayerNorm sample: forward
# (training phase, which also produces the statistics) and backward on a
# $(4, 1024, 768)$ fp16 input, each checked against PyTorch. It does it twice: through
# cudnorm's functional API, then one level down through the graph-builder layer that the
# functional API uses. (The graph-builder cells need the cuDNN frontend; without it, as in
# the README's CPU set-up, each says in one line what it would show and the rest runs.)

# %%
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _cache, _dispatch, _graphs
from cudnorm._spec import NormSpec

device = "cuda" if torch.cuda.is_available() else "cpu"
batch, seq, dim = 4, 1024, 768
eps = 1e-3  # large enough to matter in the check of rstd
dtype = torch.float16
print(device, "->", cudnorm.serving_path("ada_layer_norm", torch.empty(0, device=device, dtype=dtype)))
info = cudnorm.info()
has_frontend = info["cudnn_frontend"] is not None  # it describes cuDNN graphs (on a CPU too)
NO_FRONTEND = ("no cuDNN frontend: this cell would print the {} graph's nodes and tensors; "
               'pip install -e ".[frontend]" brings it')

# %% [markdown]
# ### Tolerances
#
# fp16 keeps 11 significant bits, so one rounding step is $2^{-11}$ relative. PyTorch's
# eager formula `layer_norm(x) * scale + shift` rounds to fp16 three times, cudnorm once,
# so elementwise results (`y`, `dx`) may differ by a couple of steps: `atol=5e-3,
# rtol=3e-3`. The scale and shift gradients are sums over the 1024 tokens of a sample;
# the rounding error of a sum grows with the size of its terms, not of the result, so
# those are compared at two fp16 steps of the largest gradient.

# %%
ELEMENTWISE = dict(atol=5e-3, rtol=3e-3)


def token_sum_tolerance(expected):
    return dict(atol=2 * 2**-10 * expected.abs().max().item(), rtol=3e-3)

# %% [markdown]
# ## 1. Through the functional API
#
# ### Forward (training phase)

# %%
torch.manual_seed(1)
x = torch.randn(batch, seq, dim, device=device, dtype=dtype, requires_grad=True)
scale = torch.randn(batch, 1, dim, device=device, dtype=dtype, requires_grad=True)
shift = torch.randn(batch, 1, dim, device=device, dtype=dtype, requires_grad=True)

y = cudnorm.ada_layer_norm(x, scale, shift, eps=eps)

y_ref = F.layer_norm(x, (dim,), eps=eps) * scale + shift
torch.testing.assert_close(y, y_ref, **ELEMENTWISE)
print("y matches PyTorch:", tuple(y.shape), y.dtype)

# %% [markdown]
# The training-phase forward also writes the per-token mean and inverse standard deviation
# (fp32) that the backward reads. The functional API keeps them inside autograd; the op
# underneath returns them in one buffer (mean in row 0, rstd in row 1, each padded to a
# multiple of 4 tokens so that both rows start 16-byte aligned), so we can check them as well.

# %%
with torch.no_grad():
    _, stats = torch.ops.cudnorm.ada_layer_norm_fwd(x, scale.view(batch, dim), shift.view(batch, dim), eps,
                                                    False, True)
mean, rstd = stats[0, :x[..., 0].numel()], stats[1, :x[..., 0].numel()]
x32 = x.detach().float()
mean_ref = x32.mean(-1).flatten()
rstd_ref = torch.rsqrt(x32.var(-1, correction=0) + eps).flatten()  # population variance
# fp32 statistics of fp16 data: they differ only by summation order
torch.testing.assert_close(mean, mean_ref, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(rstd, rstd_ref, atol=1e-5, rtol=1e-5)
print("mean and rstd match:", tuple(mean.shape), mean.dtype)

# %% [markdown]
# ### Backward
#
# The upstream gradient is a unit-scale random tensor. (A mean-reduced loss over three
# million elements would make every gradient about $10^{-6}$, below the absolute
# tolerance, and the comparison would pass whatever the result.)

# %%
dy = torch.randn_like(y)
dx, dscale, dshift = torch.autograd.grad(y, (x, scale, shift), dy)
dx_ref, dscale_ref, dshift_ref = torch.autograd.grad(y_ref, (x, scale, shift), dy)

torch.testing.assert_close(dx, dx_ref, **ELEMENTWISE)
torch.testing.assert_close(dscale, dscale_ref, **token_sum_tolerance(dscale_ref))
torch.testing.assert_close(dshift, dshift_ref, **token_sum_tolerance(dshift_ref))
print("dx, dscale, dshift match PyTorch:", tuple(dx.shape), tuple(dscale.shape), dscale.dtype)

# %% [markdown]
# ## 2. Through the graph-builder layer
#
# Below the functional API, every cuDNN graph is described by a `NormSpec` (op, phase,
# shape, dtypes, device, options: the key of the plan cache). `build_ir` turns a spec into
# a cuDNN-frontend graph without touching a GPU; `get_plan` validates, builds and caches it
# on the GPU, and `Plan.run` executes it with one buffer per role, in the order
# `_graphs.roles(spec)` lists them. A buffer in the wrong slot is read as that slot's tensor
# (a fault or wrong numbers, not an error), so the cells below name each buffer by its role.
#
# ### Forward (training phase)

# %%
device_index = torch.cuda.current_device() if device == "cuda" else 0
fwd_spec = NormSpec("ada_layer_norm", "train", rows=batch * seq, cols=dim, x_dtype=dtype, scale_dtype=dtype,
                    device_index=device_index, batch=batch)
if has_frontend:
    fwd_graph, fwd_uids = _graphs.build_ir(fwd_spec)
    ir = fwd_graph.inspect()
    print("nodes:", [(n["name"], n["type"]) for n in ir["nodes"]])
    for name, t in ir["tensors"].items():
        print(f"  {name:<20} dims {t['dim']!s:<18} {t['dtype']:<16} uid {t['uid']}")
else:
    print(NO_FRONTEND.format("forward"))
print("Plan.run buffer order:", _graphs.roles(fwd_spec))

# %% [markdown]
# The IR above is what cuDNN receives. On a GPU we now build it and run it, and compare
# with the PyTorch results of part 1. (On the CPU there is nothing to build: building
# needs a GPU, which is why the CPU path runs PyTorch's kernels.)

# %%
if info["cudnn_available"]:
    plan = _cache.get_plan(fwd_spec)
    assert plan is not None, "cuDNN declined the graph"
    print("plan:", plan.plan_name, f"(built in {plan.build_seconds:.2f} s)")
    x2 = x.detach().reshape(batch * seq, dim)
    scale2, shift2 = scale.detach().reshape(batch, dim), shift.detach().reshape(batch, dim)
    y_graph = torch.empty_like(x2)
    mean_graph = torch.empty(batch * seq, device=device)
    rstd_graph = torch.empty(batch * seq, device=device)
    fwd_buffers = {"x": x2, "scale": scale2, "bias": shift2, "eps": _graphs.host_scalar(eps, fwd_spec),
                   "y": y_graph, "mean": mean_graph, "rstd": rstd_graph}
    plan.run(*(fwd_buffers[role] for role in _graphs.roles(fwd_spec)))
    torch.testing.assert_close(y_graph.view_as(y_ref), y_ref, **ELEMENTWISE)
    torch.testing.assert_close(mean_graph, mean_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd_graph, rstd_ref, atol=1e-5, rtol=1e-5)
    print("graph forward matches PyTorch")
else:
    print(f"cuDNN cannot run here ({info['cudnn_reason']}): the graph was not built")

# %% [markdown]
# ### Backward
#
# cuDNN's adaptive LayerNorm backward graph reads `x`, the per-sample scale, the upstream
# gradient and the saved statistics, and writes `dx` and the per-sample `dscale`/`dshift`
# (here in fp16, the scale's dtype). The functional API may serve the backward another way
# for speed (see the AdaLN page of the docs); this cell runs cuDNN's own graph directly.

# %%
bwd_spec = NormSpec("ada_layer_norm", "bwd", rows=batch * seq, cols=dim, x_dtype=dtype, scale_dtype=dtype,
                    device_index=device_index, batch=batch)
if has_frontend:
    bwd_graph, _ = _graphs.build_ir(bwd_spec)
    print("nodes:", [(n["name"], n["type"]) for n in bwd_graph.inspect()["nodes"]])
else:
    print(NO_FRONTEND.format("backward"))
print("Plan.run buffer order:", _graphs.roles(bwd_spec))

if info["cudnn_available"]:
    bwd_plan = _cache.get_plan(bwd_spec)
    assert bwd_plan is not None, "cuDNN declined the graph"
    dx_graph = torch.empty_like(x2)
    dscale_graph = torch.empty(batch, dim, device=device, dtype=dtype)
    dshift_graph = torch.empty(batch, dim, device=device, dtype=dtype)
    # the graph's "dbias" output is the shift's gradient
    bwd_buffers = {"x": x2, "scale": scale2, "mean": mean_graph, "rstd": rstd_graph, "dy": dy.reshape(batch * seq, dim),
                   "dx": dx_graph, "dscale": dscale_graph, "dbias": dshift_graph}
    bwd_plan.run(*(bwd_buffers[role] for role in _graphs.roles(bwd_spec)))
    torch.testing.assert_close(dx_graph.view_as(dx_ref), dx_ref, **ELEMENTWISE)
    torch.testing.assert_close(dscale_graph.view_as(dscale_ref), dscale_ref, **token_sum_tolerance(dscale_ref))
    torch.testing.assert_close(dshift_graph.view_as(dshift_ref), dshift_ref, **token_sum_tolerance(dshift_ref))
    print("graph backward matches PyTorch")
else:
    print(f"cuDNN cannot run here ({info['cudnn_reason']}): the graph was not built")
