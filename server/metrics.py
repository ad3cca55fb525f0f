"""Prometheus metrics of one app: request latency, sources and transfers by state.

Each app gets its own ``CollectorRegistry`` (not the process-global default) so
several apps in one process, as in tests, do not collide on metric names. The
by-state gauges are computed from the store at scrape time, so every replica
reports the shared truth and nothing drifts after a restart.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from modelexpress.errors import StoreError

__all__ = ["Metrics", "CONTENT_TYPE"]

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Control-plane requests are sub-millisecond to tens of ms; long polls go to 60 s.
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            2.5, 5.0, 10.0, 30.0, 60.0)


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

    Args:
        counts: returns (sources by state, transfers by state); called per scrape.
    """

    def __init__(self, counts: Callable[[], tuple[dict[str, int], dict[str, int]]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.latency = Histogram(
            "mx_http_request_seconds", "HTTP request latency by route template.",
            ["method", "route", "status"], buckets=_BUCKETS, registry=self.registry)
        self.registry.register(_StateCollector(counts))

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Record one request."""
        self.latency.labels(method, route, str(status)).observe(seconds)

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)
