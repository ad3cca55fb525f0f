"""VmmArena: one reserved virtual range, bump-allocated, one physical chunk per slot.

The arena reserves a large virtual address range once (16 TiB by default; a
reservation has no physical cost), hands out granularity-aligned slots from a bump
pointer, and backs each slot with its own physical handle from the backend::

    base                                                         base + total
    |<-- chunk 0 -->|<-- chunk 1 -->|  hole  |<-- chunk 3 -->|   unused ...  |
    |  live         |  live         | (freed)|  live         |               |
    |<------------------- used (bump) ----------------------->|

``registered_range()`` returns ``(base, used)``: the span a transfer layer registers
as one region. ``live_allocations()`` lists the physical chunks, one per backend
handle, for registration per chunk. The bump pointer never moves back except to undo
the very last slot when its mapping fails; a ``free`` unmaps and releases the chunk
and leaves a hole, so registered addresses of other chunks never change.

Backends are passed in as objects (:class:`VmmBackend`): ``CudaVmmBackend`` (GPU),
``HostVmmBackend`` (real memfd pages on the CPU), ``StubVmmBackend`` (bump math only).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol, runtime_checkable

from modelexpress._closing import ClosedOnCollect
from modelexpress.errors import ArenaClosedError, BackendError, ConfigError, MxTimeoutError
from modelexpress.vmm._core import Core, ExtCore, PyCore, load_extension

if TYPE_CHECKING:
    import torch

__all__ = ["VmmBackend", "VmmArena", "DEFAULT_TOTAL_BYTES"]

log = logging.getLogger(__name__)

DEFAULT_TOTAL_BYTES = 16 << 40  # 16 TiB: virtual only; CUDA and Linux reserve it for free
_CLOSE_DEADLINE_S = 60.0        # how long close() waits for running malloc/free calls
_CLOSE_LOG_EVERY_S = 5.0


@runtime_checkable
class VmmBackend(Protocol):
    """The driver / OS calls behind an arena. Every method raises BackendError.

    The arena calls ``create``, ``map``, ``set_access`` in that order for a new chunk
    and undoes the completed steps in reverse if a later one fails; ``unmap`` then
    ``release`` for a freed chunk.
    """

    kind: Literal["host", "cuda", "stub"]
    """Memory kind: host memory registers with NIXL as DRAM, cuda as VRAM."""

    device: int
    granularity: int
    """Every slot's size and address is a multiple of this (bytes)."""

    def reserve(self, total: int) -> int:
        """Reserve ``total`` bytes of address space (no physical memory); return base."""
    def release_reservation(self, base: int, total: int) -> None:
        """Give a reservation back."""
    def create(self, size: int) -> Any:
        """Allocate a physical handle of ``size`` bytes."""
    def map(self, va: int, size: int, handle: Any) -> None:
        """Map ``handle`` at ``va`` (inside the reservation)."""
    def set_access(self, va: int, size: int) -> None:
        """Make ``[va, va+size)`` readable and writable."""
    def unmap(self, va: int, size: int) -> None:
        """Unmap ``[va, va+size)``; the address range stays reserved."""
    def release(self, handle: Any) -> None:
        """Release a physical handle."""
    def close(self) -> None:
        """Release backend-wide resources (idempotent)."""


def _default_backend(device: int) -> VmmBackend:
    from modelexpress.vmm.backend import CudaVmmBackend
    return CudaVmmBackend(device)


