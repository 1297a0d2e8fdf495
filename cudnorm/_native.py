"""The native launch path: builds and loads ``cudnorm/csrc``, and is the Python side of its tables.

A cudnorm call on the Python launch path costs 2-3x the host time of PyTorch's own op
(argument checks, plan lookup, an ``autograd.Function`` node and a Python backward). The
native path moves all of that to C++ (``cudnorm/csrc``, the frontend's C++ API): the public
functions hand their arguments to its entry ops (:mod:`cudnorm._entry`), and compiled graphs
call its CUDA kernels of cudnorm's custom ops. Python keeps what it does well, once:
describing, building, tuning and storing graphs, and deciding which plans serve a call.

* :func:`activate` (the first CUDA call, or ``cudnorm build``): builds the library with
  PyTorch's ``cpp_extension`` and ninja into ``Config.native_dir`` (once per machine and
  torch/CUDA/cuDNN/frontend version: a progress line meanwhile), loads it, defines the Python
  ops it calls back and switches the entry points. Without a compiler, ninja or headers it
  warns once, saying what is missing and how to fix it, and the Python launch path serves.
* :func:`resolve` (called by C++ for a call signature it has not seen): the recipe, which plans
  launch and how; plans reach the C++ table serialized (:func:`plan_id`).
* The fallbacks C++ calls: cudnorm's Python implementation of an op (``_kernel_py``) or of
  a whole public call (``_composite_py``).

Python state that changes what a signature resolves to (evicted plans, forgotten decisions,
``cudnorm.clear_cache()``) and an opening spec-recording block empty the C++ tables. The
configuration is part of their keys instead (:func:`config_id`): a configuration set again, as
``with cudnorm.config(...)`` blocks do, finds the recipes it resolved before rather than asking
Python again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import itertools
import os
import shutil
import sys
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch

from . import (_ada_kernel, _ada_rms, _ada_strategies, _cache, _decisions, _dispatch, _entry, _fused_add, _gated,
               _graphs, _lru, _norm, _norm_kernel, _ops, _recording, _rows, _runtime, _settings, _token_ada,
               _token_entry, _triton_launch, _warn)
from . import ada_layer_norm as _ada
from . import layer_norm as _layer_norm
from . import rms_norm as _rms_norm

CSRC = Path(__file__).parent / "csrc"
LIBRARY_NAME = "cudnorm_native"
# Compile flags beside cpp_extension's: the frontend's code stays private to the library (no
# other copy in the process, such as PyTorch's own, can interpose on it).
CFLAGS = ("-O2", "-fvisibility=hidden", "-fvisibility-inlines-hidden")
# Link flags beside the libraries found by _toolchain(): libstdc++ as the shared library the
# process already has. A toolchain that links it statically into the library (seen on a GPU
# image: no libstdc++.so.6 among its NEEDED) gives it a second, uninitialised copy of the
# iostream machinery, and the frontend's first string stream crashes inside plan loading.
LDFLAGS = ("-Wl,--no-as-needed", "-l:libstdc++.so.6", "-Wl,--as-needed")

# How a call signature is served: Mode in cudnorm/csrc/native.h
SINGLE, CHUNKED, PER_SAMPLE, ATEN, PYTHON, KERNEL = range(6)
# c10::ScalarType numbers of the dtypes that cross the boundary
_CODES = {torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bfloat16: 15}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


class Unavailable(RuntimeError):
    """The native path cannot be built or loaded here: ``reason`` and ``fix``."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason}; {fix}")
        self.reason, self.fix = reason, fix


@dataclasses.dataclass
class _State:
    status: str = "untried"  # "untried" | "active" | "unavailable"
    reason: str = ""
    library: str | None = None
    build_seconds: float | None = None  # this process built the library (None: loaded a built one)
    module: object = None  # the library as a Python module: the public functions' entry points


_state = _State()
_lock = threading.RLock()


def status() -> dict:
    """What ``cudnorm info`` shows: whether the native path serves calls here, and why not;
    ``build``: what the build cache holds (:func:`build_status`)."""
    active = _state.status == "active" and _entry.native
    if _settings.current.native == "off":
        reason = "off (Config.native='off')"
    elif _state.status == "untried":
        built, where = build_status()
        if built:
            reason = f"not loaded yet: {where}; loads at the first CUDA call"
        else:
            reason = (f"not loaded yet: {where}; the first CUDA call builds it (about 1-2 minutes) and loads it, "
                      "or cudnorm build builds it ahead")
    elif _state.status == "active" and not active:
        reason = "paused (cuDNN disabled or specs being recorded)"
    else:
        reason = _state.reason
    return {"active": active, "state": f"active ({_state.library})" if active else reason, "library": _state.library,
            "build_seconds": _state.build_seconds, "build": build_status()[1]}


# ---------------------------------------------------------------- building and loading

def _nvidia_dirs() -> list[Path]:
    """The directories of the ``nvidia`` namespace package (the CUDA/cuDNN wheels)."""
    try:
        import nvidia  # noqa: PLC0415 - only the wheels' location is wanted
    except ImportError:
        return []
    return [Path(p) for p in getattr(nvidia, "__path__", [])]


