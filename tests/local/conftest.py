"""Fixtures of the local-transport tests: a source process and its published endpoint."""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys
import time

import pytest

PEERS = pathlib.Path(__file__).with_name("_peers.py")
ROOT = PEERS.parents[2]


class SourceProc:
    """A LocalSource in its own process (tests/local/_peers.py source)."""

    def __init__(self, tmp: pathlib.Path, layout: str, mib: int, seed: int,
                 digest_algorithm: str = "") -> None:
        self.info_path = tmp / f"source-{layout}-{seed}.json"
        self.ipc_dir = str(tmp / "ipc")
        self.seed, self.mib = seed, mib
        extra = ["--digest", digest_algorithm] if digest_algorithm else []
        self.proc = subprocess.Popen(
            [sys.executable, str(PEERS), "source", str(self.info_path), "--layout", layout,
             "--seed", str(seed), "--mib", str(mib), "--ipc-dir", self.ipc_dir, *extra],
            stdin=subprocess.PIPE, cwd=ROOT)
        deadline = time.monotonic() + 60
        while not self.info_path.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"source exited {self.proc.returncode} before publishing")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("source did not publish within 60 s")
            time.sleep(0.05)
        self.info = json.loads(self.info_path.read_text())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def fds_settle(self, want: int, within_s: float = 10.0) -> int:
        """The source's fd count once it equals ``want`` (bounded wait), else the last seen."""
        deadline = time.monotonic() + within_s
        n = self.fds()
        while n != want and time.monotonic() < deadline:
            time.sleep(0.05)
            n = self.fds()
        return n

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # A source a test killed keeps its stdin pipe open here until the Popen is
        # collected, which a test's traceback (a closure over this) may delay into the
        # next test, whose descriptor count then drops by one.
        self.proc.stdin.close()  # type: ignore[union-attr]


@pytest.fixture
def seed() -> int:
    s = random.randrange(1 << 20)
    print(f"seed={s}")  # shown on failure, to reproduce
    return s


@pytest.fixture
def make_source(tmp_path: pathlib.Path, seed: int):  # type: ignore[no-untyped-def]
    made: list[SourceProc] = []

    def make(layout: str = "buffer", mib: int = 16, digest_algorithm: str = "") -> SourceProc:
        s = SourceProc(tmp_path, layout, mib, seed + len(made), digest_algorithm)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
    for s in made:
        assert s.proc.returncode in (0, -9), f"source exited {s.proc.returncode}"
