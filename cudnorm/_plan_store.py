"""On-disk store of built cuDNN plans: a new process loads a graph it has seen before in
milliseconds instead of building it again (0.1-1.4 s, docs/concepts.md "build costs").

Layout: ``<root>/<fingerprint>/<entry>.plan``. The fingerprint names everything that makes
a serialized plan valid (GPU name and compute capability, cuDNN backend and frontend, the
CUDA torch was built with, cudnorm's version), so plans of another GPU or library are never
even found by name; the entry name hashes the :class:`NormSpec` and the fingerprint.

Entry file (format version 1)::

    b"CUDNORMP" | uint32 format version | uint32 header length | header (UTF-8 JSON) | blob

The header holds the spec, the fingerprint, the plan name, the autotune timings, and the
length and SHA-256 of the blob (cuDNN's serialized plan). A file that is truncated, corrupt,
of another format or fingerprint is skipped with a warning and the plan rebuilt (the rebuilt
plan's save replaces it).

Writes go to a temporary file in the same directory and are moved into place with
``os.replace``, so readers never see a partial entry and concurrent writers of one entry
simply race to an identical result. After each save the least recently used entries (by
mtime; a load touches its file) are removed until the store fits its size bound. A store
that cannot be written warns once and keeps new plans in memory for the rest of the process
(entries already there are still loaded).

Configuration (:class:`cudnorm.Config`): ``plan_store_dir`` (default
``$XDG_CACHE_HOME/cudnorm/plans`` or ``~/.cache/cudnorm/plans``), ``plan_store=False``
disables the store, ``plan_store_max_mb`` bounds its size (default 512). Changing any of
them installs the store they describe.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import tempfile
import time
from pathlib import Path

import torch

from . import _graphs, _runtime, _settings, _warn
from ._spec import NormSpec
from ._version import __version__

MAGIC = b"CUDNORMP"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, format version, header length
_MAX_HEADER_BYTES = 1 << 20
_SUFFIX = ".plan"
_DECISION_SUFFIX = ".decision"
_TEMP_PREFIX = ".tmp-"
_STALE_TEMP_SECONDS = 3600  # a temp file this old belongs to a writer that died


class EntryError(ValueError):
    """An entry file that cannot be used; the message says why."""


def encode_entry(meta: dict, blob: bytes) -> bytes:
    """The bytes of an entry file: ``meta`` plus the blob's length and checksum, then the blob."""
    header = dict(meta, blob_bytes=len(blob), blob_sha256=hashlib.sha256(blob).hexdigest())
    text = json.dumps(header, sort_keys=True).encode()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(text)) + text + blob


_SPEC_FIELDS = frozenset(("op", "phase", "rows", "cols", "x_dtype", "scale_dtype"))


