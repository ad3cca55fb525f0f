"""The CUDA side of the local transport: the only module here that names cuda-python.

Source (export):

* memory from ``cuMemCreate`` (the VMM arena, PyTorch's expandable segments) is
  recognised by ``cuMemRetainAllocationHandle`` and exported per chunk with
  ``cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)``; the
  chunk must have been created with that handle type requested (the arena does,
  ``CudaVmmBackend(handle_type="posix_fd")``). The descriptor travels by SCM_RIGHTS,
  so no ptrace rights or shared PID namespace are needed (UCX's POSIX-fd path needs
  both).
* other device memory (``cudaMalloc``, PyTorch's caching allocator) is shared with a
  legacy CUDA IPC handle of the whole allocation (``cuMemGetAddressRange`` finds it).

Target (import): a ``vmm_fd`` group is imported, mapped into one reserved range at
the source's relative offsets and made accessible to the source's device and the
target's; a ``cuda_ipc`` segment is opened with lazy peer access. Copies are
``cuMemcpyAsync`` on the caller's stream (the copy engine; unified addressing picks
the direction, so a peer GPU's memory works the same way).

Every driver error becomes our error (BackendError on the source, PeerError on the
target) naming the call, the size and the device.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from modelexpress._closing import ClosedOnCollect
from modelexpress.errors import BackendError, ConfigError, PeerError

__all__ = ["CudaExport", "CudaMapping", "allocation_range", "describe_allocations",
           "export_vmm_fd", "is_vmm", "memcpy_async", "on_device"]

log = logging.getLogger(__name__)


def _drv() -> Any:
    from modelexpress._optional import require
    return require("cuda.bindings.driver", "the local transport's CUDA path")


def _name(drv: Any, err: Any) -> str:
    try:
        _, name = drv.cuGetErrorName(err)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - naming an error must not raise a new one
        return str(err)


def _check(drv: Any, result: Any, call: str, detail: str = "", error: type = BackendError) -> Any:
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise error(f"{call} failed{f' ({detail})' if detail else ''}: {_name(drv, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@contextlib.contextmanager
def on_device(device: int) -> Iterator[None]:
    """Make ``device``'s primary context current (through PyTorch's runtime, which then
    restores the caller's device): driver calls act on the current context, and a
    stream passed to cuMemcpyAsync must belong to it."""
    import torch
    with torch.cuda.device(device):
        torch.cuda.current_stream(device)
        _bind_primary_context(device)
        yield


_primary: dict[int, Any] = {}


def _bind_primary_context(device: int) -> None:
    """Make ``device``'s primary context current on this thread for the driver API.

    PyTorch's runtime binds it lazily, at a thread's first runtime call that needs a
    context: on a thread that made none (a pool thread that maps a source ahead of its
    copies) a driver call fails with CUDA_ERROR_INVALID_CONTEXT (measured: H100, CUDA
    13.0, cuIpcOpenMemHandle). The context is retained once per device and kept, as the
    runtime keeps it.
    """
    drv = _drv()
    err, ctx = drv.cuCtxGetCurrent()
    if err == drv.CUresult.CUDA_SUCCESS and ctx is not None and int(ctx) != 0:
        err, dev = drv.cuCtxGetDevice()
        if err == drv.CUresult.CUDA_SUCCESS and int(dev) == device:
            return
    ctx = _primary.get(device)
    if ctx is None:
        handle = _check(drv, drv.cuDeviceGet(device), "cuDeviceGet", f"cuda:{device}")
        ctx = _check(drv, drv.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain",
                     f"cuda:{device}")
        _primary[device] = ctx
    _check(drv, drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent", f"cuda:{device}")


class CudaExport:
    """One exportable device allocation of a source.

    Attributes:
        kind: ``"vmm_fd"`` or ``"cuda_ipc"``.
        addr, size, device: the allocation.
        ipc: the 64-byte IPC handle (``cuda_ipc``).
    """

    __slots__ = ("kind", "addr", "size", "device", "ipc")

    def __init__(self, kind: str, addr: int, size: int, device: int, ipc: bytes | None) -> None:
        self.kind, self.addr, self.size, self.device, self.ipc = kind, addr, size, device, ipc

    def __repr__(self) -> str:
        return f"CudaExport({self.kind}, 0x{self.addr:x}+{self.size}, cuda:{self.device})"


def describe_allocations(ranges: Iterable[tuple[int, int, int]]) -> list[CudaExport]:
    """The device allocations that hold the given ranges, each once.

    Args:
        ranges: ``(addr, nbytes, device)`` of tensors (or any device ranges).

    Returns:
        One :class:`CudaExport` per allocation, sorted by address.

    Raises:
        BackendError: a range is not device memory, spans two allocations, or is VMM
            memory created without the POSIX-fd handle type (it cannot be shared).
        DependencyError: cuda-python is missing.
    """
    drv = _drv()
    found: dict[int, CudaExport] = {}
    for addr, nbytes, device in sorted(ranges):
        hit = next((e for e in found.values() if e.addr <= addr < e.addr + e.size), None)
        if hit is None:
            with on_device(device):
                base, size = _check(drv, drv.cuMemGetAddressRange(drv.CUdeviceptr(addr)),
                                    "cuMemGetAddressRange", f"0x{addr:x} on cuda:{device}")
                base, size = int(base), int(size)
                hit = CudaExport(*_classify(drv, base, size, device))
            found[base] = hit
        if addr + nbytes > hit.addr + hit.size:
            raise BackendError(f"device range 0x{addr:x}+{nbytes} on cuda:{device} spans more "
                               f"than one allocation ({hit}); the local transport shares whole "
                               "allocations")
    return sorted(found.values(), key=lambda e: e.addr)


def _classify(drv: Any, base: int, size: int, device: int) -> tuple[str, int, int, int, bytes | None]:
    err, handle = drv.cuMemRetainAllocationHandle(drv.CUdeviceptr(base))
    if err == drv.CUresult.CUDA_SUCCESS:
        # cuMemCreate memory: it must be exportable as a POSIX fd (checked once here,
        # so a source learns at registration, not when a peer connects).
        try:
            err2, fd = drv.cuMemExportToShareableHandle(
                handle, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
            if err2 != drv.CUresult.CUDA_SUCCESS:
                raise BackendError(
                    f"VMM memory at 0x{base:x} ({size} bytes, cuda:{device}) cannot be exported as "
                    f"a POSIX fd ({_name(drv, err2)}): it was created without "
                    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; create the arena with "
                    "handle_type='posix_fd'")
            import os
            os.close(int(fd))
        finally:
            drv.cuMemRelease(handle)
        return "vmm_fd", base, size, device, None
    ipc = _check(drv, drv.cuIpcGetMemHandle(drv.CUdeviceptr(base)), "cuIpcGetMemHandle",
                 f"0x{base:x}+{size} on cuda:{device}")
    return "cuda_ipc", base, size, device, bytes(ipc.reserved)


def export_vmm_fd(addr: int, device: int) -> int:
    """A new POSIX fd for the VMM chunk mapped at ``addr``; the caller closes it.

    Raises:
        BackendError: the driver refused.
    """
    drv = _drv()
    with on_device(device):
        handle = _check(drv, drv.cuMemRetainAllocationHandle(drv.CUdeviceptr(addr)),
                        "cuMemRetainAllocationHandle", f"0x{addr:x} on cuda:{device}")
        try:
            fd = _check(drv, drv.cuMemExportToShareableHandle(
                handle, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                "cuMemExportToShareableHandle", f"0x{addr:x} on cuda:{device}")
        finally:
            drv.cuMemRelease(handle)
    return int(fd)


def allocation_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the device allocation holding ``ptr`` (one VMM chunk, one
    cudaMalloc), in the current context.

    Raises:
        PeerError: ``ptr`` is not device memory.
    """
    drv = _drv()
    base, size = _check(drv, drv.cuMemGetAddressRange(drv.CUdeviceptr(ptr)),
                        "cuMemGetAddressRange", f"0x{ptr:x}", error=PeerError)
    return int(base), int(size)


