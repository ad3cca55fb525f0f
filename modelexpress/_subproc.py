"""A ``python -m <module>`` child process with a JSON-line handshake.

The demo, ``bench/p2p.py`` and the P2P tests start the server, sources and agents
as real processes. Commands run with ``--json`` print one JSON object when ready;
NIXL prints its own log lines to stdout too, so the reader skips non-JSON lines.
Every wait is bounded; ``stop`` is SIGTERM, then SIGKILL after a deadline.
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import time
from typing import Any

from modelexpress.errors import MxTimeoutError

__all__ = ["ModuleProcess", "clean_env"]


def clean_env(**overrides: str) -> dict[str, str]:
    """This process's environment without ``MX_*`` settings, plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
    env.update(overrides)
    return env


class ModuleProcess:
    """``python -m <args>``: stdout piped (for the JSON line), stderr to ``log_path``.

    Args:
        args: arguments after ``python -m`` (e.g. ``["modelexpress", "publish", ...]``).
        log_path: file that receives stderr.
        env: the child's environment (see :func:`clean_env`).
        cwd: working directory.
    """

    def __init__(self, args: list[str], log_path: pathlib.Path, env: dict[str, str],
                 cwd: str | os.PathLike[str] | None = None) -> None:
        self.name = args[1] if len(args) > 1 and args[0] == "modelexpress" else args[0]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, cwd=cwd)
        self._pending = b""  # stdout read but not yet returned by json_line

    def json_line(self, deadline_s: float) -> dict[str, Any]:
        """The next JSON object the child prints on stdout (one line starting ``{``).

        Reads the pipe with ``os.read`` into a buffer of its own: a line that arrived
        with earlier output in one read is not left in a file object's buffer where
        ``select`` cannot see it, and what follows it is kept for the next call. A
        line printed just before the child exits is still returned.

        Raises:
            MxTimeoutError: nothing within ``deadline_s``, or the child exited first
                (the message holds the end of its log).
        """
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        end = time.monotonic() + deadline_s
        eof = False
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.startswith(b"{"):
                    return json.loads(line)
            if eof or time.monotonic() >= end:
                break
            ready, _, _ = select.select([fd], [], [], min(0.5, max(end - time.monotonic(), 0)))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    self._pending += chunk
                    continue
                eof = True  # the child closed stdout (exited)
                self._pending += b"\n"  # a last line without its newline
            elif self.proc.poll() is not None:
                eof = True
        raise MxTimeoutError(f"{self.name} printed no JSON line within {deadline_s:.0f} s "
                             f"(exit code {self.proc.poll()}); log:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        """The end of the child's stderr log."""
        if not self._log.closed:
            self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(log unavailable)"

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait; SIGKILL after ``timeout_s``. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (a crash: no shutdown code runs)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