def _decode_header(data: bytes) -> tuple[dict, int]:
    """``(header, offset of the blob)`` from the start of an entry file."""
    if len(data) < _PREFIX.size:
        raise EntryError(f"truncated ({len(data)} bytes)")
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise EntryError("not a cudnorm plan file (bad magic)")
    if version != FORMAT_VERSION:
        raise EntryError(f"format version {version}, this cudnorm reads {FORMAT_VERSION}")
    end = _PREFIX.size + header_len
    if header_len > _MAX_HEADER_BYTES or len(data) < end:
        raise EntryError("truncated header")
    try:
        header = json.loads(data[_PREFIX.size:end])
    except ValueError as exc:
        raise EntryError(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or not {"spec", "fingerprint", "blob_bytes", "blob_sha256"} <= set(header):
        raise EntryError("header lacks required fields")
    spec = header["spec"]
    if not (isinstance(spec, dict) and _SPEC_FIELDS <= set(spec) and isinstance(header["fingerprint"], dict)
            and type(header["blob_bytes"]) is int and isinstance(header["blob_sha256"], str)):
        raise EntryError("malformed header (a field has the wrong type)")
    return header, end


def decode_entry(data: bytes) -> tuple[dict, bytes]:
    """Inverse of :func:`encode_entry`; raises :class:`EntryError` on any damage."""
    header, start = _decode_header(data)
    blob = data[start:]
    if len(blob) != header["blob_bytes"]:
        raise EntryError(f"truncated blob ({len(blob)} of {header['blob_bytes']} bytes)")
    if hashlib.sha256(blob).hexdigest() != header["blob_sha256"]:
        raise EntryError("checksum mismatch (corrupt blob)")
    return header, blob


def _hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def default_fingerprint(device_index: int) -> dict:
    """What makes a serialized plan valid on ``device_index`` (JSON-able dict)."""

    return {**_runtime.device_fingerprint(device_index), "cudnorm": __version__}


class PlanStore:
    """Plans on disk under ``directory``, bounded to ``max_bytes``.

    ``load(spec)``/``save(plan)`` are the hooks :func:`cudnorm._cache.get_plan` calls around a
    build; neither raises (problems are warned about once and the caller builds instead).
    ``fingerprint(device_index) -> dict`` is injectable for tests.
    """

    def __init__(self, directory: str | os.PathLike, max_bytes: int, *, fingerprint=default_fingerprint,
                 enabled: bool = True) -> None:
        self.root = Path(directory)
        self.max_bytes = int(max_bytes)
        self.enabled = enabled
        self.writable = True
        self._fingerprint_fn = fingerprint
        self._fingerprints: dict[int, tuple[dict, Path]] = {}
        self._warned: set[str] = set()

    # -- locating entries ------------------------------------------------------------------
    def _fingerprint(self, device_index: int) -> tuple[dict, Path]:
        """``(fingerprint as JSON gives it back, its directory)``, computed once per device."""
        cached = self._fingerprints.get(device_index)
        if cached is None:
            fp = json.loads(json.dumps(self._fingerprint_fn(device_index), sort_keys=True))
            gpu = "".join(c if c.isalnum() else "_" for c in str(fp.get("gpu", "device")))[:32]
            cached = self._fingerprints[device_index] = (fp, self.root / f"{gpu}-{_hash(fp)[:12]}")
        return cached

    def entry_path(self, spec: NormSpec) -> Path:
        fp, directory = self._fingerprint(spec.device_index)
        return directory / (_hash({"spec": spec.to_json(), "fingerprint": fp})[:40] + _SUFFIX)

    def _locate(self, spec: NormSpec) -> tuple[Path, dict] | None:
        """``(entry path, fingerprint)``, or ``None`` (warned once) when the device cannot be
        fingerprinted: then there is no store, but the op must still run."""
        try:
            return self.entry_path(spec), self._fingerprints[spec.device_index][0]
        except Exception as exc:
            self._warn("fingerprint", f"cannot fingerprint cuda:{spec.device_index} ({exc}); not using the store")
            return None

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _warn.warn(f"cudnorm plan store: {message}", RuntimeWarning)

    def has(self, spec: NormSpec) -> bool:
        """Whether an entry for ``spec`` exists on this device's fingerprint (not validated:
        :meth:`load` still checks it). One hash and one ``stat``; never raises."""
        located = self._locate(spec) if self.enabled else None
        try:
            return located is not None and located[0].is_file()
        except OSError:
            return False

    # -- the dispatch hooks -----------------------------------------------------------------
    def load(self, spec: NormSpec):
        """The stored :class:`~cudnorm._graphs.Plan` of ``spec``, or ``None`` (then build)."""
        located = self._locate(spec) if self.enabled else None
        if located is None:
            return None
        path, fp = located
        try:
            if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the read
                self._warn(str(path), f"skipping {path}: not a regular file")
                return None
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            self._warn(str(path), f"skipping {path}: unreadable ({exc})")
            return None
        try:
            header, blob = decode_entry(data)
            if header["fingerprint"] != fp:
                raise EntryError(f"built for another GPU or library version ({header['fingerprint']})")
            if header["spec"] != spec.to_json():
                raise EntryError(f"holds another graph ({header['spec']})")
        except EntryError as exc:
            self._warn(str(path), f"skipping {path}: {exc}; rebuilding")
            return None
        try:
            plan = _graphs.deserialize_plan(spec, blob, header.get("plan_name", "deserialized"))
        except Exception as exc:  # the blob does not load on this driver/library: rebuild
            self._warn(str(path), f"skipping {path}: cuDNN could not load it ({type(exc).__name__}: {exc}); rebuilding")
            return None
        plan.timings_ms = {int(k): v for k, v in header.get("timings_ms", {}).items()}
        plan.candidates_timed = header.get("candidates_timed", 0)
        try:
            os.utime(path)  # recency for eviction
        except OSError:
            pass  # a read-only store still serves its plans
        return plan

    def save(self, plan) -> None:
        """Write ``plan`` (a freshly built :class:`~cudnorm._graphs.Plan`) and enforce the bound."""
        if not (self.enabled and self.writable):
            return
        try:
            self._save(plan)
        except Exception as exc:  # a plan that cannot be stored is still a good plan: never fail the op
            self._warn("save", f"cannot save plans ({type(exc).__name__}: {exc}); they are rebuilt in new processes")

    def _save(self, plan) -> None:
        spec = plan.spec
        located = self._locate(spec)
        if located is None:
            return
        path, fp = located
        try:
            blob = _graphs.serialize_plan(plan)
        except Exception as exc:  # e.g. an engine without a serialized form: used from memory only
            self._warn(f"save:{spec.slug()}", f"cannot serialize {spec.slug()} ({type(exc).__name__}: {exc})")
            return
        meta = {"spec": spec.to_json(), "fingerprint": fp, "plan_name": plan.plan_name,
                "timings_ms": {str(k): v for k, v in plan.timings_ms.items()},
                "candidates_timed": plan.candidates_timed, "build_seconds": plan.build_seconds,
                "created": time.time()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, encode_entry(meta, blob))
        except OSError as exc:
            self.writable = False
            self._warn("write", f"cannot write to {path.parent} ({exc}); keeping new plans in memory only "
                                "for this process")
            return
        self.evict()

    # -- measured decisions (cudnorm._decisions) ------------------------------------------------
    def decision_path(self, key: str, device_index: int, deterministic: bool) -> Path | None:
        """Where the decision for signature ``key`` lives: beside this device's plans, named by
        the key and what else makes a timing valid (torch's version, for its kernels; the
        driver's; deterministic mode), or ``None`` when the device cannot be fingerprinted."""
        located = self._locate_device(device_index)
        if located is None:
            return None
        name = _hash({"key": key, "torch": torch.__version__, "driver": _runtime.driver_version(),
                      "deterministic": deterministic})[:40]
        return located / (name + _DECISION_SUFFIX)

    def _locate_device(self, device_index: int) -> Path | None:
        try:
            return self._fingerprint(device_index)[1]
        except Exception as exc:
            self._warn("fingerprint", f"cannot fingerprint cuda:{device_index} ({exc}); not using the store")
            return None

    def load_decision(self, key: str, device_index: int, deterministic: bool) -> dict | None:
        """The stored decision record for ``key`` (``{"choice": ..., "ms": {...}, ...}``), or ``None``."""
        path = self.decision_path(key, device_index, deterministic) if self.enabled else None
        if path is None:
            return None
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("key") == key else None

    def save_decision(self, key: str, device_index: int, deterministic: bool, record: dict) -> dict:
        """Store ``record`` unless a decision for ``key`` is there already; returns the record that
        is stored (the first one written wins, so every process sharing the store agrees)."""
        record = dict(record, key=key)
        path = self.decision_path(key, device_index, deterministic) if self.enabled and self.writable else None
        if path is None:
            return record
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=path.parent)
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o644)
                json.dump(record, f, sort_keys=True)
            try:
                os.link(tmp, path)  # atomic and exclusive: fails where another process stored first
            except FileExistsError:
                return self.load_decision(key, device_index, deterministic) or record
            finally:
                _unlink(Path(tmp))
        except OSError as exc:
            self._warn("decisions", f"cannot store measured decisions in {path.parent} ({exc}); "
                                    "new processes measure again")
        return record

    def _decision_files(self) -> list[Path]:
        return [path for sub in _listdir(self.root) for path in _listdir(sub) if path.name.endswith(_DECISION_SUFFIX)]

    # -- maintenance ------------------------------------------------------------------------
    def _files(self):
        """``(path, stat)`` of every entry and temp file under the root (all fingerprints)."""
        for sub in _listdir(self.root):
            for path in _listdir(sub):
                if path.name.endswith(_SUFFIX) or path.name.startswith(_TEMP_PREFIX):
                    try:
                        yield path, path.stat()
                    except OSError:  # removed by another process meanwhile, a symlink loop
                        continue

    def evict(self) -> int:
        """Remove least recently used entries (and dead writers' temp files) until the
        store fits ``max_bytes``. Returns the number of files removed."""
        now = time.time()
        entries, removed = [], 0
        for path, st in self._files():
            if path.name.startswith(_TEMP_PREFIX):
                if now - st.st_mtime > _STALE_TEMP_SECONDS:
                    removed += _unlink(path)
            elif stat.S_ISREG(st.st_mode):
                entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            removed += _unlink(path)
            total -= size
        return removed

    def entries(self) -> list[dict]:
        """One dict per entry file: path, bytes, age, and the header (or the reason it is unreadable)."""
        rows = [{"path": str(directory), "bytes": 0, "age_s": 0.0,
                 "error": f"unreadable directory ({error.strerror or error})"} for directory, error in self.unreadable()]
        now = time.time()
        for path, st in self._files():
            if path.name.startswith(_TEMP_PREFIX):
                continue
            row = {"path": str(path), "bytes": st.st_size, "age_s": max(0.0, now - st.st_mtime)}
            if not stat.S_ISREG(st.st_mode):
                row["error"] = "not a regular file"
                rows.append(row)
                continue
            try:
                with open(path, "rb") as f:
                    head = f.read(_PREFIX.size)
                    if len(head) == _PREFIX.size:
                        head += f.read(_PREFIX.unpack(head)[2])
                row["header"], _ = _decode_header(head)
            except (OSError, EntryError, struct.error) as exc:
                row["error"] = str(exc)
            rows.append(row)
        return rows

    def unreadable(self) -> list[tuple[Path, OSError]]:
        """The store's directories (the root, each fingerprint's) that cannot be listed, with
        the error: the entries in them are invisible to loads, ``entries`` and ``clear``."""
        subs, error = _scan(self.root)
        found = [] if error is None else [(self.root, error)]
        for sub in subs:
            if sub.is_dir():
                error = _scan(sub)[1]
                if error is not None:
                    found.append((sub, error))
        return found

    def clear(self) -> int:
        """Delete every entry (and empty fingerprint directory). Returns the files removed;
        raises ``PermissionError`` naming the store when some could not be removed (a
        read-only store), or naming a directory of it that could not be read."""
        files = [path for path, _ in self._files()] + self._decision_files()
        removed = sum(_unlink(path) for path in files)
        left = [path for path in files if path.exists() or path.is_symlink()]
        if left:
            raise PermissionError(f"cudnorm: could not remove {len(left)} of {len(files)} plan store file(s) in "
                                  f"{self.root} (first: {left[0].name}); is the store read-only?")
        unreadable = self.unreadable()
        if unreadable:
            directory, error = unreadable[0]
            raise PermissionError(f"cudnorm: could not read {directory} ({error.strerror or error}): the plans in it "
                                  f"were not removed ({removed} other file(s) were)")
        for sub in _listdir(self.root):
            if sub.is_dir():
                try:
                    sub.rmdir()
                except OSError:
                    pass  # not empty (files that are not ours) or not removable
        return removed

    def info(self) -> dict:
        files = [st for path, st in self._files() if path.name.endswith(_SUFFIX)]
        return {"path": str(self.root), "enabled": self.enabled, "writable": self.writable,
                "entries": len(files), "bytes": sum(st.st_size for st in files), "max_bytes": self.max_bytes,
                "decisions": len(self._decision_files())}


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would hide a shared, pre-warmed store
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink(Path(tmp))
        raise


