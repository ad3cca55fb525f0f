"""Host-to-host copies of the local transport: parallel reads, digests alongside.

A pull whose source and destination are both host memory is a copy from the
source's memfds into the destination tensors. :class:`HostCopier` runs each chunk of
the plan on a few threads (``pread`` releases the GIL; see
:meth:`~modelexpress.local.memory.HostMapping.read_into` for why not a copy from the
mapping), and :class:`DigestsAlongside` checks each tensor's digest as soon as its last
byte has landed, on its own threads, while the next chunks are copied::

    chunk k:   [ copy: pieces over N threads ] ─> landed(done) ─> digest jobs of the
    chunk k+1:                                   [ copy ... ]     tensors now complete
    end:       wait for the last digest jobs (the tail the pull still waits for)

Chunks are the plan's (in source-address order, so the bytes done after a chunk are
a prefix of the tensors in that order); stop, deadline and liveness are still checked
between chunks by the caller.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from modelexpress.errors import IntegrityError

if TYPE_CHECKING:
    import torch

    from modelexpress.local.memory import HostMapping

__all__ = ["DigestsAlongside", "HostCopier", "copy_threads", "digest_items"]

log = logging.getLogger(__name__)

# A chunk's copies are cut into pieces of at most this many bytes, so that one large
# tensor spreads over every thread; smaller copies are dealt out whole.
_PIECE_BYTES = 8 << 20
_MAX_THREADS = 8
# Below this a chunk is copied on the calling thread: handing it out costs more.
_INLINE_BYTES = 1 << 20


def copy_threads() -> int:
    """Threads a host copy uses: the CPUs this process may run on, at most 8 (a copy
    is bound by memory bandwidth long before that)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, n))


class HostCopier:
    """Copies ``(segment, offset, dst_addr, nbytes)`` runs out of a :class:`HostMapping`.

    Args:
        mapping: the received memfds.
        threads: copy threads (default :func:`copy_threads`).
    """

    def __init__(self, mapping: "HostMapping", threads: int | None = None) -> None:
        self.mapping = mapping
        self.threads = threads or copy_threads()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _deal(self, copies: Sequence[tuple[int, int, int, int]]) -> list[list[tuple[int, int, int, int]]]:
        """Pieces dealt to the threads, about the same bytes each, in address order."""
        total = sum(c[3] for c in copies)
        share = -(-total // self.threads)
        piece = max(1, min(_PIECE_BYTES, share))
        lanes: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self.threads)]
        filled = [0] * self.threads
        lane = 0
        for seg, off, dst, n in copies:
            pos = 0
            while pos < n:
                take = min(piece, n - pos)
                lanes[lane].append((seg, off + pos, dst + pos, take))
                filled[lane] += take
                pos += take
                if filled[lane] >= share and lane < self.threads - 1:
                    lane += 1
        return [lane for lane in lanes if lane]

    def copy(self, copies: Sequence[tuple[int, int, int, int]]) -> None:
        """Copy every run; returns once all landed.

        Raises:
            BackendError: a read failed (after every other piece has finished: nothing
                still writes into the destination when this returns or raises).
        """
        total = sum(c[3] for c in copies)
        if self.threads == 1 or total < _INLINE_BYTES:
            self._lane(copies)
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="mx-local-copy")
        futures = [self._pool.submit(self._lane, lane) for lane in self._deal(copies)]
        # ORDER: wait for every piece before raising, so a failed piece never leaves
        # another one writing into memory the caller is about to reuse or free.
        concurrent.futures.wait(futures)
        for f in futures:
            f.result()

    def _lane(self, copies: Sequence[tuple[int, int, int, int]]) -> None:
        read = self.mapping.read_into
        for seg, off, dst, n in copies:
            read(seg, off, dst, n)

    def close(self) -> None:
        """Stop the threads (waits for running copies). Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class DigestsAlongside:
    """Checks digests of tensors as their bytes land, on background threads.

    Args:
        algorithm: the manifest's digest algorithm.
        items: ``(end, name, tensor, expected)`` in landing order: ``end`` is the bytes
            done (in the copy's order) once the tensor has fully landed.
        peer: names the source in errors.
        threads: digest threads (default :func:`copy_threads`; xxh3 and blake2b release
            the GIL).
    """

    def __init__(self, algorithm: str, items: Sequence[tuple[int, str, "torch.Tensor", str]],
                 peer: str, threads: int | None = None) -> None:
        self.algorithm = algorithm
        self.peer = peer
        self._items = list(items)
        self._next = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads or copy_threads(), thread_name_prefix="mx-local-digest")
        self._futures: list[concurrent.futures.Future[tuple[str, str, str]]] = []
        self._lock = threading.Lock()

    def landed(self, done: int) -> None:
        """``done`` bytes have landed: start the digests of the tensors now complete."""
        while self._next < len(self._items) and self._items[self._next][0] <= done:
            _, name, tensor, want = self._items[self._next]
            self._futures.append(self._pool.submit(self._one, name, tensor, want))
            self._next += 1

    def _one(self, name: str, tensor: "torch.Tensor", want: str) -> tuple[str, str, str]:
        from modelexpress.transfer.digest import digest_many
        return name, want, digest_many([tensor], self.algorithm)[0]

    def finish(self) -> int:
        """Digest what is left, wait for every job, compare.

        Returns:
            The number of tensors verified.

        Raises:
            IntegrityError: a digest did not match (the first mismatch is named).
        """
        self.landed(1 << 62)
        try:
            results = [f.result() for f in self._futures]
        finally:
            self.close()
        bad = [(name, want, got) for name, want, got in results if got != want]
        if bad:
            name, want, have = bad[0]
            raise IntegrityError(f"{len(bad)} tensor(s) from {self.peer} failed its "
                                 f"{self.algorithm} digest check, e.g. {name!r}: expected "
                                 f"{want}, got {have}; the source's memory changed or a copy "
                                 "failed: try another source")
        return len(results)

    def close(self) -> None:
        """Drop jobs not started, wait for running ones. Idempotent."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def digest_items(order: Sequence[Any], tensors: Mapping[str, "torch.Tensor"]
                 ) -> list[tuple[int, str, "torch.Tensor", str]]:
    """:class:`DigestsAlongside` items of matched pairs in copy order (pairs with a
    source digest only; a pair's ``end`` counts every byte before it in that order)."""
    items, end = [], 0
    for p in order:
        end += p.remote.nbytes
        if p.remote.digest is not None:
            items.append((end, p.name, tensors[p.name], p.remote.digest))
    return items
