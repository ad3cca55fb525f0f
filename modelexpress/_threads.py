"""The process's worker threads for work on bytes (host copies, digests), kept.

One pool of at most ``MAX_THREADS - 1`` threads, started at first use and kept for the
process (a forked child gets its own: the parent's threads do not exist there).
Whoever hands work to it works too (the calling thread takes items like the pool's
threads), so a job never waits for a thread to start, and a job run from a pool
thread cannot deadlock the pool: the caller alone finishes every item no other thread
took, and it waits only for the items other threads have started (:func:`run_shared`).

Why kept: starting a thread costs ~0.4 ms on a 2-core VM (``Thread.start`` waits for
the new thread to run), and a pool per pull started two of them for a 70 MB pull that
copies in ~4 ms (profiled: bench/local.py --host, docs/benchmarks.md). Idle threads wait
on the pool's queue and cost nothing.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["MAX_THREADS", "cpu_threads", "pool", "run_shared"]

# A 16-core host read its page cache at 26 GB/s on 8 threads and 36 GB/s on 16 (pread,
# 1 GiB; a libc memcpy of the same bytes: 34 and 37 GB/s); bytes are bound by memory
# bandwidth before more.
MAX_THREADS = 16

_T = TypeVar("_T")
_R = TypeVar("_R")

_pool_lock = threading.Lock()
_pool: "tuple[int, concurrent.futures.ThreadPoolExecutor] | None" = None  # (pid, pool)


def pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's worker threads (``mx-worker-*``), started at first use and kept."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                MAX_THREADS - 1, thread_name_prefix="mx-worker"))
        return _pool[1]


def _forget_pool_in_child() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # the lock may have been held at the fork


os.register_at_fork(after_in_child=_forget_pool_in_child)


def cpu_threads() -> int:
    """Threads one job on bytes uses: the CPUs this process may run on, at most
    :data:`MAX_THREADS`."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, n))


class _Shared(Generic[_T, _R]):
    """Items taken one at a time, in order, from one counter by every thread that runs
    :meth:`run` (``next`` on an ``itertools.count`` is atomic under the GIL)."""

    def __init__(self, items: Sequence[_T], fn: Callable[[_T], _R]) -> None:
        self.items, self.fn = items, fn
        self.results: list[_R | None] = [None] * len(items)
        self.error: BaseException | None = None
        self._take = itertools.count()
        self._left = len(items)
        self._lock = threading.Lock()
        self.done = threading.Event()
        if not items:
            self.done.set()

    def run(self) -> None:
        n = len(self.items)
        while True:
            k = next(self._take)
            if k >= n:
                return
            try:
                self.results[k] = self.fn(self.items[k])
            except BaseException as exc:  # noqa: BLE001 - re-raised by run_shared
                self.error = self.error or exc
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self.done.set()


def run_shared(items: Sequence[_T], fn: Callable[[_T], _R], threads: int | None = None
               ) -> list[_R]:
    """``[fn(x) for x in items]``, the items spread over the calling thread and up to
    ``threads - 1`` of the pool's threads.

    ``fn`` must not block on other work (it runs on the pool; items that hash or copy
    bytes finish on their own). Every item has finished when this returns or raises.

    Args:
        items: the work, taken in order.
        fn: called once per item.
        threads: at most this many threads (default :func:`cpu_threads`).

    Returns:
        The results, in the items' order.

    Raises:
        BaseException: the first error an item raised (after every item finished).
    """
    job = _Shared(items, fn)
    helpers = min(threads or cpu_threads(), len(items)) - 1
    for _ in range(max(0, helpers)):
        pool().submit(job.run)
    job.run()
    # ORDER: every item is taken once run() returns here; wait for those that other
    # threads took and still run. A helper that starts later finds nothing to take.
    # Items are bounded work on memory (no I/O that can hang), so this wait is too.
    job.done.wait()
    if job.error is not None:
        raise job.error
    return job.results  # type: ignore[return-value] - every slot was filled
