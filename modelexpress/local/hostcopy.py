"""Host-to-host copies of the local transport: parallel reads, digests in the same pass.

A pull whose source and destination are both host memory is a copy from the
source's memfds (or its checkpoint file's page cache) into the destination tensors.
:class:`HostCopier` cuts each chunk of the plan into pieces and runs them on a few
threads (``pread``; see :meth:`~modelexpress.local.memory.HostMapping.read_into` for
why not a copy from the mapping); the threads take the pieces in address order, one
at a time, from one shared counter, so a large tensor spreads over every thread and a
thread that is slowed down (a busy core) holds up nothing but its own piece.

Two loops run the pieces. The C loop (``_copyloop``, built with the package) is one
call that releases the GIL, starts its own threads and reads and hashes every piece
without Python; what it cannot finish (a page-cache miss, a read error, a digest it
does not know) it reports, and the Python path finishes it. The Python loop runs the
same pieces on the process's worker threads (``modelexpress._threads``), where the C
loop is not built, and for digests other than xxh3 ones. Why the C loop: in Python each
piece costs GIL-held work on every thread, and a fresh process's 70 MB pull on 16 cores
spent about twice as long copying as plain reads of the same bytes (docs/benchmarks.md,
"Local transport on host memory"). Digests are checked one of two ways:

* :class:`DigestsInPass` (xxh3, blake2b: hashes that stream): a tensor's hasher must
  see its bytes in order, while its pieces land on several threads in any order. The
  thread that lands the piece its tensor's hasher waits for hashes it, and then every
  piece of that tensor landed after it by the others, while the bytes are still in
  the CPU's caches (one hasher per tensor at a time; a thread that finds the hasher
  busy leaves its piece to it and takes the next one)::

    piece k of tensor T lands ─> T's next byte?  yes: hash k, k+1, ... (all landed)
                                                 no:  leave it for T's hasher

  With a block-wise digest (``xxh3-128-b8m`` or, for models under 512 MiB,
  ``xxh3-128-b1m``: the defaults for host tensors) each block of a tensor has a hasher
  of its own and the pieces are cut at block boundaries, so a piece is a block or part
  of one (a chunk ends inside it, or a copy is cut finer than 8 MiB: ``_piece_bytes``):
  the thread that lands it hashes it when it is the block's next, and a large tensor
  is hashed on every thread, not on one after the copy. With 1 MiB blocks (the
  smallest piece) every piece of a small model's copy is a whole block.
  (``bench/local.py --host``; docs/benchmarks.md, "Local transport on host memory").
  The C loop takes the same digests in C, for each range (block) whose pieces all land
  in one copy, with the ``xxhash`` package's own streaming XXH3 (one state per range):
  the same protocol without the GIL, and the thread that takes a range's next piece
  with the range free reads it and hashes it a step (256 KiB) at a time, while the
  bytes are in its core's cache. Hashing each range whole once its last piece had
  landed cost a tail of whole 8 MiB blocks read back from the shared cache (on the
  16-core host a verified 70 MB pull into touched memory spent 1.6 ms hashing over a
  2.1 ms copy; 1.1 ms fed in order). Its threads take the pieces of such ranges by
  rank (every range's first piece, then every range's second, ...: ``INTERLEAVE``),
  so that a range's pieces land one after another across the copy, not all at once
  with one thread left to feed the rest. Where the package exports no streaming
  functions the C loop still hashes ranges whole. A range a chunk end cuts is fed to
  its Python hasher as above. The C loop is handed every range of the pull and writes
  each digest it takes into one buffer, by range, so that a tensor's blocks' digests
  are one slice of it; Python makes a hasher only for a range it feeds itself.
* :class:`DigestsAlongside` (the others, e.g. ``wsum-i32-v1`` of a GPU source): each
  tensor's digest as soon as its last byte has landed, on its own threads, while the
  next chunks are copied::

    chunk k:   [ copy: pieces over N threads ] ─> landed(done) ─> digest jobs of the
    chunk k+1:                                   [ copy ... ]     tensors now complete
    end:       wait for the last digest jobs (the tail the pull still waits for)

Chunks are the plan's (in source-address order, so the bytes done after a chunk are
a prefix of the tensors in that order); stop, deadline and liveness are still checked
between chunks by the caller. Every piece of a chunk has landed, and been hashed,
before :meth:`HostCopier.copy` returns.
"""

