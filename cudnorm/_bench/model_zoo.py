"""The models of ``cudnorm bench --models``: DiT (adaLN-Zero), SD3-like MMDiT joint blocks and
Flux-like single-stream blocks (adaLN modulation and per-head qk RMSNorm), a Llama-style
decoder and a GPT-2-style LayerNorm stack, each built with a provider's norm factories
(:mod:`.model_norms`) so that providers differ only in their norms; their configurations are
:mod:`.model_cases`'.

Every builder seeds ``torch.manual_seed(0)`` first and no norm consumes random numbers at
construction (PyTorch's, cudnorm's and Liger's norms start at ones/zeros), so every
provider's model has the same weights. The norms' weights (and LayerNorm biases) are then
set from their own seeded generator, as a trained model's would be: with unit weights the
loss ``mean(final_norm(x) ** 2)`` would not depend on ``x`` at all, and every gradient
before the final norm would be rounding noise. Shapes: ``B`` batch, ``S`` tokens, ``D`` width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .model_norms import ada_factory, ln_factory, rms_factory


# ---------------------------------------------------------------------------------------
# Pieces shared by the blocks


def _mlp(dim: int) -> nn.Sequential:
    """The transformer MLP of DiT, SD3 and GPT-2: ``D -> 4D -> D`` with tanh GELU."""
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))


def _modulation(dim: int, chunks: int) -> nn.Sequential:
    """adaLN's ``Linear(SiLU(c))``: ``c [B, D]`` -> ``[B, chunks * D]`` (shifts, scales, gates)."""
    linear = nn.Linear(dim, chunks * dim)
    # DiT, SD3 and Flux start it at zero (identity blocks); small random weights make outputs
    # and gradients depend on every norm, so the equivalence check means something
    nn.init.normal_(linear.weight, std=0.02)
    nn.init.zeros_(linear.bias)
    return nn.Sequential(nn.SiLU(), linear)


class Rotary(nn.Module):
    """Rotary position embeddings (RoFormer; Llama's "rotate half" layout), of Llama and Flux.

    ``cos``/``sin`` buffers: ``[max_pos, head_dim]``, the ``head_dim / 2`` frequencies
    ``base ** (-2i / head_dim)`` repeated twice, so that channel ``i`` pairs with channel
    ``i + head_dim / 2``.
    """

    def __init__(self, head_dim: int, max_pos: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate ``x [B, H, S, head_dim]`` at positions ``start .. start + S - 1``."""
        s = x.shape[2]
        cos, sin = self.cos[start:start + s].to(x.dtype), self.sin[start:start + s].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------
# DiT


class DiTBlock(nn.Module):
    """adaLN-Zero DiT block (as in facebookresearch/DiT ``models.py``), norms from ``norm_mod``.

    ``forward(x, c)``: ``x [B, S, D]`` tokens, ``c [B, D]`` conditioning; returns ``[B, S, D]``.
    """

    def __init__(self, dim: int, heads: int, norm_mod: Callable) -> None:
        super().__init__()
        self.heads, self.norm_mod = heads, norm_mod
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = _mlp(dim)
        self.adaLN_modulation = _modulation(dim, 6)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa[:, None] * self.attn(self.norm_mod(x, shift_msa, scale_msa))
        return x + gate_mlp[:, None] * self.mlp(self.norm_mod(x, shift_mlp, scale_mlp))


class DiT(nn.Module):
    """``depth`` :class:`DiTBlock` s; ``forward(x, c)`` as the block's."""

    def __init__(self, dim: int, heads: int, depth: int, norm_mod: Callable) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DiTBlock(dim, heads, norm_mod) for _ in range(depth))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, c)
        return x


def build_dit(dim: int, heads: int, depth: int, provider: str) -> DiT:
    """A seeded DiT whose norms are ``provider``'s (``torch``, ``cudnorm``, ``cudnorm-cudnn``)."""
    norm_mod = ada_factory(provider)
    torch.manual_seed(0)
    return DiT(dim, heads, depth, norm_mod)


# ---------------------------------------------------------------------------------------
# SD3 (MMDiT joint blocks) and Flux (single-stream blocks): adaLN and per-head qk RMSNorm


