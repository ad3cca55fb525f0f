"""The libc page calls of the local transport: advice, population and residency.

Host copies (:mod:`.hostcopy`) populate a new destination before reading into it, and
the huge-page choice (:mod:`.hugepages`) advises new destinations ``MADV_HUGEPAGE``;
both ask first whether the memory was touched yet (``mincore``). The bindings live
here, below both, so neither imports the other for them.
"""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = ["MADV_HUGEPAGE", "MADV_POPULATE_WRITE", "PAGE", "madvise", "populate_new",
           "resident"]

MADV_HUGEPAGE = 14  # Linux 2.6.38
MADV_POPULATE_WRITE = 23  # Linux 5.14
PAGE = os.sysconf("SC_PAGE_SIZE")

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_mincore = _libc.mincore
_mincore.restype = ctypes.c_int
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_populate_ok = True  # cleared where the kernel does not know MADV_POPULATE_WRITE


def madvise(addr: int, nbytes: int, advice: int) -> int:
    """libc ``madvise`` of ``[addr, +nbytes)`` (``addr`` page-aligned); 0 on success,
    -1 with ``ctypes.get_errno()`` set otherwise."""
    return _madvise(addr, nbytes, advice)


def resident(addr: int, nbytes: int) -> bool:
    """Whether ``[addr, +nbytes)`` is memory already touched (its middle page is
    resident; ``mincore``), not a new allocation still to be faulted in."""
    vec = ctypes.c_ubyte(0)
    # ORDER: the probe is the middle page: the first may be shared with the tensor
    # before, landed already.
    return _mincore((addr + nbytes // 2) & ~(PAGE - 1), PAGE, ctypes.byref(vec)) == 0 \
        and bool(vec.value & 1)


def populate_new(addr: int, nbytes: int) -> None:
    """Fault in the pages of ``[addr, +nbytes)`` writable (``MADV_POPULATE_WRITE``) if
    they are not there yet (a fresh allocation); on touched memory the populate would be
    a page-table walk for nothing, hence the probe (:func:`resident`). No byte changes.
    Best effort: an error only means a later write faults the pages in itself, and a
    kernel that does not know the advice is not asked again."""
    global _populate_ok
    if not _populate_ok or nbytes <= 0 or resident(addr, nbytes):
        return
    start = addr & ~(PAGE - 1)
    if _madvise(start, (addr + nbytes - start + PAGE - 1) & ~(PAGE - 1),
                MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == errno.EINVAL:
        _populate_ok = False
