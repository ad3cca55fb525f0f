"""Host memory for the local transport: memfd-backed buffers (source) and their mappings (target).

A tensor in ordinary heap memory cannot be handed to another process. A tensor in a
:class:`HostBuffer` can: the buffer is a ``memfd`` mapped ``MAP_SHARED``, and its
descriptor, passed over a Unix socket, lets a peer map the very same pages. The
source keeps writing-rights; peers map read-only, so a target can never change the
weights it reads.

On the target, :class:`HostMapping` maps the received descriptors so that the
source's layout is kept: segments that were close together in the source's address
space (the chunks of a host VMM arena, or several buffers) are mapped at the same
relative offsets inside one reserved range, so a run of tensors that was contiguous
at the source is contiguous here and is copied as one block::

    source:  A.addr                      B.addr
             |<-- memfd A -->|  (gap)   |<-- memfd B -->|
    target:  base = reserve(B.end - A.addr, PROT_NONE)
             |<-- map A, RO -->| PROT_NONE |<-- map B, RO -->|

The mapping keeps the received descriptors too: a host-to-host copy reads the memfd
with ``pread`` (:meth:`HostMapping.read_into`) instead of copying from the mapping,
or, for bytes the source loaded from a checkpoint file, that file's page cache
(``file`` segments; :mod:`.origin`).
Copying from a fresh mapping faults in every source page (a page-table entry per 4 KiB;
the memfd's shmem has no huge pages unless the host enables them) and unmapping tears
those entries down again: measured, that cost more than the copy itself
(docs/benchmarks.md, "Local transport on host memory"). The kernel's copy from the page
cache needs neither; the mapping stays for copies that need an address (to or from a GPU).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from modelexpress._closing import ClosedOnCollect
from modelexpress.errors import BackendError, ConfigError, PeerError
# At import, not in _read_file: the copy threads would take the import lock mid-copy.
from modelexpress.local.origin import NOWAIT_UNSUPPORTED, cached_share, read_cached
# The libc bindings the host VMM backend already declares (mmap/munmap with errno).
from modelexpress.vmm.host import _MAP_FAILED, _MAP_NORESERVE, _mmap, _munmap

if TYPE_CHECKING:
    import torch

    from modelexpress.local.origin import FileExtent, FileOrigin
    from modelexpress.local.protocol import Segment

__all__ = ["HostBuffer", "HostMapping", "group_segments", "host_buffer_like"]

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
# ctypes releases the GIL around a CDLL call: reads on several threads run in parallel.
_pread = _libc.pread
_pread.restype = ctypes.c_ssize_t
_pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]

_PROT_NONE = 0
_PROT_READ = mmap.PROT_READ
_MAP_SHARED = mmap.MAP_SHARED
_MAP_PRIVATE = mmap.MAP_PRIVATE
_MAP_ANONYMOUS = mmap.MAP_ANONYMOUS
_MAP_FIXED = 0x10
# A copy from a file segment reads the page cache only where it holds at least this
# share of the copy's range (cachestat); below it the copy reads the memfd, which
# starts no disk read (origin.py). Not 1.0: one page evicted between the count and the
# read would send a whole copy (often the whole checkpoint: contiguous runs are merged)
# to the memfd, the slower path; at 0.5 what the misses can bring back from disk is
# at most half of it.
FILE_MIN_CACHED = 0.5

# Segments further apart than this start a new group (a new reserved range): the
# reservation costs no memory, but a pathological layout must not reserve terabytes.
MAX_GROUP_GAP = 1 << 36


def _errno_text() -> str:
    err = ctypes.get_errno()
    return f"{os.strerror(err)} (errno {err})"


class HostBuffer(ClosedOnCollect):
    """A memfd-backed host buffer that the local transport can share.

    Tensors over it come from :meth:`tensor`. ``close()`` closes the descriptor and
    unmaps the memory once no tensor view is left (a view still alive keeps the
    mapping; the pages go with the last view).

    Args:
        nbytes: size in bytes (> 0).
        name: memfd name, shown in ``/proc/PID/fd`` and ``/proc/PID/maps``.

    Raises:
        ConfigError: bad size, or not Linux.
        BackendError: memfd_create / ftruncate / mmap failed.
    """

    def __init__(self, nbytes: int, name: str = "mx-host") -> None:
        self._closed = True
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ConfigError(f"HostBuffer size must be a positive int, got {nbytes!r}")
        if not hasattr(os, "memfd_create"):
            raise ConfigError("HostBuffer needs Linux (os.memfd_create)")
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        except OSError as exc:
            raise BackendError(f"memfd_create for {nbytes} bytes failed: {exc}") from exc
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes, flags=_MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise BackendError(f"HostBuffer of {nbytes} bytes: {exc}") from exc
        # Huge pages where the kernel allows them for shared memory (shmem_enabled
        # "advise", or a per-size mTHP setting): a peer's copy pays per page it reads
        # (docs/benchmarks.md, "Local transport on host memory"). No-op under "never".
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.fd = fd
        self.nbytes = nbytes
        probe = ctypes.c_char.from_buffer(self._mm)
        self.addr = ctypes.addressof(probe)  # an mmap never moves
        del probe
        self._lock = threading.Lock()
        self.file_extents: list["FileExtent"] = []
        self._origins: list["FileOrigin"] = []
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def add_origins(self, origins: Sequence["FileOrigin"],
                    tensors: Mapping[str, "torch.Tensor"]) -> int:
        """Record which of this buffer's bytes were loaded unchanged from ``origins``
        (files opened before the load: :mod:`.origin`); the buffer owns them from now
        on. A source serves those runs as the files' page cache too.

        Returns:
            Bytes covered (0: a file changed during the load, none is used).
        """
        origins = list(origins)
        if not all(o.unchanged() for o in origins):
            for o in origins:
                o.close()
            return 0
        self._origins.extend(origins)
        for o in origins:
            self.file_extents.extend(o.extents(self.addr, self.nbytes, tensors))
        return sum(e.nbytes for e in self.file_extents)

    def tensor(self, offset: int, shape: Sequence[int], dtype: "torch.dtype") -> "torch.Tensor":
        """A tensor over ``[offset, offset + nbytes)`` of the buffer.

        Raises:
            ConfigError: the range is outside the buffer, or the buffer is closed.
        """
        import torch
        if self._closed:
            raise ConfigError("HostBuffer.tensor() after close()")
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * dtype.itemsize
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ConfigError(f"tensor of {nbytes} bytes at offset {offset} does not fit a "
                              f"HostBuffer of {self.nbytes} bytes")
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        # ORDER: through a memoryview, which holds a buffer export on the mmap for as
        # long as the tensor keeps it (torch.frombuffer keeps its argument, not an
        # export): close() then cannot unmap pages a live view still uses.
        flat = torch.frombuffer(memoryview(self._mm)[offset:offset + nbytes], dtype=torch.uint8)
        return flat.view(dtype).view(tuple(int(d) for d in shape))

    def close(self) -> None:
        """Close the descriptor; unmap now if no view is alive. Idempotent."""
        with getattr(self, "_lock", threading.Lock()):
            if self._closed:
                return
            self._closed = True
        os.close(self.fd)
        for o in self._origins:
            o.close()
        try:
            self._mm.close()
        except BufferError:
            # Views still alive hold the mapping; it goes with the last of them.
            log.debug("HostBuffer %d bytes: views alive, unmapped with the last one",
                      self.nbytes)


def host_buffer_like(tensors: Mapping[str, "torch.Tensor"], *, align: int = 256,
                     copy: bool = True, name: str = "mx-weights"
                     ) -> tuple[HostBuffer, dict[str, "torch.Tensor"]]:
    """Lay CPU tensors out in one new :class:`HostBuffer` (in mapping order).

    This is how a publisher puts weights where the local transport can share them:
    load (or copy) them into the returned tensors instead of ordinary heap memory.

    Args:
        tensors: name -> tensor (any device; only shape and dtype are used unless copy).
        align: byte alignment of each tensor (a power of two, >= 16).
        copy: copy each tensor's values in.
        name: memfd name.

    Returns:
        The buffer and name -> tensor over it.
    """
    if align < 16 or align & (align - 1):
        raise ConfigError(f"align must be a power of two >= 16, got {align}")
    offsets, total = [], 0
    for t in tensors.values():
        total = -(-total // align) * align
        offsets.append(total)
        total += t.numel() * t.element_size()
    buf = HostBuffer(max(total, 1), name=name)
    out = {}
    for (key, t), off in zip(tensors.items(), offsets):
        view = buf.tensor(off, tuple(t.shape), t.dtype)
        if copy:
            view.copy_(t)
        out[key] = view
    return buf, out


def group_segments(segments: Sequence["Segment"], max_gap: int = MAX_GROUP_GAP
                   ) -> list[list[int]]:
    """Indices of ``segments`` grouped into runs that one reserved range can hold.

    Segments of one kind and device, sorted by address, join a group while the gap to
    the previous one is at most ``max_gap``; ``cuda_ipc`` segments are always alone
    (the driver picks where an IPC handle maps).

    Raises:
        PeerError: two segments overlap (a malformed source).
    """
    order = sorted(range(len(segments)), key=lambda i: (segments[i].kind, segments[i].device,
                                                       segments[i].addr))
    groups: list[list[int]] = []
    prev = None
    for i in order:
        seg = segments[i]
        if (prev is not None and seg.kind == prev.kind and seg.device == prev.device
                and seg.addr < prev.end):
            raise PeerError(f"source segments overlap: {prev} and {seg}")
        if (prev is None or seg.kind == "cuda_ipc" or seg.kind != prev.kind
                or seg.device != prev.device or seg.addr - prev.end > max_gap):
            groups.append([i])
        else:
            groups[-1].append(i)
        prev = seg
    return groups


class HostMapping(ClosedOnCollect):
    """Received memfd segments mapped read-only on the target, source layout kept.

    Args:
        segments: the ``memfd`` segments.
        fds: one descriptor per segment; the mapping owns them from now on (kept for
            :meth:`read_into`, closed by :meth:`close`, also when this fails), so the
            caller must not close them.
        files: ``file`` segments with their descriptors (several may share one; owned
            the same way): runs of the memfds that can be read from their checkpoint
            file's page cache instead (:mod:`.origin`). One that no memfd segment holds
            whole is not used.

    Raises:
        BackendError: a reservation or mapping failed (what was mapped is unmapped,
            every descriptor is closed).
    """

    def __init__(self, segments: Sequence["Segment"], fds: Sequence[int],
                 files: Sequence[tuple["Segment", int]] = ()) -> None:
        self._closed = True
        self._ranges: list[tuple[int, int]] = []      # (base, span) reserved
        self._where: list[tuple[int, int, int]] = []  # (src_addr, src_end, local_addr)
        self._fds: list[int] = []                     # the memfd of each _where entry
        self._ext: list[tuple[int, int, int, int]] = []  # (src_addr, src_end, fd, file offset)
        self._ext_fds = list(dict.fromkeys(fd for _, fd in files))  # each closed once
        self.files_on = True  # False: every read from the memfds (see read_into)
        self.file_bytes = 0   # bytes read_into took from a file's page cache
        # Reads of a file segment the page cache did not serve in full (pages evicted
        # after the copy's cachestat, or everywhere on a kernel without it). Such a read
        # also starts the kernel's readahead of what it missed (measured on Linux 6.18:
        # RWF_NOWAIT returns EAGAIN and queues the disk read), so a later read of those
        # bytes may hit: a miss says the page cache had lost pages, not how many bytes
        # the memfds then served.
        self.file_misses = 0
        self._count = threading.Lock()
        pending = list(fds) + self._ext_fds
        try:
            for group in group_segments(segments):
                start = segments[group[0]].addr
                span = max(segments[i].end for i in group) - start
                base = _mmap(None, span, _PROT_NONE,
                             _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
                if base in (None, _MAP_FAILED):
                    raise BackendError(f"reserving {span} bytes for mapped segments failed: "
                                       f"{_errno_text()}")
                self._ranges.append((base, span))
                for i in group:
                    seg = segments[i]
                    at = base + seg.addr - start
                    got = _mmap(at, seg.size, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fds[i], 0)
                    if got in (None, _MAP_FAILED) or got != at:
                        raise BackendError(f"mapping a received memfd ({seg.size} bytes) failed: "
                                           f"{_errno_text()}")
                    self._where.append((seg.addr, seg.end, at))
                    self._fds.append(fds[i])
            order = sorted(range(len(self._where)), key=self._where.__getitem__)
            self._where = [self._where[k] for k in order]
            self._fds = [self._fds[k] for k in order]
            for seg, fd in files:
                try:
                    self._find(seg.addr, seg.size)
                except PeerError:
                    log.debug("file segment %s lies in no shared memfd: not used", seg)
                    continue
                self._ext.append((seg.addr, seg.end, fd, seg.offset))
            self._ext.sort()
        except BaseException:
            self._unmap()
            _close_all(pending)
            raise
        self._closed = False

    def _find(self, src_addr: int, nbytes: int) -> int:
        import bisect
        k = bisect.bisect_right(self._where, (src_addr, float("inf"), 0)) - 1
        if k >= 0:
            s, e, _ = self._where[k]
            if s <= src_addr and src_addr + nbytes <= e:
                return k
        raise PeerError(f"source range 0x{src_addr:x}+{nbytes} is not in any shared host segment")

    def local_addr(self, src_addr: int, nbytes: int) -> int:
        """Where ``[src_addr, src_addr + nbytes)`` of the source is mapped here.

        Raises:
            PeerError: the range is not inside one shared segment.
        """
        k = self._find(src_addr, nbytes)
        s, _, at = self._where[k]
        return at + (src_addr - s)

    def locate(self, src_addr: int, nbytes: int) -> tuple[int, int]:
        """``(segment, offset)`` of the source's ``[src_addr, +nbytes)``: what to read
        it from (an index for :meth:`read_into`: a file segment that holds it whole
        while :attr:`files_on`, else the shared memfd) and where in that.

        Raises:
            PeerError: the range is not inside one shared segment.
        """
        if self.files_on and self._ext:
            import bisect
            j = bisect.bisect_right(self._ext, (src_addr, float("inf"), 0, 0)) - 1
            if j >= 0 and self._ext[j][0] <= src_addr and src_addr + nbytes <= self._ext[j][1]:
                return len(self._where) + j, src_addr - self._ext[j][0]
        k = self._find(src_addr, nbytes)
        return k, src_addr - self._where[k][0]

    def from_file(self, segment: int) -> bool:
        """Whether :meth:`read_into` of ``segment`` reads a file's page cache (while
        :attr:`files_on`) rather than a memfd."""
        return segment >= len(self._where) and self.files_on

    @property
    def file_segments(self) -> int:
        """File segments usable here (see ``files``)."""
        return len(self._ext)

    def read_source(self, segment: int, offset: int, nbytes: int) -> tuple[int, int, bool] | None:
        """Where a read of ``nbytes`` at ``offset`` of ``segment`` starts, for a reader
        of its own (``hostcopy``'s native loop): ``(fd, offset in fd, from a file)``,
        a file to be read without waiting (``RWF_NOWAIT``; what the page cache does not
        hold is left to :meth:`read_into`), or the memfd that holds the same bytes where
        the file's page cache holds under :data:`FILE_MIN_CACHED` of them. None where
        only :meth:`read_into` can read it (a file segment while :attr:`files_on` is
        off, a closed mapping, a range outside the segment)."""
        if self._closed or offset < 0 or nbytes < 0:
            return None
        if segment < len(self._where):
            s, e, _ = self._where[segment]
            return (self._fds[segment], offset, False) if offset + nbytes <= e - s else None
        j = segment - len(self._where)
        if not self.files_on or j >= len(self._ext):
            return None
        s, e, fd, foff = self._ext[j]
        if offset + nbytes > e - s:
            return None
        if not self._cached(fd, foff + offset, nbytes):
            k = self._find(s + offset, nbytes)
            return self._fds[k], s + offset - self._where[k][0], False
        return fd, foff + offset, True

    @staticmethod
    def _cached(fd: int, file_offset: int, nbytes: int) -> bool:
        """Whether to read ``[file_offset, +nbytes)`` of a file segment from the page
        cache: unless it holds less than :data:`FILE_MIN_CACHED` of it (then the memfd:
        a read there would queue disk reads, :func:`~.origin.cached_share`). True where
        the kernel cannot say (the read then finds out, as before)."""
        share = cached_share(fd, file_offset, nbytes)
        return share is None or share >= FILE_MIN_CACHED

    def count_file_bytes(self, nbytes: int, misses: int = 0) -> None:
        """Add ``nbytes`` read from a file's page cache by a reader of its own
        (:meth:`read_source`) to :attr:`file_bytes`, and the reads it left short because
        the page cache did not hold the bytes to :attr:`file_misses`."""
        with self._count:
            self.file_bytes += nbytes
            self.file_misses += misses

    def read_into(self, segment: int, offset: int, dst_addr: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``offset`` of a shared memfd to ``dst_addr`` (host memory)
        with ``pread``: the GIL is released, so several threads copy in parallel.

        Raises:
            ConfigError: the range is outside the segment, or the mapping is closed.
            BackendError: the read failed (e.g. ``dst_addr`` is not writable memory).
        """
        if self._closed:
            raise ConfigError("HostMapping.read_into() after close()")
        if segment >= len(self._where):
            self._read_file(segment - len(self._where), offset, dst_addr, nbytes)
            return
        s, e, _ = self._where[segment]
        if offset < 0 or nbytes < 0 or offset + nbytes > e - s:
            raise ConfigError(f"read of {nbytes} bytes at offset {offset} is outside a "
                              f"shared segment of {e - s} bytes")
        fd = self._fds[segment]
        done = 0
        while done < nbytes:
            got = _pread(fd, dst_addr + done, nbytes - done, offset + done)
            if got < 0:
                if ctypes.get_errno() == errno.EINTR:
                    continue
                raise BackendError(f"reading {nbytes} bytes of a shared memfd into 0x{dst_addr:x} "
                                   f"failed after {done}: {_errno_text()}")
            if got == 0:  # end of file: the source shrank its memfd under us
                raise BackendError(f"a shared memfd ended {offset + done} bytes in, before the "
                                   f"{nbytes} bytes to read at offset {offset}")
            done += got

    def _read_file(self, j: int, offset: int, dst_addr: int, nbytes: int) -> None:
        """A file segment's bytes from the page cache, never waiting for a disk; what
        the page cache does not hold (evicted, or the file shrank) from the memfd."""
        s, e, fd, foff = self._ext[j]
        if offset < 0 or nbytes < 0 or offset + nbytes > e - s:
            raise ConfigError(f"read of {nbytes} bytes at offset {offset} is outside a "
                              f"file segment of {e - s} bytes")
        got = 0
        if self.files_on and self._cached(fd, foff + offset, nbytes):
            try:
                got = read_cached(fd, foff + offset, dst_addr, nbytes)
            except OSError as exc:
                log.debug("reading a file segment failed (%s): the memfd instead", exc)
            else:
                if got == NOWAIT_UNSUPPORTED:
                    if self.files_on:
                        log.info("the source's checkpoint file cannot be read without "
                                 "waiting on its filesystem: reading its memfds instead")
                    self.files_on = False
                    got = 0
                else:
                    self.count_file_bytes(got, misses=int(got < nbytes))
        if got < nbytes:
            k = self._find(s + offset + got, nbytes - got)
            self.read_into(k, s + offset + got - self._where[k][0], dst_addr + got,
                           nbytes - got)

    def tensor(self, local_addr: int, nbytes: int) -> "torch.Tensor":
        """A uint8 CPU tensor over mapped memory (read-only pages: never write to it)."""
        import torch
        raw = (ctypes.c_uint8 * nbytes).from_address(local_addr)
        return torch.frombuffer(raw, dtype=torch.uint8)

    def _unmap(self) -> None:
        for base, span in self._ranges:
            if _munmap(base, span) != 0:
                log.warning("munmap of a mapped source range (%d bytes) failed: %s",
                            span, _errno_text())
        self._ranges.clear()
        self._where.clear()

    def close(self) -> None:
        """Unmap everything and close the descriptors. Idempotent. No view over the
        mapping may be used after."""
        if self._closed:
            return
        self._closed = True
        self._unmap()
        fds, self._fds = self._fds, []
        ext, self._ext_fds = self._ext_fds, []
        self._ext = []
        _close_all(fds + ext)


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