def _listdir(directory: Path) -> list[Path]:
    """Entries of ``directory``; none when it is missing, not a directory or unreadable."""
    return _scan(directory)[0]


def _scan(directory: Path) -> tuple[list[Path], OSError | None]:
    """``(entries of directory, None)``; ``([], error)`` when it cannot be listed (missing
    or not a directory is no error: an empty store)."""
    try:
        return list(directory.iterdir()), None
    except (FileNotFoundError, NotADirectoryError):
        return [], None
    except OSError as exc:
        return [], exc


def _unlink(path: Path) -> int:
    try:
        path.unlink()
        return 1
    except OSError:  # gone already (another process) or not removable: nothing to count
        return 0


# -- configuration and the default store ----------------------------------------------------
_OPTIONS = ("plan_store", "plan_store_dir", "plan_store_max_mb")


def default_directory() -> Path:
    configured = _settings.current.plan_store_dir
    if configured:
        return Path(configured).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_home) / "cudnorm" / "plans"


def _max_bytes() -> int:
    return int(_settings.current.plan_store_max_mb * (1 << 20))


def install_default_store() -> PlanStore | None:
    """Install the store the configuration describes (or none when disabled). Touches no
    file: the directory is created by the first save."""
    store = PlanStore(default_directory(), _max_bytes()) if _settings.current.plan_store else None
    install(store)
    return store


