"""An agent told to exit mid-transfer reports it FAILED (restartable), never SUCCEEDED."""

from __future__ import annotations

import pathlib

import pytest

from conftest import MODEL, Cluster
from modelexpress.identity import ModelIdentity

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


def test_sigterm_mid_transfer_fails_it_and_a_restart_completes(cluster: Cluster,
                                                               tmp_path: pathlib.Path) -> None:
    cluster.source()
    c = cluster.client
    args = ["agent", "--id", "agent-t", "--out", str(tmp_path / "out"), "--no-serve",
            "--chunk-bytes", str(2 << 20)]
    agent = cluster.start([*args, "--max-gbps", "0.03"], "agent")
    cluster.wait_for(lambda: any(a.id == "agent-t" for a in c.list_agents()), "agent",
                     deadline_s=120)
    t = c.start_transfer(ModelIdentity(model=MODEL, dtype="float32"), "agent-t")
    cluster.wait_for(lambda: c.get_transfer(t.id).bytes_done > 0, "the transfer to run")
    assert agent.stop() == 1  # SIGTERM; a transfer it ran did not succeed
    failed = c.get_transfer(t.id)
    assert failed.state == "FAILED" and "shut down" in (failed.error or "")
    assert not (tmp_path / "out" / t.id).exists()

    c.restart_transfer(t.id)
    cluster.start(args, "agent-again")
    done = cluster.wait_for(lambda: (x := c.get_transfer(t.id)).state in (
        "SUCCEEDED", "FAILED") and x, "the restarted transfer", deadline_s=120)
    assert done.state == "SUCCEEDED", done.error
    assert (tmp_path / "out" / t.id).is_dir()
