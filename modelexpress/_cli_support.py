"""Plumbing shared by every ``modelexpress`` command: logging, settings from flags,
failures, exit codes, signals and progress.

Command modules (``cli.py``, ``p2p/cli.py``, ``demo.py``) import this module and
never each other, so there is no import cycle between them.

A failure ends the command with ONE line on stderr, last (``error: what was wrong,
which input, what to do``), and an exit code from :class:`ExitCode`; with ``--json``
the same message is also printed on stdout as ``{"ok": false, "error": ...}``.
Tracebacks only with ``--debug`` or ``MX_LOG_LEVEL=DEBUG``.

Signals: outside a long operation SIGINT and SIGTERM raise :class:`Interrupted`
(SIGTERM would otherwise kill the process without any cleanup); inside one
(:func:`stop_on_signals`) they set an event the operation honours at its next
chunk, and a second signal interrupts at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno as errno_codes
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn

from modelexpress.errors import (AuthError, CheckpointError, ConfigError, DependencyError,
                                 MxError, NoSourceError, OutputError, OutputExistsError,
                                 ServerUnavailableError, TransferCancelledError)

if TYPE_CHECKING:
    from modelexpress.settings import MxSettings

__all__ = [
    "ExitCode",
    "EXIT_CODES_HELP",
    "Interrupted",
    "StopOnSignals",
    "configure_logging",
    "settings_from_flags",
    "stop_on_signals",
    "raise_if_interrupted",
    "failure",
    "progress_bar",
    "follow_transfer",
    "process_age_s",
    "run_app",
]

log = logging.getLogger(__name__)


class ExitCode(enum.IntEnum):
    """What a ``modelexpress`` exit status means (docs/DEPLOYMENT.md, "Exit codes")."""

    OK = 0
    FAILED = 1          # the operation failed (transfer, integrity, full disk, ...)
    BAD_INPUT = 2       # a flag, setting, file or output the user gave is wrong
    CONTROL_PLANE = 3   # the server is unreachable or refused the token
    NO_SOURCE = 4       # no READY source serves the model
    INTERRUPTED = 130   # SIGINT (Ctrl-C) before the command finished: 128 + 2
    TERMINATED = 143    # SIGTERM before the command finished: 128 + 15


EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 1 the operation failed; 2 bad usage or input (flag, setting, "
    "checkpoint file, existing output); 3 control plane unreachable or token refused; "
    "4 no READY source; 130 interrupted by SIGINT; 143 by SIGTERM. publish, agent and "
    "serve stop cleanly on SIGINT/SIGTERM once running (exit 0). A failure prints one "
    "line on stderr; --debug (or MX_LOG_LEVEL=DEBUG) adds the traceback.")

# Settings fields a command sets from a flag (for the message of a bad value).
_FLAG_OF = {"server_url": "--server", "server_host": "--host", "server_port": "--port",
            "store": "--store"}


@dataclasses.dataclass
class _State:
    """Per-process CLI state; set by the root callback and the commands."""

    debug: bool = False
    as_json: bool = False
    server_url: str | None = None
    signum: int | None = None  # the signal that asked an operation to stop


_state = _State()


class Interrupted(BaseException):
    """SIGINT or SIGTERM ended the command (a BaseException, like KeyboardInterrupt,
    so ``except Exception`` in library code does not swallow it)."""

    def __init__(self, signum: int, what: str = "") -> None:
        super().__init__(signum, what)
        self.signum = signum
        self.what = what


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


def set_debug(debug: bool) -> None:
    """``--debug``: tracebacks with failures, DEBUG logging."""
    _state.debug = _state.debug or debug


def _debugging() -> bool:
    return _state.debug or os.environ.get("MX_LOG_LEVEL", "").upper() == "DEBUG"


def configure_logging(settings: "MxSettings") -> None:
    """Entry-point logging setup (stderr, one line per record)."""
    level = "DEBUG" if _state.debug else settings.log_level
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "DEBUG":
        # httpx logs every request at INFO: a progress poll would drown the output
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


def settings_from_flags(*, as_json: bool = False, **flags: Any) -> "MxSettings":
    """:class:`MxSettings` from the environment with the given flags on top (None:
    not given), logging configured.

    Raises:
        ConfigError: a flag or ``MX_*`` value is invalid; names the flag or variable,
            the value and what is accepted.
    """
    from modelexpress.settings import MxSettings

    _state.as_json = as_json
    settings = MxSettings.load(names=_FLAG_OF, **flags)
    _state.server_url = settings.server_url
    configure_logging(settings)
    return settings


class StopOnSignals(threading.Event):
    """Set by SIGINT/SIGTERM; ``signum`` says which arrived first."""

    signum: int | None = None


@contextlib.contextmanager
def stop_on_signals(interrupted: str | None = None) -> Iterator[StopOnSignals]:
    """An event set by SIGTERM/SIGINT, so a long operation stops at a clean point.

    A second signal raises :class:`Interrupted` at once (a stuck stop can be forced).

    Args:
        interrupted: when given, a signal makes the block end in :class:`Interrupted`
            with this text (whether the operation then finished, failed or honoured
            the stop); when None (a service, for which a signal is the normal end)
            the caller reads ``stop``.
    """
    stop = StopOnSignals()

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            _raise_interrupted(signum, frame)
        stop.signum = _state.signum = signum
        log.warning("%s: stopping at the next clean point (send it again to force)",
                    signal.Signals(signum).name)
        stop.set()

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    except Exception as exc:
        if interrupted is not None and stop.signum is not None:
            raise Interrupted(stop.signum, interrupted) from exc  # e.g. the stop honoured
        raise
    finally:
        for sig, prev in old.items():
            signal.signal(sig, prev)
    if interrupted is not None:
        raise_if_interrupted(stop, interrupted)


def raise_if_interrupted(stop: StopOnSignals, what: str) -> None:
    """After an operation: raise :class:`Interrupted` when a signal asked it to stop."""
    if stop.signum is not None:
        raise Interrupted(stop.signum, what)


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _os_error_line(exc: OSError) -> tuple[int, str]:
    where = f" {exc.filename}" if exc.filename else ""
    code = ExitCode.FAILED if exc.errno == errno_codes.ENOSPC else ExitCode.BAD_INPUT
    return code, f"{exc.strerror or exc}:{where}"


def failure(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one line that report ``exc``."""
    if isinstance(exc, Interrupted) or (isinstance(exc, TransferCancelledError)
                                        and _state.signum is not None):
        signum = exc.signum if isinstance(exc, Interrupted) else _state.signum
        assert signum is not None
        name = signal.Signals(signum).name
        what = exc.what if isinstance(exc, Interrupted) and exc.what else \
            "the command stopped before it finished"
        code = ExitCode.INTERRUPTED if signum == signal.SIGINT else ExitCode.TERMINATED
        return code, f"interrupted by {name}: {what}"
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED, "interrupted by SIGINT: the command stopped before it finished"
    if isinstance(exc, NoSourceError):
        return ExitCode.NO_SOURCE, (f"{exc}; `modelexpress sources list` shows what is served, "
                                    "`modelexpress publish` serves a checkpoint")
    if isinstance(exc, ServerUnavailableError):
        url = _state.server_url or "MX_SERVER_URL"
        return ExitCode.CONTROL_PLANE, (f"control plane at {url} unreachable ({exc}); is "
                                        "`modelexpress serve` running there? pass --server "
                                        "or set MX_SERVER_URL")
    if isinstance(exc, AuthError):
        return ExitCode.CONTROL_PLANE, str(exc)
    if isinstance(exc, OutputExistsError):
        return ExitCode.BAD_INPUT, str(exc)
    if isinstance(exc, OutputError):
        code = ExitCode.FAILED if exc.errno in (errno_codes.ENOSPC, errno_codes.EIO, None) \
            else ExitCode.BAD_INPUT
        return code, str(exc)
    if isinstance(exc, (ConfigError, CheckpointError)):
        return ExitCode.BAD_INPUT, str(exc)
    if isinstance(exc, DependencyError):  # says which extra to install
        return ExitCode.FAILED, str(exc)
    if isinstance(exc, MxError):  # a subclass's name says what failed (ConflictError, ...)
        return ExitCode.FAILED, str(exc) if type(exc) is MxError else f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError):
        return _os_error_line(exc)
    return ExitCode.FAILED, (f"unexpected {type(exc).__name__}: {exc} (a bug: run with "
                             "--debug for the traceback and report it)")


