"""The models of ``cudnorm bench --models``: DiT (adaLN-Zero), SD3-like MMDiT joint blocks and
Flux-like single-stream blocks (adaLN modulation and per-head qk RMSNorm), a Llama-style
decoder and a GPT-2-style LayerNorm stack, each built with *norm factories* so that providers
differ only in their norms; the :class:`Case` s (configurations) of the full and the quick
run; and :func:`norm_work`, one step's norm calls alone (for ``norm_ms``).

Every builder seeds ``torch.manual_seed(0)`` first and no norm consumes random numbers at
construction (PyTorch's, cudnorm's and Liger's norms start at ones/zeros), so every
provider's model has the same weights. The norms' weights (and LayerNorm biases) are then
set from their own seeded generator, as a trained model's would be: with unit weights the
loss ``mean(final_norm(x) ** 2)`` would not depend on ``x`` at all, and every gradient
before the final norm would be rounding noise. Shapes: ``B`` batch, ``S`` tokens, ``D`` width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------
# Norm factories, per provider. A factory returns a new norm module (LayerNorm/RMSNorm) or,
# for DiT, the modulated-norm function ``norm_mod(x, shift, scale)``.


def torch_norm_mod(eps: float = 1e-6) -> Callable:
    """DiT's eager ``modulate(norm(x), shift, scale)``: ``x [B, S, D]``, shift/scale ``[B, D]``."""
    def norm_mod(x, shift, scale):
        # F.layer_norm without weight/bias is what nn.LayerNorm(D, elementwise_affine=False) runs
        return F.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale[:, None]) + shift[:, None]

    return norm_mod


def cudnorm_norm_mod(eps: float = 1e-6) -> Callable:
    """The same formula as :func:`torch_norm_mod`, fused by ``cudnorm.ada_layer_norm``."""
    import cudnorm  # noqa: PLC0415

    def norm_mod(x, shift, scale):
        return cudnorm.ada_layer_norm(x, scale, shift, eps=eps, one_plus_scale=True)

    return norm_mod


def _liger_rms_norm(hidden: int, eps: float) -> nn.Module:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm  # noqa: PLC0415

    # casting_mode="llama": rstd in fp32, the normalised x cast to x's dtype, then times the
    # weight -- nn.RMSNorm's order. in_place=False: its backward must not overwrite dy.
    return LigerRMSNorm(hidden, eps=eps, offset=0.0, casting_mode="llama", in_place=False)


def _liger_layer_norm(hidden: int, eps: float) -> nn.Module:
    from liger_kernel.transformers.layer_norm import LigerLayerNorm  # noqa: PLC0415

    # bias=False only means "start the bias at zeros" (no random init): it is still learned
    return LigerLayerNorm(hidden, eps=eps, bias=False)


def _cudnorm_module(name: str):
    def make(hidden: int, eps: float) -> nn.Module:
        import cudnorm  # noqa: PLC0415

        return getattr(cudnorm, name)(hidden, eps=eps)

    return make


def norm_provider(provider: str) -> str:
    """The norms a provider's model is built with: ``cudnorm-cudnn`` is cudnorm's modules run
    with every call on cuDNN, ``cudnorm-python`` the same on the Python launch path and
    ``cudnorm-torch`` the same with every call on PyTorch's ops (:func:`provider_settings`); ``torch-again`` is PyTorch's norms in a second model, the
    run's noise floor (its ratio to ``torch`` is 1.00x but for noise)."""
    return {"cudnorm-cudnn": "cudnorm", "cudnorm-python": "cudnorm", "cudnorm-torch": "cudnorm",
            "cudnorm-blocks": "cudnorm", "torch-again": "torch"}.get(provider, provider)


# provider -> the cudnorm.config it runs under
PROVIDER_CONFIG = {"cudnorm-cudnn": {"policy": "cudnn"}, "cudnorm-python": {"policy": "cudnn", "native": "off"},
                   "cudnorm-torch": {"policy": "torch"}}


