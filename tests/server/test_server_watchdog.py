"""A replica that answered nothing for a while says so in its log (the event-loop
watchdog): a client's read timeout then has a matching line on the server's side."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import time

import httpx

from mx_server_procs import ServerProc


def test_a_stalled_server_logs_how_long_it_answered_nothing(tmp_path: pathlib.Path) -> None:
    server = ServerProc(f"sqlite:///{tmp_path / 'mx.db'}", tmp_path).start()
    try:
        assert server.proc is not None
        assert "woke" not in server.log()
        os.kill(server.proc.pid, signal.SIGSTOP)  # the whole process: no loop, no threads
        try:
            time.sleep(3.5)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        found = None
        while found is None and time.monotonic() < deadline:
            found = re.search(r"event loop woke ([0-9.]+) s late and answered nothing",
                              server.log())
            time.sleep(0.1)
        assert found is not None, server.log()
        # stopped 3.5 s in the middle of a 1 s sleep: it woke 2.5 to 3.5 s late
        assert 2.0 < float(found.group(1)) < 30, found.group(0)
        # and it serves again
        assert httpx.get(f"{server.url}/v1/health", timeout=10).status_code == 200
    finally:
        server.stop()
