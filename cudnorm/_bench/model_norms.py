"""The norms a bench model is built with, per provider: *norm factories* (a new LayerNorm or
RMSNorm module, or DiT's modulated-norm function), and the ``cudnorm.config`` each provider's
model runs under. Models (:mod:`.model_zoo`, :mod:`.real_models`) differ between providers only
in these norms.

Every factory starts its norms at ones and zeros and consumes no random numbers, so a model
built after ``torch.manual_seed(0)`` has the same weights whichever provider's norms it holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import nn


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
