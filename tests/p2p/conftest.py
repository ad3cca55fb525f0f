"""Real processes for the P2P tests: the server, sources and agents via the CLI."""

from __future__ import annotations

import json
import os
import pathlib
import selectors
import signal
import subprocess
import sys
import time
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "server"))
from mx_server_procs import ServerProc  # noqa: E402

from modelexpress.checkpoint import real_model_checkpoint  # noqa: E402
from modelexpress.client import MxClient  # noqa: E402

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
_START_DEADLINE_S = 120.0  # torch + NIXL imports on a loaded 2-core machine


class CliProc:
    """``python -m modelexpress <args>`` with stdout captured and stderr in a log file."""

    def __init__(self, args: list[str], log_path: pathlib.Path, server_url: str,
                 env: dict[str, str] | None = None) -> None:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
        full_env.update({"MX_SERVER_URL": server_url, "MX_HEARTBEAT_INTERVAL_S": "0.5",
                         "MX_LOG_LEVEL": "INFO"})
        full_env.update(env or {})
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "modelexpress", *args],
                                     stdout=subprocess.PIPE, stderr=self._log, env=full_env)

    def json_line(self, deadline_s: float = _START_DEADLINE_S) -> dict[str, Any]:
        """The first JSON object printed on stdout (NIXL's own stdout lines skipped)."""
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if sel.select(timeout=0.5):
                line = self.proc.stdout.readline()
                if line.startswith(b"{"):
                    return json.loads(line)
            if self.proc.poll() is not None:
                break
        raise AssertionError(f"no JSON line within {deadline_s} s (exit {self.proc.poll()}):\n"
                             f"{self.tail()}")

    def tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it hangs. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Cluster:
    """One server plus the processes a test starts; everything stopped at the end."""

    def __init__(self, server: ServerProc, workdir: pathlib.Path) -> None:
        self.server = server
        self.workdir = workdir
        self.procs: list[CliProc] = []
        self.client = MxClient(server.url, token=server.token, timeout_s=10.0)
        self._n = 0

    def _env(self) -> dict[str, str]:
        return {"MX_SERVER_TOKEN": self.server.token} if self.server.token else {}

    def start(self, args: list[str], name: str, env: dict[str, str] | None = None) -> CliProc:
        self._n += 1
        proc = CliProc(args, self.workdir / f"{name}-{self._n}.log", self.server.url,
                       {**self._env(), **(env or {})})
        self.procs.append(proc)
        return proc

    def source(self, name: str = "source", model: str = MODEL,
               checkpoint: pathlib.Path | None = None) -> tuple[CliProc, dict[str, Any]]:
        """Start ``modelexpress publish`` and wait until it printed its source id."""
        proc = self.start(["publish", str(checkpoint or real_model_checkpoint()), "--model",
                           model, "--json", "--worker-id", f"{name}-{self._n + 1}"], name)
        return proc, proc.json_line()

    def wait_for(self, probe: Any, what: str, deadline_s: float = 60.0) -> Any:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            value = probe()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")

    def close(self) -> None:
        for proc in self.procs:
            proc.stop()
        self.client.close()


@pytest.fixture
def cluster(tmp_path: pathlib.Path) -> Iterator[Cluster]:
    """A fresh SQLite server (sources go STALE after 3 s without heartbeats)."""
    server = ServerProc(f"sqlite:///{tmp_path / 'mx.db'}", tmp_path,
                        env={"MX_STALE_AFTER_S": "3"}).start()
    c = Cluster(server, tmp_path)
    try:
        yield c
    finally:
        c.close()
        server.stop()
