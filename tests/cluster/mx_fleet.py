"""modelexpress on a :class:`~netns_cluster.NetnsCluster`: a server host, publishers, pullers.

Every process is the real entry point: the server is ``python -m modelexpress.server``
and sources and targets run the ``modelexpress`` console script of this venv
(``publish``, ``pull``), each in its own host. The test or bench process only talks
HTTP to the server (through the root namespace's address on the bridge) and reads
the JSON lines the commands print.

UCX sees separate machines (distinct boot ids, network namespaces), so its only
transport between hosts is TCP over the hosts' NICs. ``UCX_NET_DEVICES`` is left to
the caller (UCX's default: every usable interface).
"""

from __future__ import annotations

import pathlib
import sys
import time
from typing import Any, Sequence

import httpx

from netns_cluster import Host, HostProcess, NetnsCluster

__all__ = ["Fleet", "MODEL", "MX", "START_DEADLINE_S"]

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# The console script next to this interpreter (the venv's modelexpress); where the
# package was installed without it there (the H200 host's system Python puts scripts
# elsewhere), the same CLI through the interpreter.
_SCRIPT = pathlib.Path(sys.executable).parent / "modelexpress"
MX: list[str] = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "modelexpress"]
# torch + NIXL imports of up to ten processes at once on a 2-core machine.
START_DEADLINE_S = 240.0
SERVER_PORT = 8001


class Fleet:
    """One modelexpress server in ``server_host``; publish and pull in other hosts.

    Args:
        cluster: the hosts.
        server_host: where the server runs (SQLite store in the cluster's workdir).
        stale_after_s: MX_STALE_AFTER_S of the server.
        heartbeat_s: MX_HEARTBEAT_INTERVAL_S of the sources.
    """

    def __init__(self, cluster: NetnsCluster, server_host: Host, *,
                 stale_after_s: float = 600.0, heartbeat_s: float = 0.5) -> None:
        self.cluster = cluster
        self.url = f"http://{server_host.ip}:{SERVER_PORT}"
        self.heartbeat_s = heartbeat_s
        self.server = server_host.run(
            [sys.executable, "-m", "modelexpress.server", "--host", "0.0.0.0", "--port",
             str(SERVER_PORT), "--store", f"sqlite:///{cluster.workdir / 'mx.db'}"],
            "server", self._clean({"MX_STALE_AFTER_S": str(stale_after_s),
                                   "MX_LOG_LEVEL": "INFO"}))
        self._wait_healthy(START_DEADLINE_S)

    @staticmethod
    def _clean(extra: dict[str, str]) -> dict[str, str]:
        import os
        # UCX_MODULE_DIR says where UCX's transports are (a NIXL wheel installed with
        # --target, as on an H200 host); every other UCX_ setting is the test's.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("MX_", "UCX_")) or k == "UCX_MODULE_DIR"}
        env.update(extra)
        return env

    def _wait_healthy(self, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.server.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.server.proc.returncode}:\n"
                                   f"{self.server.tail()}")
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server {self.url} not healthy after {deadline_s} s:\n"
                           f"{self.server.tail()}")

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a modelexpress command in a host."""
        return self._clean({"MX_SERVER_URL": self.url,
                            "MX_HEARTBEAT_INTERVAL_S": str(self.heartbeat_s),
                            "MX_LOG_LEVEL": "INFO", **extra})

    def client(self):  # noqa: ANN201
        from modelexpress.client import MxClient
        return MxClient(self.url, timeout_s=10.0)

    def publish(self, host: Host, *, checkpoint: pathlib.Path | None = None,
                model: str = MODEL, env: dict[str, str] | None = None) -> HostProcess:
        """Start ``modelexpress publish`` of a checkpoint (default: all-MiniLM-L6-v2) in
        ``host`` (not waited for)."""
        from modelexpress.checkpoint import real_model_checkpoint
        return host.run([*MX, "publish", str(checkpoint or real_model_checkpoint()),
                         "--model", model, "--json", "--worker-id", f"src-{host.name}"],
                        "publish", self.env(**(env or {})))

    def pull(self, host: Host, out: pathlib.Path, *, model: str = MODEL,
             args: Sequence[str] = (), env: dict[str, str] | None = None) -> HostProcess:
        """Start ``modelexpress pull --json`` into ``out`` in ``host`` (not waited for)."""
        return host.run([*MX, "pull", "--model", model, "--out", str(out), "--json", *args],
                        "pull", self.env(**(env or {})))

    def agent(self, host: Host, agent_id: str, out: pathlib.Path | None, *,
              args: Sequence[str] = (), env: dict[str, str] | None = None) -> HostProcess:
        """Start ``modelexpress agent`` in ``host`` (it runs REST-started transfers; with
        ``out`` None it keeps them in memory only, serving them onward)."""
        write = ["--out", str(out)] if out is not None else []
        return host.run([*MX, "agent", "--id", agent_id, *write, *args], "agent",
                        self.env(**(env or {})))

    def wait_agents(self, ids: Sequence[str], deadline_s: float = START_DEADLINE_S) -> None:
        """Wait until every agent in ``ids`` registered with the server."""
        end = time.monotonic() + deadline_s
        with self.client() as c:
            while not set(ids) <= {a.id for a in c.list_agents()}:
                if time.monotonic() > end:
                    raise TimeoutError(f"agents {sorted(ids)} not all registered after "
                                       f"{deadline_s} s")
                time.sleep(0.2)

    def wait_ready_sources(self, n: int, deadline_s: float = START_DEADLINE_S,
                           model: str = MODEL) -> list[Any]:
        """Wait until exactly ``n`` READY sources of ``model`` are on the server."""
        end = time.monotonic() + deadline_s
        with self.client() as c:
            while True:
                ready = c.list_sources(model=model, state="READY")
                if len(ready) == n:
                    return ready
                if time.monotonic() > end:
                    raise TimeoutError(f"{len(ready)} of {n} sources READY after "
                                       f"{deadline_s} s")
                time.sleep(0.2)
