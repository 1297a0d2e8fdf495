"""The one place that knows whether cuDNN can serve a call, and owns the cuDNN handles.

* ``cudnn_status()`` answers, once per process, whether the frontend imports and which
  backend it drives; ``route(tensor)`` answers per call whether *this* tensor can go to
  cuDNN (a CUDA tensor on a GPU cuDNN's norm engines support, nothing disabled).
* ``handle(device_index)`` returns the cuDNN handle of the calling thread for that device,
  bound to torch's *current* stream, so work orders correctly with the caller's kernels
  and inside ``torch.cuda.graph`` capture (which runs on a side stream).

``cudnorm.config(disable_cudnn=True)`` (or ``CUDNORM_DISABLE_CUDNN=1`` at import) forces
PyTorch's kernels everywhere.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import threading
from dataclasses import dataclass

import torch

from . import _lru, _settings

#: Oldest compute capability we send to cuDNN's norm engines. The fused norm engines
#: are built for Ampere and newer; older GPUs take the PyTorch path.
MIN_COMPUTE_CAPABILITY = (8, 0)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class CudnnStatus:
    """Whether the cuDNN frontend can be used in this process, and why not."""

    available: bool
    reason: str
    frontend_version: str | None = None
    backend_version: int | None = None


@functools.lru_cache(maxsize=None)
def cudnn_module():
    """The imported ``cudnn`` frontend module, or ``None`` when it does not import (code that
    needs it calls :func:`frontend`, which says what to install).

    torch is imported first (above) so that the frontend binds the cuDNN library torch
    already loaded rather than a second copy.
    """
    try:
        import cudnn  # noqa: PLC0415 - optional dependency, imported lazily on purpose
    except Exception:  # any import-time failure means "no cuDNN here"
        return None
    return cudnn


class FrontendMissing(ImportError):
    """A call that builds or runs cuDNN graphs in a process where the cuDNN frontend does not
    import (the CPU set-up leaves it out)."""


#: What brings the frontend: the GPU extras (``cu12``/``cu13``) hold it too.
FRONTEND_EXTRA = 'pip install -e ".[frontend]"'


def frontend(caller: str):
    """The ``cudnn`` frontend module for ``caller`` (the function that needs it, named in the
    error). Raises :class:`FrontendMissing` when it does not import, rather than letting
    ``None`` fail later with an ``AttributeError``."""
    cudnn = cudnn_module()
    if cudnn is None:
        raise FrontendMissing(f"{caller}: the cuDNN frontend (nvidia-cudnn-frontend) does not import here; "
                              f"{FRONTEND_EXTRA} installs it (on a GPU, the cu12/cu13 extra does)")
    return cudnn


@functools.lru_cache(maxsize=None)
def _probe_status() -> CudnnStatus:
    if not torch.cuda.is_available():
        return CudnnStatus(False, "no CUDA device")
    cudnn = cudnn_module()
    if cudnn is None:
        return CudnnStatus(False, "nvidia-cudnn-frontend is not importable")
    try:
        backend = int(cudnn.backend_version())
    except Exception as exc:  # the library torch ships could not be found/loaded
        return CudnnStatus(False, f"cuDNN backend not loadable: {exc}", cudnn.__version__)
    return CudnnStatus(True, "ok", cudnn.__version__, backend)


def cudnn_status() -> CudnnStatus:
    """Process-wide availability of cuDNN (honours ``Config.disable_cudnn``)."""
    if _settings.current.disable_cudnn:
        return CudnnStatus(False, "disabled by the configuration (disable_cudnn)")
    return _probe_status()


@functools.lru_cache(maxsize=None)
def _arch_ok(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= MIN_COMPUTE_CAPABILITY


_routes = _lru.LRU("routes", 64)  # device index -> (settings it was computed under, answer)


def route(tensor: torch.Tensor) -> str | None:
    """``None`` when cuDNN can serve an op on ``tensor``, else the reason it cannot.
    Runs on every call: the answer per device is memoised until the settings change."""
    if not tensor.is_cuda:
        return f"{tensor.device.type} tensor"
    index = tensor.get_device()
    known = _routes.peek(index)
    if known is not None and known[0] is _settings.current:
        return known[1]
    status = cudnn_status()
    if not status.available:
        reason = status.reason
    elif not _arch_ok(index):
        cap = torch.cuda.get_device_capability(index)
        reason = f"compute capability {cap[0]}.{cap[1]} is below {MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]}"
    else:
        reason = None
    _routes.put(index, (_settings.current, reason))
    return reason


def torch_to_cudnn_dtype(dtype: torch.dtype):
    """Map a torch dtype to the frontend's ``cudnn.data_type``."""
    cudnn = frontend("cudnorm._runtime.torch_to_cudnn_dtype")
    table = {
        torch.float16: cudnn.data_type.HALF,
        torch.bfloat16: cudnn.data_type.BFLOAT16,
        torch.float32: cudnn.data_type.FLOAT,
    }
    return table[dtype]


