"""cudnorm's custom ops: defining them, registering their autograd, and the eager
``autograd.Function`` twins that run the same implementation without the dispatcher.

Every op is ``cudnorm::<name>`` in one :class:`torch.library.Library`; a forward returns
``(y, stats)`` and its backward takes ``dy`` (the statistics are not differentiable).
"""

from __future__ import annotations

import torch

LIBRARY = torch.library.Library("cudnorm", "DEF")  # owns every cudnorm:: op; kept for the process


def define_op(name: str, schema: str, impl, fake):
    """Define ``cudnorm::<name><schema>`` running ``impl`` on every device, with ``fake`` for
    tracing; returns the op's default overload (what compiled graphs call).

    Registered through ``torch.library.Library`` rather than ``torch.library.custom_op``: a
    custom_op call goes through extra Python wrappers, measured at 24 us of host time per call
    against 10 us for a Library op on a lent H100 host (both returning one ``empty_like``),
    which compiled graphs pay on every call of the op (docs/performance.md, Decisions).
    """
    LIBRARY.define(name + schema)
    LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"cudnorm::{name}", fake, lib=LIBRARY)
    return getattr(torch.ops.cudnorm, name).default


def register_autograd(name: str, setup_context, backward) -> None:
    """Register ``backward(ctx, dy)`` for ``cudnorm::<name>``, a forward returning ``(y, stats)``.

    The statistics are marked non-differentiable and gradients are not materialised, so
    autograd neither allocates nor fills zero gradients for them (about 20 us of host time
    per call on an H200, measured in ``benchmarks/host_profile.py``).
    """

    def setup(ctx, inputs, output):
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        setup_context(ctx, inputs, output)

    def op_backward(ctx, dy, *_stat_grads):
        return backward(ctx, dy)

    torch.library.register_autograd(f"cudnorm::{name}", op_backward, setup_context=setup, lib=LIBRARY)


def differentiable_grads(forward, inputs: tuple, dy: torch.Tensor) -> list[torch.Tensor | None]:
    """Gradients of ``forward(*inputs)`` for ``dy`` that are themselves differentiable: the
    backward of an op when autograd runs it with ``create_graph=True`` (gradient penalties,
    Hessian-vector products). cuDNN's backward graphs compute numbers, not a graph, so the
    ops recompute their forward in PyTorch's fp32 ops here and differentiate that; the
    result is connected to ``inputs`` and ``dy``, each gradient in its input's dtype. ``None``
    for inputs that are ``None`` or do not require grad."""
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    with torch.enable_grad():
        grads = iter(torch.autograd.grad(forward(*inputs), wanted, dy, create_graph=True)) if wanted else iter(())
    return [next(grads).to(t.dtype) if t is not None and t.requires_grad else None for t in inputs]


_C_APPLY = torch._C._FunctionBase.__dict__["apply"]  # autograd.Function's C++ apply
_functorch_active = torch._C._are_functorch_transforms_active
# Up to torch 2.13 ``Function.apply`` is a Python classmethod (pytree walk, functorch check)
# around the C++ apply; from 2.14 it is the C++ apply itself, which handles functorch.
_PYTHON_APPLY = getattr(torch.autograd.Function.apply, "__func__", None)


def eager_autograd(name: str, forward, setup_context, backward) -> type:
    """An ``autograd.Function`` running the same forward/setup/backward functions a custom
    op registers, for eager calls; ``apply`` returns ``y`` only.

    Eager calls skip the dispatcher this way: an op call through the dispatcher costs 10-25
    us of host time, which would dominate small norms. The statistics stay out of the
    Function's outputs (saved in ``ctx`` instead): one differentiable output is the cheapest
    node autograd has (10 us less forward and 20 us less backward host time than three).
    ``apply`` goes straight to the C++ apply unless a functorch transform is active: the
    Python ``Function.apply`` wrapper of torch <= 2.13 walks the arguments with pytree first
    (4 us of a 12 us apply on a CPU host, more on the lent GPU hosts); torch 2.14 made
    ``Function.apply`` the C++ one, and the class keeps it. Traced calls (``torch.compile``)
    use the registered op, so both paths run the same implementation.
    """

    def fwd(ctx, *inputs):
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        return output[0]

    cls = type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(backward)})
    if _PYTHON_APPLY is None:
        return cls
    c_apply = _C_APPLY.__get__(None, cls)
    python_apply = _PYTHON_APPLY

    def apply(*args):
        return python_apply(cls, *args) if _functorch_active() else c_apply(*args)

    cls.apply = staticmethod(apply)
    return cls


def eager(x: torch.Tensor) -> bool:
    """True when ``x`` is a real tensor in an eager call, so the implementation may be
    called directly; False under ``torch.compile`` or any tracing with tensor subclasses
    (fake/functional tensors), which must go through the registered custom op."""
    return type(x) is torch.Tensor and not torch.compiler.is_compiling()