def is_vmm(ptr: int) -> bool:
    """Whether ``ptr`` lies in memory mapped with cuMemMap (VMM) rather than cudaMalloc."""
    drv = _drv()
    err, handle = drv.cuMemRetainAllocationHandle(drv.CUdeviceptr(ptr))
    if err != drv.CUresult.CUDA_SUCCESS:
        return False
    drv.cuMemRelease(handle)
    return True


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``cuMemcpyAsync`` (unified addressing: any direction, peer GPUs included).

    Raises:
        PeerError: the driver refused (the message names the addresses and size).
    """
    drv = _drv()
    _check(drv, drv.cuMemcpyAsync(drv.CUdeviceptr(dst), drv.CUdeviceptr(src), nbytes,
                                  drv.CUstream(stream)),
           "cuMemcpyAsync", f"{nbytes} bytes 0x{src:x} -> 0x{dst:x}", error=PeerError)


def memcpy2d_async(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                   height: int, stream: int) -> None:
    """``cuMemcpy2DAsync`` of ``height`` rows of ``width`` bytes, the rows ``src_pitch``
    apart at ``src`` and ``dst_pitch`` apart at ``dst`` (unified addressing on both
    sides, as :func:`memcpy_async`): one call where per-row copies would take one each.

    Raises:
        PeerError: the driver refused (the message names the addresses and shape).
    """
    drv = _drv()
    kind = drv.CUmemorytype.CU_MEMORYTYPE_UNIFIED
    copy = drv.CUDA_MEMCPY2D()
    copy.srcMemoryType, copy.srcDevice, copy.srcPitch = kind, drv.CUdeviceptr(src), src_pitch
    copy.dstMemoryType, copy.dstDevice, copy.dstPitch = kind, drv.CUdeviceptr(dst), dst_pitch
    copy.WidthInBytes, copy.Height = width, height
    _check(drv, drv.cuMemcpy2DAsync(copy, drv.CUstream(stream)), "cuMemcpy2DAsync",
           f"{height} rows of {width} bytes 0x{src:x} (pitch {src_pitch}) -> 0x{dst:x} "
           f"(pitch {dst_pitch})", error=PeerError)


class CudaMapping(ClosedOnCollect):
    """A source's device segments mapped into this process.

    Args:
        groups: lists of ``(segment, fd)``; a group of ``vmm_fd`` segments maps into one
            reserved range (fds are closed once imported; the caller must not close
            them again), a ``cuda_ipc`` group has one segment and fd -1.
        device: the target's CUDA device (it is granted access to every chunk).

    Raises:
        PeerError: an import or mapping failed (everything done so far is undone).
    """

    def __init__(self, groups: Sequence[Sequence[tuple[Any, int]]], device: int) -> None:
        self._closed = True
        self._drv = _drv()
        self.device = device
        self._reserved: list[tuple[int, int]] = []
        self._mapped: list[tuple[int, int]] = []
        self._handles: list[Any] = []
        self._ipc: list[int] = []
        self._where: list[tuple[int, int, int]] = []
        self._group_of: dict[int, int] = {}  # local start of a segment -> its group
        pending = [fd for g in groups for _, fd in g if fd >= 0]
        try:
            with on_device(device):
                try:
                    for group in groups:
                        if group[0][0].kind == "cuda_ipc":
                            self._open_ipc(group[0][0])
                        else:
                            self._map_vmm(group)
                    self._where.sort()
                except BaseException:
                    self._undo()
                    raise
        finally:
            import os
            for fd in pending:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._closed = False

    def _open_ipc(self, seg: Any) -> None:
        drv = self._drv
        h = drv.CUipcMemHandle()
        h.reserved = seg.ipc
        flags = int(drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.value)
        ptr = int(_check(drv, drv.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle",
                         f"{seg.size} bytes of cuda:{seg.device} into cuda:{self.device}",
                         error=PeerError))
        self._ipc.append(ptr)
        self._where.append((seg.addr, seg.addr + seg.size, ptr))
        self._group_of[ptr] = len(self._group_of)  # an IPC mapping is its own group

    def _map_vmm(self, group: Sequence[tuple[Any, int]]) -> None:
        drv = self._drv
        start = group[0][0].addr
        span = max(s.addr + s.size for s, _ in group) - start
        src_dev = group[0][0].device
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = src_dev
        gran = int(_check(drv, drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity", error=PeerError))
        span = -(-span // gran) * gran
        base = int(_check(drv, drv.cuMemAddressReserve(span, gran, 0, 0), "cuMemAddressReserve",
                          f"{span} bytes", error=PeerError))
        self._reserved.append((base, span))
        access = []
        for dev in sorted({src_dev, self.device}):
            desc = drv.CUmemAccessDesc()
            desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = dev
            desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            access.append(desc)
        ht = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        gid = len(self._reserved) + (1 << 32)  # one group per reserved range
        for seg, fd in group:
            handle = _check(drv, drv.cuMemImportFromShareableHandle(fd, ht),
                            "cuMemImportFromShareableHandle", f"{seg.size} bytes of cuda:{src_dev}",
                            error=PeerError)
            self._handles.append(handle)
            at = base + seg.addr - start
            _check(drv, drv.cuMemMap(drv.CUdeviceptr(at), seg.size, 0, handle, 0), "cuMemMap",
                   f"{seg.size} bytes at 0x{at:x}", error=PeerError)
            self._mapped.append((at, seg.size))
            _check(drv, drv.cuMemSetAccess(drv.CUdeviceptr(at), seg.size, access, len(access)),
                   "cuMemSetAccess", f"{seg.size} bytes at 0x{at:x} for cuda:{sorted({src_dev, self.device})}",
                   error=PeerError)
            self._where.append((seg.addr, seg.addr + seg.size, at))
            self._group_of[at] = gid

    def local_addr(self, src_addr: int, nbytes: int) -> int:
        """Where ``[src_addr, src_addr + nbytes)`` of the source is mapped here.

        Raises:
            PeerError: the range is not inside one mapped group.
        """
        import bisect
        k = bisect.bisect_right(self._where, (src_addr, float("inf"), 0)) - 1
        # ranges of one VMM group are contiguous here: walk forward over adjacent chunks
        if k >= 0:
            s, e, at = self._where[k]
            end = src_addr + nbytes
            j = k
            while end > e and j + 1 < len(self._where):
                s2, e2, at2 = self._where[j + 1]
                if s2 != e or at2 != at + (s2 - s):
                    break
                e, j = e2, j + 1
            if s <= src_addr and end <= e:
                return at + (src_addr - s)
        raise PeerError(f"source range 0x{src_addr:x}+{nbytes} is not in any shared device segment")

    def group_of(self, src_addr: int) -> int:
        """The group of the mapped segment holding ``src_addr``: one CUDA IPC mapping, or
        one reserved range of imported VMM chunks. A copy may span chunks of one range
        (one cuMemcpy across two imported chunks worked on an H200, bench/local.py
        ``copy_across_vmm_chunks``) but never two legacy allocations (refused with
        CUDA_ERROR_INVALID_VALUE there)."""
        import bisect
        k = bisect.bisect_right(self._where, (src_addr, float("inf"), 0)) - 1
        return self._group_of[self._where[k][2]] if k >= 0 else -1

    def _undo(self) -> None:
        drv = self._drv
        for at, size in reversed(self._mapped):
            err, = drv.cuMemUnmap(drv.CUdeviceptr(at), size)
            if err != drv.CUresult.CUDA_SUCCESS:
                log.warning("cuMemUnmap(0x%x, %d): %s", at, size, _name(drv, err))
        for handle in self._handles:
            drv.cuMemRelease(handle)
        for base, span in self._reserved:
            drv.cuMemAddressFree(drv.CUdeviceptr(base), span)
        for ptr in self._ipc:
            err, = drv.cuIpcCloseMemHandle(drv.CUdeviceptr(ptr))
            if err != drv.CUresult.CUDA_SUCCESS:
                log.warning("cuIpcCloseMemHandle(0x%x): %s", ptr, _name(drv, err))
        self._mapped.clear()
        self._handles.clear()
        self._reserved.clear()
        self._ipc.clear()
        self._where.clear()
        self._group_of.clear()

    def close(self) -> None:
        """Unmap, release and close everything. Idempotent; pending copies must be done."""
        if self._closed:
            return
        self._closed = True
        with on_device(self.device):
            self._undo()


def check_device(device: int) -> None:
    """Raise ConfigError when ``device`` is not a CUDA ordinal here."""
    import torch
    if not torch.cuda.is_available() or not 0 <= device < torch.cuda.device_count():
        raise ConfigError(f"no CUDA device {device} in this process")
