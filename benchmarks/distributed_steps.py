"""Per-GPU training step time under FSDP2 and tensor + sequence parallelism, cudnorm's
RMSNorm against PyTorch's in the same processes.

    torchrun --nproc-per-node 2 benchmarks/distributed_steps.py --setup fsdp2 --out steps.csv
    torchrun --nproc-per-node 2 benchmarks/distributed_steps.py --setup tp --out steps.csv
    torchrun --nproc-per-node 2 benchmarks/distributed_steps.py --quick     # gloo on CPU: runs, times nothing useful

The model is the Llama-style decoder of ``examples/tp_sp_llama.py`` (token embedding, pre-norm
layers of causal attention and a SwiGLU MLP, final norm, vocabulary head), built once per
provider from one seed, differing only in the RMSNorm class:

* ``torch``: ``torch.nn.RMSNorm``;
* ``cudnorm``: ``cudnorm.RMSNorm`` at the default policy (under TP + SP the norms receive
  DTensors, which that policy hands to PyTorch's op);
* ``cudnorm-cudnn``: the same under ``cudnorm.config(policy="cudnn")`` (every norm on
  cudnorm's op; under TP + SP through cudnorm's sharding rules);
* ``torch-again``: ``torch.nn.RMSNorm`` in a second model, the run's noise floor (its ratio
  to ``torch`` is 1.00x but for noise: on two H100s the TP + SP case once read 1.065x with
  the same kernels on both sides).

``fsdp2``: ``fully_shard`` per layer and root, bf16 parameters with fp32 gradient reduction.
``tp``: ``shard_model`` of the example (``SequenceParallel`` norms, column/row-wise linears),
bf16 parameters. SGD; a fresh batch of tokens every step. Rounds interleave the providers (the
order turns each round); a round runs ``--steps`` steps back to back and synchronises once.
Rank 0 prints the median ms per step of each provider, its ratio to ``torch`` (> 1: faster)
and the slowest rank's median, and appends rows to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import cudnorm

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tp_sp_llama.py"
PROVIDERS = ("torch", "cudnorm", "cudnorm-cudnn", "torch-again")


def _example():
    spec = importlib.util.spec_from_file_location("tp_sp_llama", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(example, provider: str, args, mesh, device):
    """The decoder with ``provider``'s norms, sharded for ``args.setup``, and its optimizer."""
    norm = torch.nn.RMSNorm if provider.startswith("torch") else cudnorm.RMSNorm
    torch.manual_seed(0)
    model = example.Decoder(args.dim, args.depth, args.heads, norm=norm).to(device)
    if args.setup == "fsdp2":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        model.to(torch.bfloat16)
        example.shard_model(model, mesh)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _settings(provider: str):
    return cudnorm.config(policy="cudnn") if provider == "cudnorm-cudnn" else contextlib.nullcontext()


def _step(model, opt, tokens) -> None:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round_ms(model, opt, provider, args, device, vocab, seed: int) -> float:
    """ms per step over ``args.steps`` steps on fresh tokens (one synchronise at the end);
    every rank draws the same tokens (a tensor-parallel group must see one batch)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), device=device, generator=gen)
               for _ in range(args.steps)]
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    with _settings(provider):
        for tokens in batches:
            _step(model, opt, tokens)
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / args.steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", choices=("fsdp2", "tp"), default="fsdp2")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma-separated subset of {PROVIDERS}")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (per rank under FSDP2)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (a multiple of the ranks under TP)")
    parser.add_argument("--steps", type=int, default=5, help="steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds of 2 steps (a smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="CSV to append rows to (rank 0)")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.depth, args.heads, args.batch, args.seq, args.steps, args.rounds = 64, 2, 4, 2, 16, 2, 2
    providers = [p for p in args.providers.split(",") if p]
    unknown = sorted(set(providers) - set(PROVIDERS))
    if unknown:
        parser.error(f"--providers: unknown {unknown}; choose from {PROVIDERS}")

    world = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh(device.type, (world,))
    example = _example()

    models, status, times = {}, {}, {p: [] for p in providers}
    for provider in providers:
        try:
            models[provider] = _build(example, provider, args, mesh, device)
            _round_ms(*models[provider], provider, args, device, example.VOCAB, 0)  # warm-up: builds, compiles, NCCL
            status[provider] = "ok"
        except Exception as error:  # noqa: BLE001 - reported in the table; the other providers still run
            status[provider] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            models.pop(provider, None)
    for r in range(args.rounds):
        order = list(models)[r % max(len(models), 1):] + list(models)[:r % max(len(models), 1)]
        for provider in order:
            times[provider].append(_round_ms(*models[provider], provider, args, device, example.VOCAB, r + 1))

    medians = {p: statistics.median(t) if t else float("nan") for p, t in times.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, medians)
    if rank == 0:
        device_name = torch.cuda.get_device_name(device) if use_cuda else "cpu"
        base = medians.get("torch", float("nan"))
        print(f"{args.setup} over {world} ranks ({dist.get_backend()}, {device_name}), dim {args.dim}, "
              f"depth {args.depth}, batch {args.batch}, seq {args.seq}; median of {args.rounds} rounds x "
              f"{args.steps} steps")
        print(f"{'provider':14s} {'ms/step':>9s} {'vs torch':>9s} {'slowest rank':>13s}  status")
        rows = []
        for p in providers:
            slowest = max(g[p] for g in gathered)
            print(f"{p:14s} {medians[p]:9.3f} {base / medians[p]:8.3f}x {slowest:13.3f}  {status[p]}")
            rows.append({"setup": args.setup, "world": world, "device": device_name, "dim": args.dim,
                         "depth": args.depth, "heads": args.heads, "batch": args.batch, "seq": args.seq,
                         "provider": p, "ms_per_step": medians[p], "vs_torch": base / medians[p],
                         "slowest_rank_ms": slowest, "status": status[p], "command": " ".join(sys.argv)})
        if args.out is not None:
            new = not args.out.exists()
            with args.out.open("a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                if new:
                    writer.writeheader()
                writer.writerows(rows)
    # free the sharded models before tearing down, and let no rank leave early (see the example)
    models.clear()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
