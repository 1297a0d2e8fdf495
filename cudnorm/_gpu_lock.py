"""One process at a time times cuDNN's candidate plans on a GPU: a lock file per device.

Autotuning picks a plan by timing the candidates on the GPU, and the pick is stored for good
(the plan store). Between any two runs of the width sweep, cuDNN's own timing moved by more
than 15% in 20-29 of the 632 cells at 2^25 elements, mostly forwards (the graphs autotuned),
while PyTorch's moved in none: the picks differ from run to run. The sweep builds its plans in
12 processes at once, so each timed its candidates beside the others' work on the GPU
(docs/performance.md, width sweep). Processes on other GPUs do not wait: the lock is keyed by the device's UUID.

The lock is an advisory ``flock`` on a file in the temporary directory; the system releases it
when its process ends, however it ends. Where there is no ``flock`` (Windows) or the file
cannot be opened (another user's), the timing runs unlocked, as it did before.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; timing runs unlocked
    fcntl = None

# The longest a process waits for another's timing before it times its own regardless: tuning a
# graph of 2^30 elements took 8-12 s (docs/performance.md, Decisions, AUTOTUNE_MAX_ELEMENTS), a
# queue of a few such graphs from other processes fits; a process that hangs holding the lock
# must not stall every other one for good.
WAIT_S = 120.0
_POLL_S = 0.005


def device_key(device_index: int) -> str:
    """A name for the GPU ``device_index`` that every process shares, whatever its
    ``CUDA_VISIBLE_DEVICES``: the device's UUID (its index where torch gives no UUID)."""
    import torch  # noqa: PLC0415 - only a timing process, which has CUDA, asks

    uuid = re.sub(r"[^A-Za-z0-9_.-]", "", str(getattr(torch.cuda.get_device_properties(device_index), "uuid", "")))
    return f"gpu-{uuid}" if uuid else f"cuda{device_index}"


def path_for(key: str) -> str:
    """The lock file of ``key``."""
    return os.path.join(tempfile.gettempdir(), f"cudnorm-timing-{key}.lock")


@contextlib.contextmanager
def held(key: str, *, wait_s: float = WAIT_S) -> Iterator[bool]:
    """Hold the timing lock of ``key`` for the ``with`` block; yields whether it is held
    (False where ``wait_s`` passed while another process held it, or no lock can be taken)."""
    if fcntl is None:
        yield False
        return
    try:
        fd = os.open(path_for(key), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield False
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except OSError:
                if time.monotonic() >= deadline:
                    locked = False
                    break
                time.sleep(_POLL_S)
        try:
            yield locked
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
