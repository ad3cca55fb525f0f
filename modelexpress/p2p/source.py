"""The serving side of a peer-to-peer pull: register, publish, heartbeat, withdraw.

A source is passive: targets READ its memory one-sided. It still has to drive its
NIXL worker (``enable_prog_thread=False``, DESIGN.md) so peers can connect, and it
has to keep telling the control plane it is alive. :class:`SourceHandle` owns both
background threads and withdraws the source (STALE) on close, on SIGTERM (through
the CLI's handler) and when its data plane fails.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

from modelexpress._closing import ClosedOnCollect
from modelexpress.errors import ControlPlaneError, MxError, NotFoundError

if TYPE_CHECKING:
    import torch

    from modelexpress.client import MxClient
    from modelexpress.identity import ModelIdentity
    from modelexpress.local import HostBuffer, LocalOptions, LocalSource
    from modelexpress.transfer import NixlTransferManager, RegistrationInfo

__all__ = ["SourceHandle", "serve_source", "default_worker_id"]

log = logging.getLogger(__name__)


def default_worker_id(role: str) -> str:
    """A worker id unique per process: ``<role>-<host>-<pid>-<random>``."""
    host = socket.gethostname().split(".")[0][:40] or "host"
    return f"{role}-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class SourceHandle(ClosedOnCollect):
    """A published source. Close it (or use it as a context manager) to withdraw.

    Attributes:
        source_id: the control plane's id of this source.
        worker_id: this worker's id.
        identity: what is served.
        manager: the NIXL manager whose registered memory is served.
        registration: what registration did (strategy, regions, bytes, seconds).
        manifest_bytes: size of the published manifest.
        local: the local transport's server for same-host peers, or None.
    """

    def __init__(self, *, client: "MxClient", identity: "ModelIdentity", source_id: str,
                 worker_id: str, manager: "NixlTransferManager",
                 registration: "RegistrationInfo", manifest_bytes: int,
                 heartbeat_interval_s: float, owns_manager: bool,
                 tensors: Mapping[str, "torch.Tensor"] | None = None,
                 guardian: Any = None, local: "LocalSource | None" = None,
                 host_buffers: Sequence["HostBuffer"] = ()) -> None:
        self.client = client
        self.local = local
        self._host_buffers = tuple(host_buffers)
        self._guardian = guardian
        # Peers read this memory until close(): hold the tensors so it cannot be freed
        # and reused while published (the caller may drop its last reference, e.g. the
        # vLLM loader serves loaded weights that post-processing replaced in the model).
        self._tensors = dict(tensors or {})
        self.identity = identity
        self.source_id = source_id
        self.worker_id = worker_id
        self.manager = manager
        self.registration = registration
        self.manifest_bytes = manifest_bytes
        self._owns_manager = owns_manager
        self._interval = heartbeat_interval_s
        self._stop = threading.Event()
        self._closed = False
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                        name=f"mx-heartbeat-{source_id[:8]}")
        self._thread.start()

    @property
    def failure(self) -> str | None:
        """Why the source withdrew itself (data-plane failure), or None."""
        return self._failure

    def _heartbeat_loop(self) -> None:
        # Heartbeats are the liveness signal the server uses to pick sources; a
        # failed heartbeat is retried at the next tick (the client already retried
        # connection errors), and a dead progress thread withdraws the source: a
        # target reading from it would only time out.
        while not self._stop.wait(self._interval):
            if not self.manager.serving:
                # ORDER: read after the wait. close() sets _stop before it releases the
                # progress thread; an agent closed on purpose (its owner shut down
                # first, e.g. at a clean exit) is not a data-plane failure.
                if self._stop.is_set():
                    return
                if self.manager.closed:
                    self._failure = "its NIXL agent was closed"
                    log.info("source %s: %s; marking it STALE", self.source_id, self._failure)
                else:
                    error = self.manager.progress_error
                    self._failure = ("the NIXL progress thread stopped (data-plane failure"
                                     + (f": {error})" if error else ")"))
                    log.error("source %s: %s; marking it STALE", self.source_id,
                              self._failure)
                self._withdraw()
                return
            try:
                self.client.heartbeat(self.source_id)
            except NotFoundError:
                # collected after a long outage: the server forgot us; publish again
                log.warning("source %s was collected by the server; it no longer serves",
                            self.source_id)
                return
            except ControlPlaneError as exc:
                log.warning("heartbeat of source %s failed: %s (retrying in %.1f s)",
                            self.source_id, exc, self._interval)

    def _withdraw(self) -> None:
        try:
            self.client.mark_stale(self.source_id)
        except MxError as exc:
            log.warning("could not mark source %s STALE: %s", self.source_id, exc)

    def close(self) -> None:
        """Withdraw (STALE), stop heartbeats, stop serving. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._failure is None:
            self._withdraw()
        if self._guardian is not None:
            self._guardian.close()
        if self.local is not None:
            # ORDER: after the withdrawal (no new target picks us), before the memory goes.
            self.local.close()
        for buf in self._host_buffers:
            buf.close()  # tensor views still alive keep their pages (HostBuffer.close)
        self._thread.join(timeout=self._interval + 5.0)
        if self._owns_manager:
            self.manager.close()
        else:
            # Other sources of this process may serve through the same agent.
            self.manager.release_progress_thread()
        self._tensors = {}
        log.info("source %s (%s) withdrawn", self.source_id, self.identity.model)


