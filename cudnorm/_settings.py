"""The configuration: :class:`Config` (every option, its type and default, and the
environment variable that seeds it), the process-wide current one, and :func:`config`,
which changes it from now on or for a ``with`` block.

The environment only seeds the configuration, once, when cudnorm is imported. A malformed
value never breaks the import: it warns once, naming the variable, the value, what it must be
and the default used instead. After the import, :func:`config` is the only way to change an
option (changing ``os.environ`` has no effect).

Library code reads ``_settings.current.<option>`` on every call: a module attribute and a
field, where reading the environment would cost microseconds per op. A change swaps
``current`` in one reference assignment, then calls the functions that state sized or
placed by the configuration registered with :func:`on_change` (the plan cache's capacity,
the plan store). Equal configurations are one object: the memos keyed on ``current``'s
identity (``_runtime.route``, ``_rows``, ``_call_plans``) survive a change that leaves every
option as it was, such as a block setting what is already set (``torch.compile`` guards on
the values of the options it reads, not on the object).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from . import _warn

_STRATEGIES = ("auto", "cudnn", "per_sample", "torch")
_BACKWARD_STRATEGIES = ("auto", "fused", "cudnn", "per_sample", "torch")


@dataclass(frozen=True)
class Config:
    """cudnorm's process-wide configuration: read it with :func:`get_config`, change it with
    :func:`config`. ``Config()`` holds the defaults below; the configuration cudnorm starts
    with is seeded from the environment variable named in brackets after each option.

    Attributes:
        policy: ``"auto"``: PyTorch's own ops serve CUDA calls where they make models faster
            (eager calls under 2^16 elements, 2^24 on the Python launch path, calls traced by
            ``torch.compile``, and every call signature where PyTorch's op measured faster: see
            ``cudnorm._policy``); ``"cudnn"``: cuDNN serves every call it can;
            ``"torch"``: PyTorch's ops serve every call whose weights have the input's dtype, behind
            cudnorm's functions and modules (the control that measures what those cost a model
            step). [``CUDNORM_POLICY``]
        autotune: ``"auto"``: time candidate plans for large LayerNorm/RMSNorm forwards;
            ``"on"``: for every new graph; ``"off"``: never (the heuristics' first plan).
            [``CUDNORM_AUTOTUNE``: also ``1``/``true``/``yes``/``always`` and
            ``0``/``false``/``no``/``never``]
        autotune_candidates: how many of the heuristics' candidate plans autotuning times
            (integer >= 1), or ``"all"`` (25-28 for LN/RMS forwards, 16-39 s per graph at
            32768 x 8192..32768 on an H200). [``CUDNORM_AUTOTUNE_CANDIDATES``]
        fp32_weight_fwd: changes the numbers computed. ``"round"``: fp32 weights of a
            half-precision input are rounded to its dtype for the forward; ``"native"``: the
            forward reads them in fp32 (cuDNN 9.19's slower generic engine).
            [``CUDNORM_FP32_WEIGHT_FWD``]
        cache_size: plans kept in memory (integer >= 1); changing it resizes the cache,
            evicting least recently used plans. [``CUDNORM_CACHE_SIZE``]
        exact_rows: row counts per norm family that may get their own graphs (integer >= 0);
            other counts run on shared row-chunk graphs (``cudnorm._rows``).
            [``CUDNORM_EXACT_ROWS``]
        exact_after: calls at one row count before it gets its own graphs (integer >= 1).
            [``CUDNORM_EXACT_AFTER``]
        ada_forward: the AdaLN forward strategy: ``"auto"`` (the rule table in
            ``cudnorm.ada_layer_norm``), ``"cudnn"``, ``"per_sample"`` or ``"torch"``.
            [``CUDNORM_ADA_FWD``]
        ada_backward: the AdaLN backward strategy, the same values or ``"fused"`` (one
            Triton kernel for any batch, ``cudnorm._ada_kernel``). [``CUDNORM_ADA_BWD``]
        raw_execute: launch plans through the frontend's raw-pointer execute where that
            frontend version was verified for it (``cudnorm._graphs``); ``False``: always
            the public ``execute``. [``CUDNORM_RAW_EXECUTE``: ``1``/``0`` and synonyms]
        plan_store: whether built plans are saved to and loaded from the on-disk store.
            [``CUDNORM_PLAN_STORE``: ``1``/``0`` and synonyms]
        plan_store_dir: the store's directory; ``None``: ``$XDG_CACHE_HOME/cudnorm/plans``,
            else ``~/.cache/cudnorm/plans``. [``CUDNORM_PLAN_STORE_DIR``]
        plan_store_max_mb: the store's size bound in MB (a finite number >= 0; least recently
            used entries are removed first). [``CUDNORM_PLAN_STORE_MAX_MB``]
        disable_cudnn: the kill switch: ``True`` runs PyTorch's kernels everywhere.
            [``CUDNORM_DISABLE_CUDNN``: ``1``/``0`` and synonyms]
        measure: under ``policy="auto"``, whether the first eager CUDA call of a call signature
            times cuDNN, PyTorch's op and cudnorm's own kernel on its shape and keeps the
            fastest (a few ms once per signature; ``cudnorm._decisions``); ``False``: the stored
            decision, else the committed prior for this GPU, else PyTorch's op. [``CUDNORM_MEASURE``:
            ``1``/``0`` and synonyms]
        native: ``"auto"``: calls on CUDA tensors go through the native launch path
            (``cudnorm/csrc``, built once per machine at the first CUDA call or by ``cudnorm
            build``), falling back to the Python launch path with one warning when it cannot
            be built; ``"off"``: always the Python launch path. [``CUDNORM_NATIVE``]
        native_dir: where the native launch path is built and cached; ``None``:
            ``$XDG_CACHE_HOME/cudnorm/native``, else ``~/.cache/cudnorm/native``.
            [``CUDNORM_NATIVE_DIR``]
    """

    # defaults taken from a measurement (and bounds that were not): docs/performance.md, Decisions
    policy: Literal["auto", "cudnn", "torch"] = "auto"
    autotune: Literal["auto", "on", "off"] = "auto"
    autotune_candidates: int | Literal["all"] = 8
    fp32_weight_fwd: Literal["round", "native"] = "round"
    cache_size: int = 512
    exact_rows: int = 1
    exact_after: int = 1
    ada_forward: Literal["auto", "cudnn", "per_sample", "torch"] = "auto"
    ada_backward: Literal["auto", "fused", "cudnn", "per_sample", "torch"] = "auto"
    raw_execute: bool = True
    plan_store: bool = True
    plan_store_dir: str | None = None
    plan_store_max_mb: float = 512
    disable_cudnn: bool = False
    measure: bool = True
    native: Literal["auto", "off"] = "auto"
    native_dir: str | None = None

    def __post_init__(self) -> None:
        for name in OPTIONS:
            object.__setattr__(self, name, _checked(name, getattr(self, name), "cudnorm.Config"))

    def __enter__(self) -> Config:
        restore = self.__dict__.get("_restore")  # set by config(): what was current before it
        if restore is None or current != self:  # a Config made by hand, or one replaced since
            restore = _install(self)[1]
        _restores().append(restore)
        return self

    def __exit__(self, *exc_info) -> None:
        _install(_restores().pop())


# -- the options: what each takes, in the API and in the environment ----------------------
@dataclass(frozen=True)
class _Option:
    env: str
    allowed: str  # what the option takes, for messages
    check: Callable[[object], object]  # the value as stored; TypeError/ValueError when refused
    parse: Callable[[str], object] = str  # environment text (stripped) -> value, unless in `words`
    words: Mapping[str, object] = dataclasses.field(default_factory=dict)  # lower-case spellings -> value
    env_allowed: str = ""  # what the variable takes, when it differs from `allowed`


def _choice(*values: str) -> Callable[[object], str]:
    def check(value):
        if not isinstance(value, str):
            raise TypeError
        if value not in values:
            raise ValueError
        return value
    return check


def _integer(minimum: int, *words: str) -> Callable[[object], object]:
    def check(value):
        if isinstance(value, str) and words:
            if value in words:
                return value
            raise ValueError
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError
        if value < minimum:
            raise ValueError
        return value
    return check


def _flag(value):
    if not isinstance(value, bool):
        raise TypeError
    return value


def _megabytes(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError
    if not 0 <= value < math.inf:  # nan fails both comparisons
        raise ValueError
    return value


def _directory(value):
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError
    return os.fspath(value)


def _names(values) -> str:
    values = [repr(v) for v in values]
    return ", ".join(values[:-1]) + " or " + values[-1]


_YES_NO = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off"), False)}
_FLAG_ENV = "1, true, yes, on or 0, false, no, off"
OPTIONS: dict[str, _Option] = {
    "policy": _Option("CUDNORM_POLICY", _names(("auto", "cudnn", "torch")), _choice("auto", "cudnn", "torch"),
                      parse=str.lower),
    "autotune": _Option(
        "CUDNORM_AUTOTUNE", _names(("auto", "on", "off")), _choice("auto", "on", "off"), parse=str.lower,
        words={**dict.fromkeys(("1", "true", "yes", "always"), "on"), **dict.fromkeys(("0", "false", "no", "never"), "off")},
        env_allowed="auto, on (1, true, yes, always) or off (0, false, no, never)"),
    "autotune_candidates": _Option("CUDNORM_AUTOTUNE_CANDIDATES", "an integer >= 1 or 'all'", _integer(1, "all"),
                                   parse=int, words={"all": "all"}),
    "fp32_weight_fwd": _Option("CUDNORM_FP32_WEIGHT_FWD", _names(("round", "native")), _choice("round", "native"),
                               parse=str.lower),
    "cache_size": _Option("CUDNORM_CACHE_SIZE", "an integer >= 1", _integer(1), parse=int),
    "exact_rows": _Option("CUDNORM_EXACT_ROWS", "an integer >= 0", _integer(0), parse=int),
    "exact_after": _Option("CUDNORM_EXACT_AFTER", "an integer >= 1", _integer(1), parse=int),
    "ada_forward": _Option("CUDNORM_ADA_FWD", _names(_STRATEGIES), _choice(*_STRATEGIES), parse=str.lower),
    "ada_backward": _Option("CUDNORM_ADA_BWD", _names(_BACKWARD_STRATEGIES), _choice(*_BACKWARD_STRATEGIES),
                            parse=str.lower),
    "raw_execute": _Option("CUDNORM_RAW_EXECUTE", "True or False", _flag, words=_YES_NO, env_allowed=_FLAG_ENV),
    "plan_store": _Option("CUDNORM_PLAN_STORE", "True or False", _flag, words=_YES_NO, env_allowed=_FLAG_ENV),
    "plan_store_dir": _Option("CUDNORM_PLAN_STORE_DIR", "a path (str or os.PathLike) or None", _directory),
    "plan_store_max_mb": _Option("CUDNORM_PLAN_STORE_MAX_MB", "a finite number >= 0", _megabytes, parse=float),
    "disable_cudnn": _Option("CUDNORM_DISABLE_CUDNN", "True or False", _flag, words=_YES_NO, env_allowed=_FLAG_ENV),
    "measure": _Option("CUDNORM_MEASURE", "True or False", _flag, words=_YES_NO, env_allowed=_FLAG_ENV),
    "native": _Option("CUDNORM_NATIVE", _names(("auto", "off")), _choice("auto", "off"), parse=str.lower),
    "native_dir": _Option("CUDNORM_NATIVE_DIR", "a path (str or os.PathLike) or None", _directory),
}


def _checked(name: str, value, where: str):
    """``value`` as ``Config.<name>`` stores it; ``TypeError``/``ValueError`` naming ``where``,
    the option and what it takes."""
    option = OPTIONS[name]
    try:
        return option.check(value)
    except TypeError:
        raise TypeError(f"{where}: option {name!r} must be {option.allowed}, got {value!r}") from None
    except ValueError:
        raise ValueError(f"{where}: option {name!r} must be {option.allowed}, got {value!r}") from None


def from_environment(environ: Mapping[str, str] = os.environ) -> Config:
    """The configuration the ``CUDNORM_*`` variables of ``environ`` describe: each variable set
    to a non-empty value seeds its option; a malformed one warns and leaves the default."""
    values = {}
    for name, option in OPTIONS.items():
        raw = environ.get(option.env, "")
        text = raw.strip()
        if not text:
            continue
        try:
            word = text.lower()
            values[name] = option.check(option.words[word] if word in option.words else option.parse(text))
        except (TypeError, ValueError):
            _warn.warn(f"cudnorm: ignoring {option.env}={raw!r}: it must be {option.env_allowed or option.allowed}; "
                       f"using the default, {getattr(Config, name)!r}")
    return Config(**values)


# -- the current configuration and changes to it --------------------------------------------
current = from_environment()

_canonical: dict[Config, Config] = {current: current}  # each distinct configuration, once
_listeners: list[Callable[[Config, Config], None]] = []
_lock = threading.Lock()  # one change (swap and listeners) at a time
_local = threading.local()


def _restores() -> list[Config]:
    """This thread's open ``with`` blocks: the configuration each restores, innermost last."""
    stack = getattr(_local, "restores", None)
    if stack is None:
        stack = _local.restores = []
    return stack


