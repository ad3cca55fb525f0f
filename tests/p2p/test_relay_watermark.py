"""The watermark word: a relay reader follows its upstream peer to peer, not the server.

A real server and source (``modelexpress publish``); in this process a
:class:`RelayServer` (its own NIXL agent) stands for an upstream target that is
receiving: the test fills its destination piece by piece and advances its watermark
word, while its transfer record on the server never moves (``bytes_done`` stays 0).
A :class:`RelayReader` with its own NIXL agent reads through it. Everything real:
NIXL between the two agents, uvicorn, SQLite.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from conftest import MODEL, Cluster
from modelexpress.checkpoint import load_checkpoint, real_model_checkpoint
from modelexpress.identity import ModelIdentity
from modelexpress.p2p.relay import RelayReader, RelayServer, relay_worker_id
from modelexpress.p2p.manifests import allocate_like, manifest_of
from modelexpress.transfer import NixlTransferManager

pytestmark = [pytest.mark.nixl]

_CHUNK = 2 << 20
_UPSTREAM = "upstream-agent"


def _setup(cluster: Cluster) -> tuple[Any, ...]:
    _, published = cluster.source()
    origin_info = cluster.client.get_source(published["source_id"])
    origin = manifest_of(origin_info)
    ident = ModelIdentity(model=MODEL, dtype="float32")
    # The upstream's transfer: run by "its target" (no agent claims it); nobody reports
    # progress on it, so its record says 0 bytes done throughout.
    up = cluster.client.start_transfer(ident, _UPSTREAM, run_by_target=True)
    relay = RelayServer(cluster.client, ModelIdentity.from_dict(origin_info.identity),
                        allocate_like(origin), origin,
                        worker_id=relay_worker_id(_UPSTREAM, up.id),
                        heartbeat_interval_s=0.5, backend="UCX")
    return origin_info, origin, up, relay


def _fill(relay: RelayServer, src: dict[str, torch.Tensor], origin: Any, upto: float) -> int:
    """Copy the first ``upto`` of the model into the relay, tensor by tensor, advancing
    its word after each; returns the watermark reached."""
    mark = 0
    for e in origin.tensors:
        if mark + e.nbytes > upto * relay.total:
            break
        relay.dest[e.name].view(torch.uint8).copy_(src[e.name].view(torch.uint8))
        mark += e.nbytes
        relay.advance(mark)
    return mark


def _read(cluster: Cluster, origin_info: Any, origin: Any, up: Any, out: dict[str, Any]
          ) -> tuple[RelayReader, threading.Thread, NixlTransferManager]:
    mgr = NixlTransferManager()
    dest = allocate_like(origin)
    reader = RelayReader(cluster.client, mgr, origin_info, origin,
                         (f"t:{up.id}", f"s:{origin_info.id}"), identity_id=up.identity_id,
                         chunk_bytes=_CHUNK, stall_s=30.0, verify=True)

    def run() -> None:
        try:
            out["result"] = reader.read_into(dest, allow_partial=False,
                                             progress=lambda d, t: None, stop=None,
                                             deadline_s=120.0)
            out["dest"] = dest
        except BaseException as exc:  # reported by the test thread
            out["error"] = exc

    th = threading.Thread(target=run)
    th.start()
    return reader, th, mgr


def _same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


def test_a_reader_follows_its_upstreams_word_while_the_server_record_says_nothing(
        patient_cluster: Cluster) -> None:
    origin_info, origin, up, relay = _setup(patient_cluster)
    ref = load_checkpoint(real_model_checkpoint())
    out: dict[str, Any] = {}
    try:
        reader, th, mgr = _read(patient_cluster, origin_info, origin, up, out)
        try:
            _fill(relay, ref, origin, 1.0)
            th.join(150)
            assert not th.is_alive()
        finally:
            mgr.close()
        assert "error" not in out, out.get("error")
        _same(out["dest"], ref)
        assert reader.read_from == [f"t:{up.id}"]  # every byte from the peer, none from the origin
        assert reader.gave_up == []
        assert patient_cluster.client.get_transfer(up.id).bytes_done == 0
    finally:
        relay.close()


def test_a_relay_that_withdraws_midway_is_left_for_the_origin(
        patient_cluster: Cluster) -> None:
    origin_info, origin, up, relay = _setup(patient_cluster)
    ref = load_checkpoint(real_model_checkpoint())
    out: dict[str, Any] = {}
    try:
        reader, th, mgr = _read(patient_cluster, origin_info, origin, up, out)
        try:
            mark = _fill(relay, ref, origin, 0.5)
            assert 0 < mark < relay.total
            patient_cluster.wait_for(lambda: reader.read_from, "the first read from the relay")
            # The word alone says so (close() would also mark the source STALE and
            # drop the memory, either of which makes a reader leave too).
            relay._withdraw_word()
            th.join(150)
            assert not th.is_alive()
        finally:
            mgr.close()
        assert "error" not in out, out.get("error")
        _same(out["dest"], ref)
        assert reader.read_from == [f"t:{up.id}", f"s:{origin_info.id}"]
        assert len(reader.gave_up) == 1 and reader.gave_up[0].startswith(f"t:{up.id}")
        assert "watermark word says so" in reader.gave_up[0], reader.gave_up
    finally:
        relay.close()