def provider_settings(provider: str):
    """A context manager for everything a provider's model runs (build, compile, steps):
    ``cudnorm-cudnn`` sets ``cudnorm.config(policy="cudnn")``, ``cudnorm-python`` also
    ``native="off"`` (the Python launch path), ``cudnorm-torch`` ``policy="torch"`` (cudnorm's
    modules around PyTorch's kernels: what cudnorm's own Python costs), the others change nothing. Compiled blocks keep
    the policy of their tracing."""
    import contextlib  # noqa: PLC0415

    if provider not in PROVIDER_CONFIG:
        return contextlib.nullcontext()
    from cudnorm import _settings  # noqa: PLC0415

    return _settings.config(**PROVIDER_CONFIG[provider])


# (norm, provider) -> factory(hidden, eps): the module computing what PyTorch's own computes
_NORM_FACTORIES = {
    ("rms", "torch"): lambda hidden, eps: nn.RMSNorm(hidden, eps=eps),
    ("rms", "cudnorm"): _cudnorm_module("RMSNorm"),
    ("rms", "liger"): _liger_rms_norm,
    ("ln", "torch"): lambda hidden, eps: nn.LayerNorm(hidden, eps=eps),
    ("ln", "cudnorm"): _cudnorm_module("LayerNorm"),
    ("ln", "liger"): _liger_layer_norm,
}


def ada_factory(provider: str) -> Callable:
    """``norm_mod(x, shift, scale)`` of ``provider``: cudnorm's fused op for the cudnorm
    providers, else PyTorch's formula (Liger has no AdaLN: its SD3/Flux models differ from
    torch's only in the qk RMSNorms)."""
    return (cudnorm_norm_mod if norm_provider(provider) == "cudnorm" else torch_norm_mod)()


def rms_factory(provider: str) -> Callable[[int, float], nn.Module]:
    """``factory(hidden, eps)`` -> an RMSNorm computing what ``nn.RMSNorm`` computes."""
    return _NORM_FACTORIES[("rms", norm_provider(provider))]


def ln_factory(provider: str) -> Callable[[int, float], nn.Module]:
    """``factory(hidden, eps)`` -> an affine LayerNorm (weight ones, bias zeros)."""
    return _NORM_FACTORIES[("ln", norm_provider(provider))]


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


# ---------------------------------------------------------------------------------------
# Cases: the model configurations of the full and the quick run


class CaseMode:
    """What the ``name`` and ``mode`` of a case (:class:`Case`, ``real_models.RealCase``) say."""

    name: str
    mode: str

    @property
    def id(self) -> str:
        return f"{self.name}:{self.mode}"

    @property
    def train(self) -> bool:
        return self.mode.startswith("train")

    @property
    def compiled(self) -> bool:
        return "compile" in self.mode


@dataclass(frozen=True)
class Case(CaseMode):
    """One model configuration in one mode. ``seq``: tokens per sequence (SD3: image tokens;
    Flux: image and text tokens; decode: the prefilled cache length when timing starts; each
    step adds one token). Mode ``train-autocast``: fp32 parameters (fp32 master weights, norm
    weights included), bf16 inputs and the forward under ``torch.autocast(bfloat16)``, so
    the norms see bf16 activations with fp32 weights."""

    model: str  # "dit" | "sd3" | "flux" | "llama" | "gpt2"
    name: str  # e.g. "dit-1152-b8-s1024"
    # "train" | "train-compile[-<torch.compile mode>]" | "train-autocast" | "infer" | "decode-b<N>"
    mode: str
    batch: int
    seq: int
    width: int
    heads: int
    depth: int
    intermediate: int = 0  # Llama MLP width
    context: int = 0  # decode: KV-cache length
    text: int = 0  # SD3: text-stream tokens

    # compiled only when a filter term names it, even in a full run on a GPU (see select)
    compile_on_request: ClassVar[bool] = False

    @property
    def compile_mode(self) -> str | None:
        """``torch.compile``'s ``mode`` (``"max-autotune"``, ``"reduce-overhead"``) of a
        ``train-compile-<mode>`` case; ``None`` for its default (and uncompiled cases)."""
        return self.mode.partition("compile")[2].lstrip("-") or None

    @property
    def cuda_graphs(self) -> bool:
        """Compiled in a mode whose graphs Inductor replays as CUDA graphs (``reduce-overhead``
        and ``max-autotune``)."""
        return self.compile_mode in ("reduce-overhead", "max-autotune")

    def compile(self, fn: Callable) -> Callable:
        """``fn`` compiled as this case asks (static shapes: each new (B, S, D) is a
        recompile, as for a fixed-resolution job), or ``fn`` itself when not compiled."""
        return torch.compile(fn, dynamic=False, mode=self.compile_mode) if self.compiled else fn

    @property
    def autocast(self) -> bool:
        return self.mode.endswith("autocast")

    @property
    def decode(self) -> bool:
        return self.mode.startswith("decode")


