"""cudnorm under DDP, FSDP2 and tensor + sequence parallelism, in 2 processes.

Each test spawns 2 workers (gloo on the CPU; in the ``gpu``-marked cases nccl on
``cuda:<rank>``, which needs 2 GPUs, and gloo with both ranks on ``cuda:0`` for DDP and FSDP2). A worker runs one scenario and saves what it saw (losses, norm
outputs, placements, the autograd nodes of the norm outputs, module counts) to one file per
rank; the test process makes every assertion on those files.

* DDP: a small attention-free DiT (adaLN-Zero blocks) on cudnorm's AdaLN modules trains like
  the same model on ``nn.LayerNorm`` + DiT's eager ``modulate`` (same init, same data).
* FSDP2: a Llama-style pre-norm stack on ``cudnorm.RMSNorm`` under ``fully_shard`` trains like
  the same stack on ``torch.nn.RMSNorm`` under ``fully_shard`` (fp32, and bf16 parameters with
  fp32 gradient reduction).
* TP + SP: the same stack under ``parallelize_module`` (``SequenceParallel`` norms,
  column/row-wise MLP linears) computes what the unsharded model computes in one process; the
  norm outputs are DTensors sharded on the sequence dim.

DDP, FSDP2 and TP + SP run twice: under ``policy="auto"`` (on the CPU and for small GPU calls
this hands every norm to PyTorch's op, DTensors at every size) and under ``policy="cudnn"``,
which sends every norm through cudnorm's own ops (its PyTorch fallback kernels on the CPU,
cuDNN's graphs on a GPU; DTensors through the sharding rules of cudnorm._sharding); the tests
check which autograd node produced each norm output. The TP workers also call each public
function on DTensors placed every way (batch, sequence, replicated, and sharded on the
normalised dim), checked against the same call on whole tensors; tests/test_sharding.py
runs more such calls in one process.
"""

from __future__ import annotations

import gc
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.slow  # every test spawns WORLD processes (tests/test_sharding.py runs the rules in one)

WORLD = 2
STEPS = 20  # DDP and FSDP2 training steps
TP_STEPS = 5
DIM, HIDDEN, COND, TOKENS, BATCH, VOCAB = 64, 128, 32, 16, 4, 128
SPAWN_TIMEOUT_S = 240

# fp32 losses of a cudnorm model against its PyTorch twin: with policy="auto" on the CPU they
# run the same kernels; with policy="cudnn" cudnorm's fallback recomputes in another order
# (cuDNN on a GPU), so they may differ by rounding, compounded over the steps
FP32_TOL = {"cpu": dict(rtol=1e-5, atol=1e-6), "cuda": dict(rtol=1e-4, atol=1e-5)}
FP32_TOL["emulated"], FP32_TOL["shared-gpu"] = FP32_TOL["cpu"], FP32_TOL["cuda"]
# TP against one process: sharded matmuls sum their partial products in another order (and a
# norm's weight gradient, summed per rank and then across the ranks)
TP_TOL = {"cpu": dict(rtol=1e-5, atol=1e-5), "cuda": dict(rtol=1e-4, atol=1e-4)}
TP_TOL["emulated"], TP_TOL["shared-gpu"] = TP_TOL["cpu"], TP_TOL["cuda"]
# bf16 parameters (FSDP2 mixed precision): cudnorm computes in fp32 and rounds once, PyTorch's
# bf16 RMSNorm may round elsewhere; a few bf16 ulps per step
BF16_TOL = dict(rtol=1e-2, atol=1e-2)

