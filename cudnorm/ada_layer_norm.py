"""Adaptive LayerNorm (AdaLN) on cuDNN graphs: custom ops, backward strategies, functional.

Math, per sample ``b`` and token row ``x`` of ``D`` elements (non-affine LayerNorm)::

    xhat = (x - mean) * rstd,   rstd = 1 / sqrt(var + eps)
    y = xhat * scale[b] + shift[b]          (one_plus_scale=False)
    y = xhat * (1 + scale[b]) + shift[b]    (one_plus_scale=True: DiT's ``modulate``)

The ops work on ``x: [B, S, D]`` and ``scale``/``shift``: ``[B, D]``. The DiT ``1 + scale``
is an in-graph add (no extra pass over ``x``).

Backward strategies (``choose_backward`` picks one per shape, ``CUDNORM_ADA_BWD`` forces one):

* ``cudnn``: cuDNN's adalayernorm backward graph. Always applicable, but slow in cuDNN 9.19
  for many short samples (32x256x1152: one generic engine, 16 GB/s).
* ``per_sample``: the plain LayerNorm backward graph (``S`` rows) run once per sample with
  the fp32 gain ``(1 + scale[b])``; its dW/dB are that sample's dscale/dshift. Fast for long
  samples, launch-bound (B launches of ~15 us host time each) for short ones.
* ``per_sample_graph``: the same B launches captured once into a CUDA graph and replayed.
  See :class:`_CapturedBackward` for what is keyed, what is static and what memory it keeps.
* ``torch``: the fp32 PyTorch formula (also the CPU path).

An unavailable strategy falls through to the next one (``per_sample_graph`` ->
``per_sample`` -> ``cudnn`` -> ``torch``; ``cudnn`` -> ``per_sample``), so forcing one never
changes results, only speed.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _checks, _dispatch, _runtime
from . import reference as ref
from ._graphs import host_scalar
from ._spec import NormSpec

_OP = "ada_layer_norm"
_EMPTY = (0,)
STRATEGIES = ("cudnn", "per_sample", "per_sample_graph", "torch")

# (rule, strategy) rows, first match wins. Provisional, from facts §4 (H200, bf16): the
# per-sample LayerNorm backward beats torch.compile once a sample has >= 1024 tokens;
# below that it is launch-bound, and a CUDA graph of the launches recovers it when there are
# many samples. To be reset from benchmarks/ada_backward_strategies.py measurements.
BACKWARD_RULES = (
    (lambda b, s, d, dtype: s >= 1024, "per_sample"),
    (lambda b, s, d, dtype: b > 8, "per_sample_graph"),
    (lambda b, s, d, dtype: True, "cudnn"),
)


def choose_backward(b: int, s: int, d: int, dtype: torch.dtype) -> str:
    """The backward strategy for ``x: [b, s, d]`` of ``dtype`` (first matching rule)."""
    return next(name for rule, name in BACKWARD_RULES if rule(b, s, d, dtype))


def _backward_strategy(b: int, s: int, d: int, dtype: torch.dtype) -> str:
    forced = os.environ.get("CUDNORM_ADA_BWD", "").strip().lower()
    if not forced:
        return choose_backward(b, s, d, dtype)
    if forced not in STRATEGIES:
        raise ValueError(f"cudnorm: CUDNORM_ADA_BWD must be one of {STRATEGIES}, got {forced!r}")
    return forced


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` packed with a 16-byte aligned base pointer (what cuDNN's tensor descriptors
    promise); a chunk of a Linear output is often neither."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------- forward

@torch.library.custom_op("cudnorm::ada_layer_norm_fwd", mutates_args=())
def ada_layer_norm_fwd(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float,
                       one_plus_scale: bool, training: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward on ``x: [B, S, D]``; ``scale``/``shift``: ``[B, D]``, fp32 or x's dtype.

    Returns ``(y [B, S, D] x.dtype, mean [B*S] fp32, rstd [B*S] fp32)``; with
    ``training=False`` the inference graph runs and ``mean``/``rstd`` are empty.
    """
    if _dispatch.route(x) is None:
        out = _cudnn_forward(x, scale, shift, eps, one_plus_scale, training)
        if out is not None:
            return out
    return _torch_forward(x, scale, shift, eps, one_plus_scale, training)