class _DeviceState:
    """This thread's cuDNN handle for one device, the stream it is bound to, and the buffers
    kept per stream (workspaces, rounding rows; see :func:`_kept`)."""

    __slots__ = ("handle", "backend", "stream", "workspaces", "rounding")

    def __init__(self, device_index: int) -> None:
        cudnn = frontend("cudnorm._runtime.handle")
        with torch.cuda.device(device_index):
            self.handle = cudnn.create_handle()
        self.backend = self.handle.backend_handle  # the cudnnHandle_t the raw launcher takes
        self.stream = None
        self.workspaces: dict[int, tuple[torch.Tensor, int]] = {}  # stream -> (buffer, bytes)
        self.rounding: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (stream, n, dtype) -> rows


class _Handles(threading.local):
    """Per-thread ``{device_index: _DeviceState}``."""

    def __init__(self) -> None:
        self.by_device: dict[int, _DeviceState] = {}


_handles = _Handles()
# torch's private raw getter costs ~0.1 us; torch.cuda.current_stream() builds an object (~3 us).
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
# a memory bound, not a measured figure (docs/performance.md, Decisions)
_MAX_STREAMS_WITH_WORKSPACE = 16
_U8 = torch.uint8


def capturing() -> bool:
    """Whether torch's current stream is being captured into a CUDA graph."""
    return bool(_capturing())


def current_stream_ptr(device_index: int) -> int:
    if _raw_current_stream is not None:
        return int(_raw_current_stream(device_index))
    return torch.cuda.current_stream(device_index).cuda_stream


def _bound(device_index: int) -> _DeviceState:
    """This thread's state for ``device_index`` with its handle bound to torch's current
    stream (re-bound only when the stream changed since the last call)."""
    stream = _raw_current_stream(device_index) if _raw_current_stream is not None \
        else torch.cuda.current_stream(device_index).cuda_stream
    state = _handles.by_device.get(device_index)
    if state is None:
        state = _handles.by_device[device_index] = _DeviceState(device_index)
    if state.stream != stream:
        frontend("cudnorm._runtime.handle").set_stream(handle=state.handle, stream=stream)
        state.stream = stream
    return state


def handle(device_index: int):
    """This thread's cuDNN handle for ``device_index``, bound to torch's current stream."""
    return _bound(device_index).handle


_worker = None  # cudnorm's one worker thread, made on first use
_worker_lock = threading.Lock()
_WORKER_NAME = "cudnorm-worker"


def _forget_worker() -> None:
    global _worker, _worker_lock  # a forked child has no copy of the thread: a new one there
    _worker, _worker_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_worker)


def on_worker_thread(device_index: int, work):
    """``work()`` run on cudnorm's worker thread with ``device_index`` current; its result is
    returned and its exception raised here. The caller's thread waits (and gives up the GIL).

    Two kinds of work go there. Buffers kept across calls (:func:`_kept`): the calling thread
    may be allocating into a CUDA-graph pool. And the frontend's planning
    (``cudnorm._graphs``): when a heuristic mode finds no engine, cudnn-frontend 1.32 keeps
    that exception in a local of the frame that caught it, a reference cycle that holds the
    frame, and through its ``f_back`` every frame of the thread's stack until the garbage
    collector runs; on the caller's thread that kept a model's activations and gradients
    alive (under ``mode="reduce-overhead"`` it broke CUDA-graph trees' pool check, found on an
    H100). On the worker the cycle holds only the worker's own frames.
    """
    if threading.current_thread().name.startswith(_WORKER_NAME):
        return work()  # already there (work that asks for a kept buffer): the thread would wait on itself

    def run():
        with torch.cuda.device(device_index):
            return work()

    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=_WORKER_NAME)
    # no local holds the future: one that held it would, with the exception, form a cycle of its own
    return _worker.submit(run).result()


