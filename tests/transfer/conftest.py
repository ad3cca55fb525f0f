"""Fixtures: a real source process (tests/transfer/_peer.py) and a target manager."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pathlib
import select
import subprocess
import sys
from collections.abc import Iterator

import pytest

PEER = pathlib.Path(__file__).with_name("_peer.py")
START_TIMEOUT_S = 120.0  # import torch + NIXL on a loaded 2-core machine


@dataclasses.dataclass
class Source:
    proc: subprocess.Popen
    pid: int
    metadata: bytes
    manifests: dict[str, str]
    registration: dict[str, str]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_source(spec: dict, env: dict[str, str] | None = None) -> Source:
    """Start a source process and wait (bounded) for its metadata and manifests."""
    proc = subprocess.Popen([sys.executable, str(PEER)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=None, text=True,
                            env={**os.environ, **(env or {})})
    proc.stdin.write(json.dumps(spec) + "\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    if not ready:
        proc.kill()
        proc.wait(10)
        raise TimeoutError(f"source process did not publish within {START_TIMEOUT_S} s")
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise RuntimeError(f"source process exited with {proc.returncode} before publishing")
    out = json.loads(line)
    return Source(proc, out["pid"], base64.b64decode(out["metadata"]), out["manifests"],
                  out["registration"])


@pytest.fixture
def source_factory() -> Iterator:
    started: list[Source] = []

    def make(spec: dict, env: dict[str, str] | None = None) -> Source:
        src = start_source(spec, env)
        started.append(src)
        return src

    yield make
    for src in started:
        src.stop()
