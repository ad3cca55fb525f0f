"""Layouts on the control plane (API version 5): stored beside the manifest, and the one
ranking of candidates of other parallel layouts (``ControlPlane.rank_sources``)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from conftest import make_identity, manifest
from modelexpress.client import MxClient
from modelexpress.errors import ConflictError
from mx_server_procs import TOKEN, ServerProc

LAYOUT = {"format": "modelexpress.layout", "version": 1, "checkpoint": [], "tensors": {},
          "pieces": []}


def _publish(client: MxClient, model: str, tp: int, rank: int, worker: str, *,
             layout: dict | None = LAYOUT, dtype: str = "bfloat16"):  # noqa: ANN202
    ident = make_identity(model, tp_size=tp, rank=rank, dtype=dtype,
                          extra=(("vllm", "0.32.0"),))
    return client.publish_source(ident, worker, manifest=manifest(), layout=layout)


def test_a_layout_is_stored_beside_the_manifest_and_returned_with_it(client) -> None:
    model = f"layouts-{uuid.uuid4().hex[:8]}"
    src = _publish(client, model, 2, 1, "w-stored")
    assert src.layout_bytes > 0
    assert client.get_source(src.id).layout == LAYOUT
    bare = _publish(client, model, 2, 0, "w-bare", layout=None)
    assert bare.layout_bytes == 0 and client.get_source(bare.id).layout is None


def test_candidates_across_layouts_come_a_whole_layout_at_a_time(client) -> None:
    """For a TP=8 rank: this identity's own sources first (none here), then the TP=1 layout
    (whole, one source), the TP=2 layout (both ranks, in rank order), the TP=4 layout
    last (rank 3 missing). Left out: a source without a layout, other weights (another
    dtype), a STALE source, the target's own."""
    model = f"layouts-{uuid.uuid4().hex[:8]}"
    tp1 = _publish(client, model, 1, 0, "w-tp1")
    tp2 = [_publish(client, model, 2, r, f"w-tp2-{r}") for r in (1, 0)]
    tp4 = [_publish(client, model, 4, r, f"w-tp4-{r}") for r in range(3)]
    _publish(client, model, 2, 0, "w-no-layout", layout=None)
    _publish(client, model, 1, 0, "w-fp32", dtype="float32")
    stale = _publish(client, model, 2, 1, "w-stale")
    client.mark_stale(stale.id)
    _publish(client, model, 1, 0, "w-target")  # the target's own source
    target = make_identity(model, tp_size=8, rank=3, dtype="bfloat16",
                           extra=(("vllm", "0.32.0"),))
    record = client.start_transfer(target, "w-target", run_by_target=True, across_layouts=True)
    assert record.layouts == "any"
    assert list(record.candidates) == ([tp1.id] + [tp2[1].id, tp2[0].id]
                                       + [s.id for s in tp4])
    assert record.source_id == tp1.id


def test_the_first_candidates_records_come_with_the_transfer(client) -> None:
    """records=N (API version 6): the whole records (manifest, layout) of the first N
    candidates, in order; across layouts, of other identities than the target's own
    (its own sources come first in the candidates but are for a same-layout pull)."""
    model = f"layouts-{uuid.uuid4().hex[:8]}"
    tp1 = _publish(client, model, 1, 0, "w-r-tp1")
    tp2 = [_publish(client, model, 2, r, f"w-r-tp2-{r}") for r in (0, 1)]
    own = _publish(client, model, 2, 1, "w-r-own")  # an identity like the target's
    target = make_identity(model, tp_size=2, rank=1, dtype="bfloat16",
                           extra=(("vllm", "0.32.0"),))
    record = client.start_transfer(target, "w-r-target", run_by_target=True,
                                   across_layouts=True, records=2)
    assert record.candidates[0] in (own.id, tp2[1].id)  # the identity's own come first
    others = [c for c in record.candidates if c not in (own.id, tp2[1].id)]
    assert [r.id for r in record.records] == others[:2]
    assert record.records[0].id == tp1.id and record.records[0].layout == LAYOUT
    assert record.records[0].manifest == client.get_source(tp1.id).manifest
    # same layout: the first candidates, the target's own identity's
    same = client.start_transfer(target, "w-r-target2", run_by_target=True, records=5)
    assert [r.id for r in same.records] == list(same.candidates)
    assert {r.id for r in same.records} == {own.id, tp2[1].id}
    assert client.start_transfer(target, "w-r-target3", run_by_target=True).records == ()
    # more than the server returns (a pull with MX_MAX_SOURCE_ATTEMPTS=100): at most
    # MAX_RECORDS are asked for
    many = client.start_transfer(target, "w-r-target4", run_by_target=True, records=100)
    assert [r.id for r in many.records] == list(many.candidates)


def test_within_a_layout_one_source_of_every_rank_comes_before_a_second(client) -> None:
    """Three replicas of TP=2 (the third without rank 1): a TP=1 target gets one source
    of each rank, in rank order, then a second of each, then the third rank 0: fetching
    records in this order until it holds a whole layout, it fetches two, not five."""
    model = f"layouts-{uuid.uuid4().hex[:8]}"
    for replica in "abc":
        for r in ((0, 1) if replica != "c" else (0,)):
            _publish(client, model, 2, r, f"w-{replica}-{r}")
    target = make_identity(model, tp_size=1, rank=0, dtype="bfloat16",
                           extra=(("vllm", "0.32.0"),))
    record = client.start_transfer(target, "w-target", run_by_target=True, across_layouts=True)
    ranks = [client.get_source(c).model_identity.rank for c in record.candidates]
    assert ranks == [0, 1, 0, 1, 0], ranks


def test_without_layouts_any_nothing_changes(client) -> None:
    model = f"layouts-{uuid.uuid4().hex[:8]}"
    _publish(client, model, 2, 0, "w-a")
    target = make_identity(model, tp_size=1, rank=0, extra=(("vllm", "0.32.0"),))
    with pytest.raises(ConflictError, match="no READY source"):
        client.start_transfer(target, "w-target", run_by_target=True)
    own = _publish(client, model, 1, 0, "w-own")
    record = client.start_transfer(target, "w-target", run_by_target=True)
    assert record.layouts == "same" and list(record.candidates) == [own.id]


def test_layouts_any_needs_the_matching_identity(server: ServerProc) -> None:
    ident = make_identity(f"layouts-{uuid.uuid4().hex[:8]}")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    base = {"identity_id": ident.id, "target_worker": "w", "run_by_target": True,
            "layouts": "any"}
    missing = httpx.post(f"{server.url}/v1/transfers", json=base, headers=auth)
    assert missing.status_code == 422 and "needs the target's identity" in missing.text
    other = make_identity("someone-else").to_dict()
    wrong = httpx.post(f"{server.url}/v1/transfers", json={**base, "identity": other},
                       headers=auth)
    assert wrong.status_code == 422 and "does not match" in wrong.text
