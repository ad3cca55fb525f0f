"""What the control plane sends back, defined once for the server and the client.

The server (``modelexpress.server.models``) declares these as its response models and
the client (:mod:`modelexpress.client`) parses replies with them, so a field added
here reaches both ends. Only pydantic (a core dependency) is imported: a worker that
never runs the server does not need FastAPI.

They are pydantic dataclasses, frozen: callers read attributes, compare records, and
use ``dataclasses.asdict`` on them (the CLI's ``--json`` output), as they did when
the client declared its own plain dataclasses. Parse a reply with
``SourceInfo.from_json(data)`` (or ``pydantic.TypeAdapter(SourceInfo)``).

Replies ignore keys they do not declare instead of failing: a record written by a
newer server version (a shared Redis during a rolling upgrade), or a newer server
answering an older client, must not break the reader.

Request bodies (what a client sends and the server validates strictly, with bounds)
stay in ``modelexpress.server.models``. :class:`TransferOutcome` is here because it
travels both ways: in a worker's finish report and in the record's ``outcome``.

API versions: every request carries ``X-MX-API-Version`` (:data:`API_HEADER`) with the
client's :data:`API_VERSION`, every response the server's, and ``GET /v1/health``
says the server's range (:class:`HealthReply`). A peer that sends none is version 1,
the API before versions were exchanged. Each side serves the previous version for
everything that version has (:data:`API_VERSIONS` says what each added); what it
cannot do fails with one line naming both versions and what to upgrade.

Sources come in three shapes over one set of fields::

    SourceSummary            lists, publish and heartbeat replies
      +-- SourceDetail       GET /v1/sources/{id}: + manifest, agent_metadata (required)
      +-- SourceInfo         what the client returns for all of them (detail optional)
"""

from __future__ import annotations

import base64
import binascii
import functools
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BeforeValidator, ConfigDict, Field, PlainSerializer, StringConstraints, TypeAdapter
from pydantic.dataclasses import dataclass

from modelexpress.identity import ModelIdentity

__all__ = [
    "API_HEADER", "API_VERSION", "API_VERSIONS", "MIN_API_VERSION", "api_version_of",
    "SOURCE_STATES", "TRANSFER_STATES", "TRANSPORT_PATTERN", "VERDICTS",
    "SourceStateName", "TransferStateName",
    "TransferOutcome", "SourceSummary", "SourceInfo", "SourceDetail", "TransferInfo",
    "ProgressReply", "AgentInfo", "AssignmentsReply", "OriginLease", "HealthReply",
    "ErrorReply",
]

SourceStateName = Literal["INITIALIZING", "READY", "STALE"]
"""A source's state on the wire (``modelexpress.server.states.SourceState`` values)."""
TransferStateName = Literal["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPING", "STOPPED"]
"""A transfer's state on the wire (``modelexpress.server.states.TransferState`` values)."""
SOURCE_STATES: tuple[str, ...] = SourceStateName.__args__  # type: ignore[attr-defined]
TRANSFER_STATES: tuple[str, ...] = TransferStateName.__args__  # type: ignore[attr-defined]

TRANSPORT_PATTERN = r"^[A-Za-z0-9_]{1,32}(\+[A-Za-z0-9_]{1,32}){0,15}$"
"""UCX transport names as a result reports them: ``cma``, ``rc_mlx5``, ``cma+tcp``, ``unknown``."""

VERDICTS = ("ok", "slow", "unknown")
"""Rate verdicts (``modelexpress.transfer.transport``: VERDICT_OK, VERDICT_SLOW, UNKNOWN)."""

API_HEADER = "X-MX-API-Version"
"""The header that carries a request's (client's) or a response's (server's) API version."""

API_VERSION = 6
"""The control-plane API version this release speaks."""

MIN_API_VERSION = 1
"""The oldest version of the other side this release still works with."""

MAX_RECORDS = 16
"""The most candidates' records ``POST /v1/transfers`` returns with a transfer (API 6)."""

API_VERSIONS: dict[int, str] = {
    1: "the API before versions were exchanged (no X-MX-API-Version header; modelexpress "
       "up to commit fb298dc)",
    2: "X-MX-API-Version on every request and response; health reports the server's API "
       "range; a source record names its GPUs by UUID (devices); engines report "
       "compiled-artifact outcomes (POST /v1/artifacts/outcomes)",
    3: "a pull's transfer may be planned at creation as a fleet-relay reader "
       "(relay_read) and holder (relay_serve) on POST /v1/transfers",
    4: "origin leases (GET, POST /v1/identities/{id}/origin, .../renew): one target of a "
       "model no peer holds reads it from storage and serves it while it loads; a "
       "fleet-relay transfer may be planned behind that loading origin",
    5: "a source publishes the layout of its loaded form (layout on PUT /v1/sources, "
       "returned by GET /v1/sources/{id}); POST /v1/transfers with layouts=any and the "
       "target's identity ranks sources of other parallel layouts too",
    6: "a SUCCEEDED finish with bytes_done also sets the record's bytes_total to it and "
       "its rate_bps to the outcome's, and may name the source read last (source_id): a "
       "pull's last progress report is folded into its finish; POST /v1/transfers with "
       "records=N returns the whole records of its first N candidates (a pull asks for "
       "none of them again)",
}
"""What each API version added (the upgrade notes a version mismatch points at)."""


