"""The control-plane HTTP API: ``create_app(settings)`` builds the FastAPI app.

Routes (all JSON, under ``/v1``; OpenAPI at ``/openapi.json``):

=======  ====================================  ===========================================
PUT      /v1/sources                           publish (upsert) a source + manifest
GET      /v1/sources                           list (filters: model, revision, state, rank,
                                               identity_id, worker_id)
GET      /v1/sources/{id}                      one source with manifest + agent metadata
POST     /v1/sources/{id}/heartbeat            alive (optionally READY / STALE)
DELETE   /v1/sources/{id}                      remove
GET      /v1/identities/{id}/candidates        READY sources in the order to try them
GET      /v1/identities/{id}/origin            the origin lease (who reads from storage)
POST     /v1/identities/{id}/origin            take it (409 while another holds it)
POST     /v1/identities/{id}/origin/renew      extend (or release) it, merging progress
POST     /v1/transfers                         start (server picks a READY source if none)
GET      /v1/transfers[/{id}]                  list / show
POST     /v1/transfers/{id}/progress           worker totals; reply says ``stop``
POST     /v1/transfers/{id}/finish             SUCCEEDED / FAILED / STOPPED
POST     /v1/transfers/{id}/stop               ask to stop (STOPPING, or STOPPED if unclaimed)
POST     /v1/transfers/{id}/restart            STOPPED / FAILED -> PENDING (same id)
PUT      /v1/agents/{id}                       register a worker that runs transfers
GET      /v1/agents                            list agents
GET      /v1/agents/{id}/assignments?wait=S    long poll: claim new PENDING transfers
GET      /v1/health                            no auth
GET      /metrics                              Prometheus
=======  ====================================  ===========================================

API versions (``modelexpress.wire``): every response carries ``X-MX-API-Version``
(this server's version); a request's header is the client's (none: version 1). A
client older than ``MIN_API_VERSION`` gets a 426 naming both versions; an older one
within the range is served what its version has (what it does not send takes the
defaults), a newer one is served this version's API and adapts itself.

Errors are ``{"detail": "..."}`` with 401 (token), 404 (unknown id), 409 (illegal
transition, or a manifest conflicting with a READY source: ``content.py``), 413 (too
large), 422 (bad body or query), 503 (store unavailable).

Threads: most routes are plain ``def``, which FastAPI runs in its thread pool, so a
slow store call (a list over many records) never blocks the event loop; the stores
are thread-safe. The hot, single-record routes that every worker hits every few
seconds (heartbeat, progress, health) are ``async def`` and call the store directly:
one SQLite update is ~20 us and one Redis WATCH/MULTI round trip well under a
millisecond on a local network, while the thread hop and the GIL hand-offs it costs
dominated their latency on a busy 2-core machine (bench/server.py on SQLite:
p50 1.2 -> 0.6 ms; see docs/benchmarks.md, Control plane). The long poll is ``async``
too, so waiting agents hold no thread; its store reads go to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import FastAPI, Path, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

import modelexpress
from modelexpress.errors import (
    AuthError, ConflictError, MxError, NotFoundError, StoreError, ValidationError,
)
from modelexpress.server.metrics import CONTENT_TYPE, Metrics
from modelexpress.server.models import (
    AgentOut, AgentRegister, ArtifactOutcomeIn, AssignmentsOut, ErrorOut, FinishIn, HealthOut,
    HeartbeatIn, OriginAcquireIn, OriginLeaseOut, OriginRenewIn,
    ProgressIn, ProgressOut, SourceDetail, SourceOut, SourcePublish, TransferCreate,
    TransferOut, MAX_METADATA_B64,
)
from modelexpress.server.service import ControlPlane
from modelexpress.server.states import SourceState, TransferState
from modelexpress.server.store import Store, open_store
from modelexpress.settings import MxSettings
from modelexpress.wire import API_HEADER, API_VERSION, MIN_API_VERSION, api_version_of

__all__ = ["create_app", "MAX_POLL_WAIT_S"]

log = logging.getLogger(__name__)

MAX_POLL_WAIT_S = 60.0
"""Longest long poll; keeps a poll well under common proxy idle timeouts (~100 s)."""

# Long-poll re-check period when nothing woke us: transfers created on ANOTHER
# replica (shared Redis) do not reach our in-process event, so we also re-read.
_POLL_RECHECK_S = 1.0
# The event-loop watchdog: it sleeps _WATCH_S at a time and warns when it woke more
# than _LATE_WARN_S late, i.e. when this replica answered nothing for that long.
_WATCH_S = 1.0
_LATE_WARN_S = 2.0
_PUBLIC_PATHS = frozenset({"/v1/health"})
_ENTITY = r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,191}$"
_WORKER = r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$"
_IDENT = r"^[0-9a-f]{32}$"

SourcePath = Annotated[str, Path(pattern=_ENTITY, description="source id (identity_id:worker_id)")]
TransferPath = Annotated[str, Path(pattern=_ENTITY, description="transfer id")]
AgentPath = Annotated[str, Path(pattern=_WORKER, description="agent (worker) id")]
IdentityPath = Annotated[str, Path(pattern=_IDENT, description="identity id")]

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 404, 409, 413, 422, 503)}


def _json_error(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


class _Gate:
    """Pure ASGI middleware: bearer token, request size cap, latency metrics.

    Pure ASGI rather than ``BaseHTTPMiddleware``: the latter costs a task and a
    stream copy per request, which shows in p99 at a few hundred requests/s.
    """

    def __init__(self, app: Any, token: str | None, max_body: int, metrics: Metrics) -> None:
        self.app = app
        self._token = token.encode() if token else None
        self._max_body = max_body
        self._metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), _VERSION_HEADER]}
            await send(message)

        try:
            denied = self._deny(scope) or _version_refusal(scope)
            if denied is not None:
                await denied(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            self._metrics.observe(scope["method"], getattr(route, "path", "unmatched"),
                                  status, time.perf_counter() - start)

    def _deny(self, scope: dict) -> JSONResponse | None:
        headers = dict(scope["headers"])
        if self._token is not None and scope["path"] not in _PUBLIC_PATHS:
            auth = headers.get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self._token):
                return _json_error(401, "missing or wrong bearer token (Authorization: Bearer "
                                        "<MX_SERVER_TOKEN>)", {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self._max_body
            except ValueError:
                return _json_error(400, "Content-Length is not an integer")
            if too_big:
                return _json_error(413, f"request body of {int(length)} bytes exceeds the "
                                        f"limit of {self._max_body} bytes")
        return None


_VERSION_HEADER = (API_HEADER.lower().encode(), str(API_VERSION).encode())


def _version_refusal(scope: dict) -> JSONResponse | None:
    """A 426 for a client this server no longer serves (or a malformed version header)."""
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    try:
        client = api_version_of({API_HEADER: headers[API_HEADER.lower()]}
                                if API_HEADER.lower() in headers else {})
    except ValueError as exc:
        return _json_error(400, str(exc))
    if client >= MIN_API_VERSION:
        return None
    return _json_error(426, f"this client speaks control-plane API version {client}; this "
                            f"server (modelexpress {modelexpress.__version__}) speaks "
                            f"version {API_VERSION} and serves clients of versions "
                            f"{MIN_API_VERSION} to {API_VERSION}: upgrade the client")


class _Wakeup:
    """Wakes long polls of this replica when a transfer becomes PENDING."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()

    def notify(self) -> None:
        """Thread-safe: called from the route thread pool."""
        if self._loop is not None and self._event is not None:
            self._loop.call_soon_threadsafe(self._event.set)

    async def wait(self, timeout: float) -> None:
        assert self._event is not None, "bind() runs in the lifespan"
        event = self._event
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
        # Swap rather than clear: pollers that woke on the old event all see it set.
        if event.is_set() and self._event is event:
            self._event = asyncio.Event()


