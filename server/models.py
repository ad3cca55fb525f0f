"""Request bodies of the REST API (pydantic, ``extra="forbid"``) and the reply models.

Everything a client sends is validated here, so a bad body is a 422 that names the
field, never a 500 and never a half-written record. Large opaque payloads (the
manifest and the NIXL agent metadata) are only checked for shape and size: the
transfer layer owns their content.

The replies are defined once, in :mod:`modelexpress.wire`, where the client parses
them too; the ``*Out`` names below are the server's names for them.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from pydantic.dataclasses import dataclass

from modelexpress.identity import ModelIdentity
from modelexpress.server.states import SourceState, TransferState
from modelexpress.wire import (
    MAX_RECORDS, AgentInfo, AssignmentsReply, ErrorReply, HealthReply, OriginLease, ProgressReply,
    SourceDetail, SourceSummary, TransferInfo, TransferOutcome,
)

__all__ = [
    "WorkerId", "EntityId", "IdentityIn", "SourcePublish", "SourceOut", "SourceDetail",
    "HeartbeatIn", "TransferCreate", "TransferOut", "ProgressIn", "ProgressOut", "FinishIn",
    "TransferOutcomeIn",
    "AgentRegister", "AgentOut", "AssignmentsOut", "HealthOut", "ErrorOut", "SourceDetail",
    "OriginAcquireIn", "OriginRenewIn", "OriginLeaseOut", "MAX_METADATA_B64",
]

WorkerId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")]
"""A worker (agent) id: letters, digits, '.', '_', '-'; 1-128 chars; safe in URLs."""
EntityId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,191}$")]
"""A source or transfer id as the server issues them."""
IdentityId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
Text = Annotated[str, StringConstraints(max_length=1024)]
Count = Annotated[int, Field(ge=0, le=1 << 62)]
GpuUuid = Annotated[str, StringConstraints(pattern=r"^(GPU|MIG)-[0-9A-Za-z-]{1,64}$")]
"""A GPU as ``nvidia-smi -L`` names it (``GPU-<uuid>``, ``MIG-<uuid>``)."""

MAX_METADATA_B64 = 16 << 20
"""Base64 characters of NIXL agent metadata we accept (real metadata is a few KiB)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class IdentityIn(_Model):
    """A :class:`~modelexpress.identity.ModelIdentity` on the wire (``id`` optional, checked)."""

    model: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    revision: Annotated[str, StringConstraints(max_length=256)] = "main"
    dtype: Annotated[str, StringConstraints(max_length=64)] = "bfloat16"
    quantization: Annotated[str, StringConstraints(max_length=64)] = "none"
    tp_size: Annotated[int, Field(ge=1, le=1 << 20)] = 1
    pp_size: Annotated[int, Field(ge=1, le=1 << 20)] = 1
    ep_size: Annotated[int, Field(ge=1, le=1 << 20)] = 1
    rank: Annotated[int, Field(ge=0, le=1 << 40)] = 0
    extra: Annotated[list[tuple[Text, Text]], Field(max_length=64)] = []
    id: IdentityId | None = None

    def to_identity(self) -> ModelIdentity:
        """Build the identity; raises ConfigError (a ValueError) when the fields disagree."""
        return ModelIdentity.from_dict(self.model_dump(exclude_none=True))

    @model_validator(mode="after")
    def _consistent(self) -> "IdentityIn":
        self.to_identity()  # ConfigError is a ValueError: pydantic turns it into a 422
        return self


