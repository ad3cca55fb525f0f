"""The agent: a worker that runs transfers started through the REST API.

Loop: register with the control plane, long-poll for assignments, and for each
transfer allocate destination tensors from the source's manifest, pull (the
assigned source first, then others), report progress (whose reply carries "stop"),
and finish with SUCCEEDED, STOPPED or FAILED. A finished pull is optionally written
out as safetensors and served onward (fan-out).

A transfer the server's planner put on a relay path (``TransferInfo.relay_path``,
agents registered with ``MX_RELAY``) is run by :mod:`~modelexpress.p2p.relay`: its
destination is served from the first chunk while each chunk is read from the first
live holder on the path, so transfers started together form a chain or a tree and the
origin sends the model about once.

Partial data is never published: the output directory of a transfer appears only
after every tensor arrived and verified, and a stopped or failed transfer's tensors
are dropped (a relay serves its verified prefix only while the transfer runs, and
becomes a READY source only after every digest was checked again).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any

from modelexpress._closing import Closeable
from modelexpress.errors import (ControlPlaneError, MxError, NotFoundError,
                                 TransferCancelledError, TransferError)
from modelexpress.identity import ModelIdentity
from modelexpress.p2p.source import SourceHandle, default_worker_id, serve_source
from modelexpress.p2p.options import PullOptions
from modelexpress.p2p.target import pull
from modelexpress.p2p.tracking import TransferTracker, outcome_of

if TYPE_CHECKING:
    from modelexpress.client import MxClient, SourceInfo, TransferInfo
    from modelexpress.settings import MxSettings
    from modelexpress.transfer import NixlTransferManager

__all__ = ["Agent", "AgentOptions"]

log = logging.getLogger(__name__)


_AGENT_PULL = PullOptions(progress_interval_s=0.2, track=False)


@dataclasses.dataclass(frozen=True)
class AgentOptions:
    """How an agent runs transfers; build it with :meth:`from_settings`.

    Attributes:
        pull: how each transfer's pull runs (device, deadline, digests, chunk size,
            attempts, policy, rate cap, transport refusal, NIXL backend); ``track`` is
            off, since the REST API created the record the agent reports on.
        out_dir: write each finished transfer to ``out_dir/<transfer id>/`` as safetensors.
        serve_after_pull: publish each finished transfer as a source (fan-out).
        heartbeat_interval_s: heartbeat of fan-out sources.
        poll_wait_s: long-poll wait per request.
        relay: serve a transfer's verified chunks while receiving, and read from
            holders the server's planner names (``MX_RELAY``; :mod:`~.relay`).
        relay_chunk_bytes: bytes per relayed READ request (``MX_RELAY_CHUNK_BYTES``).
        link_mbit: this worker's NIC speed for the planner, 0 unknown
            (``MX_RELAY_LINK_MBIT``).
    """

    pull: PullOptions = _AGENT_PULL
    out_dir: pathlib.Path | None = None
    serve_after_pull: bool = True
    heartbeat_interval_s: float = 5.0
    poll_wait_s: float = 10.0
    relay: bool = True
    relay_chunk_bytes: int = 4 << 20
    link_mbit: float = 0.0

    @property
    def device(self) -> str:
        """Where received tensors live (``cpu``, ``cuda:1``...)."""
        return self.pull.device

    @classmethod
    def from_settings(cls, settings: "MxSettings", **overrides: Any) -> "AgentOptions":
        """The options ``settings`` give; ``overrides`` (the CLI's flags) win.

        An override naming a :class:`PullOptions` field (``device``, ``chunk_bytes``,
        ``max_gbps``...) goes to the pull options, which come from
        :meth:`PullOptions.from_settings` like every other entry point's, so a transfer
        started through the REST API pulls like ``modelexpress pull``.

        Raises:
            TypeError: an override names no field of either.
        """
        pull_fields = {f.name for f in dataclasses.fields(PullOptions)}
        pull_overrides = {k: v for k, v in overrides.items() if k in pull_fields}
        own = {k: v for k, v in overrides.items() if k not in pull_fields}
        pull = PullOptions.from_settings(settings, progress_interval_s=0.2, track=False,
                                         **pull_overrides)
        values: dict[str, Any] = {
            "serve_after_pull": settings.serve_after_pull,
            "heartbeat_interval_s": settings.heartbeat_interval_s,
            "relay": settings.relay,
            "relay_chunk_bytes": settings.relay_chunk_bytes,
            "link_mbit": settings.relay_link_mbit,
        }
        return cls(pull=pull, **{**values, **own})


class Agent(Closeable):
    """Runs REST-started transfers for one worker.

    Args:
        client: control-plane client.
        agent_id: the id operators target with ``POST /v1/transfers``; unique per worker.
        options: :class:`AgentOptions`.
    """

    def __init__(self, client: "MxClient", agent_id: str | None = None,
                 options: AgentOptions | None = None) -> None:
        self.client = client
        self.agent_id = agent_id or default_worker_id("agent")
        self.options = options or AgentOptions()
        self.served: list[SourceHandle] = []
        self.finished: dict[str, str] = {}  # transfer id -> final state
        self._closed = False
        self._nixl: "NixlTransferManager | None" = None  # made by warm_up, reused by pulls
        self._buffers: list[Any] = []  # memfd buffers of fan-out sources (local transport)
        self._lingering: list[tuple[threading.Thread, Any]] = []  # finished relays

    def register(self) -> None:
        """(Re-)register with the control plane."""
        labels = {"device": self.options.device}
        if self.options.relay:
            labels["relay"] = "1"  # the server's planner may chain transfers through us
        if self.options.link_mbit > 0:
            labels["uplink_mbit"] = labels["downlink_mbit"] = f"{self.options.link_mbit:g}"
        self.client.register_agent(self.agent_id, labels=labels)
        log.info("agent %s registered (device %s)", self.agent_id, self.options.device)

    def warm_up(self) -> float:
        """Pay the process's one-time costs before taking transfers; returns the seconds.

        A fresh process's first pull imports torch and the transfer layer and starts
        UCX for the first time (its first NIXL agent costs several times a later one:
        docs/benchmarks.md, "Fixed cost of a small pull"). An agent is long-lived, so it
        pays them once here, before it registers, and not inside the first transfer an
        operator starts. The NIXL agent made here reads every transfer (each one's
        destination is deregistered when it ends).

        Raises:
            MxError: NIXL cannot start (the agent could not pull anyway).
        """
        t0 = time.perf_counter()
        import torch

        from modelexpress.p2p.readers import AgentStart

        device = torch.device(self.options.device)
        start = AgentStart(self.options.pull.backend, device if device.type == "cuda" else None)
        try:
            # Kept for every transfer: the next one pays no agent creation either.
            self._nixl = start.get()
        except BaseException:
            start.close()
            raise
        seconds = time.perf_counter() - t0
        log.info("agent %s: torch and NIXL ready in %.3f s", self.agent_id, seconds)
        return seconds

    def run(self, stop: threading.Event, max_transfers: int | None = None) -> None:
        """Poll and execute assignments until ``stop`` is set (or ``max_transfers`` ran).

        Control-plane outages are waited out with a bounded backoff, re-registering
        once the server answers again (a restarted server may have lost nothing, but
        re-registering releases claims this agent never started).
        """
        self.warm_up()
        self.register()
        ran = 0
        backoff = 0.5
        while not stop.is_set() and (max_transfers is None or ran < max_transfers):
            try:
                assignments = self.client.poll_assignments(
                    self.agent_id, wait_s=self.options.poll_wait_s)
                backoff = 0.5
            except NotFoundError:
                self.register()
                continue
            except ControlPlaneError as exc:
                log.warning("agent %s: polling failed (%s); retrying in %.1f s",
                            self.agent_id, exc, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            for transfer in assignments:
                if stop.is_set():
                    # claimed but not started: re-registering at the next start
                    # releases it (see MxClient.register_agent)
                    break
                self.execute(transfer, shutdown=stop)
                ran += 1

    def execute(self, transfer: "TransferInfo",
                shutdown: threading.Event | None = None) -> str:
        """Run one transfer to completion; returns its final state.

        Args:
            transfer: the claimed assignment.
            shutdown: set when the agent must exit (SIGTERM): the transfer aborts at
                the next chunk and is reported FAILED (restartable), since only an
                operator's stop makes a transfer STOPPED.
        """
        try:
            return self._execute(transfer, shutdown)
        finally:
            if self._nixl is not None:
                # The agent's NIXL manager outlives the transfer; its destination does not.
                try:
                    self._nixl.deregister_all()
                except TransferError as exc:
                    log.warning("transfer %s: deregistering its destination failed: %s",
                                transfer.id, exc)

    def _execute(self, transfer: "TransferInfo", shutdown: threading.Event | None) -> str:
        if transfer.relay_path and self.options.relay and self._nixl is not None:
            return self._execute_relayed(transfer, shutdown)
        opts = self.options
        tracker = TransferTracker(self.client, transfer.id,
                                  interval_s=opts.pull.progress_interval_s,
                                  source_id=transfer.source_id)
        log.info("agent %s: transfer %s of %s from source %s", self.agent_id, transfer.id,
                 transfer.identity_id, transfer.source_id)
        holder: dict[str, Any] = {}
        shared = None
        try:
            # The assigned source's record carries the identity and the manifest; the
            # pull reuses it (fetched=) instead of fetching it again.
            info = self.client.get_source(transfer.source_id)
            identity = ModelIdentity.from_dict(info.identity)
            own = tuple(h.worker_id for h in self.served)
            shared, dest = self._shared_destination(info)
            result = pull(identity, dest, client=self.client,
                          options=opts.pull.replace(prefer=(transfer.source_id,),
                                                    exclude_workers=own, track=False),
                          stop=lambda: bool(shutdown and shutdown.is_set()),
                          on_destination=holder.update, record=tracker, fetched=(info,),
                          manager=self._nixl)
        except TransferCancelledError:
            _close(shared)
            if not tracker.stop_requested.is_set():  # our own shutdown, not an operator's stop
                return self._finish(tracker, "FAILED", done=tracker.done,
                                    error="agent shut down mid-transfer; restart it")
            return self._finish(tracker, "STOPPED", done=tracker.done)
        except MxError as exc:
            _close(shared)
            log.error("transfer %s failed: %s", transfer.id, exc)
            return self._finish(tracker, "FAILED", error=f"{type(exc).__name__}: {exc}",
                                done=tracker.done)
        except BaseException:
            _close(shared)
            raise
        dest = holder
        if tracker.stop_requested.is_set():  # the stop arrived with the last chunk: it wins
            _close(shared)
            return self._finish(tracker, "STOPPED", done=result.bytes)
        out = self._write_out(transfer.id, dest)
        state = self._finish(tracker, "SUCCEEDED", done=result.bytes, outcome=outcome_of(result))
        if state != "SUCCEEDED":
            _close(shared)
            if out is not None:
                shutil.rmtree(out, ignore_errors=True)
            return state
        log.info("transfer %s: %d bytes in %.3f s (%.2f GB/s over %s; %.3f s in all)",
                 transfer.id, result.bytes, result.seconds, result.gbps, result.transport,
                 result.total_seconds)
        if opts.serve_after_pull:
            self._serve(identity, dest, shared)
        else:
            _close(shared)
        return state

    def _execute_relayed(self, transfer: "TransferInfo",
                         shutdown: threading.Event | None) -> str:
        """Run a transfer the planner put on a relay path (:mod:`~.relay`): serve its
        destination from the first chunk while reading each chunk from the first live
        holder on the path."""
        from modelexpress.p2p.manifests import allocate_like, manifest_of
        from modelexpress.p2p.relay import RelayReader, RelayServer, relay_worker_id

        opts = self.options
        # Every verified tensor is advertised at once (from the reader's own thread);
        # the rate-limited reports of the pull only repeat the same watermark.
        tracker = TransferTracker(self.client, transfer.id,
                                  interval_s=opts.pull.progress_interval_s,
                                  source_id=transfer.source_id)
        log.info("agent %s: transfer %s of %s relayed through %s", self.agent_id, transfer.id,
                 transfer.identity_id, " -> ".join(transfer.relay_path))
        relay: RelayServer | None = None
        try:
            info = self.client.get_source(transfer.source_id)
            identity = ModelIdentity.from_dict(info.identity)
            origin = manifest_of(info)
            dest = allocate_like(origin, opts.device)  # one slab, in manifest order
            try:
                relay = RelayServer(self.client, identity, dest, origin,
                                    worker_id=relay_worker_id(self.agent_id, transfer.id),
                                    heartbeat_interval_s=opts.heartbeat_interval_s,
                                    backend=opts.pull.backend)
            except MxError as exc:
                log.warning("transfer %s: not relaying (reading only): %s", transfer.id, exc)
            assert self._nixl is not None
            reader = RelayReader(self.client, self._nixl, info, origin, transfer.relay_path,
                                 identity_id=transfer.identity_id,
                                 chunk_bytes=opts.relay_chunk_bytes, link_mbit=opts.link_mbit,
                                 stall_s=opts.pull.stall_s,
                                 verify=opts.pull.verify,
                                 refuse_slow_transport=opts.pull.refuse_slow_transport,
                                 advertise=lambda done, total: tracker.report(done, total,
                                                                              force=True),
                                 publish=relay.advance if relay is not None else None,
                                 local=self._local_readers(),
                                 local_group_bytes=opts.pull.chunk_bytes)
            own = tuple(h.worker_id for h in self.served)
            result = pull(identity, dest, client=self.client,
                          options=opts.pull.replace(prefer=(transfer.source_id,),
                                                    exclude_workers=own, track=False),
                          stop=lambda: bool(shutdown and shutdown.is_set()), record=tracker,
                          fetched=(info,), manager=self._nixl,
                          readers=lambda i, m: reader if i.id == info.id else None)
        except TransferCancelledError:
            _close(relay)
            if not tracker.stop_requested.is_set():
                return self._finish(tracker, "FAILED", done=tracker.done,
                                    error="agent shut down mid-transfer; restart it")
            return self._finish(tracker, "STOPPED", done=tracker.done)
        except MxError as exc:
            _close(relay)
            log.error("transfer %s failed: %s", transfer.id, exc)
            return self._finish(tracker, "FAILED", error=f"{type(exc).__name__}: {exc}",
                                done=tracker.done)
        except BaseException:
            _close(relay)
            raise
        if tracker.stop_requested.is_set():
            _close(relay)
            return self._finish(tracker, "STOPPED", done=result.bytes)
        out = self._write_out(transfer.id, dest)
        # ORDER: finish before the relay changes: a reader takes SUCCEEDED as "holds it
        # all", and the relay still serves while its digests are checked again.
        state = self._finish(tracker, "SUCCEEDED", done=result.bytes, outcome=outcome_of(result))
        if state != "SUCCEEDED":
            _close(relay)
            if out is not None:
                shutil.rmtree(out, ignore_errors=True)
            return state
        log.info("transfer %s: %d bytes in %.3f s (%.2f GB/s over %s from %s; %.3f s in all)",
                 transfer.id, result.bytes, result.seconds, result.gbps, result.transport,
                 ", ".join(reader.read_from), result.total_seconds)
        if relay is not None:
            handle = relay.promote() if opts.serve_after_pull else None
            if handle is not None:
                self.served.append(handle)  # the fan-out source: the same memory, READY
            elif opts.serve_after_pull:
                relay.close()  # its bytes no longer match: nothing to serve
            else:
                self._close_when_unread(relay, transfer)
        elif opts.serve_after_pull:
            self._serve(identity, dest, None)
        return state

    def _close_when_unread(self, relay: Any, transfer: "TransferInfo") -> None:
        """Without fan-out, a finished relay still serves the transfers that read from it
        (the ones whose path starts with it), then withdraws: a chain's last targets
        would otherwise read their last chunks from the origin. Bounded by the pull
        deadline; a thread, so the agent takes its next transfer meanwhile."""
        from modelexpress.p2p.relay_pull import wait_unread

        def run() -> None:
            try:
                wait_unread(self.client, transfer.id, transfer.identity_id,
                            timeout_s=self.options.pull.timeout_s,
                            closed=lambda: self._closed)
            except MxError as exc:
                log.warning("transfer %s: could not list the readers of its relay (%s); "
                            "withdrawing it", transfer.id, exc)
            finally:
                relay.close()

        thread = threading.Thread(target=run, name=f"mx-relay-linger-{transfer.id[:8]}",
                                  daemon=True)
        self._lingering.append((thread, relay))
        thread.start()

    def _local_readers(self) -> Any:
        """The local transport's reader factory (None when off or without a host id)."""
        local = self.options.pull.local
        if not local.enabled:
            return None
        from modelexpress.errors import ConfigError
        from modelexpress.local.reader import local_reader_factory

        try:
            return local_reader_factory(local, chunk_bytes=self.options.pull.chunk_bytes,
                                        verify=self.options.pull.verify)
        except ConfigError as exc:
            log.warning("local transport off for relayed transfers: %s", exc)
            return None

    def _shared_destination(self, info: "SourceInfo") -> tuple[Any, dict[str, Any] | None]:
        """A memfd-backed host destination when the pulled weights will be served onward
        to peers on this host (the local transport); else (None, None): pull allocates."""
        opts = self.options
        if not (opts.serve_after_pull and opts.pull.local.enabled and opts.device == "cpu"):
            return None, None
        import torch

        from modelexpress.checkpoint import allocate_shared
        from modelexpress.p2p.manifests import manifest_of

        manifest = manifest_of(info)
        specs = [(e.name, tuple(e.shape), getattr(torch, e.dtype)) for e in manifest.tensors]
        return allocate_shared(specs)

    def _write_out(self, transfer_id: str, dest: dict) -> pathlib.Path | None:
        if self.options.out_dir is None:
            return None
        from modelexpress.checkpoint import save_checkpoint

        final = self.options.out_dir / transfer_id
        staging = self.options.out_dir / f".partial-{transfer_id}"
        shutil.rmtree(staging, ignore_errors=True)
        save_checkpoint(dest, staging)
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)  # atomic: readers never see a half-written directory
        return final

    def _finish(self, tracker: TransferTracker, state: str, *, error: str | None = None,
                done: int | None = None, outcome: dict[str, Any] | None = None) -> str:
        final = tracker.finish(state, error=error, done=done, outcome=outcome)
        self.finished[tracker.id] = final
        return final

    def _serve(self, identity: ModelIdentity, dest: dict, shared: Any) -> None:
        try:
            handle = serve_source(identity, dest, client=self.client,
                                  worker_id=f"{self.agent_id}-fanout-{len(self.served)}",
                                  heartbeat_interval_s=self.options.heartbeat_interval_s,
                                  guardian=True, backend=self.options.pull.backend,
                                  local=self.options.pull.local,
                                  host_buffers=(shared,) if shared is not None else ())
        except MxError as exc:
            _close(shared)
            log.warning("could not serve the pulled weights onward: %s", exc)
            return
        self.served.append(handle)
        if shared is not None:
            self._buffers.append(shared)

    def close(self) -> None:
        """Withdraw fan-out sources, drop the NIXL agent. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for thread, relay in self._lingering:
            relay.close()
            thread.join(5.0)
        self._lingering.clear()
        for handle in self.served:
            handle.close()
        self.served.clear()
        for buf in self._buffers:  # after the sources that shared them
            buf.close()
        self._buffers.clear()
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None


def _close(buf: Any) -> None:
    if buf is not None:
        buf.close()
