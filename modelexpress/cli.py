"""The `modelexpress` command line. Entry point: :func:`main`.

Each command is a thin layer: it builds :class:`MxSettings` from the environment and
its flags, and calls into the package. The shared plumbing (logging, settings from
flags, failures and exit codes, signals, progress) is :mod:`modelexpress._cli_support`;
the P2P commands live in :mod:`modelexpress.p2p.cli` and the demo in
:mod:`modelexpress.demo`, registered here. Neither imports this module.
"""

from __future__ import annotations

import json
import logging
import signal
from typing import Optional

import typer

from modelexpress import _cli_support as support
from modelexpress.errors import MxError

__all__ = ["app", "main"]

log = logging.getLogger(__name__)

# Typer's framed "rich" tracebacks are off: a failure is one line (see _cli_support),
# a traceback only with --debug.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Peer-to-peer weight transfer for LLM inference over NIXL.",
                  epilog=support.EXIT_CODES_HELP)


@app.callback()
def _root(debug: bool = typer.Option(
        False, "--debug", help="print tracebacks with failures and log at DEBUG")) -> None:
    """Peer-to-peer weight transfer for LLM inference over NIXL."""
    support.set_debug(debug)


@app.command(epilog=support.EXIT_CODES_HELP)
def doctor(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Check what this machine can do; exit 1 when something required is broken."""
    from modelexpress.doctor import render, run_checks

    support.settings_from_flags()  # --json: the report is the one JSON object, even failed
    results, healthy = run_checks()
    if as_json:
        typer.echo(json.dumps({"healthy": healthy,
                               "checks": [r.__dict__ for r in results]}))
    else:
        typer.echo(render(results))
        if healthy:
            typer.echo("healthy")
    if not healthy:
        failed = [r.name for r in results if r.status == "fail"]
        raise MxError(f"doctor: required check(s) failed: {', '.join(failed)}; the report "
                      "says why and what to install")


@app.command(epilog=support.EXIT_CODES_HELP)
def serve(
    host: Optional[str] = typer.Option(None, "--host",
                                       help="bind address (default MX_SERVER_HOST)"),
    port: Optional[int] = typer.Option(None, "--port", help="bind port (default MX_SERVER_PORT)"),
    store: Optional[str] = typer.Option(
        None, "--store", help="sqlite:///PATH or redis://HOST:PORT/DB (default MX_STORE)"),
) -> None:
    """Run the control-plane server (REST API, /metrics) under uvicorn until SIGTERM/SIGINT."""
    settings = support.settings_from_flags(server_host=host, server_port=port, store=store)
    from modelexpress.server.serve import serve as run_server

    try:
        run_server(settings)  # a port in use: ConfigError (it binds the socket itself)
    except support.Interrupted as exc:
        # uvicorn handles SIGTERM/SIGINT itself, shuts down gracefully, then re-raises
        # the signal to the previous handler (ours): a served server's normal end.
        log.info("server stopped by %s", signal.Signals(exc.signum).name)


def _register_commands() -> None:
    from modelexpress.demo import demo_command
    from modelexpress.p2p.cli import register as register_p2p

    app.command("demo", epilog=support.EXIT_CODES_HELP)(demo_command)
    register_p2p(app)


_register_commands()


def main() -> None:
    """Console-script entry point."""
    support.run_app(app)


if __name__ == "__main__":
    main()