def _cudnn_forward(x, scale, shift, eps, dit, training):
    """The cuDNN graph, or ``None`` when cuDNN declines it. A declined DiT graph (in-graph
    ``1 + scale``) retries the plain graph with ``1 + scale`` computed here (``B*D`` elements)."""
    b, s, d = x.shape
    x2 = _dispatch.cudnn_rows(x.reshape(b * s, d))
    scale, shift, scale_dtype, cast = _dispatch.forward_params(x2, scale, shift, has_bias=True)
    scale, shift = _aligned(scale), _aligned(shift)
    phase = "train" if training else "infer"

    def spec(dit: bool) -> NormSpec:
        return NormSpec(_OP, phase, b * s, d, x.dtype, scale_dtype, x.device.index, x_row_stride=x2.stride(0),
                        batch=b, scale_cast=cast, dit=dit,
                        autotune=_dispatch.autotune_wanted(_OP, phase, b * s, d))

    plan = _dispatch.get_plan(spec(dit))
    if plan is None and dit:
        plan, dit = _dispatch.get_plan(spec(False)), False
        scale = (scale.float() + 1.0).to(scale_dtype)
    if plan is None:
        return None
    y = torch.empty((b, s, d), dtype=x.dtype, device=x.device)
    buffers = [x2, scale, shift, host_scalar(eps, plan.spec), y]
    if training:
        mean = torch.empty(b * s, dtype=torch.float32, device=x.device)
        rstd = torch.empty(b * s, dtype=torch.float32, device=x.device)
        buffers += [mean, rstd]
    else:
        mean, rstd = x.new_empty(_EMPTY, dtype=torch.float32), x.new_empty(_EMPTY, dtype=torch.float32)
    if dit:
        buffers.append(host_scalar(1.0, plan.spec))
    plan.run(*buffers)
    return y, mean, rstd


def _gain(scale: torch.Tensor, dit: bool) -> torch.Tensor:
    """The per-sample multiplier in fp32: ``1 + scale`` (DiT) or ``scale``."""
    return scale.float() + 1.0 if dit else scale.float()


def _torch_forward(x, scale, shift, eps, dit, training):
    """PyTorch path, computed in fp32 and cast back to x's dtype; fp32 scale/shift are
    rounded as on the cuDNN path (``_dispatch.forward_param_dtype``)."""
    b, s, d = x.shape
    scale, shift = (p.to(_dispatch.forward_param_dtype(x, p)) for p in (scale, shift))
    xhat, mean, rstd = torch.native_layer_norm(x.float(), [d], None, None, eps)
    y = (xhat * _gain(scale, dit)[:, None] + shift.float()[:, None]).to(x.dtype)
    if not training:
        return y, x.new_empty(_EMPTY, dtype=torch.float32), x.new_empty(_EMPTY, dtype=torch.float32)
    return y, mean.view(b * s), rstd.view(b * s)


@ada_layer_norm_fwd.register_fake
def _(x, scale, shift, eps, one_plus_scale, training):
    b, s, _ = x.shape
    stats = (b * s,) if training else _EMPTY
    return x.new_empty(x.shape), x.new_empty(stats, dtype=torch.float32), x.new_empty(stats, dtype=torch.float32)


# ---------------------------------------------------------------- backward

@dataclass
class _BwdCall:
    """One backward call in the layout every strategy reads: ``x2``/``dy2`` are
    ``[B*S, D]`` (x with cuDNN-legal row stride, dy packed), stats ``[B*S]`` fp32."""

    dy2: torch.Tensor
    x2: torch.Tensor
    scale: torch.Tensor
    mean: torch.Tensor
    rstd: torch.Tensor
    b: int
    s: int
    dit: bool

    @property
    def d(self) -> int:
        return self.x2.shape[1]

    def new_dx(self) -> torch.Tensor:
        return torch.empty((self.b * self.s, self.d), dtype=self.x2.dtype, device=self.x2.device)


