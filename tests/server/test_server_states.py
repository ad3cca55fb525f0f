"""State machines and the rules of ControlPlane (in process, real SQLite, fake clock)."""

from __future__ import annotations

import pathlib
from typing import Iterator

import pytest

from conftest import make_identity, manifest
from modelexpress.errors import ConflictError, NotFoundError, ValidationError
from modelexpress.server.service import ControlPlane
from modelexpress.server.states import (
    SourceState, TransferState, check_source_move, check_transfer_move,
)
from modelexpress.server.store import open_store

T = TransferState


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock() -> Clock:
    return Clock()


@pytest.fixture()
def cp(tmp_path: pathlib.Path, clock: Clock) -> Iterator[ControlPlane]:
    store = open_store(f"sqlite:///{tmp_path}/mx.db")
    yield ControlPlane(store, stale_after_s=30, gc_after_s=100, max_manifest_bytes=10_000,
                       clock=clock)
    store.close()


@pytest.mark.parametrize("old,new,ok", [
    (T.PENDING, T.RUNNING, True), (T.RUNNING, T.STOPPING, True),
    (T.STOPPING, T.STOPPED, True), (T.STOPPED, T.PENDING, True), (T.FAILED, T.PENDING, True),
    (T.STOPPING, T.SUCCEEDED, False), (T.SUCCEEDED, T.PENDING, False),
    (T.RUNNING, T.STOPPED, False), (T.RUNNING, T.PENDING, False), (T.STOPPED, T.RUNNING, False),
])
def test_transfer_moves(old: TransferState, new: TransferState, ok: bool) -> None:
    if ok:
        check_transfer_move("t", old, new)
    else:
        with pytest.raises(ConflictError, match=f"{old.value} -> {new.value}"):
            check_transfer_move("t", old, new)


def test_source_moves() -> None:
    check_source_move("s", SourceState.STALE, SourceState.READY)
    with pytest.raises(ConflictError, match="publish again"):
        check_source_move("s", SourceState.READY, SourceState.INITIALIZING)


def test_stale_then_revive_then_gc(cp: ControlPlane, clock: Clock) -> None:
    src = cp.publish_source(make_identity("m"), "w1", endpoint="", agent_metadata="",
                            manifest=manifest(), state=SourceState.READY)
    clock.now += 31
    # Reads see STALE before the sweep persists it.
    assert cp.get_source(src["id"])["state"] == "STALE"
    assert cp.sweep()["staled"] == 1
    assert cp.store.get("sources", src["id"])["state"] == "STALE"
    assert cp.heartbeat(src["id"], None)["state"] == "READY"
    clock.now += 31
    cp.sweep()
    clock.now += 50
    assert cp.sweep()["sources_deleted"] == 0  # STALE for 50 s < gc_after 100 s
    clock.now += 51
    assert cp.sweep()["sources_deleted"] == 1
    with pytest.raises(NotFoundError):
        cp.get_source(src["id"])
    assert cp.store.get("blobs", src["id"]) is None


def test_gc_of_finished_transfers_and_silent_agents(cp: ControlPlane, clock: Clock) -> None:
    ident = make_identity("m")
    cp.publish_source(ident, "src", endpoint="", agent_metadata="", manifest={},
                      state=SourceState.READY)
    cp.register_agent("agent", "", {})
    done = cp.create_transfer(ident.id, "agent")
    live = cp.create_transfer(ident.id, "agent")
    cp.finish(done["id"], T.SUCCEEDED, None, 10)
    cp.progress(live["id"], 1, 10, 0.0)
    clock.now += 101
    counts = cp.sweep()
    assert counts["transfers_deleted"] == 1 and counts["agents_deleted"] == 1
    assert cp.get_transfer(live["id"])["state"] == "RUNNING"  # live transfers are kept
    with pytest.raises(NotFoundError):
        cp.get_transfer(done["id"])


def test_manifest_limit(cp: ControlPlane) -> None:
    with pytest.raises(ValidationError, match="limit is 10000"):
        cp.publish_source(make_identity("m"), "w", endpoint="", agent_metadata="",
                          manifest={"x": "y" * 10_000}, state=SourceState.READY)
    assert cp.list_sources() == []


def test_republish_keeps_created_at_and_resets_state(cp: ControlPlane, clock: Clock) -> None:
    ident = make_identity("m")
    first = cp.publish_source(ident, "w", endpoint="a", agent_metadata="", manifest={},
                              state=SourceState.READY)
    cp.heartbeat(first["id"], SourceState.STALE)
    clock.now += 5
    second = cp.publish_source(ident, "w", endpoint="b", agent_metadata="", manifest={"v": 2},
                               state=SourceState.INITIALIZING)
    assert second["id"] == first["id"] and second["created_at"] == first["created_at"]
    got = cp.get_source(first["id"], with_blob=True)
    assert (got["state"], got["endpoint"], got["manifest"]) == ("INITIALIZING", "b", {"v": 2})


def test_candidate_records_pass_over_a_source_gone_since_the_ranking(cp: ControlPlane) -> None:
    ids = [cp.publish_source(make_identity("m"), f"w{i}", endpoint="", agent_metadata="",
                             manifest=manifest(), state=SourceState.READY)["id"]
           for i in range(3)]
    cp.delete_source(ids[0])
    records = cp.candidate_records(ids, 2)
    assert [r["id"] for r in records] == ids[1:]
    assert all(r["manifest"] == manifest() for r in records)
    assert cp.candidate_records(ids, 2, other_than=records[0]["identity_id"]) == []  # all its own
