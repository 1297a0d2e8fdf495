"""Host time of the norms ``cudnorm.patch`` swaps, per call and in a DiT training step, beside
the same modules unpatched: what the patched forwards' own Python costs (issue 42, part 3).

Per call: each norm class that DiT-XL/2, PixArt-alpha, SD3.5 and Flux.1 hold (diffusers'
AdaLN classes, ``nn.LayerNorm`` with and without affine parameters, ``nn.RMSNorm``, diffusers'
``RMSNorm`` and ``FP32LayerNorm``), in three directions: ``fwd-infer`` (``torch.no_grad()``),
``fwd-train`` (the input requiring grad) and ``fwd+bwd`` (``torch.autograd.backward`` of the
first output). On a GPU each figure is :func:`cudnorm._bench.host_overhead.host_us` (calls
enqueued behind a sleeping kernel: host time whatever the kernels' time); on the CPU it is the
thread's CPU time per call at a tiny shape (``[2, 16, 64]``: the kernels' time is small, and
CPU time is not stretched by other processes on a shared host). Step: diffusers'
``DiTTransformer2DModel`` (DiT-XL/2 widths, 12 layers, batch 32, 256 tokens, bf16 on a GPU; a
tiny config on the CPU), forward, MSE loss and backward, ms per step.

Providers: ``unpatched``; ``patched`` (``cudnorm.patch`` under ``cudnorm.config(policy=...)``,
``--policy``, default ``auto``); ``unpatched-again``, the run's noise floor. Interleaved passes
(each starts at another provider), the median kept; ``vs_unpatched`` is unpatched's time over
the provider's (< 1: the provider costs more host time).

    python benchmarks/patched_host.py --out benchmarks/results/<gpu>/patched_host.csv [--policy auto]
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import statistics
import sys
import time

import torch
from diffusers import DiTTransformer2DModel
from diffusers.models import normalization as dn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import cudnorm  # noqa: E402
from cudnorm._bench import host_overhead  # noqa: E402

PROVIDERS = ("unpatched", "patched", "unpatched-again")


def _cases(d: int):
    """``(label, module, kind)``: each norm class of the four models, as they build it;
    ``kind`` names the forward's arguments (:func:`_arguments`)."""
    return [
        ("AdaLayerNormZero (DiT, with emb)", dn.AdaLayerNormZero(d, 1000), "dit"),
        ("AdaLayerNormZero (SD3.5, Flux)", dn.AdaLayerNormZero(d), "zero"),
        ("AdaLayerNormZeroSingle (Flux)", dn.AdaLayerNormZeroSingle(d), "emb"),
        ("SD35AdaLayerNormZeroX", dn.SD35AdaLayerNormZeroX(d), "emb"),
        ("AdaLayerNormContinuous", dn.AdaLayerNormContinuous(d, d, False, 1e-6), "emb"),
        ("nn.LayerNorm (no affine)", torch.nn.LayerNorm(d, elementwise_affine=False, eps=1e-6), "x"),
        ("nn.LayerNorm", torch.nn.LayerNorm(d, eps=1e-6), "x"),
        ("nn.RMSNorm", torch.nn.RMSNorm(d, eps=1e-6), "x"),
        ("diffusers RMSNorm", dn.RMSNorm(d, eps=1e-6), "x"),
        ("diffusers FP32LayerNorm", dn.FP32LayerNorm(d, eps=1e-6), "x"),
    ]


def _arguments(kind: str, shape, dtype, device, grad: bool):
    b, s, d = shape
    x = torch.randn(b, s, d, dtype=dtype, device=device, requires_grad=grad)
    if kind == "x":
        return (x,)
    emb = torch.randn(b, d, dtype=dtype, device=device)
    if kind == "emb":
        return x, emb
    if kind == "zero":  # forward(x, timestep, class_labels, hidden_dtype, emb)
        return x, None, None, None, emb
    labels = torch.randint(0, 1000, (b,), device=device)
    return x, torch.rand(b, device=device) * 999, labels, dtype


