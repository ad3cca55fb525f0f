"""modelexpress._threads: the process's kept worker threads and run_shared."""

from __future__ import annotations

import os
import threading
import time

import pytest

from modelexpress import _threads


def test_run_shared_returns_results_in_order_from_several_threads() -> None:
    seen: set[int] = set()

    def work(x: int) -> int:
        seen.add(threading.get_ident())
        time.sleep(0.002)  # long enough that a second thread takes items too
        return x * x

    assert _threads.run_shared(list(range(40)), work, threads=2) == [x * x for x in range(40)]
    assert len(seen) == 2  # the caller and one pool thread
    assert _threads.run_shared([], work) == []


def test_run_shared_raises_the_error_only_after_every_item_finished() -> None:
    finished: list[int] = []

    def work(x: int) -> int:
        if x == 3:
            raise ValueError("item 3")
        time.sleep(0.001)
        finished.append(x)
        return x

    with pytest.raises(ValueError, match="item 3"):
        _threads.run_shared(list(range(30)), work, threads=3)
    assert sorted(finished) == [x for x in range(30) if x != 3]


def test_run_shared_from_a_pool_thread_does_not_wait_for_busy_pool_threads() -> None:
    """Nested use (a digest batch hashed from a copy thread): the caller takes every
    item no other thread took, so it finishes even with every pool thread blocked."""
    release = threading.Event()
    blockers = [_threads.pool().submit(release.wait, 30) for _ in range(_threads.MAX_THREADS - 1)]
    try:
        inner = _threads.pool().submit(lambda: "queued")  # behind the blockers
        assert _threads.run_shared(list(range(10)), lambda x: x + 1, threads=4) == \
            list(range(1, 11))
        assert not inner.done()
    finally:
        release.set()
    for b in blockers:
        b.result(timeout=30)
    assert inner.result(timeout=30) == "queued"


def test_a_forked_child_gets_a_pool_of_its_own() -> None:
    parent = _threads.pool()
    pid = os.fork()
    if pid == 0:  # child: the parent's threads do not exist here
        code = 0
        try:
            child = _threads.pool()
            code = 0 if child is not parent and child.submit(lambda: 7).result(10) == 7 else 1
        except BaseException:  # noqa: BLE001 - any failure is the exit code
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