_installed: PlanStore | None = None  # the store consulted on plan-cache misses


def install(store: PlanStore | None) -> None:
    """Make ``store`` (or no store, ``None``) the one plan-cache misses consult."""
    global _installed
    _installed = store


def installed() -> PlanStore | None:
    """The store plan-cache misses consult, or ``None`` (disabled)."""
    return _installed


def _reinstall(old: _settings.Config, new: _settings.Config) -> None:
    if any(getattr(old, name) != getattr(new, name) for name in _OPTIONS):
        install_default_store()


_settings.on_change(_reinstall)


def current_store() -> PlanStore:
    """The installed store, or a disabled one at the configured place (to inspect or clear:
    ``cudnorm cache``)."""
    store = _installed
    if isinstance(store, PlanStore):
        return store
    return PlanStore(default_directory(), _max_bytes(), enabled=False)


def plan_store_info() -> dict:
    """The on-disk plan store: ``path``, ``enabled``, ``writable``, ``entries``, ``bytes``,
    ``max_bytes`` (entries and bytes count every fingerprint directory)."""
    return current_store().info()


def load_decision(key: str, device_index: int, deterministic: bool) -> dict | None:
    """The installed store's decision for a signature key (:mod:`cudnorm._decisions`), or ``None``."""
    store = _installed
    return store.load_decision(key, device_index, deterministic) if isinstance(store, PlanStore) else None


def save_decision(key: str, device_index: int, deterministic: bool, record: dict) -> dict:
    """Store a decision in the installed store; returns the one stored (another process's if first)."""
    store = _installed
    return store.save_decision(key, device_index, deterministic, record) if isinstance(store, PlanStore) else record


def clear_plan_store() -> int:
    """Delete every stored plan; returns the number of files removed. The in-memory cache
    is untouched (see :func:`cudnorm.clear_cache`)."""
    return current_store().clear()
