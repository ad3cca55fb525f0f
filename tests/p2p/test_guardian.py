"""A source's guardian withdraws it the moment its process dies, however it dies.

The server here times sources out only after 600 s without heartbeats, so a source
found STALE within seconds was withdrawn by its guardian (or, on a clean stop, by
itself), not by the server.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from conftest import Cluster

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "server"))
from mx_server_procs import ServerProc  # noqa: E402

pytestmark = pytest.mark.nixl


@pytest.fixture
def patient_cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    server = ServerProc(f"sqlite:///{tmp_path / 'mx.db'}", tmp_path,
                        env={"MX_STALE_AFTER_S": "600"}).start()
    c = Cluster(server, tmp_path)
    try:
        yield c
    finally:
        c.close()
        server.stop()


def _guardians(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children()
            if "modelexpress.p2p.guardian" in " ".join(p.cmdline())]


def test_sigkilled_source_is_marked_stale_by_its_guardian(patient_cluster: Cluster) -> None:
    proc, line = patient_cluster.source("killed")
    source_id = line["source_id"]
    (guardian,) = _guardians(proc.proc.pid)
    assert patient_cluster.client.get_source(source_id).state == "READY"
    os.kill(proc.proc.pid, signal.SIGKILL)
    patient_cluster.wait_for(
        lambda: patient_cluster.client.get_source(source_id).state == "STALE",
        "the guardian to mark the killed source STALE", deadline_s=15.0)
    guardian.wait(timeout=15.0)  # it exits once it acted


def test_guardian_ignores_group_signals_until_its_source_is_gone(
        patient_cluster: Cluster) -> None:
    proc, line = patient_cluster.source("grouped")
    (guardian,) = _guardians(proc.proc.pid)
    guardian.send_signal(signal.SIGTERM)  # as a pod's termination would
    guardian.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert guardian.is_running() and guardian.status() != psutil.STATUS_ZOMBIE
    proc.proc.kill()
    patient_cluster.wait_for(
        lambda: patient_cluster.client.get_source(line["source_id"]).state == "STALE",
        "the guardian to act after its source was killed", deadline_s=15.0)


def test_clean_stop_withdraws_once_and_the_guardian_exits(patient_cluster: Cluster) -> None:
    proc, line = patient_cluster.source("clean")
    (guardian,) = _guardians(proc.proc.pid)
    assert proc.stop() == 0
    assert patient_cluster.client.get_source(line["source_id"]).state == "STALE"
    guardian.wait(timeout=10.0)
    assert "marking it STALE" not in proc.tail()
