"""Context-manager and finaliser plumbing shared by everything that has ``close()``.

``Closeable``: ``with obj:`` closes it on exit. ``ClosedOnCollect`` also closes it
when it is garbage-collected, and never raises from there (an object whose
``__init__`` failed half-way may not even have the attributes ``close`` reads).
Each class keeps its own idempotent ``close``.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["Closeable", "ClosedOnCollect"]

_C = TypeVar("_C", bound="Closeable")


class Closeable:
    """``with obj: ...`` calls ``obj.close()`` on the way out."""

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ClosedOnCollect(Closeable):
    """A :class:`Closeable` that garbage collection closes too."""

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finaliser must never raise
            pass
