"""Claim-time source selection: reader limits per holder, relay chains, named sources kept.

In process, real SQLite; the planner is modelexpress.p2p.relay_plan's.
"""

from __future__ import annotations

import pathlib
from typing import Iterator

import pytest

from conftest import make_identity, manifest
from modelexpress.server.service import ControlPlane
from modelexpress.server.states import SourceState
from modelexpress.server.store import open_store


@pytest.fixture()
def cp(tmp_path: pathlib.Path) -> Iterator[ControlPlane]:
    store = open_store(f"sqlite:///{tmp_path}/mx.db")
    yield ControlPlane(store, stale_after_s=1e9, gc_after_s=1e9, max_manifest_bytes=10_000,
                       readers_per_source=1)
    store.close()


def _publish(cp: ControlPlane, model: str, worker: str) -> dict:
    return cp.publish_source(make_identity(model), worker, endpoint=worker, agent_metadata="",
                             manifest=manifest(), state=SourceState.READY)


def _agents(cp: ControlPlane, n: int, relay: bool) -> list[str]:
    ids = [f"a{i}" for i in range(n)]
    for a in ids:
        cp.register_agent(a, "", {"relay": "1"} if relay else {})
    return ids


def test_transfers_created_together_are_spread_over_ready_sources_when_claimed(
        cp: ControlPlane) -> None:
    s1, s2 = _publish(cp, "m1", "w1"), _publish(cp, "m1", "w2")
    agents = _agents(cp, 2, relay=False)
    # created while s1 had room: both name the same source at creation...
    made = [cp.create_transfer(s1["identity_id"], a, policy="random") for a in agents]
    assert len({t["source_id"] for t in made}) >= 1
    # ...the claims see the first reader and send the second elsewhere
    got = [cp.claim_assignments(a)[0] for a in agents]
    assert sorted(t["source_id"] for t in got) == sorted([s1["id"], s2["id"]])
    assert all(t["relay_path"] == [] for t in got)


def test_a_saturated_source_over_subscribes_rather_than_refusing(cp: ControlPlane) -> None:
    s1 = _publish(cp, "m2", "w1")
    agents = _agents(cp, 3, relay=False)
    for a in agents:
        cp.create_transfer(s1["identity_id"], a)
    assert [cp.claim_assignments(a)[0]["source_id"] for a in agents] == [s1["id"]] * 3


def test_relaying_agents_claimed_together_form_a_chain_ending_at_the_source(
        cp: ControlPlane) -> None:
    s1 = _publish(cp, "m3", "w1")
    agents = _agents(cp, 4, relay=True)
    made = [cp.create_transfer(s1["identity_id"], a) for a in agents]
    paths = [cp.claim_assignments(a)[0]["relay_path"] for a in agents]
    assert paths[0] == [f"s:{s1['id']}"]
    for i in range(1, 4):
        assert paths[i] == [f"t:{made[i - 1]['id']}", *paths[i - 1]]
    rec = cp.get_transfer(made[3]["id"])
    assert rec["source_id"] == s1["id"] and rec["relay"] is True


def test_a_source_named_at_creation_is_kept_at_the_claim(cp: ControlPlane) -> None:
    s1, s2 = _publish(cp, "m4", "w1"), _publish(cp, "m4", "w2")
    agents = _agents(cp, 2, relay=True)
    for a in agents:
        cp.create_transfer(s1["identity_id"], a, source_id=s2["id"])
    assert [cp.claim_assignments(a)[0]["source_id"] for a in agents] == [s2["id"]] * 2
