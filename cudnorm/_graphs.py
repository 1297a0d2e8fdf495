"""The one place that turns a :class:`NormSpec` into a cuDNN graph, builds it and runs it.

``build_ir(spec)`` only describes the graph (no GPU needed: on a CPU machine the IR can be
built and inspected, which the tests do); ``build_plan(spec)`` validates, picks a plan (the
heuristics' first, or the fastest when autotuning) and finalises it; a :class:`Plan` runs
with the frontend's ordered fast path (a tuple of buffers in a fixed role order).

No autograd here: the op modules decide *what* to run, this module only knows *how*.
"""

from __future__ import annotations

import time
from array import array as _array
from dataclasses import dataclass, field

import torch

from . import _gpu_lock, _lru, _runtime
from ._spec import NormSpec

# Fixed uids per tensor role, so the ordered execute path and serialized plans agree.
UIDS = {
    "x": 1, "scale": 2, "bias": 3, "eps": 4, "y": 5, "mean": 6, "rstd": 7,
    "dy": 8, "dx": 9, "dscale": 10, "dbias": 11, "offset": 12, "residual": 13, "h": 14,
}


def roles(spec: NormSpec) -> tuple[str, ...]:
    """The buffers a graph reads and writes, in the order :meth:`Plan.run` and
    :meth:`Plan.launch` take them: ascending uid (:data:`UIDS`), the order of the backend's
    variant-pack slots, so a launch passes its addresses without reordering them. A graph
    with a weight offset reads it after those (the host scalar ``offset``); a forward with a
    fused residual add reads ``residual`` and writes ``h`` last."""
    extra = ("offset",) if spec.offset else ()
    if spec.residual:
        extra += ("residual", "h")
    return _ROLES[spec.op != "rms_norm", spec.phase] + extra


_ROLES = {  # (has mean and bias, phase) -> roles without the offset
    (False, "bwd"): ("x", "scale", "rstd", "dy", "dx", "dscale"),
    (True, "bwd"): ("x", "scale", "mean", "rstd", "dy", "dx", "dscale", "dbias"),
    (False, "infer"): ("x", "scale", "eps", "y"),
    (True, "infer"): ("x", "scale", "bias", "eps", "y"),
    (False, "train"): ("x", "scale", "eps", "y", "rstd"),
    (True, "train"): ("x", "scale", "bias", "eps", "y", "mean", "rstd"),
}


def _host_scalar_shape(spec: NormSpec) -> list[int]:
    return [1, 1, 1] if spec.op == "ada_layer_norm" else [1, 1, 1, 1]


