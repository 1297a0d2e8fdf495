"""``cudnorm.patch(model)``: run the norms of a PyTorch, transformers or diffusers model on
cudnorm's ops, in place, without changing what the model computes; report what was swapped
and what was left, and why.

What is swapped is the computation, not the module: each norm whose class computes a
:data:`FORMULAS` entry keeps its identity (the same object, parameters, buffers, forward and
pre-hooks, state-dict hooks, ``requires_grad``, devices, dtypes and training mode) and gets a
subclass of its own class whose ``forward`` runs cudnorm (``isinstance`` checks keep
holding). A module dispatched by accelerate (``cpu_offload``, ``device_map`` with offload)
keeps its ``_hf_hook``: its hooked forward calls the new class's forward. Model code reading
``variance_epsilon`` or ``eps`` reads the module's own attribute, as before.

Which classes: a class registered for a formula (:data:`cudnorm._patch_table.CLASSES`:
``torch.nn.LayerNorm``/``RMSNorm``, 185 transformers and 13 diffusers classes;
:func:`register` adds one), matched by the class object or its module-qualified name, never by
its bare name: remote code reusing ``LlamaRMSNorm`` is another class. A subclass is swapped only
when it keeps the registered class's forward (and the helpers that forward calls). A module is
left, with the reason in the report, when its class is not registered, a subclass redefines
its forward, its attributes are not what the formula reads (diffusers' ``RMSNorm`` with a
bias, a weight of another shape), another patcher replaced its forward on the instance, or it
is parametrized (``torch.nn.utils.parametrize`` also swaps classes; removing the
parametrization would undo cudnorm's). Modules of cudnorm's own classes are passed over.

All or nothing: :func:`patch` decides every module first and swaps only when all decisions
were made; if deciding any module raises, the model is unchanged and the error names the
module's path.
"""

from __future__ import annotations

import functools
import numbers
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn.utils import parametrize

from . import _patch_table, _warn
from ._patch_table import qualified_name
from ._diffusers_block_ops import GLOBAL_HOOKS
from ._diffusers_blocks import BLOCKS
from .diffusers import FUSED, why_not_fused
from .layer_norm import layer_norm
from .modules import LayerNorm, RMSNorm
from .rms_norm import rms_norm

_HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- the formulas' forwards

def _param_for(input: torch.Tensor, param: torch.Tensor | None) -> torch.Tensor | None:
    """``param`` in a dtype cudnorm's ops take with ``input``: as it is when that is the
    input's or fp32 (not for a float64 input), else cast to fp32 (float64 for float64 input).
    transformers' norms take a half weight on input of another dtype and promote it."""
    if param is None or param.dtype is input.dtype or (
            param.dtype is torch.float32 and input.dtype is not torch.float64):
        return param
    return param.to(torch.float64 if input.dtype is torch.float64 else torch.float32)


def _eps(module: torch.nn.Module):
    """The eps a norm's forward adds: transformers' ``variance_epsilon``, else ``eps``. Both are
    plain attributes, read from the instance's dict first: a name the module lacks costs
    ``nn.Module.__getattr__`` an exception with its message (several us, on every call)."""
    attrs = module.__dict__
    eps = attrs.get("variance_epsilon")
    if eps is None:
        eps = attrs.get("eps")
        if eps is None:
            eps = getattr(module, "variance_epsilon", None)
            return module.eps if eps is None else eps
    return eps


def _llama_rms_norm(self, input: torch.Tensor) -> torch.Tensor:
    """``input [*, N]`` -> ``[*, N]`` in ``promote_types(weight.dtype, input.dtype)``: fp32
    statistics, ``x_hat`` times the weight rounded once (Llama rounds ``x_hat`` to the input's
    dtype first: one rounding step apart)."""
    weight = self.weight
    y = rms_norm(input, weight.shape, _param_for(input, weight), _eps(self))
    dtype = torch.promote_types(weight.dtype, input.dtype)
    return y if y.dtype == dtype else y.to(dtype)


