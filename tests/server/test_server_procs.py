"""The test harness's own processes: a real server and a real Redis whose free port
another process took between ``free_port()`` and their bind start again on another
(CI saw ``[Errno 98] Address already in use`` when tests ran side by side)."""

from __future__ import annotations

import pathlib
import socket
from collections.abc import Iterator

import httpx
import pytest

import mx_server_procs as procs


@pytest.fixture()
def taken_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A port this test listens on, handed out by ``free_port()`` once (as if another
    process had bound it just after ``free_port()`` found it free), real ones after."""
    real = procs.free_port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        handed = iter([port])
        monkeypatch.setattr(procs, "free_port", lambda: next(handed, None) or real())
        yield port


def test_a_server_whose_port_was_taken_starts_on_another(tmp_path: pathlib.Path,
                                                         taken_port: int) -> None:
    server = procs.ServerProc(f"sqlite:///{tmp_path}/mx.db", tmp_path)
    assert server.port == taken_port
    try:
        server.start()
        assert server.port != taken_port and str(server.port) in server.url
        assert httpx.get(f"{server.url}/v1/health", timeout=5.0).status_code == 200
        first = (tmp_path / f"server-{taken_port}.log").read_text()
        assert procs._port_taken(first), first[-2000:]
        # a restart keeps its port: a restart that cannot bind fails, it does not move
        server.kill()
        server.start()
        assert httpx.get(f"{server.url}/v1/health", timeout=5.0).status_code == 200
    finally:
        server.stop()


def test_a_server_that_fails_for_another_reason_is_not_started_again(
        tmp_path: pathlib.Path) -> None:
    server = procs.ServerProc("nosuchstore://x", tmp_path)
    port = server.port
    with pytest.raises(RuntimeError, match="server exited"):
        server.start()
    assert server.port == port and not procs._port_taken(server.log())


def test_a_redis_whose_port_was_taken_starts_on_another(tmp_path: pathlib.Path,
                                                        taken_port: int) -> None:
    redis = procs.RedisProc(tmp_path)
    try:
        assert redis.port != taken_port and redis.proc.poll() is None
        assert procs._port_taken((tmp_path / f"redis-{taken_port}.log").read_text())
    finally:
        redis.stop()
