"""Typed HTTP client of the control plane (httpx): :class:`MxClient`.

Used by workers (sources heartbeat, agents poll and report progress) and the CLI.
HTTP failures are translated here, at the boundary, into the error tree:

==========================  ===================================================
404                         :class:`~modelexpress.errors.NotFoundError`
409                         :class:`~modelexpress.errors.ConflictError`
401 / 403                   :class:`~modelexpress.errors.AuthError`
400 / 413 / 422             :class:`~modelexpress.errors.ValidationError`
connection errors, 502-504  :class:`~modelexpress.errors.ServerUnavailableError`
                            (after ``retries`` attempts with backoff)
==========================  ===================================================

Replicas: given several server URLs (``MX_SERVER_URL=http://a:8001,http://b:8001``,
servers on one Redis), every call fails over to the next replica on the failures it
would retry, at once, and stays with the replica that answered. One round tries each
replica once; rounds are separated by a jittered backoff (0.1 s doubling, capped at
2 s); ``retries`` bounds the extra rounds, ``timeout_s`` each request.

API versions (:mod:`modelexpress.wire`): every request says this client's
``X-MX-API-Version``; every response says the server's (none: version 1). The client
keeps each replica's version (replicas can differ in the middle of an upgrade) and
builds version-dependent bodies for the replica they go to: toward a version-1 server
it leaves out what that version does not take (a source's ``devices``), so a new
client keeps working against the previous release. A request an older server still
refuses (422) says so in its one line: both versions and "upgrade the server"; a
server that no longer serves this client answers 426, naming both versions.

Retries: a request that never reached the server (connect error) is retried for
every method. Requests that may have reached it (read timeout, 502-504) are retried
only when repeating them is harmless, which is every call here except
:meth:`MxClient.start_transfer` (a repeat would start a second transfer). Progress is
absolute totals, a repeated finish of the same state is a no-op on the server, and
stop is idempotent, so those retry safely.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import httpx
import pydantic

from modelexpress._closing import ClosedOnCollect
from modelexpress.errors import (
    AuthError, ConfigError, ConflictError, ControlPlaneError, NotFoundError, ServerUnavailableError,
    ValidationError,
)
from modelexpress.identity import ModelIdentity
from modelexpress.settings import MxSettings
from modelexpress.wire import (
    API_HEADER, API_VERSION, API_VERSIONS, MAX_RECORDS, AgentInfo, AssignmentsReply, OriginLease,
    ProgressReply, SourceInfo, TransferInfo, TransferOutcome, api_version_of,
)

__all__ = ["MxClient", "SourceInfo", "TransferInfo", "ProgressReply", "AgentInfo",
           "TransferOutcome", "OriginLease"]

log = logging.getLogger(__name__)

_BACKOFF_BASE_S = 0.1
_BACKOFF_CAP_S = 2.0
_RETRY_STATUS = frozenset({502, 503, 504})


def _outcome_json(outcome: dict[str, Any] | TransferOutcome) -> dict[str, Any]:
    """The outcome as the server takes it; ValidationError names what is wrong."""
    if isinstance(outcome, TransferOutcome):
        return dataclasses.asdict(outcome)
    names = [f.name for f in dataclasses.fields(TransferOutcome)]
    unknown = set(outcome) - set(names)
    if unknown:
        raise ValidationError(f"outcome: unknown key(s) {sorted(unknown)}; allowed: {names}")
    try:
        return dataclasses.asdict(TransferOutcome.from_json(outcome))
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValidationError(f"outcome.{where}: {first['msg']} "
                              f"(got {first.get('input')!r})") from exc


_R = TypeVar("_R")


def _reply(cls: type[_R], data: Any) -> _R:
    # A reply that does not fit the wire model is the server's fault (or a proxy's), not
    # the caller's: one error of our tree that names the model, never a pydantic error.
    try:
        return cls.from_json(data)  # type: ignore[attr-defined, no-any-return]
    except pydantic.ValidationError as exc:
        raise ControlPlaneError(f"unexpected reply from the control plane: not a "
                                f"{cls.__name__}: {exc.errors()[0]}") from exc


class MxClient(ClosedOnCollect):
    """Client of the control plane: one server, or several replicas of it.

    Args:
        base_url: e.g. ``http://127.0.0.1:8001``; replicas (on one Redis) as a list or
            a comma-separated string (``MX_SERVER_URL``), tried in order.
        token: bearer token (``MX_SERVER_TOKEN``), or None.
        timeout_s: timeout of one HTTP request (connect, read, write each).
        retries: extra attempts after a retryable failure (see module docstring).
        transport: a synchronous httpx transport (``httpx.BaseTransport``), e.g.
            ``httpx.MockTransport`` for a fake control plane in tests.
            ``httpx.ASGITransport`` is async-only and cannot drive this client; to
            talk to the real app, serve it on loopback (``modelexpress serve``) and pass
            its URL.

    Use as a context manager, or call :meth:`close`.

    Example, against a fake control plane::

        def handler(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json={"status": "ok", "store": "fake"})

        with MxClient("http://mx.test", transport=httpx.MockTransport(handler)) as client:
            assert client.health()["status"] == "ok"
    """

    def __init__(self, base_url: str | Sequence[str], *, token: str | None = None,
                 timeout_s: float = 10.0, retries: int = 3,
                 transport: httpx.BaseTransport | None = None) -> None:
        urls = base_url.split(",") if isinstance(base_url, str) else list(base_url)
        self.base_urls: tuple[str, ...] = tuple(
            u.strip().rstrip("/") for u in urls if u.strip())
        if not self.base_urls:
            raise ConfigError(f"MxClient needs a server URL (got {base_url!r}); set "
                              "MX_SERVER_URL, e.g. http://127.0.0.1:8001")
        # What recreates this client elsewhere (a source's guardian gets it): every replica.
        self.base_url = ",".join(self.base_urls)
        self.token = token  # kept for helpers that act for this client (a source's guardian)
        self.timeout_s = timeout_s
        self.retries = retries
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        headers[API_HEADER] = str(API_VERSION)
        self._http = httpx.Client(headers=headers, timeout=timeout_s, transport=transport)
        self._current = 0  # the replica that answered last; tried first
        self._api: dict[str, int] = {}  # replica URL -> the API version it declared
        self._closed = False

    @property
    def current_url(self) -> str:
        """The server replica this client talks to now (the first of ``base_urls``
        until one fails)."""
        return self.base_urls[self._current]

    @property
    def server_api_version(self) -> int | None:
        """The API version of the replica this client talks to now (None: not asked yet)."""
        return self._api.get(self.current_url)

    def _learn_version(self, url: str, resp: httpx.Response) -> int:
        try:
            version = api_version_of(resp.headers)
        except ValueError as exc:
            log.warning("control plane %s: %s; taken as API version 1", url, exc)
            version = 1
        if self._api.get(url) != version:
            self._api[url] = version
            if version < API_VERSION:
                log.info("control plane %s speaks API version %d (%s); this client speaks %d "
                         "and leaves out what version %d lacks until it is upgraded", url,
                         version, API_VERSIONS.get(version, "an unknown version"), API_VERSION,
                         version)
        return version

    def _version_at(self, url: str, timeout: float) -> int:
        """The replica's API version, asked with ``GET /v1/health`` the first time."""
        if url not in self._api:
            self._learn_version(url, self._http.get(url + "/v1/health", timeout=timeout))
        return self._api[url]

    @classmethod
    def from_settings(cls, settings: MxSettings, **overrides: Any) -> "MxClient":
        """Build from ``MX_SERVER_URL`` (one URL or a comma-separated list of replicas),
        ``MX_SERVER_TOKEN``, ``MX_CLIENT_TIMEOUT_S``, ``MX_CLIENT_RETRIES``; keyword
        arguments override them."""
        token = settings.server_token.get_secret_value() if settings.server_token else None
        kwargs: dict[str, Any] = {"token": token, "timeout_s": settings.client_timeout_s,
                                  "retries": settings.client_retries}
        kwargs.update(overrides)
        return cls(settings.server_url, **kwargs)

    # --- plumbing ---------------------------------------------------------------
    def _send(self, method: str, path: str, *, json: Any | Callable[[int], Any] = None,
              params: dict[str, Any] | None = None, idempotent: bool = True,
              timeout_s: float | None = None) -> httpx.Response:
        """One request, failing over between replicas and retrying (module docstring).

        Each round tries every replica once, starting with the one that answered last;
        rounds are separated by a jittered backoff; at most ``retries + 1`` rounds.
        ``json`` may be a function of the replica's API version (a body that depends
        on what the server takes).
        """
        if self._closed:
            raise ControlPlaneError(f"MxClient for {self.base_url} is closed")
        params = {k: v for k, v in (params or {}).items() if v is not None}
        timeout = self.timeout_s if timeout_s is None else timeout_s
        n = len(self.base_urls)
        last_resp: httpx.Response | None = None
        reason = ""
        attempts = 0
        for round_ in range(self.retries + 1):
            if round_:
                delay = (min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2 ** (round_ - 1))
                         * (0.5 + random.random()))
                log.warning("%s %s: %s; retry %d/%d in %.2f s", method, path, reason,
                            round_, self.retries, delay)
                time.sleep(delay)
            start = self._current
            for k in range(n):
                i = (start + k) % n
                url = self.base_urls[i]
                attempts += 1
                sent = False  # whether this request itself may have reached the server
                try:
                    # (the version is asked with a GET of its own: safe to repeat)
                    body = json(self._version_at(url, timeout)) if callable(json) else json
                    sent = True
                    resp = self._http.request(method, url + path, json=body, params=params,
                                              timeout=timeout)
                    self._learn_version(url, resp)
                except httpx.TransportError as exc:
                    reason = f"{url}: {type(exc).__name__}: {exc}"
                    last_resp = None
                    # ConnectError: nothing reached the server, always safe to repeat
                    # (there or on another replica). Anything else may have reached it.
                    if sent and not (isinstance(exc, httpx.ConnectError) or idempotent):
                        raise ServerUnavailableError(
                            f"{method} {url}{path} failed after {attempts} attempt(s) (not "
                            f"repeated: it may have reached the server): "
                            f"{type(exc).__name__}: {exc}") from exc
                else:
                    if resp.status_code not in _RETRY_STATUS or not idempotent:
                        if i != self._current:
                            log.warning("control plane: %s answered; using it from now on "
                                        "(%s failed: %s)", url, self.current_url, reason)
                            self._current = i
                        return resp
                    reason = f"{url}: HTTP {resp.status_code}"
                    last_resp = resp
                if n > 1 and k < n - 1:
                    log.info("%s %s: %s; failing over to %s", method, path, reason,
                             self.base_urls[(i + 1) % n])
        if last_resp is not None:
            return last_resp  # the server's own words (e.g. 503 "store unavailable: ...")
        raise ServerUnavailableError(
            f"{method} {path} failed after {attempts} attempt(s) on "
            f"{'every server (' + self.base_url + ')' if n > 1 else self.base_url}; "
            f"last: {reason}")

    def _request(self, method: str, path: str, *, json: Any | Callable[[int], Any] = None,
                 params: dict[str, Any] | None = None, idempotent: bool = True,
                 timeout_s: float | None = None) -> Any:
        resp = self._send(method, path, json=json, params=params, idempotent=idempotent,
                          timeout_s=timeout_s)
        return self._decode(method, path, resp)

    def _decode(self, method: str, path: str, resp: httpx.Response) -> Any:
        status = resp.status_code
        if status < 400:
            if status == 204 or not resp.content:
                return None
            return resp.json()
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        msg = f"{method} {path}: HTTP {status}: {detail}"
        if status == 426:  # the server's line already names both versions
            raise ControlPlaneError(f"{method} {path}: {detail}")
        try:
            server_api = api_version_of(resp.headers)  # what the answering server speaks
        except ValueError:
            server_api = 1
        # An older server refuses what it does not know: a field (422) or a route (FastAPI's
        # own 404 "Not Found" and 405, not ours, which name the missing record).
        unknown = status == 422 or (status in (404, 405) and detail in ("Not Found",
                                                                        "Method Not Allowed"))
        if unknown and server_api < API_VERSION:
            msg += (f" (the control plane at {resp.request.url.host}:{resp.request.url.port} "
                    f"speaks API version {server_api}, this client version {API_VERSION}: "
                    "upgrade the server; servers go first, see docs/DEPLOYMENT.md, Upgrading)")
        if status == 404:
            raise NotFoundError(msg)
        if status == 409:
            raise ConflictError(msg)
        if status in (401, 403):
            raise AuthError(msg + " (set MX_SERVER_TOKEN to the server's token)")
        if status in (400, 413, 422):
            raise ValidationError(msg)
        if status in _RETRY_STATUS:
            raise ServerUnavailableError(msg)
        raise ControlPlaneError(msg)

    def close(self) -> None:
        """Close the connection pool; idempotent."""
        if not self._closed:
            self._closed = True
            self._http.close()

    # --- meta ---------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """``GET /v1/health``: ``{"status": "ok"|"degraded", "store": url, ...}``.

        A degraded server (store down) answers 503, reported as ServerUnavailableError.
        """
        return self._request("GET", "/v1/health")

    def metrics_text(self) -> str:
        """The Prometheus exposition text of ``/metrics``."""
        resp = self._send("GET", "/metrics")
        if resp.status_code >= 400:
            self._decode("GET", "/metrics", resp)
        return resp.text

    # --- sources -----------------------------------------------------------------
    def publish_source(self, identity: ModelIdentity, worker_id: str, *,
                       manifest: dict[str, Any], agent_metadata: bytes = b"",
                       endpoint: str = "",
                       state: Literal["INITIALIZING", "READY"] = "READY",
                       devices: Sequence[str] = (),
                       layout: dict[str, Any] | None = None) -> SourceInfo:
        """Publish (or re-publish) this worker's source for ``identity``.

        Args:
            identity: what the worker holds.
            worker_id: unique per worker process/rank (``[A-Za-z0-9._-]``, <= 128 chars).
            manifest: the transfer layer's manifest (a JSON object).
            agent_metadata: NIXL agent metadata bytes (sent base64).
            endpoint: how peers reach the worker's NIXL agent.
            state: READY, or INITIALIZING while the weights are still loading.
            devices: UUIDs of the GPUs the served memory is on (API version 2; left
                out for a version-1 server, which has no place for them: they are
                also in the manifest's attributes).
            layout: the layout of the served loaded form (:mod:`modelexpress.layout`
                JSON; API version 5: left out for an older server, and the source then
                serves targets of its own layout only).

        Returns:
            The stored source; its ``id`` is what :meth:`heartbeat` takes.

        Raises:
            ValidationError: bad fields or a manifest over the server's limit.
        """
        body = {"identity": identity.to_dict(), "worker_id": worker_id, "endpoint": endpoint,
                "agent_metadata": base64.b64encode(agent_metadata).decode(),
                "manifest": manifest, "state": state}

        def for_version(version: int) -> dict[str, Any]:
            out = {**body, "devices": list(devices)} if version >= 2 and devices else body
            return {**out, "layout": layout} if version >= 5 and layout is not None else out

        return _reply(SourceInfo, self._request("PUT", "/v1/sources", json=for_version))

    def heartbeat(self, source_id: str,
                  state: Literal["INITIALIZING", "READY", "STALE"] | None = None) -> SourceInfo:
        """Tell the server the source is alive, optionally moving it to ``state``.

        Raises:
            NotFoundError: the record was collected (stale too long): publish again.
            ConflictError: illegal move (e.g. READY -> INITIALIZING).
        """
        return _reply(SourceInfo, self._request(
            "POST", f"/v1/sources/{source_id}/heartbeat", json={"state": state}))

    def mark_stale(self, source_id: str) -> SourceInfo:
        """Withdraw a source (shutdown or data-plane failure): heartbeat with STALE."""
        return self.heartbeat(source_id, "STALE")

    def get_source(self, source_id: str) -> SourceInfo:
        """One source with ``manifest`` and ``agent_metadata`` (bytes).

        Raises:
            NotFoundError: no such source.
        """
        return _reply(SourceInfo, self._request("GET", f"/v1/sources/{source_id}"))

    def list_sources(self, *, model: str | None = None, revision: str | None = None,
                     state: str | None = None, rank: int | None = None,
                     identity: ModelIdentity | str | None = None,
                     worker_id: str | None = None) -> list[SourceInfo]:
        """Sources matching every given filter (without manifests), oldest first."""
        ident = identity.id if isinstance(identity, ModelIdentity) else identity
        rows = self._request("GET", "/v1/sources", params={
            "model": model, "revision": revision, "state": state, "rank": rank,
            "identity_id": ident, "worker_id": worker_id})
        return [_reply(SourceInfo, r) for r in rows]

    def delete_source(self, source_id: str) -> None:
        """Delete a source. Raises NotFoundError when it does not exist."""
        self._request("DELETE", f"/v1/sources/{source_id}")

    # --- transfers ---------------------------------------------------------------
    def start_transfer(self, identity: ModelIdentity | str, target_worker: str, *,
                       source_id: str | None = None,
                       policy: Literal["random", "spread"] | None = None,
                       run_by_target: bool = False, relay_read: bool = False,
                       relay_serve: bool = False,
                       across_layouts: bool = False, records: int = 0) -> TransferInfo:
        """Start a transfer of ``identity`` to the agent ``target_worker`` (PENDING).

        Not retried after the request may have reached the server (it would start a
        second transfer); a ServerUnavailableError here means "unknown": list the
        target's transfers before starting another.

        Args:
            run_by_target: the calling process runs the pull itself and reports on it
                (what :func:`modelexpress.p2p.pull` does); no agent claims it.
            relay_read: with ``run_by_target``: the server plans it at once as a fleet
                relay reader (``relay_path`` may start at a relaying agent's transfer).
            relay_serve: with ``relay_read``: it is also a holder that later transfers
                may read from (its ``relay`` is true; the caller serves it).
            Both need API version 3: left out for an older server, which plans no
            relay (the transfer then reads its candidates as before).
            records: the reply's ``records`` carry the whole records of the first this
                many candidates, at most :data:`~modelexpress.wire.MAX_RECORDS` (with
                ``across_layouts``, of other identities), as :meth:`get_source` returns
                them (API version 6; an older server returns none: ask for them then).

        Raises:
            ConflictError: no READY source (or the named source is not READY).
            NotFoundError: the named source does not exist.
        """
        ident = identity.id if isinstance(identity, ModelIdentity) else identity
        body = {"identity_id": ident, "target_worker": target_worker,
                "source_id": source_id, "policy": policy, "run_by_target": run_by_target}
        relay = {**({"relay_read": True} if relay_read else {}),
                 **({"relay_serve": True} if relay_serve else {})}

        if across_layouts:
            if not isinstance(identity, ModelIdentity):
                raise ValueError("across_layouts needs the target's ModelIdentity")
            relay = {**relay, "layouts": "any", "identity": identity.to_dict()}
        wanted = {"records": min(records, MAX_RECORDS)} if records else {}

        def for_version(version: int) -> dict[str, Any]:
            if across_layouts and version < 5:
                raise ControlPlaneError(
                    f"the control plane at {self.current_url} speaks API version {version}; "
                    f"pulls across parallel layouts need version 5: upgrade the server")
            return {**body, **(relay if version >= 3 else {}),
                    **(wanted if version >= 6 else {})}

        # Only a body that depends on the version asks the replica's version first
        # (GET /v1/health, once per replica).
        return _reply(TransferInfo, self._request(
            "POST", "/v1/transfers", idempotent=False,
            json=for_version if relay or wanted else body))

    def rank_sources(self, identity: ModelIdentity | str, *,
                     policy: Literal["random", "spread"] | None = None,
                     exclude_worker: str | None = None) -> list[SourceInfo]:
        """READY sources of ``identity`` in the order to try them (the server's policy).

        Args:
            policy: ``random`` or ``spread``; the server's ``MX_SOURCE_POLICY`` when None.
            exclude_worker: leave this worker's own sources out.
        """
        ident = identity.id if isinstance(identity, ModelIdentity) else identity
        rows = self._request("GET", f"/v1/identities/{ident}/candidates",
                             params={"policy": policy, "exclude_worker": exclude_worker})
        return [_reply(SourceInfo, r) for r in rows]

    def get_transfer(self, transfer_id: str) -> TransferInfo:
        """One transfer. Raises NotFoundError for an unknown id."""
        return _reply(TransferInfo, self._request("GET", f"/v1/transfers/{transfer_id}"))

    def list_transfers(self, *, state: str | None = None, target_worker: str | None = None,
                       identity: ModelIdentity | str | None = None) -> list[TransferInfo]:
        """Transfers matching every given filter, oldest first."""
        ident = identity.id if isinstance(identity, ModelIdentity) else identity
        rows = self._request("GET", "/v1/transfers", params={
            "state": state, "target_worker": target_worker, "identity_id": ident})
        return [_reply(TransferInfo, r) for r in rows]

    def report_progress(self, transfer_id: str, bytes_done: int, bytes_total: int,
                        rate_bps: float = 0.0, source_id: str | None = None) -> ProgressReply:
        """Report running totals (the first report moves PENDING to RUNNING).

        Args:
            source_id: the source being read now, when it is not the one the record
                names (the target moved on to the next candidate).

        Returns:
            The record and ``stop``: when true, abort at the next chunk and finish
            with STOPPED.

        Raises:
            ConflictError: the transfer already finished.
        """
        data = self._request("POST", f"/v1/transfers/{transfer_id}/progress",
                             json={"bytes_done": bytes_done, "bytes_total": bytes_total,
                                   "rate_bps": rate_bps, "source_id": source_id})
        return _reply(ProgressReply, data)

    def finish_transfer(self, transfer_id: str,
                        state: Literal["SUCCEEDED", "FAILED", "STOPPED"], *,
                        error: str | None = None, bytes_done: int | None = None,
                        outcome: dict[str, Any] | TransferOutcome | None = None,
                        source_id: str | None = None) -> TransferInfo:
        """The worker's final report.

        Args:
            error: why it failed (FAILED), or None.
            bytes_done: final byte count, when the last progress report is behind it.
            outcome: how it went, for the record and the server's metrics: keys of
                :class:`~modelexpress.wire.TransferOutcome` (``transport`` UCX used,
                ``rate_bps``, ``verdict`` ok/slow/unknown, ``data_plane_s``,
                ``total_s``); omitted keys take its defaults.

                An outcome this client cannot send (an unknown key, a value out of
                range) is left out with a WARNING that says why: the finish itself,
                the transfer's final state, is never lost to its metrics.
            source_id: with SUCCEEDED, the source read last when the record names
                another (API version 6; left out for an older server, where a progress
                report moves it).

        Raises:
            ConflictError: illegal, e.g. SUCCEEDED after a stop was asked (the stop
                won), or STOPPED when no stop was asked.
        """
        body: dict[str, Any] = {"state": state, "error": error, "bytes_done": bytes_done}
        if outcome is not None:
            try:
                body["outcome"] = _outcome_json(outcome)
            except ValidationError as exc:
                log.warning("transfer %s: finishing without its outcome: %s", transfer_id, exc)
        if source_id is None:
            return _reply(TransferInfo, self._request(
                "POST", f"/v1/transfers/{transfer_id}/finish", json=body))
        return _reply(TransferInfo, self._request(
            "POST", f"/v1/transfers/{transfer_id}/finish",
            json=lambda version: {**body, "source_id": source_id} if version >= 6 else body))

    def stop_transfer(self, transfer_id: str) -> TransferInfo:
        """Ask a transfer to stop (STOPPING; STOPPED at once if no agent claimed it).

        Raises:
            ConflictError: it already SUCCEEDED or FAILED.
        """
        return _reply(TransferInfo, self._request("POST", f"/v1/transfers/{transfer_id}/stop"))

    def restart_transfer(self, transfer_id: str) -> TransferInfo:
        """Put a STOPPED or FAILED transfer back to PENDING (same id).

        Raises:
            ConflictError: not STOPPED/FAILED, or no READY source left.
        """
        return _reply(TransferInfo, self._request(
            "POST", f"/v1/transfers/{transfer_id}/restart"))

    # --- origin leases ----------------------------------------------------------------
    def acquire_origin(self, identity: ModelIdentity | str, holder: str,
                       ttl_s: float) -> OriginLease:
        """Take the origin lease of ``identity``: become the one target that reads it from
        storage (``modelexpress.server.origins``). Taking one already held renews it.

        Raises:
            ConflictError: another holder's lease has not expired.
            NotFoundError: the server predates API version 4 (no origin leases).
        """
        ident = identity.id if isinstance(identity, ModelIdentity) else identity
        return _reply(OriginLease, self._request(
            "POST", f"/v1/identities/{ident}/origin", json={"holder": holder, "ttl_s": ttl_s}))

    def renew_origin(self, identity: ModelIdentity | str, holder: str, generation: int,
                     ttl_s: float, *, release: bool = False, source_id: str | None = None,
                     digest_algorithm: str | None = None,
                     digests: dict[str, str] | None = None, bytes_done: int | None = None,
                     bytes_total: int | None = None, storage: str | None = None
                     ) -> OriginLease:
        """Extend the origin lease by ``ttl_s`` (``release``: end it), reporting the
        source served while loading, progress, and digests read from storage (merged).

        Raises:
            ConflictError: another holder took the lease: stop reading as the origin.
            NotFoundError: no lease for the identity.
        """
        ident = identity.id if isinstance(identity, ModelIdentity) else identity
        body: dict[str, Any] = {"holder": holder, "generation": generation, "ttl_s": ttl_s,
                                "release": release}
        for key, value in (("source_id", source_id), ("digest_algorithm", digest_algorithm),
                           ("bytes_done", bytes_done), ("bytes_total", bytes_total),
                           ("storage", storage)):
            if value is not None:
                body[key] = value
        if digests:
            body["digests"] = dict(digests)
        return _reply(OriginLease, self._request(
            "POST", f"/v1/identities/{ident}/origin/renew", json=body))

    def get_origin(self, identity: ModelIdentity | str) -> OriginLease:
        """The origin lease of ``identity`` with every digest recorded so far.

        Raises:
            NotFoundError: no target ever became its origin (or an older server).
        """
        ident = identity.id if isinstance(identity, ModelIdentity) else identity
        return _reply(OriginLease, self._request("GET", f"/v1/identities/{ident}/origin"))

    # --- compiled artifacts --------------------------------------------------------
    def report_artifact_outcome(self, identity_id: str, kind: str, outcome: str, *,
                                compiled: bool | None = None, worker_id: str | None = None,
                                source_id: str | None = None, detail: str = "") -> None:
        """Tell the control plane what an engine did with compiled artifacts (its
        ``/metrics`` counts them: ``mx_artifacts_total{kind,outcome}``).

        Raises:
            ValidationError: a value out of range (outcome not one of hit, miss, refused,
                present, off, error).
            NotFoundError: a server older than API version 2 (no such route).
        """
        self._request("POST", "/v1/artifacts/outcomes", json={
            "identity_id": identity_id, "kind": kind, "outcome": outcome,
            "compiled": compiled, "worker_id": worker_id, "source_id": source_id,
            "detail": detail[:1024]}, idempotent=False)

    # --- agents ------------------------------------------------------------------
    def register_agent(self, agent_id: str, *, endpoint: str = "",
                       labels: dict[str, str] | None = None) -> AgentInfo:
        """Register a worker that runs REST-started transfers. Re-registering (after
        a restart) releases the transfers it claimed but never started."""
        return _reply(AgentInfo, self._request(
            "PUT", f"/v1/agents/{agent_id}", json={"endpoint": endpoint,
                                                   "labels": labels or {}}))

    def list_agents(self) -> list[AgentInfo]:
        """Every registered agent."""
        return [_reply(AgentInfo, r) for r in self._request("GET", "/v1/agents")]

    def poll_assignments(self, agent_id: str, wait_s: float = 30.0) -> list[TransferInfo]:
        """Long poll: claim new PENDING transfers for ``agent_id``, waiting up to
        ``wait_s`` (<= 60) for one. An empty list at the deadline is normal.

        Raises:
            NotFoundError: the agent is not registered (call :meth:`register_agent`).
        """
        data = self._request("GET", f"/v1/agents/{agent_id}/assignments",
                             params={"wait": wait_s}, timeout_s=wait_s + self.timeout_s,
                             # a repeat after a lost reply would miss what the first
                             # claimed; the agent re-registers instead (releases claims)
                             idempotent=False)
        return _reply(AssignmentsReply, data).transfers