def _fp32_rms_norm(self, input: torch.Tensor) -> torch.Tensor:
    """``input [*, N]`` -> ``[*, N]`` in the input's dtype: ``x_hat * weight`` in fp32, rounded
    once, which is :func:`cudnorm.rms_norm` (no weight: ``x_hat``)."""
    weight = getattr(self, "weight", None)
    shape = input.shape[-1:] if weight is None else weight.shape
    return rms_norm(input, shape, _param_for(input, weight), _eps(self))


def _gemma_rms_norm(self, input: torch.Tensor) -> torch.Tensor:
    """``input [*, N]`` -> ``[*, N]`` in the input's dtype: ``x_hat * (1 + weight)`` in fp32, the
    offset added inside cuDNN's graph (``rms_norm(..., weight_offset=1.0)``)."""
    weight = self.weight
    return rms_norm(input, weight.shape, _param_for(input, weight), _eps(self), weight_offset=1.0)


def _stable_audio3_rms_norm(self, input: torch.Tensor) -> torch.Tensor:
    """Stable Audio 3's RMSNorm: ``input [*, N]`` -> ``[*, N]`` in the input's dtype, ``x_hat *
    gamma`` in fp32 rounded once, which is :func:`cudnorm.rms_norm` (the original computes it
    in fp32 with ``force_fp32``, else in the input's dtype, rounding each step)."""
    gamma = self.gamma
    return rms_norm(input, gamma.shape, _param_for(input, gamma), self.eps)


def _t5_rms_norm(self, input: torch.Tensor) -> torch.Tensor:
    """T5's RMSNorm (and diffusers' ``RMSNorm``): ``input [*, N]`` -> ``[*, N]`` in T5's dtype:
    the weight's for fp16/bf16 weights whatever the input's, otherwise the promotion of the
    input's, the weight's and fp32 (fp32 for an fp32 weight on bf16 input); without a weight
    ``x_hat`` in the input's dtype.

    T5 normalises in fp32, rounds ``x_hat`` to a half weight's dtype, then multiplies. Input
    and weight of one dtype run one :func:`cudnorm.rms_norm`, which rounds once where T5 rounds
    twice (the same numbers in fp32); any other pair runs it in fp32, where T5's arithmetic
    happens (float64 where a float64 tensor takes part), rounded once to the output dtype: a
    bf16 T5 whose residual stream became fp32 (it keeps its ``wo`` layers in fp32) gets bf16
    out, as from T5."""
    weight, eps = self.weight, _eps(self)
    if weight is None:
        return rms_norm(input, input.shape[-1:], None, eps)
    if input.dtype is weight.dtype:
        return rms_norm(input, weight.shape, weight, eps)
    compute = torch.promote_types(torch.promote_types(input.dtype, weight.dtype), torch.float32)
    y = rms_norm(input.to(compute), weight.shape, weight.to(compute), eps)
    return y.to(weight.dtype) if weight.dtype in _HALF else y


def _cohere_layer_norm(self, input: torch.Tensor) -> torch.Tensor:
    """Cohere's LayerNorm (no bias): ``input [*, N]`` -> the input's dtype, ``x_hat * weight``
    in fp32 rounded once. A ``[heads, head_dim]`` weight (the q/k norms, on input
    ``[*, heads, head_dim]``) normalises the last dim in fp32 and multiplies by the weight in
    one PyTorch op: cudnorm's ops scale every row by one ``[N]`` weight."""
    weight, eps = self.weight, _eps(self)
    if weight.dim() == 1:
        return layer_norm(input, weight.shape, _param_for(input, weight), None, eps)
    return (layer_norm(input.float(), input.shape[-1:], None, None, eps) * weight.float()).to(input.dtype)


def _fp32_layer_norm(self, input: torch.Tensor) -> torch.Tensor:
    """diffusers' ``FP32LayerNorm``: ``input [*, *normalized_shape]`` -> the input's dtype, the
    norm and its affine parameters in fp32, rounded once."""
    return layer_norm(input, self.normalized_shape, _param_for(input, self.weight), _param_for(input, self.bias),
                      self.eps)


# ---------------------------------------------------------------- what an instance needs