def _loaded_library(prefix: str) -> Path | None:
    """The file of a shared library this process has loaded (torch loads cuDNN and the CUDA
    runtime): the headers to compile against are the ones beside the library that runs."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if Path(path).name.startswith(prefix):
            return Path(path)
    return None


def _first(candidates, relative: str) -> Path | None:
    """The first directory of ``candidates`` that holds ``relative``."""
    for directory in candidates:
        if directory is not None and (Path(directory) / relative).exists():
            return Path(directory)
    return None


def _toolchain() -> dict:
    """Include directories and linker flags for ``cudnorm/csrc``, or :class:`Unavailable`."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - heavy (setuptools); only when building

    cuda = (torch.version.cuda or "").split(".")[0]
    if not cuda:
        raise Unavailable("this torch is not a CUDA build", "install a CUDA build of torch")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise Unavailable(f"no C++ compiler ({cxx!r} not found)", "install g++ (e.g. apt install g++) or set CXX")
    if not cpp_extension.is_ninja_available():
        raise Unavailable("ninja is not installed", "pip install ninja")
    try:
        frontend = importlib.metadata.distribution("nvidia-cudnn-frontend").locate_file("include")
    except importlib.metadata.PackageNotFoundError:
        frontend = None
    if frontend is None or not (Path(frontend) / "cudnn_frontend.h").exists():
        raise Unavailable("the cuDNN frontend's C++ headers were not found", "pip install nvidia-cudnn-frontend")
    wheels = _nvidia_dirs()
    loaded = _loaded_library("libcudnn.so")
    cudnn_roots = ([loaded.parent.parent] if loaded else []) + [d / "cudnn" for d in wheels]
    cudnn = _first(cudnn_roots, "include/cudnn.h")
    if cudnn is None:
        raise Unavailable("cuDNN's headers were not found", f"pip install nvidia-cudnn-cu{cuda} (the cuDNN torch uses)")
    home = Path(cpp_extension.CUDA_HOME) if cpp_extension.CUDA_HOME else None
    cuda_includes = [d for d in [home / "include" if home else None,
                                 *(d / f"cu{cuda}" / "include" for d in wheels),
                                 *(d / sub / "include" for d in wheels for sub in ("cuda_runtime", "cuda_nvrtc",
                                                                                   "cuda_cccl", "cuda_crt"))]
                     if d is not None and d.is_dir()]
    # CUDA 13 keeps libcu++'s <nv/target> (which cuda_fp16.h includes) under include/cccl
    cuda_includes += [d / "cccl" for d in cuda_includes if (d / "cccl").is_dir()]
    for header in ("cuda_runtime_api.h", "crt/host_defines.h", "nv/target", "nvrtc.h"):
        if _first(cuda_includes, header) is None:
            raise Unavailable(f"the CUDA header {header} was not found",
                              "install the CUDA toolkit (and set CUDA_HOME) or pip install "
                              f"nvidia-cuda-runtime nvidia-cuda-nvrtc nvidia-cuda-cccl nvidia-cuda-crt for CUDA {cuda}")
    lib_dirs = [loaded.parent if loaded else None, *(d / "cudnn" / "lib" for d in wheels),
                *(d / f"cu{cuda}" / "lib" for d in wheels), *(d / "cuda_runtime" / "lib" for d in wheels),
                *(d / "cuda_nvrtc" / "lib" for d in wheels),
                home / "lib64" if home else None, home / "lib" if home else None]
    cudart = _loaded_library("libcudart.so")
    ldflags = []
    for name, known in ((f"libcudnn.so.{torch.backends.cudnn.version() // 10000}", loaded),
                        (f"libcudart.so.{cuda}", cudart), (f"libnvrtc.so.{cuda}", None)):
        directory = known.parent if known is not None and known.name.startswith(name) else _first(lib_dirs, name)
        if directory is None:
            raise Unavailable(f"{name} was not found", f"install the CUDA {cuda} runtime wheels torch depends on")
        ldflags += [f"-L{directory}", f"-l:{name}", f"-Wl,-rpath,{directory}"]
    return {"include": [str(frontend), str(cudnn / "include"), *map(str, cuda_includes)],
            "ldflags": ["-lc10_cuda", "-ltorch_cuda", *ldflags], "cxx": cxx}


def _sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def _versions() -> dict[str, str]:
    """The versions a build is made for (no CUDA call: cuDNN's version is the library's)."""
    try:
        frontend = importlib.metadata.version("nvidia-cudnn-frontend")
    except importlib.metadata.PackageNotFoundError:
        frontend = "none"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "none"
    return {"torch": torch.__version__, "cudnn": str(cudnn), "frontend": frontend}


