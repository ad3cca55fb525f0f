"""Real processes for the control-plane tests: a uvicorn server and Debian's redis-server.

Both bind 127.0.0.1 on a free port (a first start whose port another process took
meanwhile starts again on another), log to a file under the test's temp dir, and
are waited for with a deadline; ``kill()`` is SIGKILL (for the restart test),
``stop()`` a graceful SIGTERM with a bounded wait.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx

__all__ = ["free_port", "ServerProc", "RedisProc", "TOKEN"]

TOKEN = "test-token-7f3a"
_START_DEADLINE_S = 60.0  # a loaded 2-core machine imports fastapi slowly
_PORT_TRIES = 3  # a first start whose port another process took since free_port()


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """``python -m modelexpress.server`` in a subprocess.

    Args:
        store: store URL.
        log_dir: where ``server-<port>.log`` goes.
        token: MX_SERVER_TOKEN, or None for no auth.
        env: more MX_* settings.
    """

    def __init__(self, store: str, log_dir: pathlib.Path, *, token: str | None = TOKEN,
                 env: dict[str, str] | None = None) -> None:
        self.store = store
        self.token = token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
        self._env.update(env or {})
        if token:
            self._env["MX_SERVER_TOKEN"] = token
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False

    def start(self) -> "ServerProc":
        """Start and wait until healthy. A first start whose port another process took
        between :func:`free_port` and the bind (the log says ``[Errno 98]``) starts again
        on another port, at most twice; a restart keeps its port (callers hold its URL)."""
        for attempt in range(_PORT_TRIES):
            try:
                return self._start_once()
            except RuntimeError:
                if self._started or attempt + 1 == _PORT_TRIES or not _port_taken(self.log()):
                    raise
            self._move_to(free_port())
        raise AssertionError("unreachable")

    def _move_to(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = self.log_path.with_name(f"server-{port}.log")

    def _start_once(self) -> "ServerProc":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "modelexpress.server", "--host", "127.0.0.1",
                 "--port", str(self.port), "--store", self.store],
                stdout=log, stderr=subprocess.STDOUT, env=self._env)
        deadline = time.monotonic() + _START_DEADLINE_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=2.0).status_code == 200:
                    self._started = True
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"server on {self.url} not healthy after "
                                   f"{_START_DEADLINE_S} s:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (the restart test's crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()


def _port_taken(log: str) -> bool:
    """Whether a server's or Redis's log says its port was in use (the server checks
    before it binds and says so; uvicorn's bind and Redis say it their way)."""
    return any(m in log for m in ("is in use (another server?)", "[Errno 98]",
                                  "Address already in use"))


class RedisProc:
    """Debian's ``redis-server`` on a free port in ``workdir``.

    Args:
        persist: append-only file on, fsync'd per write, so a restart keeps every
            acknowledged record (the Redis restart test); off by default.
    """

    def __init__(self, workdir: pathlib.Path, *, persist: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self._binary = binary
        self._workdir = workdir
        self._persist = persist
        for attempt in range(_PORT_TRIES):  # as ServerProc.start: the port taken meanwhile
            self.port = free_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"
            self.log_path = workdir / f"redis-{self.port}.log"
            try:
                self.proc = self._spawn()
                break
            except RuntimeError:
                log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
                if attempt + 1 == _PORT_TRIES or not _port_taken(log):
                    raise

    def _spawn(self) -> subprocess.Popen:
        durability = (["--appendonly", "yes", "--appendfsync", "always"] if self._persist
                      else ["--appendonly", "no"])
        proc = subprocess.Popen(
            [self._binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self._workdir), "--save", "", *durability, "--daemonize", "no",
             "--logfile", str(self.log_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import redis
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)
        deadline = time.monotonic() + 20.0
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {proc.returncode}")
                try:
                    client.ping()
                    return proc
                except redis.RedisError:
                    if time.monotonic() > deadline:
                        proc.kill()
                        proc.wait(timeout=10)
                        raise TimeoutError(f"redis-server on port {self.port} not up after 20 s")
                    time.sleep(0.05)
        finally:
            client.close()

    def restart(self, down_s: float = 0.0) -> None:
        """Stop (SIGTERM), stay down ``down_s``, start again on the same port and dir."""
        self.stop()
        time.sleep(down_s)
        self.proc = self._spawn()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
