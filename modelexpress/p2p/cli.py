"""CLI commands of P2P serving: publish, pull, agent, sources, transfers.

Each command builds :class:`MxSettings` (flags override it), configures logging and
calls the library. ``--json`` prints one JSON object for scripts; the exit code is 0
only on success. Registered on the main app by :func:`register`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import signal
import threading
import time
from typing import Any, Iterator, Optional

import typer

from modelexpress.errors import MxError
from modelexpress.identity import ModelIdentity
from modelexpress.settings import MxSettings

__all__ = ["register"]

log = logging.getLogger(__name__)

SERVER = typer.Option(None, "--server", help="control-plane URL (default MX_SERVER_URL)")
JSON = typer.Option(False, "--json", help="print one JSON object instead of text")

sources_app = typer.Typer(no_args_is_help=True, help="List published sources.")
transfers_app = typer.Typer(no_args_is_help=True,
                            help="Start, stop, restart and list REST transfers.")


def _settings(server: str | None) -> MxSettings:
    from modelexpress.cli import configure_logging

    settings = MxSettings(**({"server_url": server} if server else {}))
    configure_logging(settings)
    return settings


def _client(settings: MxSettings):  # noqa: ANN202
    from modelexpress.client import MxClient

    return MxClient.from_settings(settings)


def _fail(exc: Exception, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
    else:
        typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(1)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """An event set by SIGTERM/SIGINT, so long-running commands shut down cleanly."""
    stop = threading.Event()
    handler = lambda *_: stop.set()  # noqa: E731
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, prev in old.items():
            signal.signal(sig, prev)


def _identity(model: str, revision: str, dtype: str, quantization: str, tp: int, pp: int,
              ep: int, rank: int) -> ModelIdentity:
    return ModelIdentity(model=model, revision=revision, dtype=dtype, quantization=quantization,
                         tp_size=tp, pp_size=pp, ep_size=ep, rank=rank)


def _dominant_dtype(tensors: dict[str, Any]) -> str:
    sizes: dict[str, int] = {}
    for t in tensors.values():
        name = str(t.dtype).removeprefix("torch.")
        sizes[name] = sizes.get(name, 0) + t.numel() * t.element_size()
    return max(sizes, key=sizes.__getitem__) if sizes else "unknown"


def _device_index(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


@contextlib.contextmanager
def _progress_bar(enabled: bool, label: str) -> Iterator[Any]:
    """A rich progress bar; yields ``update(done, total)``."""
    if not enabled:
        yield lambda done, total: None
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), transient=False) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def publish(
    checkpoint: pathlib.Path = typer.Argument(..., help="safetensors checkpoint directory or file"),
    model: str = typer.Option(..., "--model", help="model name (part of the identity)"),
    revision: str = typer.Option("main", "--revision"),
    dtype: str = typer.Option("auto", "--dtype",
                              help="identity dtype; auto: the checkpoint's dominant dtype"),
    quantization: str = typer.Option("none", "--quantization"),
    tp: int = typer.Option(1, "--tp"), pp: int = typer.Option(1, "--pp"),
    ep: int = typer.Option(1, "--ep"), rank: int = typer.Option(0, "--rank"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda:N"),
    contiguous: bool = typer.Option(
        True, "--contiguous/--separate",
        help="load into one allocation (one NIXL region, one IPC handle) or one per tensor"),
    worker_id: Optional[str] = typer.Option(None, "--worker-id"),
    duration: float = typer.Option(0.0, "--duration",
                                   help="serve this many seconds, then exit (0: until SIGTERM)"),
    server: Optional[str] = SERVER, as_json: bool = JSON,
) -> None:
    """Load a checkpoint and serve it to peers until SIGTERM (then withdraw: STALE)."""
    from modelexpress.checkpoint import load_checkpoint
    from modelexpress.p2p.source import serve_source

    settings = _settings(server)
    arena = None
    try:
        with _stop_on_signals() as stop, contextlib.ExitStack() as stack:
            t0 = time.perf_counter()
            if settings.vmm_arena and device == "cpu":
                from modelexpress.vmm import HostVmmBackend, VmmArena
                arena = stack.enter_context(VmmArena(settings.vmm_arena_bytes, 0,
                                                     HostVmmBackend()))
                tensors = load_checkpoint(checkpoint, arena=arena)
            else:
                from modelexpress.vmm import maybe_enter_vmm_arena
                with maybe_enter_vmm_arena(settings.vmm_arena and device != "cpu",
                                           _device_index(device),
                                           settings.vmm_arena_bytes) as arena:
                    tensors = load_checkpoint(checkpoint, device=device,
                                              contiguous=contiguous and arena is None)
                if arena is not None:
                    # closed after the source withdrew (ExitStack unwinds in reverse)
                    stack.callback(arena.close)
            load_s = time.perf_counter() - t0
            identity = _identity(model, revision,
                                 _dominant_dtype(tensors) if dtype == "auto" else dtype,
                                 quantization, tp, pp, ep, rank)
            client = stack.enter_context(_client(settings))
            handle = stack.enter_context(serve_source(
                identity, tensors, client=client, arena=arena, worker_id=worker_id,
                heartbeat_interval_s=settings.heartbeat_interval_s,
                single_region=settings.arena_single_mr, guardian=True,
                backend=settings.nixl_backend))
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            summary = {"ok": True, "source_id": handle.source_id, "worker_id": handle.worker_id,
                       "identity": identity.to_dict(), "tensors": len(tensors), "bytes": nbytes,
                       "load_seconds": round(load_s, 3),
                       "registration": handle.registration.strategy}
            typer.echo(json.dumps(summary) if as_json else
                       f"serving {model} ({len(tensors)} tensors, {nbytes / 1e9:.3f} GB) as source "
                       f"{handle.source_id}; loaded in {load_s:.2f} s; SIGTERM or Ctrl-C to stop")
            deadline = time.monotonic() + duration if duration > 0 else None
            while not stop.wait(0.5):
                if handle.failure is not None:
                    raise MxError(f"source withdrew itself: {handle.failure}")
                if deadline is not None and time.monotonic() > deadline:
                    break
    except MxError as exc:
        _fail(exc, as_json)


def pull(
    model: str = typer.Option(..., "--model"),
    out: pathlib.Path = typer.Option(..., "--out", help="directory for the safetensors output"),
    revision: str = typer.Option("main", "--revision"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="default: the sources' dtype"),
    quantization: Optional[str] = typer.Option(None, "--quantization"),
    tp: int = typer.Option(1, "--tp"), pp: int = typer.Option(1, "--pp"),
    ep: int = typer.Option(1, "--ep"), rank: int = typer.Option(0, "--rank"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda:N"),
    stripe: int = typer.Option(1, "--stripe", help="read from up to N sources at once"),
    policy: Optional[str] = typer.Option(None, "--policy", help="random or spread"),
    server: Optional[str] = SERVER, as_json: bool = JSON,
) -> None:
    """Pull a model's weights from READY peers and write them as safetensors."""
    from modelexpress.checkpoint import save_checkpoint
    from modelexpress.p2p.target import pull as do_pull

    settings = _settings(server)
    try:
        with _client(settings) as client, _stop_on_signals() as stop:
            identity = _resolve_identity(client, model, revision, dtype, quantization,
                                         tp, pp, ep, rank)
            holder: dict[str, Any] = {}
            with _progress_bar(not as_json, f"pull {model}") as update:
                result = do_pull(identity, None, client=client, device=device,
                                 timeout_s=settings.transfer_timeout_s,
                                 verify=settings.verify_digests, progress=update, stop=stop,
                                 policy=policy or settings.source_policy,
                                 max_attempts=settings.max_source_attempts, stripe=stripe,
                                 chunk_bytes=settings.transfer_chunk_bytes,
                                 refuse_slow_transport=settings.refuse_slow_transport,
                                 max_gbps=settings.transfer_max_gbps,
                                 backend=settings.nixl_backend,
                                 on_destination=holder.update)
            files = save_checkpoint(holder, out)
    except MxError as exc:
        _fail(exc, as_json)
    summary = {"ok": True, **result.to_dict(), "out": [str(f) for f in files]}
    typer.echo(json.dumps(summary) if as_json else
               f"pulled {result.bytes / 1e9:.3f} GB ({result.tensors} tensors) from "
               f"{', '.join(result.source_ids)} in {result.seconds:.2f} s "
               f"({result.gbps:.2f} GB/s over {result.transport}); wrote {len(files)} file(s) "
               f"to {out}; transfer {result.transfer_id}")