def build_directory() -> Path:
    """Where this torch/CUDA/cuDNN/frontend and these sources build (``Config.native_dir``)."""
    root = _settings.current.native_dir
    if root is None:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "cudnorm", "native")
    digest = hashlib.sha256(repr((CFLAGS, LDFLAGS)).encode())
    for path in [*_sources(), CSRC / "native.h"]:
        digest.update(path.name.encode() + path.read_bytes())
    v = _versions()
    name = (f"torch{v['torch']}-cudnn{v['cudnn']}-fe{v['frontend']}-{sys.implementation.cache_tag}-"
            f"{digest.hexdigest()[:12]}").replace("+", "_")
    return Path(os.path.expanduser(root)) / name


def build_status() -> tuple[bool, str]:
    """``(built, description)`` of the build cache for this process, read from the files alone
    (nothing is loaded, CUDA is not touched): built for these versions and sources (where), built
    only for others (which: the directories' names), not built, or not buildable with this torch
    (a CPU build)."""
    directory = build_directory()
    v = _versions()
    these = f"torch {v['torch']}, cuDNN {v['cudnn']}, frontend {v['frontend']}"
    if (directory / f"{LIBRARY_NAME}.so").is_file():
        return True, f"built for {these} in {directory}"
    others = sorted(path.parent.name for path in directory.parent.glob(f"*/{LIBRARY_NAME}.so"))
    if others:
        return False, (f"not built for {these} and these sources, built only for others in {directory.parent} "
                       f"({', '.join(others)})")
    if not torch.version.cuda:  # what cudnorm build answers (_toolchain), without probing the rest
        return False, "cannot be built here: this torch is not a CUDA build (install a CUDA build of torch)"
    return False, f"not built yet (none in {directory.parent})"


