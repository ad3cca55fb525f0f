"""Checkpoint files a host buffer was loaded from, served to peers as the page cache.

A publisher that loads a safetensors checkpoint into a
:class:`~modelexpress.local.memory.HostBuffer` holds the weights twice: in the buffer
(a memfd: shmem, in 4 KiB pages unless the host enables shmem huge pages) and in the
file's page cache (large folios on filesystems that have them, e.g. ext4 on recent
kernels). A peer's ``pread`` of the page cache costs less per byte than one of the
memfd, which pays the kernel's per-4 KiB-page work (measured: docs/benchmarks.md,
"Local transport on host memory"). So for each buffer range loaded unchanged from a
file the source also serves that file's descriptor and offset (a ``file`` segment,
:mod:`.protocol`), to targets that ask for them; the memfd stays the reference::

    source                                        target
    ------                                        ------
    open + fstat each file, load the tensors
    into the buffer, fstat again: changed
    while loading -> no file extents
    per peer: fstat again: changed since the
    load -> that peer gets the memfds only
                                                  each copy: cachestat of its file range
                                                    under half of it cached -> the memfd
                                                  each piece: preadv2(file, RWF_NOWAIT)
                                                    not in the page cache (EAGAIN, short)
                                                      -> the rest of the piece from the memfd
                                                    the filesystem cannot (EOPNOTSUPP)
                                                      -> the memfds from then on
                                                  every tensor's digest, as before; a
                                                  mismatch after file reads -> the whole
                                                  copy again from the memfds

Why the checks are enough: a file replaced by rename or deleted keeps its old inode
behind the held descriptor (same bytes); a write in place changes ``mtime`` (seen at
the next peer's connect, as does one that puts ``mtime`` back: ``ctime`` still moves);
a write in place during a copy changes bytes the digests cover, and the target then
reads the memfds. A peer never waits for a disk, and it does not make the kernel read
one either: a ``RWF_NOWAIT`` read that misses still queues the disk read of what it
missed (Linux 6.18), so a pull from a source whose page cache was evicted read the
whole file back from disk while it copied, and took longer than reading the memfd
alone (bench/peers.py, ``mx_pull`` cold; docs/benchmarks.md). So each copy first asks
how much of its range the page cache holds (``cachestat``, Linux 6.5: it counts pages
and reads nothing) and reads the memfd where that is under half
(``memory.FILE_MIN_CACHED``); a page evicted between that count and the read still
misses, as before. Where the kernel has no ``cachestat`` every copy reads the file as
before this check. What a pull leaves to the memfd the source reads back itself once
the peer is done (:func:`refill_page_cache`, where the host has the memory), so the
next peers find the page cache again without any pull having waited for it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["FileExtent", "FileOrigin", "NOWAIT_UNSUPPORTED", "cached_share", "origins_for",
           "read_cached", "refill_page_cache"]

log = logging.getLogger(__name__)

_MAX_HEADER = 100 << 20  # safetensors caps its JSON header at 100 MB


class FileExtent:
    """A run of a host buffer that holds the bytes at ``file_offset`` of an origin."""

    __slots__ = ("origin", "buf_offset", "file_offset", "nbytes")

    def __init__(self, origin: "FileOrigin", buf_offset: int, file_offset: int,
                 nbytes: int) -> None:
        self.origin, self.buf_offset = origin, buf_offset
        self.file_offset, self.nbytes = file_offset, nbytes


class FileOrigin:
    """One safetensors file, held open from before a load until the buffer closes.

    Args:
        path: the file.

    Raises:
        OSError: it cannot be opened or read; ValueError: not a safetensors header
        (callers treat both as "no file extents": the memfd alone is served).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._stamp = self._stat()
            head = os.pread(self.fd, 8, 0)
            if len(head) != 8:
                raise ValueError(f"{self.path}: shorter than a safetensors header")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > _MAX_HEADER:
                raise ValueError(f"{self.path}: header of {hlen} bytes")
            header = json.loads(os.pread(self.fd, hlen, 8))
            base = 8 + hlen
            self.entries: dict[str, tuple[int, int]] = {
                name: (base + int(e["data_offsets"][0]),
                       int(e["data_offsets"][1]) - int(e["data_offsets"][0]))
                for name, e in header.items() if name != "__metadata__"}
        except BaseException:
            os.close(self.fd)
            raise
        self._changed_logged = False

    def _stat(self) -> tuple[int, ...]:
        st = os.fstat(self.fd)
        # ctime too: a writer can put mtime back (utime), not ctime.
        return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def unchanged(self) -> bool:
        """Whether the file is as it was when opened (inode, size, mtime, ctime); logs
        the first time it is not."""
        try:
            same = self._stat() == self._stamp
        except OSError:
            same = False
        if not same and not self._changed_logged:
            self._changed_logged = True
            log.warning("checkpoint file %s changed since it was loaded: peers on this host "
                        "read the loaded copy (the memfd) instead of its page cache", self.path)
        return same

    def extents(self, base: int, size: int, tensors: Mapping[str, "torch.Tensor"]
                ) -> list[FileExtent]:
        """The runs of ``[base, base + size)`` (a buffer) whose tensors came from this
        file, merged where both sides are contiguous."""
        runs: list[FileExtent] = []
        for name, (foff, n) in sorted(self.entries.items(), key=lambda kv: kv[1][0]):
            t = tensors.get(name)
            if t is None or n == 0 or t.numel() * t.element_size() != n:
                continue
            boff = t.data_ptr() - base
            if boff < 0 or boff + n > size:
                continue
            last = runs[-1] if runs else None
            if (last is not None and last.buf_offset + last.nbytes == boff
                    and last.file_offset + last.nbytes == foff):
                last.nbytes += n
            else:
                runs.append(FileExtent(self, boff, foff, n))
        return runs

    def uncached_bytes(self) -> int | None:
        """Bytes of the file its page cache lacks now (``cachestat``); None where the
        kernel cannot say or the file is closed."""
        fd = self.fd
        if fd < 0:
            return None
        try:
            size = os.fstat(fd).st_size
        except OSError:
            return None
        share = cached_share(fd, 0, size)
        return None if share is None else round(size * (1.0 - share))

    def close(self) -> None:
        """Close the descriptor. Idempotent."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


_REFILL_STEP = 128 << 10  # the kernel's default readahead window (VM_READAHEAD_PAGES)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def refill_page_cache(origins: Sequence[FileOrigin], who: str = "") -> int:
    """Ask the kernel to read back what the page cache of each (unchanged) origin lacks,
    where the host has at least twice that memory available (``MemAvailable``): the
    source's side of never making a pull wait on a disk (see the module docstring).
    ``POSIX_FADV_WILLNEED`` queues the reads; this call may block while they are
    queued, so a source runs it on a thread of its own.

    Returns:
        The bytes asked for (0: nothing was missing, the kernel cannot say, or the host
        had not the memory).
    """
    missing, total = [], 0
    for o in origins:
        lack = o.uncached_bytes()
        if lack and o.unchanged():
            missing.append(o)
            total += lack
    if not total:
        return 0
    avail = _mem_available()
    if avail is None or avail < 2 * total:
        log.info("local source %s: %d bytes of its checkpoint's page cache were evicted; "
                 "not read back (%s bytes available, twice that wanted): peers read the "
                 "memfd", who, total, avail)
        return 0
    log.info("local source %s: reading back %d bytes of its checkpoint's evicted page cache "
             "for the next peers", who, total)
    for o in missing:
        try:
            size = os.fstat(o.fd).st_size
            # One WILLNEED reads at most one readahead window of the device (Linux
            # 6.18: a whole 1 GiB file asked at once got 8 MiB back), so the file is
            # asked for a window at a time, in the smallest window a device has.
            for off in range(0, size, _REFILL_STEP):
                if o.fd < 0:  # the source closed meanwhile
                    break
                os.posix_fadvise(o.fd, off, _REFILL_STEP, os.POSIX_FADV_WILLNEED)
            # and WILLNEED leaves out a last partial page: read it here
            tail = size % _PAGE
            if tail and o.fd >= 0:
                os.pread(o.fd, tail, size - tail)
        except OSError as exc:  # closed meanwhile, or a filesystem that refuses it
            log.debug("WILLNEED of %s failed: %s", o.path, exc)
    return total


def origins_for(files: Sequence[str | os.PathLike[str]]) -> list[FileOrigin]:
    """Open each file as an origin; none at all if one cannot be (logged)."""
    out: list[FileOrigin] = []
    try:
        for f in files:
            out.append(FileOrigin(f))
    except (OSError, ValueError) as exc:
        for o in out:
            o.close()
        log.info("checkpoint %s not served as page cache (peers read the loaded copy): %s",
                 files[0] if files else "?", exc)
        return []
    return out


# -- target side ---------------------------------------------------------------------------
class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_preadv2 = getattr(_libc, "preadv2", None)
if _preadv2 is not None:
    _preadv2.restype = ctypes.c_ssize_t
    _preadv2.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_int, ctypes.c_long,
                         ctypes.c_int]
_RWF_NOWAIT = 0x8  # Linux 4.14


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_SYS_CACHESTAT = 451  # Linux 6.5, the same number on every architecture (asm-generic)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_cachestat_ok = os.uname().sysname == "Linux"  # cleared where the kernel lacks it
_PAGE = os.sysconf("SC_PAGE_SIZE")


def cached_share(fd: int, file_offset: int, nbytes: int) -> float | None:
    """The share of ``[file_offset, +nbytes)`` of a file that its page cache holds now
    (``cachestat``: counts pages, reads nothing and starts no readahead); None where the
    kernel cannot say (before Linux 6.5, or a sandbox that refuses the call).

    Why ask before reading: a ``RWF_NOWAIT`` read that misses still queues the disk
    read of what it missed (see the module docstring).
    """
    global _cachestat_ok
    if not _cachestat_ok or nbytes <= 0:
        return None
    first = file_offset - file_offset % _PAGE
    pages = -(-(file_offset + nbytes - first) // _PAGE)
    rng, out = _CachestatRange(first, pages * _PAGE), _Cachestat()
    if _syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.EOPNOTSUPP):
            _cachestat_ok = False
        return None
    return min(1.0, out.nr_cache / pages)


NOWAIT_UNSUPPORTED = -1
"""What :func:`read_cached` returns where the filesystem (or libc) cannot read
without waiting (tmpfs, for one): read the memfd instead."""


def read_cached(fd: int, file_offset: int, dst_addr: int, nbytes: int) -> int:
    """Read what the page cache holds of ``[file_offset, +nbytes)`` into ``dst_addr``,
    never waiting for a disk (``RWF_NOWAIT``; the GIL is released).

    Returns:
        Bytes read, from the start (fewer than ``nbytes``: the rest is not cached, or
        the file is shorter now), or :data:`NOWAIT_UNSUPPORTED` (nothing read).

    Raises:
        OSError: another read error.
    """
    if _preadv2 is None:
        return NOWAIT_UNSUPPORTED
    done = 0
    while done < nbytes:
        iov = _Iovec(dst_addr + done, nbytes - done)
        got = _preadv2(fd, ctypes.byref(iov), 1, file_offset + done, _RWF_NOWAIT)
        if got > 0:
            done += got
            continue
        if got == 0:
            return done
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err == errno.EAGAIN:  # not in the page cache
            return done
        if err in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # EINVAL: a kernel without the flag
            if done == 0:
                return NOWAIT_UNSUPPORTED
            return done
        raise OSError(err, os.strerror(err))
    return done
