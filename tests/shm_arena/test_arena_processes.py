"""Arena scenarios across forked processes, each in a fresh interpreter (seed logged)."""

from __future__ import annotations

import logging
import os
import pathlib
import random
import subprocess
import sys

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
