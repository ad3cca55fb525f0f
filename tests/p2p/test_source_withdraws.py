"""A source whose data plane dies withdraws itself (STALE) instead of serving nothing."""

from __future__ import annotations

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
