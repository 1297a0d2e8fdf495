"""Where the public functions send a call: the native launch path's entry points, or
cudnorm's Python implementation.

``cudnorm.layer_norm``, ``rms_norm`` and ``ada_layer_norm`` read :data:`native` first. While
it is True (:mod:`cudnorm._native` made the native path active) the functions here are its
C++ entry points (``cudnorm::*_entry``): they serve the common CUDA call in C++ (checks, kernel policy,
autograd node, launch) and hand every other call back to the Python implementation, so
behaviour is the same either way. While the native path is untried, :data:`pending` is True
and the first CUDA call tries it (:func:`try_native`).

This module only holds references: it imports nothing of cudnorm's, so the op modules can
read it on every call.
"""

from __future__ import annotations

import torch

native = False  # the entry points below are the native path's
pending = True  # the native path has not been tried in this process (nor switched off)
# the codes of the kernels that serve a call (Server in cudnorm/csrc/native.h): C++'s decision
# table holds them, and a measurement passes one to the plain norms' entry points to force it
SERVERS = {"cudnn": 0, "torch": 1, "kernel": 2}

# the native entry points (functions of the native library's Python module, which call
# cudnorm::*_entry's C++ directly), set by cudnorm._native
layer_norm = rms_norm = add_layer_norm = add_rms_norm = ada_layer_norm = None
# a norm modulated per token (cudnorm._token_entry): the entry point with its measured decision,
# and the kernels alone (None where the native path does not serve the arguments)
token_ada_norm = token_ada_kernel = None
# the adaptive RMSNorm through its kernels, with its C++ node (None where not served)
ada_rms_kernel = None
# the gated residual: its public function's call (rules, decision, formula or fused op), and
# the fused op with its C++ node alone; (y, h), or None where not served
gated_ada_layer_norm = gated_kernel = None
# the affine fold of a modulated LayerNorm (csrc/fold.cpp): (w * g, b * g + shift) in one
# autograd node, for cudnorm.diffusers' forwards of affine norms followed by a modulation
affine_fold = None
# an affine LayerNorm's per-sample modulated call (cudnorm._diffusers_forwards): the measured
# formula or fold and adaptive LayerNorm, in C++ (None where not served)
modulated_layer_norm = None

is_compiling = torch.compiler.is_compiling
# cudnorm._native's activate(), status() and counters(): set when that module is imported
# (by the package), which sits above the modules that read this one
activate = status = counters = None


def try_native(input) -> bool:
    """Whether the native path is active after trying it for this call: only a CUDA tensor
    triggers the first try (building or loading ``cudnorm/csrc``, :func:`cudnorm._native.activate`)."""
    if activate is None or not (isinstance(input, torch.Tensor) and input.is_cuda) or is_compiling():
        return False
    return activate()