def api_version_of(headers: Any) -> int:
    """The API version a request's or response's headers declare; 1 when they declare none.

    Raises:
        ValueError: the header is not a positive whole number.
    """
    raw = headers.get(API_HEADER)
    if raw is None:
        return 1
    try:
        version = int(str(raw).strip())
    except ValueError:
        raise ValueError(f"{API_HEADER}: {raw!r} is not a whole number") from None
    if version < 1:
        raise ValueError(f"{API_HEADER}: {version} is not a version (they start at 1)")
    return version


_REPLY = ConfigDict(extra="ignore")
_Seconds = Annotated[float, Field(ge=0, le=1e7, allow_inf_nan=False)]
_T = TypeVar("_T")


def _b64decode(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"not valid base64: {exc}") from exc
    return value


Base64Bytes = Annotated[
    bytes, BeforeValidator(_b64decode),
    PlainSerializer(lambda raw: base64.b64encode(raw).decode("ascii"), return_type=str,
                    when_used="json")]
"""Bytes in Python, standard padded base64 (no line breaks) in JSON."""


@functools.cache
def _adapter(cls: type[_T]) -> TypeAdapter[_T]:
    return TypeAdapter(cls)


class _Parse:
    """``from_json``: build the record from a decoded JSON reply (unknown keys ignored)."""

    @classmethod
    def from_json(cls: type[_T], data: Any) -> _T:
        """Validate ``data`` (a decoded JSON object) into this record.

        Raises:
            pydantic.ValidationError: a field is missing or has the wrong type.
        """
        return _adapter(cls).validate_python(data)


@dataclass(frozen=True, config=_REPLY)
class TransferOutcome(_Parse):
    """How a finished transfer went, as its target observed it.

    Attributes:
        transport: what UCX reported using for the READs (``cuda_ipc``, ``rc_mlx5``,
            ``tcp``, ``cma``, several joined by ``+``), ``local`` for a pull that
            moved nothing over the network, or ``unknown``.
        rate_bps: bytes per second of the data plane.
        verdict: the rate verdict: ``ok``, ``slow`` (below the transport's floor, or
            a fallback UCX reported), ``unknown`` (no verdict was reached).
        data_plane_s: seconds the READs took (0 when none ran).
        total_s: seconds from the pull's start to its end, control plane included;
            None when the reporter does not know.
    """

    transport: Annotated[str, StringConstraints(pattern=TRANSPORT_PATTERN)] = "unknown"
    rate_bps: Annotated[float, Field(ge=0, le=1e15, allow_inf_nan=False)] = 0.0
    verdict: Literal["ok", "slow", "unknown"] = "unknown"
    data_plane_s: _Seconds = 0.0
    total_s: _Seconds | None = None


@dataclass(frozen=True, config=_REPLY)
class SourceSummary(_Parse):
    """A published source: one worker rank holding one identity (no manifest)."""

    id: str
    identity_id: str
    identity: dict[str, Any]
    worker_id: str
    endpoint: str
    state: SourceStateName
    created_at: float
    updated_at: float
    last_heartbeat: float
    manifest_bytes: int
    fingerprint: str = Field(
        "", description="Hash of the content the manifest serves (tensor names, dtypes, "
                        "shapes, sizes, digests; not addresses): sources of one identity "
                        "with equal fingerprints serve the same weights. Empty for "
                        "records published before fingerprints.")
    devices: tuple[str, ...] = Field(
        (), description="UUIDs of the GPUs whose memory the source serves (GPU-...), as "
                        "nvidia-smi -L and CUDA_VISIBLE_DEVICES name them; empty for host "
                        "memory and for records of API version 1 publishers.")
    layout_bytes: int = Field(
        0, description="Size of the layout the source published (compact JSON; API "
                       "version 5), 0 when it published none: it serves targets of its own "
                       "parallel layout only.")

    @property
    def model_identity(self) -> ModelIdentity:
        """The identity as our dataclass."""
        return ModelIdentity.from_dict(self.identity)


