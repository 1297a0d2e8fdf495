"""Train a small DiT block twice, on cudnorm's adaLN modules and in plain PyTorch, and compare.

The block is DiT's: self-attention and an MLP, each behind adaLN-Zero modulation
(``x + gate * f(norm(x) * (1 + scale) + shift)``, with shift/scale/gate projected from a
conditioning vector by a zero-initialised linear layer). Both models start from the same
weights and see the same synthetic batches; the script prints the largest relative gap
between the two loss curves and writes both curves to a PNG.

    pip install -e .                                   # from a checkout (or PYTHONPATH=.)
    python examples/dit_block.py                       # CPU or GPU, fp32, 300 steps
    python examples/dit_block.py --device cuda --dtype bfloat16 --steps 500 --out loss.png

Exit status 1 when the curves differ by more than ``--tol``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import cudnorm

# Default tolerance on the relative loss gap. fp32: the two models differ only by rounding
# order. bf16 autocast: PyTorch's LayerNorm runs in fp32 under autocast, cudnorm in bf16, so
# each step differs by bf16 rounding and the gap drifts a little (9e-4 after 300 CPU steps).
TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))


def mlp(dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))


class CudnormDiTBlock(nn.Module):
    """DiT block on cudnorm: AdaLayerNormZero gives the attention input and the other chunks."""

    def __init__(self, dim: int, heads: int, cond_dim: int) -> None:
        super().__init__()
        self.norm1 = cudnorm.AdaLayerNormZero(dim, cond_dim=cond_dim)
        self.attn = Attention(dim, heads)
        self.norm2 = cudnorm.AdaLayerNorm(dim)
        self.mlp = mlp(dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, c)
        x = x + gate_msa[:, None] * self.attn(h)
        return x + gate_mlp[:, None] * self.mlp(self.norm2(x, shift_mlp, scale_mlp))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class TorchDiTBlock(nn.Module):
    """The same block as the DiT reference code writes it."""

    def __init__(self, dim: int, heads: int, cond_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = mlp(dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cond_dim, 6 * dim))
        nn.init.zeros_(self.adaLN_modulation[1].weight)
        nn.init.zeros_(self.adaLN_modulation[1].bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa[:, None] * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp[:, None] * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class Model(nn.Module):
    def __init__(self, block: nn.Module, in_dim: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.block = block
        self.head = nn.Linear(dim, in_dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x), c))


def build_models(dim: int, heads: int, in_dim: int, cond_dim: int, seed: int) -> tuple[Model, Model]:
    """(plain PyTorch, cudnorm) models with identical weights."""
    torch.manual_seed(seed)
    plain = Model(TorchDiTBlock(dim, heads, cond_dim), in_dim, dim)
    fused = Model(CudnormDiTBlock(dim, heads, cond_dim), in_dim, dim)
    renamed = {k.replace("adaLN_modulation.1.", "norm1.linear."): v for k, v in plain.state_dict().items()}
    fused.load_state_dict(renamed)
    return plain, fused


def synthetic_batches(steps: int, batch: int, seq: int, in_dim: int, cond_dim: int, seed: int):
    """A fixed teacher: a token-mixing, condition-gated nonlinearity of the input."""
    g = torch.Generator().manual_seed(seed)
    mix, cond_map = torch.randn(in_dim, in_dim, generator=g) / in_dim ** 0.5, torch.randn(cond_dim, in_dim, generator=g)
    for _ in range(steps):
        x = torch.randn(batch, seq, in_dim, generator=g)
        c = torch.randn(batch, cond_dim, generator=g)
        gain = 1 + 0.5 * torch.tanh(c @ cond_map / cond_dim ** 0.5)
        target = torch.tanh(x @ mix + x.mean(1, keepdim=True)) * gain[:, None]
        yield x, c, target


def train(model: Model, batches, device: str, dtype: torch.dtype, lr: float) -> list[float]:
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x, c, target in batches:
        x, c, target = x.to(device), c.to(device), target.to(device)
        with torch.autocast(device_type=device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
            loss = F.mse_loss(model(x, c).float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def max_relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def plot(curves: dict, path: str, title: str) -> bool:
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot written")
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        ax.plot(losses, label=label, linestyle="--" if "cudnorm" in label else "-")
    ax.set(xlabel="step", ylabel="MSE loss", yscale="log", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(device: str, dtype_name: str = "float32", steps: int = 300, out: str | None = "dit_block_loss.png",
        batch: int = 16, seq: int = 32, dim: int = 64, heads: int = 4, seed: int = 0, lr: float = 1e-3) -> dict:
    """Train both models; returns the trained models, both curves and their largest relative gap."""
    dtype = getattr(torch, dtype_name)
    in_dim, cond_dim = 16, 32
    plain, fused = build_models(dim, heads, in_dim, cond_dim, seed)
    curves = {}
    for label, model in (("PyTorch (nn.LayerNorm + modulate)", plain), ("cudnorm (AdaLayerNormZero)", fused)):
        torch.manual_seed(seed)
        start = time.perf_counter()
        batches = synthetic_batches(steps, batch, seq, in_dim, cond_dim, seed + 1)
        curves[label] = train(model, batches, device, dtype, lr)
        print(f"{label:<36} final loss {curves[label][-1]:.5f}  ({time.perf_counter() - start:.1f} s)")
    gap = max_relative_gap(curves["cudnorm (AdaLayerNormZero)"], curves["PyTorch (nn.LayerNorm + modulate)"])
    if out:
        plot(curves, out, f"DiT block, {device}, {dtype_name}: max relative gap {gap:.1e}")
    return {"models": {"torch": plain, "cudnorm": fused}, "curves": curves, "max_relative_gap": gap}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE), help="bfloat16 runs under autocast")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="dit_block_loss.png", help="PNG path ('' for none)")
    parser.add_argument("--tol", type=float, default=None, help="largest accepted relative gap of the curves")
    args = parser.parse_args(argv)
    result = run(args.device, args.dtype, args.steps, args.out or None)
    tol = TOLERANCE[args.dtype] if args.tol is None else args.tol
    gap = result["max_relative_gap"]
    print(f"max relative gap between the loss curves: {gap:.2e} (tolerance {tol:.0e}): "
          f"{'match' if gap <= tol else 'MISMATCH'}")
    return 0 if gap <= tol else 1


if __name__ == "__main__":
    raise SystemExit(main())
