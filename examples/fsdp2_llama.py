"""FSDP2 (``fully_shard``) training of a small Llama-style decoder on ``cudnorm.RMSNorm``.

    torchrun --nproc-per-node 2 examples/fsdp2_llama.py             # gloo on CPU, nccl on GPUs
    python -m torch.distributed.run --nproc-per-node 2 examples/fsdp2_llama.py --fp32

Each decoder layer and the root are sharded: a rank stores half of every parameter and
gathers a layer's weights just before that layer runs. Inside the forward the norms see
plain tensors, so ``cudnorm.RMSNorm`` takes its normal path. By default parameters are
computed in bf16 and gradients reduced in fp32 (``MixedPrecisionPolicy``); ``--fp32``
turns that off. The task: continue sequences of a fixed recurrence ``t[i+1] = (3 t[i] + 1) % V``.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import cudnorm

VOCAB = 97


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = cudnorm.RMSNorm(dim, eps=1e-5)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = cudnorm.RMSNorm(dim, eps=1e-5)
        self.gate_up = nn.Linear(dim, 2 * 3 * dim, bias=False)  # SwiGLU: gate and up in one matmul
        self.down = nn.Linear(3 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads) for _ in range(depth))
        self.norm = cudnorm.RMSNorm(dim, eps=1e-5)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def batch(n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    seq = [torch.randint(0, VOCAB, (n,), generator=gen)]
    for _ in range(length):
        seq.append((3 * seq[-1] + 1) % VOCAB)
    return torch.stack(seq, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--fp32", action="store_true", help="no mixed precision")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)
    model = Decoder().to(device)
    shard = {"mesh": mesh}
    if not args.fp32:
        shard["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, **shard)  # one all-gather per layer, freed after use
    fully_shard(model, **shard)  # the rest: embedding, final norm, head
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    if rank == 0:
        w = model.layers[0].attn_norm.weight
        print(f"FSDP2 over {world} processes ({dist.get_backend()}, {device.type}, "
              f"{'fp32' if args.fp32 else 'bf16 params / fp32 reduce'}); "
              f"attn_norm.weight is a {type(w).__name__} {w.placements}, local shape {tuple(w.to_local().shape)}")
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        seq = batch(args.batch, args.seq, gen).to(device)
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
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
