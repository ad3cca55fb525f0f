"""Server replicas with the real workers: ``modelexpress publish`` and ``modelexpress
agent`` processes configured with both replicas (MX_SERVER_URL=A,B), real NIXL
transfers; replica A is killed (SIGKILL) while a rate-capped transfer runs and the
source heartbeats: the source stays READY, the transfer finishes with its outcome, and
a CLI pull afterwards goes through replica B."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

import pytest

from modelexpress._subproc import ModuleProcess, clean_env
from modelexpress.checkpoint import real_model_checkpoint
from modelexpress.client import MxClient
from modelexpress.identity import ModelIdentity
from mx_server_procs import TOKEN, RedisProc, ServerProc

pytestmark = [pytest.mark.nixl, pytest.mark.redis, pytest.mark.slow]

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
_STALE_S = 4.0


def _wait_for(probe: Callable[[], Any], what: str, deadline_s: float) -> Any:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")


@pytest.fixture()
def replicas(tmp_path: pathlib.Path) -> Iterator[tuple[ServerProc, ServerProc]]:
    redis = RedisProc(tmp_path)
    env = {"MX_STALE_AFTER_S": str(_STALE_S)}
    servers: list[ServerProc] = []
    try:
        servers.append(ServerProc(redis.url, tmp_path, env=env).start())
        servers.append(ServerProc(redis.url, tmp_path, env=env).start())
        yield servers[0], servers[1]
    finally:
        for s in servers:
            s.stop()
        redis.stop()


def test_real_workers_ride_out_a_replica_killed_mid_transfer(
        replicas: tuple[ServerProc, ServerProc], tmp_path: pathlib.Path) -> None:
    a, b = replicas
    env = clean_env(MX_SERVER_URL=f"{a.url},{b.url}", MX_SERVER_TOKEN=TOKEN,
                    MX_HEARTBEAT_INTERVAL_S="0.5", MX_LOG_LEVEL="INFO")
    procs: list[ModuleProcess] = []
    try:
        source = ModuleProcess(["modelexpress", "publish", str(real_model_checkpoint()),
                                "--model", MODEL, "--json", "--worker-id", "src-1"],
                               tmp_path / "publish.log", env)
        procs.append(source)
        published = source.json_line(180.0)
        agent = ModuleProcess(["modelexpress", "agent", "--id", "agent-1", "--no-serve",
                               "--out", str(tmp_path / "out"), "--chunk-bytes", str(2 << 20),
                               "--max-gbps", "0.02"], tmp_path / "agent.log", env)
        procs.append(agent)
        with MxClient([b.url, a.url], token=TOKEN, timeout_s=10.0) as c:
            _wait_for(lambda: any(x.id == "agent-1" for x in c.list_agents()), "the agent",
                      180.0)
            t = c.start_transfer(ModelIdentity(model=MODEL, dtype="float32"), "agent-1")
            _wait_for(lambda: c.get_transfer(t.id).bytes_done > 0, "the transfer to run",
                      120.0)
            a.kill()
            # Longer than MX_STALE_AFTER_S: heartbeats lost with A would stale the source.
            for _ in range(int((_STALE_S + 2) / 0.25)):
                assert c.get_source(published["source_id"]).state == "READY"
                time.sleep(0.25)
            done = _wait_for(lambda: (x := c.get_transfer(t.id)).state in (
                "SUCCEEDED", "FAILED") and x, "the transfer to finish", 180.0)
            assert done.state == "SUCCEEDED", (done.error, agent.tail())
            assert done.bytes_done == done.bytes_total > 0
            assert done.outcome is not None and done.outcome.transport != ""
            assert done.outcome.data_plane_s > 0
            assert (tmp_path / "out" / t.id).is_dir()

            # A CLI pull configured with both replicas, the first one dead.
            pull = subprocess.run(
                [sys.executable, "-m", "modelexpress", "pull", "--model", MODEL, "--out",
                 str(tmp_path / "pulled"), "--json"], capture_output=True, text=True,
                env=env, timeout=300)
            assert pull.returncode == 0, pull.stderr[-3000:]
            result = json.loads(next(ln for ln in pull.stdout.splitlines()
                                     if ln.startswith("{")))
            assert c.get_transfer(result["transfer_id"]).state == "SUCCEEDED"
            assert c.get_source(published["source_id"]).state == "READY"
    finally:
        for p in procs:
            p.stop()