class SourcePublish(_Model):
    """``PUT /v1/sources``: a worker rank announces the weights it holds."""

    identity: IdentityIn
    worker_id: WorkerId
    endpoint: Text = Field("", description="How peers reach the worker's NIXL agent (host:port).")
    agent_metadata: str = Field(
        "", max_length=MAX_METADATA_B64,
        description="NIXL agent metadata, base64 (standard alphabet, padded).")
    manifest: dict[str, Any] = Field(
        description="The transfer layer's manifest; stored as opaque JSON within a size limit.")
    state: Literal[SourceState.INITIALIZING, SourceState.READY] = SourceState.READY
    devices: Annotated[list[GpuUuid], Field(max_length=64)] = Field(
        [], description="API version 2: UUIDs of the GPUs whose memory the source serves.")
    layout: dict[str, Any] | None = Field(
        None, description="API version 5: the layout of the served loaded form "
                          "(modelexpress.layout JSON: which checkpoint region each tensor "
                          "region holds, with block digests); stored as opaque JSON within "
                          "the manifest's size limit.")

    @field_validator("agent_metadata")
    @classmethod
    def _base64(cls, value: str) -> str:
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"agent_metadata is not valid base64: {exc}") from exc
        return value

    @field_validator("manifest", "layout")
    @classmethod
    def _json(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            json.dumps(value, allow_nan=False)
        except (ValueError, RecursionError) as exc:  # NaN/Infinity or absurd nesting
            raise ValueError(f"not storable JSON: {exc}") from exc
        return value


class HeartbeatIn(_Model):
    """``POST /v1/sources/{id}/heartbeat``: I am alive, optionally with a new state."""

    state: SourceState | None = Field(
        None, description="READY when initialisation finished, STALE when the worker "
                          "goes away or its data plane failed; omit to keep the state.")


class TransferCreate(_Model):
    """``POST /v1/transfers``: move the weights of an identity to a target worker."""

    identity_id: IdentityId
    target_worker: WorkerId
    source_id: EntityId | None = Field(None, description="Omit to let the server pick a READY source.")
    policy: Literal["random", "spread"] | None = Field(
        None, description="How to pick a source when none is given (default: MX_SOURCE_POLICY).")
    run_by_target: bool = Field(
        False, description="The target process runs the pull itself (library, CLI, vLLM "
                           "loader) and reports on it; no agent claims the transfer.")
    relay_read: bool = Field(
        False, description="With run_by_target: plan the transfer now as a fleet-relay "
                           "reader (relay_path), so it may read the chunks of a relaying "
                           "agent's live transfer; it relays to nobody itself.")
    relay_serve: bool = Field(
        False, description="With relay_read: the transfer is also a holder that later "
                           "transfers of the model may read from while it receives (a vLLM "
                           "engine's pull relays; the target serves it).")
    layouts: Literal["same", "any"] = Field(
        "same", description="API version 5. any: rank READY sources of the same weights in "
                            "other parallel layouts too (after the identity's own), for a "
                            "target that reads across layouts; needs identity.")
    identity: IdentityIn | None = Field(
        None, description="API version 5: the target's identity (its id must be "
                          "identity_id); with layouts=any it names the weights in any "
                          "layout.")
    records: int = Field(
        0, ge=0, le=MAX_RECORDS,
        description="API version 6: the reply's records carry the whole records (as GET "
                    "/v1/sources/{id}: manifest, agent metadata, layout) of the first this "
                    "many candidates, so the target need not ask for them; with "
                    "layouts=any, of candidates of other identities.")

    @model_validator(mode="after")
    def _layouts(self) -> "TransferCreate":
        if self.layouts == "any":
            if self.identity is None:
                raise ValueError("layouts=any needs the target's identity")
            if self.identity.to_identity().id != self.identity_id:
                raise ValueError("identity does not match identity_id")
        return self


class ProgressIn(_Model):
    """``POST /v1/transfers/{id}/progress``: the worker's running totals (absolute, idempotent)."""

    bytes_done: Count
    bytes_total: Count
    rate_bps: Annotated[float, Field(ge=0, le=1e15, allow_inf_nan=False)] = 0.0
    source_id: EntityId | None = Field(
        None, description="The source being read now, when the target moved on from the "
                          "one the record names.")

    @model_validator(mode="after")
    def _bounded(self) -> "ProgressIn":
        if self.bytes_done > self.bytes_total:
            raise ValueError(f"bytes_done ({self.bytes_done}) exceeds bytes_total "
                             f"({self.bytes_total})")
        return self


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class TransferOutcomeIn(TransferOutcome):
    """A :class:`~modelexpress.wire.TransferOutcome` in a request: unknown keys are a 422."""


class FinishIn(_Model):
    """``POST /v1/transfers/{id}/finish``: the worker's final word."""

    state: Literal[TransferState.SUCCEEDED, TransferState.FAILED, TransferState.STOPPED]
    error: Annotated[str, StringConstraints(max_length=8192)] | None = None
    bytes_done: Count | None = None
    outcome: TransferOutcomeIn | None = Field(
        None, description="How the transfer went (transport UCX used, rate, verdict, "
                          "seconds); the server stores it and exports it in /metrics.")
    source_id: EntityId | None = Field(
        None, description="API version 6: with SUCCEEDED, the source read last, when the "
                          "record names another (as a progress report's source_id); an "
                          "unknown source leaves the record's as it was.")


class ArtifactOutcomeIn(_Model):
    """``POST /v1/artifacts/outcomes``: what an engine did with compiled artifacts."""

    identity_id: IdentityId
    kind: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
    outcome: Literal["hit", "miss", "refused", "present", "off", "error"]
    compiled: bool | None = Field(None, description="The engine compiled anyway.")
    worker_id: WorkerId | None = None
    source_id: EntityId | None = None
    detail: Text = ""


LeaseSeconds = Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)]
Digest = Annotated[str, StringConstraints(min_length=1, max_length=256)]
TensorName = Annotated[str, StringConstraints(min_length=1, max_length=1024)]


class OriginAcquireIn(_Model):
    """``POST /v1/identities/{id}/origin``: become the origin of a model no peer holds."""

    holder: WorkerId
    ttl_s: LeaseSeconds = Field(description="The lease lapses this long after the last renewal.")


class OriginRenewIn(_Model):
    """``POST /v1/identities/{id}/origin/renew``: still alive (or, with ``release``, done),
    with what was learnt since the last renewal (digests are merged)."""

    holder: WorkerId
    generation: Annotated[int, Field(ge=1, le=1 << 62)]
    ttl_s: LeaseSeconds
    release: bool = Field(False, description="End the lease now (the origin finished or "
                                             "gave up); its digests and source stay.")
    source_id: EntityId | None = None
    digest_algorithm: Annotated[str, StringConstraints(max_length=64)] | None = None
    digests: Annotated[dict[TensorName, Digest], Field(max_length=1 << 20)] = {}
    bytes_done: Count | None = None
    bytes_total: Count | None = None
    storage: Text | None = None


class AgentRegister(_Model):
    """``PUT /v1/agents/{id}``: a worker that executes REST-started transfers."""

    endpoint: Text = ""
    labels: Annotated[dict[Annotated[str, StringConstraints(max_length=128)], Text],
                      Field(max_length=64)] = {}


# The replies, defined once in modelexpress.wire (the client parses them with the same
# classes); the server's names for them.
SourceOut = SourceSummary
TransferOut = TransferInfo
OriginLeaseOut = OriginLease
ProgressOut = ProgressReply
AgentOut = AgentInfo
AssignmentsOut = AssignmentsReply
HealthOut = HealthReply
ErrorOut = ErrorReply
