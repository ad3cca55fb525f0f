"""CLI commands of P2P serving: publish, pull, agent, sources, transfers.

Each command builds :class:`MxSettings` (flags override it) and calls the library.
``--json`` prints one JSON object for scripts. Failures, exit codes, signals and
progress bars are :mod:`modelexpress._cli_support`'s (a failure is one line on stderr
and an exit code from its table). Registered on the main app by :func:`register`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import re
import time
from typing import Any, Optional

import typer

from modelexpress import _cli_support as support
from modelexpress.errors import ConfigError, MxError
from modelexpress.identity import ModelIdentity
from modelexpress.settings import MxSettings

__all__ = ["register"]

log = logging.getLogger(__name__)

SERVER = typer.Option(None, "--server", help="control-plane URL (default MX_SERVER_URL)")
JSON = typer.Option(False, "--json", help="print one JSON object instead of text")

sources_app = typer.Typer(no_args_is_help=True, help="List published sources.",
                          epilog=support.EXIT_CODES_HELP, pretty_exceptions_enable=False)
transfers_app = typer.Typer(no_args_is_help=True,
                            help="Start, stop, restart and list REST transfers.",
                            epilog=support.EXIT_CODES_HELP, pretty_exceptions_enable=False)


def _settings(server: str | None, as_json: bool = False) -> MxSettings:
    return support.settings_from_flags(server_url=server, as_json=as_json)


def _client(settings: MxSettings):  # noqa: ANN202
    from modelexpress.client import MxClient

    return MxClient.from_settings(settings)


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


def _check_device(device: str) -> str:
    """``--device``: ``cpu`` or a CUDA device this host has.

    Raises:
        ConfigError: anything else; says what this host offers.
    """
    if device == "cpu":
        return device
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise ConfigError(f"--device {device!r} is not a device; use cpu or cuda:N")
    import torch  # only for a CUDA device: a CPU pull imports torch later, overlapped

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"--device {device}: this host has no CUDA device torch can use "
                          f"(torch {torch.__version__}); use --device cpu")
    if _device_index(device) >= count:
        raise ConfigError(f"--device {device}: this host has {count} CUDA device(s), "
                          f"cuda:0 to cuda:{count - 1}")
    return device


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
    """Load a checkpoint and serve it to peers until SIGTERM (then withdraw: STALE).

    A signal while loading ends it with 130/143; once serving, SIGTERM or Ctrl-C is
    its normal end (exit 0).
    """
    from modelexpress.checkpoint import checkpoint_files, load_checkpoint, load_checkpoint_shared
    from modelexpress.local import LocalOptions
    from modelexpress.p2p.source import serve_source

    settings = _settings(server, as_json)
    checkpoint_files(checkpoint)  # a bad path fails before the heavy imports
    _check_device(device)
    local = LocalOptions.from_settings(settings)
    arena = None
    buffers = []
    with support.stop_on_signals() as stop, contextlib.ExitStack() as stack:
        log.info("loading checkpoint %s", checkpoint)
        t0 = time.perf_counter()
        if local.enabled and device == "cpu" and contiguous and not settings.vmm_arena:
            # memfd-backed, so that peers on this host map it (the local transport)
            buf, tensors = load_checkpoint_shared(checkpoint)
            stack.callback(buf.close)  # after the source withdrew (reverse order)
            buffers.append(buf)
        elif settings.vmm_arena and device == "cpu":
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
        support.raise_if_interrupted(stop, f"publish of {checkpoint} stopped while loading; "
                                           "nothing was published")
        identity = _identity(model, revision,
                             _dominant_dtype(tensors) if dtype == "auto" else dtype,
                             quantization, tp, pp, ep, rank)
        client = stack.enter_context(_client(settings))
        handle = stack.enter_context(serve_source(
            identity, tensors, client=client, arena=arena, worker_id=worker_id,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            single_region=settings.vmm_arena_single_mr, guardian=True,
            backend=settings.nixl_backend, local=local, host_buffers=buffers))
        support.raise_if_interrupted(stop, f"publish of {checkpoint} stopped before it "
                                           "served; the source withdrew")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        summary = {"ok": True, "source_id": handle.source_id, "worker_id": handle.worker_id,
                   "identity": identity.to_dict(), "tensors": len(tensors), "bytes": nbytes,
                   "load_seconds": round(load_s, 3),
                   "registration": handle.registration.strategy,
                   "local_transport": handle.local.path if handle.local is not None else None}
        typer.echo(json.dumps(summary) if as_json else
                   f"serving {model} ({len(tensors)} tensors, {nbytes / 1e9:.3f} GB) as source "
                   f"{handle.source_id}; loaded in {load_s:.2f} s; SIGTERM or Ctrl-C to stop")
        deadline = time.monotonic() + duration if duration > 0 else None
        while not stop.wait(0.5):
            if handle.failure is not None:
                raise MxError(f"source withdrew itself: {handle.failure}")
            if deadline is not None and time.monotonic() > deadline:
                break


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
    overwrite: bool = typer.Option(
        False, "--overwrite", help="replace an existing non-empty --out directory"),
    from_: Optional[str] = typer.Option(
        None, "--from", metavar="URL",
        help="where the checkpoint is stored (s3://BUCKET/PREFIX or a directory; default "
             "MX_MODEL_STORAGE): with no READY peer, one pull becomes the origin (a lease "
             "on the control plane), reads it from there and serves it to the others"),
    layout: Optional[pathlib.Path] = typer.Option(
        None, "--layout",
        help="pull the rank of --tp/--rank this layout describes (JSON of python -m "
             "modelexpress.engines.vllm.derive) from sources of any parallel layout"),
    server: Optional[str] = SERVER, as_json: bool = JSON,
) -> None:
    """Pull a model's weights from READY peers and write them as safetensors.

    With --from (or MX_MODEL_STORAGE), a model no peer holds yet is read from storage
    once: the first pull takes the origin lease and reads it, pulls started meanwhile
    read from it and from each other (docs/DEPLOYMENT.md, "From zero"). With --layout,
    the rank is assembled from sources of other tensor-parallel layouts (each region
    read once, every block checked against the checkpoint's digests) and written as
    that rank's loaded form. The output appears under --out only when complete
    (written beside it under a hidden temporary name, then renamed); an existing
    non-empty --out is refused unless --overwrite.
    """
    if layout is not None:
        _pull_across_layouts(model, out, layout, revision, dtype, quantization, tp, pp, rank,
                             device, policy, overwrite, server, as_json)
        return
    # Where a small pull's time goes around PullResult.phases (the demo prints it):
    # interpreter start + the CLI, resolving the identity, the pull() call around its
    # own clock, writing the output. torch is imported inside pull() (its "imports"
    # phase), overlapping the NIXL agent's creation.
    startup_s = support.process_age_s()
    from modelexpress.checkpoint import check_output, save_checkpoint
    from modelexpress.p2p.options import PullOptions
    from modelexpress.p2p.target import pull as do_pull

    settings = _settings(server, as_json)
    _check_device(device)
    check_output(out, overwrite)  # refuse before any byte moves
    storage_url = from_ if from_ is not None else settings.model_storage
    if storage_url:
        _pull_from_zero(model, out, storage_url, revision, dtype, quantization, tp, pp, ep,
                        rank, overwrite, settings, as_json, startup_s)
        return
    with _client(settings) as client, support.stop_on_signals(
            f"pull of {model} stopped; nothing was written to {out}") as stop:
        t0 = time.perf_counter()
        identity = _resolve_identity(client, model, revision, dtype, quantization,
                                     tp, pp, ep, rank)
        resolve_s = time.perf_counter() - t0
        holder: dict[str, Any] = {}
        t0 = time.perf_counter()
        with support.progress_bar(not as_json, f"pull {model}") as update:
            result = do_pull(identity, None, client=client, progress=update, stop=stop,
                             options=PullOptions.from_settings(
                                 settings, device=device, stripe=stripe, policy=policy,
                                 # reads through relaying agents; relays to nobody
                                 relay_read=settings.relay),
                             on_destination=holder.update)
        call_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    files = save_checkpoint(holder, out, overwrite=overwrite)
    write_s = time.perf_counter() - t0
    summary = {"ok": True, **result.to_dict(), "out": [str(f) for f in files],
               "command": {"startup_seconds": startup_s, "resolve_seconds": resolve_s, "pull_call_seconds": call_s,
                           "write_seconds": write_s,
                           "seconds_before_exit": support.process_age_s()}}
    typer.echo(json.dumps(summary) if as_json else
               f"pulled {result.bytes / 1e9:.3f} GB ({result.tensors} tensors) from "
               f"{', '.join(result.source_ids)} in {result.seconds:.2f} s "
               f"({result.gbps:.2f} GB/s over {result.transport}); wrote {len(files)} file(s) "
               f"to {out}; transfer {result.transfer_id}")


def _pull_from_zero(model: str, out: pathlib.Path, url: str, revision: str,
                    dtype: str | None, quantization: str | None, tp: int, pp: int, ep: int,
                    rank: int, overwrite: bool, settings: MxSettings, as_json: bool,
                    startup_s: float) -> None:
    """``pull --from URL``: peers first, else the model's loading origin, else storage as
    the origin (:func:`modelexpress.p2p.zero.fetch`); then write ``out``."""
    from modelexpress.checkpoint import save_checkpoint
    from modelexpress.p2p.options import PullOptions
    from modelexpress.p2p.zero import fetch
    from modelexpress.storage import open_storage, read_layout

    options = PullOptions.from_settings(settings, model_storage=url, relay_read=settings.relay,
                                        relay_serve=settings.relay)
    t0 = time.perf_counter()
    with open_storage(url, options.storage) as storage, _client(settings) as client, \
            support.stop_on_signals(f"pull of {model} stopped; nothing was written to "
                                    f"{out}") as stop:
        layout = read_layout(storage)
        sizes: dict[str, int] = {}
        for t in layout.tensors:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.nbytes
        identity = _identity(model, revision,
                             dtype or (max(sizes, key=sizes.__getitem__) if sizes else "unknown"),
                             quantization or "none", tp, pp, ep, rank)
        with support.progress_bar(not as_json, f"pull {model}") as update:
            result = fetch(identity, storage, client=client, options=options, layout=layout,
                           progress=update, stop=stop)
        call_s = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            files = save_checkpoint(result.tensors, out, overwrite=overwrite)
            write_s = time.perf_counter() - t1
        finally:
            # ORDER: after the output is written (the tensors are not changed), serve the
            # pulls still reading from this one for at most MX_RELAY_LINGER_S.
            result.release()
    summary = {"ok": True, **result.to_dict(), "from": storage.url,
               "identity": identity.to_dict(), "out": [str(f) for f in files],
               "command": {"startup_seconds": startup_s, "fetch_call_seconds": call_s,
                           "write_seconds": write_s,
                           "seconds_before_exit": support.process_age_s()}}
    typer.echo(json.dumps(summary) if as_json else
               f"pulled {result.bytes / 1e9:.3f} GB ({len(result.tensors)} tensors) as the "
               f"{result.role} in {result.seconds:.2f} s ({result.storage_bytes / 1e9:.3f} GB "
               f"read from {storage.url}); wrote {len(files)} file(s) to {out}")
def _pull_across_layouts(model: str, out: pathlib.Path, layout_file: pathlib.Path,
                         revision: str, dtype: str | None, quantization: str | None, tp: int,
                         pp: int, rank: int, device: str, policy: str | None, overwrite: bool,
                         server: str | None, as_json: bool) -> None:
    """``modelexpress pull --layout``: this rank from sources of other layouts."""
    import dataclasses

    from modelexpress.checkpoint import check_output, save_checkpoint
    from modelexpress.errors import NoSourceError
    from modelexpress.layout import Layout
    from modelexpress.p2p.layout_pull import pull_across_layouts
    from modelexpress.p2p.options import PullOptions

    settings = _settings(server, as_json)
    _check_device(device)
    if device != "cpu":
        # what it pulls goes to a file: through a GPU it would only cost a copy back
        raise ConfigError(f"--layout with --device {device}: a pull across layouts writes "
                          "a checkpoint from host memory; pull to --device cpu")
    check_output(out, overwrite)
    try:
        target = Layout.loads(layout_file.read_text())
    except OSError as exc:
        raise ConfigError(f"--layout {layout_file}: {exc}") from exc
    if (target.tp_size, target.rank) != (tp, rank):
        raise ConfigError(f"--layout {layout_file} describes rank {target.rank} of tp="
                          f"{target.tp_size}, not rank {rank} of tp={tp}")
    import torch

    dest = {name: torch.zeros(shape, dtype=getattr(torch, dt), device=device)
            for name, (shape, dt) in target.tensors.items()}
    with _client(settings) as client, support.stop_on_signals(
            f"pull of {model} stopped; nothing was written to {out}") as stop:
        found = [s.model_identity for s in client.list_sources(model=model, revision=revision,
                                                                state="READY")
                 if (dtype is None or s.identity.get("dtype") == dtype)
                 and (quantization is None or s.identity.get("quantization") == quantization)
                 and s.layout_bytes]
        families = {i.family for i in found}
        if not found:
            raise NoSourceError(f"no READY source of {model} (revision {revision}) published "
                                "a layout")
        if len(families) > 1:
            raise MxError(f"sources of {model} hold {len(families)} different sets of weights "
                          "(dtype, quantization, vLLM version, device): pass --dtype and "
                          "--quantization")
        identity = dataclasses.replace(found[0], tp_size=tp, pp_size=pp, rank=rank)
        with support.progress_bar(not as_json, f"pull {model} across layouts") as update:
            outcome = pull_across_layouts(
                identity, target, dest, client=client, progress=update, stop=stop,
                options=PullOptions.from_settings(settings, device=device, policy=policy))
    result = outcome.result
    files = save_checkpoint(dest, out, overwrite=overwrite)
    summary = {"ok": True, **result.to_dict(), "out": [str(f) for f in files],
               "across_layouts": True}
    typer.echo(json.dumps(summary) if as_json else
               f"pulled rank {rank} of tp={tp}: {result.bytes / 1e9:.3f} GB from "
               f"{', '.join(result.source_ids)} (other layouts) in {result.seconds:.2f} s "
               f"({result.gbps:.2f} GB/s over {result.transport}), every block verified; "
               f"wrote {len(files)} file(s) to {out}; transfer {result.transfer_id}")


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
    _check_device(device)
    flags = {"serve_after_pull": serve_after, "chunk_bytes": chunk_bytes or None,
             "max_gbps": max_gbps}
    options = AgentOptions.from_settings(
        settings, device=device, out_dir=out,
        **{name: value for name, value in flags.items() if value is not None})
    with _client(settings) as client, support.stop_on_signals() as stop, \
            Agent(client, agent_id, options) as worker:
        typer.echo(f"agent {worker.agent_id} waiting for transfers (device {device})")
        worker.run(stop, max_transfers=max_transfers)
        failed = [t for t, s in worker.finished.items() if s == "FAILED"]
    if failed:
        raise MxError(f"{len(failed)} transfer(s) FAILED: {', '.join(failed[:5])}; "
                      "`modelexpress transfers list --state FAILED` shows why")


@sources_app.command("list")
def sources_list(
    model: Optional[str] = typer.Option(None, "--model"),
    state: Optional[str] = typer.Option(None, "--state", help="INITIALIZING, READY or STALE"),
    rank: Optional[int] = typer.Option(None, "--rank"),
    server: Optional[str] = SERVER, as_json: bool = JSON,
) -> None:
    """List published sources."""
    settings = _settings(server, as_json)
    with _client(settings) as client:
        rows = client.list_sources(model=model, state=state, rank=rank)
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
    settings = _settings(server, as_json)
    with _client(settings) as client:
        rows = client.list_transfers(state=state, target_worker=target)
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
    settings = _settings(server, as_json)
    if identity_id is None and model is None:
        raise ConfigError("transfers start needs --identity ID or --model NAME")
    with _client(settings) as client:
        if identity_id is None:
            identity_id = _resolve_identity(client, model, revision, dtype, quantization,
                                            tp, pp, ep, rank).id
        t = client.start_transfer(identity_id, target, source_id=source)
        if wait:
            with support.stop_on_signals(f"stopped following transfer {t.id} (it keeps "
                                         "running; `modelexpress transfers stop` stops it)"
                                         ) as stop:
                t = follow_transfer(client, t.id, timeout_s=timeout, show=not as_json,
                                    stop=stop)
    if as_json:
        typer.echo(json.dumps({"ok": not wait or t.state == "SUCCEEDED", **_transfer_json(t)}))
    else:
        _print_transfer(t)
    if wait and t.state != "SUCCEEDED":
        raise MxError(f"transfer {t.id} ended {t.state}" + (f": {t.error}" if t.error else ""))


follow_transfer = support.follow_transfer


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
    settings = _settings(server, as_json)
    with _client(settings) as client:
        t = call(client)
    if as_json:
        typer.echo(json.dumps({"ok": True, **_transfer_json(t)}))
    else:
        _print_transfer(t)


def register(app: typer.Typer) -> None:
    """Add the P2P commands to the main CLI app."""
    for command in (publish, pull, agent):
        app.command(epilog=support.EXIT_CODES_HELP)(command)
    app.add_typer(sources_app, name="sources")
    app.add_typer(transfers_app, name="transfers")
