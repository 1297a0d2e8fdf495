"""cudnorm._sleep_timing: a burst whose leading GPU sleep the host outlasted is timed again
behind a longer sleep, and one still uncovered is reported so (on a CPU: fake events)."""

import time

import pytest
import torch

from cudnorm import _sleep_timing


class _Events:
    """Stands in for torch.cuda.Event and _sleep: the GPU reaches each burst's start event
    before the host finishes enqueueing (``query`` True) for the first ``uncovered`` bursts."""

    def __init__(self, uncovered: int):
        self.uncovered, self.starts, self.sleeps = uncovered, 0, []

    def event(self, enable_timing=True):
        events = self

        class Event:
            def record(self, stream=None):
                self.start = not hasattr(events, "_open")
                if self.start:
                    events._open, self.n = True, events.starts
                    events.starts += 1
                else:
                    del events._open

            def query(self):
                return self.n < events.uncovered

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return 10.0 if self.n < events.uncovered else 1.0  # waits on the host inflate it

        return Event()


@pytest.fixture
def fake(monkeypatch):
    def install(uncovered):
        events = _Events(uncovered)
        monkeypatch.setattr(torch.cuda, "Event", events.event)
        monkeypatch.setattr(torch.cuda, "_sleep", events.sleeps.append)
        return events
    return install


def test_a_covered_burst_is_timed_once(fake):
    events = fake(0)
    burst = _sleep_timing.timed_burst(lambda: None, 2.0)
    assert burst == (1.0, burst.host_ms, True) and events.starts == 1
    assert events.sleeps == [int(_sleep_timing.SLEEP_CYCLES_PER_MS * (_sleep_timing.SLEEP_FACTOR * 2.0
                                                                      + _sleep_timing.SLEEP_MARGIN_MS))]


def test_an_uncovered_burst_is_timed_again_behind_a_longer_sleep(fake):
    events = fake(1)
    burst = _sleep_timing.timed_burst(lambda: None, 2.0)
    assert burst.covered and burst.gpu_ms == 1.0, "the second burst's time, not the inflated first"
    assert events.starts == 2 and events.sleeps[1] > events.sleeps[0]


def test_a_host_that_keeps_outlasting_the_sleep_is_reported(fake):
    events = fake(99)
    burst = _sleep_timing.timed_burst(lambda: None, 2.0, retries=2)
    assert not burst.covered and events.starts == 3
    assert events.sleeps == sorted(events.sleeps) and len(set(events.sleeps)) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_host_slower_than_its_guess_is_seen_and_covered_again():
    """A burst whose host takes 40x its guess: the GPU reaches the start event early (seen,
    without retries), and the retry behind a sleep sized from the host's time covers it, its
    GPU time then the kernels' alone, not the host's 40 ms."""
    x = torch.zeros(1024, device="cuda")

    def slow_host():
        for _ in range(20):
            x.add_(1.0)
            time.sleep(0.002)

    slow_host()
    torch.cuda.synchronize()
    seen = _sleep_timing.timed_burst(slow_host, 1.0, retries=0)
    assert not seen.covered and seen.host_ms >= 40.0 and seen.gpu_ms > 20.0
    again = _sleep_timing.timed_burst(slow_host, 1.0)
    assert again.covered and again.gpu_ms < 5.0
