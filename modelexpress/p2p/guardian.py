"""A source's guardian: a small process that withdraws the source when its owner dies.

A source marks itself STALE when it closes, but a process that is killed runs no
code: vLLM's shutdown SIGKILLs its workers (an OpenAI server stopped with SIGTERM does
so right away by default), the OOM killer and ``kill -9`` do the same. Until the
server's ``MX_STALE_AFTER_S`` passes, targets would then pick a source that cannot
serve, and fail on it.

So a source may start a guardian (``serve_source(..., guardian=True)``): a process
that reads its standard input, a pipe whose only writer is the source's process. The
kernel closes that pipe when the source's process ends, however it ends; the
guardian then marks the source STALE and exits. The guardian is not a descendant of
the source (it is re-parented to init at once) and has its own session: vLLM kills
its whole process tree at shutdown, and process-group signals do not reach it.

Limit: when the engine is PID 1 of its container, orphans are re-parented to it and
die with it. Run it under an init (``tini``, ``docker run --init``, or
``shareProcessNamespace: true`` in a pod); otherwise the server marks the source
STALE after ``MX_STALE_AFTER_S``. A source that closes
normally withdraws itself and tells the guardian so first (``closed`` on the pipe),
and the guardian exits without a request.

The guardian ignores SIGINT and SIGTERM: a signal sent to the whole process group
(Ctrl-C, a pod's termination) must not take it down before the source is gone.
It exits on its own right after. Its settings come as one JSON line on the pipe,
never on the command line (the token is a secret).

Protocol on the pipe (the command line is ``--source-id ID``, for ``ps``): ``{"server": URL, "token": TOKEN|null, "source_id": ID, "pid": PID}\\n``,
then ``closed\\n`` on a normal close, or end of file when the source's process died.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import IO

from modelexpress._closing import Closeable

__all__ = ["Guardian", "start_guardian"]

log = logging.getLogger(__name__)

_WITHDRAW_DEADLINE_S = 30.0


class Guardian(Closeable):
    """The source side of a guardian: holds the pipe's write end."""

    def __init__(self, pipe: IO[bytes], source_id: str) -> None:
        self._pipe = pipe
        self.source_id = source_id

    def close(self) -> None:
        """Tell the guardian the source withdrew itself; it exits without acting. Idempotent."""
        if self._pipe.closed:
            return
        try:
            self._pipe.write(b"closed\n")
            self._pipe.flush()
        except OSError:
            pass  # the guardian already exited
        finally:
            self._pipe.close()


def start_guardian(server_url: str, token: str | None, source_id: str) -> Guardian:
    """Start the guardian of ``source_id`` (see the module docstring).

    Args:
        server_url: the control plane the source was published on.
        token: its bearer token, or None.
        source_id: the source to withdraw when this process ends.

    Returns:
        A :class:`Guardian`; close it after withdrawing the source normally.

    Raises:
        OSError: the process could not be started.
    """
    # A shell starts the guardian in the background and exits: the guardian is then
    # nobody's descendant but init's (or the nearest subreaper's). vLLM's shutdown
    # SIGKILLs its whole process tree, and a guardian in that tree would die with the
    # worker it guards. ``trap ""`` makes it deaf to SIGINT/SIGTERM from its first
    # instruction (ignored signals stay ignored across exec; preexec_fn would be unsafe
    # in a process with threads). An asynchronous command's stdin is /dev/null unless
    # redirected, hence fd 3. The source id is on the command line so that ``ps``
    # shows which source a guardian watches; the token is not.
    script = ('trap "" INT TERM; exec 3<&0; '
              '"$0" -m modelexpress.p2p.guardian --source-id "$1" <&3 3<&- & exit 0')
    proc = subprocess.Popen(["/bin/sh", "-c", script, sys.executable, source_id],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=None, close_fds=True)
    assert proc.stdin is not None
    pipe = proc.stdin
    try:
        pipe.write(json.dumps({"server": server_url, "token": token, "source_id": source_id,
                               "pid": os.getpid()}).encode() + b"\n")
        pipe.flush()
        proc.wait(timeout=10.0)  # the shell only starts the guardian
    except BaseException:
        pipe.close()
        raise
    return Guardian(pipe, source_id)


def _withdraw(server_url: str, token: str | None, source_id: str) -> bool:
    from modelexpress.client import MxClient
    from modelexpress.errors import MxError, NotFoundError

    deadline = time.monotonic() + _WITHDRAW_DEADLINE_S
    with MxClient(server_url, token=token, timeout_s=5.0, retries=1) as client:
        while True:
            try:
                client.mark_stale(source_id)
                return True
            except NotFoundError:
                return True  # already collected
            except MxError as exc:
                if time.monotonic() > deadline:
                    log.error("guardian: could not mark source %s STALE within %.0f s: %s",
                              source_id, _WITHDRAW_DEADLINE_S, exc)
                    return False
                time.sleep(0.5)


def _main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.setsid()  # out of the source's process group and session too
    logging.basicConfig(level=logging.INFO, format="modelexpress guardian %(process)d: %(message)s")
    stdin = sys.stdin.buffer
    try:
        config = json.loads(stdin.readline())
        server, token, source_id = config["server"], config["token"], config["source_id"]
        owner = int(config.get("pid", os.getppid()))
    except (ValueError, KeyError, TypeError) as exc:
        log.error("guardian: bad configuration line: %s", exc)
        return 2
    # Blocks until the source says "closed" or its process is gone (end of file).
    line = stdin.readline()
    if line.strip() == b"closed":
        return 0
    log.info("source process %d ended without withdrawing source %s; marking it STALE",
             owner, source_id)
    return 0 if _withdraw(server, token, source_id) else 1


if __name__ == "__main__":
    sys.exit(_main())