def _why_not_weighted(module: torch.nn.Module, *, weight_dims=(1,), weight_optional=False,
                      attr: str = "weight") -> str | None:
    """Why ``module`` lacks what the RMSNorm-like formulas read: a weight tensor (attribute
    ``attr``: Stable Audio 3 names it ``gamma``) of ``weight_dims`` dims (or none, when
    optional) and a real ``eps >= 0``."""
    weight = getattr(module, attr, None)
    if weight is None and not weight_optional:
        return f"no {attr}, which its formula scales by"
    if weight is not None and (not isinstance(weight, torch.Tensor) or weight.dim() not in weight_dims):
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        return f"a {attr} of shape {shape}, where its formula takes {' or '.join(f'{d}-D' for d in weight_dims)}"
    eps = _eps(module) if hasattr(module, "variance_epsilon") or hasattr(module, "eps") else None
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        return f"eps {eps!r}, where its formula adds a number >= 0"
    return None


def _why_not_t5(module: torch.nn.Module) -> str | None:
    if getattr(module, "bias", None) is not None:  # diffusers' RMSNorm(..., bias=True): Sana's output norm
        return "a bias after the norm, which cudnorm's RMSNorm does not take"
    return _why_not_weighted(module, weight_optional=True)


def _never(module: torch.nn.Module) -> None:
    """The formula of ``torch.nn.LayerNorm``/``RMSNorm`` and their exact kin: every instance
    has what it reads."""
    return None


# ---------------------------------------------------------------- the formulas

@dataclass(frozen=True)
class Formula:
    """A function cudnorm computes for registered classes.

    ``forward(module, ...)`` runs the class's forward on cudnorm's ops from the module's own
    attributes; ``why_not(module)`` says why an instance lacks what it reads, or None;
    ``methods``: the class's methods that compute it (a subclass redefining one is left);
    ``reads``: children whose call ``forward`` replaces by reading their parameters (when such
    a child's call is observed, by hooks on it or global module hooks, the original forward
    runs, so that the hooks fire as before).
    """

    name: str
    forward: Callable
    why_not: Callable[[torch.nn.Module], str | None]
    methods: tuple[str, ...] = ("forward",)
    reads: tuple[str, ...] = ()


def _fused(name: str, qualified: str) -> Formula:
    fused = FUSED[qualified]
    norms = tuple(sorted(child for child in fused.children if child.startswith("norm")))
    return Formula(name, fused.forward, functools.partial(why_not_fused, fused=fused), reads=norms)


# what each computes: its forward's docstring, and docs/patching.md
_FORMULA_LIST = (
    Formula("layer_norm", LayerNorm.forward, _never),  # torch.nn.LayerNorm's forward
    Formula("rms_norm", RMSNorm.forward, _never),  # torch.nn.RMSNorm's forward
    Formula("llama_rms_norm", _llama_rms_norm, _why_not_weighted),
    Formula("fp32_rms_norm", _fp32_rms_norm, functools.partial(_why_not_weighted, weight_optional=True)),
    Formula("gemma_rms_norm", _gemma_rms_norm, _why_not_weighted, methods=("forward", "_norm")),
    Formula("t5_rms_norm", _t5_rms_norm, _why_not_t5),
    Formula("stable_audio3_rms_norm", _stable_audio3_rms_norm, functools.partial(_why_not_weighted, attr="gamma")),
    Formula("cohere_layer_norm", _cohere_layer_norm, functools.partial(_why_not_weighted, weight_dims=(1, 2))),
    Formula("fp32_layer_norm", _fp32_layer_norm, _never),
    *(_fused(name, classes[0]) for name, classes in _patch_table.CLASSES.items() if classes[0] in FUSED),
)
#: formula name -> :class:`Formula`: the names :func:`register` takes
FORMULAS = {formula.name: formula for formula in _FORMULA_LIST}
# whole diffusers blocks with their modulated norms fused (patch(..., blocks=True)), by class name
_BLOCKS_BY_NAME = {qualified: Formula(f"{qualified.rpartition('.')[2]}_fused", block.forward, block.why_not)
                   for qualified, block in BLOCKS.items()}
_BLOCK_FORMULAS = {formula.name: formula for formula in _BLOCKS_BY_NAME.values()}

