"""The P2P command line against a real server, source and agent: JSON out, exit codes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import MODEL, Cluster
from modelexpress._subproc import clean_env
from modelexpress.checkpoint import load_checkpoint, real_model_checkpoint

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


def _cli(cluster: Cluster, *args: str, timeout: float = 180) -> tuple[int, dict]:
    env = clean_env(MX_SERVER_TOKEN=cluster.server.token or "")
    proc = subprocess.run([sys.executable, "-m", "modelexpress", *args, "--server",
                           cluster.server.url, "--json"], capture_output=True, text=True,
                          env=env, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON from {args}: {proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.returncode, json.loads(lines[-1])


def test_cli_sources_pull_and_rest_transfer(cluster: Cluster, tmp_path: pathlib.Path) -> None:
    _, published = cluster.source()
    code, listed = _cli(cluster, "sources", "list", "--state", "READY")
    assert code == 0 and [s["id"] for s in listed["sources"]] == [published["source_id"]]

    out = tmp_path / "pulled"
    code, result = _cli(cluster, "pull", "--model", MODEL, "--out", str(out))
    assert code == 0 and result["ok"] and result["verified"]
    # where the command's time went: process start + imports, the pull's phases, the write
    command = result["command"]
    assert command["startup_seconds"] > 0 and command["write_seconds"] > 0
    assert command["pull_call_seconds"] >= result["total_seconds"] > 0
    from modelexpress.p2p.result import PHASES
    assert set(result["phases"]) == set(PHASES)
    assert abs(sum(result["phases"][k] for k in PHASES if k not in ("agent", "verify"))
               - result["total_seconds"]) < 0.05 * result["total_seconds"] + 0.01
    reference = load_checkpoint(real_model_checkpoint())
    received = load_checkpoint(out)
    assert received.keys() == reference.keys()
    assert all(torch.equal(received[n], t) for n, t in reference.items())

    cluster.start(["agent", "--id", "cli-agent", "--no-serve"], "agent")
    cluster.wait_for(lambda: any(a.id == "cli-agent" for a in cluster.client.list_agents()),
                     "the agent", deadline_s=120)
    code, transfer = _cli(cluster, "transfers", "start", "--model", MODEL, "--target",
                          "cli-agent", "--wait", "--timeout", "120")
    assert code == 0 and transfer["state"] == "SUCCEEDED"
    assert transfer["bytes_done"] == transfer["bytes_total"] > 0
    code, listed = _cli(cluster, "transfers", "list", "--state", "SUCCEEDED")
    # every pull is a transfer the server knows: the CLI pull's, then the agent's
    assert code == 0 and [t["id"] for t in listed["transfers"]] == [result["transfer_id"],
                                                                     transfer["id"]]
    code, stopped = _cli(cluster, "transfers", "stop", transfer["id"])
    assert code == 1 and not stopped["ok"] and "ConflictError" in stopped["error"]


def test_cli_failures_exit_nonzero_with_a_clear_error(cluster: Cluster,
                                                      tmp_path: pathlib.Path) -> None:
    # exit codes: docs/DEPLOYMENT.md, "Exit codes" (4: no source; 1: the operation failed)
    code, result = _cli(cluster, "pull", "--model", "nobody/serves-this", "--out",
                        str(tmp_path / "x"))
    assert code == 4 and "no READY source" in result["error"] and result["exit_code"] == 4
    assert not (tmp_path / "x").exists()
    code, result = _cli(cluster, "transfers", "get", "no-such-transfer")
    assert code == 1 and "NotFoundError" in result["error"]
