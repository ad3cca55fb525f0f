"""Stores of the control plane: the :class:`Store` protocol, SQLite and Redis backends."""

from modelexpress.server.store.base import COLLECTIONS, Collection, Record, Store
from modelexpress.server.store.factory import open_store

__all__ = ["COLLECTIONS", "Collection", "Record", "Store", "open_store",
           "SqliteStore", "RedisStore"]


def __getattr__(name: str):  # backends import their drivers lazily
    if name == "SqliteStore":
        from modelexpress.server.store.sqlite import SqliteStore
        return SqliteStore
    if name == "RedisStore":
        from modelexpress.server.store.redis import RedisStore
        return RedisStore
    raise AttributeError(name)