def _resolve_identity(client: Any, model: str, revision: str, dtype: str | None,
                      quantization: str | None, tp: int, pp: int, ep: int,
                      rank: int) -> ModelIdentity:
    """The identity to pull: given fields, the rest taken from READY sources of ``model``."""
    if dtype is not None and quantization is not None:
        return _identity(model, revision, dtype, quantization, tp, pp, ep, rank)
    found = {}
    for s in client.list_sources(model=model, revision=revision, state="READY", rank=rank):
        ident = s.model_identity
        if (ident.tp_size, ident.pp_size, ident.ep_size) != (tp, pp, ep):
            continue
        if dtype is not None and ident.dtype != dtype:
            continue
        if quantization is not None and ident.quantization != quantization:
            continue
        found[ident.id] = ident
    if len(found) == 1:
        return next(iter(found.values()))
    if not found:
        from modelexpress.errors import NoSourceError
        raise NoSourceError(f"no READY source for {model} (revision {revision}, rank {rank}, "
                            f"tp={tp} pp={pp} ep={ep})")
    options = ", ".join(f"dtype={i.dtype} quantization={i.quantization}" for i in found.values())
    raise MxError(f"several identities of {model} are served ({options}); "
                  "pass --dtype and --quantization")


def agent(
    agent_id: Optional[str] = typer.Option(None, "--id", help="agent id (default: generated)"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda:N"),
    out: Optional[pathlib.Path] = typer.Option(
        None, "--out", help="write each finished transfer to OUT/<transfer id>/"),
    serve_after: Optional[bool] = typer.Option(
        None, "--serve/--no-serve", help="serve finished pulls onward (default MX_SERVE_AFTER_PULL)"),
    chunk_bytes: Optional[int] = typer.Option(None, "--chunk-bytes"),
    max_gbps: Optional[float] = typer.Option(None, "--max-gbps"),
    max_transfers: Optional[int] = typer.Option(None, "--max-transfers",
                                                help="exit after this many transfers"),
    server: Optional[str] = SERVER,
) -> None:
    """Run a worker that executes transfers started through the REST API."""
    from modelexpress.p2p.agent import Agent, AgentOptions

    settings = _settings(server)
    flags = {"serve_after_pull": serve_after, "chunk_bytes": chunk_bytes or None,
             "max_gbps": max_gbps}
    options = AgentOptions.from_settings(
        settings, device=device, out_dir=out,
        **{name: value for name, value in flags.items() if value is not None})
    try:
        with _client(settings) as client, _stop_on_signals() as stop, \
                Agent(client, agent_id, options) as worker:
            typer.echo(f"agent {worker.agent_id} waiting for transfers (device {device})")
            worker.run(stop, max_transfers=max_transfers)
            failed = [t for t, s in worker.finished.items() if s == "FAILED"]
    except MxError as exc:
        _fail(exc, False)
    raise typer.Exit(1 if failed else 0)


@sources_app.command("list")
def sources_list(
    model: Optional[str] = typer.Option(None, "--model"),
    state: Optional[str] = typer.Option(None, "--state", help="INITIALIZING, READY or STALE"),
    rank: Optional[int] = typer.Option(None, "--rank"),
    server: Optional[str] = SERVER, as_json: bool = JSON,
) -> None:
    """List published sources."""
    settings = _settings(server)
    try:
        with _client(settings) as client:
            rows = client.list_sources(model=model, state=state, rank=rank)
    except MxError as exc:
        _fail(exc, as_json)
    if as_json:
        typer.echo(json.dumps({"ok": True, "sources": [
            {"id": s.id, "model": s.identity.get("model"), "rank": s.identity.get("rank"),
             "state": s.state, "worker_id": s.worker_id, "endpoint": s.endpoint,
             "last_heartbeat": s.last_heartbeat} for s in rows]}))
        return
    for s in rows:
        typer.echo(f"{s.id}  {s.state:<12} {s.identity.get('model')} rank={s.identity.get('rank')} "
                   f"dtype={s.identity.get('dtype')} worker={s.worker_id}")


def _transfer_json(t: Any) -> dict[str, Any]:
    import dataclasses
    return dataclasses.asdict(t)


def _print_transfer(t: Any) -> None:
    pct = 100.0 * t.bytes_done / t.bytes_total if t.bytes_total else 0.0
    typer.echo(f"{t.id}  {t.state:<10} {pct:5.1f}%  {t.bytes_done}/{t.bytes_total} B  "
               f"{t.rate_bps / 1e9:.2f} GB/s  target={t.target_worker} source={t.source_id}"
               + (f"  error={t.error}" if t.error else ""))


@transfers_app.command("list")
def transfers_list(
    state: Optional[str] = typer.Option(None, "--state"),
    target: Optional[str] = typer.Option(None, "--target"),
    server: Optional[str] = SERVER, as_json: bool = JSON,
) -> None:
    """List transfers."""
    settings = _settings(server)
    try:
        with _client(settings) as client:
            rows = client.list_transfers(state=state, target_worker=target)
    except MxError as exc:
        _fail(exc, as_json)
    if as_json:
        typer.echo(json.dumps({"ok": True, "transfers": [_transfer_json(t) for t in rows]}))
        return
    for t in rows:
        _print_transfer(t)


@transfers_app.command("start")
def transfers_start(
    target: str = typer.Option(..., "--target", help="agent id that runs the transfer"),
    identity_id: Optional[str] = typer.Option(None, "--identity", help="identity id"),
    model: Optional[str] = typer.Option(None, "--model", help="or: model (+ --rank ...)"),
    revision: str = typer.Option("main", "--revision"),
    dtype: Optional[str] = typer.Option(None, "--dtype"),
    quantization: Optional[str] = typer.Option(None, "--quantization"),
    tp: int = typer.Option(1, "--tp"), pp: int = typer.Option(1, "--pp"),
    ep: int = typer.Option(1, "--ep"), rank: int = typer.Option(0, "--rank"),
    source: Optional[str] = typer.Option(None, "--source", help="source id (default: server picks)"),
    wait: bool = typer.Option(False, "--wait", help="follow progress until it finishes"),
    timeout: float = typer.Option(3600.0, "--timeout", help="--wait gives up after this"),
    server: Optional[str] = SERVER, as_json: bool = JSON,
) -> None:
    """Start a transfer to an agent; with --wait, show progress until it finishes."""
    settings = _settings(server)
    try:
        with _client(settings) as client:
            if identity_id is None:
                if model is None:
                    raise MxError("pass --identity or --model")
                identity_id = _resolve_identity(client, model, revision, dtype, quantization,
                                                tp, pp, ep, rank).id
            t = client.start_transfer(identity_id, target, source_id=source)
            if wait:
                t = follow_transfer(client, t.id, timeout_s=timeout, show=not as_json)
    except MxError as exc:
        _fail(exc, as_json)
    if as_json:
        typer.echo(json.dumps({"ok": not wait or t.state == "SUCCEEDED", **_transfer_json(t)}))
    else:
        _print_transfer(t)
    raise typer.Exit(0 if not wait or t.state == "SUCCEEDED" else 1)


def follow_transfer(client: Any, transfer_id: str, *, timeout_s: float, show: bool,
                    poll_s: float = 0.2) -> Any:
    """Poll a transfer until it is SUCCEEDED, FAILED or STOPPED, with a progress bar.

    Raises:
        MxTimeoutError: still running after ``timeout_s``.
    """
    from modelexpress.errors import MxTimeoutError

    deadline = time.monotonic() + timeout_s
    with _progress_bar(show, f"transfer {transfer_id[:8]}") as update:
        while True:
            t = client.get_transfer(transfer_id)
            update(t.bytes_done, t.bytes_total or None)
            if t.state in ("SUCCEEDED", "FAILED", "STOPPED"):
                return t
            if time.monotonic() > deadline:
                raise MxTimeoutError(f"transfer {transfer_id} still {t.state} after {timeout_s} s")
            time.sleep(poll_s)


@transfers_app.command("get")
def transfers_get(transfer_id: str, server: Optional[str] = SERVER, as_json: bool = JSON) -> None:
    """Show one transfer."""
    _one(lambda c: c.get_transfer(transfer_id), server, as_json)


@transfers_app.command("stop")
def transfers_stop(transfer_id: str, server: Optional[str] = SERVER, as_json: bool = JSON) -> None:
    """Ask a transfer to stop at its next chunk."""
    _one(lambda c: c.stop_transfer(transfer_id), server, as_json)


@transfers_app.command("restart")
def transfers_restart(transfer_id: str, server: Optional[str] = SERVER,
                      as_json: bool = JSON) -> None:
    """Put a STOPPED or FAILED transfer back to PENDING."""
    _one(lambda c: c.restart_transfer(transfer_id), server, as_json)


def _one(call: Any, server: str | None, as_json: bool) -> None:
    settings = _settings(server)
    try:
        with _client(settings) as client:
            t = call(client)
    except MxError as exc:
        _fail(exc, as_json)
    if as_json:
        typer.echo(json.dumps({"ok": True, **_transfer_json(t)}))
    else:
        _print_transfer(t)


def demo(
    synthetic_layers: int = typer.Option(
        0, "--synthetic-layers",
        help="serve N generated Llama-3-8B-shaped layers instead of the real MiniLM model"),
    workdir: Optional[pathlib.Path] = typer.Option(None, "--workdir",
                                                   help="keep logs and outputs here"),
    as_json: bool = JSON,
) -> None:
    """End-to-end demo on loopback: server, source, agent, REST transfer, verification."""
    import dataclasses

    from modelexpress.demo import run_demo

    result = run_demo(workdir=workdir, synthetic_layers=synthetic_layers,
                      keep=workdir is not None)
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(result)))
    else:
        gb = result.bytes / 1e9
        typer.echo(
            f"\nsummary: {result.model}\n"
            f"  transfer    {result.transfer_state}: {result.bytes / 1e6:.1f} MB, "
            f"{result.tensors} tensors in {result.transfer_seconds:.3f} s "
            f"REST start to finish (data plane {result.transfer_gbps:.2f} GB/s)\n"
            f"  verified    {'every tensor byte-for-byte' if not result.mismatched else 'MISMATCH: ' + ', '.join(result.mismatched[:5])}\n"
            f"  from disk   the same checkpoint into memory: warm page cache "
            f"{result.disk_warm_seconds:.3f} s ({gb / result.disk_warm_seconds:.2f} GB/s), cold "
            f"{result.disk_cold_seconds:.3f} s ({gb / result.disk_cold_seconds:.2f} GB/s)\n"
            f"  shutdown    exit codes {result.exit_codes}"
            + (" (uvicorn re-raises SIGTERM after its graceful shutdown)"
               if result.exit_codes.get("server") == -15 else ""))
    raise typer.Exit(0 if result.ok else 1)


def register(app: typer.Typer) -> None:
    """Add the P2P commands to the main CLI app."""
    app.command()(demo)
    app.command()(publish)
    app.command()(pull)
    app.command()(agent)
    app.add_typer(sources_app, name="sources")
    app.add_typer(transfers_app, name="transfers")
