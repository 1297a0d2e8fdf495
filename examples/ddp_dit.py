"""Data-parallel (DDP) training of a small DiT on cudnorm's adaLN modules.

    torchrun --nproc-per-node 2 examples/ddp_dit.py               # gloo on CPU, nccl on GPUs
    python -m torch.distributed.run --nproc-per-node 2 examples/ddp_dit.py --steps 50

Every rank holds the whole model and its own slice of the data; DDP averages the gradients.
The norms see plain local tensors, so they take cudnorm's normal path (cuDNN on a GPU for
large enough calls, PyTorch's kernels on the CPU). The task: predict the noise added to
synthetic latents, conditioned on the noise level.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import cudnorm


class Block(nn.Module):
    """DiT block: attention and MLP, each behind adaLN-Zero modulation."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ada = cudnorm.AdaLayerNormZero(dim)  # emb -> (modulated x, gate_msa, shift_mlp, scale_mlp, gate_mlp)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = cudnorm.AdaLayerNorm(dim)  # norm(x) * (1 + scale) + shift
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.ada(x, emb)
        b, s, d = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = x + gate_msa[:, None] * self.proj(attn)
        return x + gate_mlp[:, None] * self.mlp(self.norm2(x, shift_mlp, scale_mlp))


class TinyDiT(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 3, heads: int = 4) -> None:
        super().__init__()
        self.t_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.final_norm = cudnorm.AdaLayerNormContinuous(dim, cond_dim=dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = self.t_embed(t[:, None])
        for block in self.blocks:
            x = block(x, emb)
        return self.out(self.final_norm(x, emb))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same init everywhere (DDP also broadcasts rank 0's weights)
    model = DistributedDataParallel(TinyDiT().to(device), device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    clean = torch.randn(64, args.tokens, 64).cumsum(1) / args.tokens ** 0.5  # a smooth "dataset"
    gen = torch.Generator().manual_seed(rank)  # each rank draws its own samples

    if rank == 0:
        sample = torch.empty(args.batch, args.tokens, 64, device=device)
        print(f"DDP over {world} processes ({dist.get_backend()}, {device.type}); "
              f"AdaLN calls served by: {cudnorm.serving_path('ada_layer_norm', sample)}")
    for step in range(args.steps):
        idx = torch.randint(0, clean.shape[0], (args.batch,), generator=gen)
        t = torch.rand(args.batch, generator=gen)
        noise = torch.randn(args.batch, args.tokens, 64, generator=gen)
        noisy = (1 - t)[:, None, None] * clean[idx] + t[:, None, None] * noise
        loss = F.mse_loss(model(noisy.to(device), t.to(device)), noise.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the loss over all ranks, for printing
        if rank == 0:
            print(f"step {step:3d}  loss {mean.item() / world:.4f}")
    # Free the wrapped model before tearing down, and let no rank leave early: gloo runs on the
    # CPU here (torch 2.13) otherwise aborted at exit now and then, with or without cudnorm
    # ("terminate called without an active exception").
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
