"""DTensor sharding rules for cudnorm's custom ops, registered with PyTorch's ``register_sharding``.

Every op normalises rows over the last dim: ``x: [M, N]`` (LayerNorm, RMSNorm, the fused
residual add) or ``[B, S, D]`` (AdaLN, per-sample ``scale``/``shift: [B, D]``). A shard of the
rows is a smaller call of the same op, so each rank runs its local rows. A rule offers, per
mesh dim (DTensor picks the offer its inputs reach most cheaply and redistributes to it):

* ``x`` sharded on a row dim: a ``Shard``, or the ``_StridedShard`` that the public
  functions' ``reshape(-1, N)`` makes of a ``[B, S, N]`` input sharded on ``S``. Outputs and
  statistics are sharded alike, weight and bias ``Replicate`` and their gradients ``Partial``
  (each rank sums over its own rows; PyTorch reduces them when they are read). AdaLN's
  ``scale``/``shift`` follow a batch shard (their gradients too) and are replicated for a
  sequence shard (their gradients ``Partial``).
* everything ``Replicate``: outputs and gradients ``Replicate``.
* nothing for a shard of the normalised dim: DTensor redistributes such an input to one of
  the offers above (an all-gather to ``Replicate``, or an all-to-all to a row shard) before
  the op; PyTorch's own LayerNorm rule also replicates the normalised dims.

Statistics are laid out by flattened row (RMSNorm's rstd ``[M]``; ``[k, ceil4(rows)]`` mean and
rstd), so they take the placement ``x``'s rows have after a flatten. A rank's statistics cover
its local rows (padded per rank) and only the matching backward reads them: a backward rule
offers only the placements whose statistics are the ones its forward gave, so they are never
redistributed.

Importing ``torch.distributed.tensor`` costs over a second (it pulls in sympy), so ``import
cudnorm`` does not: :func:`install` registers the rules at once when DTensor is already
loaded, and otherwise when ``torch.distributed.tensor`` is first imported, which happens
before any DTensor can exist, so no DTensor ever reaches cudnorm's ops unruled.
"""

from __future__ import annotations

import importlib.abc
import sys

import torch

from . import _fused_add, ada_layer_norm, layer_norm, rms_norm  # noqa: F401 - they define the ops ruled here


def _rows(x, dims=(0,)) -> list:
    """Placements offered for ``x``: ``Replicate``, ``Shard`` of each row dim in ``dims``, and
    the shard of a row dim that ``x`` already has (a ``_StridedShard`` runs locally as well:
    any split of whole rows does)."""
    found = [_REP, *(Shard(d) for d in dims)]
    found += [p for p in x.placements if isinstance(p, (Shard, _StridedShard)) and p.dim in dims and p not in found]
    return found


def _flat(p, lead: int, dim: int):
    """The placement on ``dim`` of rows flattened from ``x`` placed by ``p``, ``lead`` rows
    before each step of ``p``'s dim (what DTensor's reshape rule gives); ``Replicate`` stays."""
    if p == _REP:
        return p
    factor = getattr(p, "split_factor", 1) * lead
    return Shard(dim) if factor == 1 else _StridedShard(dim, split_factor=factor)


def _rstd(p, training: bool):
    """RMSNorm's ``rstd: [M]`` for ``x`` placed by ``p`` (empty, so replicated, without training)."""
    return p if training else _REP


def _mean_rstd(p, training: bool):
    """``[k, ceil4(M)]`` statistics for ``x: [M, N]`` placed by ``p`` (``[k, 0]`` without training)."""
    return _flat(p, 1, 1) if training else _REP


def _given(offers: list, stats, stats_of) -> list:
    """The backward's offers: those whose statistics placement ``stats_of(p, True)`` is the
    one the forward gave ``stats``."""
    return [p for p in offers if stats_of(p, True) in stats.placements]


def _grad(p):
    """Gradient placement of a replicated parameter when ``x`` is placed by ``p``."""
    return _REP if p == _REP else Partial()


def _opt(t, placement):
    return None if t is None else placement  # an absent optional tensor takes no placement


# One rule per op, taking the op's arguments (tensors as DTensorSpecs, None for an absent
# optional one) and returning, per offer, (output placements, input placements) in schema order.

def _rms_norm_fwd(x, weight, eps, training, offset=0.0):
    return [((p, _rstd(p, training)), (p, _opt(weight, _REP))) for p in _rows(x)]


def _rms_norm_bwd(dy, x, weight, rstd, offset=0.0):
    return [((p, _grad(p)), (p, p, _opt(weight, _REP), _rstd(p, True))) for p in _given(_rows(x), rstd, _rstd)]