from __future__ import annotations

import array
import bisect
import concurrent.futures
import ctypes
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from modelexpress import _threads
from modelexpress._optional import Extension
from modelexpress.errors import IntegrityError
from modelexpress.local import pages

# Not built (no C compiler at install) or not loadable here: the Python loop copies the
# same pieces, and the first host copy of the process says so, once.
COPYLOOP = Extension("modelexpress.local._copyloop",
                     "host copies of the local transport run in Python threads (slower "
                     "on many cores)")
_copyloop = COPYLOOP.module

if TYPE_CHECKING:
    import torch

    from modelexpress.local.hugepages import HugePages
    from modelexpress.local.memory import HostMapping

__all__ = ["DigestsAlongside", "DigestsInPass", "HostCopier", "Rows", "copy_threads",
           "digest_items", "digests_for"]

log = logging.getLogger(__name__)

# A chunk's copies are cut into pieces of at most this many bytes, so that one large
# tensor spreads over every thread; smaller copies are pieces of their own. In the
# Python loop a piece costs some GIL-held Python that every thread shares, so pieces
# stay this large where they can (a 1 GiB pull was slower in smaller ones on the
# 16-core host; docs/benchmarks.md). The blocks of a large model's default digest
# (xxh3-128-b8m) are as large, so a piece of a large copy is one of its blocks; a model
# small enough for finer pieces has 1 MiB blocks (xxh3-128-b1m: digest.FINE_BELOW).
_PIECE_BYTES = 8 << 20
# A copy too small to give each thread several pieces of _PIECE_BYTES is cut finer,
# down to this, where the pieces are cheap (the C loop) or the destination is new
# memory (its page faults spread over every thread: a 70 MB pull on 16 threads in 8 MiB
# pieces had 9 threads faulting and 7 idle). The Python loop into touched memory keeps
# whole pieces: there a piece copies in well under 1 ms and its Python costs more than
# the idle threads do (_piece_bytes; bench/local.py --host, docs/benchmarks.md).
_MIN_PIECE_BYTES = 1 << 20
_PIECES_PER_THREAD = 4
# Below this a chunk is copied on the calling thread: handing it out costs more.
_INLINE_BYTES = 1 << 20


# Whether copies run the C piece loop (``_copyloop``: reads and xxh3 digests without
# the GIL) where it is built; False runs the same pieces in Python threads
# (bench/local.py --host measures both: its *_pyloop rows; tests/local/_peers.py).
NATIVE = _copyloop is not None
# Whether the C loop takes the pieces of ranges it feeds in order by their rank in the
# range (the first piece of each range, then the second, ...) rather than in address
# order: fewer pieces fed from the shared cache at the end (_copyloop.c, run()). False
# only for an A/B of the two in one run.
INTERLEAVE = True
_FILE, _PREFAULT = 1, 2  # _copyloop's piece flags


class _XXH128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


# A test input past xxh3's short-input paths, and the package's digest of it.
_PROBE = bytes(range(256)) * 9 + b"mx"


@functools.cache
def _xxhash_lib() -> tuple[Any, bytes] | None:
    """The ``xxhash`` package's own library (ctypes) and its ``xxh3_128`` of
    :data:`_PROBE`, which every function taken from the library must give; None where
    it cannot be loaded."""
    try:
        import xxhash
        from xxhash import _xxhash
        return ctypes.CDLL(_xxhash.__file__), xxhash.xxh3_128(_PROBE).digest()
    except (ImportError, OSError, AttributeError):
        return None


def _canonical(h: "_XXH128") -> bytes:
    return h.high64.to_bytes(8, "big") + h.low64.to_bytes(8, "big")


@functools.cache
def _xxh3_address() -> int:
    """The address of the ``xxhash`` package's own ``XXH3_128bits`` (its runtime-
    dispatched build where it exports one), once it gave the package's digest of a
    test input; 0 where there is none (the C loop then copies only where nothing is
    hashed)."""
    loaded = _xxhash_lib()
    if loaded is None:
        return 0
    lib, want = loaded
    for name in ("XXH3_128bits_dispatch", "XXH3_128bits"):
        fn = getattr(lib, name, None)  # None: not exported by this build
        if fn is None:
            continue
        fn.restype, fn.argtypes = _XXH128, [ctypes.c_char_p, ctypes.c_size_t]
        if _canonical(fn(_PROBE, len(_PROBE))) == want:
            return ctypes.cast(fn, ctypes.c_void_p).value or 0
        log.warning("the xxhash package's %s disagrees with its xxh3_128: host copies "
                    "hash in Python", name)
    return 0