class _Ticker:
    """A progress line on stderr while a build runs: elapsed seconds every few seconds."""

    def __init__(self, message: str, every: float = 15.0) -> None:
        self.message, self.every = message, every
        self._done = threading.Event()
        self._start = time.perf_counter()

    def __enter__(self):
        print(f"cudnorm: {self.message}", file=sys.stderr, flush=True)
        threading.Thread(target=self._tick, daemon=True).start()
        return self

    def _tick(self) -> None:
        while not self._done.wait(self.every):
            print(f"cudnorm:   ... {time.perf_counter() - self._start:.0f} s", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        self._done.set()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._start


def _import(library: Path):
    """Load the built library as the Python module it is (its static initialisers register
    the ops with the dispatcher)."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location(LIBRARY_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(verbose: bool = False) -> Path:
    """Compile ``cudnorm/csrc`` (unless this build directory has it already) and load it;
    returns the library's path. :class:`Unavailable` when it cannot be built here."""
    from torch.utils import cpp_extension  # noqa: PLC0415

    directory = build_directory()
    library = directory / f"{LIBRARY_NAME}.so"
    _define_callbacks()  # the ops the library calls back: defined before it can call them
    if library.exists() and not verbose:
        # built before for these sources and this torch/cuDNN/frontend/Python (the directory's
        # name): loading it skips cpp_extension's import and ninja's check (~0.5 s)
        try:
            _state.module = _import(library)
            return library
        except ImportError:
            pass  # unloadable (a partial copy, another machine's libraries): build again
    tools = _toolchain()
    directory.mkdir(parents=True, exist_ok=True)
    ticker = None if verbose else _Ticker(f"building the native launch path into {directory} (once per machine "
                                          "and version; about 1-2 minutes)")
    try:
        if ticker:
            ticker.__enter__()
        _state.module = cpp_extension.load(
            name=LIBRARY_NAME, sources=[str(p) for p in _sources()], extra_include_paths=tools["include"],
            extra_cflags=list(CFLAGS), extra_ldflags=[*tools["ldflags"], *LDFLAGS], build_directory=str(directory),
            with_cuda=False, is_python_module=True, verbose=verbose)
    except Unavailable:
        raise
    except Exception as exc:  # a compile or load error: its first lines say what went wrong
        lines = [line for line in str(exc).splitlines() if "error" in line.lower()] or str(exc).splitlines()
        raise Unavailable(f"building {CSRC} failed ({' | '.join(lines[:3])[:400]})",
                          f"see the log in {directory}, or run cudnorm build --verbose") from exc
    finally:
        if ticker:
            ticker.__exit__(None, None, None)
    if ticker:
        _state.build_seconds = ticker.seconds
        print(f"cudnorm: native launch path built in {ticker.seconds:.0f} s", file=sys.stderr, flush=True)
    return library


def activate() -> bool:
    """Make the native path serve calls (building it once if needed); whether it does.
    Tried once per process; after a failure the Python launch path serves, with one warning."""
    with _lock:
        if _state.status != "untried":
            return _entry.native
        if _settings.current.native == "off":
            _entry.pending = False
            return False
        try:
            if not _runtime.cudnn_status().available:
                raise Unavailable(f"cuDNN is not available ({_runtime.cudnn_status().reason})",
                                  "install nvidia-cudnn-frontend and a CUDA build of torch")
            _state.library = str(build())
        except Unavailable as exc:
            _state.status, _state.reason = "unavailable", exc.reason
            _entry.pending = False
            _warn.warn(f"cudnorm: the native launch path is not available ({exc.reason}); the Python launch "
                       f"path serves, at about 2-3x the host time per call. Fix: {exc.fix}. Silence: "
                       "cudnorm.config(native='off')", RuntimeWarning)
            return False
        _state.status, _state.reason = "active", ""
        _entry.pending = False
        _settings.on_change(lambda old, new: _sync())
        _cache.plans.on_evict(forget)
        _rows.on_reset(forget)
        _recording.listeners.append(_sync)
        _decisions.DECIDED.on_evict(forget)
        _sync()
        return _entry.native


def _sync() -> None:
    """Push the configuration to C++ and point the entry points at the path that serves now:
    Python's while cuDNN is disabled, the native path is off or specs are being recorded."""
    if _state.status != "active":
        return
    current = _settings.current
    serve = current.native != "off" and not current.disable_cudnn and not _recording.blocks
    native = torch.ops.cudnorm_native
    if _recording.blocks:  # every signature resolves in Python while specs are recorded, as the block opens
        native.clear()
    native.configure(serve, *policy_arguments(current.policy), config_id(current))
    module = _state.module
    _entry.layer_norm, _entry.rms_norm = module.layer_norm, module.rms_norm
    _entry.add_layer_norm, _entry.add_rms_norm = module.add_layer_norm, module.add_rms_norm
    _entry.ada_layer_norm = module.ada_layer_norm
    _entry.affine_fold = module.affine_fold
    _entry.token_ada_norm, _entry.token_ada_kernel = module.token_ada_norm, module.token_ada_kernel
    _entry.ada_rms_kernel, _entry.gated_kernel = module.ada_rms_kernel, module.gated_kernel
    _entry.gated_ada_layer_norm, _entry.modulated_layer_norm = module.gated_ada_layer_norm, module.modulated_layer_norm
    _entry.native = serve
    _triton_launch.native = module.launch if serve else None  # Python's kernel launches through C++


# configuration -> its number in the C++ tables' keys. Numbers are never reused: a configuration
# that left this cache and comes back gets a new one (its old recipes are unreachable, and go
# when the C++ table next starts over)
_CONFIG_IDS = _lru.LRU("native_configs", 64)
_next_config_id = itertools.count(1)


def config_id(config: _settings.Config) -> int:
    """The number of ``config`` in the C++ recipe and decision keys: the same for equal
    configurations while this process keeps it, so switching back to one finds its recipes (a
    recipe depends on the whole configuration: policy, autotune, row bucketing, ...)."""
    found = _CONFIG_IDS.get(config)
    if found is None:
        found = next(_next_config_id)
        _CONFIG_IDS.put(config, found)
    return found


def policy_arguments(policy: str) -> tuple[bool, int, bool]:
    """``(policy_auto, cudnn_min_elements, measured)`` for C++'s ``configure``: under ``"auto"``
    same-dtype calls below the threshold run PyTorch's op and larger ones take the measured
    decision of their signature (:mod:`cudnorm._decisions`); under ``"torch"`` every same-dtype
    call runs PyTorch's op (a threshold no tensor reaches); under ``"cudnn"`` none does."""
    if policy == "cudnn":
        return False, 0, False
    return (True, _policy_min_elements(), True) if policy == "auto" else (True, 1 << 62, False)


def _policy_min_elements() -> int:
    from . import _policy  # noqa: PLC0415

    return _policy.NATIVE_CUDNN_MIN_ELEMENTS


def forget() -> None:
    """Empty the C++ recipe and decision tables (plans were evicted, decisions forgotten or the
    caches cleared)."""
    if _state.status == "active":
        torch.ops.cudnorm_native.clear()


def counters() -> dict:
    """The C++ tables: calls served from a known recipe, signatures resolved by Python,
    recipes and plans held."""
    if _state.status != "active":
        return {}
    hits, misses, recipes, plans = torch.ops.cudnorm_native.counters()
    return {"hits": hits, "resolved": misses, "recipes": recipes, "plans": plans}


# ---------------------------------------------------------------- plans

_plan_lock = threading.Lock()


def plan_id(plan: _graphs.Plan) -> int:
    """``plan``'s id in the C++ table, adding it (deserialized from its serialized form) the
    first time; removed from the table when the Python plan is freed (evicted)."""
    with _plan_lock:
        if plan.native_id is None:
            blob = _graphs.serialize_plan(plan)
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            plan.native_id = int(torch.ops.cudnorm_native.add_plan(data, plan.spec.device_index, len(plan.uids)))
            plan.blob = None  # C++ holds its own copy; the plan store wrote its own when the plan was built
            weakref.finalize(plan, _drop, plan.native_id)
        return plan.native_id


def _drop(native_id: int) -> None:
    try:
        torch.ops.cudnorm_native.drop_plan(native_id)
    except Exception:  # interpreter shutdown: the library may already be gone
        pass


def execute_floor_us(plan: _graphs.Plan, reps: int = 200) -> float:
    """Host us per execute of ``plan`` in a C++ loop on dummy buffers: the floor of any launch
    path (what cuDNN's execute itself costs), for ``cudnorm bench --host-overhead``."""
    buffers = _graphs.dummy_buffers(plan.spec)
    return float(torch.ops.cudnorm_native.execute_floor_us(plan_id(plan), [b.data_ptr() for b in buffers], reps))


# ---------------------------------------------------------------- recipes

def _recipe(mode: int, param_dtype: torch.dtype = torch.float32, *, fused: bool = False, overlap: int = 0,
            launches=(), cacheable: bool = True, kernel: tuple[int, ...] = ()) -> list[int]:
    """The int list C++ parses (recipes.cpp): cacheable, mode, param dtype, fused add, overlap,
    launch count, then (plan id, first row, rows) per launch; a ``KERNEL`` recipe ends with its
    kernel's launch (:func:`cudnorm._ada_kernel.native_launch`)."""
    out = [int(cacheable), mode, _CODES[param_dtype], int(fused), overlap, len(launches)]
    for plan, start, rows in launches:
        out += [plan_id(plan), start, rows]
    return out + list(kernel)


def _stable_rows() -> bool:
    """Whether what :mod:`cudnorm._rows` answers for a row count no longer changes with later
    calls: with ``exact_after`` above 1 a count may be promoted to exact graphs later, so its
    calls keep asking Python until then."""
    return _settings.current.exact_after <= 1


def _plan_recipe(found, param_dtype: torch.dtype, *, fused: bool = False) -> list[int] | None:
    """The recipe of an exact plan or a chunked one; ``None`` when there is no plan."""
    if found is None:
        return None
    if isinstance(found, _graphs.Plan):
        return _recipe(SINGLE, param_dtype, fused=fused, launches=[(found, 0, found.spec.rows)])
    return _recipe(CHUNKED, param_dtype, fused=fused, overlap=found.overlap,
                   launches=[(found.plans[size], start, size) for start, size in found.chunks],
                   cacheable=_stable_rows())


def _rows_plan(op: str, phase: str, rows, scale_dtype: torch.dtype, device_index: int, *, offset: bool = False,
               residual: bool = False):
    """The exact or chunked plan (or ``None``) of ``rows``' layout: what
    :func:`cudnorm._call_plans.rows_plan` finds, for rows already in a layout cuDNN reads
    (``rows`` may be a meta tensor of that layout)."""
    spec = _dispatch.spec_for(op, phase, rows, scale_dtype, device_index, offset=offset, residual=residual)
    return _rows.plan_or_chunks(spec)


def _meta(code: int, shape) -> torch.Tensor | None:
    return None if code < 0 else torch.empty(shape, dtype=_DTYPES[code], device="meta")


def _resolve_norm_forward(x: torch.Tensor, ints, floats) -> list[int]:
    rms, training, add, weight_code, bias_code = ints
    offset = floats[0]
    op = _norm.RMS_NORM if rms else _norm.LAYER_NORM
    n = x.shape[1]
    _, _, param_dtype = _dispatch.forward_params(torch.empty((0, n), dtype=x.dtype, device="meta"),
                                                 _meta(weight_code, (n,)), _meta(bias_code, (n,)), has_bias=not rms)
    if offset and offset not in op.cudnn_offsets:
        return _recipe(PYTHON)
    phase = "train" if training else "infer"
    if add:  # cudnorm._fused_add._cudnn_forward: the fused graph, or PyTorch's add then the plain graph
        fused = n <= _fused_add.FUSED_FORWARD_MAX_COLS[op.name]
        rows = x if fused else torch.empty(x.shape, dtype=x.dtype, device="meta")
        found = _rows_plan(op.name, phase, rows, param_dtype, x.device.index, offset=bool(offset), residual=fused)
        return _plan_recipe(found, param_dtype, fused=fused) or _recipe(PYTHON, cacheable=_stable_rows())
    aten = not offset and op.native is not None  # PyTorch's fused kernel can serve (cudnorm._norm.kernel_forward)
    if _dispatch.native_forward(x):
        return _recipe(ATEN, param_dtype) if aten else _recipe(PYTHON)
    found = _rows_plan(op.name, phase, x, param_dtype, x.device.index, offset=bool(offset))
    return _plan_recipe(found, param_dtype) or _recipe(ATEN if aten else PYTHON, param_dtype,
                                                       cacheable=_stable_rows())


def _resolve_norm_backward(x: torch.Tensor, ints, floats) -> list[int]:
    rms, weight_code = ints
    offset = floats[0]
    op = _norm.RMS_NORM if rms else _norm.LAYER_NORM
    if offset and offset not in op.cudnn_offsets:
        return _recipe(PYTHON)
    scale_dtype = _DTYPES.get(weight_code, torch.float32)  # _dispatch.backward_scale_dtype
    found = _rows_plan(op.name, "bwd", x, scale_dtype, x.device.index, offset=bool(offset))
    return _plan_recipe(found, scale_dtype) or _recipe(PYTHON, cacheable=_stable_rows())


def _resolve_ada_forward(x2: torch.Tensor, ints, floats) -> list[int]:
    training, b, scale_code, shift_code, _dit = ints
    rows, d = x2.shape
    dtype = _ada_strategies.forward_dtype(x2, _meta(scale_code, (b, d)), _meta(shift_code, (b, d)))
    for name in _ada_strategies.FORWARD_ORDER[_ada_strategies.forward_strategy(b, rows // b, d, x2.dtype)]:
        strategy = _ada_strategies.FORWARDS[name]
        plan = _ada_strategies.plan_for(strategy.spec(x2, b, dtype, bool(training), x2.device.index))
        if plan is not None:
            return _recipe(SINGLE if name == "cudnn" else PER_SAMPLE, dtype, launches=[(plan, 0, plan.spec.rows)])
    return _recipe(PYTHON)


def _resolve_ada_backward(x2: torch.Tensor, ints, floats) -> list[int]:
    b, scale_code, _dit = ints
    rows, d = x2.shape
    scale_dtype = _DTYPES[scale_code]
    for name in _ada_strategies.BACKWARD_ORDER[_ada_strategies.backward_strategy(b, rows // b, d, x2.dtype)]:
        strategy = _ada_strategies.BACKWARDS[name]
        plan = _ada_strategies.plan_for(strategy.spec(x2, b, scale_dtype, x2.device.index))
        if isinstance(plan, _ada_strategies.KernelSpec):  # cudnorm's own kernel, launched by C++ where it can
            kernel = _ada_kernel.native_launch(x2, b, scale_dtype, bool(_dit))
            # no grid of its own: C++ launches chunks per sample (programs and tiles unused)
            return _recipe(PYTHON) if kernel is None else _recipe(KERNEL, scale_dtype, kernel=(*kernel, 0, 0))
        if plan is not None:
            return _recipe(SINGLE if name == "cudnn" else PER_SAMPLE, scale_dtype,
                           launches=[(plan, 0, plan.spec.rows)])
    return _recipe(PYTHON)


def _resolve_kernel_forward(x: torch.Tensor, ints, floats) -> list[int]:
    rms, training, weight_code, bias_code = ints
    kernel = _norm_kernel.native_launch(x, bool(rms), bool(training), _DTYPES.get(weight_code),
                                        _DTYPES.get(bias_code))
    return _recipe(PYTHON) if kernel is None else _recipe(KERNEL, kernel=kernel)


def _resolve_kernel_backward(x: torch.Tensor, ints, floats) -> list[int]:
    rms, weight_code, bias_code = ints
    kernel = _norm_kernel.native_launch(x, bool(rms), True, _DTYPES.get(weight_code), _DTYPES.get(bias_code),
                                        backward=True)
    return _recipe(PYTHON) if kernel is None else _recipe(KERNEL, kernel=kernel)


def _resolve_modulated_forward(x: torch.Tensor, ints, floats) -> list[int]:
    rms, training, one_plus, scale_code, shift_code, scale_stride, shift_stride = ints
    scale_dtype, shift_dtype = _DTYPES[scale_code], _DTYPES.get(shift_code)
    if not _token_ada.supports(x.shape[1], x.dtype, scale_dtype, shift_dtype):
        return _recipe(ATEN)  # the formula's ops (or Python's implementation) serve it (csrc/entry.cpp)
    kernel = _norm_kernel.native_launch(x, bool(rms), bool(training), scale_dtype, shift_dtype,
                                        per_token=(bool(one_plus), scale_stride, shift_stride))
    return _recipe(PYTHON) if kernel is None else _recipe(KERNEL, kernel=kernel)


def _resolve_token_backward(x: torch.Tensor, ints, floats) -> list[int]:
    rms, one_plus, scale_code, scale_stride = ints
    kernel = _token_ada.native_launch(x, _DTYPES[scale_code], bool(rms), bool(one_plus), scale_stride)
    return _recipe(PYTHON) if kernel is None else _recipe(KERNEL, kernel=kernel)


def _resolve_ada_rms_backward(x2: torch.Tensor, ints, floats) -> list[int]:
    b, scale_code, one_plus = ints
    scale_dtype = _DTYPES[scale_code]
    kernel = _ada_kernel.native_launch(x2, b, scale_dtype, bool(one_plus), rms=True) if _ada_kernel.available(
        x2, scale_dtype) else None
    # no grid of its own: C++ launches chunks per sample (programs and tiles unused)
    return _recipe(PYTHON) if kernel is None else _recipe(KERNEL, scale_dtype, kernel=(*kernel, 0, 0))


def _resolve_gated_backward(h2: torch.Tensor, ints, floats) -> list[int]:
    b, has_dh, one_plus, scale_code = ints
    dtype = _DTYPES[scale_code]
    kernel = _ada_kernel.gated_native_launch(h2, b, dtype, bool(one_plus), bool(has_dh)) if _ada_kernel.available(
        h2, dtype) else None
    # no grid of its own: C++ launches chunks per sample (programs and tiles unused)
    return _recipe(PYTHON) if kernel is None else _recipe(KERNEL, dtype, kernel=(*kernel, 0, 0))


def _serve(op: str, input: torch.Tensor, cols: int, weight, bias, training: bool) -> list[int]:
    """``[server, kept]`` for a call signature C++'s decision table lacks (decisions.cpp):
    :func:`cudnorm._decisions.server`'s answer, and whether C++ may keep it."""
    choice, kept = _decisions.server_kept(op, input, cols, weight, bias, training)
    return [_entry.SERVERS[choice], int(kept)]


_RESOLVERS = {"norm_fwd": _resolve_norm_forward, "norm_bwd": _resolve_norm_backward,
              "ada_fwd": _resolve_ada_forward, "ada_bwd": _resolve_ada_backward,
              "kernel_fwd": _resolve_kernel_forward, "kernel_bwd": _resolve_kernel_backward,
              "mod_fwd": _resolve_modulated_forward, "token_bwd": _resolve_token_backward,
              "ada_rms_bwd": _resolve_ada_rms_backward, "gated_bwd": _resolve_gated_backward}


def resolve(kind: str, x: torch.Tensor, ints: list[int], floats: list[float]) -> list[int]:
    """The recipe of a call signature C++ has not seen (recipes.cpp). ``x`` is the call's
    ``[rows, cols]`` input in a layout cuDNN reads; ``ints``/``floats`` the rest of the
    signature (norm.cpp, ada.cpp). May build plans (or load them from the store)."""
    return _RESOLVERS[kind](x, list(ints), list(floats))


# ---------------------------------------------------------------- the Python fallbacks C++ calls

def _empty(like: torch.Tensor) -> torch.Tensor:
    """A placeholder for an absent output (an op's ``Tensor[]`` cannot hold None)."""
    return like.new_empty(0)


def _kernel(name: str, tensors: list, scalars: list[float]) -> list[torch.Tensor]:
    """cudnorm's Python implementation of an op, below autograd: what a recipe in mode
    ``PYTHON`` runs, and every kernel while the native path is paused."""
    if name == "norm_fwd":
        x, residual, weight, bias = tensors
        eps, training, rms, offset = scalars
        if residual is None:
            y, stats = _fused_add._IMPLS[bool(rms)].forward(x, weight, None if rms else bias, eps, bool(training),
                                                             offset)
            return [y, _empty(x), stats]
        return list(_fused_add.forward(x, residual, weight, bias, eps, bool(training), bool(rms), offset))
    if name == "norm_bwd":
        dy, x, weight, stats = tensors
        rms, offset = scalars
        dx, dw, db = _fused_add._IMPLS[bool(rms)].backward(dy, x, weight, stats, offset)
        return [dx, dw, _empty(x) if db is None else db]
    if name == "ada_fwd":
        x, scale, shift = tensors
        eps, dit, training = scalars
        return list(_ada._forward(x, scale, shift, eps, bool(dit), bool(training)))
    if name == "ada_bwd":
        dy, x, scale, stats = tensors
        dit, shift_code = scalars
        return list(_ada._backward_impl(dy, x, scale, stats, bool(dit), _DTYPES[int(shift_code)]))
    if name == "kernel_fwd":  # cudnorm's own kernel where C++ cannot launch it (csrc/kernel.cpp)
        x, weight, bias = tensors
        eps, training, rms = scalars
        y, stats = _norm_kernel.forward(x.contiguous(), weight, bias, eps, bool(rms), bool(training))
        return [y, _empty(x) if stats is None else stats[0] if rms else stats]
    if name == "kernel_bwd":
        dy, x, weight, stats = tensors
        rms, bias_code = scalars
        dx, dw, db = _norm_kernel.backward(dy, x.contiguous(), weight, stats.view(-1, x.shape[0]) if rms else stats,
                                           bool(rms), _DTYPES.get(int(bias_code)))
        return [dx, _empty(x) if dw is None else dw, _empty(x) if db is None else db]
    if name == "mod_fwd":  # a norm modulated per token or per sample where C++ cannot launch the kernel
        x, scale, shift = tensors
        eps, one_plus, rms, training, seq = scalars
        y, stats = _norm_kernel.forward(x.contiguous(), scale, shift, eps, bool(rms), bool(training), seq=int(seq),
                                        one_plus=bool(one_plus))
        return [y, _empty(x) if stats is None else stats[0] if rms else stats]
    if name == "token_bwd":
        dy, x, scale, stats = tensors
        one_plus, rms = scalars
        return list(_token_ada.backward(dy.contiguous(), x.contiguous(), scale,
                                        stats.view(-1, x.shape[0]) if rms else stats, bool(rms), bool(one_plus)))
    if name == "ada_rms_bwd":
        dy, x, scale, rstd = tensors
        one_plus, shift_code = scalars
        dx, dscale, dshift = _ada_rms.backward(dy, x.contiguous(), scale, rstd, bool(one_plus),
                                               _DTYPES.get(int(shift_code)))
        return [dx, dscale, _empty(x) if dshift is None else dshift]
    if name == "gated_bwd":  # the gated residual's backward where C++ cannot launch the kernel
        dy, dh, h, branch, gate, scale, stats = tensors
        b, d = gate.shape
        rows = h.numel() // d
        return list(_ada_kernel.gated_backward(dy.reshape(rows, d).contiguous(), h.reshape(rows, d), b, scale, stats,
                                               bool(scalars[0]),
                                               None if dh is None else dh.reshape(rows, d).contiguous(),
                                               branch.reshape(rows, d).contiguous(), gate))
    raise ValueError(f"cudnorm: no Python kernel {name!r}")


def _composite(name: str, tensors: list, scalars: list[float], shape) -> list[torch.Tensor]:
    """cudnorm's Python implementation of a public call or of a differentiable backward,
    above autograd: every call the native entry points do not serve themselves (CPU, DTensor,
    traced, float64, empty or malformed arguments), and gradients with create_graph=True."""
    shape = tuple(shape)
    if name == "layer_norm":
        x, weight, bias = tensors
        return [_layer_norm.python_layer_norm(x, shape, weight, bias, scalars[0])]
    if name == "add_layer_norm":
        x, residual, weight, bias = tensors
        return list(_layer_norm.python_layer_norm(x, shape, weight, bias, scalars[0], residual))
    if name in ("rms_norm", "add_rms_norm"):
        x, *residual, weight = tensors
        has_eps, eps, offset = scalars
        out = _rms_norm.python_rms_norm(x, shape, weight, eps if has_eps else None, offset, *residual)
        return list(out) if residual else [out]
    if name == "ada_layer_norm":
        x, scale, shift = tensors
        eps, dit = scalars
        return [_ada.python_ada_layer_norm(x, scale, shift, eps, bool(dit))]
    if name == "token_ada_norm":
        x, scale, shift = tensors
        eps, one_plus, rms = scalars
        return [_token_entry.python_call(x, scale, shift, eps, bool(one_plus), bool(rms))]
    if name == "token_ada_grad":
        dy, x, scale = tensors
        eps, rms, one_plus, shift_code = scalars
        dx, dscale, dshift = _token_ada.differentiable_backward(dy, x, scale, eps, bool(rms), bool(one_plus),
                                                               _DTYPES.get(int(shift_code)))
        return [dx, dscale, _empty(x) if dshift is None else dshift]
    if name == "ada_rms_grad":
        dy, x, scale = tensors
        eps, _rms, one_plus, shift_code = scalars
        dx, dscale, dshift = _ada_rms.differentiable_backward(dy, x, scale, eps, bool(one_plus),
                                                              _DTYPES.get(int(shift_code)))
        return [dx, dscale, _empty(x) if dshift is None else dshift]
    if name == "gated_grad":
        dy, dh, h, branch, gate, scale = tensors
        eps, one_plus = scalars
        return list(_gated.differentiable_backward(dy, dh, h, branch, gate, scale, eps, bool(one_plus)))
    if name in ("layer_norm_grad", "rms_norm_grad"):
        dy, x, weight = tensors
        eps, offset = scalars
        dx, dw, db = _fused_add._IMPLS[name == "rms_norm_grad"].differentiable_backward(dy, x, weight, eps, offset)
        return [dx, _empty(x) if dw is None else dw, _empty(x) if db is None else db]
    if name == "add_norm_grad":
        dy, dh, h, weight = tensors
        eps, rms, offset = scalars
        ctx = SimpleNamespace(eps=eps, rms=bool(rms), offset=offset)
        dx, dw, db = _fused_add._differentiable_backward(dy, dh, h, weight, ctx)
        return [dx, _empty(h) if dw is None else dw, db]
    if name == "ada_layer_norm_grad":
        dy, x, scale = tensors
        eps, dit, shift_code = scalars
        return list(_ada._differentiable_backward(dy, x, scale, eps, bool(dit), _DTYPES[int(shift_code)]))
    raise ValueError(f"cudnorm: no Python implementation {name!r}")


_callbacks_defined = False
# the first CUDA call of a public function tries the native path; cudnorm info reports it
_entry.activate, _entry.status, _entry.counters = activate, status, counters


def _define_callbacks() -> None:
    """Define the ops C++ calls back (once): ``cudnorm::_resolve_py``, ``_kernel_py``
    (below autograd) and ``_composite_py`` (above it: PyTorch's autograd records it)."""
    global _callbacks_defined
    if _callbacks_defined:
        return
    lib = _ops.LIBRARY
    lib.define("_resolve_py(str kind, Tensor x, int[] ints, float[] floats) -> int[]")
    lib.impl("_resolve_py", resolve, "CompositeExplicitAutograd")
    lib.define("_serve_py(str op, Tensor input, int cols, Tensor? weight, Tensor? bias, bool training) -> int[]")
    lib.impl("_serve_py", _serve, "CompositeExplicitAutograd")
    lib.define("_kernel_py(str name, Tensor?[] tensors, float[] scalars) -> Tensor[]")
    lib.impl("_kernel_py", _kernel, "CompositeExplicitAutograd")
    lib.define("_composite_py(str name, Tensor?[] tensors, float[] scalars, SymInt[] shape) -> Tensor[]")
    lib.impl("_composite_py", _composite, "CompositeImplicitAutograd")
    _callbacks_defined = True