@torch.library.custom_op("cudnorm::ada_layer_norm_bwd", mutates_args=())
def ada_layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor,
                       rstd: torch.Tensor, one_plus_scale: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward on ``x, dy: [B, S, D]``, ``scale: [B, D]`` (the forward's, any float dtype).

    Returns ``(dx [B, S, D] x.dtype, dscale [B, D] fp32, dshift [B, D] fp32)``; dscale is the
    same for both conventions (``d(1 + scale) / dscale = 1``).
    """
    b, s, d = x.shape
    if _dispatch.route(x) is None:
        call = _BwdCall(_aligned(dy.reshape(b * s, d)), _dispatch.cudnn_rows(x.reshape(b * s, d)), scale,
                        _aligned(mean), _aligned(rstd), b, s, one_plus_scale)
        for name in _FALLTHROUGH[_backward_strategy(b, s, d, x.dtype)]:
            out = _BACKWARDS[name](call)
            if out is not None:
                dx, dscale, dshift = out
                return dx.view(b, s, d), dscale, dshift
    return _torch_backward(dy, x, scale, mean, rstd, one_plus_scale)


def _torch_backward(dy, x, scale, mean, rstd, dit):
    """``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * gain``;
    ``dscale = sum_tokens(dy * xhat)``, ``dshift = sum_tokens(dy)``, all in fp32."""
    b, s, d = x.shape
    dyf = dy.float()
    rstd3 = rstd.view(b, s, 1)
    xhat = (x.float() - mean.view(b, s, 1)) * rstd3
    g = dyf * _gain(scale, dit)[:, None]
    dx = rstd3 * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(1), dyf.sum(1)


def _bwd_cudnn(call: _BwdCall):
    """cuDNN's adalayernorm backward; dscale/dshift come out in the scale's dtype."""
    x2 = call.x2
    sdt = call.scale.dtype
    spec = NormSpec(_OP, "bwd", call.b * call.s, call.d, x2.dtype, sdt, x2.device.index,
                    x_row_stride=x2.stride(0), batch=call.b, dit=call.dit)
    plan = _dispatch.get_plan(spec)
    if plan is None:
        return None
    dx = call.new_dx()
    dscale = torch.empty((call.b, call.d), dtype=sdt, device=x2.device)
    dshift = torch.empty_like(dscale)
    buffers = [x2, _aligned(call.scale), call.dy2, call.mean, call.rstd, dx, dscale, dshift]
    if call.dit:
        buffers.append(host_scalar(1.0, spec))
    plan.run(*buffers)
    return dx, dscale.float(), dshift.float()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class _PerSample:
    """What the per-sample launches read and write. Per-sample slices must start 16-byte
    aligned, so the fp32 ``[B, D]`` buffers have rows padded to ``Dp`` (multiple of 4) and
    stats are copied to ``[B, Sp]`` when ``S`` is not a multiple of 4."""

    plan: object
    xs: tuple
    dys: tuple
    means: tuple
    rstds: tuple

    def launch(self, dx: torch.Tensor, gain: torch.Tensor, dscale: torch.Tensor, dshift: torch.Tensor) -> None:
        dxs = dx.unflatten(0, (len(self.xs), -1)).unbind(0)
        for per_sample in zip(self.xs, gain.unbind(0), self.dys, self.means, self.rstds, dxs,
                              dscale.unbind(0), dshift.unbind(0)):
            self.plan.run(*per_sample)


def _per_sample_setup(call: _BwdCall) -> _PerSample | None:
    x2, b, s, d = call.x2, call.b, call.s, call.d
    es = x2.element_size()
    if (s * x2.stride(0) * es) % 16 or (s * d * es) % 16:
        return None  # a sample's x/dy/dx block would start misaligned
    spec = NormSpec("layer_norm", "bwd", s, d, x2.dtype, torch.float32, x2.device.index,
                    x_row_stride=x2.stride(0), autotune=_dispatch.autotune_wanted("layer_norm", "bwd", s, d))
    plan = _dispatch.get_plan(spec)
    if plan is None:
        return None
    stats = []
    for stat in (call.mean, call.rstd):
        stat = stat.view(b, s)
        if s % 4:
            padded = torch.empty((b, _round_up(s, 4)), dtype=torch.float32, device=x2.device)
            padded[:, :s].copy_(stat)
            stat = padded[:, :s]
        stats.append(stat.unbind(0))
    rows = lambda t: t.unflatten(0, (b, s)).unbind(0)  # noqa: E731
    return _PerSample(plan, rows(x2), rows(call.dy2), stats[0], stats[1])


def _param_buffers(call: _BwdCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gain, dscale, dshift): fp32 ``[B, D]`` views of row-padded ``[B, Dp]`` buffers."""
    shape = (call.b, _round_up(call.d, 4))
    bufs = [torch.empty(shape, dtype=torch.float32, device=call.x2.device)[:, :call.d] for _ in range(3)]
    return tuple(bufs)


def _fill_gain(dst: torch.Tensor, call: _BwdCall) -> None:
    dst.copy_(call.scale)
    if call.dit:
        dst.add_(1.0)


def _bwd_per_sample(call: _BwdCall):
    setup = _per_sample_setup(call)
    if setup is None:
        return None
    gain, dscale, dshift = _param_buffers(call)
    _fill_gain(gain, call)
    dx = call.new_dx()
    setup.launch(dx, gain, dscale, dshift)
    return dx, dscale.contiguous(), dshift.contiguous()


class _CapturedBackward:
    """The B per-sample launches of one call, captured in a CUDA graph.

    Correctness: a graph replays fixed pointers. The key holds the LayerNorm spec (shape,
    strides, dtype), B, the stream and the data pointers of x, dy, mean, rstd and dx; a
    replay therefore reads and writes exactly the tensors of the current call (memory
    freed and reused by another tensor of the same spec is read as that tensor, which is
    what the call asks). The small fp32 buffers gain/dscale/dshift are owned by the entry
    (static): the gain is copied in before each replay and dscale/dshift copied out after,
    so they never alias a caller's tensor. Keying on the stream keeps two streams from
    racing on those buffers and on the workspace.

    Cost: a miss runs the launches eagerly (that call's result), then captures them on a
    side stream (host time only, nothing runs twice). In a training loop the caching
    allocator hands out the same addresses each step, so steady-state calls hit.

    Memory: per entry three ``[B, Dp]`` fp32 buffers plus cuDNN's workspace, which lives in
    a graph memory pool shared by all entries of one (device, stream): replays on one
    stream never overlap, so sharing the workspace is safe. At most
    ``CUDNORM_ADA_GRAPH_CACHE`` entries (default 64; a DiT-XL step makes 56 AdaLN calls)
    are kept, least recently used evicted.
    """

    _entries: OrderedDict = OrderedDict()
    _pools: dict = {}

    def __init__(self, call: _BwdCall, setup: _PerSample, dx: torch.Tensor) -> None:
        self.gain, self.dscale, self.dshift = _param_buffers(call)
        self.setup, self.dx = setup, dx
        self.plan = setup.plan  # the graph's kernels belong to the plan: keep it alive
        self.graph = None

    @classmethod
    def run(cls, call: _BwdCall, setup: _PerSample):
        device = call.x2.device.index
        stream = _runtime.current_stream_ptr(device)
        dx = call.new_dx()
        key = (setup.plan.spec, call.b, stream, call.x2.data_ptr(), call.dy2.data_ptr(),
               setup.means[0].data_ptr(), setup.rstds[0].data_ptr(), dx.data_ptr())
        entry = cls._entries.get(key)
        if entry is None:
            entry = cls(call, setup, dx)
            _fill_gain(entry.gain, call)
            setup.launch(dx, entry.gain, entry.dscale, entry.dshift)
            entry.capture(device, stream)
            cls._remember(key, entry)
        else:
            cls._entries.move_to_end(key)
            _fill_gain(entry.gain, call)
            if entry.graph is not None:
                entry.graph.replay()
            else:
                setup.launch(dx, entry.gain, entry.dscale, entry.dshift)
        return dx, entry.dscale.clone(memory_format=torch.contiguous_format), \
            entry.dshift.clone(memory_format=torch.contiguous_format)

    def capture(self, device: int, stream: int) -> None:
        """Record the launches (nothing runs). On failure the entry stays eager, with a warning."""
        pool = self._pools.get((device, stream))
        if pool is None:
            pool = self._pools[(device, stream)] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                # thread_local: other threads (data loaders, autograd workers) keep working
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    self.setup.launch(self.dx, self.gain, self.dscale, self.dshift)
                finally:
                    graph.capture_end()
            self.graph = graph
        except Exception as exc:  # capture refused (driver, nested capture): stay correct, eager
            warnings.warn(f"cudnorm.{_OP}: CUDA-graph capture of the per-sample backward failed "
                          f"({type(exc).__name__}: {exc}); running it without a graph", RuntimeWarning, stacklevel=2)
        current.wait_stream(side)
        self.setup = self.dx = None  # the graph holds pointers, not tensors: drop the refs

    @classmethod
    def _remember(cls, key, entry) -> None:
        cls._entries[key] = entry
        limit = int(os.environ.get("CUDNORM_ADA_GRAPH_CACHE", "64"))
        while len(cls._entries) > max(limit, 1):
            cls._entries.popitem(last=False)

    @classmethod
    def clear(cls) -> None:
        cls._entries.clear()
        cls._pools.clear()


def _bwd_per_sample_graph(call: _BwdCall):
    if torch.cuda.is_current_stream_capturing():
        return None  # an outer capture records the plain launches itself
    setup = _per_sample_setup(call)
    return None if setup is None else _CapturedBackward.run(call, setup)


_BACKWARDS = {"cudnn": _bwd_cudnn, "per_sample": _bwd_per_sample, "per_sample_graph": _bwd_per_sample_graph,
              "torch": lambda call: None}
_FALLTHROUGH = {"cudnn": ("cudnn", "per_sample"), "per_sample": ("per_sample", "cudnn"),
                "per_sample_graph": ("per_sample_graph", "per_sample", "cudnn"), "torch": ()}


@ada_layer_norm_bwd.register_fake
def _(dy, x, scale, mean, rstd, one_plus_scale):
    b, _, d = x.shape
    return (x.new_empty(x.shape), x.new_empty((b, d), dtype=torch.float32),
            x.new_empty((b, d), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    x, scale, shift, eps, one_plus_scale, training = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, scale, mean, rstd)
    ctx.one_plus_scale = one_plus_scale
    ctx.shift_dtype = shift.dtype


def _backward(ctx, dy, _dmean, _drstd):
    x, scale, mean, rstd = ctx.saved_tensors
    if mean.numel() == 0:
        raise RuntimeError("cudnorm.ada_layer_norm: backward through an inference-phase forward "
                           "(the forward ran without grad mode, so no statistics were saved)")
    dx, dscale, dshift = ada_layer_norm_bwd(dy, x, scale, mean, rstd, ctx.one_plus_scale)
    return dx, dscale.to(scale.dtype), dshift.to(ctx.shift_dtype), None, None, None


ada_layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- functional

def _check_modulation(arg: str, value, input: torch.Tensor) -> torch.Tensor:
    """scale/shift: ``[B, D]`` or ``[B, 1, ..., 1, D]``; returned as ``[B, D]``."""
    b, d = input.shape[0], input.shape[-1]
    _checks.check_tensor(_OP, arg, value, dtypes=tuple(dict.fromkeys((input.dtype, torch.float32))))
    shape = tuple(value.shape)
    if len(shape) < 2 or shape[0] != b or shape[-1] != d or any(n != 1 for n in shape[1:-1]):
        raise ValueError(f"cudnorm.{_OP}: argument '{arg}' has shape {shape}; expected [B, D] or [B, 1, D] "
                         f"with B={b}, D={d} from input of shape {tuple(input.shape)}")
    _checks.check_same_device(_OP, arg, value, input)
    return value.reshape(b, d)


def ada_layer_norm(input: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6,
                   one_plus_scale: bool = False) -> torch.Tensor:
    """Adaptive LayerNorm: a non-affine LayerNorm over the last dim, modulated per sample.

    Args:
        input: ``[B, *, D]`` (e.g. ``[B, S, D]`` tokens), float16/bfloat16/float32.
        scale, shift: ``[B, D]`` or ``[B, 1, D]``, float32 or ``input.dtype``; broadcast over
            the tokens of each sample.
        eps: added to the variance (DiT/PixArt/SD3/Flux use 1e-6).
        one_plus_scale: ``True`` computes DiT's ``modulate``: ``norm(x) * (1 + scale) + shift``
            (the ``1 +`` runs inside the graph); ``False`` computes ``norm(x) * scale + shift``.

    Returns:
        ``input``-shaped tensor in ``input.dtype``. Gradients flow to input, scale and shift
        (scale/shift gradients are accumulated in fp32 and returned in their dtype). With
        bf16/fp16 input, fp32 scale/shift are rounded to ``input.dtype`` for the forward only.
    """
    _checks.check_input(_OP, input)
    if input.dim() < 2:
        raise ValueError(f"cudnorm.{_OP}: argument 'input' must be [B, *, D], got shape {tuple(input.shape)}")
    scale = _check_modulation("scale", scale, input)
    shift = _check_modulation("shift", shift, input)
    eps = _checks.check_eps(_OP, eps)
    if not isinstance(one_plus_scale, bool):
        raise TypeError(f"cudnorm.{_OP}: argument 'one_plus_scale' must be a bool, got {type(one_plus_scale).__name__}")
    b, d = input.shape[0], input.shape[-1]
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (input, scale, shift))
    y, _, _ = ada_layer_norm_fwd(input.reshape(b, -1, d), scale, shift, eps, one_plus_scale, training)
    return y.view(input.shape)


def check_cases(device: str, dtypes):
    """``cudnorm check`` cases (see ``cudnorm._check._cases`` for the tuple format):
    both conventions, fp32 and activation-dtype scale/shift, DiT-like shape."""
    b, s, d = 4, 250, 1152
    for dtype in dtypes:
        for wdtype in dict.fromkeys((torch.float32, dtype)):
            for dit in (True, False):
                g = torch.Generator(device="cpu").manual_seed(0)
                x = torch.randn((b, s, d), generator=g).to(device, dtype)
                scale = ((0.0 if dit else 1.0) + 0.1 * torch.randn((b, d), generator=g)).to(device, wdtype)
                shift = (0.1 * torch.randn((b, d), generator=g)).to(device, wdtype)
                tag = f"{str(dtype)[6:]} x, {str(wdtype)[6:]} scale, {'1+scale' if dit else 'scale'}"
                yield (f"{_OP} ({tag})", dtype,
                       lambda x, sc, sh, dit=dit: ada_layer_norm(x, sc, sh, 1e-6, one_plus_scale=dit),
                       lambda x, sc, sh, dit=dit: _eager_formula(x, sc, sh, 1e-6, dit),
                       lambda x, sc, sh, dit=dit: ref.ada_layer_norm(x, sc, sh, 1e-6, dit=dit),
                       (x, scale, shift), ("y", "dx", "dscale", "dshift"))


def _eager_formula(x, scale, shift, eps, dit):
    """PyTorch in ``x``'s dtype, as DiT code writes it (the baseline of the 2x error rule)."""
    scale, shift = scale.to(x.dtype)[:, None], shift.to(x.dtype)[:, None]
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * ((1 + scale) if dit else scale) + shift