def _kept(device_index: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CUDA buffer kept across calls, allocated on the worker thread: while
    torch.compile's CUDA-graph modes warm up or record, every allocation of the calling thread
    goes to the graphs' memory pool, where a kept buffer fails cudagraph trees' check that each
    live pool tensor is a graph output (found on an H100 under mode="reduce-overhead"). It is
    marked as used on the caller's stream, so once dropped its memory is not handed out again
    while a launch there may still use it."""
    device = torch.device("cuda", device_index)
    tensor = on_worker_thread(device_index, lambda: torch.empty(shape, dtype=dtype, device=device))
    tensor.record_stream(torch.cuda.current_stream(device_index))
    return tensor


def kept_full(device_index: int, n: int, value: float, dtype: torch.dtype) -> torch.Tensor:
    """A ``[n]`` CUDA vector of ``value`` kept across calls: as :func:`_kept`, filled and waited
    for on the worker thread."""
    device = torch.device("cuda", device_index)

    def fill():
        tensor = torch.full((n,), value, dtype=dtype, device=device)
        torch.cuda.current_stream(device_index).synchronize()
        return tensor

    tensor = on_worker_thread(device_index, fill)
    tensor.record_stream(torch.cuda.current_stream(device_index))
    return tensor


def launch_context(device_index: int, nbytes: int) -> tuple[_DeviceState, torch.Tensor | None]:
    """``(state, workspace)`` for one execute on torch's current stream: this thread's
    :class:`_DeviceState` (``state.handle`` bound to the stream, ``state.backend`` its
    ``cudnnHandle_t``) and a uint8 CUDA buffer of at least ``nbytes`` (``None`` for 0).

    The workspace is kept per (thread, device, stream) and grows when a plan needs more:
    allocating it per call costs several us of host time. Reuse is safe because every
    execute that uses it is ordered on that one stream. While the stream is being captured
    into a CUDA graph a fresh buffer comes from the graph's memory pool instead, so a replay
    never writes into memory the cache later frees or grows; the caller keeps it alive until
    its launch has been issued.
    """
    state = _bound(device_index)
    if not nbytes:
        return state, None
    if _capturing():
        return state, torch.empty(nbytes, dtype=_U8, device=torch.device("cuda", device_index))
    kept = state.workspaces.get(state.stream)
    if kept is None or kept[1] < nbytes:
        if len(state.workspaces) >= _MAX_STREAMS_WITH_WORKSPACE:
            state.workspaces.clear()
        kept = state.workspaces[state.stream] = (_kept(device_index, nbytes, _U8), nbytes)
    return state, kept[0]


def rounding_rows(device_index: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``[n]`` CUDA vectors of ``dtype`` (each 16-byte aligned) that a forward rounds its
    fp32 weight and bias into just before its launch, kept per (thread, device, stream).

    Allocating and slicing a fresh pair per call cost more host time than the graph launch.
    Reuse is safe for the reason the workspace's is: the copy into the rows and the launch
    reading them are ordered on this one stream, after every earlier launch that read them,
    and each thread has its own rows, so two threads sharing a stream cannot interleave their
    copies. While the stream is being captured into a CUDA graph the rows come fresh from
    the graph's pool (see :func:`launch_context`).
    """
    state = _bound(device_index)
    key = (state.stream, n, dtype)
    capturing = _capturing()
    rows = None if capturing else state.rounding.get(key)
    if rows is None:
        per_16_bytes = 16 // dtype.itemsize
        stride = -(-n // per_16_bytes) * per_16_bytes
        pair = torch.empty((2, stride), dtype=dtype, device=torch.device("cuda", device_index)) if capturing \
            else _kept(device_index, (2, stride), dtype)
        rows = (pair[0, :n], pair[1, :n])
        if not capturing:
            if len(state.rounding) >= _MAX_STREAMS_WITH_WORKSPACE:
                state.rounding.clear()
            state.rounding[key] = rows
    return rows


def release_workspaces() -> None:
    """Drop this thread's cached workspaces and rounding rows (``cudnorm.clear_cache()``)."""
    for state in _handles.by_device.values():
        state.workspaces.clear()
        state.rounding.clear()


def release_handles() -> None:
    """Drop this thread's cuDNN handles (at interpreter exit; a later call makes new ones)."""
    _handles.by_device.clear()


@functools.cache
def driver_version() -> int:
    """The CUDA driver's version (``cuDriverGetVersion``, e.g. 13000), 0 where it cannot be read:
    a measured decision is kept per driver, whose scheduling can move kernel times."""
    try:
        value = ctypes.c_int(0)
        return value.value if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(value)) == 0 else 0
    except (OSError, AttributeError):
        return 0


def device_fingerprint(device_index: int) -> dict:
    """Everything that makes a built plan valid on a device (used by the plan store)."""
    status = cudnn_status()
    props = torch.cuda.get_device_properties(device_index)
    return {
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "cudnn_backend": status.backend_version,
        "cudnn_frontend": status.frontend_version,
        "torch_cuda": torch.version.cuda,
    }
