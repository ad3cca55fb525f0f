"""The local transport as a user meets it: chosen per source, with NIXL for the rest.

Real server, real ``modelexpress publish`` processes (they load the checkpoint into
memfd-backed memory and serve it over a Unix socket next to NIXL), real ``modelexpress
pull`` processes and in-process pulls. "Another host" is a puller whose ``MX_NODE_NAME``
differs from the source's host id (the sources use the kernel boot id).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch

from conftest import MODEL, Cluster
from modelexpress._subproc import clean_env
from modelexpress.checkpoint import load_checkpoint, real_model_checkpoint
from modelexpress.identity import ModelIdentity
from modelexpress.local import LocalOptions
from modelexpress.p2p import PullOptions, pull

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

IDENTITY = ModelIdentity(model=MODEL, dtype="float32")


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_checkpoint(real_model_checkpoint())


def _cli_pull(cluster: Cluster, out: pathlib.Path, **env: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "modelexpress", "pull", "--model", MODEL, "--out", str(out),
         "--json", "--server", cluster.server.url],
        capture_output=True, text=True, timeout=240,
        env=clean_env(MX_SERVER_TOKEN=cluster.server.token or "", **env))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_same(reference: dict[str, torch.Tensor], out: pathlib.Path) -> None:
    got = load_checkpoint(out)
    assert sorted(got) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(got[name], tensor), name


def _no_nixl_agent(result: dict[str, Any]) -> bool:
    """The pull created no NIXL agent and registered nothing (``phases``: the agent's
    thread never ran, nothing was waited for, registered or closed)."""
    phases = result["phases"]
    return all(phases[k] == 0.0 for k in ("agent", "agent_wait", "register", "close", "peer"))


def test_publish_then_pull_on_one_host_copies_locally_without_a_nixl_agent(
        cluster: Cluster, reference, tmp_path: pathlib.Path) -> None:
    _, published = cluster.source()
    assert published["local_transport"], published  # the publisher serves it locally
    result = _cli_pull(cluster, tmp_path / "out")
    assert result["transport"] == "local" and result["expected_transport"] == "local"
    assert result["source_ids"] == [published["source_id"]] and result["verified"]
    assert result["bytes"] == published["bytes"] and result["warnings"] == []
    assert _no_nixl_agent(result), result["phases"]
    record = cluster.client.get_transfer(result["transfer_id"])
    assert record.state == "SUCCEEDED" and record.outcome is not None
    assert record.outcome.transport == "local"
    _assert_same(reference, tmp_path / "out")


def test_a_puller_on_another_host_reads_the_same_source_over_nixl(
        cluster: Cluster, reference, tmp_path: pathlib.Path) -> None:
    _, published = cluster.source()
    result = _cli_pull(cluster, tmp_path / "out", MX_NODE_NAME="some-other-node")
    assert result["transport"] not in ("local", "unknown"), result["transport_detail"]
    assert result["source_ids"] == [published["source_id"]] and result["verified"]
    assert result["phases"]["agent"] > 0  # its NIXL agent was created
    record = cluster.client.get_transfer(result["transfer_id"])
    assert record.outcome is not None and record.outcome.transport == result["transport"]
    _assert_same(reference, tmp_path / "out")


def test_local_transport_off_reads_over_nixl(cluster: Cluster, reference,
                                             tmp_path: pathlib.Path) -> None:
    cluster.source()
    result = _cli_pull(cluster, tmp_path / "out", MX_IPC_DIR="off")
    assert result["transport"] not in ("local", "unknown"), result["transport_detail"]
    assert result["phases"]["agent"] > 0
    _assert_same(reference, tmp_path / "out")


def test_a_local_source_killed_mid_copy_gives_way_to_the_next_source(
        cluster: Cluster, reference) -> None:
    first_proc, first = cluster.source("first")
    _, second = cluster.source("second")
    killed: list[int] = []

    def kill_first(done: int, total: int) -> None:
        if done and not killed:
            os.kill(first_proc.proc.pid, signal.SIGKILL)
            killed.append(done)

    dest = {name: torch.empty_like(t) for name, t in reference.items()}
    # ~90 MB at 0.05 GB/s in 4 MiB chunks: the kill lands with most bytes still to copy.
    result = pull(IDENTITY, dest, client=cluster.client, progress=kill_first,
                  options=PullOptions(timeout_s=120, prefer=(first["source_id"],),
                                      max_gbps=0.05, chunk_bytes=4 << 20))
    assert killed and killed[0] < result.bytes
    assert result.source_ids == (second["source_id"],) and result.transport == "local"
    assert [s.source_id for s in result.skipped] == [first["source_id"]]
    assert "PeerError" in result.skipped[0].reason, result.skipped
    assert result.phases["agent"] == 0.0  # the next source was local too: still no NIXL
    for name, tensor in reference.items():
        assert torch.equal(dest[name], tensor), name


def test_a_local_source_that_cannot_be_mapped_here_is_read_over_nixl(
        cluster: Cluster, reference) -> None:
    """A local attempt that fails before copying while the source still listens (here
    a credential that does not match: the source refuses) is retried over NIXL, from
    the same source, with a warning saying so."""
    _, published = cluster.source()
    from modelexpress.local import LocalReader, endpoint_of

    def wrong_token(info, manifest):  # noqa: ANN001,ANN202 - a caller's reader factory
        ep = endpoint_of(manifest)
        assert ep is not None
        return LocalReader(dataclasses.replace(ep, token="0" * 64), manifest, chunk_bytes=1 << 30, verify=True)

    dest = {name: torch.empty_like(t) for name, t in reference.items()}
    result = pull(IDENTITY, dest, client=cluster.client, readers=wrong_token,
                  options=PullOptions(timeout_s=120))
    assert result.source_ids == (published["source_id"],) and result.skipped == ()
    assert result.transport not in ("local", "unknown")
    assert any("reading it over NIXL" in w for w in result.warnings), result.warnings
    for name, tensor in reference.items():
        assert torch.equal(dest[name], tensor), name


def test_a_library_pull_with_local_off_never_uses_the_local_transport(
        cluster: Cluster, reference) -> None:
    cluster.source()
    dest = {name: torch.empty_like(t) for name, t in reference.items()}
    result = pull(IDENTITY, dest, client=cluster.client,
                  options=PullOptions(timeout_s=120, local=LocalOptions(ipc_dir="off")))
    assert result.transport not in ("local", "unknown")


def test_an_agents_fan_out_source_serves_same_host_peers_locally(
        cluster: Cluster, reference) -> None:
    """An agent pulls into memfd memory and serves it onward: its fan-out source
    publishes a local endpoint, and a pull from it copies locally."""
    from modelexpress.p2p.agent import Agent, AgentOptions
    from modelexpress.settings import MxSettings

    cluster.source()
    options = AgentOptions.from_settings(MxSettings(ipc_dir=cluster.ipc_dir),
                                         serve_after_pull=True)
    with Agent(cluster.client, "fan-out-agent", options) as agent:
        agent.register()
        started = cluster.client.start_transfer(IDENTITY, agent.agent_id)
        claimed = cluster.claim(cluster.client, agent.agent_id)
        assert agent.execute(claimed[0]) == "SUCCEEDED"
        assert cluster.client.get_transfer(started.id).outcome.transport == "local"
        (served,) = agent.served
        assert served.local is not None and served.local.path.startswith(cluster.ipc_dir)
        dest = {name: torch.empty_like(t) for name, t in reference.items()}
        result = pull(IDENTITY, dest, client=cluster.client,
                      options=PullOptions(timeout_s=120, prefer=(served.source_id,)))
        assert result.source_ids == (served.source_id,) and result.transport == "local"
        for name, tensor in reference.items():
            assert torch.equal(dest[name], tensor), name
