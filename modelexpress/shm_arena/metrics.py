"""Counters of what the arena diverted and declined, as Prometheus metrics and a bounded log.

Every tensor the pickler looks at ends in exactly one bucket: *diverted* (one
copy into the arena) or *declined* with a reason, after which it takes the
queue's normal path unchanged. The reasons:

========== ==================================================================
small      below the divert threshold (or empty): the normal path is cheaper
non_contiguous  a strided view: copying it would need a gather; the normal path handles it
subclass   a Tensor subclass other than ``nn.Parameter``: its type would be lost
unsupported  not a dense CPU tensor, a non-leaf that requires grad, or a conj/neg view
full       fits the arena but no free extent or descriptor right now
oversize   larger than the arena's whole data region
========== ==================================================================

``prometheus_client`` is optional: without it the counters still count (and
:meth:`ArenaCounters.snapshot` reports them), only the export is skipped. The
metric objects are process-global (one registration per name), labelled by
reason; every arena in the process adds to them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from modelexpress._optional import available

__all__ = ["DECLINE_REASONS", "ArenaCounters", "CounterSnapshot"]

log = logging.getLogger(__name__)

DECLINE_REASONS = ("small", "non_contiguous", "subclass", "unsupported", "full", "oversize")
# Declines that mean the arena is too small or too busy, worth an INFO line.
_NOTEWORTHY = ("full", "oversize")

_PROM_LOCK = threading.Lock()
_PROM: dict[str, Any] | None = None


def _prometheus() -> dict[str, Any] | None:
    """Create the process-global metric objects once; None without prometheus_client."""
    global _PROM
    if _PROM is not None or not available("prometheus_client"):
        return _PROM
    with _PROM_LOCK:
        if _PROM is None:
            from prometheus_client import Counter, Gauge
            _PROM = {
                "diverted": Counter("mx_shm_arena_diverted_tensors",
                                    "Tensors copied into the shm tensor arena"),
                "diverted_bytes": Counter("mx_shm_arena_diverted_bytes",
                                          "Bytes copied into the shm tensor arena"),
                "declined": Counter("mx_shm_arena_declined_tensors",
                                    "Tensors the shm tensor arena declined (normal path)",
                                    ["reason"]),
                "declined_bytes": Counter("mx_shm_arena_declined_bytes",
                                          "Bytes of tensors the shm tensor arena declined",
                                          ["reason"]),
                "in_use": Gauge("mx_shm_arena_bytes_in_use",
                                "Arena bytes held by tensors not yet released by every reader"),
            }
    return _PROM


@dataclasses.dataclass(frozen=True)
class CounterSnapshot:
    """Counts since the arena was created."""

    diverted: int
    diverted_bytes: int
    declined: dict[str, int]
    declined_bytes: dict[str, int]


class ArenaCounters:
    """Per-arena counts, mirrored into the process-global Prometheus metrics.

    Args:
        log_interval_s: at most one summary log line per this many seconds.
    """

    def __init__(self, log_interval_s: float = 60.0) -> None:
        self._lock = threading.Lock()
        self.diverted = 0
        self.diverted_bytes = 0
        self.declined = dict.fromkeys(DECLINE_REASONS, 0)
        self.declined_bytes = dict.fromkeys(DECLINE_REASONS, 0)
        self._log_interval_s = log_interval_s
        self._last_log = float("-inf")
        self._since_log = dict.fromkeys(DECLINE_REASONS, 0)
        self._prom = _prometheus()

    def record_diverted(self, nbytes: int) -> None:
        """Count one tensor copied into the arena."""
        with self._lock:
            self.diverted += 1
            self.diverted_bytes += nbytes
        if self._prom is not None:
            self._prom["diverted"].inc()
            self._prom["diverted_bytes"].inc(nbytes)
            self._prom["in_use"].inc(nbytes)

    def record_released(self, nbytes: int) -> None:
        """The writer reclaimed ``nbytes`` every reader had released."""
        if self._prom is not None:
            self._prom["in_use"].dec(nbytes)

    def record_declined(self, reason: str, nbytes: int) -> None:
        """Count one declined tensor and log a bounded-rate summary.

        Raises:
            ValueError: ``reason`` is not one of :data:`DECLINE_REASONS`.
        """
        if reason not in self.declined:
            raise ValueError(f"reason must be one of {DECLINE_REASONS} (got {reason!r})")
        with self._lock:
            self.declined[reason] += 1
            self.declined_bytes[reason] += nbytes
            self._since_log[reason] += 1
            now = time.monotonic()
            due = now - self._last_log >= self._log_interval_s
            if due:
                self._last_log = now
                summary = {k: v for k, v in self._since_log.items() if v}
                self._since_log = dict.fromkeys(DECLINE_REASONS, 0)
        if self._prom is not None:
            self._prom["declined"].labels(reason=reason).inc()
            self._prom["declined_bytes"].labels(reason=reason).inc(nbytes)
        if due:
            level = logging.INFO if any(k in summary for k in _NOTEWORTHY) else logging.DEBUG
            log.log(level, "shm tensor arena declined %s (normal path taken; last: %s, %d "
                    "bytes); diverted %d tensors / %d bytes so far", summary, reason,
                    nbytes, self.diverted, self.diverted_bytes)

    def snapshot(self) -> CounterSnapshot:
        """A consistent copy of the counts."""
        with self._lock:
            return CounterSnapshot(self.diverted, self.diverted_bytes,
                                   dict(self.declined), dict(self.declined_bytes))
