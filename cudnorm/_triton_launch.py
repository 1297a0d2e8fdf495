"""What C++ needs to launch a kernel Triton compiled (csrc/launch.cpp, ``launch_kernel``): one
place that checks a compiled kernel is a launch C++ makes and reads off its handle, and
:func:`launch`, through which Python launches every kernel of cudnorm's.

C++ launches through ``cuLaunchKernel`` with a 1-D grid, one CTA per block, no cooperative or
programmatic-dependent launch, the parameters in a fixed order (pointers, then 32-bit
scalars) and the compiler's trailing scratch pointers passed as null. A kernel compiled any
other way (clusters, scratch memory in use, a parameter of another kind) is launched by
Python instead. Used by cudnorm's fused AdaLN backward (:mod:`cudnorm._ada_kernel`) and its
LayerNorm/RMSNorm kernels (:mod:`cudnorm._norm_kernel`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import torch

from . import _lru

#: cudnorm's native launch (csrc/python.cpp, ``launch``) while the native path serves, else
#: ``None``: set by :mod:`cudnorm._native`
native: Callable | None = None

# the metadata fields of the scratch buffers Triton may add as trailing pointer parameters
_SCRATCH = ("global_scratch_size", "profile_scratch_size")


def handle(compiled, parameters: list[str]) -> tuple[int, int, int, int] | None:
    """``(CUfunction, threads per block, shared bytes, scratch parameters)`` of ``compiled`` (a
    kernel from ``JITFunction.warmup`` whose module is loaded), or ``None`` where C++ cannot
    launch it plainly. ``parameters``: the kinds C++ passes, in order (``"*"`` a pointer,
    ``"i32"``, ``"fp32"``), to compare with the compiled signature's non-constexpr ones."""
    meta = compiled.metadata
    signature = [kind for kind in compiled.src.signature.values() if kind != "constexpr"]
    plain = (getattr(meta, "num_ctas", 1) == 1 and not getattr(meta, "launch_pdl", False)
             and not getattr(meta, "launch_cooperative_grid", False)
             and not any(getattr(meta, name, 0) for name in _SCRATCH)
             and len(signature) == len(parameters)
             and all(kind.startswith(want) for kind, want in zip(signature, parameters)))
    if not plain or not compiled.function:
        return None
    return int(compiled.function), 32 * meta.num_warps, meta.shared, sum(hasattr(meta, name) for name in _SCRATCH)


# (kernel, device, what Triton specialises each argument on, constexprs): :func:`key` -> the
# compiled kernel's handle and argument order (:func:`_plain`), or None where C++ cannot launch it
_HANDLES = _lru.LRU("triton_launches", 256)
_MISSING = object()


def _specialised(value) -> object:
    """What Triton compiles a runtime argument for: a tensor's dtype and 16-byte alignment, an
    int's being 1, a multiple of 16 and 32-bit (a key at least as fine as Triton's own)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool, value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -(2**31) <= value < 2**31
    return type(value)


def key(kernel, args: tuple, meta: dict) -> tuple:
    """What :func:`loaded` and :func:`launch` look a compiled kernel up by: the kernel, the first
    argument's device, what Triton specialises each argument on and the constexprs. A caller
    that makes both calls builds it once and passes it to both."""
    return (kernel, args[0].get_device(), *map(_specialised, args), *meta.items())


def _plain(kernel, args: tuple, meta: dict) -> tuple | None:
    """``(CUfunction, threads, shared bytes, scratch parameters, pointer indices, scalar
    indices)`` of ``kernel`` compiled for ``args`` and ``meta`` (its module loaded), or None
    where C++ cannot launch it: another parameter kind, a pointer after a scalar."""
    compiled = kernel.warmup(*args, grid=(1,), **meta)
    compiled.run  # noqa: B018 - loads the module: sets compiled.function
    kinds = list(compiled.src.signature.values())[:len(args)]
    runtime = [i for i, kind in enumerate(kinds) if kind != "constexpr"]  # an int of 1 is compiled in
    pointers = [i for i in runtime if isinstance(args[i], torch.Tensor)]
    scalars = [i for i in runtime if not isinstance(args[i], torch.Tensor)]
    if (pointers and scalars and max(pointers) > min(scalars)) or any(
            isinstance(args[i], bool) or not isinstance(args[i], (int, float)) for i in scalars):
        return None
    found = handle(compiled, ["*"] * len(pointers) + ["fp32" if isinstance(args[i], float) else "i32"
                                                       for i in scalars])
    return None if found is None else (*found, tuple(pointers), tuple(scalars))


# the same key -> the compiled kernel with its module loaded (its registers known)
_LOADED = _lru.LRU("triton_loaded_kernels", 256)


def loaded(kernel, args: tuple, meta: dict, found_by: tuple | None = None):
    """The compiled kernel :func:`launch` runs for ``args`` and ``meta`` (tensors on one CUDA
    device), its module loaded so that its register count and shared memory are known (what sizes
    a grid of as many programs as the SMs hold); compiled on first use, then a lookup.
    ``found_by``: :func:`key` of the call where the caller has it."""
    found_by = found_by or key(kernel, args, meta)
    found = _LOADED.peek(found_by)
    if found is None:
        with torch.cuda.device(args[0].device):
            found = kernel.warmup(*args, grid=(1,), **meta)
            found.run  # noqa: B018 - loads the module: sets its register count
        _LOADED.put(found_by, found)
    return found


def _bits(value: int | float) -> int:
    """An int32 scalar as is, a fp32 one as its bits (C++ passes every scalar as 32 bits)."""
    return value if isinstance(value, int) else struct.unpack("<i", struct.pack("<f", value))[0]


def launch(kernel, grid: int, args: tuple, meta: dict, found_by: tuple | None = None) -> None:
    """``kernel[(grid,)](*args, **meta)`` on the current stream of the first argument's device,
    ``args`` positional runtime arguments (tensors on one device, ints, floats), ``meta`` the
    constexprs and ``num_warps``. While the native path serves, C++ launches the compiled
    kernel (``cuLaunchKernel``), its handle found by what Triton specialises the call on;
    otherwise, or where C++ cannot launch that kernel, Triton's own launcher (about twice the
    host time: 62.5 against 32.9 us a norm forward on a lent H200, docs/performance.md,
    Decisions). ``found_by``: :func:`key` of the call where the caller has it."""
    first = args[0]
    if first.is_cuda and first.get_device() != torch.cuda.current_device():
        with torch.cuda.device(first.device):  # a launch goes to the current device's stream
            _launch(kernel, grid, args, meta, found_by)
    else:
        _launch(kernel, grid, args, meta, found_by)


def _launch(kernel, grid: int, args: tuple, meta: dict, found_by: tuple | None) -> None:
    first = args[0]
    if native is not None and first.is_cuda:
        found_by = found_by or key(kernel, args, meta)
        found = _HANDLES.get(found_by, _MISSING)
        if found is _MISSING:
            found = _plain(kernel, args, meta)
            _HANDLES.put(found_by, found)
        if found is not None:
            function, threads, shared, scratch, pointers, scalars = found
            native(function, grid, threads, shared, scratch, tuple(args[i] for i in pointers),
                   tuple(_bits(args[i]) for i in scalars))
            return
    kernel[(grid,)](*args, **meta)
