"""The store interface: JSON documents in named collections, with atomic updates.

The server keeps small collections (``sources``, ``blobs`` for the large
manifest + agent metadata of a source, ``transfers``, ``agents``, ``leases`` for the
origin of a model that no peer holds yet: ``server/origins.py``). Every record is
a JSON object with an ``"id"`` key. State machines live in the app layer; the store
only guarantees that :meth:`Store.update` is atomic: the function sees the current
record and its result is written only if nobody changed the record in between. That
one primitive is what makes "two replicas cannot both move a transfer" true on
Redis (WATCH/MULTI) and on SQLite (``BEGIN IMMEDIATE``).

Why documents and not columns: the records are small, their fields evolve with the
API, and both backends then share one code path for every state machine.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Protocol, runtime_checkable

__all__ = ["Collection", "COLLECTIONS", "Record", "Store"]

Collection = Literal["sources", "blobs", "transfers", "agents", "leases"]
COLLECTIONS: tuple[Collection, ...] = ("sources", "blobs", "transfers", "agents", "leases")
Record = dict[str, Any]


@runtime_checkable
class Store(Protocol):
    """Persistent, shared state of the control plane.

    Implementations are thread-safe (the app calls them from a thread pool) and
    raise :class:`~modelexpress.errors.StoreError` when the backend fails.
    """

    url: str
    """Where the data lives, without credentials (for health and logs)."""

    def get(self, coll: Collection, key: str) -> Record | None:
        """Return the record or None."""

    def list(self, coll: Collection) -> list[Record]:
        """Return every record of a collection (unordered)."""

    def create(self, coll: Collection, record: Record) -> None:
        """Insert a record; :class:`ConflictError` if its id exists."""

    def put(self, coll: Collection, record: Record) -> None:
        """Insert or replace a record."""

    def update(self, coll: Collection, key: str,
               fn: Callable[[Record], Record]) -> Record:
        """Atomically replace a record with ``fn(current)`` and return the new one.

        ``fn`` may raise (e.g. :class:`ConflictError` for an illegal move); then
        nothing is written and the exception propagates. ``fn`` may run more than
        once when a concurrent writer got in between, so it must be pure.

        Raises:
            NotFoundError: no such record.
            ConflictError: the record kept changing under us (retries exhausted).
        """

    def delete(self, coll: Collection, key: str) -> bool:
        """Delete a record; return whether it existed."""

    def ping(self) -> None:
        """Raise :class:`StoreError` when the backend is unusable."""

    def close(self) -> None:
        """Release connections; idempotent."""
