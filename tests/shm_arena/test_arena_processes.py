"""Arena scenarios across forked processes, each in a fresh interpreter (seed logged)."""

from __future__ import annotations

import logging
import os
import pathlib
import random
import subprocess
import sys
import time

import pytest

log = logging.getLogger(__name__)
SCENARIOS = pathlib.Path(__file__).with_name("scenarios.py")


def entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("mx_shm_arena")}


def run(name: str) -> subprocess.CompletedProcess:
    seed = random.randrange(1 << 30)
    log.info("scenario %s seed=%d", name, seed)
    proc = subprocess.run([sys.executable, str(SCENARIOS), name, str(seed)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"seed={seed}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_lifecycle_forked_readers() -> None:
    before = entries()
    run("lifecycle")
    assert entries() == before


def test_no_segment_leaks() -> None:
    before = entries()
    proc = run("leaks")
    leftover = proc.stdout.strip().splitlines()[-1]
    assert leftover.startswith("mx_shm_arena")
    assert leftover not in entries(), "a never-closed writer was not unlinked at exit"
    assert entries() == before


def test_killed_writer_segment_is_unlinked_by_the_resource_tracker() -> None:
    """SIGKILL runs no finalizer; the tracker the writer registered with cleans up."""
    before = entries()
    code = ("import sys, time\n"
            "from modelexpress.shm_arena import ArenaWriter\n"
            "w = ArenaWriter(1, 1 << 20, prefault=False)\n"
            "print(w.name, flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert name.startswith("mx_shm_arena"), name
        path = os.path.join("/dev/shm", name)
        assert os.path.exists(path)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30.0
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(path), f"{path} outlived its SIGKILLed writer"
    assert entries() == before
