"""Both stores, for real: SQLite on a file, Redis from Debian's redis-server."""

from __future__ import annotations

import pathlib
import threading
from typing import Iterator

import pytest

from modelexpress.errors import ConfigError, ConflictError, NotFoundError, StoreError
from modelexpress.server.store import Store, open_store
from mx_server_procs import RedisProc, free_port


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def store(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[Store]:
    if request.param == "sqlite":
        s = open_store(f"sqlite:///{tmp_path}/db/mx.db")
        yield s
        s.close()
    else:
        proc = RedisProc(tmp_path)
        s = open_store(proc.url)
        yield s
        s.close()
        proc.stop()


def test_crud(store: Store) -> None:
    store.create("transfers", {"id": "t1", "n": 0})
    with pytest.raises(ConflictError, match="exists"):
        store.create("transfers", {"id": "t1", "n": 5})
    assert store.get("transfers", "t1") == {"id": "t1", "n": 0}
    store.put("transfers", {"id": "t2", "n": 2})
    store.put("sources", {"id": "t2", "other": True})  # collections are separate
    assert sorted(r["id"] for r in store.list("transfers")) == ["t1", "t2"]
    assert store.update("transfers", "t2", lambda r: {**r, "n": 3}) == {"id": "t2", "n": 3}
    with pytest.raises(NotFoundError):
        store.update("transfers", "nope", lambda r: r)
    assert store.delete("transfers", "t1") and not store.delete("transfers", "t1")
    assert store.get("transfers", "t1") is None
    assert store.get("sources", "t2") == {"id": "t2", "other": True}
    store.ping()


def test_failed_update_writes_nothing(store: Store) -> None:
    store.put("transfers", {"id": "t", "state": "SUCCEEDED"})

    def illegal(_: dict) -> dict:
        raise ConflictError("terminal")
    with pytest.raises(ConflictError):
        store.update("transfers", "t", illegal)
    assert store.get("transfers", "t") == {"id": "t", "state": "SUCCEEDED"}


def test_concurrent_updates_lose_nothing(store: Store) -> None:
    store.put("transfers", {"id": "ctr", "n": 0})
    threads, per_thread = 8, 40
    errors: list[BaseException] = []

    def bump() -> None:
        try:
            for _ in range(per_thread):
                store.update("transfers", "ctr", lambda r: {**r, "n": r["n"] + 1})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=bump) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not errors and not any(w.is_alive() for w in workers)
    assert store.get("transfers", "ctr")["n"] == threads * per_thread


def test_sqlite_survives_reopen(tmp_path: pathlib.Path) -> None:
    url = f"sqlite:///{tmp_path}/mx.db"
    with open_store(url) as s:  # type: ignore[attr-defined]
        s.put("agents", {"id": "a", "labels": {"k": "v"}})
    s2 = open_store(url)
    assert s2.get("agents", "a") == {"id": "a", "labels": {"k": "v"}}
    s2.close()
    s2.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        s2.get("agents", "a")


def test_bad_urls() -> None:
    with pytest.raises(ConfigError, match="sqlite:///"):
        open_store("postgres://x")


@pytest.mark.redis
def test_unreachable_redis_is_a_store_error() -> None:
    with pytest.raises(StoreError, match="ping"):
        open_store(f"redis://127.0.0.1:{free_port()}/0")
