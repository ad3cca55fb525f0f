"""A plain vLLM engine with ``MX_ARTIFACT_KEY`` set and no ``MX_SERVER_URL`` asks no server.

The plugin runs in every vLLM process, also in engines that never use modelexpress
(``--load-format auto``). Its model-info prefetch (compiled artifacts) needs a control
plane; with none configured it must not try the default address: no connection, no
warning, no error line. A listener on the default address records which process each
connection came from (this machine's other jobs may use that port too), so the test
fails on any attempt by the engine's processes, refused or not.
"""

from __future__ import annotations

import re
import socket
import threading

import psutil
import pytest

from vllm_engines import Engine, make_tiny_llama

pytestmark = [pytest.mark.vllm]

READY_S = 300.0
KEY = "no-server-artifact-key-0123456789"


class _Listener:
    """Accepts connections on 127.0.0.1:8001, MxSettings' default server, and records the
    pid each came from (None where the connection was gone before it was looked up)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 8001))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.pids: list[int | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.pids.append(self._owner(peer))  # ORDER: while the peer's socket is open
            conn.close()

    @staticmethod
    def _owner(peer: tuple[str, int]) -> int | None:
        for c in psutil.net_connections(kind="tcp4"):
            if c.laddr and (c.laddr.ip, c.laddr.port) == peer and c.raddr \
                    and c.raddr.port == 8001:
                return c.pid
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def test_a_plain_engine_with_a_key_and_no_server_contacts_none_and_logs_no_error(
        tmp_path) -> None:
    try:
        listener = _Listener()
    except OSError as exc:  # another process holds the default port: cannot observe it
        pytest.skip(f"127.0.0.1:8001 is taken ({exc}); the test listens there")
    ckpt = make_tiny_llama(tmp_path / "llama")
    try:
        with Engine(ckpt, name="plain-key-no-server", log_dir=tmp_path, load_format="auto",
                    env={"MX_ARTIFACT_KEY": KEY,
                         "VLLM_CACHE_ROOT": str(tmp_path / "cache")}).start() as engine:
            engine.wait_ready(READY_S)
            assert engine.complete("hello world", max_tokens=4)
            log = engine.log_text()
            ours = set(engine.pids())
    finally:
        listener.close()
    from_engine = [pid for pid in listener.pids if pid in ours]
    assert not from_engine, f"{len(from_engine)} connection(s) to the default address"
    ours = [line for line in log.splitlines() if "modelexpress" in line]
    bad = [line for line in ours if re.search(r"\b(WARNING|ERROR)\b", line)]
    assert not bad, "\n".join(bad)
    assert "Connection refused" not in log