class QKV(nn.Module):
    """q/k/v projections with a per-head RMSNorm on q and k (diffusers' ``Attention`` with
    ``qk_norm="rms_norm"``): ``x [B, S, D]`` -> q, k, v ``[B, H, S, D / H]``.

    Three projections rather than one fused qkv Linear, as in diffusers' SD3 and Flux
    attention: each norm's input is then a contiguous ``[B, S, H, D / H]``; the q of a fused
    output is a strided view, which Liger's RMSNorm cannot flatten into rows."""

    def __init__(self, dim: int, heads: int, rms: Callable) -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q, self.norm_k = rms(dim // heads, 1e-6), rms(dim // heads, 1e-6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (proj(x).unflatten(-1, (self.heads, -1)) for proj in (self.to_q, self.to_k, self.to_v))
        return self.norm_q(q).transpose(1, 2), self.norm_k(k).transpose(1, 2), v.transpose(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over ``[B, H, S, hd]`` q, k, v -> ``[B, S, H * hd]``."""
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class JointStream(nn.Module):
    """One stream (image or text) of an SD3 joint block: its adaLN-Zero modulation, q/k/v
    with qk RMSNorm, attention output projection and MLP."""

    def __init__(self, dim: int, heads: int, norm_mod: Callable, rms: Callable) -> None:
        super().__init__()
        self.norm_mod = norm_mod
        self.adaLN_modulation = _modulation(dim, 6)
        self.attn = QKV(dim, heads, rms)
        self.proj = nn.Linear(dim, dim)
        self.mlp = _mlp(dim)

    def qkv(self, x: torch.Tensor, mod: tuple) -> tuple[torch.Tensor, ...]:
        """``x [B, S, D]`` and this stream's six ``[B, D]`` modulation chunks -> q, k, v."""
        shift_msa, scale_msa = mod[:2]
        return self.attn(self.norm_mod(x, shift_msa, scale_msa))

    def finish(self, x: torch.Tensor, att: torch.Tensor, mod: tuple) -> torch.Tensor:
        """The gated residuals of attention (``att [B, S, D]``, this stream's share) and MLP."""
        _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod
        x = x + gate_msa[:, None] * self.proj(att)
        return x + gate_mlp[:, None] * self.mlp(self.norm_mod(x, shift_mlp, scale_mlp))


class JointBlock(nn.Module):
    """SD3's MMDiT joint block (diffusers ``JointTransformerBlock``): an image and a text
    stream, each modulated by ``c``, attending jointly over their concatenated tokens.

    ``forward(x, ctx, c)``: ``x [B, S, D]`` image tokens, ``ctx [B, T, D]`` text tokens,
    ``c [B, D]`` conditioning; returns ``(x, ctx)`` of the same shapes.
    """

    def __init__(self, dim: int, heads: int, norm_mod: Callable, rms: Callable) -> None:
        super().__init__()
        self.image, self.text = (JointStream(dim, heads, norm_mod, rms) for _ in range(2))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        streams, states = (self.image, self.text), (x, ctx)
        mods = [stream.adaLN_modulation(c).chunk(6, dim=1) for stream in streams]
        qkv = [stream.qkv(h, mod) for stream, h, mod in zip(streams, states, mods)]
        att = _attend(*(torch.cat(t, dim=2) for t in zip(*qkv))).split([x.shape[1], ctx.shape[1]], dim=1)
        return tuple(stream.finish(h, a, mod) for stream, h, a, mod in zip(streams, states, att, mods))


class MMDiT(nn.Module):
    """``depth`` :class:`JointBlock` s. ``forward(x, ctx, c)`` -> ``[B, S + T, D]``: both
    streams' outputs, so that the loss reaches every norm (SD3's last block drops the text
    stream's MLP; these blocks keep it)."""

    def __init__(self, dim: int, heads: int, depth: int, norm_mod: Callable, rms: Callable) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(JointBlock(dim, heads, norm_mod, rms) for _ in range(depth))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x, ctx = block(x, ctx, c)
        return torch.cat((x, ctx), dim=1)


def build_sd3(dim: int, heads: int, depth: int, provider: str) -> MMDiT:
    """A seeded :class:`MMDiT` whose AdaLNs and qk RMSNorms are ``provider``'s."""
    norm_mod, rms = ada_factory(provider), rms_factory(provider)
    torch.manual_seed(0)
    return randomize_norms(MMDiT(dim, heads, depth, norm_mod, rms))


class SingleStreamBlock(nn.Module):
    """Flux's single-stream block (BFL ``SingleStreamBlock``, diffusers
    ``FluxSingleTransformerBlock``): one modulated LayerNorm feeds attention (qk RMSNorm,
    RoPE) and the MLP in parallel; one Linear maps their concatenated outputs back, gated.

    ``forward(x, c)``: ``x [B, S, D]`` (text and image tokens), ``c [B, D]``; returns
    ``[B, S, D]``. RoPE: Llama's one-axis :class:`Rotary` stands in for Flux's three-axis
    one (the same elementwise work on q and k; no norm in it).
    """

    def __init__(self, dim: int, heads: int, norm_mod: Callable, rms: Callable, rotary: Rotary) -> None:
        super().__init__()
        self.norm_mod, self.rotary = norm_mod, [rotary]  # a list: the model owns the buffers
        self.modulation = _modulation(dim, 3)
        self.attn = QKV(dim, heads, rms)
        self.mlp_in = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(5 * dim, dim)  # [attention, GELU(mlp_in)] -> D

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.modulation(c).chunk(3, dim=1)
        h = self.norm_mod(x, shift, scale)
        q, k, v = self.attn(h)
        rope = self.rotary[0]
        att = _attend(rope(q, 0), rope(k, 0), v)
        return x + gate[:, None] * self.proj(torch.cat((att, F.gelu(self.mlp_in(h), approximate="tanh")), dim=-1))


class FluxSingle(nn.Module):
    """``depth`` :class:`SingleStreamBlock` s; ``forward(x, c)`` as the block's."""

    def __init__(self, dim: int, heads: int, depth: int, norm_mod: Callable, rms: Callable, max_pos: int) -> None:
        super().__init__()
        self.rotary = Rotary(dim // heads, max_pos)
        self.blocks = nn.ModuleList(SingleStreamBlock(dim, heads, norm_mod, rms, self.rotary) for _ in range(depth))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, c)
        return x


def build_flux(dim: int, heads: int, depth: int, provider: str, max_pos: int) -> FluxSingle:
    """A seeded :class:`FluxSingle` whose AdaLNs and qk RMSNorms are ``provider``'s."""
    norm_mod, rms = ada_factory(provider), rms_factory(provider)
    torch.manual_seed(0)
    return randomize_norms(FluxSingle(dim, heads, depth, norm_mod, rms, max_pos))


# ---------------------------------------------------------------------------------------
# Llama


class LlamaLayer(nn.Module):
    """Pre-norm decoder layer: RMSNorm -> causal attention with RoPE -> residual, RMSNorm ->
    SwiGLU MLP -> residual. No biases."""

    def __init__(self, hidden: int, heads: int, intermediate: int, norm: Callable, rotary: Rotary) -> None:
        super().__init__()
        self.heads, self.rotary = heads, [rotary]  # a list: the model owns the buffers
        self.input_layernorm = norm(hidden, 1e-6)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.post_attention_layernorm = norm(hidden, 1e-6)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, d = t.shape
        return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)  # [B, H, S, hd]

    def forward(self, x: torch.Tensor, start: int = 0, cache: tuple | None = None) -> torch.Tensor:
        """``x [B, S, hidden]`` at positions ``start ..``. Without ``cache``: causal attention
        over ``x``'s own tokens. With ``cache = (k, v)``, each ``[B, H, context, hd]``: the new
        keys/values are written at ``start ..`` and the queries attend to positions
        ``0 .. start + S - 1`` (one new token per step: every cached position is in its past)."""
        b, s, d = x.shape
        h = self.input_layernorm(x)
        rope = self.rotary[0]
        q = rope(self._heads(self.q_proj(h)), start)
        k = rope(self._heads(self.k_proj(h)), start)
        v = self._heads(self.v_proj(h))
        if cache is None:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            cache_k, cache_v = cache
            cache_k[:, :, start:start + s] = k
            cache_v[:, :, start:start + s] = v
            att = F.scaled_dot_product_attention(q, cache_k[:, :, :start + s], cache_v[:, :, :start + s])
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, s, d))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """``layers`` :class:`LlamaLayer` s and a final RMSNorm, on hidden states (no embedding).

    ``forward(x)``: training/prefill, ``x [B, S, hidden]``. :meth:`decode_step`: one token
    per sequence against the KV cache made by :meth:`make_cache`.
    """

    def __init__(self, hidden: int, heads: int, intermediate: int, layers: int, norm: Callable,
                 max_pos: int) -> None:
        super().__init__()
        self.rotary = Rotary(hidden // heads, max_pos)
        self.layers = nn.ModuleList(LlamaLayer(hidden, heads, intermediate, norm, self.rotary)
                                    for _ in range(layers))
        self.norm = norm(hidden, 1e-6)
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.position = self.prefill = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)

    def make_cache(self, batch: int, context: int, prefill: int, seed: int = 1) -> None:
        """Preallocate a ``[batch, H, context, hd]`` key and value cache per layer, random
        keys/values (the same for every provider: seeded) at positions ``< prefill``."""
        p = next(self.parameters())
        heads = self.layers[0].heads
        shape = (batch, heads, context, p.shape[-1] // heads)
        gen = torch.Generator(device=p.device).manual_seed(seed)
        self.cache = []
        for _ in self.layers:
            kv = [torch.zeros(shape, device=p.device, dtype=p.dtype) for _ in range(2)]
            for t in kv:
                t[:, :, :prefill] = torch.randn(shape[:2] + (prefill, shape[3]), generator=gen,
                                                device=p.device, dtype=p.dtype)
            self.cache.append(tuple(kv))
        self.position = self.prefill = prefill

    def decode_step(self, x: torch.Tensor) -> torch.Tensor:
        """One generated token per sequence: ``x [B, 1, hidden]`` -> ``[B, 1, hidden]``. When
        the cache is full the position goes back to the end of the prefill (stale entries
        past it are overwritten), so any number of steps can be timed."""
        if self.position >= self.cache[0][0].shape[2]:
            self.position = self.prefill
        for layer, cache in zip(self.layers, self.cache):
            x = layer(x, self.position, cache)
        self.position += 1
        return self.norm(x)


def build_llama(hidden: int, heads: int, intermediate: int, layers: int, provider: str, max_pos: int) -> Llama:
    """A seeded :class:`Llama` whose RMSNorms are ``provider``'s."""
    norm = rms_factory(provider)
    torch.manual_seed(0)
    return randomize_norms(Llama(hidden, heads, intermediate, layers, norm, max_pos))


# ---------------------------------------------------------------------------------------
# GPT-2


class GPTBlock(nn.Module):
    """GPT-2 block: ``ln_1`` -> causal attention -> residual, ``ln_2`` -> GELU MLP -> residual."""

    def __init__(self, hidden: int, heads: int, norm: Callable) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = norm(hidden, 1e-5)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.attn_proj = nn.Linear(hidden, hidden)
        self.ln_2 = norm(hidden, 1e-5)
        self.mlp = _mlp(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, S, hidden]`` -> the same shape."""
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``layers`` :class:`GPTBlock` s and the final ``ln_f``, on hidden states (no embedding)."""

    def __init__(self, hidden: int, heads: int, layers: int, norm: Callable) -> None:
        super().__init__()
        self.layers = nn.ModuleList(GPTBlock(hidden, heads, norm) for _ in range(layers))
        self.ln_f = norm(hidden, 1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.ln_f(x)


def build_gpt(hidden: int, heads: int, layers: int, provider: str) -> GPT:
    """A seeded :class:`GPT` whose LayerNorms are ``provider``'s."""
    norm = ln_factory(provider)
    torch.manual_seed(0)
    return randomize_norms(GPT(hidden, heads, layers, norm))


def randomize_norms(model: nn.Module, seed: int = 1) -> nn.Module:
    """Set every norm weight to ``1 + 0.1 * randn`` and bias to ``0.1 * randn`` (seeded, in
    module order, so every provider gets the same values). Norms: modules other than
    ``nn.Linear`` owning a 1-D ``weight``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, nn.Linear) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
                continue
            weight.copy_(1 + 0.1 * torch.randn(weight.shape, generator=gen))
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))
    return model


def first_linear_weight(model: nn.Module) -> torch.Tensor:
    """The first ``nn.Linear`` weight of the first block/layer (for the gradient check)."""
    first = model.blocks[0] if hasattr(model, "blocks") else model.layers[0]
    return next(m.weight for m in first.modules() if isinstance(m, nn.Linear))
