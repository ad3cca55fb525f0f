"""The receive-rate cap (pulls and agents alike): its clock starts with the data plane."""
from __future__ import annotations

import time

import pytest

from modelexpress.errors import TransferTimeoutError
from modelexpress.p2p.tracking import RateCap


def _cap(max_gbps: float = 1.0, deadline_s: float = 600.0) -> RateCap:
    return RateCap(max_gbps, lambda: False, time.monotonic() + deadline_s, deadline_s)


def test_setup_time_is_not_credit_for_the_cap() -> None:
    cap = _cap()
    time.sleep(0.2)  # source lookup, allocation, the agent's start: before start()
    assert cap.ahead(1_000_000_000) == 0.0  # nothing moved yet: nothing to hold
    cap.start()
    # 1 GB at a 1 GB/s cap right after the first READ: about a second ahead
    assert 0.5 < cap.ahead(1_000_000_000) <= 1.0


def test_start_is_idempotent_the_first_read_starts_the_clock() -> None:
    cap = _cap()
    cap.start()
    first = cap.started
    time.sleep(0.05)
    cap.start()  # a second source (a retry, a stripe) does not reset the clock
    assert cap.started == first


def test_no_cap_never_holds() -> None:
    cap = _cap(max_gbps=0.0)
    cap.start()
    assert cap.ahead(10**12) == 0.0
    cap.wait(10**12)  # returns at once


def test_a_cap_the_deadline_cannot_meet_times_out() -> None:
    cap = _cap(max_gbps=1.0, deadline_s=0.2)
    cap.start()
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="MX_TRANSFER_MAX_GBPS"):
        cap.wait(10 * 10**9)  # 10 s ahead, 0.2 s left
    assert time.monotonic() - t0 < 5.0
