"""A real control-plane server and source processes serving ranks with their layouts,
for the tests of pulls across layouts (``test_layout_pull.py``, ``test_layout_devices.py``).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import ServerProc  # noqa: E402

from modelexpress._subproc import ModuleProcess, clean_env  # noqa: E402


@contextlib.contextmanager
def layout_sources(tmp: pathlib.Path, commands: Mapping[str, Sequence[str]], *,
                   pythonpath: str, ready_s: float
                   ) -> Iterator[tuple[ServerProc, str, dict[str, str]]]:
    """A server (SQLite under ``tmp``) and one ``python -m`` process per name of
    ``commands`` (each prints its ``source_id`` on its first line, within ``ready_s``),
    over NIXL and the local transport (a short ``MX_IPC_DIR``: a Unix socket's path is
    at most 107 bytes). Yields ``(server, ipc dir, source id by name)``; everything is
    stopped and removed when the block ends."""
    server = ServerProc(f"sqlite:///{tmp / 'mx.db'}", tmp,
                        env={"MX_STALE_AFTER_S": "600"}).start()
    ipc = tempfile.mkdtemp(prefix="mx-ipc-")
    # ``pythonpath`` goes before this process's own (a GPU host's staged packages are
    # on it: the sources need them as much as this process does)
    inherited = os.environ.get("PYTHONPATH")
    env = clean_env(MX_SERVER_URL=server.url, MX_SERVER_TOKEN=server.token or "",
                    MX_IPC_DIR=ipc, MX_HEARTBEAT_INTERVAL_S="1",
                    PYTHONPATH=os.pathsep.join(p for p in (pythonpath, inherited) if p))
    procs = {name: ModuleProcess(list(argv), tmp / f"{name}.log", env)
             for name, argv in commands.items()}
    try:
        yield server, ipc, {name: p.json_line(ready_s)["source_id"] for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()
        server.stop()
        shutil.rmtree(ipc, ignore_errors=True)