def on_change(listener: Callable[[Config, Config], None]) -> None:
    """Call ``listener(old, new)`` after each change of the configuration (for state that the
    configuration sizes or places: the plan cache, the plan store)."""
    _listeners.append(listener)


def _install(new: Config) -> tuple[Config, Config]:
    """Make ``new`` (or the equal configuration made before) current: ``(new, previous)``."""
    global current
    with _lock:
        new = _canonical.setdefault(new, new)
        previous, current = current, new
        if new is not previous:
            for listener in _listeners:
                listener(previous, new)
    return new, previous


def get_config() -> Config:
    """The configuration in effect now (see :class:`Config`)."""
    return current


def config(**overrides) -> Config:
    """Change cudnorm's configuration and return the new one; as a context manager, only
    until the end of the block::

        import cudnorm

        cudnorm.config(autotune="off")         # from now on
        with cudnorm.config(policy="cudnn"):   # in this block
            print(cudnorm.get_config().policy)

    The change takes effect at the call. The configuration is process-wide, not per thread:
    a ``with`` block changes it for every thread while it runs, and threads changing it at
    the same time may restore each other's changes. Changing ``cache_size`` resizes the plan
    cache; changing ``plan_store``, ``plan_store_dir`` or ``plan_store_max_mb`` installs the
    store they describe.

    Args:
        **overrides: :class:`Config` fields and their new values; the others keep their
            current values. With none, the current configuration (and a ``with`` block
            restores it at its end, undoing every change made inside).

    Returns:
        The new :class:`Config`. Used in a ``with`` statement, it restores at the end of the
        block the configuration that was current when ``config`` was called.

    Raises:
        TypeError: an unknown option, or a value of the wrong type.
        ValueError: a value the option does not take (the message says what it takes).
    """
    unknown = [name for name in overrides if name not in OPTIONS]
    if unknown:
        raise TypeError(f"cudnorm.config: unknown option {unknown[0]!r}; the options are {', '.join(OPTIONS)}")
    checked = {name: _checked(name, value, "cudnorm.config") for name, value in overrides.items()}
    new, previous = _install(dataclasses.replace(current, **checked))
    handle = copy.copy(new)  # equal to `new`; carries what a `with` block restores
    object.__setattr__(handle, "_restore", previous)
    return handle