def serve_source(identity: "ModelIdentity", tensors: Mapping[str, "torch.Tensor"], *,
                 client: "MxClient", arena: Any = None,
                 manager: "NixlTransferManager | None" = None,
                 worker_id: str | None = None, endpoint: str = "",
                 heartbeat_interval_s: float = 5.0, digests: bool = True,
                 digest_algorithm: str | None = None,
                 single_region: bool = False,
                 known_digests: Mapping[str, str] | None = None,
                 attributes: Mapping[str, Any] | None = None,
                 guardian: bool = False, backend: str = "UCX",
                 local: "LocalOptions | None" = None,
                 host_buffers: Sequence["HostBuffer"] = (),
                 own_host_buffers: bool = True,
                 own_manager: bool | None = None,
                 state: Literal["INITIALIZING", "READY"] = "READY",
                 layout: Mapping[str, Any] | None = None) -> SourceHandle:
    """Register ``tensors`` with NIXL and publish them as a READY source.

    Args:
        identity: what the tensors are (model, revision, dtype, layout, rank).
        tensors: name -> tensor, in load order (contiguous; CPU or GPU).
        client: control-plane client.
        arena: the VMM arena the tensors live in, if any; registration then picks the
            strategy the transport supports (``register_arena``).
        manager: an existing NIXL manager (its registrations are reused); a new one
            is created (and owned) when None.
        worker_id: this worker's id; unique per process by default.
        endpoint: free-form "how to reach me" shown in listings.
        heartbeat_interval_s: ``MX_HEARTBEAT_INTERVAL_S``.
        digests: publish per-tensor digests so targets can verify.
        digest_algorithm: force a digest algorithm (``wsum-i32-v1`` works on CPU and
            GPU; the default is chosen by where the tensors live).
        single_region: ``MX_VMM_ARENA_SINGLE_MR``: force one region over the arena.
        known_digests: per-tensor digests the caller already computed with
            ``digest_algorithm`` (the vLLM loader digests the loaded weights before
            post-processing and checks them after); not computed again.
        attributes: JSON facts published with the manifest for targets to check
            (the vLLM loader's behavioural probe).
        guardian: start a guardian process that marks the source STALE as soon as
            this process ends without closing it (killed; see
            :mod:`modelexpress.p2p.guardian`).
        backend: the NIXL backend of the manager made when ``manager`` is None
            (``MX_NIXL_BACKEND``).
        local: also serve the tensors to peers on this host over the local transport
            (``LocalOptions.from_settings``; None or ``MX_IPC_DIR=off``: NIXL only). Its
            endpoint is published in the manifest's attributes; peers on other hosts
            still read over NIXL. Memory it cannot share (CPU tensors outside
            ``host_buffers``, a CUDA allocation without IPC) leaves this source NIXL-only,
            with a warning.
        host_buffers: the memfd-backed buffers CPU ``tensors`` live in
            (``checkpoint.load_checkpoint_shared``, ``local.host_buffer_like``); the
            handle closes them when it closes (views of them keep their pages).
        own_host_buffers: False: the caller keeps ``host_buffers`` open after the
            handle closes (a pool that serves version after version from them).
        own_manager: the handle closes ``manager`` when it closes (None: only a manager
            made here; a fleet relay passes the one it registered its watermark with).
        state: INITIALIZING publishes memory still being filled, which no pull ranks
            (a fleet relay, :mod:`~modelexpress.p2p.relay`); heartbeats keep the state
            until the caller moves it to READY.
        layout: the layout of ``tensors`` (:class:`modelexpress.layout.Layout` JSON),
            published beside the manifest so that targets of other parallel layouts can
            read regions of them (API version 5 servers; an older one stores none).

    Returns:
        A :class:`SourceHandle`; close it to withdraw.

    Raises:
        RegistrationError, ConfigError: registration or manifest failed.
        ControlPlaneError: publishing failed (the registration is undone).
    """
    from modelexpress.transfer import NixlTransferManager

    owns = manager is None if own_manager is None else own_manager
    mgr = manager or NixlTransferManager(backend=backend)
    local_source = None
    holds_progress = False
    try:
        t0 = time.perf_counter()
        from modelexpress.local.devices import gpus_of
        gpus = gpus_of(tensors.values())  # GPUs by UUID for other processes
        if gpus:
            attributes = {**(attributes or {}), "gpus": gpus}
        if local is not None and local.enabled:
            local_source = _serve_locally(local, tensors, arena, host_buffers)
            if local_source is not None:
                from modelexpress.local import publish_attributes

                attributes = {**(attributes or {}), **publish_attributes(local_source)}
        if arena is not None:
            registration = mgr.register_arena(arena, tensors, force_single_region=single_region)
        else:
            registration = mgr.register_tensors(tensors)
        manifest = mgr.build_manifest(tensors, digests=digests,
                                      digest_algorithm=digest_algorithm,
                                      known_digests=known_digests, attributes=attributes)
        manifest_json = manifest.to_json()
        mgr.acquire_progress_thread()
        holds_progress = True
        wid = worker_id or default_worker_id("source")
        info = client.publish_source(identity, wid, manifest=json.loads(manifest_json),
                                     agent_metadata=mgr.get_agent_metadata(),
                                     endpoint=endpoint or f"{socket.gethostname()}:{mgr.name}",
                                     devices=tuple(dict.fromkeys(gpus.values())), state=state,
                                     layout=dict(layout) if layout is not None else None)
    except BaseException:
        if local_source is not None:
            local_source.close()
        if owns:
            mgr.close()
        elif holds_progress:
            mgr.release_progress_thread()
        raise
    guard = None
    if guardian:
        from modelexpress.p2p.guardian import start_guardian

        try:
            guard = start_guardian(client.base_url, client.token, info.id)
        except OSError as exc:
            log.warning("source %s: no guardian (%s); if this process is killed the source "
                        "stays READY until the server times it out", info.id, exc)
    log.info("source %s serving %s: %d tensors, %d bytes on %s, %d %s regions%s, published "
             "in %.3f s", info.id, identity.model, len(manifest.tensors), manifest.total_bytes,
             ", ".join(gpus.values()) or "the host", registration.regions, registration.strategy,
             f", local transport on {local_source.path}" if local_source is not None else "",
             time.perf_counter() - t0)
    return SourceHandle(client=client, identity=identity, source_id=info.id, worker_id=wid,
                        manager=mgr, registration=registration,
                        manifest_bytes=len(manifest_json),
                        heartbeat_interval_s=heartbeat_interval_s, owns_manager=owns,
                        tensors=tensors, guardian=guard, local=local_source,
                        host_buffers=host_buffers if own_host_buffers else ())


def _serve_locally(local: "LocalOptions", tensors: Mapping[str, "torch.Tensor"], arena: Any,
                   host_buffers: Sequence["HostBuffer"]) -> "LocalSource | None":
    """A started :class:`~modelexpress.local.LocalSource` over ``tensors``, or None (logged)
    when their memory cannot be shared: the source then serves over NIXL only."""
    from modelexpress.local import LocalSource

    try:
        server = LocalSource(local.ipc_dir, host_id=local.host_id)
    except MxError as exc:
        log.warning("no local transport for this source: %s", exc)
        return None
    try:
        for buf in host_buffers:
            server.add_host_buffer(buf)
        if arena is not None:
            server.add_vmm_arena(arena)
        server.add_tensors(tensors)
        server.start()
    except (MxError, ImportError) as exc:
        # ImportError: CUDA memory without cuda-python (the extra that shares it).
        server.close()
        log.warning("no local transport for this source (peers on this host read it over "
                    "NIXL): %s", exc)
        return None
    return server
