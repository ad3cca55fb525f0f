"""A pull's transfer record on the control plane, and the receive-rate cap.

:class:`TransferTracker` is the one reporter of a transfer's life, whoever runs it:
a library or CLI pull (which creates its record, ``run_by_target``) and an agent
(whose record was created through the REST API) both report progress through it,
learn from its replies that an operator asked to stop, and finish the record with
the outcome (transport UCX used, rate, verdict, times) that the server exports.

A control-plane error while reporting progress never fails the transfer: the data
plane goes on, and only what operators see lags.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from modelexpress.errors import ConflictError, ControlPlaneError, MxError, TransferTimeoutError

if TYPE_CHECKING:
    from modelexpress.client import MxClient
    from modelexpress.p2p.result import PullResult

__all__ = ["TransferTracker", "RateCap", "outcome_of"]

log = logging.getLogger(__name__)


class TransferTracker:
    """Progress (rate-limited), a stop from the REST API, and the final report of one record.

    Args:
        client: the control-plane client.
        transfer_id: the record.
        interval_s: at most one progress report per this many seconds (forced reports
            excepted).
        source_id: the source the record names; a report moves it when
            :attr:`reading` differs (the target went on to the next candidate).
        run_by_target: the record belongs to a pull run by this process (no agent): a
            stop the caller made itself is announced with ``stop_transfer`` before the
            record ends STOPPED, since the server ends STOPPED only what was asked to stop.

    Attributes:
        stop_requested: set once a report's reply asked to stop.
        reading: the source being read now.
        done: the last byte count reported.
    """

    def __init__(self, client: "MxClient", transfer_id: str, *, interval_s: float = 0.5,
                 source_id: str | None = None, run_by_target: bool = False) -> None:
        self.client = client
        self.id = transfer_id
        self.interval_s = interval_s
        self.run_by_target = run_by_target
        self.stop_requested = threading.Event()
        self.reading: str | None = None
        self.done = 0
        self._named = source_id
        self._last = 0.0
        self._started = time.monotonic()
        self._lock = threading.Lock()

    def begin(self) -> None:
        """Start the clock of the reported rate: the data plane starts now."""
        self._started = time.monotonic()

    def report(self, done: int, total: int, *, force: bool = False,
               rate_bps: float | None = None) -> None:
        """Report running totals unless one was sent less than ``interval_s`` ago.

        Args:
            force: send regardless of the interval (the first and the last report).
            rate_bps: the rate to report; default bytes since :meth:`begin` per second.
        """
        now = time.monotonic()
        with self._lock:
            self.done = done
            if not force and now - self._last < self.interval_s:
                return
            self._last = now
            moved = self._moved()
        if rate_bps is None:
            rate_bps = done / max(now - self._started, 1e-9)
        try:
            reply = self.client.report_progress(self.id, done, total, rate_bps,
                                                source_id=moved)
        except ControlPlaneError as exc:
            log.warning("progress report for transfer %s failed: %s", self.id, exc)
            return
        if moved is not None:
            self._named = moved
        if reply.stop and not self.stop_requested.is_set():
            log.info("transfer %s: stop requested through the control plane; stopping at "
                     "the next chunk", self.id)
            self.stop_requested.set()

    def succeed(self, done: int, *, rate_bps: float, outcome: dict[str, Any]) -> str:
        """End a pull that moved ``done`` bytes: one request, the finish, which sets the
        record's totals and rate and names the source read last (API version 6); where
        the server is older, the last progress report first. Returns what
        :meth:`finish` returns."""
        if (getattr(self.client, "server_api_version", None) or 1) < 6:
            self.report(done, done, force=True, rate_bps=rate_bps)
            return self.finish("SUCCEEDED", done=done, outcome=outcome)
        with self._lock:
            moved = self._moved()
        return self.finish("SUCCEEDED", done=done, outcome=outcome, source_id=moved)

    def _moved(self) -> str | None:
        """The source read now when the record names another (under ``_lock``)."""
        return self.reading if self.reading not in (None, self._named) else None

    def finish(self, state: str, *, error: str | None = None, done: int | None = None,
               outcome: dict[str, Any] | None = None, source_id: str | None = None) -> str:
        """End the record; returns the state it ended in (what the server recorded).

        SUCCEEDED refused because a stop was asked after the last chunk (the server
        allows one outcome) ends the record STOPPED: the stop won. Other failures to
        report are logged, never raised: the transfer itself is over.

        Args:
            state: ``SUCCEEDED``, ``FAILED`` or ``STOPPED``.
            error: why it failed.
            done: the final byte count.
            outcome: :func:`outcome_of` the result (the server's metrics read it).
            source_id: the source read last, when the record names another.
        """
        try:
            if state == "STOPPED" and self.run_by_target and not self.stop_requested.is_set():
                self.client.stop_transfer(self.id)  # the caller stopped it: say so first
            info = self.client.finish_transfer(self.id, state,  # type: ignore[arg-type]
                                               error=error, bytes_done=done, outcome=outcome,
                                               source_id=source_id)
            final = info.state
        except ConflictError as exc:
            if state != "SUCCEEDED":
                log.warning("could not record transfer %s as %s: %s", self.id, state, exc)
                return state
            log.info("transfer %s was stopped as it finished: %s", self.id, exc)
            return self.finish("STOPPED", done=done)
        except MxError as exc:
            log.warning("could not record transfer %s as %s: %s", self.id, state, exc)
            return state
        log.info("transfer %s finished: %s", self.id, final)
        return final


def outcome_of(result: "PullResult") -> dict[str, Any]:
    """The outcome a finished record carries (``MxClient.finish_transfer(outcome=...)``).

    ``transport`` is what UCX reported, or ``local`` for a same-host source copied by
    :mod:`modelexpress.local` (``+``-joined when several sources used several), ``verdict`` the rate verdict: ``slow`` when any source's READ was judged
    a fallback, ``ok`` when all were judged fine, ``unknown`` when none was judged.
    """
    parts = sorted({t for chunk in result.transport.split(",") for t in chunk.split("+") if t})
    return {"transport": "+".join(parts) or "unknown", "rate_bps": result.gbps * 1e9,
            "verdict": result.verdict, "data_plane_s": result.seconds,
            "total_s": result.total_seconds}


class RateCap:
    """Sleeps between chunks until the average receive rate is under ``max_gbps``.

    The clock starts with the first READ (:meth:`start`), so setup time (source
    lookup, allocation, the agent's start) is no credit: a slow setup would otherwise
    let the first chunks through uncapped. A stop or the deadline ends a sleep early.

    Args:
        max_gbps: the cap; 0 is none.
        stopped: True once the pull must stop.
        deadline: monotonic time the pull must end by.
        deadline_s: the pull's whole deadline (for the error message).
    """

    def __init__(self, max_gbps: float, stopped: Callable[[], bool], deadline: float,
                 deadline_s: float) -> None:
        self.max_bps = max_gbps * 1e9
        self._stopped = stopped
        self._deadline = deadline
        self._deadline_s = deadline_s
        self.started: float | None = None

    def start(self) -> None:
        """The data plane starts now (idempotent: the first READ's time counts)."""
        if self.started is None:
            self.started = time.monotonic()

    def ahead(self, done: int) -> float:
        """Seconds ``done`` bytes are ahead of the cap (<= 0: none; 0 before :meth:`start`)."""
        if self.max_bps <= 0 or self.started is None:
            return 0.0
        return done / self.max_bps - (time.monotonic() - self.started)

    def wait(self, done: int) -> None:
        """Hold the caller until ``done`` bytes are within the cap.

        Raises:
            TransferTimeoutError: the cap cannot be met before the deadline.
        """
        ahead = self.ahead(done)
        if ahead <= 0:
            return
        remaining = self._deadline - time.monotonic()
        end = time.monotonic() + min(ahead, remaining)
        while time.monotonic() < end and not self._stopped():
            time.sleep(max(0.0, min(end - time.monotonic(), 0.05)))  # end may pass meanwhile
        if ahead > remaining and not self._stopped():
            raise TransferTimeoutError(
                f"pull deadline of {self._deadline_s:.0f} s ran out with the receive rate "
                f"capped at {self.max_bps / 1e9:g} GB/s (MX_TRANSFER_MAX_GBPS)")