# the registry: classes by object (torch's, and those register() was given) and by module-qualified name
_BY_CLASS = {torch.nn.LayerNorm: FORMULAS["layer_norm"], torch.nn.RMSNorm: FORMULAS["rms_norm"]}
_BY_NAME = {cls: FORMULAS[name] for name, classes in _patch_table.CLASSES.items() for cls in classes}


def register(cls: type | str, how: str) -> None:
    """Make :func:`patch` swap the forward of ``cls``'s modules (and of subclasses keeping its
    forward) for cudnorm's computation of formula ``how``.

    Args:
        cls: an ``nn.Module`` class, or its module-qualified name
            (``"my_package.layers.MyRMSNorm"``; for a class not imported yet, or remote code).
        how: the name of a formula ``cls``'s forward computes exactly (:data:`FORMULAS`), e.g.
            ``"llama_rms_norm"`` for ``weight * x_hat.to(x.dtype)`` reading ``weight`` and
            ``variance_epsilon`` (or ``eps``). A later registration of ``cls`` replaces this one.
    """
    if not (isinstance(cls, str) or (isinstance(cls, type) and issubclass(cls, torch.nn.Module))):
        raise TypeError(f"cudnorm.patching.register: argument 'cls' must be an nn.Module class or its "
                        f"module-qualified name, got {cls!r}")
    if how not in FORMULAS:
        raise ValueError(f"cudnorm.patching.register: argument 'how' must be one of {', '.join(FORMULAS)}, "
                         f"got {how!r}")
    (_BY_NAME if isinstance(cls, str) else _BY_CLASS)[cls] = FORMULAS[how]


# ---------------------------------------------------------------- deciding a module

def _label(cls: type) -> str:
    """``torch.nn.LayerNorm`` for torch's classes, else the module-qualified name
    (``transformers.models.llama.modeling_llama.LlamaRMSNorm``): what tells classes apart."""
    return f"torch.nn.{cls.__name__}" if cls.__module__.startswith("torch.nn") else qualified_name(cls)


def _formula_of(cls: type, by_class: dict | None = None, by_name_table: dict | None = None
                ) -> tuple[Formula | None, str | None]:
    """``(formula, None)`` for a class whose modules take a formula; ``(None, why)`` for a
    subclass of a registered class redefining its forward, or a class registered by name whose
    forward is no longer the one its class body defined (replaced by another patcher: the
    registry's facts are about that body); ``(None, None)`` for any other class. The registries
    default to the norms'."""
    by_class = _BY_CLASS if by_class is None else by_class
    by_name_table = _BY_NAME if by_name_table is None else by_name_table
    for base in cls.__mro__:
        formula = by_class.get(base)
        by_name = formula is None
        if by_name:
            formula = by_name_table.get(qualified_name(base))
        if formula is None:
            continue
        own = vars(base)
        changed = [name for name in formula.methods if name in own and (
            getattr(cls, name) is not own[name]
            or (by_name and getattr(own[name], "__qualname__", None) != f"{base.__qualname__}.{name}"))]
        if changed:
            what = (f"a subclass of {_label(base)} that redefines {', '.join(changed)}" if base is not cls
                    else f"its {', '.join(changed)} was replaced after its class was defined")
            return None, f"{what}: cudnorm does not know what it computes"
        return formula, None
    return None, None


def _why_unknown(cls: type) -> str:
    """Why a norm-like class without a formula is left."""
    known = _patch_table.LEFT.get(qualified_name(cls))
    if known is not None:
        return known
    if any(name.rpartition(".")[2] == cls.__name__ for name in _BY_NAME) or any(
            registered.__name__ == cls.__name__ for registered in _BY_CLASS):
        return (f"not the registered class of that name ({qualified_name(cls)} is another class, e.g. remote "
                "code): cudnorm matches classes, not names")
    return "no cudnorm formula is registered for this class (cudnorm.patching.register adds one)"


def _accelerate_hooked(module: torch.nn.Module, cls: type) -> bool:
    """Whether ``module``'s instance ``forward`` is accelerate's hook around its class's forward
    (``add_hook_to_module`` keeps that bound method as ``_old_forward``)."""
    old = vars(module).get("_old_forward")
    return hasattr(module, "_hf_hook") and getattr(old, "__func__", None) is cls.forward and (
        getattr(old, "__self__", None) is module)


