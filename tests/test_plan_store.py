"""On-disk plan store on the CPU: the file format, damaged and foreign files, unwritable
directories, the size bound, concurrent writers, the dispatch hook and ``cudnorm cache``.

cuDNN's serialize/deserialize need a GPU, so ``_graphs.serialize_plan``/``deserialize_plan``
are replaced by fakes that carry the blob through unchanged; tests/test_plan_store_gpu.py
covers the real ones.
"""

import hashlib
import json
import multiprocessing
import os
import struct
import time
import warnings

import pytest
import torch

import cudnorm
from cudnorm import _cache, _graphs, _plan_store, cli
from cudnorm._plan_store import PlanStore
from cudnorm._spec import NormSpec

FAKE_FP = {"gpu": "Fake GPU 80GB", "compute_capability": "9.0", "cudnn_backend": 91900, "cudnn_frontend": "1.32.0",
           "torch_cuda": "13.0", "cudnorm": "0.1.0"}


def fake_fingerprint(device_index):
    return dict(FAKE_FP)


def fake_serialize(plan):
    return plan.graph


def fake_deserialize(spec, blob, plan_name="deserialized"):
    return _graphs.Plan(spec, blob, (), 0, plan_name, 0.0, source="store")


def install_fakes():
    _graphs.serialize_plan = fake_serialize
    _graphs.deserialize_plan = fake_deserialize


def spec_(rows=64, cols=1024, op="layer_norm", phase="train"):
    return NormSpec(op, phase, rows, cols, torch.bfloat16, torch.bfloat16, 0)