def fail(exc: BaseException) -> NoReturn:
    """Report ``exc`` (JSON on stdout with ``--json``; one line on stderr, last) and exit."""
    code, message = failure(exc)
    message = _one_line(message)
    if _debugging():
        traceback.print_exception(exc, file=sys.stderr)
    if _state.as_json:
        name = type(exc).__name__
        error = message if message.startswith(name) else f"{name}: {message}"
        print(json.dumps({"ok": False, "error": error, "exit_code": int(code)}), flush=True)
    logging.shutdown()  # flush handlers now: nothing may print after the line
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(int(code))


@contextlib.contextmanager
def progress_bar(enabled: bool, label: str) -> Iterator[Callable[[int, int | None], None]]:
    """A rich progress bar on stdout; yields ``update(done, total)``."""
    if not enabled:
        yield lambda done, total: None
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), transient=False) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def follow_transfer(client: Any, transfer_id: str, *, timeout_s: float, show: bool,
                    poll_s: float = 0.2, stop: threading.Event | None = None) -> Any:
    """Poll a transfer until it is SUCCEEDED, FAILED or STOPPED (or ``stop`` is set),
    with a progress bar. Returns the last record read.

    Raises:
        MxTimeoutError: still running after ``timeout_s``.
    """
    from modelexpress.errors import MxTimeoutError

    deadline = time.monotonic() + timeout_s
    with progress_bar(show, f"transfer {transfer_id[:8]}") as update:
        while True:
            t = client.get_transfer(transfer_id)
            update(t.bytes_done, t.bytes_total or None)
            if t.state in ("SUCCEEDED", "FAILED", "STOPPED") or (stop is not None
                                                                 and stop.is_set()):
                return t
            if time.monotonic() > deadline:
                raise MxTimeoutError(f"transfer {transfer_id} still {t.state} after {timeout_s} s")
            time.sleep(poll_s)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux ``/proc``), or None elsewhere.

    The part before a command's own clock starts: interpreter start and imports.
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def run_app(app: Any, argv: list[str] | None = None) -> NoReturn:
    """Run the typer ``app`` as the ``modelexpress`` command and exit with its code.

    ``--debug`` is accepted anywhere on the command line (moved before the command).
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_interrupted)
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:
        args = ["--debug", *(a for a in args if a != "--debug")]
    import typer

    try:  # newer typer vendors click as typer._click; older ones use click itself
        from typer._click import exceptions as click_exc
    except ImportError:
        from click import exceptions as click_exc  # type: ignore[no-redef]

    try:
        code = app(args=args, prog_name="modelexpress", standalone_mode=False)
    except SystemExit:
        raise
    except click_exc.UsageError as exc:
        if isinstance(exc, getattr(click_exc, "NoArgsIsHelpError", ())):
            exc.show()  # the help text, as asked for by giving no arguments
            raise SystemExit(ExitCode.BAD_INPUT) from None
        # click's own rendering (typer: a framed box) ends with a frame, not the problem
        command = exc.ctx.command_path if exc.ctx is not None else "modelexpress"
        sys.stderr.write(f"{exc.ctx.get_usage() if exc.ctx is not None else ''}\n")
        sys.stderr.write(f"error: {_one_line(exc.format_message())} (see `{command} "
                         "--help`)\n")
        raise SystemExit(ExitCode.BAD_INPUT) from None
    except click_exc.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except typer.Abort:
        fail(Interrupted(signal.SIGINT))
    except BaseException as exc:  # noqa: BLE001 - the one place every failure is reported
        fail(exc)
    raise SystemExit(code if isinstance(code, int) else 0)
