"""HostVmmBackend: the VMM semantics on the CPU, with real memory.

The CUDA calls have exact Linux counterparts, so the arena runs for real on a
machine without a GPU and NIXL can register its range as DRAM:

=====================  ===========================================================
CUDA                   here
=====================  ===========================================================
cuMemAddressReserve    ``mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``
cuMemCreate            ``memfd_create`` + ``ftruncate`` (the fd is the handle)
cuMemMap               ``mmap(va, MAP_SHARED|MAP_FIXED, fd)`` with ``PROT_NONE``
cuMemSetAccess         ``mprotect(PROT_READ|PROT_WRITE)``
cuMemUnmap             ``mmap(PROT_NONE, MAP_FIXED|MAP_ANONYMOUS)`` over the chunk:
                       the range stays reserved (``munmap`` would open a hole another
                       mapping could land in)
cuMemRelease           ``close(fd)`` (the pages go once unmapped and closed)
cuMemAddressFree       ``munmap``
=====================  ===========================================================

``MAP_SHARED`` memfd pages are ordinary process memory, so another process reads
them with ``process_vm_readv`` (UCX's CMA transport). Each chunk keeps its fd open
until it is freed, like a CUDA handle; that costs one descriptor per live chunk.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
import os
from typing import Literal

from modelexpress.errors import BackendError, ConfigError

__all__ = ["HostVmmBackend"]

_PROT_NONE = 0
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED = mmap.MAP_SHARED
_MAP_PRIVATE = mmap.MAP_PRIVATE
_MAP_ANONYMOUS = mmap.MAP_ANONYMOUS
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                  ctypes.c_int, ctypes.c_long]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_mprotect = _libc.mprotect
_mprotect.restype = ctypes.c_int
_mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

_names = itertools.count()


def _os_error(what: str) -> BackendError:
    err = ctypes.get_errno()
    return BackendError(f"host VMM: {what} failed: {os.strerror(err)} (errno {err})")


class HostVmmBackend:
    """Real host memory with CUDA-VMM-like semantics (see the module docstring).

    Args:
        granularity: slot alignment in bytes; a power of two, at least the page size
            (default: the page size; pass 2 MiB to mimic CUDA's slot sizes).
        device: reported device ordinal (host memory has none; kept for messages).
    """

    kind: Literal["host"] = "host"

    def __init__(self, granularity: int | None = None, device: int = 0) -> None:
        page = mmap.PAGESIZE
        gran = page if granularity is None else granularity
        if gran < page or gran & (gran - 1):
            raise ConfigError(f"granularity must be a power of two >= the page size "
                              f"({page}), got {gran}")
        if not hasattr(os, "memfd_create"):
            raise ConfigError("HostVmmBackend needs Linux (os.memfd_create)")
        self.granularity = gran
        self.device = device
        self._fds: dict[int, int] = {}  # va -> memfd of the chunk mapped there (export_chunk)

    def reserve(self, total: int) -> int:
        # Over-reserve by one granule and trim, so the base is granularity-aligned.
        span = total + self.granularity
        addr = _mmap(None, span, _PROT_NONE,
                     _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if addr in (None, _MAP_FAILED):
            raise _os_error(f"reserving {total} bytes of address space")
        base = -(-addr // self.granularity) * self.granularity
        head, tail = base - addr, (addr + span) - (base + total)
        if head:
            _munmap(addr, head)
        if tail:
            _munmap(base + total, tail)
        return base

    def release_reservation(self, base: int, total: int) -> None:
        if _munmap(base, total) != 0:
            raise _os_error(f"releasing the reservation 0x{base:x}+{total}")

    def create(self, size: int) -> int:
        try:
            fd = os.memfd_create(f"mx-vmm-{os.getpid()}-{next(_names)}", os.MFD_CLOEXEC)
        except OSError as exc:
            raise BackendError(f"host VMM: memfd_create for {size} bytes failed: {exc}") from exc
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            os.close(fd)
            raise BackendError(f"host VMM: ftruncate({size}) failed: {exc}") from exc
        return fd

    def map(self, va: int, size: int, handle: int) -> None:
        # PROT_NONE until set_access, as cuMemMap leaves memory inaccessible.
        addr = _mmap(va, size, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, handle, 0)
        if addr in (None, _MAP_FAILED):
            raise _os_error(f"mapping fd {handle} ({size} bytes) at 0x{va:x}")
        if addr != va:  # MAP_FIXED never moves; a different address is a kernel bug
            raise BackendError(f"host VMM: mmap placed 0x{addr:x}, wanted 0x{va:x}")
        self._fds[va] = handle

    def set_access(self, va: int, size: int) -> None:
        if _mprotect(va, size, _PROT_RW) != 0:
            raise _os_error(f"mprotect(0x{va:x}, {size}, RW)")

    def unmap(self, va: int, size: int) -> None:
        self._fds.pop(va, None)
        addr = _mmap(va, size, _PROT_NONE,
                     _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1, 0)
        if addr in (None, _MAP_FAILED):
            raise _os_error(f"unmapping 0x{va:x}+{size}")

    def release(self, handle: int) -> None:
        try:
            os.close(handle)
        except OSError as exc:
            raise BackendError(f"host VMM: close(fd {handle}) failed: {exc}") from exc

    def export_chunk(self, va: int, size: int) -> int:
        """A new descriptor (a duplicate of the memfd) for the chunk mapped at ``va``.

        The caller owns and closes it; another process maps the same pages with it
        (the local transport sends it over a Unix socket).

        Raises:
            BackendError: no chunk is mapped at ``va``.
        """
        fd = self._fds.get(va)
        if fd is None:
            raise BackendError(f"host VMM: no chunk mapped at 0x{va:x} to export")
        return os.dup(fd)

    def close(self) -> None:
        """Nothing backend-wide to release."""
