"""The arena's bookkeeping core: bump pointer, live-allocation map, in-flight count.

Two implementations with the same semantics:

* :class:`ExtCore` wraps the C extension's per-arena state (``_alloc_ext``). It is
  the one the CUDA pluggable allocator (``mx_malloc`` / ``mx_free``) shares, so the
  Python ``VmmArena.malloc`` and PyTorch's allocations see one bump pointer and one
  live map.
* :class:`PyCore` is the pure-Python fallback used when the extension did not build
  (``ARENA_AVAILABLE`` False): the host and stub backends still work.

Both call ``map_cb(va, size) -> handle`` after reserving a slot and
``unmap_cb(va, size, handle)`` after removing an entry; the arena supplies them.
The ordering rule both follow: a call counts itself in flight *before* it reads the
closed flag, and ``drain`` sets the flag *before* it waits for the count to reach
zero, so a drained core can no longer run a callback.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any, Callable, Protocol

from modelexpress._optional import import_extension
from modelexpress.errors import (
    ArenaClosedError,
    ArenaExhaustedError,
    ConfigError,
    InvalidFreeError,
)

__all__ = ["Core", "ExtCore", "PyCore", "load_extension"]

MapCallback = Callable[[int, int], Any]
UnmapCallback = Callable[[int, int, Any], None]

_EXT: ModuleType | None = None
_EXT_ERROR: ImportError | None = None


def load_extension() -> ModuleType | None:
    """Import ``_alloc_ext`` once; None when it was not built.

    Returns:
        The configured extension module, or None.
    """
    global _EXT, _EXT_ERROR
    if _EXT is None and _EXT_ERROR is None:
        # not built (no compiler) or built for another ABI: MX_VMM_ARENA=1 falls back
        # with one warning per reason (runtime.py)
        ext, _EXT_ERROR = import_extension("modelexpress.vmm._alloc_ext")
        if ext is None:
            return None
        ext.configure(ArenaClosedError, ArenaExhaustedError, InvalidFreeError)
        _EXT = ext
    return _EXT


def extension_error() -> ImportError | None:
    """Why the extension could not be imported (None if it was, or was not tried)."""
    return _EXT_ERROR


class Core(Protocol):
    """What VmmArena needs from a bookkeeping core."""

    def malloc(self, size: int) -> int: ...
    def free(self, va: int) -> int: ...
    def live(self) -> list[tuple[int, int]]: ...
    def stats(self) -> dict[str, Any]: ...
    def drain(self, wait_s: float) -> int: ...
    def take_all(self) -> list[tuple[int, int, Any]]: ...


class ExtCore:
    """The C extension's state for one arena (see ``_alloc_ext.cpp``)."""

    def __init__(self, ext: ModuleType, base: int, total: int, granularity: int,
                 map_cb: MapCallback, unmap_cb: UnmapCallback) -> None:
        self._ext = ext
        self.capsule = ext.create(base, total, granularity, map_cb, unmap_cb)

    def malloc(self, size: int) -> int:
        return self._ext.malloc(self.capsule, size)

    def free(self, va: int) -> int:
        return self._ext.free(self.capsule, va)

    def live(self) -> list[tuple[int, int]]:
        return self._ext.live(self.capsule)

    def stats(self) -> dict[str, Any]:
        return self._ext.stats(self.capsule)

    def drain(self, wait_s: float) -> int:
        return self._ext.drain(self.capsule, wait_s)

    def take_all(self) -> list[tuple[int, int, Any]]:
        return self._ext.take_all(self.capsule)


class PyCore:
    """Pure-Python core with the same semantics as the C one."""

    def __init__(self, base: int, total: int, granularity: int,
                 map_cb: MapCallback, unmap_cb: UnmapCallback) -> None:
        if granularity <= 0 or total <= 0 or total % granularity or base % granularity:
            raise ConfigError(f"bad arena geometry: base={base} total={total} "
                              f"granularity={granularity}")
        self._base, self._total, self._gran = base, total, granularity
        self._map_cb, self._unmap_cb = map_cb, unmap_cb
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._bump = 0
        self._live: dict[int, tuple[int, Any]] = {}
        self._mapped = 0
        self._closed = False
        self._in_flight = 0
        self._counters = dict.fromkeys(
            ("mallocs", "frees", "malloc_failures", "free_failures", "late_frees"), 0)

    def _enter(self, what: str) -> None:
        with self._lock:
            self._in_flight += 1
            if self._closed:
                self._leave_locked()
                raise ArenaClosedError(f"{what} on a closed VmmArena")

    def _leave_locked(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._drained.notify_all()

    def _leave(self) -> None:
        with self._lock:
            self._leave_locked()

    def malloc(self, size: int) -> int:
        self._enter("malloc")
        try:
            if size <= 0:
                raise ValueError(f"allocation size must be > 0, got {size}")
            aligned = -(-size // self._gran) * self._gran
            with self._lock:
                if aligned > self._total - self._bump:
                    self._counters["malloc_failures"] += 1
                    raise ArenaExhaustedError(
                        f"VmmArena exhausted: {size} bytes requested ({aligned} aligned), "
                        f"{self._bump} of {self._total} bytes of the reserved range used; "
                        "reserve a larger range")
                va = self._base + self._bump
                self._bump += aligned
            try:
                handle = self._map_cb(va, aligned)
            except BaseException:
                with self._lock:
                    if self._bump == va - self._base + aligned:  # still the top
                        self._bump = va - self._base
                    self._counters["malloc_failures"] += 1
                raise
            with self._lock:
                self._live[va] = (aligned, handle)
                self._mapped += aligned
                self._counters["mallocs"] += 1
            return va
        finally:
            self._leave()

    def free(self, va: int) -> int:
        self._enter("free")
        try:
            with self._lock:
                entry = self._live.pop(va, None)
                if entry is not None:
                    self._mapped -= entry[0]
            if entry is None:
                raise InvalidFreeError(
                    f"free(0x{va:x}): not a live allocation of this arena (never "
                    "allocated, already freed, or not the start of an allocation)")
            size, handle = entry
            try:
                self._unmap_cb(va, size, handle)
            except BaseException:
                with self._lock:
                    self._counters["free_failures"] += 1
                raise
            with self._lock:
                self._counters["frees"] += 1
            return size
        finally:
            self._leave()

    def live(self) -> list[tuple[int, int]]:
        with self._lock:
            return sorted((va, size) for va, (size, _) in self._live.items())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._counters, in_flight=self._in_flight, live=len(self._live),
                        mapped_bytes=self._mapped, used_bytes=self._bump,
                        closed=self._closed, last_error="")

    def drain(self, wait_s: float) -> int:
        with self._lock:
            self._closed = True
            self._drained.wait_for(lambda: self._in_flight == 0, timeout=wait_s)
            return self._in_flight

    def take_all(self) -> list[tuple[int, int, Any]]:
        with self._lock:
            if not self._closed or self._in_flight:
                raise RuntimeError("take_all needs a drained arena (call drain first)")
            taken = sorted((va, size, handle) for va, (size, handle) in self._live.items())
            self._live.clear()
            self._mapped = 0
            return taken
