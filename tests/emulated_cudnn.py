"""A CPU stand-in for cuDNN's norm graphs, so the code of the cuDNN path runs in CI.

:func:`install` routes CPU tensors to cudnorm's cuDNN path and answers every spec with a
plan whose launch reads the buffers at the addresses it is given (in
:func:`cudnorm._graphs.roles` order, ``x`` with the spec's row stride), computes what the
graph computes in fp32 and writes the outputs there. Everything above the launch is the
library's own code: specs, strategies, row chunks, per-sample address steps, statistics
layouts, output allocation. A wrong address, stride, role order or buffer size gives a wrong
result (or reads another buffer), which the tests see; cuDNN's kernels themselves are tested
on the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections import Counter

import torch

import cudnorm
from cudnorm import _cache, _graphs, _runtime

launches: Counter = Counter()  # (op, phase) -> launches since install()


def _view(address: int, shape: tuple[int, ...], dtype: torch.dtype, row_stride: int | None = None) -> torch.Tensor:
    """A tensor on the memory at ``address`` (``[rows, cols]`` rows ``row_stride`` apart)."""
    if len(shape) == 2:
        count = (shape[0] - 1) * row_stride + shape[1]
    else:
        count = 1
        for size in shape:
            count *= size
    memory = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    flat = torch.frombuffer(memory, dtype=dtype, count=count)
    return flat.as_strided(shape, (row_stride, 1)) if len(shape) == 2 else flat.view(shape)


def _emulated_plan(spec) -> _graphs.Plan:
    """A "built" plan of ``spec``: a real :class:`~cudnorm._graphs.Plan` (the ops take their
    address path only for that exact type), launched by :func:`_launch` while installed."""
    return _graphs.Plan(spec=spec, graph=None, uids=(), workspace_size=0, plan_name="emulated", build_seconds=0.0)


def _run(plan, *buffers):
    _launch(plan, [b.data_ptr() for b in buffers])


def _launch(plan, pointers):
    """Compute ``plan.spec``'s graph on the buffers at ``pointers`` (roles() order)."""
    spec = plan.spec
    shapes = _graphs.buffer_shapes(spec)
    names = _graphs.roles(spec)
    assert len(pointers) == len(names), (spec, len(pointers), names)
    t = {}
    for name, address in zip(names, pointers):
        shape, dtype = shapes[name]
        stride = spec.x_row_stride if name == "x" else shape[-1]
        t[name] = _view(address, shape, dtype, stride)
    launches[spec.op, spec.phase] += 1
    (_backward if spec.phase == "bwd" else _forward)(spec, t)


def _per_row(spec, values: torch.Tensor) -> torch.Tensor:
    """A ``[rows, cols]`` view of per-column parameters: ``[cols]``, or AdaLN's ``[B, cols]``
    repeated over each sample's rows."""
    if spec.op == "ada_layer_norm":
        return values.float().repeat_interleave(spec.rows // spec.batch, dim=0)
    return values.float().expand(spec.rows, -1)


def _forward(spec, t) -> None:
    x = t["x"].float()
    if spec.residual:
        x = x + t["residual"].float()  # the norm reads the unrounded sum
        t["h"].copy_(x)
    eps = t["eps"].item()
    scale = _per_row(spec, t["scale"]) + (t["offset"].item() if spec.offset else 0.0)
    if spec.op == "rms_norm":
        rstd = torch.rsqrt(x.square().mean(1) + eps)
        y = x * rstd[:, None] * scale
    else:
        mean = x.mean(1)
        rstd = torch.rsqrt((x - mean[:, None]).square().mean(1) + eps)
        y = (x - mean[:, None]) * rstd[:, None] * scale + _per_row(spec, t["bias"])
        if spec.phase == "train":
            t["mean"].copy_(mean)
    t["y"].copy_(y)
    if spec.phase == "train":
        t["rstd"].copy_(rstd)


def _backward(spec, t) -> None:
    x, dy = t["x"].float(), t["dy"].float()
    rstd = t["rstd"][:, None]
    scale = _per_row(spec, t["scale"]) + (t["offset"].item() if spec.offset else 0.0)
    g = dy * scale
    if spec.op == "rms_norm":
        xhat = x * rstd
        dx = rstd * (g - xhat * (g * xhat).mean(1, keepdim=True))
    else:
        xhat = (x - t["mean"][:, None]) * rstd
        dx = rstd * (g - g.mean(1, keepdim=True) - xhat * (g * xhat).mean(1, keepdim=True))
    t["dx"].copy_(dx)
    parts = (dy * xhat, dy) if spec.op != "rms_norm" else (dy * xhat,)
    for name, part in zip(("dscale", "dbias"), parts):
        if spec.op == "ada_layer_norm":  # per sample: that sample's rows
            t[name].copy_(part.view(spec.batch, -1, spec.cols).sum(1))
        else:
            t[name].copy_(part.sum(0))


def install() -> tuple:
    """Route CPU tensors to the cuDNN path, build emulated plans and launch them here;
    returns what :func:`uninstall` restores."""
    saved = (_runtime.route, _cache._build, _graphs.Plan.run, _graphs.Plan.launch)
    _runtime.route = lambda tensor: None
    _cache._build = _emulated_plan
    _graphs.Plan.run, _graphs.Plan.launch = _run, _launch
    launches.clear()
    return saved


def uninstall(saved: tuple) -> None:
    _runtime.route, _cache._build, _graphs.Plan.run, _graphs.Plan.launch = saved


@contextlib.contextmanager
def installed():
    """:func:`install` for a block, which must reach the cuDNN path at least once; the plans
    it built are dropped afterwards."""
    saved = install()
    try:
        yield launches
        assert sum(launches.values()) > 0, "no call reached the cuDNN path"
    finally:
        uninstall(saved)
        cudnorm.clear_cache()
