"""Prometheus metrics of one app: request latency, sources and transfers by state,
and the outcomes workers report when they finish a transfer.

Each app gets its own ``CollectorRegistry`` (not the process-global default) so
several apps in one process, as in tests, do not collide on metric names. The
by-state gauges are computed from the store at scrape time, so every replica
reports the shared truth and nothing drifts after a restart.

The outcome counters and histograms (``mx_transfer_*``) count the finish reports
THIS replica received (``modelexpress.wire.TransferOutcome``: the transport UCX
used, the rate, the rate verdict, data-plane and end-to-end seconds). With several
replicas, sum them over instances (``sum without (instance) (...)``), as for any
per-process counter; a replica restart resets its counters, which Prometheus's
``rate()`` handles. A finish without an outcome counts with transport ``unknown``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from modelexpress.errors import StoreError

__all__ = ["Metrics", "CONTENT_TYPE", "MAX_TRANSPORT_LABELS"]

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Control-plane requests are sub-millisecond to tens of ms; long polls go to 60 s.
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            2.5, 5.0, 10.0, 30.0, 60.0)
# Transfers: a small checkpoint over cuda_ipc in milliseconds, a large one over TCP in
# many minutes (MX_TRANSFER_TIMEOUT_S defaults to 600 s).
_TRANSFER_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     120.0, 300.0, 600.0, 1800.0)
# Label values come from clients: past this many distinct transports, new ones count
# as "other" so a misbehaving client cannot grow the exposition without bound.
MAX_TRANSPORT_LABELS = 32


class _StateCollector(Collector):
    def __init__(self, counts: Callable[[], tuple[dict[str, int], dict[str, int]]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        try:
            sources, transfers = self._counts()
        except StoreError as exc:  # a scrape must not fail because the store blinked
            log.warning("metrics: cannot read the store: %s", exc)
            return
        g = GaugeMetricFamily("mx_sources", "Sources by state.", labels=["state"])
        for state, n in sources.items():
            g.add_metric([state], n)
        yield g
        g = GaugeMetricFamily("mx_transfers", "Transfers by state.", labels=["state"])
        for state, n in transfers.items():
            g.add_metric([state], n)
        yield g


class Metrics:
    """The registry of one app.

    Call :meth:`watch_states` once with the store's by-state counts (read per scrape)
    and :meth:`transfer_finished` for every transfer a finish report ended.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.latency = Histogram(
            "mx_http_request_seconds", "HTTP request latency by route template.",
            ["method", "route", "status"], buckets=_BUCKETS, registry=self.registry)
        self.finished = Counter(
            "mx_transfers_finished", "Transfers ended by their worker's finish report, by "
            "final state and the transport UCX used.", ["state", "transport"],
            registry=self.registry)
        self.bytes = Counter(
            "mx_transfer_bytes", "Bytes moved by finished transfers, by transport.",
            ["transport"], registry=self.registry)
        self.verdicts = Counter(
            "mx_transfer_verdicts", "Rate verdicts of finished transfers (ok, slow, unknown), "
            "by transport.", ["transport", "verdict"], registry=self.registry)
        self.data_plane = Histogram(
            "mx_transfer_data_plane_seconds", "Seconds the READs of a finished transfer took.",
            ["transport"], buckets=_TRANSFER_BUCKETS, registry=self.registry)
        self.total = Histogram(
            "mx_transfer_total_seconds", "Seconds from a pull's start to its end (control "
            "plane, connection, data plane, verification).", ["transport"],
            buckets=_TRANSFER_BUCKETS, registry=self.registry)
        self.artifacts = Counter(
            "mx_artifacts", "What engines did with compiled artifacts, per kind: hit (used), "
            "miss (none served, or installed and not used), refused (signature, digest or "
            "path), present (an own cache), off, error.", ["kind", "outcome"],
            registry=self.registry)
        self.artifacts_compiled = Counter(
            "mx_artifacts_compiled_anyway", "Engines that installed compiled artifacts and "
            "still compiled (vLLM rejected the cache or rebuilt part of it).", ["kind"],
            registry=self.registry)
        self._transports: set[str] = set()
        self._lock = threading.Lock()

    def watch_states(self, counts: Callable[[], tuple[dict[str, int], dict[str, int]]]
                     ) -> None:
        """Export ``mx_sources`` and ``mx_transfers`` by state from ``counts`` (per scrape)."""
        self.registry.register(_StateCollector(counts))

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Record one request."""
        self.latency.labels(method, route, str(status)).observe(seconds)

    def _transport_label(self, transport: str) -> str:
        with self._lock:
            if transport in self._transports:
                return transport
            if len(self._transports) >= MAX_TRANSPORT_LABELS:
                return "other"
            self._transports.add(transport)
            return transport

    def transfer_finished(self, record: dict[str, Any]) -> None:
        """Count a transfer that a finish report just ended (its stored record)."""
        outcome = record.get("outcome") or {}
        transport = self._transport_label(outcome.get("transport") or "unknown")
        self.finished.labels(record["state"], transport).inc()
        self.bytes.labels(transport).inc(max(0, int(record.get("bytes_done") or 0)))
        self.verdicts.labels(transport, outcome.get("verdict") or "unknown").inc()
        if outcome:
            self.data_plane.labels(transport).observe(outcome.get("data_plane_s") or 0.0)
            if outcome.get("total_s") is not None:
                self.total.labels(transport).observe(outcome["total_s"])

    def artifact_outcome(self, kind: str, outcome: str, compiled: bool | None) -> None:
        """Count one engine's compiled-artifact outcome (``POST /v1/artifacts/outcomes``)."""
        self.artifacts.labels(kind, outcome).inc()
        if compiled and outcome in ("hit", "miss"):
            self.artifacts_compiled.labels(kind).inc()

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)