# torch.compile's modes besides its default, for a host-bound and a GPU-bound DiT step:
# mode="reduce-overhead" replays CUDA graphs (no host cost left, only kernels and fusions count;
# docs/performance.md, call Q); max-autotune also tunes GEMMs (minutes per model) and replays CUDA graphs (call U)
EXTRA_COMPILE_MODES = ("train-compile-max-autotune", "train-compile-reduce-overhead")


def _dit_cases(dims, seqs, batches, depth) -> list[Case]:
    return [Case("dit", f"dit-{d}-b{b}-s{s}", mode, b, s, d, h, depth)
            for mode in ("train", "train-compile", "infer") for d, h in dims for s in seqs for b in batches]


def _autocast_cases(cases: list[Case]) -> list[Case]:
    """The ``train-autocast`` twin of each case."""
    return [replace(c, mode="train-autocast") for c in cases]


_DIFFUSION_MODES = ("train", "train-autocast", "infer")


def _sd3_cases(b, s, t, d, h, depth) -> list[Case]:
    return [Case("sd3", f"sd3-{d}-b{b}-s{s}-t{t}", mode, b, s, d, h, depth, text=t) for mode in _DIFFUSION_MODES]


def _flux_cases(b, s, d, h, depth) -> list[Case]:
    return [Case("flux", f"flux-{d}-b{b}-s{s}", mode, b, s, d, h, depth) for mode in _DIFFUSION_MODES]


def _llama_cases(hidden, heads, inter, layers, train_bs, decode_batches, context) -> list[Case]:
    b, s = train_bs
    cases = [Case("llama", f"llama-{hidden}-b{b}-s{s}", mode, b, s, hidden, heads, layers, inter)
             for mode in ("train", "train-compile")]
    return cases + [Case("llama", f"llama-{hidden}", f"decode-b{n}", n, context // 2, hidden, heads, layers, inter,
                         context) for n in decode_batches]


def all_cases(quick: bool) -> list[Case]:
    """Every configuration of the full run, or of the quick run (tiny, seconds on a CPU).

    SD3-like: SD3-medium's width and heads (D = 1536, 24 x 64), 4096 image tokens (a
    1024 x 1024 image: 128 x 128 latents in 2 x 2 patches) and 154 text tokens, B = 2, 6
    joint blocks (SD3-medium has 24). Flux-like: Flux's single-stream width and heads
    (D = 3072, 24 x 128), 4096 image + 512 text tokens, B = 1, 4 blocks (Flux has 38).
    Depths keep a step within tens of ms on an H100.
    """
    if quick:
        dit = _dit_cases([(64, 4)], [16], [2], depth=2)
        return (dit + _autocast_cases([c for c in dit if c.mode == "train"])
                + _sd3_cases(2, 16, 8, 64, 4, depth=2) + _flux_cases(1, 24, 64, 4, depth=2)
                + _llama_cases(64, 4, 128, 2, (2, 32), (1, 2), context=64)
                + [Case("gpt2", "gpt2-64-b2-s32", mode, 2, 32, 64, 4, 2) for mode in ("train", "train-compile")])
    dit = _dit_cases([(1152, 16), (3072, 24)], [256, 1024], [2, 8, 32], depth=4)
    dit += [replace(c, mode=mode) for c in dit if c.mode == "train" and c.name in ("dit-1152-b8-s256", "dit-1152-b32-s1024")
            for mode in EXTRA_COMPILE_MODES]
    return (dit + _autocast_cases([c for c in dit if c.mode == "train" and c.name.startswith("dit-1152-b8-")])
            + _sd3_cases(2, 4096, 154, 1536, 24, depth=6) + _flux_cases(1, 4608, 3072, 24, depth=4)
            + _llama_cases(4096, 32, 11008, 4, (2, 4096), (1, 32), context=1024)
            + [Case("gpt2", "gpt2-1024-b8-s1024", mode, 8, 1024, 1024, 16, 4) for mode in ("train", "train-compile")])