def _why_not_instance(module: torch.nn.Module, formula: Formula) -> str | None:
    cls = type(module)
    if parametrize.is_parametrized(module):
        return ("parametrized (torch.nn.utils.parametrize swaps its class too, and removing the "
                "parametrization would undo cudnorm's)")
    if "forward" in vars(module) and not _accelerate_hooked(module, cls):
        return "its forward is replaced on the instance (by another patcher); cudnorm leaves it as it is"
    return formula.why_not(module)


# ---------------------------------------------------------------- the patched classes

def _forward_keeping_child_calls(formula: Formula) -> Callable:
    """``formula.forward``, or the class's original forward when a child it reads instead of
    calling is observed (:func:`cudnorm._diffusers_block_ops.observed`: hooks, an instance
    ``forward``, global module hooks), whose calls must happen as before. It runs on every call
    of every patched AdaLN module, and host-bound steps pay each microsecond: the test is
    inlined here (no call; tests/test_patch_host_cost.py counts them)."""
    fused, reads = formula.forward, formula.reads
    forward_hooks, forward_pre_hooks, backward_hooks, backward_pre_hooks = GLOBAL_HOOKS

    def forward(self, *args, **kwargs):
        children = self._modules
        for name in reads:
            child = children[name]
            if (child._forward_hooks or child._forward_pre_hooks or child._backward_hooks
                    or child._backward_pre_hooks or "forward" in child.__dict__):
                return self._cudnorm_unpatched.forward(self, *args, **kwargs)
        if forward_hooks or forward_pre_hooks or backward_hooks or backward_pre_hooks:
            return self._cudnorm_unpatched.forward(self, *args, **kwargs)
        return fused(self, *args, **kwargs)

    forward.__doc__ = fused.__doc__
    return forward


def _new_patched(cls: type, formula_name: str) -> torch.nn.Module:
    """An empty instance of the patched ``cls`` (unpickling and ``copy.deepcopy`` fill it)."""
    patched = _patched_class(cls, formula_name)
    return patched.__new__(patched)


def _reduce_ex(self, protocol):
    """Pickled as the original class and the formula's name: the patched class is made again
    on load (it is created at run time, so pickle cannot find it by name)."""
    getstate = getattr(self, "__getstate__", None)
    return _new_patched, (self._cudnorm_unpatched, self._cudnorm_formula.name), (
        getstate() if getstate is not None else self.__dict__)


@functools.cache  # one subclass per (class, formula): patched modules of a class share it (not a cache to clear)
def _patched_class(cls: type, formula_name: str) -> type:
    """``cls`` with ``forward`` computing ``formula_name``; it keeps ``cls``'s name and module,
    so reprs, and code matching classes by name (accelerate's ``no_split_module_classes``)
    see the class they know."""
    formula = FORMULAS.get(formula_name) or _BLOCK_FORMULAS[formula_name]
    return type(cls.__name__, (cls,), {
        "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        "forward": _forward_keeping_child_calls(formula) if formula.reads else formula.forward,
        "_cudnorm_formula": formula, "_cudnorm_unpatched": cls, "__reduce_ex__": _reduce_ex,
    })


def _swap(module: torch.nn.Module, patched: type) -> None:
    module.__class__ = patched
    if "forward" in vars(module):  # accelerate's hook: it calls the bound forward it wrapped
        module._old_forward = types.MethodType(patched.forward, module)


# ---------------------------------------------------------------- patch

@dataclass
class PatchReport:
    """What :func:`patch` did: ``swapped`` ``(module name, class, formula)`` and ``left``
    ``(module name, class, why)`` for norm-like modules it did not swap (a class with "Norm" in
    its name, a subclass of a registered class). A module reachable under several names is
    listed under each."""

    swapped: list[tuple[str, str, str]] = field(default_factory=list)
    left: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"cudnorm.patch: swapped {len(self.swapped)} norm(s), left {len(self.left)}"]
        counts: dict[tuple[str, str], int] = {}
        for _, cls, formula in self.swapped:
            counts[(cls, formula)] = counts.get((cls, formula), 0) + 1
        lines += [f"  {n} x {cls} -> {formula}" for (cls, formula), n in counts.items()]
        lines += [f"  left {name or '(the model)'} ({cls}): {why}" for name, cls, why in self.left]
        return "\n".join(lines)