def _timer(cuda: bool):
    """``us(fn, calls)``: host time per call of ``fn`` (module docstring)."""
    if cuda:
        return lambda fn, calls: host_overhead.host_us(fn, calls=calls)

    def cpu_us(fn, calls):
        samples = []
        for _ in range(host_overhead.ROUNDS):
            start = time.thread_time()
            for _ in range(calls):
                fn()
            samples.append((time.thread_time() - start) / calls * 1e6)
        return statistics.median(samples)

    return cpu_us


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def per_call(shape, dtype, device, passes: int, policy: str) -> list[dict]:
    us = _timer(device == "cuda")
    samples: dict[tuple, list[float]] = {}
    for label, module, kind in _cases(shape[2]):
        module = module.to(device, dtype)
        patched = copy.deepcopy(module)
        cudnorm.patch(patched)
        models = {"unpatched": module, "patched": patched, "unpatched-again": copy.deepcopy(module)}
        infer, train = _arguments(kind, shape, dtype, device, False), _arguments(kind, shape, dtype, device, True)
        dy = torch.randn(shape, dtype=dtype, device=device)
        for k in range(passes):
            order = PROVIDERS[k % 3:] + PROVIDERS[:k % 3]
            for provider in order:
                m = models[provider]
                with cudnorm.config(policy=policy):
                    with torch.no_grad():
                        m(*infer)
                        samples.setdefault((label, "fwd-infer", provider), []).append(us(lambda: m(*infer), 40))
                    m(*train)
                    samples.setdefault((label, "fwd-train", provider), []).append(us(lambda: m(*train), 40))
                    step = lambda: torch.autograd.backward(_first(m(*train)), dy)  # noqa: E731
                    step()
                    # fewer calls: a backward enqueues several kernels, which must fit in the launch queue
                    samples.setdefault((label, "fwd+bwd", provider), []).append(us(step, 10))
    rows = []
    for (label, direction, provider), values in samples.items():
        rows.append({"section": "per_call", "case": label, "direction": direction, "provider": provider,
                     "value": statistics.median(values), "unit": "us"})
    return _ratios(rows)


def step(device, dtype, passes: int, policy: str, steps: int = 10) -> list[dict]:
    torch.manual_seed(0)
    cuda = device == "cuda"
    heads, head_dim, size, batch = (16, 72, 32, 32) if cuda else (2, 32, 8, 2)  # DiT-XL/2 widths; tiny
    model = DiTTransformer2DModel(num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4,
                                  out_channels=8, num_layers=12, sample_size=size, patch_size=2,
                                  num_embeds_ada_norm=1000).to(device, dtype)
    patched = copy.deepcopy(model)
    cudnorm.patch(patched)
    models = {"unpatched": model, "patched": patched, "unpatched-again": copy.deepcopy(model)}
    x = torch.randn(batch, 4, size, size, device=device, dtype=dtype)
    t = torch.randint(0, 1000, (batch,), device=device)
    labels = torch.randint(0, 1000, (batch,), device=device)
    target = torch.randn(batch, 8, size, size, device=device, dtype=dtype)
    clock = time.perf_counter if cuda else time.thread_time

    def run(m):
        loss = torch.nn.functional.mse_loss(m(x, timestep=t, class_labels=labels).sample, target)
        loss.backward()

    samples: dict[str, list[float]] = {p: [] for p in PROVIDERS}
    for k in range(passes * 5):
        for provider in PROVIDERS[k % 3:] + PROVIDERS[:k % 3]:
            with cudnorm.config(policy=policy):
                run(models[provider])
                if cuda:
                    torch.cuda.synchronize()
                start = clock()
                for _ in range(steps):
                    run(models[provider])
                if cuda:
                    torch.cuda.synchronize()
                samples[provider].append((clock() - start) / steps * 1e3)
    rows = [{"section": "step", "case": f"DiTTransformer2DModel 12 layers, B {batch}, {(size // 2) ** 2} tokens",
             "direction": "fwd+loss+bwd", "provider": p, "value": statistics.median(v), "unit": "ms"}
            for p, v in samples.items()]
    return _ratios(rows)


def _ratios(rows: list[dict]) -> list[dict]:
    base = {(r["case"], r["direction"]): r["value"] for r in rows if r["provider"] == "unpatched"}
    for r in rows:
        r["vs_unpatched"] = base[(r["case"], r["direction"])] / r["value"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="CSV path (default: print only)")
    parser.add_argument("--policy", default="auto", help="cudnorm.config(policy=...) for the patched model")
    parser.add_argument("--passes", type=int, default=3, help="interleaved passes (median kept)")
    parser.add_argument("--no-step", action="store_true", help="per-call figures only")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = (32, 256, 1152) if cuda else (2, 16, 64)  # DiT-XL/2 at 256 tokens; a tiny CPU shape
    if not cuda:
        torch.set_num_threads(1)  # thread CPU time covers the whole call
    rows = per_call(shape, dtype, device, args.passes, args.policy)
    if not args.no_step:
        rows += step(device, dtype, args.passes, args.policy)
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{name}, {dtype}, per-call shape {list(shape)}, policy={args.policy!r}")
    for r in rows:
        print(f"{r['case']:48s} {r['direction']:12s} {r['provider']:16s} {r['value']:9.1f} {r['unit']}  "
              f"{r['vs_unpatched']:.3f}x")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["section", "case", "direction", "provider", "value", "unit",
                                                   "vs_unpatched"])
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