BACKENDS = [
    pytest.param("cpu", id="gloo-cpu"),
    # CPU tensors through the cuDNN path's own code, the graphs emulated (tests/emulated_cudnn.py)
    pytest.param("emulated", id="gloo-emulated-cudnn"),
    # both ranks on cuda:0, gloo carrying CUDA tensors: cuDNN's graphs under DDP, FSDP2 and the
    # sharding rules on a one-GPU machine (NCCL refuses two ranks on one device)
    pytest.param("shared-gpu", id="gloo-1gpu", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
    pytest.param("cuda", id="nccl-2gpu", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA GPUs")]),
]
# TP + SP redistributes through DTensor's functional collectives, whose all-gather crashes with
# gloo on CUDA tensors (SIGSEGV in wait_tensor; all_reduce works: torch 2.11, H100), so the
# shared-GPU set-up runs DDP and FSDP2 only
TP_BACKENDS = [param for param in BACKENDS if param.id != "gloo-1gpu"]


# -- models ----------------------------------------------------------------------------------
def modulate(h, shift, scale):
    """DiT's eager formula."""
    return h * (1 + scale[:, None]) + shift[:, None]


class TorchAdaLN(nn.Module):
    """``nn.LayerNorm`` + ``modulate``: the reference of ``cudnorm.AdaLayerNorm`` (no parameters)."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, shift, scale):
        return modulate(self.norm(x), shift, scale)


class TorchAdaLNZero(nn.Module):
    """The reference of ``cudnorm.AdaLayerNormZero`` (same parameter names and chunk order)."""

    def __init__(self, dim, cond_dim):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(cond_dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(self.silu(emb)).chunk(6, dim=1)
        return modulate(self.norm(x), shift_msa, scale_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp


class TorchAdaLNContinuous(nn.Module):
    """The reference of ``cudnorm.AdaLayerNormContinuous`` without affine norm: ``(scale, shift)``."""

    def __init__(self, dim, cond_dim):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(cond_dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        scale, shift = self.linear(self.silu(emb)).chunk(2, dim=1)
        return modulate(self.norm(x), shift, scale)


def _mlp(width_in, width_out):
    return nn.Sequential(nn.Linear(width_in, 4 * width_in), nn.GELU(approximate="tanh"),
                         nn.Linear(4 * width_in, width_out))


class DiTBlock(nn.Module):
    """adaLN-Zero block with token mixing (an MLP across tokens) in place of attention."""

    def __init__(self, ours: bool):
        super().__init__()
        import cudnorm

        self.norm1 = cudnorm.AdaLayerNormZero(DIM, cond_dim=COND) if ours else TorchAdaLNZero(DIM, COND)
        self.norm2 = cudnorm.AdaLayerNorm(DIM) if ours else TorchAdaLN(DIM)
        self.token_mix = _mlp(TOKENS, TOKENS)
        self.mlp = _mlp(DIM, DIM)

    def forward(self, x, emb):
        h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, emb)
        x = x + gate_msa[:, None] * self.token_mix(h.transpose(1, 2)).transpose(1, 2)
        return x + gate_mlp[:, None] * self.mlp(self.norm2(x, shift_mlp, scale_mlp))


class TinyDiT(nn.Module):
    def __init__(self, ours: bool, depth: int = 3):
        super().__init__()
        import cudnorm

        self.cond = nn.Linear(COND, COND)
        self.blocks = nn.ModuleList(DiTBlock(ours) for _ in range(depth))
        self.norm_out = cudnorm.AdaLayerNormContinuous(DIM, cond_dim=COND) if ours else TorchAdaLNContinuous(DIM, COND)
        self.proj_out = nn.Linear(DIM, DIM)

    def forward(self, x, c):
        emb = self.cond(c)
        for block in self.blocks:
            x = block(x, emb)
        return self.proj_out(self.norm_out(x, emb))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """Pre-norm residual MLP block (attention-free)."""

    def __init__(self, norm_cls):
        super().__init__()
        self.ffn_norm = norm_cls(DIM, eps=1e-5)
        self.feed_forward = SwiGLU()

    def forward(self, x):
        return x + self.feed_forward(self.ffn_norm(x))


class LlamaStack(nn.Module):
    def __init__(self, norm_cls, depth: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(LlamaBlock(norm_cls) for _ in range(depth))
        self.norm = norm_cls(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def _randomize(model):
    """Weights away from their identity inits (adaLN-Zero's zero linears, RMSNorm's ones), so
    every norm and modulation changes the loss from step 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ffn_norm.weight") or name == "norm.weight":
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:  # O(1) activations, shifts, scales and gates
                p.normal_(0, p.shape[1] ** -0.5 if p.dim() > 1 else 0.1)


def _twins(make_ours, make_ref):
    """A cudnorm model and its PyTorch reference with the same weights (strict key match)."""
    torch.manual_seed(1234)
    ours = make_ours()
    _randomize(ours)
    ref = make_ref()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


# -- what the workers record ----------------------------------------------------------------
_VIEWS = {"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"}


def _node(t: torch.Tensor) -> str:
    """The name of the autograd node that made ``t``, looking through reshapes."""
    node = t.grad_fn
    while node is not None and node.name() in _VIEWS:
        node = node.next_functions[0][0]
    return "None" if node is None else node.name()


# cudnorm's autograd nodes: the native launch path's (cudnorm/csrc/autograd.cpp), the Python
# path's eager autograd.Function, and the Python path's op as traced code and DTensor reach it
_NATIVE_NODES = {"layer_norm": "CudnormLayerNormBackward", "rms_norm": "CudnormRMSNormBackward",
                 "ada_layer_norm": "CudnormAdaLayerNormBackward"}
_EAGER_NODES = {"layer_norm": "_LayerNormFunctionBackward", "rms_norm": "_RMSNormFunctionBackward",
                "ada_layer_norm": "_AdaLayerNormFunctionBackward"}


def _ours(op: str, native: bool, eager: bool = True) -> str:
    """The node cudnorm's ``op`` leaves on its output: ``native``: the native path was active;
    ``eager``: a plain-tensor call (else a DTensor's, through the op and its sharding rule)."""
    if native:
        return _NATIVE_NODES[op]
    return _EAGER_NODES[op] if eager else f"GeneratedBackwardFor_cudnorm_{op}_fwd_defaultBackward"


def _native_active() -> bool:
    """Whether this worker's cudnorm calls ran on the native launch path (recorded after them)."""
    from cudnorm import _entry

    return bool(_entry.native)


def _cudnorm_modules(model) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("cudnorm")})


