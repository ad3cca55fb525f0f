"""StubVmmBackend: no memory at all, for bump-math tests.

It hands out fake addresses and integer handles and records every call, so tests
can check the arena's call sequencing and rollback; ``fail`` makes a chosen step
raise :class:`BackendError` the way a real driver failure would. Nothing may be
read or written at its addresses.
"""

from __future__ import annotations

import itertools
import threading
from typing import Literal

from modelexpress.errors import BackendError, ConfigError

__all__ = ["StubVmmBackend"]

_STEPS = ("reserve", "create", "map", "set_access", "unmap", "release")
# Fake bases far apart (and far from anything real) so arenas never overlap.
_NEXT_BASE = itertools.count(0x7A00_0000_0000, 1 << 44)


class StubVmmBackend:
    """A backend that only does the bookkeeping.

    Args:
        granularity: slot alignment in bytes (power of two; default 2 MiB like CUDA).
        device: reported device ordinal.
        fail: step name -> the 1-based call number of that step that fails
            (e.g. ``{"map": 3}``); steps: reserve, create, map, set_access, unmap, release.
    """

    kind: Literal["stub"] = "stub"

    def __init__(self, granularity: int = 2 << 20, device: int = 0,
                 fail: dict[str, int] | None = None) -> None:
        if granularity <= 0 or granularity & (granularity - 1):
            raise ConfigError(f"granularity must be a power of two, got {granularity}")
        unknown = set(fail or ()) - set(_STEPS)
        if unknown:
            raise ConfigError(f"unknown fail steps {sorted(unknown)}; allowed: {_STEPS}")
        self.granularity = granularity
        self.device = device
        self.fail = dict(fail or {})
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.counts = dict.fromkeys(_STEPS, 0)
        self.handles: set[int] = set()          # created, not released
        self.mapped: dict[int, int] = {}        # va -> size
        self.accessible: set[int] = set()       # va with access granted
        self.reservations: dict[int, int] = {}  # base -> total
        self.closed = False
        self._next_handle = itertools.count(1)
        self._lock = threading.Lock()

    def _step(self, name: str, *args: int) -> None:
        with self._lock:
            self.counts[name] += 1
            self.calls.append((name, args))
            if self.fail.get(name) == self.counts[name]:
                raise BackendError(f"stub: injected failure of {name} call "
                                   f"#{self.counts[name]} {args}")

    def reserve(self, total: int) -> int:
        self._step("reserve", total)
        base = next(_NEXT_BASE)
        self.reservations[base] = total
        return base

    def release_reservation(self, base: int, total: int) -> None:
        if self.reservations.pop(base, None) != total:
            raise BackendError(f"stub: release of unknown reservation 0x{base:x}+{total}")

    def create(self, size: int) -> int:
        self._step("create", size)
        handle = next(self._next_handle)
        self.handles.add(handle)
        return handle

    def map(self, va: int, size: int, handle: int) -> None:
        self._step("map", va, size, handle)
        if handle not in self.handles or va in self.mapped:
            raise BackendError(f"stub: bad map of handle {handle} at 0x{va:x}")
        self.mapped[va] = size

    def set_access(self, va: int, size: int) -> None:
        self._step("set_access", va, size)
        self.accessible.add(va)

    def unmap(self, va: int, size: int) -> None:
        self._step("unmap", va, size)
        if self.mapped.pop(va, None) != size:
            raise BackendError(f"stub: unmap of unmapped 0x{va:x}+{size}")
        self.accessible.discard(va)

    def release(self, handle: int) -> None:
        self._step("release", handle)
        if handle not in self.handles:
            raise BackendError(f"stub: release of unknown handle {handle}")
        self.handles.discard(handle)

    def close(self) -> None:
        self.closed = True
