"""The timing lock (cudnorm._gpu_lock): one process at a time times cuDNN's plans on a GPU."""

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cudnorm import _gpu_lock

pytestmark = pytest.mark.skipif(_gpu_lock.fcntl is None, reason="no flock on this platform")

_MODULE = Path(_gpu_lock.__file__)


def _holder(key: str, seconds: float) -> subprocess.Popen:
    """Another process holding ``key``'s lock for ``seconds`` (the module loaded on its own, not
    through cudnorm, so the child starts in milliseconds)."""
    code = ("import importlib.util, sys, time\n"
            f"spec = importlib.util.spec_from_file_location('gpu_lock', {str(_MODULE)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            f"with m.held({key!r}) as ok:\n"
            "    print('held' if ok else 'not held', flush=True)\n"
            f"    time.sleep({seconds})\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_free_lock_is_taken_at_once():
    key = f"test-{uuid.uuid4().hex}"
    began = time.monotonic()
    with _gpu_lock.held(key, wait_s=5.0) as ok:
        assert ok
    assert time.monotonic() - began < 1.0
    with _gpu_lock.held(key, wait_s=0.0) as ok:
        assert ok, "released at the end of the block"


def test_a_second_process_waits_for_the_first():
    key = f"test-{uuid.uuid4().hex}"
    child = _holder(key, 1.0)
    began = time.monotonic()
    with _gpu_lock.held(key, wait_s=30.0) as ok:
        waited = time.monotonic() - began
        assert ok
        assert child.poll() is not None or waited > 0.5, "taken while the other process held it"
    assert 0.3 < waited < 20.0
    child.wait(timeout=30)


def test_a_lock_held_too_long_is_given_up_and_the_timing_runs_anyway():
    key = f"test-{uuid.uuid4().hex}"
    child = _holder(key, 30.0)
    try:
        began = time.monotonic()
        with _gpu_lock.held(key, wait_s=0.3) as ok:
            assert not ok
        assert 0.25 < time.monotonic() - began < 5.0
        with _gpu_lock.held(f"test-{uuid.uuid4().hex}", wait_s=0.0) as other:
            assert other, "another GPU's lock does not wait"
    finally:
        child.kill()
        child.wait(timeout=30)


def test_a_killed_holder_releases_the_lock():
    key = f"test-{uuid.uuid4().hex}"
    child = _holder(key, 60.0)
    child.kill()
    child.wait(timeout=30)
    with _gpu_lock.held(key, wait_s=5.0) as ok:
        assert ok


def test_an_unopenable_lock_file_means_unlocked(monkeypatch, tmp_path):
    monkeypatch.setattr(_gpu_lock, "path_for", lambda key: str(tmp_path / "missing" / "dir" / "x.lock"))
    with _gpu_lock.held("any", wait_s=0.0) as ok:
        assert ok is False


def test_the_key_is_the_devices_uuid_in_a_file_name(monkeypatch):
    import torch

    props = type("Props", (), {"uuid": "GPU-1a2b/3c4d 5e"})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert _gpu_lock.device_key(0) == "gpu-GPU-1a2b3c4d5e"
    props.uuid = ""
    assert _gpu_lock.device_key(3) == "cuda3"
    assert Path(_gpu_lock.path_for("gpu-x")).name == "cudnorm-timing-gpu-x.lock"