NORM_NAMES = {"norm1", "norm2", "norm_out", "ffn_norm"}


def _norms(model) -> list[nn.Module]:
    """The model's norm modules, cudnorm's or PyTorch's (not the LayerNorm inside an AdaLN module)."""
    return [m for name, m in model.named_modules() if name.rpartition(".")[2] in NORM_NAMES or name == "norm"]


def _hook_outputs(model, record: list):
    """Forward hooks on the model's norms: each call appends its (first) output tensor."""
    return [m.register_forward_hook(lambda mod, args, out: record.append(out[0] if isinstance(out, tuple) else out))
            for m in _norms(model)]


def _cudnorm_config(policy, device):
    import cudnorm

    # never the user's on-disk plan store; on a GPU every row count gets its exact graph, as in conftest
    extra = dict(exact_rows=1_000_000, exact_after=1) if device.type == "cuda" else {}
    return cudnorm.config(policy=policy, plan_store=False, **extra)


# -- scenarios (run in each worker) ----------------------------------------------------------
def _scenario_ddp(rank, device):
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    teacher = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(99)) / DIM**0.5  # one task
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own data: DDP must average
    xs = [torch.randn(BATCH, TOKENS, DIM, generator=gen) for _ in range(STEPS)]
    data = [(x, torch.randn(BATCH, COND, generator=gen), torch.tanh(x @ teacher)) for x in xs]
    for policy in ("auto", "cudnn"):
        with _cudnorm_config(policy, device):
            ours, ref = _twins(lambda: TinyDiT(True), lambda: TinyDiT(False))
            rec = {"modules_ours": _cudnorm_modules(ours), "modules_ref": _cudnorm_modules(ref)}
            for label, model in (("ours", ours), ("ref", ref)):
                model = model.to(device)
                seen: list = []
                handles = _hook_outputs(model, seen)
                ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
                opt = torch.optim.AdamW(ddp.parameters(), lr=2e-3, weight_decay=0.01)
                losses = []
                for step, (x, c, target) in enumerate(data):
                    loss = F.mse_loss(ddp(x.to(device), c.to(device)), target.to(device))
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
                    if step == 0:
                        rec[f"nodes_{label}"] = [_node(t) for t in seen]
                        for h in handles:
                            h.remove()
                rec[f"losses_{label}"] = losses
                rec[f"params_{label}"] = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
            rec["native"] = _native_active()
            out[policy] = rec
    return out


