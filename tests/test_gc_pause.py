"""``modelexpress._gc.paused``: the cyclic collector held off for a block, and back."""

from __future__ import annotations

import gc
import threading

from modelexpress._gc import paused


def test_the_collector_is_off_inside_and_back_on_after_even_on_an_error() -> None:
    assert gc.isenabled()
    with paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with paused():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()


def test_blocks_in_two_threads_nest_and_a_collector_that_was_off_stays_off() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with paused():
            inside.set()
            assert leave.wait(10)

    thread = threading.Thread(target=other)
    with paused():
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's block still runs
    leave.set()
    thread.join(10)
    assert not thread.is_alive() and gc.isenabled()
    gc.disable()
    try:
        with paused():
            pass
        assert not gc.isenabled()  # it was off before: left off
    finally:
        gc.enable()