@dataclass(frozen=True, config=_REPLY, kw_only=True)
class SourceDetail(SourceSummary):
    """A source with its manifest and NIXL agent metadata (``GET /v1/sources/{id}``)."""

    manifest: dict[str, Any]
    agent_metadata: Base64Bytes
    layout: dict[str, Any] | None = Field(
        None, description="The layout of the loaded form (modelexpress.layout JSON; API "
                          "version 5), null when the source published none.")


@dataclass(frozen=True, config=_REPLY, kw_only=True)
class SourceInfo(SourceSummary):
    """A source as the client returns it. ``manifest``, ``agent_metadata`` (bytes) and
    ``layout`` are set only by ``MxClient.get_source`` (lists leave them out)."""

    manifest: dict[str, Any] | None = None
    agent_metadata: Base64Bytes | None = None
    layout: dict[str, Any] | None = None


@dataclass(frozen=True, config=_REPLY)
class TransferInfo(_Parse):
    """A transfer record as the server holds it."""

    id: str
    identity_id: str
    target_worker: str
    source_id: str
    source_worker: str
    source_endpoint: str
    state: TransferStateName
    bytes_done: int
    bytes_total: int
    rate_bps: float
    error: str | None
    stop_requested: bool
    claimed: bool
    restarts: int
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None
    run_by_target: bool = False
    candidates: tuple[str, ...] = Field(
        (), description="READY sources in the order the target should try them, chosen "
                        "source first (fixed when the transfer was created).")
    outcome: TransferOutcome | None = Field(
        None, description="How it went, as the target reported in its finish (transport, "
                          "rate, verdict, seconds); null until then or when not reported.")
    layouts: Literal["same", "any"] = Field(
        "same", description="any: the candidates include READY sources of the same weights "
                            "in other parallel layouts (after those of the identity itself), "
                            "for a target that reads regions across layouts (API version 5).")
    relay_path: tuple[str, ...] = Field(
        (), description="Fleet relay: the holders the target reads from, chosen when an "
                        "agent that relays claimed it, or at creation for a pull that asked "
                        "(relay_read) (s:<source id>, t:<transfer id> of a "
                        "target still receiving), its upstream first and a READY source last; "
                        "empty otherwise.")
    records: tuple[SourceInfo, ...] = Field(
        (), description="API version 6, in the reply to POST /v1/transfers that asked for "
                        "them (records=N): the whole records of the first N candidates (with "
                        "layouts=any, of other identities), in order; empty otherwise.")


@dataclass(frozen=True, config=_REPLY)
class ProgressReply(_Parse):
    """Reply to a progress report. ``stop``: abort at the next chunk, then finish the
    transfer with ``"STOPPED"``."""

    transfer: TransferInfo
    stop: bool


@dataclass(frozen=True, config=_REPLY)
class AgentInfo(_Parse):
    """A registered agent (a worker that runs REST-started transfers)."""

    id: str
    endpoint: str
    labels: dict[str, str]
    registered_at: float
    last_seen: float


@dataclass(frozen=True, config=_REPLY)
class AssignmentsReply(_Parse):
    """Transfers newly assigned to an agent (claimed by this poll)."""

    transfers: list[TransferInfo]


@dataclass(frozen=True, config=_REPLY)
class OriginLease(_Parse):
    """The origin lease of an identity (``modelexpress.server.origins``): who reads the
    model from storage and serves it while it loads, and what it learnt so far."""

    identity_id: str
    acquired_at: float
    renewed_at: float
    expires_at: float
    ttl_s: float
    holder: str = Field("", description="The worker holding it; empty once released.")
    generation: int = Field(1, description="Bumped each time another holder takes it; a "
                                           "renewal names the generation it holds.")
    held: bool = Field(False, description="Someone holds it and it has not expired.")
    source_id: str | None = Field(None, description="The source the origin serves while "
                                                    "it loads (INITIALIZING until READY).")
    digest_algorithm: str | None = None
    digests: dict[str, str] = Field(
        default_factory=dict, description="Digests of the tensors read from storage so far "
                                          "(GET only; other replies leave them out).")
    digest_count: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    storage: str = Field("", description="Where the origin reads from (no credentials).")


@dataclass(frozen=True, config=_REPLY)
class HealthReply(_Parse):
    """``GET /v1/health``."""

    status: Literal["ok", "degraded"]
    store: str
    detail: str = ""
    api_version: int = Field(1, description="The server's API version (1: a server that "
                                            "predates versions and does not say).")
    min_api_version: int = Field(1, description="The oldest client API version it serves.")
    version: str = Field("", description="The server's modelexpress release.")


@dataclass(frozen=True, config=_REPLY)
class ErrorReply(_Parse):
    """Every 4xx/5xx body."""

    detail: str
