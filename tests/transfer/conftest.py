"""Fixtures: real source processes (tests/transfer/_peer.py) and target processes
(tests/transfer/_target.py), each with the UCX environment a test gives it."""

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
TARGET = pathlib.Path(__file__).with_name("_target.py")
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


def run_target(sources: list[Source], kind: str, env: dict[str, str] | None = None, *,
               repeat: int = 1, refuse: bool = False, parallel: bool = False,
               drop_env: tuple[str, ...] = ()) -> dict:
    """READ ``kind`` from each source, ``repeat`` times (or all sources at once:
    ``parallel``), with one manager in a fresh target process.

    The target's UCX starts in that process, so ``env`` (UCX_TLS, UCX_LOG_FILE, ...)
    is in place before it; ``drop_env`` removes inherited variables first.
    """
    spec = {"sources": [{"metadata": base64.b64encode(s.metadata).decode(),
                         "manifest": s.manifests[kind]} for s in sources],
            "repeat": repeat, "refuse": refuse, "parallel": parallel}
    base = {k: v for k, v in os.environ.items() if k not in drop_env}
    out = subprocess.run([sys.executable, str(TARGET)], input=json.dumps(spec),
                         capture_output=True, text=True, timeout=300,
                         env={**base, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


@pytest.fixture
def target_runner():
    return run_target