def _format_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:10]:
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


# Our errors that mean "the request was wrong", and the status each maps to (the
# client maps them back: modelexpress.client).
_STATUS: dict[type[Exception], int] = {NotFoundError: 404, ConflictError: 409,
                                       ValidationError: 422, AuthError: 401}


def create_app(settings: MxSettings | None = None, *, store: Store | None = None) -> FastAPI:
    """Build the control-plane app.

    Args:
        settings: server settings (store URL, token, timeouts); default ``MxSettings.load()``.
        store: an open store to use instead of opening ``settings.store``; the caller
            keeps ownership (the app closes only a store it opened itself).

    Returns:
        The FastAPI app, ready for uvicorn.
    """
    settings = settings or MxSettings.load()
    token = settings.server_token.get_secret_value() if settings.server_token else None
    owned = store is None
    the_store: Store = store if store is not None else open_store(settings.store)
    metrics = Metrics()
    cp = ControlPlane(the_store, stale_after_s=settings.stale_after_s,
                      gc_after_s=settings.gc_after_s,
                      max_manifest_bytes=settings.server_max_manifest_bytes,
                      default_policy=settings.source_policy,
                      on_finish=metrics.transfer_finished,
                      readers_per_source=settings.relay_readers_per_source,
                      relay_chunk_bytes=settings.relay_chunk_bytes)
    metrics.watch_states(cp.counts)
    wakeup = _Wakeup()
    sweep_every = max(0.2, min(settings.stale_after_s / 3, 10.0))

    async def sweeper() -> None:
        while True:
            await asyncio.sleep(sweep_every)
            try:
                await run_in_threadpool(cp.sweep)
            except StoreError as exc:
                log.warning("sweep skipped: %s", exc)
            except Exception:  # noqa: BLE001 - keep sweeping; a bug here must not stop GC
                log.exception("sweep failed")

    async def watchdog() -> None:
        # A stalled replica looks, to its clients, like a lost reply (their read times
        # out); this line says on the server's side when and for how long it happened.
        while True:
            start = time.monotonic()
            await asyncio.sleep(_WATCH_S)
            late = time.monotonic() - start - _WATCH_S
            if late > _LATE_WARN_S:
                log.warning("this replica's event loop woke %.1f s late and answered "
                            "nothing meanwhile (a store write in a heartbeat or progress "
                            "route that stalled, or a host that gave this process no CPU)",
                            late)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        wakeup.bind(asyncio.get_running_loop())
        tasks = [asyncio.create_task(sweeper(), name="mx-sweeper"),
                 asyncio.create_task(watchdog(), name="mx-watchdog")]
        log.info("control plane up: store %s, auth %s", the_store.url,
                 "on" if token else "off")
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if owned:
                the_store.close()

    app = FastAPI(title="modelexpress control plane", version=modelexpress.__version__,
                  lifespan=lifespan, responses=_ERRORS)
    app.state.control_plane = cp
    app.state.store = the_store

    # --- error mapping: 4xx with a message, never a 500 for bad input -------------
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _json_error(422, _format_validation(exc))

    async def _mapped(_: Request, exc: Exception) -> JSONResponse:
        status = next(code for cls, code in _STATUS.items() if isinstance(exc, cls))
        return _json_error(status, str(exc))

    for error_class in _STATUS:
        app.add_exception_handler(error_class, _mapped)

    @app.exception_handler(StoreError)
    async def _store_down(_: Request, exc: StoreError) -> JSONResponse:
        log.warning("store error: %s", exc)
        return _json_error(503, f"store unavailable: {exc}")

    @app.exception_handler(MxError)
    async def _other(_: Request, exc: MxError) -> JSONResponse:
        log.warning("request failed: %s", exc)
        return _json_error(400, str(exc))

    # --- health and metrics -----------------------------------------------------
    versions = {"api_version": API_VERSION, "min_api_version": MIN_API_VERSION,
                "version": modelexpress.__version__}

    @app.get("/v1/health", response_model=HealthOut, tags=["meta"])
    async def health(response: Response) -> HealthOut:
        """Liveness and store reachability. Never needs the token."""
        try:
            the_store.ping()
        except StoreError as exc:
            response.status_code = 503
            return HealthOut(status="degraded", store=the_store.url, detail=str(exc),
                             **versions)
        return HealthOut(status="ok", store=the_store.url, **versions)

    @app.get("/metrics", tags=["meta"], response_class=Response,
             responses={200: {"content": {"text/plain": {}}}})
    def prometheus() -> Response:
        """Prometheus exposition: sources and transfers by state, request latency, and the
        outcomes workers reported (mx_transfer_* counters and histograms)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # --- sources -----------------------------------------------------------------
    @app.put("/v1/sources", response_model=SourceOut, tags=["sources"])
    def publish_source(body: SourcePublish) -> Any:
        """Publish (or re-publish) the source of one worker rank; resets its state. 409
        when its manifest serves other weights than a READY source of the identity."""
        try:
            return cp.publish_source(body.identity.to_identity(), body.worker_id,
                                     endpoint=body.endpoint,
                                     agent_metadata=body.agent_metadata,
                                     manifest=body.manifest, state=SourceState(body.state),
                                     devices=body.devices, layout=body.layout)
        except ValidationError as exc:  # the only one publish raises: manifest too large
            return _json_error(413, str(exc))

    @app.get("/v1/sources", response_model=list[SourceOut], tags=["sources"])
    def list_sources(
        model: Annotated[str | None, Query(max_length=512)] = None,
        revision: Annotated[str | None, Query(max_length=256)] = None,
        state: SourceState | None = None,
        rank: Annotated[int | None, Query(ge=0, le=1 << 40)] = None,
        identity_id: Annotated[str | None, Query(pattern=_IDENT)] = None,
        worker_id: Annotated[str | None, Query(pattern=_WORKER)] = None,
    ) -> Any:
        """Sources matching every given filter (state is the effective one: a source
        past its heartbeat deadline reads STALE even before the sweep persists it)."""
        return cp.list_sources(model=model, revision=revision, state=state, rank=rank,
                               identity_id=identity_id, worker_id=worker_id)

    @app.get("/v1/sources/{source_id}", response_model=SourceDetail, tags=["sources"])
    def get_source(source_id: SourcePath) -> Any:
        """One source with its manifest and NIXL agent metadata (base64)."""
        return cp.get_source(source_id, with_blob=True)

    @app.post("/v1/sources/{source_id}/heartbeat", response_model=SourceOut, tags=["sources"])
    async def heartbeat(source_id: SourcePath, body: HeartbeatIn) -> Any:
        """Alive. 404 means the record was collected: publish again."""
        return cp.heartbeat(source_id, body.state)

    @app.delete("/v1/sources/{source_id}", status_code=204, tags=["sources"])
    def delete_source(source_id: SourcePath) -> Response:
        """Remove a source and its manifest."""
        cp.delete_source(source_id)
        return Response(status_code=204)

    @app.get("/v1/identities/{identity_id}/candidates", response_model=list[SourceOut],
             tags=["sources"])
    def candidates(
        identity_id: Annotated[str, Path(pattern=_IDENT)],
        policy: Literal["random", "spread"] | None = None,
        exclude_worker: Annotated[str | None, Query(pattern=_WORKER)] = None,
    ) -> Any:
        """READY sources of an identity in the order a target should try them (the
        server's selection policy; default MX_SOURCE_POLICY)."""
        return cp.rank_sources(identity_id, exclude_worker, policy)

    # --- origin leases (modelexpress.server.origins) ---------------------------------
    @app.get("/v1/identities/{identity_id}/origin", response_model=OriginLeaseOut,
             tags=["origins"])
    def get_origin(identity_id: IdentityPath) -> Any:
        """The origin lease of an identity, with the digests of every tensor read from
        storage so far. 404: no target ever became its origin."""
        return cp.origins.get(identity_id)

    @app.post("/v1/identities/{identity_id}/origin", response_model=OriginLeaseOut,
              tags=["origins"])
    def acquire_origin(identity_id: IdentityPath, body: OriginAcquireIn) -> Any:
        """Become the origin of a model no peer holds (read it from storage, serve it
        while it loads). 409 while another holder's lease has not expired."""
        return cp.origins.acquire(identity_id, body.holder, body.ttl_s)

    @app.post("/v1/identities/{identity_id}/origin/renew", response_model=OriginLeaseOut,
              tags=["origins"])
    def renew_origin(identity_id: IdentityPath, body: OriginRenewIn) -> Any:
        """Extend the lease (``release``: end it), merging the origin's source, progress
        and digests. 409 when another holder took it: stop acting as the origin."""
        return cp.origins.renew(identity_id, body.holder, body.generation, body.ttl_s,
                                source_id=body.source_id,
                                digest_algorithm=body.digest_algorithm, digests=body.digests,
                                bytes_done=body.bytes_done, bytes_total=body.bytes_total,
                                storage=body.storage, release=body.release)

    # --- transfers ---------------------------------------------------------------
    @app.post("/v1/transfers", response_model=TransferOut, status_code=201, tags=["transfers"])
    def create_transfer(body: TransferCreate) -> Any:
        """Start a transfer; it is PENDING until the target agent claims and runs it."""
        rec = cp.create_transfer(body.identity_id, body.target_worker,
                                 source_id=body.source_id, policy=body.policy,
                                 run_by_target=body.run_by_target,
                                 relay_read=body.relay_read,
                                 relay_serve=body.relay_serve,
                                 across_layouts=(body.identity.to_identity()
                                                 if body.layouts == "any" and body.identity
                                                 else None))
        wakeup.notify()
        if body.records:
            rec = {**rec, "records": cp.candidate_records(
                rec["candidates"], body.records,
                other_than=body.identity_id if body.layouts == "any" else None)}
        return rec

    @app.get("/v1/transfers", response_model=list[TransferOut], tags=["transfers"])
    def list_transfers(
        state: TransferState | None = None,
        target_worker: Annotated[str | None, Query(pattern=_WORKER)] = None,
        identity_id: Annotated[str | None, Query(pattern=_IDENT)] = None,
    ) -> Any:
        """Transfers matching every given filter, oldest first."""
        return cp.list_transfers(state=state, target_worker=target_worker,
                                 identity_id=identity_id)

    @app.get("/v1/transfers/{transfer_id}", response_model=TransferOut, tags=["transfers"])
    def get_transfer(transfer_id: TransferPath) -> Any:
        """State, bytes done/total, rate, source, error."""
        return cp.get_transfer(transfer_id)

    @app.post("/v1/transfers/{transfer_id}/progress", response_model=ProgressOut,
              tags=["transfers"])
    async def progress(transfer_id: TransferPath, body: ProgressIn) -> Any:
        """Worker totals. ``stop: true`` in the reply: abort at the next chunk and
        finish with STOPPED."""
        rec = cp.progress(transfer_id, body.bytes_done, body.bytes_total, body.rate_bps,
                          source_id=body.source_id)
        return {"transfer": rec, "stop": rec["state"] == TransferState.STOPPING.value}

    @app.post("/v1/transfers/{transfer_id}/finish", response_model=TransferOut,
              tags=["transfers"])
    def finish(transfer_id: TransferPath, body: FinishIn) -> Any:
        """Final state from the worker. STOPPED only after a stop was asked."""
        outcome = dataclasses.asdict(body.outcome) if body.outcome is not None else None
        return cp.finish(transfer_id, TransferState(body.state), body.error, body.bytes_done,
                         outcome, source_id=body.source_id)

    @app.post("/v1/artifacts/outcomes", status_code=204, tags=["artifacts"])
    def artifact_outcome(body: ArtifactOutcomeIn) -> Response:
        """An engine's compiled-artifact outcome: counted in ``/metrics``
        (``mx_artifacts_total{kind,outcome}``, ``mx_artifacts_compiled_anyway_total``)."""
        metrics.artifact_outcome(body.kind, body.outcome, body.compiled)
        log.info("artifacts %s for identity %s (%s, worker %s%s): %s", body.outcome,
                 body.identity_id, body.kind, body.worker_id or "?",
                 ", compiled anyway" if body.compiled else "", body.detail[:200])
        return Response(status_code=204)

    @app.post("/v1/transfers/{transfer_id}/stop", response_model=TransferOut,
              tags=["transfers"])
    def stop(transfer_id: TransferPath) -> Any:
        """Ask a transfer to stop; idempotent. 409 once it SUCCEEDED or FAILED."""
        return cp.stop(transfer_id)

    @app.post("/v1/transfers/{transfer_id}/restart", response_model=TransferOut,
              tags=["transfers"])
    def restart(transfer_id: TransferPath) -> Any:
        """STOPPED or FAILED -> PENDING with the same id (a new source if the old is gone)."""
        rec = cp.restart(transfer_id)
        wakeup.notify()
        return rec

    # --- agents ------------------------------------------------------------------
    @app.put("/v1/agents/{agent_id}", response_model=AgentOut, tags=["agents"])
    def register_agent(agent_id: AgentPath, body: AgentRegister) -> Any:
        """Register a worker that runs REST-started transfers (re-registering releases
        transfers it claimed but never started)."""
        return cp.register_agent(agent_id, body.endpoint, body.labels)

    @app.get("/v1/agents", response_model=list[AgentOut], tags=["agents"])
    def list_agents() -> Any:
        """Every registered agent."""
        return cp.list_agents()

    @app.get("/v1/agents/{agent_id}/assignments", response_model=AssignmentsOut,
             tags=["agents"])
    async def assignments(
        agent_id: AgentPath,
        wait: Annotated[float, Query(ge=0, le=MAX_POLL_WAIT_S,
                                     description="seconds to wait for work")] = 0.0,
    ) -> Any:
        """Long poll: claim this agent's new PENDING transfers, waiting up to ``wait``
        seconds for one to appear. An empty list at the deadline is normal: poll again."""
        deadline = time.monotonic() + wait
        while True:
            claimed = await run_in_threadpool(cp.claim_assignments, agent_id)
            remaining = deadline - time.monotonic()
            if claimed or remaining <= 0:
                return {"transfers": claimed}
            await wakeup.wait(min(remaining, _POLL_RECHECK_S))

    # Bodies carry at most a manifest plus base64 metadata; anything larger is refused
    # before it is read (a 413, not a memory spike).
    max_body = settings.server_max_manifest_bytes + MAX_METADATA_B64 + (1 << 20)
    app.add_middleware(_Gate, token=token, max_body=max_body, metrics=metrics)
    return app


