"""``python -m modelexpress.server`` fails to start with one line and an exit code:
real processes, a real busy port, a real unreachable Redis."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest

from mx_server_procs import free_port


def _run(args: list[str], tmp_path: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
    clean.update(env)
    return subprocess.run([sys.executable, "-m", "modelexpress.server", *args],
                          capture_output=True, text=True, timeout=120, env=clean,
                          cwd=tmp_path)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "env", "code", "says"), [
    (["--store", "mysql://x"], {}, 2,
     "--store: unsupported store URL 'mysql://x'; use sqlite:///PATH or redis://HOST:PORT/DB"),
    ([], {"MX_STORE": "mysql://x"}, 2, "MX_STORE: unsupported store URL 'mysql://x'"),
    ([], {"MX_LOG_LEVEL": "LOUD"}, 2, "MX_LOG_LEVEL: 'LOUD' is not allowed; use one of DEBUG"),
    (["--port", "70000"], {}, 2, "--port: 70000 is out of range; it must be <= 65535"),
    ([], {"MX_STALE_AFTER_S": "soon"}, 2, "MX_STALE_AFTER_S: 'soon' is not a number"),
    (["--host", "192.0.2.1", "--port", "0"], {}, 2, "cannot listen on 192.0.2.1:0"),
])
def test_bad_settings_and_addresses_exit_2_with_one_line(tmp_path: pathlib.Path, args: list[str],
                                                         env: dict, code: int, says: str) -> None:
    proc = _run(args, tmp_path, **env)
    assert proc.returncode == code, proc.stderr
    assert says in _one_line(proc)


def test_a_port_in_use_exits_2_with_one_line(tmp_path: pathlib.Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _run(["--port", str(port), "--store", f"sqlite:///{tmp_path}/mx.db"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert f"port {port} on 127.0.0.1 is in use" in _one_line(proc)


def test_an_unreachable_store_exits_1_with_one_line(tmp_path: pathlib.Path) -> None:
    dead = free_port()  # nothing listens there
    proc = _run(["--port", "0", "--store", f"redis://127.0.0.1:{dead}/0"], tmp_path)
    assert proc.returncode == 1, proc.stderr
    line = _one_line(proc)
    assert f"127.0.0.1:{dead}" in line and "MX_STORE / --store" in line


def test_debug_adds_the_traceback(tmp_path: pathlib.Path) -> None:
    proc = _run(["--store", "mysql://x"], tmp_path, MX_LOG_LEVEL="DEBUG")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith(
        "python -m modelexpress.server: error: --store: unsupported store URL")
