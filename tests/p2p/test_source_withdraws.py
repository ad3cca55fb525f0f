"""A source whose data plane dies withdraws itself (STALE) instead of serving nothing."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from conftest import Cluster
from modelexpress.identity import ModelIdentity
from modelexpress.p2p import serve_source

pytestmark = pytest.mark.nixl


def test_dead_progress_thread_marks_the_source_stale(cluster: Cluster) -> None:
    tensors = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    handle = serve_source(ModelIdentity(model="withdraw-test", dtype="float32"), tensors,
                          client=cluster.client, heartbeat_interval_s=0.2)
    try:
        assert cluster.client.get_source(handle.source_id).state == "READY"
        handle.manager.stop_progress_thread()  # what an error in the data plane leads to
        deadline = time.monotonic() + 20
        while cluster.client.get_source(handle.source_id).state != "STALE":
            assert time.monotonic() < deadline, "the source never withdrew"
            time.sleep(0.1)
        assert handle.failure is not None and "progress thread" in handle.failure
    finally:
        handle.close()


def test_sigterm_withdraws_a_published_checkpoint(cluster: Cluster) -> None:
    proc, published = cluster.source("sigterm")
    assert cluster.client.get_source(published["source_id"]).state == "READY"
    assert proc.stop() == 0  # SIGTERM: clean exit
    assert cluster.client.get_source(published["source_id"]).state == "STALE"


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_sources_sharing_one_agent_withdraw_one_at_a_time_without_an_error(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """The vLLM loader serves its weights and its compiled artifacts through one NIXL
    agent: at a clean exit the first to withdraw must not stop the other's progress
    (which then read as a data-plane failure: an ERROR line and a STALE source)."""
    from modelexpress.transfer import NixlTransferManager

    caplog.set_level(logging.INFO, logger="modelexpress")
    mgr = NixlTransferManager()
    first = second = None
    try:
        first = serve_source(ModelIdentity(model="shared-agent-a", dtype="float32"),
                             {"w": torch.ones(1 << 12)}, client=cluster.client,
                             manager=mgr, heartbeat_interval_s=0.2)
        second = serve_source(ModelIdentity(model="shared-agent-b", dtype="float32"),
                              {"w": torch.zeros(1 << 12)}, client=cluster.client,
                              manager=mgr, heartbeat_interval_s=0.2)
        first.close()
        time.sleep(1.5)  # several of the second's heartbeats
        assert mgr.serving
        assert cluster.client.get_source(second.source_id).state == "READY"
        assert second.failure is None
        second.close()
        assert not mgr.serving  # the last holder let go
        assert cluster.client.get_source(second.source_id).state == "STALE"
    finally:
        for handle in (first, second):
            if handle is not None:
                handle.close()
        mgr.close()
    assert not _errors(caplog), _errors(caplog)


def test_an_agent_closed_by_its_owner_withdraws_its_sources_quietly(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """The owner of a shared agent closed it first (at exit, the order finalizers run
    in): the source withdraws, with an INFO line, not as a data-plane failure."""
    from modelexpress.transfer import NixlTransferManager

    caplog.set_level(logging.INFO, logger="modelexpress")
    mgr = NixlTransferManager()
    handle = serve_source(ModelIdentity(model="closed-agent", dtype="float32"),
                          {"w": torch.ones(1 << 12)}, client=cluster.client, manager=mgr,
                          heartbeat_interval_s=0.2)
    try:
        mgr.close()
        deadline = time.monotonic() + 20
        while cluster.client.get_source(handle.source_id).state != "STALE":
            assert time.monotonic() < deadline, "the source never withdrew"
            time.sleep(0.1)
        assert handle.failure == "its NIXL agent was closed"
    finally:
        handle.close()
    assert not _errors(caplog), _errors(caplog)
