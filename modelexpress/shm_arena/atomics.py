"""64-bit release/acquire atomics on shared memory, and page population.

The arena protocol (see :mod:`modelexpress.shm_arena.arena`) needs two things
Python cannot express: a store that becomes visible only after every earlier
store (the tensor bytes) is visible (*release*), and a load after which every
later load sees what the releasing process wrote before it (*acquire*). A
memoryview byte write is neither: CPython turns it into a plain ``memcpy`` the C
compiler and a weakly ordered CPU may reorder. vLLM's ring buffer learned this
the hard way and added fences afterwards (vLLM PRs #29819 and #40303).

``NATIVE`` is True when the C extension ``_atomics`` (built by ``setup.py``,
optional) is importable: then :func:`load_acquire` / :func:`store_release`
compile to ``__atomic_load_n(ACQUIRE)`` / ``__atomic_store_n(RELEASE)`` on an
8-byte aligned word, which is correct on every architecture GCC supports.

Without the extension a pure-Python fallback is used, and it is WEAKER: it
brackets ``struct.pack_into``/``unpack_from`` with a full fence (taking and
releasing a ``threading.Lock``, the same trick vLLM's ``memory_fence`` uses).
On x86-64 (total store order) that is sufficient in practice; on weakly ordered
CPUs (ARM, POWER) it is not formally guaranteed, and an 8-byte ``memcpy`` is not
guaranteed to be a single, untorn store. Build the extension (any C compiler)
for production use on such machines; ``modelexpress doctor`` reports which one
is in use, and the first use of the fallback in a process logs one warning.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
from typing import Any

from modelexpress._optional import Extension

__all__ = ["ATOMICS", "NATIVE", "load_acquire", "store_release", "populate", "fence",
           "py_load_acquire", "py_store_release", "copy_in"]

log = logging.getLogger(__name__)

# The extension is optional (no compiler at install time): the fallbacks below say so
# once, the first time one of them runs.
ATOMICS = Extension("modelexpress.shm_arena._atomics",
                    "the shm tensor arena orders its words with lock fences (weaker off "
                    "x86-64) and copies tensors with torch")
_native = ATOMICS.module

NATIVE: bool = _native is not None

_U64 = struct.Struct("=Q")
_fence_lock = threading.Lock()
# MADV_POPULATE_WRITE (Linux >= 5.14); Python 3.11's mmap module lacks the constant.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def fence() -> None:
    """Full memory barrier (lock acquire + release). Only the fallback needs it."""
    with _fence_lock:
        pass


def _check(buf: Any, offset: int) -> None:
    if offset % 8 or offset < 0 or offset + 8 > len(buf):
        raise ValueError(f"offset {offset} is not an aligned word inside {len(buf)} bytes")


def load_acquire(buf: Any, offset: int) -> int:
    """Atomically load the 64-bit word at ``offset`` with acquire ordering.

    Args:
        buf: a writable buffer over the shared mapping (the arena's ``mmap``).
        offset: byte offset, a multiple of 8.

    Returns:
        The word's value.

    Raises:
        ValueError: the offset is unaligned or out of range.
    """
    if _native is not None:
        return _native.load_acquire(buf, offset)
    ATOMICS.falling_back(log)
    return py_load_acquire(buf, offset)


def py_load_acquire(buf: Any, offset: int) -> int:
    """The pure-Python fallback of :func:`load_acquire` (weaker; see the module doc)."""
    _check(buf, offset)
    value = _U64.unpack_from(buf, offset)[0]
    fence()  # later loads must not move above this one
    return value


def store_release(buf: Any, offset: int, value: int) -> None:
    """Atomically store ``value`` at ``offset`` with release ordering.

    Every store this process made before the call (e.g. the tensor bytes) is
    visible to a process that reads ``value`` with :func:`load_acquire`.

    Raises:
        ValueError: the offset is unaligned or out of range.
    """
    if _native is not None:
        _native.store_release(buf, offset, value)
        return
    ATOMICS.falling_back(log)
    py_store_release(buf, offset, value)


def py_store_release(buf: Any, offset: int, value: int) -> None:
    """The pure-Python fallback of :func:`store_release` (weaker; see the module doc)."""
    _check(buf, offset)
    fence()  # earlier stores must not move below this one
    _U64.pack_into(buf, offset, value)
    fence()


def populate(mm: mmap.mmap, start: int, length: int) -> str:
    """Fault ``[start, start+length)`` of a shared mapping in writable, bytes unchanged.

    Safe to run in a background thread while the writer copies tensors into the
    same range: neither path changes a byte it did not mean to.

    Returns:
        ``"madvise"`` (MADV_POPULATE_WRITE), ``"touch"`` (per-page atomic add of
        zero, old kernels, native only) or ``"python"`` (fallback madvise, which
        holds the GIL while it runs).

    Raises:
        OSError: the kernel refused (e.g. tmpfs out of space: ENOMEM/EFAULT).
    """
    if _native is not None:
        return _native.populate(mm, start, length)
    ATOMICS.falling_back(log)
    if length:
        mm.madvise(_MADV_POPULATE_WRITE, start, length)
    return "python"


# Streaming copies only from this size on, split in parts of at least half of it:
# a thread start costs ~0.1 ms, and one streaming thread alone is not faster than
# a plain copy everywhere (bench/host_copy.py: 12.7 vs 22.4 ms for glibc memcpy on
# the 2-core CI machine, 27.8 vs 21.5 ms on a 32-core GPU host).
_PARALLEL_MIN_BYTES = 32 << 20
_MAX_COPY_THREADS = 8
# Threads claim the copy in chunks of this size (a thread that loses its CPU
# holds back at most the chunk it is in, not a fixed share of the copy).
_COPY_CHUNK = 2 << 20


def _copy_threads(nbytes: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return max(1, min(_MAX_COPY_THREADS, cpus, nbytes // (_PARALLEL_MIN_BYTES // 2)))


def copy_in(buf: Any, offset: int, src: Any, *, threads: int | None = None) -> bool:
    """Copy a contiguous CPU tensor's bytes into ``buf`` at ``offset``, fast.

    With the C extension, for 32 MiB or more on a machine with 2 or more usable
    CPUs: streaming (non-temporal) stores on x86-64, the GIL released, the copy
    done by up to 8 threads (one per usable CPU) that claim 2 MiB chunks from a
    shared counter; the threads are joined before this returns, and each ends
    with a store fence, so a later :func:`store_release` publishes the bytes.

    Args:
        buf: the writable shared mapping (the arena's ``mmap``).
        offset: destination byte offset in ``buf``.
        src: a contiguous ``torch.uint8`` CPU tensor (kept alive by the caller).
        threads: force the number of copying threads (benchmarks); 1 included.

    Returns:
        False when it did not copy (no C extension, a smaller tensor, one CPU, or
        not a contiguous byte tensor): the caller then copies with torch.
    """
    if _native is None:
        ATOMICS.falling_back(log)
        return False
    if not src.is_contiguous() or src.element_size() != 1:
        return False
    nbytes = src.numel()
    parts = threads if threads is not None else _copy_threads(nbytes)
    if threads is None and parts < 2:
        return False
    _native.stream_copy(buf, offset, src.data_ptr(), nbytes, parts, _COPY_CHUNK)
    return True