def buffer_shapes(spec: NormSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every buffer of ``spec`` (as torch allocates them)."""
    f32 = torch.float32
    x = ((spec.rows, spec.cols), spec.x_dtype)
    if spec.op == "ada_layer_norm":
        param = ((spec.batch, spec.cols), spec.scale_dtype)
        dparam = ((spec.batch, spec.cols), spec.scale_dtype)
    else:
        param = ((spec.cols,), spec.scale_dtype)
        dparam = ((spec.cols,), spec.scale_dtype)
    stat = ((spec.rows,), f32)
    table = {"x": x, "y": x, "dy": x, "dx": x, "residual": x, "h": x, "scale": param, "bias": param,
             "dscale": dparam, "dbias": dparam, "mean": stat, "rstd": stat, "eps": ((1,), f32), "offset": ((1,), f32)}
    return {r: table[r] for r in roles(spec)}


def _dims(spec: NormSpec):
    """(x dims, x strides, param dims, param strides, stat dims, stat strides) in cuDNN's layout."""
    if spec.op == "ada_layer_norm":
        b, s, n = spec.batch, spec.seq, spec.cols
        return ([b, s, n], [s * spec.x_row_stride, spec.x_row_stride, 1], [b, 1, n], [n, n, 1], [b, s, 1], [s, 1, 1])
    m, n = spec.rows, spec.cols
    return ([m, n, 1, 1], [spec.x_row_stride, 1, 1, 1], [1, n, 1, 1], [n, 1, 1, 1], [m, 1, 1, 1], [1, 1, 1, 1])


def build_ir(spec: NormSpec, handle=None, kernel_cache=None):
    """Describe the graph of ``spec`` (no validation, no GPU work). Returns ``(graph, uids)``.

    A ``spec.dynamic`` graph is a dynamic-shape graph bound to ``kernel_cache`` (made by
    :func:`build_plan`; ``None`` when only the IR is wanted).
    """
    cudnn = _runtime.frontend("cudnorm._graphs.build_ir")
    dt = _runtime.torch_to_cudnn_dtype
    f32 = cudnn.data_type.FLOAT
    io = dt(spec.x_dtype)
    kwargs = dict(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32)
    if handle is not None:
        kwargs["handle"] = handle
    if spec.dynamic:
        kwargs.update(is_dynamic_shape_enabled=True, kernel_cache=kernel_cache)
    g = cudnn.pygraph(**kwargs)
    xd, xs, pd, ps, sd, ss = _dims(spec)
    t = {}

    def tensor(role, dims, strides, dtype, **kw):
        t[role] = g.tensor(name=role, dim=dims, stride=strides, data_type=dtype, uid=UIDS[role], **kw)
        return t[role]

    def output(role, node_out, dtype):
        node_out.set_output(True).set_data_type(dtype).set_uid(UIDS[role])
        # explicit layouts: outputs are packed even when x has padded rows, and the
        # frontend's shape inference for AdaLN stats is not final before validate()
        dims, strides = {"y": (xd, _packed(xd)), "dx": (xd, _packed(xd)), "h": (xd, _packed(xd)),
                         "mean": (sd, ss), "rstd": (sd, ss),
                         "dscale": (pd, ps), "dbias": (pd, ps)}[role]
        node_out.set_dim(dims).set_stride(strides)
        t[role] = node_out

    tensor("x", xd, xs, io)
    norm_in = t["x"]
    if spec.residual:
        # the prenorm residual stream: h = x + residual, written out and normalised in one pass
        # (the norm reads h before rounding to the activation dtype)
        tensor("residual", xd, _packed(xd), io)
        norm_in = g.add(name="residual_add", a=t["x"], b=t["residual"], compute_data_type=f32)
        output("h", norm_in, io)
    # Every graph reads the scale in its memory dtype, and a backward writes dscale/dbias in
    # that dtype too: the graph accumulates them in fp32 and rounds once, as PyTorch's own
    # backward does, so half-precision weights need no cast kernels around the launch and
    # fp32 master weights get fp32 gradients (cuDNN 9.19 runs both at the same speed).
    scale = tensor("scale", pd, ps, dt(spec.scale_dtype))
    hs = _host_scalar_shape(spec)
    hs_stride = [1] * len(hs)
    if spec.offset:
        # Gemma's ``1 + weight``: added in fp32 inside the graph, before the norm reads it; the
        # backward's dscale is then the weight's gradient as it stands
        offset = tensor("offset", hs, hs_stride, f32, is_pass_by_value=True)
        scale = g.add(name="weight_offset", a=scale, b=offset, compute_data_type=f32)
        scale.set_data_type(f32)
    if spec.phase == "bwd":
        tensor("dy", xd, _packed(xd), io)
        if spec.op != "rms_norm":
            tensor("mean", sd, ss, f32)
        tensor("rstd", sd, ss, f32)
        grad_dtype = dt(spec.scale_dtype)
        if spec.op == "rms_norm":
            dx, dscale, _ = g.rmsnorm_backward(name="norm_bwd", grad=t["dy"], input=t["x"], scale=scale,
                                               inv_variance=t["rstd"], has_dbias=False)
            outs = [("dx", dx, io), ("dscale", dscale, grad_dtype)]
        else:
            op = g.layernorm_backward if spec.op == "layer_norm" else g.adalayernorm_backward
            dx, dscale, dbias = op(name="norm_bwd", grad=t["dy"], input=t["x"], scale=scale, mean=t["mean"],
                                   inv_variance=t["rstd"])
            outs = [("dx", dx, io), ("dscale", dscale, grad_dtype), ("dbias", dbias, grad_dtype)]
    else:
        bias = None
        if spec.op != "rms_norm":
            bias = tensor("bias", pd, ps, dt(spec.scale_dtype))
        eps = tensor("eps", hs, hs_stride, f32, is_pass_by_value=True)
        phase = cudnn.norm_forward_phase.TRAINING if spec.phase == "train" else cudnn.norm_forward_phase.INFERENCE
        if spec.op == "rms_norm":
            y, rstd = g.rmsnorm(name="norm", norm_forward_phase=phase, input=norm_in, scale=scale, epsilon=eps)
            mean = None
        else:
            op = g.layernorm if spec.op == "layer_norm" else g.adalayernorm
            y, mean, rstd = op(name="norm", norm_forward_phase=phase, input=norm_in, scale=scale, bias=bias, epsilon=eps)
        outs = [("y", y, io)]
        if spec.phase == "train":
            if mean is not None:
                outs.append(("mean", mean, f32))
            outs.append(("rstd", rstd, f32))
    for role, node_out, dtype in outs:
        output(role, node_out, dtype)
    return g, tuple(UIDS[r] for r in roles(spec))


def _packed(dims: list[int]) -> list[int]:
    """Row-major strides of ``dims``."""
    strides, acc = [], 1
    for d in reversed(dims):
        strides.append(acc)
        acc *= d
    return list(reversed(strides))


_SCALARS = _lru.LRU("host_scalars", 1024)  # (value, rank) -> (CPU tensor, its address)


def eps_scalar(value: float, rank: int = 4) -> tuple[torch.Tensor, int]:
    """``(tensor, address)`` of a CPU fp32 tensor of ``rank`` unit dims holding ``value``: the
    pass-by-value eps (or weight offset) input of a forward graph (rank 3 for AdaLN, 4
    otherwise), memoised per value. The caller holds the tensor until its launch has read
    it: the memo may evict it meanwhile (another thread adding values), which is then safe."""
    key = (value, rank)
    found = _SCALARS.peek(key)
    if found is None:
        tensor = torch.full((1,) * rank, float(value), dtype=torch.float32)
        found = (tensor, tensor.data_ptr())
        _SCALARS.put(key, found)
    return found


def host_scalar(value: float, spec: NormSpec) -> torch.Tensor:
    """The CPU fp32 tensor holding ``value`` for ``spec``'s pass-by-value eps input."""
    return eps_scalar(float(value), len(_host_scalar_shape(spec)))[0]


#: Frontend versions whose private raw-pointer execute (``backend_graph._execute_with_raw_ptrs``)
#: was verified bit-identical to the public ``execute`` by ``tests/test_norms_gpu.py``. Any other
#: version takes the public path: a private signature may change meaning without an error.
RAW_EXECUTE_FRONTENDS = ("1.32.",)


class RawExecute:
    """Launches a built plan through the frontend's C++ graph with an array of addresses,
    skipping the public ``execute``'s per-call Python (binding checks, variant-pack
    normalisation).

    The public ordered execute costs 14-18 us of host time per launch on an H200, this path
    the backend call alone (7-8 us on a lent H100 host, most of it inside cuDNN;
    docs/performance.md, Decisions). Built by
    :meth:`for_graph`, which returns ``None`` whenever anything it relies on is absent.
    """

    __slots__ = ("_execute", "_perm", "_count", "_index")

    def __init__(self, execute, arg_of_slot: tuple[int, ...], index: int) -> None:
        self._execute = execute
        # None when the caller's order is already the backend's (roles() lists ascending uids)
        self._perm = None if arg_of_slot == tuple(range(len(arg_of_slot))) else arg_of_slot
        self._count = len(arg_of_slot)
        self._index = index

    MODE = "raw-pointer launch"

    @staticmethod
    def enabled() -> bool:
        from . import _settings  # noqa: PLC0415 - _settings is import-light; keep this module's imports minimal

        version = str(getattr(_runtime.cudnn_module(), "__version__", ""))
        return _settings.current.raw_execute and version.startswith(RAW_EXECUTE_FRONTENDS)

    @classmethod
    def mode(cls) -> str:
        """How plans are launched here: :attr:`MODE`, or why the public ``execute`` is used
        (``cudnorm info`` shows it). A report only: launches ask :meth:`enabled`."""
        from . import _settings  # noqa: PLC0415

        frontend = _runtime.cudnn_module()
        if frontend is None:
            return "none (no cuDNN frontend)"
        if cls.enabled():
            return cls.MODE
        if not _settings.current.raw_execute:
            return "public execute (raw_execute=False)"
        version = str(getattr(frontend, "__version__", "")) or "unknown"
        return f"public execute (raw-pointer launch not verified on frontend {version})"

    @classmethod
    def for_graph(cls, g, uids: tuple[int, ...]) -> "RawExecute | None":
        """The raw launcher of a built (or deserialized) graph whose caller-filled slots are
        exactly ``uids``, or ``None`` (then the public ``execute`` is used)."""
        if not cls.enabled():
            return None
        try:
            if getattr(g, "selected_engine", None) is not None:
                return None  # a Python engine (sm100 norm kernels): only the public path runs it
            order = list(g._variant_pack_uids())  # the backend's slots, ascending uid
            if sorted(order) != sorted(uids):
                return None
            index = -1
            if g._plans:
                cpp_index = g._materialize_backend_plan(g._plan_index or 0).cpp_index
                index = -1 if cpp_index is None else int(cpp_index)
            return cls(g._lowered_graph._execute_with_raw_ptrs, tuple(uids.index(u) for u in order), index)
        except Exception:  # any private detail missing: the public path is always correct
            return None

    def launch(self, pointers, workspace: torch.Tensor | None, backend_handle: int) -> None:
        """Execute with device (or, for pass-by-value scalars, host) addresses given in
        :func:`roles` order. An ``array('Q')`` holds them for the call: cheaper to build than
        a ctypes array (8.2 vs 10.3 us per launch with the execute, lent H100 host;
        docs/performance.md, Decisions)."""
        perm = self._perm
        slots = _array("Q", pointers if perm is None else [pointers[i] for i in perm])
        self._execute(slots.buffer_info()[0], self._count, 0 if workspace is None else workspace.data_ptr(),
                      backend_handle, self._index)


@dataclass
class Plan:
    """A built, runnable cuDNN graph for one :class:`NormSpec`."""

    spec: NormSpec
    graph: object
    uids: tuple[int, ...]
    workspace_size: int
    plan_name: str
    build_seconds: float
    candidates_timed: int = 0
    timings_ms: dict = field(default_factory=dict)
    source: str = "built"  # "built" | "store" (loaded from the on-disk plan store)
    # A deserialized graph has no ranked plan list; the frontend documents the {uid: tensor}
    # form for it (cudnn-facts section 5), so store-loaded plans use that form.
    ordered: bool = True
    raw: RawExecute | None = None  # the fast launcher, when RawExecute.for_graph allows one
    # cuDNN's serialized plan (serialize_plan), kept once made: the plan store writes it and
    # the native launch path (cudnorm._native) deserializes its own copy of the plan from it
    blob: bytes | None = None
    native_id: int | None = None  # the plan's id in the native path's table, once added there

    def run(self, *buffers: torch.Tensor) -> None:
        """Execute on torch's current stream. ``buffers`` follow :func:`roles`; the workspace
        is this stream's cached buffer (:func:`cudnorm._runtime.launch_context`)."""
        state, workspace = _runtime.launch_context(self.spec.device_index, self.workspace_size)
        if self.raw is not None:
            self.raw.launch([b.data_ptr() for b in buffers], workspace, state.backend)
        else:
            self._execute_public(buffers, workspace, state.handle)

    def launch(self, pointers: list[int]) -> None:
        """:meth:`run` with addresses instead of tensors (offsets into a buffer need no
        tensor view): the hot paths of the ops use it. The caller keeps every buffer alive
        until this returns. Without a raw launcher the public execute takes the addresses in
        its ``{uid: address}`` form."""
        state, workspace = _runtime.launch_context(self.spec.device_index, self.workspace_size)
        if self.raw is not None:
            self.raw.launch(pointers, workspace, state.backend)
        else:
            self.graph.execute(dict(zip(self.uids, pointers)), workspace, handle=state.handle)

    def _execute_public(self, buffers, workspace, h) -> None:
        if self.ordered:
            self.graph.execute(buffers, workspace, handle=h, tensor_uids=self.uids)
        else:
            self.graph.execute(dict(zip(self.uids, buffers)), workspace, handle=h)


_kernel_caches = _lru.LRU("kernel_caches", 64)


def _kernel_cache(spec: NormSpec):
    """The kernel cache shared by the dynamic graphs of one (device, op, phase): a later
    row count reuses compiled kernels (LN forward builds drop from ~0.25 s to 0.03-0.06 s)."""
    key = (spec.device_index, spec.op, spec.phase)
    cache = _kernel_caches.get(key)
    if cache is None:
        cache = _runtime.frontend("cudnorm._graphs._kernel_cache").create_kernel_cache()
        _kernel_caches.put(key, cache)
    return cache


def _heuristic_modes(full: bool) -> list:
    """Heuristic modes asked for candidate plans. Mode A alone lists the same first plan as
    A + B + FALLBACK (their lists are concatenated, A's first) at a fraction of the cost: a
    LayerNorm backward at N = 4096 (H200) spent 0.28-0.35 s in mode A vs 0.57-0.80 s in all
    three (docs/performance.md, Decisions). Autotuning wants every candidate."""
    cudnn = _runtime.frontend("cudnorm._graphs._heuristic_modes")
    if full:
        return [cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK]
    return [cudnn.heur_mode.A]


def _finalise(spec: NormSpec, h, *, full_heuristics: bool):
    """``(graph, uids, timings)``: the graph of ``spec`` validated, with one plan built (the
    fastest timed one when autotuning, else the heuristics' first)."""
    g, uids = build_ir(spec, handle=h, kernel_cache=_kernel_cache(spec) if spec.dynamic else None)
    g.validate()
    g.build_operation_graph()
    modes = _heuristic_modes(full_heuristics)
    # on the worker thread: a mode without an engine leaves a reference cycle holding the
    # planning thread's frames (cudnorm._runtime.on_worker_thread), which must not be the caller's
    _runtime.on_worker_thread(spec.device_index, lambda: g.create_execution_plans(modes))
    g.check_support()
    timings: dict = {}
    if spec.autotune and g.get_execution_plan_count() > 1:
        timings = _time_plans(g, spec)
        g.build_plan_at_index(min(timings, key=timings.get))
    else:
        g.build_plans()
    return g, uids, timings


def build_plan(spec: NormSpec) -> Plan:
    """Validate and finalise the graph of ``spec`` on its device.

    Raises the frontend's ``cudnnGraphNotSupportedError`` when no engine accepts the graph;
    callers treat that as "cuDNN declines" and take the PyTorch path.
    """
    start = time.perf_counter()
    with torch.cuda.device(spec.device_index):
        h = _runtime.handle(spec.device_index)
        try:
            g, uids, timings = _finalise(spec, h, full_heuristics=spec.autotune)
        except Exception:
            if spec.autotune:
                raise
            # mode A had no plan that builds: ask modes B and FALLBACK too before declining
            g, uids, timings = _finalise(spec, h, full_heuristics=True)
        workspace = int(g.get_workspace_size())
        name = _selected_plan_name(g)
    return Plan(spec, g, uids, workspace, name, time.perf_counter() - start,
                candidates_timed=len(timings), timings_ms=timings, raw=RawExecute.for_graph(g, uids))


def _selected_plan_name(g) -> str:
    index = getattr(g, "_plan_index", 0) or 0
    try:
        return str(g.get_plan_name_at_index(index))
    except Exception:  # a deserialized graph has no ranked list to name
        return "deserialized"


def dummy_buffers(spec: NormSpec, eps: float = 1e-5) -> list[torch.Tensor]:
    """Plausible random buffers for ``spec`` (autotuning, warmup, benchmarks)."""
    device = f"cuda:{spec.device_index}"
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for role, (shape, dtype) in buffer_shapes(spec).items():
        if role == "eps":
            out.append(host_scalar(eps, spec))
        elif role == "offset":
            out.append(host_scalar(1.0, spec))
        elif role == "rstd":
            out.append(torch.rand(shape, device=device, generator=gen).add_(0.5))
        else:
            out.append(torch.randn(shape, device=device, generator=gen).to(dtype))
    return out


#: Autotuning builds and times the heuristics' first candidates only (``Config.autotune_candidates``,
#: default 8): finalising a plan costs 0.2-4 s, and timing all 25-28 LN/RMS-forward plans took
#: 16-39 s per graph at 32768 x 8192..32768 on the H200. The fastest plan is not always among the
#: first 8: for the LayerNorm forward at 32768 x 8192 it was candidate 21 (4119 GB/s against
#: 3667 for the best of the first 8; ``benchmarks/plan_candidates.py``; docs/performance.md,
#: Decisions).
#: Plans timed in addition to the first candidates whenever the heuristics list them: measured
#: fastest where the heuristics rank them low. ``eng3_k24=2_k30=0_k33=0_k34=0_k35=1_k36=3`` was the
#: fastest LayerNorm forward at 32768 x 4096 and 32768 x 8192 (H200, every candidate timed:
#: 3923 / 4038 GB/s against 3575 / 3667 for the best of the first 8), ranked 21st-24th
#: (docs/performance.md, Decisions).
EXTRA_CANDIDATES = ("eng3_k24=2_k30=0_k33=0_k34=0_k35=1_k36=3",)


def autotune_candidates(g) -> list[int]:
    """Indices of the candidate plans autotuning times: the first
    ``Config.autotune_candidates`` (default 8; ``"all"``: every one) and any later one named in
    :data:`EXTRA_CANDIDATES`."""
    from . import _settings  # noqa: PLC0415 - _settings is import-light; keep this module's imports minimal

    count = g.get_execution_plan_count()
    limit = _settings.current.autotune_candidates
    first = count if limit == "all" else min(count, limit)
    extra = [i for i in range(first, count) if str(g.get_plan_name_at_index(i)) in EXTRA_CANDIDATES]
    return list(range(first)) + extra


def _time_plans(g, spec: NormSpec, indices=None, reps: int = 20, budget_ms: float = 50.0) -> dict[int, float]:
    """Build and time the candidates :func:`autotune_candidates` names (or the given
    ``indices``); median ms per index.

    Every sample starts with L2 flushed (:func:`_l2_flush_buffer`), as a norm meets its
    input in a model and as the benchmarks time it: back to back, a graph of up to ~50 MB
    (a per-sample AdaLN launch, a few thousand rows) ran from L2 and its pick varied
    between processes. Candidates are sampled in rounds, one sample of each per round, so
    drift (clocks, a neighbour's load) touches all of them alike. After one round a
    candidate 3x slower than the best keeps that sample; the others get up to ``reps``
    rounds within about ``budget_ms`` each (at least 3): at 8192 x 262144 a run takes up to
    ~13 ms, where a fixed 20 samples of every candidate would spend seconds
    (docs/performance.md, Decisions)."""
    buffers = dummy_buffers(spec)
    uid_map = dict(zip((UIDS[r] for r in roles(spec)), buffers))
    h = _runtime.handle(spec.device_index)
    device = torch.device("cuda", spec.device_index)
    flush = _l2_flush_buffer(device)
    built = {}
    for index in autotune_candidates(g) if indices is None else indices:
        try:  # a plan that does not build is simply not a candidate
            g.build_plan_at_index(index)
            built[index] = torch.empty(max(int(g.get_workspace_size_plan_at_index(index)), 1), dtype=torch.uint8,
                                       device=device)
        except Exception:
            continue
    # built (CPU work) beside other processes, timed alone on the GPU (_gpu_lock says why)
    with _gpu_lock.held(_gpu_lock.device_key(spec.device_index)):
        return _time_built(g, spec, built, uid_map, h, flush, reps, budget_ms)


def _time_built(g, spec: NormSpec, built: dict, uid_map: dict, h, flush, reps: int, budget_ms: float) -> dict[int, float]:
    """:func:`_time_plans`' timing of the plans ``built`` (index: workspace)."""
    device = flush.device
    workspaces = {}
    for index, ws in built.items():
        try:  # a plan that does not run is simply not a candidate
            g.execute_plan_at_index(uid_map, ws, index, handle=h)  # warm-up: first-launch costs
            workspaces[index] = ws
        except Exception:
            continue
    if not workspaces:
        raise RuntimeError(f"cudnorm: autotuning {spec.slug()}: no plan ran")

    def one_round(candidates) -> dict[int, float]:
        events = {}
        for index in candidates:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush.zero_()
            begin.record()
            g.execute_plan_at_index(uid_map, workspaces[index], index, handle=h)
            end.record()
            events[index] = (begin, end)
        torch.cuda.synchronize(device)
        return {index: begin.elapsed_time(end) for index, (begin, end) in events.items()}

    first = one_round(workspaces)
    best = min(first.values())
    timings = {i: t for i, t in first.items() if t > 3 * best}
    contenders = [i for i in first if i not in timings]
    samples = {i: [first[i]] for i in contenders}
    for _ in range(max(3, min(reps, int(budget_ms / max(best, 1e-3)))) - 1):
        for index, t in one_round(contenders).items():
            samples[index].append(t)
    for index, values in samples.items():
        timings[index] = sorted(values)[len(values) // 2]
    return timings


def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """A byte buffer twice the size of ``device``'s L2: zeroing it evicts what a timed run
    would otherwise find cached (50 MB L2 on H100/H200)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
    return torch.empty(2 * l2, dtype=torch.uint8, device=device)


def serialize_plan(plan: Plan) -> bytes:
    """The finalised plan of ``plan`` in cuDNN's binary format (34-98 KB for norm graphs),
    made once per plan."""
    if plan.blob is None:
        plan.blob = bytes(plan.graph.serialize(as_bytes=True))
    return plan.blob


def deserialize_plan(spec: NormSpec, blob: bytes, plan_name: str = "deserialized") -> Plan:
    """Rebuild a runnable :class:`Plan` from :func:`serialize_plan` output (6-30 ms instead
    of a 0.1-1.4 s build). Raises if the blob does not load on this device/library."""
    cudnn = _runtime.frontend("cudnorm._graphs.deserialize_plan")
    start = time.perf_counter()
    with torch.cuda.device(spec.device_index):
        h = _runtime.handle(spec.device_index)
        g = cudnn.pygraph(handle=h)
        g.deserialize(h, blob)
        workspace = int(g.get_workspace_size())
    uids = tuple(UIDS[r] for r in roles(spec))
    return Plan(spec, g, uids, workspace, plan_name, time.perf_counter() - start, source="store", ordered=False,
                raw=RawExecute.for_graph(g, uids), blob=bytes(blob))
