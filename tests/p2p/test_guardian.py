"""A source's guardian withdraws it the moment its process dies, however it dies.

The server here times sources out only after 600 s without heartbeats, so a source
found STALE within seconds was withdrawn by its guardian (or, on a clean stop, by
itself), not by the server.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

pytestmark = pytest.mark.nixl


def _guardians(source_id: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if "modelexpress.p2p.guardian" in cmd and source_id in cmd:
            found.append(p)
    return found


def _guardian_of(source_id: str, source_pid: int) -> psutil.Process:
    (guardian,) = _guardians(source_id)
    # Not in the source's process tree (vLLM SIGKILLs its whole tree at shutdown) nor
    # in its process group or session.
    assert guardian.pid not in {c.pid for c in psutil.Process(source_pid).children(True)}
    end = time.monotonic() + 10.0  # it calls setsid() once Python has started
    while os.getsid(guardian.pid) == os.getsid(source_pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert os.getsid(guardian.pid) != os.getsid(source_pid)
    return guardian


def test_sigkilled_source_is_marked_stale_by_its_guardian(patient_cluster) -> None:
    proc, line = patient_cluster.source("killed")
    source_id = line["source_id"]
    guardian = _guardian_of(source_id, proc.proc.pid)
    assert patient_cluster.client.get_source(source_id).state == "READY"
    os.kill(proc.proc.pid, signal.SIGKILL)
    patient_cluster.wait_for(
        lambda: patient_cluster.client.get_source(source_id).state == "STALE",
        "the guardian to mark the killed source STALE", deadline_s=15.0)
    psutil.wait_procs([guardian], timeout=15.0)  # it exits once it acted (not our child)
    assert not guardian.is_running()


def test_guardian_ignores_group_signals_until_its_source_is_gone(
        patient_cluster) -> None:
    proc, line = patient_cluster.source("grouped")
    guardian = _guardian_of(line["source_id"], proc.proc.pid)
    guardian.send_signal(signal.SIGTERM)  # as a pod's termination would
    guardian.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert guardian.is_running() and guardian.status() != psutil.STATUS_ZOMBIE
    assert patient_cluster.client.get_source(line["source_id"]).state == "READY"
    proc.proc.kill()
    patient_cluster.wait_for(
        lambda: patient_cluster.client.get_source(line["source_id"]).state == "STALE",
        "the guardian to act after its source was killed", deadline_s=15.0)


def test_clean_stop_withdraws_once_and_the_guardian_exits(patient_cluster) -> None:
    proc, line = patient_cluster.source("clean")
    guardian = _guardian_of(line["source_id"], proc.proc.pid)
    assert proc.stop() == 0
    assert patient_cluster.client.get_source(line["source_id"]).state == "STALE"
    gone, _alive = psutil.wait_procs([guardian], timeout=10.0)
    assert gone
    assert "marking it STALE" not in proc.tail()
