"""GPU time of a burst of calls, with the host's enqueueing hidden behind a GPU sleep.

A burst of calls is timed between two CUDA events. Were the GPU to wait on the host between
calls, the events would time the host's enqueueing, not the GPU's work: a GPU sleep queued
first keeps the GPU busy while the host enqueues, so the calls run back to back once it ends.
The sleep is sized from a guess of the host's time, and a guess can be short (the host
stalled, a first call cost more): :func:`timed_burst` then sees that the GPU reached the
start event before the host finished enqueueing, and times the burst again behind a sleep
sized from what the host just took. Both the dispatcher's measurements
(:mod:`cudnorm._candidates`) and the sweep (:mod:`cudnorm._bench.sweep`) time this way.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import torch

# GPU clock cycles per ms for torch.cuda._sleep (about the H100's and H200's boost clock): the
# sleep only has to outlast the host's enqueueing, so overshooting costs a little GPU time
SLEEP_CYCLES_PER_MS = 2.0e6
# A burst the sleep did not cover is timed again at most this many times, each behind a sleep
# sized from the host time just seen (a host that keeps stalling is reported, not waited out)
RETRIES = 2
# The sleep covers this multiple of the host's guessed enqueueing time, plus a fixed margin (ms)
SLEEP_FACTOR = 1.5
SLEEP_MARGIN_MS = 0.05


class Burst(NamedTuple):
    """One timed burst: ``gpu_ms`` between the events (the whole burst), ``host_ms`` the host's
    enqueueing of it, ``covered`` whether the sleep outlasted that enqueueing (``False``: the
    GPU may have waited on the host, and ``gpu_ms`` may include that wait)."""

    gpu_ms: float
    host_ms: float
    covered: bool


def timed_burst(enqueue: Callable[[], object], host_guess_ms: float, retries: int = RETRIES) -> Burst:
    """Time ``enqueue()`` (which queues a burst of GPU work on the current CUDA stream) between
    CUDA events behind a GPU sleep of :data:`SLEEP_FACTOR` x ``host_guess_ms``
    (the host's expected enqueueing time of the whole burst, ms). Where the GPU reached the
    start event before ``enqueue`` returned, the burst is timed again behind a sleep sized
    from the host time it took, at most ``retries`` times; the last burst is returned."""
    guess, attempt = host_guess_ms, 0
    while True:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(SLEEP_CYCLES_PER_MS * (SLEEP_FACTOR * guess + SLEEP_MARGIN_MS)))
        start.record()
        began = time.perf_counter()
        enqueue()
        host_ms = (time.perf_counter() - began) * 1e3
        # still asleep when the host finished: every call was queued before the GPU reached them
        covered = not start.query()
        end.record()
        end.synchronize()
        if covered or attempt == retries:
            return Burst(start.elapsed_time(end), host_ms, covered)
        guess, attempt = max(host_ms, 2 * guess), attempt + 1
