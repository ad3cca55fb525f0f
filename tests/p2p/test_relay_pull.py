"""Pulls that relay (``relay_serve``: what the vLLM loader does): engines started together.

A real server and source (``modelexpress publish``) and two library pulls in this
process over NIXL (the local transport off). The first is rate-capped so that it is
still receiving when the second starts, the second more so, so that it is still
reading when the first has everything; the server plans the second behind it, the
second reads each piece as the first verifies it, and the first keeps serving until
the second is done, then withdraws before its ``pull()`` returns (the caller, an
engine, post-processes the memory after that).
"""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from typing import Any

import pytest
import torch

from conftest import MODEL, Cluster
from modelexpress.checkpoint import (LlamaShape, generate_llama_checkpoint, load_checkpoint,
                                     real_model_checkpoint)
from modelexpress.errors import NotFoundError
from modelexpress.identity import ModelIdentity
from modelexpress.p2p.options import PullOptions
from modelexpress.p2p.relay import relay_source_id, relay_worker_id
from modelexpress.p2p.target import pull
from modelexpress.settings import MxSettings

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

_SHAPE = LlamaShape(hidden=1024, intermediate=2048, heads=8, kv_heads=4, vocab=8000, layers=2)


def _options(**changes: Any) -> PullOptions:
    return PullOptions.from_settings(MxSettings(ipc_dir="off"), relay_read=True,
                                     relay_serve=True, relay_chunk_bytes=2 << 20,
                                     heartbeat_interval_s=1.0, **changes)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_relaying_pull_serves_the_pull_behind_it_until_it_is_done_then_withdraws(
        patient_cluster: Cluster, caplog: pytest.LogCaptureFixture, device: str,
        tmp_path: pathlib.Path) -> None:
    """Host destinations, and GPU ones (the relay serves the first pull's GPU memory;
    on one GPU both pulls are on it, which UCX reads over TCP: a correctness run). A
    generated 71 MB checkpoint (the H200 host has no real-model package)."""
    caplog.set_level(logging.INFO, logger="modelexpress.p2p.relay_pull")
    cluster = patient_cluster
    ckpt = tmp_path / "ckpt"
    generate_llama_checkpoint(ckpt, _SHAPE, seed=3)
    # A GPU origin for GPU destinations: its digests (wsum-i32-v1) are computed where
    # the bytes land; a host origin's xxh3 is CPU-only.
    published = cluster.start(["publish", str(ckpt), "--model", "relay-pull", "--json",
                               "--worker-id", "origin-1", "--device", device],
                              "origin").json_line()
    ident = ModelIdentity.from_dict(published["identity"])
    first: dict[str, Any] = {"dest": {}}

    def run_first() -> None:
        try:
            first["result"] = pull(ident, client=cluster.client, stop=stop_first,
                                   on_destination=first["dest"].update,
                                   options=_options(max_gbps=0.03, worker_id="engine-a",
                                                    relay_linger_s=60.0, device=device))
            # what the second pull's record says the moment the first returned
            first["second_then"] = (cluster.client.get_transfer(second["id"]).state
                                    if "id" in second else None)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            first["error"] = exc

    second: dict[str, Any] = {}
    stop_first = threading.Event()  # set only if the test fails first: no pull outlives it
    th = threading.Thread(target=run_first, name="first-pull")
    th.start()
    try:
        # the first pull's record, once it has verified its first piece
        rec1 = cluster.wait_for(
            lambda: next((t for t in cluster.client.list_transfers(identity=ident.id)
                          if t.target_worker == "engine-a" and t.bytes_done > 0), None),
            "the first pull's first verified piece")
        got: dict[str, torch.Tensor] = {}
        result = pull(ident, client=cluster.client, on_destination=got.update,
                      # slower than the first: still reading from it when it is done
                      options=_options(max_gbps=0.02, worker_id="engine-b", device=device))
        second["id"] = result.transfer_id
    except BaseException:
        stop_first.set()
        raise
    finally:
        th.join(240)
    assert not th.is_alive() and "error" not in first, first.get("error")
    rec1 = cluster.client.get_transfer(rec1.id)
    rec2 = cluster.client.get_transfer(second["id"])
    origin = f"s:{published['source_id']}"
    assert rec1.relay_path == (origin,), rec1.relay_path  # a holder, reading the origin
    assert rec2.relay_path == (f"t:{rec1.id}", origin), rec2.relay_path
    assert rec1.state == rec2.state == "SUCCEEDED"
    assert result.verified
    read_through = [r.getMessage() for r in caplog.records
                    if r.name == "modelexpress.p2p.relay_pull" and "read through" in r.getMessage()]
    assert any(f"t:{rec1.id}" in m for m in read_through), read_through  # bytes came from it
    # the first served the second to its end: its pull returned after the second's did
    assert first["second_then"] == "SUCCEEDED", first
    # ...and withdrew before returning: its relay source is gone, and so is the second's
    deadline = time.monotonic() + 10
    for rec in (rec1, rec2):
        sid = relay_source_id(ident.id, relay_worker_id(rec.target_worker, rec.id))
        while True:
            try:
                cluster.client.get_source(sid)
            except NotFoundError:
                break
            assert time.monotonic() < deadline, f"relay source {sid} still published"
            time.sleep(0.1)
    ref = load_checkpoint(ckpt)
    for dest in (first["dest"], got):
        assert dest.keys() == ref.keys()
        for name, t in ref.items():
            assert str(dest[name].device) == device, (name, dest[name].device)
            assert torch.equal(dest[name].cpu().view(torch.uint8), t.view(torch.uint8)), name


