"""What the control plane sends back, defined once for the server and the client.

The server (``modelexpress.server.models``) declares these as its response models and
the client (:mod:`modelexpress.client`) parses replies with them, so one field added
here reaches both ends. Only pydantic (a core dependency) is imported: a worker that
never runs the server does not need FastAPI.

Replies ignore keys they do not declare instead of failing: a record written by a
newer server version (a shared Redis during a rolling upgrade), or a newer server
answering an older client, must not break the reader.

The request bodies (what a client sends and the server validates strictly) stay in
``modelexpress.server.models``; :class:`TransferOutcome` lives here because it travels
both ways (a worker's finish report, and the record's ``outcome`` field).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

__all__ = ["TransferOutcome", "TRANSPORT_PATTERN", "VERDICTS"]

TRANSPORT_PATTERN = r"^[A-Za-z0-9_]{1,32}(\+[A-Za-z0-9_]{1,32}){0,15}$"
"""UCX transport names as a result reports them: ``cma``, ``rc_mlx5``, ``cma+tcp``, ``unknown``."""

VERDICTS = ("ok", "slow", "unknown")
"""Rate verdicts (``modelexpress.transfer.transport``: VERDICT_OK, VERDICT_SLOW, UNKNOWN)."""

_Seconds = Annotated[float, Field(ge=0, le=1e7, allow_inf_nan=False)]


class TransferOutcome(BaseModel):
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

    # Lenient like every reply; the server's request body (FinishIn) uses a strict
    # subclass, so a report with a misspelled key is a 422 there.
    model_config = ConfigDict(extra="ignore", frozen=True)

    transport: Annotated[str, StringConstraints(pattern=TRANSPORT_PATTERN)] = "unknown"
    rate_bps: Annotated[float, Field(ge=0, le=1e15, allow_inf_nan=False)] = 0.0
    verdict: Literal["ok", "slow", "unknown"] = "unknown"
    data_plane_s: _Seconds = 0.0
    total_s: _Seconds | None = None
