"""Per-GPU training step time under FSDP2 and tensor + sequence parallelism, cudnorm's norms
against PyTorch's in the same processes.

    torchrun --nproc-per-node 2 benchmarks/distributed_steps.py --setup fsdp2 --out steps.csv
    torchrun --nproc-per-node 2 benchmarks/distributed_steps.py --setup tp --out steps.csv
    torchrun --nproc-per-node 4 benchmarks/distributed_steps.py --model dit --out steps.csv
    torchrun --nproc-per-node 2 benchmarks/distributed_steps.py --quick     # gloo on CPU: runs, times nothing useful
    torchrun --nproc-per-node 2 benchmarks/distributed_steps.py --model dit --quick

``--model decoder`` (the default) is the Llama-style decoder of ``examples/tp_sp_llama.py``
(token embedding, pre-norm layers of causal attention and a SwiGLU MLP, final norm, vocabulary
head), built once per provider from one seed, differing only in the RMSNorm class:

* ``torch``: ``torch.nn.RMSNorm``;
* ``cudnorm``: ``cudnorm.RMSNorm`` at the default policy (under TP + SP the norms receive
  DTensors, which that policy hands to PyTorch's op);
* ``cudnorm-cudnn``: the same under ``cudnorm.config(policy="cudnn")`` (every norm on
  cudnorm's op; under TP + SP through cudnorm's sharding rules);
* ``torch-again``: ``torch.nn.RMSNorm`` in a second model, the run's noise floor (its ratio
  to ``torch`` is 1.00x but for noise: on two H100s the TP + SP case once read 1.065x with
  the same kernels on both sides).

``--model dit`` is diffusers' ``DiTTransformer2DModel`` at DiT-XL/2's widths and published
depth, 28 blocks (``DIT`` of ``cudnorm/_bench/real_models/diffusers_models.py``; ``--depth``
overrides), B 32 per rank at 256 px: latents [32, 4, 32, 32], 256 tokens of width 1152, fresh
latents, timesteps in [0, 1000) and class labels every step, the loss the mean square of the
output. FSDP2 only. ``torch`` and ``torch-again`` run it unpatched, ``cudnorm`` after
``cudnorm.patch(model)`` (AdaLayerNormZero and LayerNorm), ``cudnorm-cudnn`` the same under
``policy="cudnn"``. Its memory: diffusers' class has 750M parameters (the paper's 675M plus a
timestep and label embedder in every block); a copy's fp32 parameters and gradients take 6 GB
divided among the ranks (SGD keeps no state), 24 GB for the four providers; one step's saved
activations at B 32 x 256 tokens in bf16 are at most 21 GiB (summed with saved-tensor hooks on
the meta device, attention weights included, which flash attention does not keep), one
provider stepping at a time. About 27 GB a GPU over 4 ranks, 45 GB on one: every provider's
model is built once and held, as for the decoder, so that the rounds can interleave them.

``fsdp2``: ``fully_shard`` per layer (block) and root, bf16 parameters with fp32 gradient
reduction. ``tp``: ``shard_model`` of the example (``SequenceParallel`` norms, column/row-wise
linears), bf16 parameters. SGD; a fresh batch every step. Rounds interleave the providers (the
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import cudnorm

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tp_sp_llama.py"
PROVIDERS = ("torch", "cudnorm", "cudnorm-cudnn", "torch-again")
# the decoder's sizes, and --quick's
DECODER = dict(dim=4096, depth=4, heads=32, batch=2, seq=4096)
DECODER_QUICK = dict(dim=64, depth=2, heads=4, batch=2, seq=16)


@dataclass(frozen=True)
class Workload:
    """What the rounds time. ``build(provider)`` -> the sharded model with ``provider``'s norms;
    ``draw(gen)`` -> one step's batch (the same on every rank for one generator seed);
    ``loss(model, batch)`` -> the fp32 scalar to backpropagate; ``sizes``: the rows' dim,
    depth, heads, batch and seq; ``title``: the model, for the printed table."""

    build: Callable[[str], torch.nn.Module]
    draw: Callable[[torch.Generator], object]
    loss: Callable[[torch.nn.Module, object], torch.Tensor]
    sizes: dict
    title: str


def _example():
    spec = importlib.util.spec_from_file_location("tp_sp_llama", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fully_shard(model: torch.nn.Module, blocks, mesh) -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _decoder(args, mesh, device) -> Workload:
    """The example's decoder with ``provider``'s RMSNorm, sharded for ``args.setup``; batches of
    [batch, seq + 1] tokens (a tensor-parallel group must see one batch)."""
    example = _example()

    def build(provider: str) -> torch.nn.Module:
        norm = torch.nn.RMSNorm if provider.startswith("torch") else cudnorm.RMSNorm
        torch.manual_seed(0)
        model = example.Decoder(args.dim, args.depth, args.heads, norm=norm).to(device)
        if args.setup == "fsdp2":
            _fully_shard(model, model.layers, mesh)
        else:
            model.to(torch.bfloat16)
            example.shard_model(model, mesh)
        return model

    def draw(gen: torch.Generator) -> torch.Tensor:
        return torch.randint(0, example.VOCAB, (args.batch, args.seq + 1), device=device, generator=gen)

    def loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    sizes = dict(dim=args.dim, depth=args.depth, heads=args.heads, batch=args.batch, seq=args.seq)
    return Workload(build, draw, loss, sizes, "decoder")


def _dit(args, mesh, device) -> Workload:
    """diffusers' DiT-XL/2 (toy widths under --quick), ``cudnorm.patch``-ed for the cudnorm
    providers, under FSDP2; batches of fp32 latents [batch, 4, side, side] (FSDP2 casts them
    to bf16), int64 timesteps and class labels [batch]."""
    from cudnorm._bench.real_models.diffusers_models import DIT  # noqa: PLC0415 - diffusers only when asked

    config = {**(DIT.toy if args.quick else {**DIT.config, **DIT.full}),
              **({} if args.depth is None else {"num_layers": args.depth})}
    batch = args.batch if args.batch is not None else (DIT.toy_batch if args.quick else DIT.batch)

    def build(provider: str) -> torch.nn.Module:
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it runs, not on the host's CPUs, which the ranks share
            model = DIT.build(config)
        if provider.startswith("cudnorm"):
            report = cudnorm.patch(model)  # before sharding, as a training script would
            if dist.get_rank() == 0:
                print(f"{provider}: {str(report).splitlines()[0]}")
        blocks = model.transformer_blocks
        # the model's forward calls block 0's conditioning embedder itself (for the final
        # layer's modulation), outside block 0's forward: it is its own FSDP unit so that it
        # gathers its parameters on either call
        _fully_shard(model, [blocks[0].norm1.emb, *blocks], mesh)
        return model

    def draw(gen: torch.Generator) -> dict:
        return DIT.inputs(config, batch, device, torch.float32, gen)

    def loss(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        return DIT.output(model(**inputs)).float().square().mean()

    sizes = dict(dim=DIT.width(config), depth=config["num_layers"], heads=config["num_attention_heads"],
                 batch=batch, seq=DIT.tokens(config))
    return Workload(build, draw, loss, sizes, DIT.title)


def _settings(provider: str):
    return cudnorm.config(policy="cudnn") if provider == "cudnorm-cudnn" else contextlib.nullcontext()


def _step(model, opt, workload: Workload, batch) -> None:
    loss = workload.loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round_ms(model, opt, provider, workload: Workload, args, device, seed: int) -> float:
    """ms per step over ``args.steps`` steps on fresh batches (one synchronise at the end);
    every rank draws the same batches."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batches = [workload.draw(gen) for _ in range(args.steps)]
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    with _settings(provider):
        for batch in batches:
            _step(model, opt, workload, batch)
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / args.steps


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("decoder", "dit"), default="decoder",
                        help="the example's Llama-style decoder, or diffusers' DiT-XL/2 (FSDP2 only)")
    parser.add_argument("--setup", choices=("fsdp2", "tp"), default="fsdp2", help="tp: --model decoder only")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma-separated subset of {PROVIDERS}")
    parser.add_argument("--dim", type=int, default=None, help=f"decoder width (default {DECODER['dim']})")
    parser.add_argument("--depth", type=int, default=None,
                        help=f"layers (default: decoder {DECODER['depth']}, dit DiT-XL/2's 28)")
    parser.add_argument("--heads", type=int, default=None, help=f"decoder heads (default {DECODER['heads']})")
    parser.add_argument("--batch", type=int, default=None,
                        help=f"per rank under FSDP2 (default: decoder {DECODER['batch']} sequences, dit 32 latents)")
    parser.add_argument("--seq", type=int, default=None,
                        help=f"decoder tokens per sequence (default {DECODER['seq']}; a multiple of the ranks under TP)")
    parser.add_argument("--steps", type=int, default=5, help="steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="toy widths, 2 rounds of 2 steps (a smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="CSV to append rows to (rank 0)")
    args = parser.parse_args(argv)
    if args.model == "dit":
        if args.setup != "fsdp2":
            parser.error(f"--setup {args.setup}: --model dit runs under fsdp2 only (tensor parallelism shards "
                         "the decoder's layers); use --model decoder")
        given = [f"--{name}" for name in ("dim", "heads", "seq") if getattr(args, name) is not None]
        if given:
            parser.error(f"{', '.join(given)}: --model decoder only (dit runs DiT-XL/2's widths)")
    if args.quick:
        args.steps, args.rounds = 2, 2
    if args.model == "decoder":
        for name, value in (DECODER_QUICK if args.quick else DECODER).items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    args.providers = [p for p in args.providers.split(",") if p]
    unknown = sorted(set(args.providers) - set(PROVIDERS))
    if unknown:
        parser.error(f"--providers: unknown {unknown}; choose from {PROVIDERS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    providers = args.providers
    world = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh(device.type, (world,))
    workload = (_dit if args.model == "dit" else _decoder)(args, mesh, device)

    models, status, times = {}, {}, {p: [] for p in providers}
    for provider in providers:
        try:
            model = workload.build(provider)
            models[provider] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
            _round_ms(*models[provider], provider, workload, args, device, 0)  # warm-up: builds, compiles, NCCL
            status[provider] = "ok"
        except Exception as error:  # noqa: BLE001 - reported in the table; the other providers still run
            status[provider] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            models.pop(provider, None)
    for r in range(args.rounds):
        order = list(models)[r % max(len(models), 1):] + list(models)[:r % max(len(models), 1)]
        for provider in order:
            times[provider].append(_round_ms(*models[provider], provider, workload, args, device, r + 1))

    medians = {p: statistics.median(t) if t else float("nan") for p, t in times.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, medians)
    if rank == 0:
        device_name = torch.cuda.get_device_name(device) if use_cuda else "cpu"
        base = medians.get("torch", float("nan"))
        sizes = workload.sizes
        print(f"{args.setup} over {world} ranks ({dist.get_backend()}, {device_name}), {workload.title}, "
              + ", ".join(f"{k} {v}" for k, v in sizes.items())
              + f"; median of {args.rounds} rounds x {args.steps} steps")
        print(f"{'provider':14s} {'ms/step':>9s} {'vs torch':>9s} {'slowest rank':>13s}  status")
        rows = []
        for p in providers:
            slowest = max(g[p] for g in gathered)
            print(f"{p:14s} {medians[p]:9.3f} {base / medians[p]:8.3f}x {slowest:13.3f}  {status[p]}")
            rows.append({"model": args.model, "setup": args.setup, "world": world, "device": device_name, **sizes,
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
