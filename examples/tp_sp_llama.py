"""Tensor + sequence parallel training of a small Llama-style decoder with ``cudnorm.RMSNorm``.

    torchrun --nproc-per-node 2 examples/tp_sp_llama.py             # gloo on CPU, nccl on GPUs
    python -m torch.distributed.run --nproc-per-node 2 examples/tp_sp_llama.py --steps 50

All ranks form one tensor-parallel group and see the same batch. Attention heads and the MLP
hidden units are split over the ranks (column-wise in, row-wise out); between the blocks the
activations are split along the sequence, so each rank normalises only its own tokens
(``SequenceParallel`` on every RMSNorm). The norms receive DTensors sharded on the sequence.
Under the default ``policy="auto"`` cudnorm hands them to PyTorch's RMSNorm; under
``cudnorm.config(policy="cudnn")`` cudnorm's own op runs on each rank's shard, placed by its
sharding rules (docs/distributed.md; sequence shards need torch >= 2.13, whose DTensor keeps
them through the op's reshape). Either way the output keeps the sequence sharding.
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
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import cudnorm

VOCAB = 96  # divisible by the tensor-parallel degree (the head is split by vocabulary)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: under tensor parallelism each rank holds heads / tp of the heads
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, norm: type[nn.Module] = cudnorm.RMSNorm) -> None:
        super().__init__()
        self.attention_norm = norm(dim, eps=1e-5)
        self.attention = Attention(dim, heads)
        self.ffn_norm = norm(dim, eps=1e-5)
        self.feed_forward = FeedForward(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    """``norm``: the RMSNorm class (``torch.nn.RMSNorm`` gives the same model on PyTorch's
    norms, as ``benchmarks/distributed_steps.py`` compares)."""

    def __init__(self, dim: int = 64, depth: int = 2, heads: int = 4, norm: type[nn.Module] = cudnorm.RMSNorm) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Layer(dim, heads, norm) for _ in range(depth))
        self.norm = norm(dim, eps=1e-5)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def shard_model(model: Decoder, mesh) -> None:
    seq = Shard(1)  # [batch, sequence, features]: split the sequence
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),  # full logits everywhere
    })
    for layer in model.layers:
        parallelize_module(layer, mesh, {
            "attention_norm": SequenceParallel(),
            # attention and the MLP need every token: gather the sequence on the way in ...
            "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            # ... and reduce-scatter back to sequence shards on the way out
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32, help="a multiple of the number of processes")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # same weights and same batches on every rank
    model = Decoder().to(device)
    shard_model(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seen = []  # the first output of one norm, to show its sharding
    hook = model.layers[0].ffn_norm.register_forward_hook(lambda mod, args, out: seen.append(out))

    for step in range(args.steps):
        start = torch.randint(0, VOCAB, (args.batch, 1))
        seq = (start + 5 * torch.arange(args.seq + 1)) % VOCAB  # arithmetic sequences to continue
        seq = seq.to(device)
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        hook.remove()
        if rank == 0:
            if step == 0:
                out = seen[0]
                print(f"TP+SP over {world} processes ({dist.get_backend()}, {device.type}); layers.0.ffn_norm "
                      f"returns a {type(out).__name__} {out.placements}, local {tuple(out.to_local().shape)} "
                      f"of {tuple(out.shape)}")
            print(f"step {step:3d}  loss {loss.item():.4f}")
    # Free the wrapped model before tearing down, and let no rank leave early: gloo runs on the
    # CPU here (torch 2.13) otherwise aborted at exit now and then, with or without cudnorm
    # ("terminate called without an active exception").
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