@functools.cache
def _xxh3_stream_functions() -> tuple[int, int, int, int, int] | None:
    """The addresses of the ``xxhash`` package's own ``XXH3_createState``,
    ``XXH3_freeState``, ``XXH3_128bits_reset``, ``XXH3_128bits_update`` (its runtime-
    dispatched build where it exports one) and ``XXH3_128bits_digest``, once they gave
    the package's digest of a test input fed in three parts; None where there are none
    (the C loop then hashes each range whole once its last piece has landed)."""
    loaded = _xxhash_lib()
    if loaded is None:
        return None
    lib, want = loaded
    try:
        create, free, reset, digest = (lib.XXH3_createState, lib.XXH3_freeState,
                                       lib.XXH3_128bits_reset, lib.XXH3_128bits_digest)
        update = getattr(lib, "XXH3_128bits_update_dispatch", None) or lib.XXH3_128bits_update
    except AttributeError:  # not exported by this build
        return None
    create.restype, create.argtypes = ctypes.c_void_p, []
    free.restype, free.argtypes = ctypes.c_int, [ctypes.c_void_p]
    reset.restype, reset.argtypes = ctypes.c_int, [ctypes.c_void_p]
    update.restype = ctypes.c_int
    update.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    digest.restype, digest.argtypes = _XXH128, [ctypes.c_void_p]
    state = create()
    if not state:
        return None
    try:
        if reset(state) != 0:
            return None
        for part in (_PROBE[:100], _PROBE[100:1500], _PROBE[1500:]):
            if update(state, part, len(part)) != 0:
                return None
        got = _canonical(digest(state))
    finally:
        free(state)
    if got != want:
        log.warning("the xxhash package's streaming XXH3_128bits disagrees with its "
                    "xxh3_128: the C loop hashes each range whole")
        return None
    return tuple(ctypes.cast(f, ctypes.c_void_p).value or 0  # type: ignore[return-value]
                 for f in (create, free, reset, update, digest))


def _prefault(addr: int, nbytes: int) -> None:
    """Fault in the destination pages of ``[addr, +nbytes)`` writable before a read
    from a memfd lands there, if they are not there yet (a fresh allocation):
    :func:`~modelexpress.local.pages.populate_new`.

    Not before a read from a file's page cache (``HostMapping.from_file``) in Python
    threads: there the faults taken inside the read cost less than populating first
    (on the 16-core H200 host, 2026-12-03, pulls in fresh processes populating first took
    30.5 ms against 18.8 for 70 MB and 112 against 82 ms for 1 GiB). The C loop does
    populate small new pages before such a read (:meth:`HostCopier._copy_native`).

    New memory costs a fault per page, more than the copy itself on the CI machine,
    and faults taken inside ``pread``'s copy cost more than this populate at best
    (bench/local.py --host; docs/benchmarks.md, "Local transport on host memory").
    Huge pages are the pull's choice (:mod:`.hugepages`), made before the copy: a
    populate of a range advised ``MADV_HUGEPAGE`` faults it in as huge pages."""
    pages.populate_new(addr, nbytes)


def copy_threads() -> int:
    """Threads a host copy uses: the CPUs this process may run on, at most
    :data:`~modelexpress._threads.MAX_THREADS` (a copy is bound by memory bandwidth
    before that)."""
    return _threads.cpu_threads()


def _piece_bytes(total: int, threads: int, fine: bool) -> int:
    """The pieces of a copy of ``total`` bytes on ``threads`` threads: ``_PIECE_BYTES``,
    or where ``fine`` (new memory, or the C loop, whose pieces cost no Python) halved
    from it until each thread has about ``_PIECES_PER_THREAD`` of them, but no smaller
    than ``_MIN_PIECE_BYTES``."""
    size = _PIECE_BYTES
    while fine and size > _MIN_PIECE_BYTES and total < size * threads * _PIECES_PER_THREAD:
        size //= 2
    return size