class VmmArena(ClosedOnCollect):
    """A reserved virtual range whose slots are backed by separate physical chunks.

    Args:
        total_bytes: size of the reservation (rounded up to the granularity).
        device: device ordinal (for the default CUDA backend and messages).
        backend: the :class:`VmmBackend`; default ``CudaVmmBackend(device)``.
        use_extension: use the C core (``_alloc_ext``) — required by ``use_arena``;
            None means "when it is built", False forces the pure-Python core.

    Raises:
        ConfigError: ``total_bytes`` is not a positive int.
        DependencyError: ``use_extension=True`` but the extension is not built.
        BackendError: the reservation failed.
    """

    def __init__(self, total_bytes: int = DEFAULT_TOTAL_BYTES, device: int = 0,
                 backend: VmmBackend | None = None, *,
                 use_extension: bool | None = None) -> None:
        self._closed = True  # until fully built, so __del__/close are no-ops
        if not isinstance(total_bytes, int) or isinstance(total_bytes, bool) or total_bytes <= 0:
            raise ConfigError(f"total_bytes must be a positive int, got {total_bytes!r}")
        self.backend: VmmBackend = backend if backend is not None else _default_backend(device)
        self.device = device
        self.granularity = int(self.backend.granularity)
        if self.granularity <= 0 or self.granularity & (self.granularity - 1):
            raise ConfigError(f"backend granularity must be a power of two, "
                              f"got {self.granularity}")
        self.total_bytes = -(-total_bytes // self.granularity) * self.granularity
        ext = load_extension() if use_extension is not False else None
        if use_extension and ext is None:
            from modelexpress.errors import DependencyError
            raise DependencyError("the VMM arena C extension (_alloc_ext) is not built; "
                                  "reinstall modelexpress with a C++ compiler present")
        self.base = int(self.backend.reserve(self.total_bytes))
        # The callbacks hold the backend, not the arena: no reference cycle through
        # the C state, so an unreferenced arena is closed by __del__ at once.
        map_cb = functools.partial(_map_chunk, self.backend, device)
        unmap_cb = functools.partial(_unmap_chunk, self.backend)
        try:
            core: Core
            if ext is not None:
                core = ExtCore(ext, self.base, self.total_bytes, self.granularity,
                               map_cb, unmap_cb)
            else:
                core = PyCore(self.base, self.total_bytes, self.granularity,
                              map_cb, unmap_cb)
        except BaseException:
            self.backend.release_reservation(self.base, self.total_bytes)
            raise
        self._core = core
        self._close_lock = threading.Lock()
        self._on_close: list[Callable[[], None]] = []
        self._closed = False
        log.debug("VmmArena reserved %d bytes at 0x%x (%s, granularity %d, %s core)",
                  self.total_bytes, self.base, self.backend.kind, self.granularity,
                  "C" if ext is not None else "Python")

    # ------------------------------------------------------------- public API

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ArenaClosedError(f"VmmArena.{what}() after close() "
                                   f"({self.backend.kind} device {self.device})")

    def malloc(self, size: int) -> int:
        """Allocate ``size`` bytes (rounded up to the granularity) as one new chunk.

        Args:
            size: bytes, > 0.

        Returns:
            The virtual address of the chunk.

        Raises:
            ConfigError: size is not a positive int.
            ArenaClosedError: the arena is closed.
            ArenaExhaustedError: the reservation has no room left.
            BackendError: the backend failed; nothing stays allocated.
        """
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ConfigError(f"allocation size must be a positive int, got {size!r}")
        self._check_open("malloc")
        return self._core.malloc(size)

    def free(self, va: int) -> None:
        """Unmap and release the chunk at ``va``; its address range stays a hole.

        Raises:
            ArenaClosedError: the arena is closed.
            InvalidFreeError: ``va`` is not the start of a live allocation.
            BackendError: unmap/release failed (the entry is gone either way).
        """
        self._check_open("free")
        self._core.free(va)

    def registered_range(self) -> tuple[int, int]:
        """Return ``(base, used)``: the span every chunk so far lies in."""
        return self.base, self.used_bytes

    def live_allocations(self) -> list[tuple[int, int]]:
        """Return the live chunks as ``(va, size)``, sorted by va, one per backend handle."""
        return self._core.live() if not self._closed else []

    def export_chunks(self) -> list[tuple[int, int, int]]:
        """A new file descriptor per live chunk, for sharing with another process.

        Returns:
            ``(va, size, fd)`` per live chunk, sorted by va; the caller owns the fds.

        Raises:
            ConfigError: the backend cannot export (the stub, or a CUDA backend created
                without the POSIX-fd handle type).
            BackendError: an export failed (descriptors already made are closed).
        """
        export = getattr(self.backend, "export_chunk", None)
        if export is None:
            raise ConfigError(f"a {self.backend.kind!r} arena backend cannot export chunks")
        out: list[tuple[int, int, int]] = []
        try:
            for va, size in self.live_allocations():
                out.append((va, size, int(export(va, size))))
        except BaseException:
            import os
            for _, _, fd in out:
                os.close(fd)
            raise
        return out

    @property
    def used_bytes(self) -> int:
        """Bytes from ``base`` to the bump pointer (holes included)."""
        return int(self._core.stats()["used_bytes"]) if not self._closed else 0

    @property
    def mapped_bytes(self) -> int:
        """Bytes of physical memory currently mapped (live chunks)."""
        return int(self._core.stats()["mapped_bytes"]) if not self._closed else 0

    @property
    def live_allocation_count(self) -> int:
        """Number of live chunks."""
        return int(self._core.stats()["live"]) if not self._closed else 0

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, Any]:
        """Counters of the core (mallocs, frees, failures, in_flight, ...)."""
        return self._core.stats()

    def empty(self, shape: tuple[int, ...] | list[int] | int, dtype: "torch.dtype") -> "torch.Tensor":
        """A CPU tensor over a new chunk of host arena memory (host backend only).

        The chunk is freed when the last view of the tensor is collected. Tensors
        must not outlive the arena: ``close()`` unmaps their memory.

        Args:
            shape: tensor shape.
            dtype: torch dtype.

        Returns:
            An uninitialised contiguous tensor whose ``data_ptr()`` lies in the arena.

        Raises:
            ConfigError: the backend's memory is not host memory.
        """
        from modelexpress._optional import require
        torch = require("torch", "VmmArena.empty")
        if self.backend.kind != "host":
            raise ConfigError(f"VmmArena.empty needs the host backend, this arena is "
                              f"{self.backend.kind!r}; on CUDA use use_arena()")
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        numel = 1
        for d in dims:
            numel *= d
        nbytes = numel * dtype.itemsize
        va = self.malloc(max(nbytes, 1))
        buf = (ctypes.c_uint8 * max(nbytes, 1)).from_address(va)
        # torch.frombuffer keeps `buf` alive for the storage's lifetime; when the
        # storage goes, `buf` goes, and the finalizer gives the chunk back.
        weakref.finalize(buf, _release_view, weakref.ref(self), va)
        flat = torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]
        return flat.view(dtype).view(dims)

    def __del__(self) -> None:
        # At interpreter exit the objects go in no set order: unmapping now would pull
        # the memory from under tensors the interpreter has yet to free (PyTorch then
        # aborts the exiting process). The process is ending: the driver unmaps.
        if sys.is_finalizing():
            return
        super().__del__()

    def add_close_callback(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at the start of ``close()`` (e.g. to release a MemPool's segments)."""
        self._check_open("add_close_callback")
        self._on_close.append(fn)

    def close(self) -> None:
        """Unmap every live chunk, release the reservation. Idempotent.

        Waits (with a deadline) for malloc/free calls already running on other
        threads. Memory of tensors still alive becomes invalid.

        Raises:
            MxTimeoutError: running calls did not finish within the deadline.
        """
        with self._close_lock:
            if self._closed:
                return
            for fn in reversed(self._on_close):
                _undo("close callback", fn)
            self._on_close.clear()
            self._closed = True
            self._drain()
            leftovers = self._core.take_all()
            if leftovers:
                log.info("VmmArena closing with %d live chunks (%d bytes) on %s device %d",
                         len(leftovers), sum(s for _, s, _ in leftovers),
                         self.backend.kind, self.device)
            for va, size, handle in leftovers:
                _undo("unmap", _unmap_chunk, self.backend, va, size, handle)
            _undo("release_reservation", self.backend.release_reservation,
                       self.base, self.total_bytes)
            _undo("backend close", self.backend.close)

    def _drain(self) -> None:
        start = time.monotonic()
        last_log = start
        while True:
            remaining = self._core.drain(min(1.0, _CLOSE_LOG_EVERY_S))
            if remaining == 0:
                return
            now = time.monotonic()
            if now - start > _CLOSE_DEADLINE_S:
                raise MxTimeoutError(
                    f"VmmArena.close: {remaining} malloc/free calls still running after "
                    f"{now - start:.0f} s on {self.backend.kind} device {self.device}")
            if now - last_log >= _CLOSE_LOG_EVERY_S:
                log.warning("VmmArena.close: still waiting for %d running calls after %.0f s",
                            remaining, now - start)
                last_log = now

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"used={self.used_bytes} live={self.live_allocation_count}"
        return (f"VmmArena({self.backend.kind}, base=0x{getattr(self, 'base', 0):x}, "
                f"total={getattr(self, 'total_bytes', 0)}, {state})")


def _undo(what: str, fn: Callable[..., None], *args: Any) -> None:
    # A failing rollback must not hide the error that caused it.
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - logged; the original error is re-raised
        log.error("VmmArena: rollback step %s%r failed", what, args, exc_info=True)


def _map_chunk(backend: VmmBackend, device: int, va: int, size: int) -> Any:
    """create + map + set_access, undoing completed steps on failure (core callback)."""
    handle = backend.create(size)
    try:
        backend.map(va, size, handle)
        try:
            backend.set_access(va, size)
        except BaseException:
            _undo("unmap", backend.unmap, va, size)
            raise
    except BaseException as exc:
        _undo("release", backend.release, handle)
        log.warning("VmmArena: mapping %d bytes at 0x%x on %s device %d failed: %s",
                    size, va, backend.kind, device, exc)
        raise
    return handle


def _unmap_chunk(backend: VmmBackend, va: int, size: int, handle: Any) -> None:
    """unmap + release (core callback); release runs even if unmap failed."""
    try:
        backend.unmap(va, size)
    finally:
        backend.release(handle)


def _release_view(arena_ref: "weakref.ref[VmmArena]", va: int) -> None:
    """Finalizer of an ``empty()`` tensor's buffer: free its chunk if the arena is open."""
    arena = arena_ref()
    if arena is None or arena.closed:
        return
    try:
        arena.free(va)
    except (ArenaClosedError, BackendError) as exc:
        log.debug("VmmArena: releasing tensor chunk 0x%x: %s", va, exc)
    except Exception:  # noqa: BLE001 - finalizers must not raise
        log.warning("VmmArena: releasing tensor chunk 0x%x failed", va, exc_info=True)
