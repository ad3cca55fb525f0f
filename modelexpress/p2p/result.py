"""What a pull returns: :class:`PullResult`, the sources it passed over, and where its
time went (the keys of :data:`PHASES`, filled by a :class:`PullClock`).

Below :mod:`~modelexpress.p2p.target` (which builds it) and
:mod:`~modelexpress.p2p.tracking` (which reports it to the control plane), so that
neither imports the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Iterator, Mapping

__all__ = ["PHASES", "PullClock", "PullResult", "SkippedSource"]


PHASES = ("imports", "control_plane", "agent_wait", "allocate", "register", "peer", "connect",
          "data_plane", "close", "other", "agent", "verify")
"""Keys of ``PullResult.phases``: the critical path's, then the two that overlap it."""


@dataclasses.dataclass(frozen=True)
class SkippedSource:
    """A source that was tried (or passed over) and why."""

    source_id: str
    worker_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class PullResult:
    """Outcome of a successful :func:`pull`.

    Attributes:
        source_ids: the source(s) the bytes came from (several when striped).
        bytes: bytes received.
        seconds: wall time from the first READ to the last byte (validation and
            control-plane calls excluded; ``total_seconds`` includes them).
        gbps: bytes / seconds / 1e9.
        transport: the transport(s) UCX reported for the READs (``cma``, ``tcp``,
            ``cuda_ipc``, ``rc_mlx5``...; several joined with ``,``), or ``unknown``;
            never inferred (see ``TransferResult.transport``); ``local`` for a source
            on this host copied by :mod:`modelexpress.local`.
        expected_transport: the family the memory kinds and hosts call for.
        transport_detail: where ``transport`` was read, or why it is unknown.
        descriptors: NIXL descriptors posted (after coalescing).
        tensors: tensors received.
        verified: every tensor's digest was checked and matched.
        skipped: sources skipped, with reasons.
        warnings: data-plane warnings (e.g. a slow transport).
        total_seconds: wall time of the whole call.
        verify_seconds: time spent computing digests (mostly overlapped with the
            READ: a chunk is checked while the next ones move).
        connect_seconds: opening the source's memory before the clock starts (a
            4 KiB READ; in ``total_seconds``, not in ``seconds``).
        source_attributes: source id -> the ``attributes`` its manifest published
            (facts for the caller to check, e.g. the vLLM loader's probe).
        transfer_id: the control plane's record of this pull (None when the caller
            keeps its own, ``track=False``).
        verdict: the rate verdict over the sources read: ``ok``, ``slow`` (a READ was
            judged a fallback: see ``warnings``) or ``unknown`` (none was judged).
        digest_algorithm, digests: when ``verified``, the algorithm and the source
            digests every received tensor matched (name -> digest), so a caller that
            needs the digests of what it received need not compute them again; None
            and empty otherwise.
        phases: where ``total_seconds`` went, in seconds (keys in :data:`PHASES`). On
            the critical path, summing to ``total_seconds``: ``imports`` (torch and the
            transfer layer, when this call imported them), ``control_plane`` (the
            transfer record, candidates, manifests, progress and the final report),
            ``agent_wait`` (waiting for the NIXL agent being created), ``allocate``
            (destination tensors), ``register`` (the destination, when not registered
            while the agent started), ``peer`` (loading the source's agent metadata),
            ``connect`` and ``data_plane`` (as above), ``close`` (dropping the pull's
            agent), ``other`` (validation, planning, bookkeeping). Overlapping them:
            ``agent`` (creating the NIXL agent and registering a given destination, in
            a thread alongside imports and control plane; 0 with a caller's manager)
            and ``verify`` (digests, alongside the data plane).
    """

    source_ids: tuple[str, ...]
    bytes: int
    seconds: float
    gbps: float
    transport: str
    descriptors: int
    tensors: int
    verified: bool
    skipped: tuple[SkippedSource, ...]
    warnings: tuple[str, ...]
    total_seconds: float
    verify_seconds: float = 0.0
    connect_seconds: float = 0.0
    source_attributes: Mapping[str, Mapping[str, object]] = dataclasses.field(
        default_factory=dict)
    transfer_id: str | None = None
    expected_transport: str = ""
    transport_detail: str = ""
    phases: Mapping[str, float] = dataclasses.field(default_factory=dict)
    verdict: str = "unknown"
    digest_algorithm: str | None = None
    digests: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """JSON-able form (for ``--json`` output)."""
        data = dataclasses.asdict(self)
        data["skipped"] = [dataclasses.asdict(s) for s in self.skipped]
        data["source_attributes"] = {k: dict(v) for k, v in self.source_attributes.items()}
        data["phases"] = dict(self.phases)
        # one digest per tensor is the manifest's business, not a pull's report
        data.pop("digests")
        return data


class PullClock:
    """Where a pull's time goes on its critical path (see ``PullResult.phases``)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time spent inside the ``with`` block to ``phases[name]``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] += time.perf_counter() - t0

    def total(self) -> float:
        """Seconds since the pull started."""
        return time.perf_counter() - self.started
