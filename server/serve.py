"""Run the control plane under uvicorn: ``modelexpress serve`` and ``python -m modelexpress.server``."""

from __future__ import annotations

import argparse
import logging
import sys

from modelexpress.settings import MxSettings

__all__ = ["serve", "main"]

log = logging.getLogger(__name__)


def serve(settings: MxSettings) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn handles both and shuts down gracefully).

    Args:
        settings: host, port, store URL, token and timeouts.

    Raises:
        DependencyError: the ``server`` extra (fastapi, uvicorn) is missing.
        StoreError: the store cannot be opened.
    """
    from modelexpress._optional import require

    uvicorn = require("uvicorn", "modelexpress serve")
    from modelexpress.server.app import create_app

    app = create_app(settings)
    log.info("serving on http://%s:%d (store %s)", settings.server_host,
             settings.server_port, settings.store.split("@")[-1])
    # One process: the SQLite store allows one writer process anyway; scale out with
    # replicas on Redis. Access logs off: one line per heartbeat drowns everything.
    uvicorn.run(app, host=settings.server_host, port=settings.server_port,
                log_level=settings.log_level.lower(), access_log=False,
                timeout_graceful_shutdown=5)


def main(argv: list[str] | None = None) -> None:
    """``python -m modelexpress.server [--host H] [--port P] [--store URL]``."""
    parser = argparse.ArgumentParser(prog="python -m modelexpress.server",
                                     description="modelexpress control plane")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--store", help="sqlite:///PATH or redis://HOST:PORT/DB")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("server_host", args.host), ("server_port", args.port),
                                   ("store", args.store)) if v is not None}
    settings = MxSettings(**overrides)
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(settings)