def _fsdp2_run(model, mesh, mp_policy, tokens, targets, device):
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    model = model.to(device)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    w = model.layers[0].ffn_norm.weight
    rec = {"norm_weight_type": type(w).__name__, "norm_weight_placements": [repr(p) for p in w.placements],
           "norm_weight_local_shape": list(w.to_local().shape)}
    seen: list = []
    handles = _hook_outputs(model, seen)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step, (t, y) in enumerate(zip(tokens, targets)):
        loss = F.cross_entropy(model(t.to(device)).float().flatten(0, 1), y.to(device).flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            rec["nodes"] = [_node(o) for o in seen]
            rec["norm_out_dtypes"] = [str(o.dtype) for o in seen]
            rec["norm_out_types"] = [type(o).__name__ for o in seen]
            for h in handles:
                h.remove()
    rec["losses"] = losses
    rec["final_norm_weight"] = _gathered(model.norm.weight).cpu()
    return rec


def _gathered(weight):
    """The whole of a parameter FSDP2 sharded on dim 0, by c10d's all-gather: ``full_tensor()``
    takes DTensor's functional collectives, which crash with gloo on CUDA tensors (SIGSEGV in
    ``AsyncCollectiveTensor``, torch 2.11 on an H100)."""
    import torch.distributed as dist

    local = weight.to_local().detach().contiguous()
    whole = local.new_empty((local.shape[0] * WORLD, *local.shape[1:]))
    dist.all_gather_into_tensor(whole, local)
    return whole


def _scenario_fsdp2(rank, device):
    import cudnorm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh(device.type, (WORLD,))
    gen = torch.Generator().manual_seed(200 + rank)
    tokens = [torch.randint(0, VOCAB, (BATCH, TOKENS), generator=gen) for _ in range(STEPS)]
    targets = [(5 * t + 1) % VOCAB for t in tokens]  # a map the stack can learn from fresh batches
    precisions = {"fp32": None,
                  "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    out = {}
    for policy in ("auto", "cudnn"):
        for precision, mp_policy in precisions.items():
            with _cudnorm_config(policy, device):
                ours, ref = _twins(lambda: LlamaStack(cudnorm.RMSNorm), lambda: LlamaStack(nn.RMSNorm))
                rec = {"modules_ours": _cudnorm_modules(ours), "modules_ref": _cudnorm_modules(ref)}
                for label, model in (("ours", ours), ("ref", ref)):
                    for key, value in _fsdp2_run(model, mesh, mp_policy, tokens, targets, device).items():
                        rec[f"{key}_{label}"] = value
                rec["native"] = _native_active()
                out[policy, precision] = rec
    return out


def _tp_run(mesh, device, policy, tokens, targets):
    """One TP + SP training run of the Llama stack against the same stack unsharded, under ``policy``."""
    import cudnorm
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    with _cudnorm_config(policy, device):
        tp_model, single = _twins(lambda: LlamaStack(cudnorm.RMSNorm), lambda: LlamaStack(cudnorm.RMSNorm))
        tp_model, single = tp_model.to(device), single.to(device)
        plan = {
            # embedding rows split over the ranks; its output leaves sharded on the sequence dim
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        for i in range(len(tp_model.layers)):
            plan[f"layers.{i}.ffn_norm"] = SequenceParallel()
            plan[f"layers.{i}.feed_forward.w1"] = ColwiseParallel(input_layouts=Shard(1))
            plan[f"layers.{i}.feed_forward.w3"] = ColwiseParallel(input_layouts=Shard(1))
            plan[f"layers.{i}.feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1))
        parallelize_module(tp_model, mesh, plan)
        rec = {"modules": _cudnorm_modules(tp_model),
               "placements": {name: [repr(p) for p in param.placements] for name, param in tp_model.named_parameters()
                              if isinstance(param, DTensor)},
               "plain_params": [name for name, param in tp_model.named_parameters() if not isinstance(param, DTensor)]}
        opt_tp = torch.optim.SGD(tp_model.parameters(), lr=0.5)
        opt_single = torch.optim.SGD(single.parameters(), lr=0.5)
        losses_tp, losses_single = [], []
        for step in range(TP_STEPS):
            seen_tp: list = []
            seen_single: list = []
            handles = _hook_outputs(tp_model, seen_tp) + _hook_outputs(single, seen_single)
            logits_tp, logits_single = tp_model(tokens[step]), single(tokens[step])
            for h in handles:
                h.remove()
            loss_tp = F.cross_entropy(logits_tp.flatten(0, 1), targets[step].flatten())
            loss_single = F.cross_entropy(logits_single.flatten(0, 1), targets[step].flatten())
            for opt, loss in ((opt_tp, loss_tp), (opt_single, loss_single)):
                opt.zero_grad(set_to_none=True)
                loss.backward()
            if step == 0:
                rec["logits_type"] = type(logits_tp).__name__
                rec["logits_tp"], rec["logits_single"] = logits_tp.detach().cpu(), logits_single.detach().cpu()
                rec["norm_out_types"] = [type(o).__name__ for o in seen_tp]
                rec["norm_out_placements"] = [[repr(p) for p in o.placements] for o in seen_tp]
                rec["norm_out_local_shapes"] = [list(o.to_local().shape) for o in seen_tp]
                rec["nodes_tp"] = [_node(o) for o in seen_tp]
                rec["norm_out_tp"] = [o.full_tensor().detach().cpu() for o in seen_tp]
                rec["norm_out_single"] = [o.detach().cpu() for o in seen_single]
                g = tp_model.layers[0].ffn_norm.weight.grad
                rec["norm_grad_placements"] = [repr(p) for p in g.placements]
                rec["norm_grad_tp"] = g.full_tensor().cpu()
                rec["norm_grad_single"] = single.layers[0].ffn_norm.weight.grad.cpu()
            opt_tp.step()
            opt_single.step()
            losses_tp.append(loss_tp.item())
            losses_single.append(loss_single.item())
        rec["losses_tp"], rec["losses_single"] = losses_tp, losses_single
        rec["final_tp"] = {n: p.full_tensor().detach().cpu() for n, p in tp_model.named_parameters()}
        rec["final_single"] = {n: p.detach().cpu() for n, p in single.named_parameters()}
        rec["native"] = _native_active()
    return rec


def flattens_sequence_shards(mesh) -> bool:
    """Whether this torch's DTensor reshapes ``[B, S, N]`` sharded on ``S`` (over a 1-D ``mesh``)
    into ``[B*S, N]`` rows without a redistribution, as cudnorm.layer_norm/rms_norm do before
    their op: torch 2.13 does (a strided shard of the rows), torch 2.11 raises "Attempted to
    flatten multiple dimensions, with dimension 1 being sharded"."""
    from torch.distributed.tensor import Shard, distribute_tensor

    x = distribute_tensor(torch.zeros(2, 2 * mesh.size(), 2, device=mesh.device_type), mesh, [Shard(1)])
    try:
        x.reshape(-1, 2)
    except RuntimeError:
        return False
    return True


SEQUENCE_SHARD_SKIP = "this torch's DTensor cannot flatten a sequence shard (torch 2.11 cannot, 2.13 can)"
DTENSOR_CALLS = ("layer_norm", "rms_norm", "rms_norm_offset", "ada_layer_norm")
X_PLACEMENTS = ("Shard(dim=0)", "Shard(dim=1)", "Replicate()", "Shard(dim=2)")  # Shard(2): the normalised dim


def _dtensor_calls(mesh, device, sequence_shards: bool):
    """Each public function on DTensors under ``policy="cudnn"`` (cudnorm's ops, placed by
    cudnorm._sharding), ``x: [B, S, D]`` in each of :data:`X_PLACEMENTS`, weights and AdaLN's
    modulation replicated; and the same call on whole plain tensors (``"ref"``). Records the
    autograd node, the placements and full values of the output and of every gradient.
    Without ``sequence_shards`` (:func:`flattens_sequence_shards`) the LayerNorm and RMSNorm
    calls on ``Shard(1)`` are left out."""
    import cudnorm
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(400)  # the same tensors on both ranks
    x = torch.randn(BATCH, TOKENS, DIM, generator=gen)
    w, b = 1 + 0.2 * torch.randn(DIM, generator=gen), 0.1 * torch.randn(DIM, generator=gen)
    scale, shift = 0.5 * torch.randn(BATCH, DIM, generator=gen), 0.5 * torch.randn(BATCH, DIM, generator=gen)
    calls = {"layer_norm": (lambda x, w, b: cudnorm.layer_norm(x, (DIM,), w, b, 1e-5), [w, b]),
             "rms_norm": (lambda x, w: cudnorm.rms_norm(x, (DIM,), w, 1e-5), [w]),
             "rms_norm_offset": (lambda x, w: cudnorm.rms_norm(x, (DIM,), w, 1e-5, weight_offset=1.0), [w - 1]),
             "ada_layer_norm": (lambda x, sc, sh: cudnorm.ada_layer_norm(x, sc, sh, 1e-6, one_plus_scale=True),
                                [scale, shift])}
    placements = dict(zip(X_PLACEMENTS, (Shard(0), Shard(1), Replicate(), Shard(2)), strict=True))
    out = {}
    for name, (fn, params) in calls.items():
        with _cudnorm_config("auto", device):  # plain tensors: no DTensor, one process's answer
            inputs = [t.to(device, copy=True).requires_grad_() for t in (x, *params)]  # x itself stays a constant
            y = fn(*inputs)
            y.pow(2).sum().backward()
            out[name, "ref"] = [y.detach().cpu()] + [t.grad.cpu() for t in inputs]
        for label, placement in placements.items():
            if label == "Shard(dim=1)" and not sequence_shards and name != "ada_layer_norm":
                continue  # AdaLN takes [B, S, D] as it is; the others flatten it
            with _cudnorm_config("cudnn", device):
                inputs = [distribute_tensor(t.to(device), mesh, [placement if t.dim() == 3 else Replicate()])
                          for t in (x, *params)]
                inputs = [t.requires_grad_() for t in inputs]
                y = fn(*inputs)
                # the gradients as the backward op placed them. ``.grad`` may differ: on 2 GPUs
                # (torch 2.11) AdaLN's modulation got Replicate() ``.grad``s, likely AccumulateGrad
                # copying the Partial gradient into a Replicate one (pytorch/pytorch#180486)
                tensors = [y, *torch.autograd.grad(y.pow(2).sum(), inputs)]
                out[name, label] = {"node": _node(y), "native": _native_active(), "placements": [[repr(p) for p in t.placements] for t in tensors],
                                    "values": [t.full_tensor().detach().cpu() for t in tensors]}
    return out


def _scenario_tp(rank, device):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (WORLD,))
    gen = torch.Generator().manual_seed(300)  # the same batch on both ranks: they split one model, not the data
    tokens = [torch.randint(0, VOCAB, (BATCH, TOKENS), generator=gen).to(device) for _ in range(TP_STEPS)]
    targets = [(5 * t + 1) % VOCAB for t in tokens]
    sequence_shards = flattens_sequence_shards(mesh)  # else cudnorm's RMSNorm cannot take SP's activations
    out = {policy: _tp_run(mesh, device, policy, tokens, targets)
           for policy in (("auto", "cudnn") if sequence_shards else ("auto",))}
    out["calls"] = _dtensor_calls(mesh, device, sequence_shards)
    return out


SCENARIOS = {"ddp": _scenario_ddp, "fsdp2": _scenario_fsdp2, "tp": _scenario_tp}


def _worker(rank, scenario, device_type, init_file, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)  # two processes on a small machine
    if device_type in ("cuda", "shared-gpu"):
        device = torch.device("cuda", rank if device_type == "cuda" else 0)
        torch.cuda.set_device(device)
        backend = "nccl" if device_type == "cuda" else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if device_type == "emulated":
        import emulated_cudnn

        emulated_cudnn.install()
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=90))
    try:
        result = {"ok": SCENARIOS[scenario](rank, device)}
        if device_type == "emulated":
            result["emulated_launches"] = sum(emulated_cudnn.launches.values())
        elif device.type == "cuda":
            import cudnorm

            result["cudnn_plans"] = {"built": cudnorm.cache_info().builds, "declined": cudnorm.cache_info().declined}
    except Exception:  # noqa: BLE001 - reported by the test with the worker's traceback
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    # Everything distributed freed, and both ranks done, before the groups are torn down:
    # without that, 1 in 3 to 1 in 10 runs of the FSDP2 and TP examples (torch 2.13, gloo, CPU;
    # with or without cudnorm) aborted at interpreter exit ("terminate called without an
    # active exception")
    del result
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def run_workers(scenario, device_type, tmp_path) -> list[dict]:
    """Spawn 2 workers on ``scenario``; their records, rank 0 first."""
    import torch.multiprocessing as mp

    out_dir = tmp_path / scenario
    out_dir.mkdir()
    ctx = mp.start_processes(_worker, args=(scenario, device_type, str(tmp_path / f"{scenario}.init"), str(out_dir)),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{scenario}: workers still running after {SPAWN_TIMEOUT_S} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    records = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    errors = [f"rank {r}:\n{rec['error']}" for r, rec in enumerate(records) if "error" in rec]
    assert not errors, "\n".join(errors)
    if device_type == "emulated":  # the policy="cudnn" runs reached the (emulated) cuDNN path
        assert all(rec["emulated_launches"] > 0 for rec in records), [rec["emulated_launches"] for rec in records]
    if "cudnn_plans" in records[0]:  # the policy="cudnn" runs built cuDNN graphs, and none was declined
        assert all(rec["cudnn_plans"]["built"] > 0 == rec["cudnn_plans"]["declined"] for rec in records), \
            [rec["cudnn_plans"] for rec in records]
    return [rec["ok"] for rec in records]


def _close(got, want, tol, what):
    """``assert_close`` with a label; lists (of losses) compared in float64."""
    got, want = (torch.tensor(v, dtype=torch.float64) if isinstance(v, list) else v for v in (got, want))
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


# -- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("device_type", BACKENDS)
def test_ddp_dit_trains_like_pytorchs_norms(device_type, tmp_path):
    ranks = run_workers("ddp", device_type, tmp_path)
    for policy in ("auto", "cudnn"):
        for rank, all_recs in enumerate(ranks):
            rec = all_recs[policy]
            where = f"rank {rank}, policy={policy}"
            # (AdaLayerNormContinuous holds a cudnorm.LayerNorm for its optional affine weights)
            assert rec["modules_ours"] == ["AdaLayerNorm", "AdaLayerNormContinuous", "AdaLayerNormZero", "LayerNorm"], \
                (where, rec["modules_ours"])
            assert rec["modules_ref"] == [], where
            # 3 blocks x 2 norms + the output norm, each hooked once
            assert len(rec["nodes_ours"]) == 7 and len(rec["nodes_ref"]) == 7, (where, rec["nodes_ours"])
            if policy == "cudnn":  # cudnorm's own autograd node made every norm output
                assert set(rec["nodes_ours"]) == {_ours("ada_layer_norm", rec["native"])}, (where, rec["nodes_ours"])
            assert not any("AdaLayerNorm" in n for n in rec["nodes_ref"]), (where, rec["nodes_ref"])
            assert len(rec["losses_ours"]) == STEPS
            _close(rec["losses_ours"], rec["losses_ref"], FP32_TOL[device_type], f"{where}: losses")
            assert rec["losses_ours"][-1] < 0.9 * rec["losses_ours"][0], (where, rec["losses_ours"])  # it trains
        # DDP: different data per rank, one set of weights
        assert ranks[0]["auto"]["losses_ours"][0] != ranks[1]["auto"]["losses_ours"][0]
        for label in ("ours", "ref"):
            torch.testing.assert_close(ranks[0][policy][f"params_{label}"], ranks[1][policy][f"params_{label}"],
                                       rtol=0, atol=0, msg=lambda m: f"DDP replicas diverged ({label}, {policy}): {m}")


@pytest.mark.parametrize("device_type", BACKENDS)
def test_fsdp2_llama_trains_like_torch_rmsnorm(device_type, tmp_path):
    ranks = run_workers("fsdp2", device_type, tmp_path)
    for (policy, precision), _ in ranks[0].items():
        for rank, all_recs in enumerate(ranks):
            rec = all_recs[policy, precision]
            where = f"rank {rank}, policy={policy}, {precision}"
            assert rec["modules_ours"] == ["RMSNorm"] and rec["modules_ref"] == [], where
            for label in ("ours", "ref"):  # parameters sharded on dim 0 over the 2 ranks
                assert rec[f"norm_weight_type_{label}"] == "DTensor", where
                assert rec[f"norm_weight_placements_{label}"] == ["Shard(dim=0)"], where
                assert rec[f"norm_weight_local_shape_{label}"] == [DIM // WORLD], where
                # inside the forward the norms see plain (unsharded) tensors: cudnorm's normal path
                assert rec[f"norm_out_types_{label}"] == ["Tensor"] * 3, (where, rec[f"norm_out_types_{label}"])
                want_dtype = "torch.bfloat16" if precision == "bf16" else "torch.float32"
                assert rec[f"norm_out_dtypes_{label}"] == [want_dtype] * 3, where
            if policy == "cudnn":
                assert set(rec["nodes_ours"]) == {_ours("rms_norm", rec["native"])}, (where, rec["nodes_ours"])
            assert not set(rec["nodes_ref"]) & {_ours("rms_norm", True), _ours("rms_norm", False)}, where
            tol = BF16_TOL if precision == "bf16" else FP32_TOL[device_type]
            _close(rec["losses_ours"], rec["losses_ref"], tol, f"{where}: losses")
            _close(rec["final_norm_weight_ours"], rec["final_norm_weight_ref"],
                   BF16_TOL if precision == "bf16" else dict(rtol=1e-4, atol=1e-5), f"{where}: trained norm weight")
            assert rec["losses_ours"][-1] < rec["losses_ours"][0] - 0.1, (where, rec["losses_ours"])
        assert ranks[0][policy, precision]["losses_ours"][0] != ranks[1][policy, precision]["losses_ours"][0]
        for label in ("ours", "ref"):  # one model: the gathered weights agree across ranks
            torch.testing.assert_close(ranks[0][policy, precision][f"final_norm_weight_{label}"],
                                       ranks[1][policy, precision][f"final_norm_weight_{label}"], rtol=0, atol=0)
    assert {key[1] for key in ranks[0]} == {"fp32", "bf16"}


@pytest.fixture(scope="module")
def tp_ranks(tmp_path_factory):
    """``tp_ranks(device_type)``: the TP workers' records, spawned once for the two tests that read them."""
    records = {}

    def get(device_type):
        if device_type not in records:
            records[device_type] = run_workers("tp", device_type, tmp_path_factory.mktemp("tp"))
        return records[device_type]

    return get


@pytest.mark.parametrize("policy", ["auto", "cudnn"])
@pytest.mark.parametrize("device_type", TP_BACKENDS)
def test_tensor_and_sequence_parallel_match_one_process(device_type, policy, tp_ranks):
    ranks = tp_ranks(device_type)
    tol = TP_TOL[device_type]
    if policy not in ranks[0]:
        pytest.skip(f'policy="cudnn" not run: {SEQUENCE_SHARD_SKIP}')
    for rank, all_recs in enumerate(ranks):
        rec = all_recs[policy]
        where = f"rank {rank}, policy={policy}"
        assert rec["modules"] == ["RMSNorm"], where
        assert rec["plain_params"] == [], where
        placements = rec["placements"]
        assert placements["layers.0.ffn_norm.weight"] == ["Replicate()"], placements
        assert placements["norm.weight"] == ["Replicate()"], placements
        assert placements["layers.0.feed_forward.w1.weight"] == ["Shard(dim=0)"], placements  # column-wise
        assert placements["layers.0.feed_forward.w2.weight"] == ["Shard(dim=1)"], placements  # row-wise
        assert placements["tok_embeddings.weight"] == ["Shard(dim=0)"], placements
        # norm outputs: DTensors sharded on the sequence dim, half the tokens on each rank
        assert rec["norm_out_types"] == ["DTensor"] * 3, rec["norm_out_types"]
        assert rec["norm_out_placements"] == [["Shard(dim=1)"]] * 3, rec["norm_out_placements"]
        assert rec["norm_out_local_shapes"] == [[BATCH, TOKENS // WORLD, DIM]] * 3, rec["norm_out_local_shapes"]
        if policy == "cudnn":  # cudnorm's op on each rank's tokens, through its sharding rule
            assert set(rec["nodes_tp"]) == {_ours("rms_norm", rec["native"], eager=False)}, (where, rec["nodes_tp"])
        else:
            assert not any("cudnorm" in n.lower() for n in rec["nodes_tp"]), (where, rec["nodes_tp"])
        for i, (got, want) in enumerate(zip(rec["norm_out_tp"], rec["norm_out_single"], strict=True)):
            _close(got, want, tol, f"{where}: norm output {i}")
        assert rec["logits_type"] == "Tensor"  # output_layouts=Replicate(): full logits on every rank
        _close(rec["logits_tp"], rec["logits_single"], tol, f"{where}: logits")
        # a replicated weight with sequence-sharded activations: partial gradients, summed when
        # gathered (cudnorm's rule says Partial; how PyTorch's own op leaves it depends on its release)
        want_grad = [["Partial(sum)"]] if policy == "cudnn" else [["Partial(sum)"], ["Replicate()"]]
        assert rec["norm_grad_placements"] in want_grad, rec["norm_grad_placements"]
        _close(rec["norm_grad_tp"], rec["norm_grad_single"], dict(rtol=1e-4, atol=1e-6),
               f"{where}: norm weight grad")
        _close(rec["losses_tp"], rec["losses_single"], tol, f"{where}: losses")
        assert rec["losses_tp"][-1] < rec["losses_tp"][0], rec["losses_tp"]
        for name, want in rec["final_single"].items():
            _close(rec["final_tp"][name], want, dict(rtol=1e-4, atol=1e-5), f"{where}: trained {name}")
    torch.testing.assert_close(ranks[0][policy]["logits_tp"], ranks[1][policy]["logits_tp"], rtol=0, atol=0)


@pytest.mark.parametrize("label", X_PLACEMENTS)
@pytest.mark.parametrize("name", DTENSOR_CALLS)
@pytest.mark.parametrize("device_type", TP_BACKENDS)
def test_cudnn_policy_runs_cudnorms_ops_on_dtensors(device_type, name, label, tp_ranks):
    """The TP workers' direct calls (``_dtensor_calls``): cudnorm's own op ran, the output and
    gradients are placed by its rules and equal one process's whole-tensor call."""
    ranks = tp_ranks(device_type)
    calls = [rec["calls"] for rec in ranks]
    if (name, label) not in calls[0]:  # left out only where sequence shards cannot be flattened
        assert label == "Shard(dim=1)" and name != "ada_layer_norm" and "cudnn" not in ranks[0], (name, label)
        pytest.skip(f"{name} on {label} not run: {SEQUENCE_SHARD_SKIP}")
    tol = TP_TOL[device_type]
    op = name.removesuffix("_offset")
    for rank, rec in enumerate(calls):
        got, where = rec[name, label], f"rank {rank}: {name} on {label}"
        assert got["node"] == _ours(op, got["native"], eager=False), (where, got["node"])
        out, dx, *dparams = got["placements"]
        if label == "Shard(dim=2)":  # the normalised dim: rows made whole before the op
            assert out == dx and "dim=2" not in out[0], (where, got["placements"])
        else:  # rows: each rank normalises its own; replicated weights get per-rank sums
            assert out == dx == [label], (where, got["placements"])
            batch_shard_modulation = name == "ada_layer_norm" and label == "Shard(dim=0)"
            want = [label] if batch_shard_modulation or label == "Replicate()" else ["Partial(sum)"]
            assert all(p == want for p in dparams), (where, dparams)
        for i, (value, ref) in enumerate(zip(got["values"], rec[name, "ref"], strict=True)):
            _close(value, ref, tol, f"{where}, tensor {i}")
