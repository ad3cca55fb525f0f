"""Run the control plane under uvicorn: ``modelexpress serve`` and ``python -m modelexpress.server``.

A failure to start ends with one line on stderr and an exit code, no traceback
(unless ``MX_LOG_LEVEL=DEBUG``):

====  =====================================================================
2     a bad setting or flag (``MX_STORE=mysql://x``, ``--port 70000``), or the
      address cannot be bound (port in use, address not on this host)
1     the store cannot be opened (Redis down, SQLite file unwritable), or the
      server failed to start for another reason
====  =====================================================================

We bind the listening socket ourselves and hand it to uvicorn: a port in use is then
our error with our message, raised before uvicorn starts, instead of uvicorn's log
line and ``sys.exit(1)`` (and there is no window between a check and uvicorn's bind).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
import traceback

from modelexpress.errors import ConfigError, MxError, StoreError
from modelexpress.settings import MxSettings

__all__ = ["serve", "main", "listen_socket"]

log = logging.getLogger(__name__)

# The flags of ``python -m modelexpress.server``, to name them in messages.
_FLAGS = {"server_host": "--host", "server_port": "--port", "store": "--store"}


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (uvicorn listens on it).

    Raises:
        ConfigError: the port is in use, or the address is not this host's.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As uvicorn does: a port left in TIME_WAIT by a previous server is not "in use".
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is in use (another server?); pass "
                              "--port or set MX_SERVER_PORT to a free port") from exc
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}; pass --host / "
                          "--port (MX_SERVER_HOST / MX_SERVER_PORT)") from exc
    sock.set_inheritable(True)
    return sock


def serve(settings: MxSettings) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn handles both and shuts down gracefully).

    Args:
        settings: host, port, store URL, token and timeouts.

    Raises:
        ConfigError: the address cannot be bound (port in use, ...).
        DependencyError: the ``server`` extra (fastapi, uvicorn) is missing.
        StoreError: the store cannot be opened.
        MxError: uvicorn did not start (its log says why).
    """
    from modelexpress._optional import require

    uvicorn = require("uvicorn", "modelexpress serve")
    from modelexpress.server.app import create_app

    sock = listen_socket(settings.server_host, settings.server_port)
    try:
        app = create_app(settings)
        log.info("serving on http://%s:%d (store %s)", settings.server_host,
                 sock.getsockname()[1], settings.store.split("@")[-1])
        # One process: the SQLite store allows one writer process anyway; scale out with
        # replicas on Redis. Access logs off: one line per heartbeat drowns everything.
        config = uvicorn.Config(app, host=settings.server_host, port=settings.server_port,
                                log_level=settings.log_level.lower(), access_log=False,
                                timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        server.run(sockets=[sock])
        if not server.started and not server.should_exit:
            raise MxError(f"the server on {settings.server_host}:{settings.server_port} did "
                          "not start (see the log lines above)")
    finally:
        sock.close()


def _debugging() -> bool:
    return os.environ.get("MX_LOG_LEVEL", "").strip().upper() == "DEBUG"


def _fail(exc: BaseException, code: int) -> None:
    if _debugging():
        traceback.print_exception(exc, file=sys.stderr)
    print(f"python -m modelexpress.server: error: {exc}", file=sys.stderr, flush=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """``python -m modelexpress.server [--host H] [--port P] [--store URL]``.

    Exits 2 on a bad setting, flag or address, 1 when the store cannot be opened (one
    line on stderr; the traceback too with ``MX_LOG_LEVEL=DEBUG``).
    """
    parser = argparse.ArgumentParser(prog="python -m modelexpress.server",
                                     description="modelexpress control plane")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--store", help="sqlite:///PATH or redis://HOST:PORT/DB")
    args = parser.parse_args(argv)
    try:
        settings = MxSettings.load(names=_FLAGS, server_host=args.host,
                                   server_port=args.port, store=args.store)
    except ConfigError as exc:
        _fail(exc, 2)
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(settings)
    except ConfigError as exc:
        _fail(exc, 2)
    except StoreError as exc:
        _fail(StoreError(f"{exc}; check that the store is up and reachable from here "
                         "(MX_STORE / --store)"), 1)
    except MxError as exc:
        _fail(exc, 1)