def _layer_norm_fwd(x, weight, bias, eps, training):
    return [((p, _mean_rstd(p, training)), (p, _opt(weight, _REP), _opt(bias, _REP))) for p in _rows(x)]


def _layer_norm_bwd(dy, x, weight, stats):
    return [((p, _grad(p), _grad(p)), (p, p, _opt(weight, _REP), _mean_rstd(p, True)))
            for p in _given(_rows(x), stats, _mean_rstd)]


def _add_norm_fwd(x, residual, weight, bias, eps, training, rms, offset=0.0):
    return [((p, p, _mean_rstd(p, training)), (p, p, _opt(weight, _REP), _opt(bias, _REP))) for p in _rows(x)]


def _add_norm_bwd(dy, dh, h, weight, stats, rms, offset=0.0):
    return [((p, _grad(p), _grad(p)), (_opt(dy, p), _opt(dh, p), p, _opt(weight, _REP), _mean_rstd(p, True)))
            for p in _given(_rows(h), stats, _mean_rstd)]


def _ada_offers(x) -> list[tuple]:
    """``(x, scale/shift, statistics)`` placements offered for AdaLN's ``x: [B, S, D]``: a batch
    shard shards the modulation alike, a sequence shard replicates it."""
    return [(p, p, _flat(p, 1, 1)) if p == _REP or p.dim == 0 else (p, _REP, _flat(p, x.shape[0], 1))
            for p in _rows(x, (0, 1))]


def _ada_layer_norm_fwd(x, scale, shift, eps, one_plus_scale, training):
    return [((p, stats if training else _REP), (p, mod, mod)) for p, mod, stats in _ada_offers(x)]


def _ada_layer_norm_bwd(dy, x, scale, stats, one_plus_scale, shift_dtype):
    offers = []
    for p, mod, stats_p in _ada_offers(x):
        if stats_p in stats.placements:
            dmod = _grad(p) if mod == _REP else mod  # a sharded modulation's gradient is sharded alike
            offers.append(((p, dmod, dmod), (p, p, mod, stats_p)))
    return offers


_RULES = {"rms_norm_fwd": _rms_norm_fwd, "rms_norm_bwd": _rms_norm_bwd,
          "layer_norm_fwd": _layer_norm_fwd, "layer_norm_bwd": _layer_norm_bwd,
          "add_norm_fwd": _add_norm_fwd, "add_norm_bwd": _add_norm_bwd,
          "ada_layer_norm_fwd": _ada_layer_norm_fwd, "ada_layer_norm_bwd": _ada_layer_norm_bwd}


def _register() -> None:
    """Register every rule of :data:`_RULES` for its ``cudnorm::`` op."""
    global DTensor, Partial, Shard, _StridedShard, _REP  # the placement types the rules above use
    try:  # private names among them (tried on torch 2.11 and 2.13); cudnorm supports torch >= 2.5
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
        from torch.distributed.tensor.experimental import register_sharding
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # no rules: a DTensor reaching cudnorm's op raises DTensor's error naming the op
        return
    _REP = Replicate()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name, rule in _RULES.items():
        op = getattr(torch.ops.cudnorm, name).default
        register_sharding(op)(rule)
        # register_sharding keys DTensor's cache of sharding decisions on the op's int arguments
        # only; ours are floats, bools and a dtype, and ``training`` sets the statistics' shape:
        # unkeyed, a no-grad call after a training call with the same placements got the
        # training call's global shape on its empty statistics (torch 2.13). Key on them all.
        args = op._schema.arguments
        scalars = [i for i, a in enumerate(args) if "Tensor" not in str(a.type)]
        if scalars:
            propagator.op_to_schema_info[op] = RuntimeSchemaInfo(
                static_argnum=scalars[0], static_kwargkey=[args[i].name for i in scalars], needs_pytree=True)


_DTENSOR = "torch.distributed.tensor"


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds ``torch.distributed.tensor`` through the other finders and has its loader call
    :func:`_register` once the module has executed; then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DTENSOR:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)  # legacy finders have only find_module
            spec = None if find is None else find(fullname, path, target)
            if spec is not None:
                spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    """``loader``, registering the rules after it has executed the module; the module keeps
    the original loader (``__loader__``, ``__spec__.loader``)."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        _register()


def install() -> None:
    """Register the rules now if ``torch.distributed.tensor`` is loaded, else when it is
    first imported (cudnorm's ops must be defined: the package calls this last)."""
    if not torch.distributed.is_available():
        return
    if _DTENSOR in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
