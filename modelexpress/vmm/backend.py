"""CudaVmmBackend: the CUDA driver's virtual memory management calls (cuda-python).

This module is the only place that names cuda-python. Every driver error becomes a
:class:`BackendError` naming the call, the CUDA error, the size and the device.

Context: cuda-python driver calls act on the *current* context, and vLLM found that
calls made on a thread without one fail with context mismatches. The backend retains
the device's primary context (the one PyTorch's runtime uses) and makes it current
around every call: set it when the thread has none, push/pop it when the thread has
another one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator, Literal

from modelexpress.errors import BackendError, ConfigError

__all__ = ["CudaVmmBackend", "cuda_vmm_supported"]

log = logging.getLogger(__name__)

HandleType = Literal["none", "posix_fd", "auto"]


def _driver() -> Any:
    from modelexpress._optional import require
    return require("cuda.bindings.driver", "the CUDA VMM backend")


def cuda_vmm_supported(device: int = 0) -> tuple[bool, str]:
    """Whether ``device`` supports CUDA VMM, and why not.

    Returns:
        ``(supported, reason)``; never raises for a missing driver or device.
    """
    from modelexpress._optional import available
    if not available("cuda.bindings"):
        return False, "cuda-python (cuda.bindings) is not installed"
    drv = _driver()
    err, = drv.cuInit(0)
    if err != drv.CUresult.CUDA_SUCCESS:
        return False, f"cuInit failed: {_name(drv, err)}"
    err, count = drv.cuDeviceGetCount()
    if err != drv.CUresult.CUDA_SUCCESS or device >= count:
        return False, f"no CUDA device {device} ({count if not err else 0} present)"
    err, dev = drv.cuDeviceGet(device)
    attr = drv.CUdevice_attribute
    _, major = drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    _, vmm = drv.cuDeviceGetAttribute(
        attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev)
    if major < 7 or not vmm:
        return False, f"device {device} has compute capability {major}.x / VMM={vmm} (needs >= 7.0)"
    return True, f"device {device}: VMM supported (compute capability {major}.x)"


def _name(drv: Any, err: Any) -> str:
    try:
        _, name = drv.cuGetErrorName(err)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - naming an error must not raise a new one
        return str(err)


class CudaVmmBackend:
    """CUDA VMM through cuda-python: reserve, cuMemCreate, cuMemMap, cuMemSetAccess.

    Args:
        device: CUDA device ordinal.
        handle_type: shareable handle type requested for each chunk: "none",
            "posix_fd" (exportable to another process as a file descriptor: the local
            transport serves chunks this way), or "auto" (posix_fd where the device
            reports support for it, else none). FABRIC handles are refused on the
            project's H200 machine (GPU.md).

    Raises:
        DependencyError: cuda-python is missing.
        ConfigError: bad handle_type.
        BackendError: no such device, no VMM support, or a driver call failed.
    """

    kind: Literal["cuda"] = "cuda"

    def __init__(self, device: int = 0, handle_type: HandleType = "none") -> None:
        if handle_type not in ("none", "posix_fd", "auto"):
            raise ConfigError(f"handle_type must be 'none', 'posix_fd' or 'auto', "
                              f"got {handle_type!r}")
        self._closed = True  # until the primary context is retained (see close)
        self._lock = threading.Lock()
        self._drv = drv = _driver()
        self.device = device
        self.handle_type = handle_type
        self._check(drv.cuInit(0), "cuInit")
        self._dev = self._check(drv.cuDeviceGet(device), "cuDeviceGet")
        attr = drv.CUdevice_attribute
        vmm = self._check(drv.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, self._dev),
            "cuDeviceGetAttribute(VMM)")
        if not vmm:
            raise BackendError(f"CUDA device {device} does not support VMM")
        if handle_type == "auto":
            posix = self._check(drv.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, self._dev),
                "cuDeviceGetAttribute(POSIX fd handles)")
            self.handle_type = handle_type = "posix_fd" if posix else "none"
        rdma = self._check(drv.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, self._dev),
            "cuDeviceGetAttribute(GDR with VMM)")
        self._ctx = self._check(drv.cuDevicePrimaryCtxRetain(self._dev),
                                "cuDevicePrimaryCtxRetain")
        try:
            prop = drv.CUmemAllocationProp()
            prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = device
            if handle_type == "posix_fd":
                prop.requestedHandleTypes = (
                    drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            # Needed for ibv_reg_dmabuf_mr over the range (the single-region path).
            if rdma:
                prop.allocFlags.gpuDirectRDMACapable = 1
            self._prop = prop
            access = drv.CUmemAccessDesc()
            access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = device
            access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._access = access
            with self._current():
                self.granularity = int(self._check(drv.cuMemGetAllocationGranularity(
                    prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                    "cuMemGetAllocationGranularity"))
        except BaseException:
            drv.cuDevicePrimaryCtxRelease(self._dev)
            raise
        self.gpu_direct_rdma = bool(rdma)
        self._closed = False

    # ------------------------------------------------------------ plumbing

    def _check(self, result: Any, call: str, detail: str = "") -> Any:
        """Unpack a cuda-python ``(err, *values)`` tuple or raise BackendError."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._drv.CUresult.CUDA_SUCCESS:
            extra = f" ({detail})" if detail else ""
            raise BackendError(f"{call} failed on CUDA device {self.device}{extra}: "
                               f"{_name(self._drv, err)}")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        drv = self._drv
        cur = self._check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if cur is not None and int(cur) == int(self._ctx):
            yield
            return
        if cur is None or int(cur) == 0:
            # A thread with no context: leave the primary one current, as the CUDA
            # runtime would after its first call on this thread.
            self._check(drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            yield
            return
        self._check(drv.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            drv.cuCtxPopCurrent()

    def _ptr(self, va: int) -> Any:
        return self._drv.CUdeviceptr(va)

    # ------------------------------------------------------------ VmmBackend

    def reserve(self, total: int) -> int:
        with self._current():
            ptr = self._check(self._drv.cuMemAddressReserve(total, self.granularity, 0, 0),
                              "cuMemAddressReserve", f"{total} bytes")
        return int(ptr)

    def release_reservation(self, base: int, total: int) -> None:
        with self._current():
            self._check(self._drv.cuMemAddressFree(self._ptr(base), total),
                        "cuMemAddressFree", f"0x{base:x}+{total}")

    def create(self, size: int) -> Any:
        with self._current():
            return self._check(self._drv.cuMemCreate(size, self._prop, 0),
                               "cuMemCreate", f"{size} bytes")

    def map(self, va: int, size: int, handle: Any) -> None:
        with self._current():
            self._check(self._drv.cuMemMap(self._ptr(va), size, 0, handle, 0),
                        "cuMemMap", f"{size} bytes at 0x{va:x}")

    def set_access(self, va: int, size: int) -> None:
        with self._current():
            self._check(self._drv.cuMemSetAccess(self._ptr(va), size, [self._access], 1),
                        "cuMemSetAccess", f"{size} bytes at 0x{va:x}")

    def unmap(self, va: int, size: int) -> None:
        with self._current():
            self._check(self._drv.cuMemUnmap(self._ptr(va), size),
                        "cuMemUnmap", f"{size} bytes at 0x{va:x}")

    def release(self, handle: Any) -> None:
        with self._current():
            self._check(self._drv.cuMemRelease(handle), "cuMemRelease")

    def export_dmabuf(self, va: int, size: int) -> int:
        """A dmabuf fd spanning ``[va, va+size)`` (``cuMemGetHandleForAddressRange``).

        The caller owns the fd and closes it. Every byte of the range must be mapped.

        Raises:
            BackendError: the driver refused (e.g. a hole in the range, or no dmabuf
                support in the kernel driver).
        """
        drv = self._drv
        with self._current():
            fd = self._check(drv.cuMemGetHandleForAddressRange(
                self._ptr(va), size,
                drv.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
                "cuMemGetHandleForAddressRange", f"{size} bytes at 0x{va:x}")
        return int(fd)

    def export_chunk(self, va: int, size: int) -> int:
        """A POSIX file descriptor for the chunk mapped at ``va``; the caller closes it.

        ``cuMemRetainAllocationHandle`` finds the chunk's handle from its address (no
        handle table here), ``cuMemExportToShareableHandle`` exports it.

        Raises:
            ConfigError: the backend was created without ``handle_type="posix_fd"``.
            BackendError: the driver refused.
        """
        if self.handle_type != "posix_fd":
            raise ConfigError(f"chunks of this arena cannot be exported: handle_type is "
                              f"{self.handle_type!r}, create the backend with 'posix_fd' or 'auto'")
        drv = self._drv
        with self._current():
            handle = self._check(drv.cuMemRetainAllocationHandle(self._ptr(va)),
                                 "cuMemRetainAllocationHandle", f"0x{va:x}")
            try:
                fd = self._check(drv.cuMemExportToShareableHandle(
                    handle, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0), "cuMemExportToShareableHandle", f"{size} bytes at 0x{va:x}")
            finally:
                drv.cuMemRelease(handle)
        return int(fd)

    def close(self) -> None:
        """Release the retained primary context. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        err, = self._drv.cuDevicePrimaryCtxRelease(self._dev)
        if err != self._drv.CUresult.CUDA_SUCCESS:
            log.warning("cuDevicePrimaryCtxRelease on device %d: %s",
                        self.device, _name(self._drv, err))

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - __del__ must never raise
            pass