def blob_for(spec, size=4000):
    """Deterministic per-spec bytes standing in for cuDNN's serialized plan."""
    seed = hashlib.sha256(spec.slug().encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def plan_(spec, size=4000):
    return _graphs.Plan(spec, blob_for(spec, size), (1, 2), 0, "eng5_k3", 0.7, candidates_timed=3,
                        timings_ms={0: 0.25, 2: 0.125})


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setattr(_graphs, "serialize_plan", fake_serialize)
    monkeypatch.setattr(_graphs, "deserialize_plan", fake_deserialize)


@pytest.fixture
def store(tmp_path, fakes):
    return PlanStore(tmp_path / "plans", 1 << 30, fingerprint=fake_fingerprint)


@pytest.fixture
def installed_store():
    """Restore whatever store cudnorm installed at import after the test."""
    before = _plan_store.installed()
    yield
    _plan_store.install(before)


def recorded(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_round_trip_keeps_plan_name_and_timings(store):
    spec = spec_()
    assert store.load(spec) is None
    assert not store.root.exists(), "a miss must not create the directory"
    store.save(plan_(spec))
    plan = store.load(spec)
    assert plan.graph == blob_for(spec) and plan.spec == spec and plan.source == "store"
    assert plan.plan_name == "eng5_k3" and plan.candidates_timed == 3 and plan.timings_ms == {0: 0.25, 2: 0.125}
    assert store.load(spec_(rows=65)) is None  # another row count is another graph
    path = store.entry_path(spec)
    assert path.parent.parent == store.root and path.parent.name.startswith("Fake_GPU_80GB-")


def test_has_answers_without_loading(store, installed_store):
    spec = spec_()
    assert not store.has(spec) and not _cache.stored(spec)
    store.save(plan_(spec))
    assert store.has(spec) and not store.has(spec_(rows=65))
    _plan_store.install(store)
    assert _cache.stored(spec)
    store.enabled = False
    assert not store.has(spec)


def test_entries_of_another_fingerprint_live_elsewhere(tmp_path, fakes):
    ours = PlanStore(tmp_path, 1 << 30, fingerprint=fake_fingerprint)
    theirs = PlanStore(tmp_path, 1 << 30, fingerprint=lambda i: {**FAKE_FP, "cudnn_backend": 92100})
    spec = spec_()
    theirs.save(plan_(spec))
    assert ours.entry_path(spec).parent != theirs.entry_path(spec).parent
    assert ours.load(spec) is None
    assert ours.info()["entries"] == 1  # the bound and `cache info` see every fingerprint


def _truncate_blob(data):
    return data[:-100]


def _truncate_header(data):
    return data[:20]


def _flip_blob_byte(data):
    return data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:]


def _bad_magic(data):
    return b"NOTAPLAN" + data[8:]


def _future_version(data):
    return data[:8] + struct.pack("<I", 99) + data[12:]


def _garbage_header(data):
    return data[:16] + b"{" * (len(data) - 16)


def _foreign_fingerprint(data):
    header, blob = _plan_store.decode_entry(data)
    meta = {k: v for k, v in header.items() if not k.startswith("blob_")}
    return _plan_store.encode_entry({**meta, "fingerprint": {**FAKE_FP, "gpu": "Other GPU"}}, blob)


def _other_spec(data):
    header, blob = _plan_store.decode_entry(data)
    meta = {k: v for k, v in header.items() if not k.startswith("blob_")}
    return _plan_store.encode_entry({**meta, "spec": spec_(rows=999).to_json()}, blob)


@pytest.mark.parametrize("damage, reason", [
    (_truncate_blob, "truncated blob"), (_truncate_header, "truncated header"), (_flip_blob_byte, "checksum"),
    (_bad_magic, "bad magic"), (_future_version, "format version 99"), (_garbage_header, "unreadable header"),
    (_foreign_fingerprint, "another GPU"), (_other_spec, "another graph"),
    (lambda data: b"", "truncated"),
])
def test_damaged_entry_is_skipped_once_then_replaced(store, damage, reason):
    spec = spec_()
    store.save(plan_(spec))
    path = store.entry_path(spec)
    path.write_bytes(damage(path.read_bytes()))
    plan, warned = recorded(lambda: store.load(spec))
    assert plan is None
    assert len(warned) == 1 and reason in str(warned[0].message) and str(path) in str(warned[0].message)
    plan, warned = recorded(lambda: store.load(spec))
    assert plan is None and not warned, "warn once per file"
    store.save(plan_(spec))  # what the caller does after rebuilding
    assert store.load(spec).graph == blob_for(spec)


def test_deserialize_failure_is_skipped_with_a_warning(store, monkeypatch):
    spec = spec_()
    store.save(plan_(spec))

    def refuse(*args):
        raise RuntimeError("CUDNN_STATUS_BAD_PARAM")

    monkeypatch.setattr(_graphs, "deserialize_plan", refuse)
    with pytest.warns(RuntimeWarning, match="cuDNN could not load it.*BAD_PARAM"):
        assert store.load(spec) is None


def test_save_never_raises(store, monkeypatch):
    def refuse(plan):
        raise RuntimeError("engine has no serialized form")

    monkeypatch.setattr(_graphs, "serialize_plan", refuse)
    with pytest.warns(RuntimeWarning, match="cannot serialize layer_norm-train.*no serialized form"):
        store.save(plan_(spec_()))
    with pytest.warns(RuntimeWarning, match="cannot save plans .*AttributeError"):
        store.save(object())  # whatever a build returned, the op goes on
    assert not store.root.exists()


def test_fingerprint_failure_does_not_fail_the_op(tmp_path):
    def no_gpu(device_index):
        raise RuntimeError("no CUDA")

    store = PlanStore(tmp_path, 1 << 30, fingerprint=no_gpu)
    with pytest.warns(RuntimeWarning, match="cannot fingerprint"):
        assert store.load(spec_()) is None
    store.save(plan_(spec_()))  # warned already; must not raise
    assert not any(tmp_path.iterdir())


def test_unwritable_directory_degrades_to_memory_only(tmp_path, fakes):
    # A path below a regular file cannot be created, even by root (who ignores chmod).
    (tmp_path / "file").write_text("x")
    store = PlanStore(tmp_path / "file" / "plans", 1 << 30, fingerprint=fake_fingerprint)
    _, warned = recorded(lambda: store.save(plan_(spec_())))
    assert len(warned) == 1 and "memory only" in str(warned[0].message)
    assert store.writable is False
    _, warned = recorded(lambda: store.save(plan_(spec_(rows=2))))
    assert not warned
    assert store.load(spec_()) is None


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_by_permissions(tmp_path, fakes):
    root = tmp_path / "plans"
    root.mkdir()
    root.chmod(0o555)
    try:
        store = PlanStore(root, 1 << 30, fingerprint=fake_fingerprint)
        with pytest.warns(RuntimeWarning, match="memory only"):
            store.save(plan_(spec_()))
        assert store.writable is False
    finally:
        root.chmod(0o755)


def test_read_only_store_still_serves_its_entries(store, monkeypatch):
    spec = spec_()
    store.save(plan_(spec))

    def denied(path, *args):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(_plan_store, "write_atomic", denied)
    monkeypatch.setattr(os, "utime", denied)  # a load touches its file; that must not matter either
    with pytest.warns(RuntimeWarning, match="memory only"):
        store.save(plan_(spec_(rows=2)))
    assert store.load(spec).graph == blob_for(spec)


def test_size_bound_evicts_least_recently_used(store):
    specs = [spec_(rows=r) for r in range(1, 7)]
    entry_bytes = len(_plan_store.encode_entry({"spec": specs[0].to_json(), "fingerprint": FAKE_FP}, b"")) + 4000 + 200
    store.max_bytes = 4 * entry_bytes
    for age, spec in zip(range(100, 0, -10), specs[:4]):  # specs[0] oldest
        store.save(plan_(spec))
        os.utime(store.entry_path(spec), (time.time() - age, time.time() - age))
    assert store.load(specs[0]) is not None  # touch: now the most recent
    store.save(plan_(specs[4]))
    store.save(plan_(specs[5]))
    present = {s.rows for s in specs if store.entry_path(s).exists()}
    assert present == {1, 4, 5, 6}
    assert store.info()["bytes"] <= store.max_bytes


def test_stale_temp_files_are_cleaned_fresh_ones_kept(store):
    store.save(plan_(spec_()))
    directory = store.entry_path(spec_()).parent
    stale, fresh = directory / ".tmp-dead", directory / ".tmp-live"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    store.evict()
    assert not stale.exists() and fresh.exists()


# -- several processes at once ------------------------------------------------------------
CONCURRENT_SPECS = [spec_(rows=r) for r in range(1, 25)]


def _writer(root, worker):
    install_fakes()
    store = PlanStore(root, 1 << 30, fingerprint=fake_fingerprint)
    order = CONCURRENT_SPECS if worker % 2 else CONCURRENT_SPECS[::-1]
    for _ in range(3):
        for spec in order:  # every worker writes every entry: same-entry races on purpose
            store.save(plan_(spec, size=60_000 + spec.rows))


def _reader(root, stop, bad):
    install_fakes()
    store = PlanStore(root, 1 << 30, fingerprint=fake_fingerprint)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while not stop.is_set():
            for spec in CONCURRENT_SPECS:
                plan = store.load(spec)
                if plan is not None and plan.graph != blob_for(spec, 60_000 + spec.rows):
                    bad.value += 1
                store._warned.clear()
    bad.value += len(caught)


@pytest.mark.slow  # several processes
def test_concurrent_writers_and_a_reader(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    root = str(tmp_path / "plans")
    stop, bad = ctx.Event(), ctx.Value("i", 0)
    reader = ctx.Process(target=_reader, args=(root, stop, bad))
    reader.start()
    writers = [ctx.Process(target=_writer, args=(root, i)) for i in range(4)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(120)
    stop.set()
    reader.join(60)
    assert [p.exitcode for p in writers + [reader]] == [0] * 5
    assert bad.value == 0, "a reader saw a partial or wrong entry"
    fresh_store = PlanStore(root, 1 << 30, fingerprint=fake_fingerprint)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_graphs, "deserialize_plan", fake_deserialize)
        for spec in CONCURRENT_SPECS:
            assert fresh_store.load(spec).graph == blob_for(spec, 60_000 + spec.rows)
    leftovers = [p for p in (tmp_path / "plans").rglob("*") if p.is_file() and not p.name.endswith(".plan")]
    assert leftovers == []


# -- the dispatch hook, configuration, public API -----------------------------------------
def test_dispatch_loads_from_store_instead_of_building(store, monkeypatch, installed_store, fresh_cache):
    builds = []

    def fake_build(spec):
        builds.append(spec)
        return plan_(spec)

    monkeypatch.setattr(_graphs, "build_plan", fake_build)
    _plan_store.install(store)
    spec = spec_()
    assert _cache.get_plan(spec).source == "built"
    _cache.plans.clear()  # a new process, as far as the cache knows
    plan = _cache.get_plan(spec)
    assert plan.source == "store" and plan.graph == blob_for(spec)
    assert len(builds) == 1 and cudnorm.cache_info().store_loads == 1


def test_configuration_installs_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cudnorm.get_config().plan_store_dir is None
    assert _plan_store.default_directory() == tmp_path / "xdg" / "cudnorm" / "plans"
    cudnorm.config(plan_store=True, plan_store_dir=tmp_path / "mine", plan_store_max_mb=1.5)
    store = _plan_store.installed()
    assert isinstance(store, PlanStore) and store.max_bytes == 1572864
    assert cudnorm.plan_store_info() == {"path": str(tmp_path / "mine"), "enabled": True, "writable": True,
                                         "entries": 0, "bytes": 0, "max_bytes": 1572864, "decisions": 0}
    assert not (tmp_path / "mine").exists(), "installing must not create the directory"
    cudnorm.config(cache_size=100)
    assert _plan_store.installed() is store, "other options leave the store alone"
    with cudnorm.config(plan_store_max_mb=2):
        assert _plan_store.installed() is not store and _plan_store.installed().max_bytes == 2 << 20
    assert _plan_store.installed().max_bytes == 1572864
    cudnorm.config(plan_store=False)
    assert _plan_store.installed() is None
    assert cudnorm.plan_store_info()["enabled"] is False and cudnorm.plan_store_info()["path"] == str(tmp_path / "mine")


def test_clear_removes_only_store_files(store):
    cudnorm.config(plan_store=True, plan_store_dir=store.root)
    for rows in (1, 2, 3):
        store.save(plan_(spec_(rows=rows)))
    (store.root / "README").write_text("not ours")
    assert cudnorm.plan_store_info()["entries"] == 3
    assert cudnorm.clear_plan_store() == 3
    assert cudnorm.plan_store_info()["entries"] == 0 and (store.root / "README").exists()


# -- `cudnorm cache` ----------------------------------------------------------------------
@pytest.fixture
def cli_main(monkeypatch):
    """cli.main restricted to this feature's subcommands (others may not be importable yet)."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", {k: cli.SUBCOMMANDS[k] for k in ("cache", "warmup")})
    return cli.main


def test_cli_cache_info_and_clear(store, cli_main, capsys):
    cudnorm.config(plan_store=True, plan_store_dir=store.root)
    store.save(plan_(spec_(rows=4096, cols=8192, op="rms_norm", phase="bwd")))
    store.save(plan_(spec_(rows=8)))
    store.entry_path(spec_(rows=8)).write_bytes(b"junk")
    assert cli_main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(store.root) in out and "entries" in out
    assert "rms_norm" in out and "4096x8192" in out and "eng5_k3" in out and "Fake GPU 80GB" in out
    assert "unreadable" in out
    assert cli_main(["cache", "info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["entries"] == 2 and len(data["files"]) == 2
    assert cli_main(["cache", "clear"]) == 0
    assert "removed 2" in capsys.readouterr().out
    assert cli_main(["cache", "info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 0