def select(cases: list, filter_text: str | None, device: str, quick: bool) -> list:
    """Cases (these and :mod:`.real_models`') whose id contains any comma-separated term of
    ``filter_text`` ("all": every case); a term that is a whole case id selects that case only
    (``dit-1152-b8-s256:train`` not its ``:train-compile``). Compile modes run on a GPU in a
    full run, elsewhere (and those of cases ``compile_on_request``) only when a term names them."""
    terms = [] if filter_text in (None, "", "all") else [t.strip() for t in filter_text.split(",") if t.strip()]
    ids = {c.id for c in cases}
    exact, parts = {t for t in terms if t in ids}, [t for t in terms if t not in ids]
    chosen = [c for c in cases if not terms or c.id in exact or any(t in c.id for t in parts)]
    named = any("compile" in t for t in terms)
    opt_in = device != "cuda" or quick
    return [c for c in chosen if not c.compiled or named or not (opt_in or c.compile_on_request)]


def dtypes(case: Case, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """``(parameters, activations)`` of ``case`` in a run of ``dtype``: fp32 and bf16 in
    ``train-autocast``, else both ``dtype``."""
    return (torch.float32, torch.bfloat16) if case.autocast else (dtype, dtype)


def norm_work(case: Case, provider: str, device: str, dtype: torch.dtype) -> Callable[[], None]:
    """A zero-argument function running one step's norm calls on static tensors: as many
    calls as one forward makes, each at its activation shape (per block: DiT 2 AdaLN; SD3 2
    AdaLN and a q and a k RMSNorm per stream; Flux 1 AdaLN, q and k RMSNorm; Llama/GPT-2 2
    norms per layer and the final one), followed in training by its autograd backward (grads
    of the input and of the norm's parameters, or of the AdaLN modulation), under autocast in
    ``train-autocast``. Compile modes compile the norm functions alone (a stand-in: inside a
    compiled block inductor may fuse them)."""
    b, d, hd = case.batch, case.width, case.width // case.heads
    s = 1 if case.decode else case.seq
    params, act = dtypes(case, dtype)
    calls = []  # (norm, its arguments, the leaves its backward reaches, dy), one per call

    def randn(*shape):
        return torch.randn(shape, device=device, dtype=act, requires_grad=case.train)

    def compiled(fn):
        # torch.compile's default mode whatever the case's: this work is itself captured in a
        # CUDA graph (models.norm_ms), which mode="reduce-overhead"'s own graphs cannot nest in
        return torch.compile(fn, dynamic=False) if case.compiled else fn

    def ada(tokens: int, chunks: int, count: int) -> None:
        x, mod = randn(b, tokens, d), randn(b, chunks * d)
        fn = compiled(ada_factory(provider))
        calls.extend([(fn, lambda: (x, *mod.chunk(chunks, dim=1)[:2]), [x, mod], torch.randn_like(x))] * count)

    def norm(factory, shape: tuple, eps: float, count: int) -> None:
        x = randn(*shape)
        module = factory(provider)(shape[-1], eps).to(device, params)
        calls.extend([(compiled(module), lambda: (x,), [x, *module.parameters()], torch.randn_like(x))] * count)

    n = case.depth
    if case.model == "dit":
        ada(s, 6, 2 * n)
    elif case.model == "sd3":
        for tokens in (s, case.text):
            ada(tokens, 6, 2 * n)
            norm(rms_factory, (b, tokens, case.heads, hd), 1e-6, 2 * n)
    elif case.model == "flux":
        ada(s, 3, n)
        norm(rms_factory, (b, s, case.heads, hd), 1e-6, 2 * n)
    else:
        llama = case.model == "llama"
        norm(rms_factory if llama else ln_factory, (b, s, d), 1e-6 if llama else 1e-5, 2 * n + 1)

    def work():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=case.autocast):
            for fn, args, leaves, dy in calls:
                y = fn(*args())
                if case.train:
                    torch.autograd.grad(y, leaves, dy)

    return work
