"""Real processes for the P2P tests: the server, sources and agents via the CLI."""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "server"))
from mx_server_procs import ServerProc  # noqa: E402

from modelexpress._subproc import ModuleProcess, clean_env  # noqa: E402
from modelexpress.checkpoint import real_model_checkpoint  # noqa: E402
from modelexpress.client import MxClient  # noqa: E402
from modelexpress.errors import ServerUnavailableError  # noqa: E402

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
_START_DEADLINE_S = 120.0  # torch + NIXL imports on a loaded 2-core machine
# The tests' clients wait this long for a reply: at a load average of 15 on the 2-core
# CI machine (vLLM engines compiling beside these tests) a process, the server among
# them, got no CPU for 6 s (its event-loop watchdog's warnings), and a poll or a
# start_transfer that times out is not repeated (it may have reached the server).
CLIENT_TIMEOUT_S = 30.0


class CliProc(ModuleProcess):
    """``python -m modelexpress <args>`` pointed at the test's server."""

    def __init__(self, args: list[str], log_path: pathlib.Path, server_url: str,
                 env: dict[str, str] | None = None) -> None:
        defaults = {"MX_SERVER_URL": server_url, "MX_HEARTBEAT_INTERVAL_S": "0.5",
                    "MX_LOG_LEVEL": "INFO", "MX_CLIENT_TIMEOUT_S": str(CLIENT_TIMEOUT_S)}
        # a test's own env wins over these defaults
        super().__init__(["modelexpress", *args], log_path,
                         clean_env(**{**defaults, **(env or {})}))

    def json_line(self, deadline_s: float = _START_DEADLINE_S) -> dict[str, Any]:
        return super().json_line(deadline_s)


class Cluster:
    """One server plus the processes a test starts; everything stopped at the end."""

    def __init__(self, server: ServerProc, workdir: pathlib.Path) -> None:
        self.server = server
        self.workdir = workdir
        self.procs: list[CliProc] = []
        self.client = MxClient(server.url, token=server.token, timeout_s=CLIENT_TIMEOUT_S)
        self._n = 0
        # The sources' local-transport sockets: a short path (a Unix socket's is at most
        # 107 bytes; pytest's tmp_path can be longer), removed with the cluster.
        self.ipc_dir = tempfile.mkdtemp(prefix="mx-ipc-")

    def _env(self) -> dict[str, str]:
        env = {"MX_IPC_DIR": self.ipc_dir}
        if self.server.token:
            env["MX_SERVER_TOKEN"] = self.server.token
        return env

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

    def claim(self, client: MxClient, agent_id: str, deadline_s: float = 60.0) -> Any:
        """Poll until ``agent_id`` claims something, as an agent's own loop does: a poll
        whose reply never came (``ServerUnavailableError``: the server stalled past the
        client's timeout) is repeated, and what it claimed is handed out again after
        ``CLAIM_REDELIVERY_S``."""
        def poll() -> Any:
            try:
                return client.poll_assignments(agent_id, wait_s=1.0)
            except ServerUnavailableError:
                return []
        return self.wait_for(poll, f"the assignment of {agent_id}", deadline_s)

    def close(self) -> None:
        for proc in self.procs:
            proc.stop()
        self.client.close()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _fresh_cluster(request: pytest.FixtureRequest, tmp_path: pathlib.Path,
                   stale_after_s: float) -> Iterator[Cluster]:
    server = ServerProc(f"sqlite:///{tmp_path / 'mx.db'}", tmp_path,
                        env={"MX_STALE_AFTER_S": str(stale_after_s)}).start()
    c = Cluster(server, tmp_path)
    try:
        yield c
    finally:
        c.close()
        server.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            # shown under the failure ("Captured stdout teardown"): what the server and
            # the CLI processes logged, which a CI run keeps nowhere else
            for proc in c.procs:
                print(f"--- {proc.log_path.name} (last 4000 characters) ---\n{proc.tail()}")
            print(f"--- {server.log_path.name} (last 4000 characters) ---\n{server.log()}")


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[Cluster]:
    """A fresh SQLite server (sources go STALE after 3 s without heartbeats)."""
    yield from _fresh_cluster(request, tmp_path, 3)


@pytest.fixture
def patient_cluster(request: pytest.FixtureRequest, tmp_path: pathlib.Path
                    ) -> Iterator[Cluster]:
    """A fresh SQLite server that times sources out only after 600 s: a source found
    STALE sooner was withdrawn (by itself or its guardian), not timed out."""
    yield from _fresh_cluster(request, tmp_path, 600)
