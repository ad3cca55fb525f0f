"""The agent's receive-rate cap: its clock starts with the data plane, not before."""
from __future__ import annotations

import threading

from modelexpress.p2p.agent import _Reporter


class _RecordingStop(threading.Event):
    """A stop event that records how long the throttle asked to wait (and does not wait)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout if timeout is not None else float("inf"))
        return self.is_set()


class _NoServer:
    def report_progress(self, *args, **kwargs):
        raise AssertionError("interval_s is large: no report is due")


def _reporter(stop: _RecordingStop) -> _Reporter:
    r = _Reporter(_NoServer(), "t", interval_s=1e9, max_gbps=1.0, stop=stop)  # type: ignore[arg-type]
    r.last = r.started  # a report was just sent: none is due for interval_s
    return r


def test_setup_time_is_not_credit_for_the_cap() -> None:
    stop = _RecordingStop()
    r = _reporter(stop)
    r.started -= 5.0  # five seconds of source lookup and allocation before the pull
    r.begin()
    r(done=1_000_000_000, total=4_000_000_000)  # 1 GB at a 1 GB/s cap: ~1 s ahead
    assert len(stop.waits) == 1 and 0.5 < stop.waits[0] <= 1.0


def test_without_begin_setup_time_would_let_a_burst_through() -> None:
    # the failure mode begin() exists for: the clock counted 5 s of setup, so 1 GB
    # passes with no wait at all
    stop = _RecordingStop()
    r = _reporter(stop)
    r.started -= 5.0
    r(done=1_000_000_000, total=4_000_000_000)
    assert stop.waits == []
