"""Host-to-host copies of the local transport: parallel reads, digests in the same pass.

A pull whose source and destination are both host memory is a copy from the
source's memfds into the destination tensors. :class:`HostCopier` runs each chunk of
the plan on a few threads (``pread`` releases the GIL; see
:meth:`~modelexpress.local.memory.HostMapping.read_into` for why not a copy from the
mapping). Digests are checked one of two ways:

* :class:`DigestsInPass` (xxh3, blake2b: hashes that stream): each tensor's part of a
  chunk goes to one thread, which reads it in pieces of :data:`_HOT_PIECE_BYTES` and
  feeds each piece to the tensor's hasher while it is still in the CPU's cache; a
  second pass over the landed bytes reads them back from memory (``pread_n`` against
  the pull in bench/local.py --host; docs/benchmarks.md, "Local transport on host
  memory").
* :class:`DigestsAlongside` (the others, e.g. ``wsum-i32-v1`` of a GPU source): each
  tensor's digest as soon as its last byte has landed, on its own threads, while the
  next chunks are copied::

    chunk k:   [ copy: pieces over N threads ] ─> landed(done) ─> digest jobs of the
    chunk k+1:                                   [ copy ... ]     tensors now complete
    end:       wait for the last digest jobs (the tail the pull still waits for)

Chunks are the plan's (in source-address order, so the bytes done after a chunk are
a prefix of the tensors in that order); stop, deadline and liveness are still checked
between chunks by the caller. A chunk's threads all finish before the next chunk
starts, so a tensor spanning chunks is fed to its hasher in order.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import ctypes
import errno
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from modelexpress.errors import IntegrityError

if TYPE_CHECKING:
    import torch

    from modelexpress.local.memory import HostMapping

__all__ = ["DigestsAlongside", "DigestsInPass", "HostCopier", "copy_threads",
           "digest_items", "digests_for"]

log = logging.getLogger(__name__)

# A chunk's copies are cut into pieces of at most this many bytes, so that one large
# tensor spreads over every thread; smaller copies are dealt out whole.
_PIECE_BYTES = 8 << 20
_MAX_THREADS = 8
# Below this a chunk is copied on the calling thread: handing it out costs more.
_INLINE_BYTES = 1 << 20
# Read-then-hash step of DigestsInPass: small enough to stay in a core's L2 cache.
_HOT_PIECE_BYTES = 1 << 20


_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE = os.sysconf("SC_PAGE_SIZE")
_mincore = _libc.mincore
_mincore.restype = ctypes.c_int
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_prefault_ok = True  # cleared where the kernel does not know MADV_POPULATE_WRITE


def _prefault(addr: int, nbytes: int) -> None:
    """Fault in the destination pages of ``[addr, +nbytes)`` writable before a read
    from a memfd lands there, if they are not there yet (a fresh allocation).

    Not before a read from a file's page cache (``HostMapping.from_file``): there the
    faults taken inside the read cost less than populating first, which writes the new
    pages once more (bench/local.py --host, fresh-process rows).

    New memory costs a fault per page, more than the copy itself on the CI machine,
    and faults taken inside ``pread``'s copy cost more than this populate at best
    (bench/local.py --host; docs/benchmarks.md, "Local transport on host memory").
    Huge pages (``MADV_HUGEPAGE`` first) were measured too and are not asked for:
    on the CI machine (a VM) they were twice as fast at best and slower at the
    median. On touched memory the populate would be a page-table walk for nothing,
    hence the probe (``mincore`` of one page). No byte changes. Best effort: an
    error only means the read faults the pages in itself."""
    global _prefault_ok
    if not _prefault_ok or nbytes <= 0:
        return
    start = addr & ~(_PAGE - 1)
    vec = ctypes.c_ubyte(0)
    # ORDER: the probe is the middle page: the first may be shared with the tensor
    # before, landed already.
    if _mincore((addr + nbytes // 2) & ~(_PAGE - 1), _PAGE, ctypes.byref(vec)) == 0 \
            and vec.value & 1:
        return
    if _madvise(start, (addr + nbytes - start + _PAGE - 1) & ~(_PAGE - 1),
                _MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == errno.EINVAL:
        _prefault_ok = False


_pool_lock = threading.Lock()
_pool: "tuple[int, concurrent.futures.ThreadPoolExecutor] | None" = None  # (pid, pool)


def _copy_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's copy threads, started at its first parallel copy and kept.

    Why kept: starting a thread costs ~0.4 ms on the CI machine (``Thread.start``
    waits for the new thread to run), and a pool per pull started two of them for a
    70 MB pull that copies in ~4 ms (profiled: bench/local.py --host, docs/benchmarks.md).
    Idle threads wait on the pool's queue and cost nothing. Several pulls of one process
    share them; a lane never waits for another lane, so sharing cannot deadlock. A
    forked child gets a pool of its own (the parent's threads do not exist there)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                _MAX_THREADS - 1, thread_name_prefix="mx-local-copy"))
        return _pool[1]


def _forget_pool_in_child() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # the lock may have been held at the fork


os.register_at_fork(after_in_child=_forget_pool_in_child)


def copy_threads() -> int:
    """Threads a host copy uses: the CPUs this process may run on, at most 8 (a cap:
    a copy is bound by memory bandwidth; more threads were not measured)."""
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

    def copy(self, copies: Sequence[tuple[int, int, int, int]],
             in_pass: "DigestsInPass | None" = None) -> None:
        """Copy every run (hashing each tensor's bytes as they land when ``in_pass``);
        returns once all landed.

        Raises:
            BackendError: a read failed (after every other piece has finished: nothing
                still writes into the destination when this returns or raises).
        """
        total = sum(c[3] for c in copies)
        post: list[Any] = []
        if in_pass is not None:
            lanes, post = in_pass.lanes(copies, 1 if total < _INLINE_BYTES else self.threads)
            work: Any = in_pass.run_lane
        else:
            lanes = [copies] if self.threads == 1 or total < _INLINE_BYTES else self._deal(copies)
            work = self._lane
        if len(lanes) <= 1:
            for lane in lanes:
                work(self.mapping, lane)
        else:
            # The calling thread copies the first lane itself, the process's copy
            # threads the others: no thread is started or woken for the first lane.
            futures = [_copy_pool().submit(work, self.mapping, lane) for lane in lanes[1:]]
            failed: BaseException | None = None
            try:
                work(self.mapping, lanes[0])
            except BaseException as exc:  # noqa: BLE001 - raised below, after the others
                failed = exc
            # ORDER: wait for every piece before raising, so a failed piece never leaves
            # another one writing into memory the caller is about to reuse or free.
            concurrent.futures.wait(futures)
            if failed is not None:
                raise failed
            for f in futures:
                f.result()
        if post:
            assert in_pass is not None
            in_pass.feed(post)

    @staticmethod
    def _lane(mapping: "HostMapping", copies: Sequence[tuple[int, int, int, int]]) -> None:
        read = mapping.read_into
        for seg, off, dst, n in copies:
            if not mapping.from_file(seg):
                _prefault(dst, n)
            read(seg, off, dst, n)

    def close(self) -> None:
        """(Nothing to release: the copy threads are the process's, see
        :func:`_copy_pool`; a copy has returned only once all its pieces finished.)"""


class _Stream:
    """One destination tensor's hasher and how many of its bytes it was fed."""

    __slots__ = ("name", "base", "nbytes", "want", "h", "view", "fed")

    def __init__(self, name: str, tensor: "torch.Tensor", want: str, h: Any) -> None:
        self.name, self.want, self.h = name, want, h
        self.base = tensor.data_ptr()
        self.nbytes = tensor.numel() * tensor.element_size()
        # A view of the destination's bytes by address (the tensor is contiguous host
        # memory, kept alive by the caller): ~2 us, where torch's view + numpy took
        # ~15 us a tensor, a third of a millisecond of a 70 MB pull's set-up.
        self.view = (memoryview((ctypes.c_ubyte * self.nbytes).from_address(self.base))
                     if self.nbytes else memoryview(b""))
        self.fed = 0


class DigestsInPass:
    """Per-tensor streaming hashers that the copy threads feed while copying.

    Args:
        algorithm: the manifest's digest algorithm (it must have a
            :func:`~modelexpress.transfer.digest.hasher`).
        order: matched pairs in copy order (``_plan``'s: by source address).
        tensors: the destinations.
        peer: names the source in errors.
    """

    hot = True

    def __init__(self, algorithm: str, order: Sequence[Any],
                 tensors: Mapping[str, "torch.Tensor"], peer: str) -> None:
        from modelexpress.transfer.digest import hasher
        self.algorithm, self.peer = algorithm, peer
        self._streams = [_Stream(p.name, tensors[p.name], p.remote.digest, hasher(algorithm))
                         for p in order if p.remote.digest is not None]
        # Destination ranges, sorted, to find the tensor a copied byte lands in.
        ranges = sorted((st.base, st.base + st.nbytes, i) for i, st in enumerate(self._streams)
                        if st.nbytes)
        self._bases = [r[0] for r in ranges]
        self._ranges = ranges

    def lanes(self, copies: Sequence[tuple[int, int, int, int]], threads: int
              ) -> tuple[list[list[Any]], list[tuple[_Stream, int, int]]]:
        """The chunk's runs cut at tensor boundaries, each tensor's part given whole to
        one lane (largest first, to the least loaded lane); and the parts to hash after
        the copy (:meth:`feed`)."""
        parts: list[tuple[int, int, int, int, _Stream | None]] = []
        for seg, off, dst, n in copies:
            pos = 0
            while pos < n:
                stream, until = self._stream_at(dst + pos)
                take = min(n - pos, until - (dst + pos))
                parts.append((seg, off + pos, dst + pos, take, stream))
                pos += take
        units: dict[int, list[Any]] = {}  # a tensor's parts stay on one lane
        for part in parts:
            units.setdefault(id(part[4]) if part[4] is not None else -len(units) - 1,
                             []).append(part)
        ordered = sorted(units.values(), key=lambda u: -sum(p[3] for p in u))
        total = sum(p[3] for p in parts)
        threads = max(1, threads)
        post: list[tuple[_Stream, int, int]] = []
        if threads > 1 and ordered and sum(p[3] for p in ordered[0]) > 1.25 * total / threads:
            # One tensor outweighs a lane's share: on one lane it would copy at one
            # thread's speed. Its bytes are copied on every lane instead and hashed after
            # the chunk, in order, on the calling thread (from memory: slower per byte
            # than in the pass, faster than a copy at half speed).
            big = ordered.pop(0)
            post = [(p[4], p[2], p[3]) for p in big if p[4] is not None]
            for seg, off, dst, n, _ in big:
                step = -(-n // threads)
                ordered.extend([[(seg, off + a, dst + a, min(step, n - a), None)]
                                for a in range(0, n, step)])
        lanes: list[list[Any]] = [[] for _ in range(threads)]
        load = [0] * len(lanes)
        for unit in ordered:
            k = load.index(min(load))
            lanes[k].extend(unit)
            load[k] += sum(p[3] for p in unit)
        for lane in lanes:
            lane.sort(key=lambda p: p[2])  # ORDER: a tensor's bytes reach its hasher in order
        return [lane for lane in lanes if lane], post

    @staticmethod
    def feed(post: Sequence[tuple[_Stream, int, int]]) -> None:
        """Hash parts copied without hashing (see :meth:`lanes`), in order."""
        for stream, dst, n in post:
            at = dst - stream.base
            assert at == stream.fed, "a tensor's bytes were hashed out of order"
            stream.h.update(stream.view[at:at + n])
            stream.fed += n

    def _stream_at(self, addr: int) -> tuple[_Stream | None, int]:
        """The stream whose tensor holds ``addr`` (None: bytes of no digested tensor) and
        where that stops (its tensor's end, or the next digested tensor's start)."""
        k = bisect.bisect_right(self._bases, addr) - 1
        if k >= 0 and addr < self._ranges[k][1]:
            return self._streams[self._ranges[k][2]], self._ranges[k][1]
        nxt = self._bases[k + 1] if k + 1 < len(self._bases) else 1 << 64
        return None, nxt

    @staticmethod
    def run_lane(mapping: "HostMapping", parts: Sequence[Any]) -> None:
        read = mapping.read_into
        for seg, off, dst, n, stream in parts:
            if not mapping.from_file(seg):
                _prefault(dst, n)
            pos = 0
            while pos < n:
                take = min(_HOT_PIECE_BYTES, n - pos)
                read(seg, off + pos, dst + pos, take)
                if stream is not None:
                    at = dst + pos - stream.base
                    assert at == stream.fed, "a tensor's bytes were hashed out of order"
                    stream.h.update(stream.view[at:at + take])
                    stream.fed += take
                pos += take

    def landed(self, done: int) -> None:
        """(Interface of :class:`DigestsAlongside`; nothing to do here.)"""

    def finish(self) -> int:
        """Compare every tensor's digest.

        Returns:
            The number of tensors verified.

        Raises:
            IntegrityError: a digest did not match, or a tensor was not fully fed.
        """
        from modelexpress.transfer.digest import stream_digest
        bad = [(s.name, s.want, stream_digest(s.h, s.fed) if s.fed == s.nbytes else
                f"(only {s.fed} of {s.nbytes} bytes hashed)") for s in self._streams]
        bad = [b for b in bad if b[1] != b[2]]
        if bad:
            raise _mismatch(bad, self.algorithm, self.peer)
        return len(self._streams)

    def close(self) -> None:
        """(Nothing to release.)"""


def _mismatch(bad: Sequence[tuple[str, str, str]], algorithm: str, peer: str) -> IntegrityError:
    name, want, have = bad[0]
    return IntegrityError(f"{len(bad)} tensor(s) from {peer} failed its {algorithm} digest "
                          f"check, e.g. {name!r}: expected {want}, got {have}; the source's "
                          "memory changed or a copy failed: try another source")


def digests_for(algorithm: str, order: Sequence[Any], tensors: Mapping[str, "torch.Tensor"],
                peer: str) -> "DigestsInPass | DigestsAlongside":
    """:class:`DigestsInPass` where ``algorithm`` streams, else :class:`DigestsAlongside`."""
    from modelexpress.transfer.digest import hasher
    if hasher(algorithm) is not None:
        return DigestsInPass(algorithm, order, tensors, peer)
    return DigestsAlongside(algorithm, digest_items(order, tensors), peer)


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

    hot = False

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
            raise _mismatch(bad, self.algorithm, self.peer)
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
