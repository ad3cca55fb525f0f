"""One-sided READs of named pieces from one peer, each posted when the caller says so.

:meth:`~.manager.NixlTransferManager.read` moves a set of tensors known in advance and
returns when all landed. A fleet relay's reader does not know in advance: its upstream
holds a growing prefix of the model, and the reader should have the next pieces in
flight while it learns that the prefix grew, so that its link never idles between one
batch and the next (a read-everything-then-poll loop keeps a hop's lag from ever
shrinking, and adds the poll's round trip at every batch). A :class:`PieceStream`
prepares the descriptor lists of every piece once, then posts one request per piece
on demand and reports the pieces that landed, without blocking.

Digests are the caller's business (a relay verifies a tensor when its last piece
lands, against the origin's digest). The transport is judged like a READ's: UCX's
protocol report for the connect READ decides the family (a fallback with
``refuse_slow_transport`` raises at once), and the rate over the time pieces were in
flight is judged when the stream ends.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from modelexpress.errors import PeerError, TransportError
from modelexpress.transfer.read_loop import connect_read
from modelexpress.transfer.transport import assess

if TYPE_CHECKING:
    import torch

    from modelexpress.transfer.nixl_adapter import NixlAgent
    from modelexpress.transfer.observer import ReadWatch
    from modelexpress.transfer.planner import ReadPlan

__all__ = ["PieceStream"]

log = logging.getLogger(__name__)


class PieceStream:
    """Posted READs of ``plan``'s pieces (one descriptor each) from ``peer``.

    Made by :meth:`~.manager.NixlTransferManager.open_stream`, which enters the
    observer's window for it; :meth:`close` releases everything still in flight.
    """

    def __init__(self, agent: "NixlAgent", plan: "ReadPlan", local: Mapping[str, "torch.Tensor"],
                 peer: str, *, expected: str, refuse: bool, watch: "ReadWatch",
                 probe_bytes: int) -> None:
        if len(plan.local_descs) != len(plan.pairs):
            raise AssertionError("a stream's plan has one descriptor per piece")
        self.agent, self.plan, self.peer = agent, plan, peer
        self.expected, self.refuse, self.watch = expected, refuse, watch
        self.probe_bytes = probe_bytes
        self.local = local
        self.row = {p.name: i for i, p in enumerate(plan.pairs)}
        self.nbytes = {p.name: int(p.local.nbytes) for p in plan.pairs}
        self.inflight: dict[str, Any] = {}  # name -> request, in posting order
        self.inflight_bytes = 0
        self.bytes = 0            # landed
        self.pieces = 0
        self.connect_s = 0.0
        self.busy_s = 0.0         # time with at least one piece in flight
        self._busy_since: float | None = None
        self._warned = ""  # the connect READ's verdict message, when it was a fallback
        self._handles: list[Any] = []
        try:
            self._handles.append(agent.prep(None, plan.local_descs, plan.local_mem))  # type: ignore[arg-type]
            self._handles.append(agent.prep(peer, plan.remote_descs, plan.remote_mem))  # type: ignore[arg-type]
        except BaseException:
            self.close()
            raise

    def connect(self, name: str, deadline_s: float) -> None:
        """READ the first few KiB of piece ``name`` (whose bytes the caller reads again),
        inside the observer's window: UCX wires the connection up and reports its
        protocols there, off the pipeline.

        Raises:
            PeerError: it failed or did not complete within ``deadline_s``.
            TransportError: UCX reports a fallback transport and ``refuse`` is set.
        """
        end = time.monotonic() + deadline_s

        def wait(req: Any, n: int) -> str:
            state = "PROC"
            while state == "PROC":
                if time.monotonic() > end:
                    raise PeerError(f"connecting to peer {self.peer} (a {n}-byte READ) did "
                                    f"not finish within {deadline_s:g} s; the peer may be hung")
                time.sleep(0.0002)
                state = self.agent.state(req, self.peer, n)
            return state

        n, self.connect_s = connect_read(self.agent, self.peer, self.plan, self.row[name],
                                         self.watch, wait)
        verdict = assess(self.expected, n, max(self.connect_s, 1e-9), facts=self.watch.facts(),
                         min_measure_bytes=self.probe_bytes, cold=True)
        if not verdict.ok:
            if self.refuse:
                raise TransportError(f"transfer from {self.peer} refused: {verdict.message}")
            log.warning("slow transport from peer %s: %s", self.peer, verdict.message)
            self._warned = verdict.message

    def post(self, name: str) -> None:
        """Post the READ of piece ``name`` (not in flight).

        Raises:
            PeerError: NIXL refused the post (the peer exited).
        """
        i = self.row[name]
        idx = np.array([i], dtype=np.int32)
        req = self.agent.make_read(self._handles[0], idx, self._handles[1], idx, self.peer, b"")
        self.inflight[name] = req
        self.inflight_bytes += self.nbytes[name]
        if self._busy_since is None:
            self._busy_since = time.perf_counter()
        if self.agent.post(req, self.peer, self.nbytes[name]) == "ERR":
            raise PeerError(f"posting a READ of {self.nbytes[name]} bytes to peer {self.peer} "
                            "failed; the peer may have exited")

    def poll(self) -> list[str]:
        """The pieces that landed since the last call, in posting order (never blocks).

        Raises:
            PeerError: a READ failed (the peer vanished or its memory is gone).
        """
        done = []
        for name, req in self.inflight.items():
            state = self.agent.state(req, self.peer, self.nbytes[name])
            if state == "ERR":
                raise PeerError(f"READ of piece {name!r} ({self.nbytes[name]} bytes) from peer "
                                f"{self.peer} failed after {self.bytes} bytes: the peer vanished "
                                "or its memory is gone")
            if state != "PROC":
                done.append(name)
        for name in done:
            self.agent.release(self.inflight.pop(name))
            self.inflight_bytes -= self.nbytes[name]
            self.bytes += self.nbytes[name]
            self.pieces += 1
        if done and not self.inflight and self._busy_since is not None:
            self.busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None
        return done

    def finish(self) -> tuple[float, Any, list[str]]:
        """(busy seconds, transport verdict, warnings) of what landed so far.

        Raises:
            TransportError: a fallback was detected and ``refuse`` is set.
        """
        busy = self.busy_s + (time.perf_counter() - self._busy_since
                              if self._busy_since is not None else 0.0)
        verdict = assess(self.expected, self.bytes, max(busy, 1e-9), facts=self.watch.facts(),
                         min_measure_bytes=self.probe_bytes)
        if verdict.ok and self._warned:
            verdict = dataclasses.replace(verdict, ok=False, message=self._warned)
        warnings = [] if verdict.ok else [verdict.message]
        if not verdict.ok:
            if self.refuse:
                raise TransportError(f"transfer from {self.peer} refused: {verdict.message}")
            if verdict.message != self._warned:
                log.warning("slow transport from peer %s: %s", self.peer, verdict.message)
        return max(busy, 1e-9), verdict, warnings

    def close(self) -> None:
        """Release every request still in flight (aborting it) and the lists. Idempotent."""
        while self.inflight:
            _, req = self.inflight.popitem()
            self.agent.release(req)
        self.inflight_bytes = 0
        while self._handles:
            self.agent.release(self._handles.pop())
