"""The origin lease: exactly one target of a model no peer holds reads it from storage.

Real servers (uvicorn on 127.0.0.1) on SQLite and on a real Redis (two replicas); the
rules' edge cases (lapse, a replaced holder, the planner's root) in process on SQLite
with a clock the test moves.
"""

from __future__ import annotations

import pathlib
import threading
from typing import Callable, Iterator

import pytest

from conftest import make_identity, manifest
from modelexpress.client import MxClient, OriginLease
from modelexpress.errors import ConflictError, NotFoundError, ValidationError
from modelexpress.server.service import ControlPlane
from modelexpress.server.states import SourceState
from modelexpress.server.store import open_store
from mx_server_procs import TOKEN, RedisProc, ServerProc

_RACERS = 12


def _race(calls: list[Callable[[], object]]) -> list[object]:
    """Run the calls at the same moment; each result, or the exception it raised."""
    barrier = threading.Barrier(len(calls))
    results: list[object] = [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait(timeout=60)
        try:
            results[i] = calls[i]()
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return results


def _one_winner(results: list[object]) -> OriginLease:
    won = [r for r in results if isinstance(r, OriginLease)]
    lost = [r for r in results if isinstance(r, ConflictError)]
    assert len(won) == 1 and len(lost) == len(results) - 1, results
    assert all(won[0].holder in str(e) for e in lost)  # the refusal names the holder
    return won[0]


def test_targets_racing_for_the_origin_lease_on_sqlite_get_exactly_one_origin(
        client: MxClient) -> None:
    ident = make_identity("origins/sqlite-race")
    won = _one_winner(_race([lambda i=i: client.acquire_origin(ident, f"t{i}", 30.0)
                             for i in range(_RACERS)]))
    assert won.generation == 1 and won.held
    # the holder taking it again renews it; nobody else gets it
    again = client.acquire_origin(ident, won.holder, 30.0)
    assert again.generation == 1 and again.expires_at >= won.expires_at
    other = "t0" if won.holder != "t0" else "t1"
    with pytest.raises(ConflictError, match=won.holder):
        client.acquire_origin(ident, other, 30.0)


def test_renewals_merge_the_digests_and_a_release_keeps_them_for_the_next_origin(
        client: MxClient) -> None:
    ident = make_identity("origins/digests")
    lease = client.acquire_origin(ident, "o1", 30.0)
    client.renew_origin(ident, "o1", lease.generation, 30.0, source_id=f"{ident.id}:o1-origin",
                        digest_algorithm="xxh3-128", digests={"a": "1", "b": "2"},
                        bytes_done=10, bytes_total=30, storage="s3://bucket/m")
    client.renew_origin(ident, "o1", lease.generation, 30.0, digests={"c": "3"}, bytes_done=20)
    got = client.get_origin(ident)
    assert got.digests == {"a": "1", "b": "2", "c": "3"} and got.digest_count == 3
    assert (got.source_id, got.bytes_done, got.bytes_total, got.storage) == (
        f"{ident.id}:o1-origin", 20, 30, "s3://bucket/m")
    done = client.renew_origin(ident, "o1", lease.generation, 30.0, release=True)
    assert not done.held and done.holder == "" and done.digests == {}  # replies leave them out
    nxt = client.acquire_origin(ident, "o2", 30.0)
    assert nxt.generation == 2 and nxt.source_id is None and nxt.digest_count == 3
    with pytest.raises(ConflictError, match="no longer held by o1"):
        client.renew_origin(ident, "o1", lease.generation, 30.0)


def test_origin_lease_requests_out_of_range_are_refused_with_the_reason(
        client: MxClient) -> None:
    ident = make_identity("origins/bad")
    with pytest.raises(NotFoundError, match="no origin lease"):
        client.get_origin(ident)
    with pytest.raises(ValidationError, match="ttl_s"):
        client.acquire_origin(ident, "o1", 0.0)
    with pytest.raises(ValidationError, match="holder"):
        client.acquire_origin(ident, "bad holder!", 5.0)
    lease = client.acquire_origin(ident, "o1", 5.0)
    client.renew_origin(ident, "o1", lease.generation, 5.0, digest_algorithm="xxh3-128",
                        digests={"a": "1"})
    with pytest.raises(ConflictError, match="xxh3"):
        client.renew_origin(ident, "o1", lease.generation, 5.0, digest_algorithm="wsum-i32-v1",
                            digests={"b": "2"})


# --- two replicas on one Redis ----------------------------------------------------------
@pytest.fixture()
def replicas(redis_proc: RedisProc, tmp_path: pathlib.Path) -> Iterator[tuple[str, str]]:
    a = ServerProc(redis_proc.url, tmp_path).start()
    try:
        b = ServerProc(redis_proc.url, tmp_path).start()
    except BaseException:
        a.stop()
        raise
    yield a.url, b.url
    a.stop()
    b.stop()


@pytest.mark.redis
def test_targets_racing_through_two_replicas_on_redis_get_exactly_one_origin_each_round(
        replicas: tuple[str, str]) -> None:
    url_a, url_b = replicas
    with MxClient(url_a, token=TOKEN, timeout_s=30.0) as a, \
            MxClient(url_b, token=TOKEN, timeout_s=30.0) as b:
        ident = make_identity("origins/redis-race")
        prev = 0
        for round_ in range(4):  # the first creates the record, the others take it over
            won = _one_winner(_race([
                (lambda i=i: (a if i % 2 else b).acquire_origin(ident, f"r{round_}t{i}", 30.0))
                for i in range(_RACERS)]))
            assert won.generation == prev + 1
            prev = won.generation
            assert b.get_origin(ident).holder == a.get_origin(ident).holder == won.holder
            (a if round_ % 2 else b).renew_origin(ident, won.holder, won.generation, 30.0,
                                                  release=True)


# --- rules in process, on a clock the test moves ------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def cp_clock(tmp_path: pathlib.Path) -> Iterator[tuple[ControlPlane, _Clock]]:
    clock = _Clock()
    store = open_store(f"sqlite:///{tmp_path}/mx.db")
    yield ControlPlane(store, stale_after_s=1e6, gc_after_s=100.0, max_manifest_bytes=100_000,
                       clock=clock, readers_per_source=1), clock
    store.close()


def test_a_lapsed_lease_goes_to_the_next_caller_and_its_old_holder_is_refused(
        cp_clock: tuple[ControlPlane, _Clock]) -> None:
    cp, clock = cp_clock
    iid = make_identity("origins/lapse").id
    first = cp.origins.acquire(iid, "o1", 10.0)
    clock.now += 9.0
    with pytest.raises(ConflictError):
        cp.origins.acquire(iid, "o2", 10.0)
    clock.now += 2.0  # lapsed, not yet taken: its holder may still renew
    assert cp.origins.renew(iid, "o1", first["generation"], 10.0)["held"]
    clock.now += 11.0
    second = cp.origins.acquire(iid, "o2", 10.0)
    assert second["generation"] == 2 and second["holder"] == "o2"
    with pytest.raises(ConflictError, match="held by o2"):
        cp.origins.renew(iid, "o1", first["generation"], 10.0)
    # swept once nobody held it for gc_after_s
    cp.origins.renew(iid, "o2", 2, 10.0, release=True)
    clock.now += 50.0
    assert cp.sweep()["leases_deleted"] == 0
    clock.now += 60.0
    assert cp.sweep()["leases_deleted"] == 1
    with pytest.raises(NotFoundError):
        cp.origins.get(iid)


def test_a_relay_reader_with_no_ready_source_is_planned_behind_the_loading_origin(
        cp_clock: tuple[ControlPlane, _Clock]) -> None:
    cp, clock = cp_clock
    ident = make_identity("origins/plan")
    origin = cp.publish_source(ident, "t0-origin", endpoint="", agent_metadata="",
                               manifest=manifest(), state=SourceState.INITIALIZING)
    # no lease yet: an INITIALIZING source is no holder
    with pytest.raises(ConflictError, match="no READY source"):
        cp.create_transfer(ident.id, "t1", run_by_target=True, relay_read=True,
                           relay_serve=True)
    lease = cp.origins.acquire(ident.id, "t0", 10.0)
    cp.origins.renew(ident.id, "t0", lease["generation"], 10.0, source_id=origin["id"])
    first = cp.create_transfer(ident.id, "t1", run_by_target=True, relay_read=True,
                               relay_serve=True)
    second = cp.create_transfer(ident.id, "t2", run_by_target=True, relay_read=True,
                                relay_serve=True)
    assert first["source_id"] == second["source_id"] == origin["id"]
    assert first["relay_path"] == [f"s:{origin['id']}"]
    assert second["relay_path"] == [f"t:{first['id']}", f"s:{origin['id']}"]  # a chain
    # the origin's own worker is not planned behind itself; nor is anyone once it lapsed
    with pytest.raises(ConflictError):
        cp.create_transfer(ident.id, "t0", run_by_target=True, relay_read=True)
    clock.now += 11.0
    with pytest.raises(ConflictError):
        cp.create_transfer(ident.id, "t3", run_by_target=True, relay_read=True)
    # a plain pull (no relay_read) never follows a loading origin
    clock.now -= 11.0
    with pytest.raises(ConflictError):
        cp.create_transfer(ident.id, "t4", run_by_target=True)
