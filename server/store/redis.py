"""Redis store: several server replicas share one Redis.

Layout under a key prefix (default ``mx``): ``{prefix}:{collection}:{id}`` holds
the JSON document and the set ``{prefix}:{collection}:ids`` indexes the ids.

Atomic updates use optimistic locking (WATCH / MULTI / EXEC): the update function
runs on the value read under WATCH, and EXEC fails if any other client wrote the
key meanwhile; then we re-read and re-run the function, which re-checks the state
machine against the new state. Two replicas racing to move one transfer therefore
serialise: the loser re-reads, finds the winner's state, and gets a 409. A Lua
script would also be atomic but would duplicate the state machine in Lua.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Callable

from modelexpress._closing import ClosedOnCollect
from modelexpress._optional import require
from modelexpress.errors import ConflictError, NotFoundError, StoreError
from modelexpress.server.store.base import Collection, Record

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)

_MAX_UPDATE_ATTEMPTS = 64
_MGET_BATCH = 500


def _dump(record: Record) -> str:
    return json.dumps(record, separators=(",", ":"), allow_nan=False)


class RedisStore(ClosedOnCollect):
    """A :class:`~modelexpress.server.store.Store` on Redis.

    Args:
        url: ``redis://[:password@]HOST:PORT/DB`` (or ``rediss://``, ``unix://``).
        prefix: key prefix, so several deployments (or tests) can share one Redis.
        socket_timeout_s: timeout of one Redis command.

    Raises:
        DependencyError: the ``redis`` client package is missing.
        StoreError: Redis cannot be reached.
    """

    def __init__(self, url: str, prefix: str = "mx", socket_timeout_s: float = 5.0) -> None:
        redis = require("redis", "the Redis store")
        self._errors = (redis.RedisError, OSError)
        self._watch_error = redis.WatchError
        # Never log credentials: keep only what follows the '@'.
        self.url = re.sub(r"//[^@/]*@", "//***@", url)
        self._prefix = prefix
        self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                            socket_connect_timeout=socket_timeout_s,
                                            decode_responses=True)
        self._closed = False
        try:
            self.ping()
        except StoreError:
            self.close()
            raise

    def _key(self, coll: Collection, key: str) -> str:
        return f"{self._prefix}:{coll}:{key}"

    def _ids(self, coll: Collection) -> str:
        return f"{self._prefix}:{coll}:ids"

    def _fail(self, what: str, exc: Exception) -> StoreError:
        return StoreError(f"Redis store {self.url}: {what} failed: {exc}")

    def get(self, coll: Collection, key: str) -> Record | None:
        try:
            raw = self._client.get(self._key(coll, key))
        except self._errors as exc:
            raise self._fail("get", exc) from exc
        return None if raw is None else json.loads(raw)

    def list(self, coll: Collection) -> list[Record]:
        try:
            ids = sorted(self._client.smembers(self._ids(coll)))
            out: list[Record] = []
            for start in range(0, len(ids), _MGET_BATCH):
                keys = [self._key(coll, k) for k in ids[start:start + _MGET_BATCH]]
                # A key deleted between SMEMBERS and MGET comes back as None: skip it.
                out.extend(json.loads(raw) for raw in self._client.mget(keys) if raw is not None)
        except self._errors as exc:
            raise self._fail("list", exc) from exc
        return out

    def create(self, coll: Collection, record: Record) -> None:
        key = self._key(coll, record["id"])
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.set(key, _dump(record), nx=True)
                pipe.sadd(self._ids(coll), record["id"])
                created, _ = pipe.execute()
        except self._errors as exc:
            raise self._fail("create", exc) from exc
        if not created:
            raise ConflictError(f"{coll} record {record['id']} already exists")

    def put(self, coll: Collection, record: Record) -> None:
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.set(self._key(coll, record["id"]), _dump(record))
                pipe.sadd(self._ids(coll), record["id"])
                pipe.execute()
        except self._errors as exc:
            raise self._fail("put", exc) from exc

    def update(self, coll: Collection, key: str, fn: Callable[[Record], Record]) -> Record:
        full = self._key(coll, key)
        try:
            with self._client.pipeline(transaction=True) as pipe:
                for _attempt in range(_MAX_UPDATE_ATTEMPTS):
                    try:
                        pipe.watch(full)
                        raw = pipe.get(full)
                        if raw is None:
                            raise NotFoundError(f"{coll} record {key} not found")
                        new = fn(json.loads(raw))
                        pipe.multi()
                        pipe.set(full, _dump(new))
                        pipe.execute()
                        return new
                    except self._watch_error:
                        log.debug("update of %s lost a race; re-reading", full)
                        continue
                    finally:
                        pipe.reset()
        except self._errors as exc:
            raise self._fail("update", exc) from exc
        raise ConflictError(f"{coll} record {key} kept changing; gave up after "
                            f"{_MAX_UPDATE_ATTEMPTS} attempts, try again")

    def delete(self, coll: Collection, key: str) -> bool:
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self._key(coll, key))
                pipe.srem(self._ids(coll), key)
                deleted, _ = pipe.execute()
        except self._errors as exc:
            raise self._fail("delete", exc) from exc
        return bool(deleted)

    def ping(self) -> None:
        try:
            self._client.ping()
        except self._errors as exc:
            raise self._fail("ping", exc) from exc

    def close(self) -> None:
        """Close the connection pool; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._client.close()
