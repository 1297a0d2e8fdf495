"""What C++ needs to launch a kernel Triton compiled (csrc/launch.cpp, ``launch_kernel``): one
place that checks a compiled kernel is a launch C++ makes and reads off its handle.

C++ launches through ``cuLaunchKernel`` with a 1-D grid, one CTA per block, no cooperative or
programmatic-dependent launch, the parameters in a fixed order (pointers, then 32-bit
scalars) and the compiler's trailing scratch pointers passed as null. A kernel compiled any
other way (clusters, scratch memory in use, a parameter of another kind) is launched by
Python instead. Used by cudnorm's fused AdaLN backward (:mod:`cudnorm._ada_kernel`) and its
LayerNorm/RMSNorm kernels (:mod:`cudnorm._norm_kernel`).
"""

from __future__ import annotations

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
