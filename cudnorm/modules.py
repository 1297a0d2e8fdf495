"""Drop-in ``nn.Module`` front ends of the functional ops.

``LayerNorm``/``RMSNorm`` subclass PyTorch's own modules, so constructor arguments,
parameters, ``state_dict`` keys and ``repr`` are exactly PyTorch's: a checkpoint saved from
``torch.nn.LayerNorm`` loads into ``cudnorm.LayerNorm`` and back.

The AdaLN modules follow diffusers' classes of the same names (``linear.weight``,
``linear.bias``, chunk orders), so a pretrained ``state_dict`` loads into them. Their
constructors take everything after ``dim`` by keyword: diffusers' classes of the same names
order their arguments differently (``AdaLayerNormZero(dim, num_embeddings)``,
``AdaLayerNormContinuous(dim, cond_dim, elementwise_affine, eps)``), and a positional call
written for one must not silently build something else with the other.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch

from . import _checks, _entry, _norm, _policy
from .ada_layer_norm import ada_layer_norm
from .ada_rms_norm import ada_rms_norm
from .layer_norm import layer_norm
from .rms_norm import rms_norm


class LayerNorm(torch.nn.LayerNorm):
    """:class:`torch.nn.LayerNorm` running :func:`cudnorm.layer_norm`.

    Input ``[*, *normalized_shape]`` in fp16/bf16/fp32; parameters may be fp32 while the
    input is bf16/fp16 (mixed precision keeps fp32 master weights and fp32 gradients).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input``: ``[*, *normalized_shape]``; returns the same shape and dtype."""
        # the parameters straight from their dict: nn.Module.__getattr__ is a Python call per read,
        # which a host-bound step pays (tests/test_patch_host_cost.py counts them); a weight that is
        # no parameter (torch.nn.utils.weight_norm sets a computed one on the instance) is read as usual
        params = self._parameters
        weight = params["weight"] if "weight" in params else self.weight
        bias = params["bias"] if "bias" in params else self.bias
        eps = self.eps
        # the native path's C++ applies the same policy; a traced call takes the function's checks,
        # which make a mistake raise the eager error under torch.compile too
        if _entry.native or (_entry.pending and _entry.try_native(input)) or _entry.is_compiling():
            return layer_norm(input, self.normalized_shape, weight, bias, eps)
        if _policy.torch_serves(input, weight, bias):
            # PyTorch's op, as nn.LayerNorm runs it, minus F.layer_norm's Python wrapper (small
            # models' steps are host-bound). A mistake raises cudnorm's error whichever kernels
            # serve the call: PyTorch's op refuses every mistake cudnorm's checks find but an eps
            # (negative, not finite, not a float: checked first), so they run only where it raised
            # and the common call pays no second check
            if type(eps) is float and 0.0 <= eps < math.inf:
                try:
                    return torch.layer_norm(input, self.normalized_shape, weight, bias, eps)
                except Exception:  # cudnorm's checks name the mistake; PyTorch's error where they find none
                    pass
            _checks.norm_call("layer_norm", input, self.normalized_shape, {"weight": weight, "bias": bias}, eps)
            return torch.layer_norm(input, self.normalized_shape, weight, bias, eps)
        return layer_norm(input, self.normalized_shape, weight, bias, eps)


class RMSNorm(torch.nn.RMSNorm):
    """:class:`torch.nn.RMSNorm` running :func:`cudnorm.rms_norm` (``eps=None`` means
    ``torch.finfo(input.dtype).eps``, as in PyTorch)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input``: ``[*, *normalized_shape]``; returns the same shape and dtype."""
        params = self._parameters  # as in LayerNorm.forward
        weight, eps = params["weight"] if "weight" in params else self.weight, self.eps
        if _entry.native or (_entry.pending and _entry.try_native(input)) or _entry.is_compiling():
            return rms_norm(input, self.normalized_shape, weight, eps)  # as in LayerNorm.forward
        if _policy.torch_serves(input, weight):  # PyTorch's op, checked as in LayerNorm.forward
            if eps is None or (type(eps) is float and 0.0 <= eps < math.inf):
                try:  # torch.rms_norm itself where the dtypes match: no Python frame (host-bound steps)
                    if weight is None or weight.dtype is input.dtype:
                        return torch.rms_norm(input, self.normalized_shape, weight, eps)
                    return _norm.torch_rms_norm(input, self.normalized_shape, weight, eps)
                except Exception:
                    pass
            # eps=None is PyTorch's default, the dtype's machine epsilon: any valid eps checks the rest
            _checks.norm_call("rms_norm", input, self.normalized_shape, {"weight": weight}, 0.0 if eps is None else eps)
            return _norm.torch_rms_norm(input, self.normalized_shape, weight, eps)
        return rms_norm(input, self.normalized_shape, weight, self.eps)


class FusedAddLayerNorm(LayerNorm):
    """:class:`LayerNorm` with the pre-norm residual add fused in: ``forward(input, residual)``
    returns ``(layer_norm(h), h)`` with ``h = input + residual`` (both ``[*, *normalized_shape]``,
    one dtype). Parameters and ``state_dict`` are :class:`torch.nn.LayerNorm`'s."""

    def forward(self, input: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y, h)``: the normalised sum and the sum itself (the next residual)."""
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, residual=residual)


class FusedAddRMSNorm(RMSNorm):
    """:class:`RMSNorm` with the pre-norm residual add fused in, like Liger's
    ``LigerFusedAddRMSNorm``: ``forward(input, residual)`` returns ``(rms_norm(h), h)`` with
    ``h = input + residual``. Parameters and ``state_dict`` are :class:`torch.nn.RMSNorm`'s."""

    def forward(self, input: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y, h)``: the normalised sum and the sum itself (the next residual)."""
        return rms_norm(input, self.normalized_shape, self.weight, self.eps, residual=residual)


def _options_by_keyword(diffusers_arguments: str):
    """Decorate an AdaLN module's ``__init__(self, dim, *, ...)`` so that options passed by
    position raise a ``TypeError`` naming the keywords and pointing to the diffusers class of
    the same name, whose positional ``diffusers_arguments`` such a call was likely written for."""

    def decorate(init):
        keywords = ", ".join(f"{name}=" for name, p in inspect.signature(init).parameters.items()
                             if p.kind is p.KEYWORD_ONLY)

        @functools.wraps(init)
        def checked(self, dim, *positional, **options):
            if positional:
                name = type(self).__name__
                raise TypeError(
                    f"cudnorm.{name} takes one positional argument, dim; pass {keywords} by keyword "
                    f"(got {len(positional)} more positional: {', '.join(map(repr, positional))}). diffusers' "
                    f"{name}({diffusers_arguments}) is cudnorm.diffusers.{name}")
            init(self, dim, **options)

        return checked

    return decorate


class AdaLayerNorm(torch.nn.Module):
    """DiT's ``modulate(norm(x), shift, scale)``, fused: ``layer_norm(x) * (1 + scale) + shift``
    with a non-affine LayerNorm. No parameters: shift/scale come from the caller.

    ``forward(x, shift, scale)``: ``x [B, *, D]``; shift/scale ``[B, D]`` or ``[B, 1, D]``
    (note the argument order: shift first, as in DiT's ``modulate``).
    """

    @_options_by_keyword("embedding_dim, num_embeddings, ...")
    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``norm(x) * (1 + scale) + shift``; ``x [B, *, D]``, shift/scale ``[B, D]`` or ``[B, 1, D]``."""
        _checks.check_width("AdaLayerNorm", "x", x, self.dim)
        return ada_layer_norm(x, scale, shift, self.eps, one_plus_scale=True)

    def extra_repr(self) -> str:
        """``dim, eps=...`` (shown by ``repr``)."""
        return f"{self.dim}, eps={self.eps}"


class AdaRMSNorm(torch.nn.Module):
    """Adaptive RMSNorm: ``rms_norm(x) * (1 + scale) + shift`` (``one_plus_scale=False``:
    ``* scale``) with a non-affine RMSNorm. No parameters: scale/shift come from the caller.

    ``forward(x, scale, shift=None)``: ``x [B, *, D]``; scale/shift ``[B, D]`` or ``[B, 1, D]``
    (scale first, as :func:`cudnorm.ada_rms_norm` takes them).
    """

    @_options_by_keyword("embedding_dim, ...")
    def __init__(self, dim: int, *, eps: float = 1e-6, one_plus_scale: bool = True) -> None:
        super().__init__()
        self.dim, self.eps, self.one_plus_scale = dim, eps, one_plus_scale

    def forward(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        """``rms_norm(x) * gain + shift``; ``x [B, *, D]``, scale/shift ``[B, D]`` or ``[B, 1, D]``."""
        _checks.check_width("AdaRMSNorm", "x", x, self.dim)
        return ada_rms_norm(x, scale, shift, self.eps, one_plus_scale=self.one_plus_scale)

    def extra_repr(self) -> str:
        """``dim, eps=..., one_plus_scale=...`` (shown by ``repr``)."""
        return f"{self.dim}, eps={self.eps}, one_plus_scale={self.one_plus_scale}"


class AdaLayerNormZero(torch.nn.Module):
    """adaLN-Zero (DiT): ``emb -> SiLU -> Linear(cond_dim, 6 * dim)`` chunked as
    ``(shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp)``.

    ``forward(x, emb)`` with ``x [B, *, D]``, ``emb [B, cond_dim]`` returns
    ``(norm(x) * (1 + scale_msa) + shift_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp)``,
    the chunks ``[B, D]``, as ``diffusers.models.normalization.AdaLayerNormZero`` does.
    The linear layer starts at zero (DiT's init), so the block starts as the identity.

    ``cond_dim`` is the width of ``emb``; left out, it is ``dim`` (DiT's conditioning, the sum
    of the timestep and label embeddings, has the model's width).
    """

    @_options_by_keyword("embedding_dim, num_embeddings, ...")
    def __init__(self, dim: int, *, cond_dim: int | None = None, eps: float = 1e-6, bias: bool = True) -> None:
        super().__init__()
        self.silu = torch.nn.SiLU()
        self.linear = torch.nn.Linear(dim if cond_dim is None else cond_dim, 6 * dim, bias=bias)
        torch.nn.init.zeros_(self.linear.weight)
        if bias:
            torch.nn.init.zeros_(self.linear.bias)
        self.norm = AdaLayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, emb: torch.Tensor):
        """``(norm(x) * (1 + scale_msa) + shift_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp)``
        from ``x [B, *, D]`` and ``emb [B, cond_dim]``."""
        _checks.check_width("AdaLayerNormZero", "x", x, self.norm.dim)
        _checks.check_conditioning("AdaLayerNormZero", "emb", emb, x, self.linear.in_features)
        emb = emb.to(self.linear.weight.dtype)  # fp32 conditioning into a bf16 module, as diffusers casts it
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(self.silu(emb)).chunk(6, dim=1)
        return self.norm(x, shift_msa, scale_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormContinuous(torch.nn.Module):
    """SD3/Flux's output norm: ``emb -> SiLU -> Linear(cond_dim, 2 * dim)`` chunked as
    ``(scale, shift)``, then ``norm(x) * (1 + scale) + shift``.

    ``forward(x, emb)``: ``x [B, *, D]``, ``emb [B, cond_dim]``. With ``elementwise_affine``
    the norm has ``norm.weight``/``norm.bias`` (diffusers' default layout); they are folded
    into the per-sample scale/shift (``[B, D]`` work), so the op still reads ``x`` once.
    """

    @_options_by_keyword("embedding_dim, conditioning_embedding_dim, elementwise_affine, eps, ...")
    def __init__(self, dim: int, *, cond_dim: int, eps: float = 1e-6, elementwise_affine: bool = False,
                 bias: bool = True) -> None:
        super().__init__()
        self.silu = torch.nn.SiLU()
        self.linear = torch.nn.Linear(cond_dim, 2 * dim, bias=bias)
        self.norm = LayerNorm(dim, eps=eps, elementwise_affine=elementwise_affine, bias=bias)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """``norm(x) * (1 + scale) + shift`` with ``(scale, shift)`` projected from ``emb [B, cond_dim]``."""
        _checks.check_width("AdaLayerNormContinuous", "x", x, self.norm.normalized_shape[0])
        _checks.check_conditioning("AdaLayerNormContinuous", "emb", emb, x, self.linear.in_features)
        emb = emb.to(self.linear.weight.dtype)  # as in AdaLayerNormZero.forward
        scale, shift = self.linear(self.silu(emb)).chunk(2, dim=1)
        weight, bias = self.norm.weight, self.norm.bias
        if weight is None:
            return ada_layer_norm(x, scale, shift, self.norm.eps, one_plus_scale=True)
        # (xhat * w + b) * gain + shift == xhat * (w * gain) + (b * gain + shift)
        gain = 1 + scale
        shift = shift if bias is None else bias * gain + shift
        return ada_layer_norm(x, weight * gain, shift, self.norm.eps)