def _decide(module: torch.nn.Module, blocks: bool) -> tuple[type | None, str | None]:
    """``(patched class, None)``, ``(None, why it is left)`` or ``(None, None)`` (not a module
    this patch concerns: not norm-like, cudnorm's own, patched already, a block without
    ``blocks`` or one with nothing to fuse)."""
    cls = type(module)
    # patched already (or a subclass of a patched class: FSDP2 wraps classes too), or cudnorm's own
    if hasattr(cls, "_cudnorm_formula") or cls.__module__.startswith("cudnorm"):
        return None, None
    formula, why = _formula_of(cls)
    if formula is None and why is None and blocks:
        formula, why = _formula_of(cls, {}, _BLOCKS_BY_NAME)
        if formula is not None and formula.why_not(module) is not None:
            return None, None  # a block whose norm type has no modulation to fuse: not a norm, not left
    if formula is None:
        return None, why or (_why_unknown(cls) if "Norm" in cls.__name__ else None)
    why = _why_not_instance(module, formula)
    return (None, why) if why is not None else (_patched_class(cls, formula.name), None)


def patch(model: torch.nn.Module, *, blocks: bool = False) -> PatchReport:
    """Run the norms inside ``model`` (``model`` itself included) on cudnorm, in place (see the
    module docstring): each registered norm module keeps its identity, parameters and hooks and
    gets a subclass of its class computing the same function on cudnorm's ops.

    Args:
        model: any ``nn.Module`` (a transformers ``PreTrainedModel``, a diffusers model, a
            plain PyTorch model, a single norm).
        blocks: also swap the forward of the diffusers transformer blocks that modulate
            a plain norm's output inline (DiT/PixArt, SD3, Flux and the blocks sharing its
            forward, Chroma, FLUX.2, Sana, Allegro, HiDream-I1, Qwen-Image, LTX-Video,
            AuraFlow, Wan, SkyReels-V2, HunyuanVideo, HunyuanImage, CogView4:
            :data:`cudnorm._diffusers_blocks.BLOCKS`), so that the modulation runs fused with
            the norm; opt-in: GPU model steps show it ahead of the plain patch on most of those
            measured and behind on Allegro (docs/patching.md). Those blocks are listed in
            ``swapped`` too.

    Returns:
        A :class:`PatchReport`; ``print(report)`` summarises it. Outputs match the original
        modules to one rounding step of the activation dtype (the same numbers in fp32).
        Patching again swaps nothing more.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        RuntimeError: deciding a module raised (an attribute that raises when read); the
            model is unchanged and the message names the module's path.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"cudnorm.patch: argument 'model' must be a torch.nn.Module, got {type(model).__name__}")
    report, decided = PatchReport(), {}
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) not in decided:
            try:
                decided[id(module)] = (module, *_decide(module, blocks))
            except Exception as error:
                raise RuntimeError(f"cudnorm.patch: deciding module '{name}' ({_label(type(module))}) raised "
                                   f"{type(error).__name__}: {error}; the model is unchanged") from error
        _, patched, why = decided[id(module)]
        if patched is not None:
            report.swapped.append((name, _label(type(module)), patched._cudnorm_formula.name))
        elif why is not None:
            report.left.append((name, _label(type(module)), why))
    for module, patched, _ in decided.values():
        if patched is not None:
            _swap(module, patched)
    if not report.swapped:  # a model without supported norms, or one patched already
        done = sum(hasattr(type(module), "_cudnorm_formula") for module, _, _ in decided.values())
        already = f": it is patched already ({done} module(s) run on cudnorm)" if done else ""
        _warn.warn(f"cudnorm.patch: swapped no norm in {type(model).__name__}{already} ({len(report.left)} "
                   "norm-like module(s) left, listed in the returned report)", RuntimeWarning)
    return report