@dataclasses.dataclass(frozen=True)
class Rows:
    """Runs of one length out of one segment: ``nbytes`` from each of ``offsets`` (in
    the segment) to each of ``dsts`` (addresses); int64 numpy arrays of one length.

    The rows of a column slice (a row-parallel weight's shard landing in its part of
    each row of the whole): :meth:`HostCopier.copy` cuts them into the C loop's pieces
    with numpy, where a run given on its own costs about 1 us of Python."""

    segment: int
    offsets: Any
    dsts: Any
    nbytes: int

    @property
    def total(self) -> int:
        return len(self.offsets) * self.nbytes

    def runs(self) -> list[tuple[int, int, int, int]]:
        """The same, one ``(segment, offset, dst_addr, nbytes)`` run per row."""
        return [(self.segment, o, d, self.nbytes)
                for o, d in zip(self.offsets.tolist(), self.dsts.tolist())]


class HostCopier:
    """Copies ``(segment, offset, dst_addr, nbytes)`` runs out of a :class:`HostMapping`.

    Args:
        mapping: the received memfds.
        threads: copy threads (default :func:`copy_threads`).
        native: run the C piece loop (``_copyloop``); default :data:`NATIVE`. It is
            used where it can do the whole job (no digests, or xxh3 ones), else the
            same pieces run in Python threads. Left to the default where the
            extension is unavailable, the first copier of a process warns once.
        huge_pages: the pull's :class:`~modelexpress.local.hugepages.HugePages`, told
            each chunk's destinations before they are copied into (None: small pages).
    """

    def __init__(self, mapping: "HostMapping", threads: int | None = None,
                 native: bool | None = None, huge_pages: "HugePages | None" = None) -> None:
        self.mapping = mapping
        self.threads = threads or copy_threads()
        self.native = NATIVE if native is None else native
        self.huge_pages = huge_pages
        if self.native and _copyloop is None:
            raise ValueError("the C piece loop (modelexpress.local._copyloop) is not built")
        if native is None and not COPYLOOP.available:
            COPYLOOP.falling_back(log)

    def copy(self, copies: Sequence[tuple[int, int, int, int]],
             in_pass: "DigestsInPass | None" = None, rows: Sequence[Rows] = ()) -> None:
        """Copy every run and every row of ``rows`` (hashing each tensor's bytes as they
        land when ``in_pass``); returns once all landed (and were hashed).

        Raises:
            BackendError: a read failed (after every other piece has finished: nothing
                still writes into the destination when this returns or raises).
        """
        native = self.native and (in_pass is None or (in_pass.xxh3 and _xxh3_address() != 0))
        if rows and not (native and self.huge_pages is None):
            copies = [*copies, *(run for r in rows for run in r.runs())]
            rows = ()
        total = sum(c[3] for c in copies) + sum(r.total for r in rows)
        # Whether new destination pages fault in huge: then the C loop's page-cache reads
        # take the faults themselves (see _copy_native).
        huge = self.huge_pages is not None and self.huge_pages.faults_huge(copies)
        # Fine pieces in the C loop; in Python only into new memory (judged by the
        # largest copy's destination): into touched memory a piece copies in well under
        # 1 ms and its Python costs more than idle threads do.
        big = max(copies, key=lambda c: c[3], default=None)
        fine = native or (big is not None and not pages.resident(big[2], big[3]))
        size = _piece_bytes(total, self.threads, fine)
        if native:
            self._copy_native(copies, size, in_pass, 1 if total < _INLINE_BYTES else self.threads,
                              _FILE if huge else _FILE | _PREFAULT, rows)
            return
        if in_pass is not None:
            pieces = in_pass.pieces(copies, size)
        else:
            pieces = [(seg, off + a, dst + a, min(size, n - a), None)
                      for seg, off, dst, n in copies for a in range(0, n, size)]
        workers = 1 if total < _INLINE_BYTES else min(self.threads, len(pieces))
        # The calling thread copies too, the process's worker threads beside it, taking
        # pieces in order from one counter (modelexpress._threads.run_shared): no thread
        # is started, none is woken for a copy the caller does alone, and every piece
        # has finished when this returns or raises, so a failed piece never leaves
        # another one writing into memory the caller is about to reuse or free.
        _threads.run_shared(pieces, self._one, threads=workers)

    def _one(self, piece: "_Piece") -> None:
        seg, off, dst, n, stream = piece
        if not self.mapping.from_file(seg):
            _prefault(dst, n)
        self.mapping.read_into(seg, off, dst, n)
        if stream is not None:
            stream.landed(dst, n)

    def _copy_native(self, copies: Sequence[tuple[int, int, int, int]], size: int,
                     in_pass: "DigestsInPass | None", workers: int, file_flags: int,
                     rows: Sequence[Rows] = ()) -> None:
        """The copies cut into pieces and read by the C loop, without the GIL. It hashes
        every range landed whole by this copy and untouched so far, and whatever it
        could not finish (a page-cache miss, a read error, a range a chunk end cuts) is
        finished here by :meth:`_one`'s path.

        ``file_flags``: the loop's flags for a read of a file's page cache: ``_FILE``,
        with ``_PREFAULT`` where new destination pages are small ones. A piece read from
        a memfd is always populated first where new. In the C loop each thread
        populates its own piece (``MADV_POPULATE_WRITE``) before reading into it, which
        on the 16-core H200 host cost less than the faults the read takes itself in small
        pages (70 MB into new memory: the pull 5.3 against 6.3 ms, a fresh process 7.2
        against 8.0 ms) and more where the pull advised huge pages (1 GiB: 45.0 against
        41.9 ms, a fresh process 48.2 against 43.5 ms; 2026-12-05, measured with a probe
        beside bench/local.py --host). (In Python threads, populating first was slower
        either way: :meth:`_one` does not.)

        One pass over the pieces, which the loop is handed with every range of the
        pull and its digest buffer (``DigestsInPass``): this Python, per piece, is most
        of a verified pull's fixed cost on many cores. (numpy for the cutting was
        slower: its fixed cost per call, from cold caches after the copy before, came
        to more than the Python for ~90 pieces.) ``rows`` whose runs are one piece each,
        out of a memfd, into no range of ``in_pass`` are made pieces by numpy
        (:meth:`_row_pieces`); the others are cut here as runs of their own."""
        flat = array.array("q")
        put = flat.extend
        read_source = self.mapping.read_source
        if in_pass is not None:
            starts, ends, ids = in_pass.sorted_ranges()
        else:
            starts = ends = ids = []
        m = len(starts)
        row_pieces, in_rows = [], []
        for r in rows:
            got = self._row_pieces(r, size, starts, ends)
            if got is None:
                copies = [*copies, *r.runs()]
            else:
                row_pieces.append(got)
                in_rows.append(r)
        left = array.array("q", bytes(8 * len(in_pass.sizes))) if in_pass is not None else None
        partial = []  # ranges a copy starts or ends inside of: fed in Python
        for seg, off, dst, n in copies:
            where = read_source(seg, off, n)
            fd, at, from_file = where if where is not None else (-1, 0, False)
            flag = file_flags if from_file else _PREFAULT
            # k: the first range (by address) that ends after the piece's start
            k = bisect.bisect_right(starts, dst) - 1 if m else 0
            if k < 0 or (k < m and dst >= ends[k]):
                k += 1
            if k < m and starts[k] < dst:
                partial.append(ids[k])
            pos, r = 0, -1
            while pos < n:
                a = dst + pos
                if k < m and a >= starts[k]:
                    r, until = ids[k], ends[k]
                else:
                    r, until = -1, starts[k] if k < m else a + n
                take = n - pos
                if until - a < take:
                    take = until - a
                if size < take:
                    take = size
                put((fd, at + pos, a, take, flag, r))
                pos += take
                if r >= 0:
                    left[r] += 1
                    if a + take == until:
                        k += 1
            if r >= 0 and dst + n != until:  # the copy ends inside range r
                partial.append(r)
        for pieces in row_pieces:
            flat.frombytes(pieces.tobytes())
        if not flat:
            return
        n_pieces = len(flat) // 6
        if in_pass is not None and (partial or in_pass.fed_in_python()):
            # Ranges not landed whole here, or begun in Python: not the loop's to hash.
            not_here = set(partial) | in_pass.fed_in_python()
            for i in range(5, len(flat), 6):
                if flat[i] in not_here:
                    left[flat[i]] -= 1
                    flat[i] = -1
        nr = len(in_pass.sizes) if in_pass is not None else 0
        ranges = in_pass.ranges if in_pass is not None else array.array("q")
        digests = in_pass.digests if in_pass is not None else bytearray()
        done, err = array.array("q", bytes(8 * n_pieces)), array.array("q", bytes(8 * n_pieces))
        hashed = bytearray(nr)
        if nr and _xxh3_stream_functions() is not None:
            # each range fed in order as its pieces land (while they are in the cache)
            short, from_files, misses = _copyloop.run(
                flat, ranges, left, done, err, digests, hashed, workers, _xxh3_address(),
                _xxh3_stream_functions(), INTERLEAVE)
        else:
            short, from_files, misses = _copyloop.run(
                flat, ranges, left if left is not None else array.array("q"), done, err,
                digests, hashed, workers, _xxh3_address() if nr else 0)
        if from_files or misses:
            self.mapping.count_file_bytes(from_files, misses)
        if short:
            # A piece is (fd, offset in fd, dst, ...): its segment and offset there are its
            # copy's, found by destination (copies do not overlap there).
            by_dst = sorted((dst, seg, off) for seg, off, dst, n in
                            (*copies, *(run for r in in_rows for run in r.runs())) if n > 0)
            starts_at = [c[0] for c in by_dst]
            rest = []
            for i in range(0, len(flat), 6):
                pd, pn, got = flat[i + 2], flat[i + 3], done[i // 6]
                if got < pn:
                    dst, seg, off = by_dst[bisect.bisect_right(starts_at, pd) - 1]
                    rest.append((seg, off + pd - dst + got, pd + got, pn - got, None))
            log.debug("%d of %d pieces left short by the C loop (page-cache misses or "
                      "read errors, errno %s): read the rest in Python", len(rest), n_pieces,
                      sorted({e for e in err if e}))
            _threads.run_shared(rest, self._one, threads=min(workers, len(rest)))
        if in_pass is not None:
            in_pass.took(hashed)
            if short or partial or in_pass.fed_in_python():
                # (each piece's range found again: those not the loop's are -1 in flat)
                for i in range(0, len(flat), 6):
                    in_pass.landed_in_python(flat[i + 2], flat[i + 3])

    def _row_pieces(self, rows: Rows, size: int, starts: Sequence[int],
                    ends: Sequence[int]) -> Any:
        """``rows`` as the C loop's pieces, ``(fd, offset, dst, nbytes, flags, -1)`` a
        row (an int64 array of 6 columns), or None where a row is more than one piece
        (longer than ``size``), the rows are not all in one memfd (a file's page cache
        is read a piece at a time: ``read_source``), or they land in a range hashed in
        the pass (``starts``/``ends``: sorted, not overlapping)."""
        import numpy as np

        n = len(rows.offsets)
        if n == 0 or rows.nbytes <= 0 or rows.nbytes > size:
            return None
        lo = int(rows.offsets.min())
        where = self.mapping.read_source(rows.segment, lo,
                                         int(rows.offsets.max()) + rows.nbytes - lo)
        if where is None or where[2]:
            return None
        d_lo, d_end = int(rows.dsts.min()), int(rows.dsts.max()) + rows.nbytes
        k = bisect.bisect_right(ends, d_lo)  # the first range that ends after d_lo
        if k < len(starts) and starts[k] < d_end:
            return None
        out = np.empty((n, 6), dtype=np.int64)
        out[:, 0] = where[0]
        out[:, 1] = rows.offsets - lo + where[1]
        out[:, 2] = rows.dsts
        out[:, 3] = rows.nbytes
        out[:, 4] = _PREFAULT
        out[:, 5] = -1
        return out

    def close(self) -> None:
        """(Nothing to release: the copy threads are the process's, see
        :mod:`modelexpress._threads`, or the C loop's own, ended when it returns; a
        copy has returned only once all its pieces finished.)"""


class _Stream:
    """One hasher over a destination range (a tensor, or one block of it for a
    block-wise digest), how many of its bytes it was fed, and the pieces landed beyond
    that, waiting for it (:meth:`landed`)."""

    __slots__ = ("base", "nbytes", "h", "_new", "view", "fed", "_waiting", "_hashing", "_lock")

    def __init__(self, base: int, nbytes: int, new_hasher: Callable[[], Any]) -> None:
        self.base, self.nbytes = base, nbytes
        # The hasher and the view of the bytes are made when Python first hashes here
        # (the C loop hashes most ranges itself: a pull's set-up makes neither).
        self.h: Any = None
        self._new = new_hasher
        self.view: memoryview | None = None
        self.fed = 0
        self._waiting: dict[int, int] = {}  # offset in the range -> bytes landed there
        self._hashing = False
        self._lock = threading.Lock()

    def hasher(self) -> Any:
        """The range's hasher (made now if nothing was hashed yet: an empty range's)."""
        if self.h is None:
            self.h = self._new()
        return self.h

    def landed(self, dst: int, n: int) -> None:
        """``n`` bytes landed at ``dst`` (inside this range): hash them now if they are
        the next the hasher needs, and then whatever landed after them meanwhile; else
        leave them to the thread hashing this range now or to the one that lands the
        bytes before them."""
        with self._lock:
            self._waiting[dst - self.base] = n
            if self._hashing:
                return
            self._hashing = True
        while True:
            # ORDER: only the thread that set _hashing reads or moves fed and h; a piece
            # added under the lock while it hashes is found by its next look, and it
            # clears _hashing under the same lock, so no landed piece is left unhashed.
            with self._lock:
                take = self._waiting.pop(self.fed, 0)
                if not take:
                    self._hashing = False
                    return
            if self.view is None:
                # A view of the destination's bytes by address (the tensor is contiguous
                # host memory, kept alive by the caller): ~2 us, where torch's view +
                # numpy took ~15 us a tensor.
                self.view = memoryview((ctypes.c_ubyte * self.nbytes).from_address(self.base))
            self.hasher().update(self.view[self.fed:self.fed + take])
            self.fed += take


# A piece of a copy: (segment, offset in it, destination address, bytes, the range it
# lands in: None where no digest is taken of it).
_Piece = tuple[int, int, int, int, "_Stream | None"]


class DigestsInPass:
    """Streaming hashers that the copy threads feed while copying: one per tensor, or,
    for a block-wise digest (``xxh3-128-b8m``, ``xxh3-128-b1m``), one per block of each
    tensor (a range), so that the blocks of one large tensor are hashed on several
    threads at once.

    The C loop hashes most ranges itself: it is handed every range (:attr:`ranges`)
    and writes each digest it takes into :attr:`digests`, by range, so that a tensor's
    blocks' digests are one slice of it. A :class:`_Stream` is made only for a range
    fed in Python (the Python loop, a range a chunk end cuts, a piece the C loop left
    short).

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
        from modelexpress.transfer.digest import XXH3, block_bytes, hasher
        self.algorithm, self.peer = algorithm, peer
        self._new_hasher = functools.partial(hasher, algorithm)
        block = block_bytes(algorithm)  # only the block-wise xxh3 digests have blocks
        self._blocks = block is not None
        # Each range's digest is the xxh3-128 of its bytes: the C loop can take it.
        self.xxh3 = algorithm == XXH3 or block is not None
        # (name, expected digest, bytes, its first range, its ranges)
        self._tensors: list[tuple[str, str, int, int, int]] = []
        bases: list[int] = []
        #: each range's size, by range (a tensor's in order)
        self.sizes: list[int] = []
        for p in order:
            if p.remote.digest is None:
                continue
            t = tensors[p.name]
            base, nbytes = t.data_ptr(), t.numel() * t.element_size()
            step = block or nbytes or 1
            first = len(bases)
            bases += range(base, base + (nbytes or 1), step)
            count = len(bases) - first
            self.sizes += [step] * (count - 1)
            self.sizes.append(nbytes - step * (count - 1))  # the last, or only, one
            self._tensors.append((p.name, p.remote.digest, nbytes, first, count))
        self._base = bases
        #: (first byte, size) of each range, flat: the C loop's ``streams``
        self.ranges = array.array("q", [v for r in zip(bases, self.sizes) for v in r])
        #: the C loop's digests, 16 bytes by range; :attr:`_in_c` says which it took
        self.digests = bytearray(16 * len(bases))
        self._in_c = bytearray(len(bases))
        self._py: dict[int, _Stream] = {}  # ranges fed in Python
        # Non-empty ranges by address, to find the range a byte lands in.
        by_addr = sorted((b, b + n, r) for r, (b, n) in enumerate(zip(bases, self.sizes)) if n)
        self._starts = [x[0] for x in by_addr]
        self._ends = [x[1] for x in by_addr]
        self._ids = [x[2] for x in by_addr]

    def sorted_ranges(self) -> tuple[list[int], list[int], list[int]]:
        """The non-empty ranges by address: first bytes, ends, range numbers."""
        return self._starts, self._ends, self._ids

    def fed_in_python(self) -> Any:
        """The ranges fed (or made to be fed) in Python so far: not the C loop's."""
        return self._py.keys()

    def took(self, hashed: bytes | bytearray) -> None:
        """The C loop took the digest of each range where ``hashed`` (one byte each) is 1
        (written to :attr:`digests`)."""
        if any(hashed):
            self._in_c = bytearray((int.from_bytes(self._in_c, "little")
                                    | int.from_bytes(hashed, "little")
                                    ).to_bytes(len(self._in_c), "little"))

    def hashed_by_the_loop(self) -> list[bool]:
        """Whether the C loop hashed each range, by range (tests)."""
        return [bool(x) for x in self._in_c]

    def _stream(self, r: int) -> "_Stream":
        st = self._py.get(r)
        if st is None:
            st = self._py[r] = _Stream(self._base[r], self.sizes[r], self._new_hasher)
        return st

    def landed_in_python(self, dst: int, n: int) -> None:
        """A piece ``[dst, +n)`` landed (cut at range boundaries): fed to its range's
        Python hasher unless the C loop hashed that range."""
        k = bisect.bisect_right(self._starts, dst) - 1
        if k >= 0 and dst < self._ends[k] and not self._in_c[self._ids[k]]:
            self._stream(self._ids[k]).landed(dst, n)

    def pieces(self, copies: Sequence[tuple[int, int, int, int]], piece_bytes: int
               ) -> "list[_Piece]":
        """The chunk's runs cut at tensor (and block) boundaries and into pieces of at
        most ``piece_bytes``, in address order, each with the stream of its range (None:
        bytes of no digested tensor): the Python loop's."""
        out: list[_Piece] = []
        for seg, off, dst, n in copies:
            pos = 0
            while pos < n:
                stream, until = self._stream_at(dst + pos)
                take = min(n - pos, until - (dst + pos), piece_bytes)
                out.append((seg, off + pos, dst + pos, take, stream))
                pos += take
        return out

    def _stream_at(self, addr: int) -> tuple[_Stream | None, int]:
        """The stream whose range holds ``addr`` (None: bytes of no digested tensor) and
        where that stops (its range's end, or the next digested tensor's start)."""
        k = bisect.bisect_right(self._starts, addr) - 1
        if k >= 0 and addr < self._ends[k]:
            return self._stream(self._ids[k]), self._ends[k]
        nxt = self._starts[k + 1] if k + 1 < len(self._starts) else 1 << 64
        return None, nxt

    def landed(self, done: int) -> None:
        """(Interface of :class:`DigestsAlongside`; nothing to do here.)"""

    def finish(self) -> int:
        """Compare every tensor's digest.

        Returns:
            The number of tensors verified.

        Raises:
            IntegrityError: a digest did not match, or a tensor was not fully fed.
        """
        bad = [(name, want, got) for name, want, got in self.outcomes() if got != want]
        if bad:
            raise _mismatch(bad, self.algorithm, self.peer)
        return len(self._tensors)

    def outcomes(self) -> list[tuple[str, str, str]]:
        """``(name, expected digest, digest got)`` of every tensor; where not every byte
        was hashed (bytes that landed other than through this copy), the digest got is
        ``"(only N of M bytes hashed)"``, which equals no digest."""
        from modelexpress.transfer.digest import combine_digests
        in_c, digests = self._in_c, self.digests
        out = []
        for name, want, nbytes, first, count in self._tensors:
            if in_c.count(1, first, first + count) == count:  # all in C: the usual case
                got = combine_digests(digests[16 * first:16 * (first + count)], nbytes)
            else:
                got = self._mixed(first, count, nbytes)
            out.append((name, want, got))
        return out

    def _mixed(self, first: int, count: int, nbytes: int) -> str:
        """A tensor's digest from ranges hashed in C and in Python (a range of neither
        hashed nothing: an empty tensor's, or bytes that never landed)."""
        from modelexpress.transfer.digest import combine_digests, stream_digest
        fed, parts = 0, []
        for r in range(first, first + count):
            if self._in_c[r]:
                fed += self.sizes[r]
                parts.append(bytes(self.digests[16 * r:16 * r + 16]))
            else:
                st = self._stream(r)
                fed += st.fed
                parts.append(st.hasher())
        if fed != nbytes:
            return f"(only {fed} of {nbytes} bytes hashed)"
        if not self._blocks:  # one range, hashed in Python
            return stream_digest(parts[0], nbytes)
        return combine_digests(b"".join(p if isinstance(p, bytes) else p.digest()
                                        for p in parts), nbytes)

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
