"""The agent: a worker that runs transfers started through the REST API.

Loop: register with the control plane, long-poll for assignments, and for each
transfer allocate destination tensors from the source's manifest, pull (the
assigned source first, then others), report progress (whose reply carries "stop"),
and finish with SUCCEEDED, STOPPED or FAILED. A finished pull is optionally written
out as safetensors and served onward (fan-out).

Partial data is never published: the output directory of a transfer appears only
after every tensor arrived and verified, and a stopped or failed transfer's tensors
are dropped.
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
from modelexpress.errors import (ConflictError, ControlPlaneError, MxError, NotFoundError,
                                 TransferCancelledError)
from modelexpress.identity import ModelIdentity
from modelexpress.p2p.source import SourceHandle, default_worker_id, serve_source
from modelexpress.p2p.target import allocate_like, manifest_of, pull

if TYPE_CHECKING:
    from modelexpress.client import MxClient, TransferInfo
    from modelexpress.settings import MxSettings

__all__ = ["Agent", "AgentOptions"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AgentOptions:
    """How an agent runs transfers; build it with :meth:`from_settings`.

    Attributes:
        device: where received tensors live (``cpu``, ``cuda:1``...).
        out_dir: write each finished transfer to ``out_dir/<transfer id>/`` as safetensors.
        serve_after_pull: publish each finished transfer as a source (fan-out).
        timeout_s: deadline of one transfer.
        verify: check digests.
        chunk_bytes: bytes per READ chunk (progress and stop granularity).
        max_attempts: sources tried per transfer.
        policy: source policy for retries (the server picked the first source).
        progress_interval_s: minimum time between progress reports to the server.
        max_gbps: cap on the receive rate (0: none); keeps a pull from saturating a
            link shared with serving traffic.
        refuse_slow_transport: fail a pull whose transport fell back (e.g. VMM memory
            over TCP) instead of only warning.
        heartbeat_interval_s: heartbeat of fan-out sources.
        poll_wait_s: long-poll wait per request.
        nixl_backend: NIXL backend plugin of the agent's pulls and sources.
    """

    device: str = "cpu"
    out_dir: pathlib.Path | None = None
    serve_after_pull: bool = True
    timeout_s: float = 600.0
    verify: bool = True
    chunk_bytes: int = 1 << 30
    max_attempts: int = 3
    policy: str = "random"
    progress_interval_s: float = 0.2
    max_gbps: float = 0.0
    refuse_slow_transport: bool = False
    heartbeat_interval_s: float = 5.0
    poll_wait_s: float = 10.0
    nixl_backend: str = "UCX"

    @classmethod
    def from_settings(cls, settings: "MxSettings", **overrides: Any) -> "AgentOptions":
        """The options ``settings`` give; ``overrides`` (the CLI's flags) win.

        Every pull setting ``modelexpress pull`` reads is read here too, so a transfer
        started through the REST API runs like one pulled from the command line
        (tests/p2p/test_agent_options.py keeps the two in step).

        Raises:
            TypeError: an override names no field.
        """
        values: dict[str, Any] = {
            "serve_after_pull": settings.serve_after_pull,
            "timeout_s": settings.transfer_timeout_s,
            "verify": settings.verify_digests,
            "chunk_bytes": settings.transfer_chunk_bytes,
            "max_attempts": settings.max_source_attempts,
            "policy": settings.source_policy,
            "max_gbps": settings.transfer_max_gbps,
            "refuse_slow_transport": settings.refuse_slow_transport,
            "heartbeat_interval_s": settings.heartbeat_interval_s,
            "nixl_backend": settings.nixl_backend,
        }
        return cls(**{**values, **overrides})


class _Reporter:
    """Rate-limited progress reports; remembers whether the server asked to stop."""

    def __init__(self, client: "MxClient", transfer_id: str, interval_s: float,
                 max_gbps: float, stop: threading.Event) -> None:
        self.client = client
        self.transfer_id = transfer_id
        self.interval_s = interval_s
        self.max_bps = max_gbps * 1e9
        self.stop = stop
        self.started = time.monotonic()
        self.last = 0.0
        self.done = 0

    def begin(self) -> None:
        """Start the rate clock: the data plane starts now.

        Time spent before (source lookup, allocation) must not count as credit for the
        rate cap, or a slow setup lets the first chunks through uncapped.
        """
        self.started = time.monotonic()

    def send(self, done: int, total: int, force: bool = False,
             rate_bps: float | None = None) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.interval_s:
            return
        self.last = now
        if rate_bps is None:
            rate_bps = done / max(now - self.started, 1e-9)
        try:
            reply = self.client.report_progress(self.transfer_id, done, total, rate_bps)
        except ControlPlaneError as exc:
            # The data plane keeps going; a lost report only delays what the operator sees.
            log.warning("progress report for transfer %s failed: %s", self.transfer_id, exc)
            return
        if reply.stop and not self.stop.is_set():
            log.info("transfer %s: stop requested; aborting at the next chunk", self.transfer_id)
            self.stop.set()

    def __call__(self, done: int, total: int) -> None:
        self.done = done
        self.send(done, total)
        if self.max_bps > 0:
            # Throttle between chunks: sleep until the average rate is under the cap.
            ahead = done / self.max_bps - (time.monotonic() - self.started)
            if ahead > 0:
                self.stop.wait(ahead)


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

    def register(self) -> None:
        """(Re-)register with the control plane."""
        self.client.register_agent(self.agent_id, labels={"device": self.options.device})
        log.info("agent %s registered (device %s)", self.agent_id, self.options.device)

    def run(self, stop: threading.Event, max_transfers: int | None = None) -> None:
        """Poll and execute assignments until ``stop`` is set (or ``max_transfers`` ran).

        Control-plane outages are waited out with a bounded backoff, re-registering
        once the server answers again (a restarted server may have lost nothing, but
        re-registering releases claims this agent never started).
        """
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
        opts = self.options
        stop = threading.Event()
        reporter = _Reporter(self.client, transfer.id, opts.progress_interval_s, opts.max_gbps,
                             stop)
        log.info("agent %s: transfer %s of %s from source %s", self.agent_id, transfer.id,
                 transfer.identity_id, transfer.source_id)
        try:
            info = self.client.get_source(transfer.source_id)
            identity = ModelIdentity.from_dict(info.identity)
            dest = allocate_like(manifest_of(info), opts.device)
            total = sum(t.numel() * t.element_size() for t in dest.values())
            reporter.send(0, total, force=True)  # PENDING -> RUNNING
            own = [h.worker_id for h in self.served]
            reporter.begin()
            result = pull(identity, dest, client=self.client, timeout_s=opts.timeout_s,
                          verify=opts.verify, progress=reporter,
                          stop=lambda: stop.is_set() or bool(shutdown and shutdown.is_set()),
                          policy=opts.policy, max_attempts=opts.max_attempts,
                          prefer=[transfer.source_id], exclude_workers=own,
                          chunk_bytes=opts.chunk_bytes,
                          refuse_slow_transport=opts.refuse_slow_transport,
                          backend=opts.nixl_backend, track=False)  # the REST-started transfer is this pull's record
            # the final report carries the data plane's own rate (READ time only)
            reporter.send(result.bytes, total, force=True, rate_bps=result.gbps * 1e9)
        except TransferCancelledError:
            if not stop.is_set():  # our own shutdown, not an operator's stop
                return self._finish(transfer.id, "FAILED", bytes_done=reporter.done,
                                    error="agent shut down mid-transfer; restart it")
            return self._finish(transfer.id, "STOPPED", bytes_done=reporter.done)
        except MxError as exc:
            log.error("transfer %s failed: %s", transfer.id, exc)
            return self._finish(transfer.id, "FAILED", error=f"{type(exc).__name__}: {exc}",
                                bytes_done=reporter.done)
        if stop.is_set():  # the stop arrived with the last chunk: it wins
            return self._finish(transfer.id, "STOPPED", bytes_done=reporter.done)
        out = self._write_out(transfer.id, dest)
        state = self._finish(transfer.id, "SUCCEEDED", bytes_done=result.bytes)
        if state != "SUCCEEDED":
            if out is not None:
                shutil.rmtree(out, ignore_errors=True)
            return state
        log.info("transfer %s: %d bytes in %.3f s (%.2f GB/s over %s)", transfer.id,
                 result.bytes, result.seconds, result.gbps, result.transport)
        if opts.serve_after_pull:
            self._serve(identity, dest)
        return state

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

    def _finish(self, transfer_id: str, state: str, *, error: str | None = None,
                bytes_done: int | None = None) -> str:
        try:
            info = self.client.finish_transfer(transfer_id, state,  # type: ignore[arg-type]
                                               error=error, bytes_done=bytes_done)
            final = info.state
        except ConflictError as exc:
            # e.g. SUCCEEDED after a stop was asked: the stop won.
            log.warning("transfer %s: %s rejected (%s); reporting STOPPED", transfer_id, state, exc)
            final = "STOPPED" if state == "SUCCEEDED" else state
            if state == "SUCCEEDED":
                try:
                    final = self.client.finish_transfer(transfer_id, "STOPPED",
                                                        bytes_done=bytes_done).state
                except MxError as exc2:
                    log.error("transfer %s: could not report STOPPED: %s", transfer_id, exc2)
        except MxError as exc:
            log.error("transfer %s: could not report %s: %s", transfer_id, state, exc)
            final = state
        self.finished[transfer_id] = final
        log.info("transfer %s finished: %s", transfer_id, final)
        return final

    def _serve(self, identity: ModelIdentity, dest: dict) -> None:
        try:
            handle = serve_source(identity, dest, client=self.client,
                                  worker_id=f"{self.agent_id}-fanout-{len(self.served)}",
                                  heartbeat_interval_s=self.options.heartbeat_interval_s,
                                  guardian=True, backend=self.options.nixl_backend)
        except MxError as exc:
            log.warning("could not serve the pulled weights onward: %s", exc)
            return
        self.served.append(handle)

    def close(self) -> None:
        """Withdraw fan-out sources. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in self.served:
            handle.close()
        self.served.clear()
