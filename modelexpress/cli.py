"""The `modelexpress` command line. Entry point: :func:`main`.

Each command is a thin layer: it reads :class:`MxSettings`, configures logging
(the library never does) and calls into the package. Commands of the server,
P2P and demo parts are registered below from their own modules.
"""

from __future__ import annotations

import json
import logging
import sys

import typer

from modelexpress.settings import MxSettings

__all__ = ["app", "main"]

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Peer-to-peer weight transfer for LLM inference over NIXL.")


@app.callback()
def _root() -> None:
    """Peer-to-peer weight transfer for LLM inference over NIXL."""


def configure_logging(settings: MxSettings) -> None:
    """Entry-point logging setup (stderr, one line per record)."""
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Check what this machine can do; exit 1 when something required is broken."""
    from modelexpress.doctor import render, run_checks

    configure_logging(MxSettings())
    results, healthy = run_checks()
    if as_json:
        typer.echo(json.dumps({"healthy": healthy,
                               "checks": [r.__dict__ for r in results]}))
    else:
        typer.echo(render(results))
        typer.echo("healthy" if healthy else "something required is broken (see FAIL lines)")
    raise typer.Exit(0 if healthy else 1)


@app.command()
def serve(
    host: str = typer.Option(None, "--host", help="bind address (default MX_SERVER_HOST)"),
    port: int = typer.Option(None, "--port", help="bind port (default MX_SERVER_PORT)"),
    store: str = typer.Option(None, "--store",
                              help="sqlite:///PATH or redis://HOST:PORT/DB (default MX_STORE)"),
) -> None:
    """Run the control-plane server (REST API, /metrics) under uvicorn."""
    from modelexpress.server.serve import serve as run_server

    overrides = {k: v for k, v in (("server_host", host), ("server_port", port),
                                   ("store", store)) if v is not None}
    settings = MxSettings(**overrides)
    configure_logging(settings)
    run_server(settings)


def _register_commands() -> None:
    from modelexpress.p2p.cli import register as register_p2p

    register_p2p(app)


_register_commands()


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