def test_a_relaying_pull_with_nobody_behind_it_returns_without_lingering(
        patient_cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """Alone, a holder pull reads the origin through its relay reader and withdraws at
    once (no reader to wait for): every byte right, no relay source left."""
    caplog.set_level(logging.INFO, logger="modelexpress.p2p.relay_pull")
    cluster = patient_cluster
    _, published = cluster.source()
    ident = ModelIdentity(model=MODEL, dtype="float32")
    got: dict[str, torch.Tensor] = {}
    result = pull(ident, client=cluster.client, on_destination=got.update,
                  options=_options(worker_id="engine-alone", relay_linger_s=120.0))
    rec = cluster.client.get_transfer(result.transfer_id)
    assert rec.relay_path == (f"s:{published['source_id']}",) and rec.state == "SUCCEEDED"
    # no linger: it found no reader (wait_unread says so only when the linger ran out)
    said = [r.getMessage() for r in caplog.records if r.name == "modelexpress.p2p.relay_pull"]
    assert any(f"relay of transfer {rec.id} withdrawn" in m for m in said), said
    assert not any("still read from it" in m for m in said), said
    sid = relay_source_id(ident.id, relay_worker_id(rec.target_worker, rec.id))
    with pytest.raises(NotFoundError):
        cluster.client.get_source(sid)
    ref = load_checkpoint(real_model_checkpoint())
    assert all(torch.equal(got[n].view(torch.uint8), t.view(torch.uint8))
               for n, t in ref.items())


def test_a_holder_that_publishes_no_relay_source_is_left_at_once(
        patient_cluster: Cluster, caplog: pytest.LogCaptureFixture, tmp_path: pathlib.Path
        ) -> None:
    """A holder pull whose relay source could not start (it reads only, but the server
    planned it as a holder) is receiving without a relay source: a pull planned behind
    it leaves it as soon as it sees that, not after twice the stall time, and reads the
    origin. The holder here is a bare record: created as a relaying pull, reporting
    progress, never publishing."""
    caplog.set_level(logging.WARNING, logger="modelexpress.p2p.relay")
    cluster = patient_cluster
    ckpt = tmp_path / "ckpt"
    generate_llama_checkpoint(ckpt, _SHAPE, seed=4)
    published = cluster.start(["publish", str(ckpt), "--model", "relay-ghost", "--json",
                               "--worker-id", "origin-1"], "origin").json_line()
    ident = ModelIdentity.from_dict(published["identity"])
    ghost = cluster.client.start_transfer(ident, "ghost", run_by_target=True,
                                          relay_read=True, relay_serve=True)
    total = sum(int(t.nbytes) for t in load_checkpoint(ckpt).values())
    cluster.client.report_progress(ghost.id, 1 << 20, total)
    got: dict[str, torch.Tensor] = {}
    # stall 600 s, deadline 60 s: waiting for the ghost's stall would time the pull out
    result = pull(ident, client=cluster.client, on_destination=got.update,
                  options=PullOptions.from_settings(MxSettings(ipc_dir="off"), relay_read=True,
                                                    stall_s=600.0, timeout_s=60.0))
    rec = cluster.client.get_transfer(result.transfer_id)
    assert rec.relay_path == (f"t:{ghost.id}", f"s:{published['source_id']}"), rec.relay_path
    assert rec.state == "SUCCEEDED" and result.verified
    assert any("published no relay source" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records]
    ref = load_checkpoint(ckpt)
    assert all(torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)) for n, t in ref.items())
    cluster.client.finish_transfer(ghost.id, "FAILED", bytes_done=1 << 20, error="test ghost")


def test_a_relaying_pull_of_an_origin_on_its_own_host_copies_it_and_serves_nobody(
        patient_cluster: Cluster) -> None:
    """The origin publishes a local endpoint on this host: a holder pull (an engine's)
    copies it through the local transport and publishes no relay source (a same-host
    copy uses no uplink a relay could spare, and the relay source would cost the engine
    its load time)."""
    cluster = patient_cluster
    _, published = cluster.source()
    ident = ModelIdentity(model=MODEL, dtype="float32")
    got: dict[str, torch.Tensor] = {}
    result = pull(ident, client=cluster.client, on_destination=got.update,
                  options=PullOptions.from_settings(MxSettings(ipc_dir=cluster.ipc_dir),
                                                    relay_read=True, relay_serve=True))
    rec = cluster.client.get_transfer(result.transfer_id)
    assert rec.relay_path == (f"s:{published['source_id']}",)  # planned as a holder...
    assert result.transport == "local", result.transport  # ...read as a same-host source
    sid = relay_source_id(ident.id, relay_worker_id(rec.target_worker, rec.id))
    with pytest.raises(NotFoundError):
        cluster.client.get_source(sid)  # ...and never published as a relay
    ref = load_checkpoint(real_model_checkpoint())
    assert all(torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)) for n, t in ref.items())
