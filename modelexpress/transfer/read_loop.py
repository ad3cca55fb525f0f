"""The chunk loop of one NIXL READ: post, poll, verify, report, honour a stop.

Kept apart from :mod:`~modelexpress.transfer.manager` so the manager reads as the
API (register, publish, plan, read) and this module as the loop's mechanics: a
window of posted chunks, the transport probe on the first chunk, digests of landed
tensors computed while the next chunks move, a deadline and a still-waiting log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from modelexpress.errors import (
    IntegrityError,
    PeerError,
    TransferCancelledError,
    TransferTimeoutError,
    TransportError,
)
from modelexpress.transfer import digest as _digest
from modelexpress.transfer.planner import ReadPlan
from modelexpress.transfer.transport import TransportVerdict, assess

if TYPE_CHECKING:
    from modelexpress.transfer.nixl_adapter import NixlAgent
    from modelexpress.transfer.observer import ReadWatch

__all__ = ["ReadLoop", "StopSignal", "ProgressCallback", "connect_read", "stopped"]

log = logging.getLogger(__name__)

StopSignal = Union[threading.Event, Callable[[], bool]]
ProgressCallback = Callable[[int, int], None]

_STILL_WAITING_EVERY_S = 10.0
_SPIN_POLLS = 2000          # polls before we start sleeping between them
_POLL_SLEEP_S = 0.0001
_CONNECT_BYTES = 4096       # the READ that opens the peer's memory before the clock starts


def stopped(stop: StopSignal | None) -> bool:
    if stop is None:
        return False
    if isinstance(stop, threading.Event):
        return stop.is_set()
    return bool(stop())


def connect_read(agent: NixlAgent, peer: str, plan: ReadPlan, row: int, watch: ReadWatch,
                 wait: Callable[[Any, int], str]) -> tuple[int, float]:
    """READ the first few KiB of the plan's descriptor ``row`` (bytes the caller reads
    again) inside ``watch``'s window; returns the bytes read and the seconds.

    A first access to a peer is connection setup: UCX wires the endpoint up, opens the
    peer's memory (cuda_ipc maps its IPC handle, ~ms for a multi-GB allocation) and
    reports the protocols it chose, which the observer's window catches. ``wait(req,
    n)`` is called while the READ is in flight and returns its final state ("DONE" or
    "ERR"), raising on its caller's deadline.

    Raises:
        PeerError: the READ failed (the peer vanished or its memory is gone).
    """
    t0 = time.perf_counter()
    n = int(min(_CONNECT_BYTES, int(plan.local_descs[row][1])))
    local = plan.local_descs[row:row + 1].copy()
    remote = plan.remote_descs[row:row + 1].copy()
    local[0][1] = remote[0][1] = n
    handles: list[Any] = []
    req = None
    try:
        with watch.window():
            handles.append(agent.prep(None, local, plan.local_mem))  # type: ignore[arg-type]
            handles.append(agent.prep(peer, remote, plan.remote_mem))  # type: ignore[arg-type]
            idx = np.zeros(1, dtype=np.int32)
            req = agent.make_read(handles[0], idx, handles[1], idx, peer, b"")
            state = agent.post(req, peer, n)
            if state == "PROC":
                state = wait(req, n)
        if state == "ERR":
            raise PeerError(f"connecting to peer {peer} (a {n}-byte READ) failed: the peer "
                            "vanished or its memory is gone; try another source")
    finally:
        if req is not None:
            agent.release(req)
        for h in handles:
            agent.release(h)
    return n, time.perf_counter() - t0


class ReadLoop:
    """The chunk loop of one READ (kept apart so ``read`` stays readable).

    It gets what it uses, nothing more: the NIXL agent to post on, the plan, the
    destination, and ``done_notification``, the bytes the last chunk carries to the
    source (``mx-read-done <reader> <bytes>``; the source logs who read what).
    """

    def __init__(self, agent: "NixlAgent", plan: ReadPlan, local: Mapping[str, Any],
                 peer: str, algo: str | None, deadline_s: float,
                 progress: ProgressCallback | None, stop: StopSignal | None,
                 on_tensor_done: Callable[[str], None] | None, max_inflight: int,
                 expected: str, refuse: bool, probe_bytes: int, watch: "ReadWatch",
                 done_notification: bytes = b"", stall_s: float | None = None,
                 connect: bool = True, spin_polls: int = _SPIN_POLLS,
                 max_nap_s: float = _POLL_SLEEP_S) -> None:
        self.agent, self.plan, self.local = agent, plan, local
        self.done_notification = done_notification
        self.connect = connect  # False: the peer's memory was opened by an earlier READ
        # Polls of a chunk before sleeping between them, and the longest sleep (the
        # first is _POLL_SLEEP_S, doubling): a reader of a slow link asks for few polls
        # and longer sleeps, since every poll and wake-up costs CPU its host may share.
        self.spin_polls, self.max_nap_s = spin_polls, max(max_nap_s, _POLL_SLEEP_S)
        self.peer, self.algo, self.deadline_s = peer, algo, deadline_s
        self.progress, self.stop, self.on_tensor_done = progress, stop, on_tensor_done
        self.max_inflight, self.expected, self.refuse = max_inflight, expected, refuse
        self.probe_bytes = probe_bytes
        self.stall_s = stall_s  # no chunk landing for this long: the peer is given up
        self.watch = watch  # which transport UCX's report shows for this READ
        self.verify_s = 0.0
        self.connect_s = 0.0
        self._last_log = time.monotonic()  # of the last still-waiting line
        self.first_chunk: tuple[int, float] | None = None  # (bytes, seconds) when probed
        self.held_s = 0.0  # time spent in the caller's progress callback
        # pairs completed per chunk index
        self.by_chunk: dict[int, list[int]] = {}
        for i, c in enumerate(plan.done_after):
            self.by_chunk.setdefault(c, []).append(i)

    def _verify(self, chunk_idx: int) -> None:
        pairs = [self.plan.pairs[i] for i in self.by_chunk.get(chunk_idx, ())]
        got: list[str | None] = [None] * len(pairs)
        if self.algo is not None and pairs:
            t0 = time.perf_counter()
            # One batch per chunk: on a GPU every reduction is launched, then read back
            # with a single synchronisation.
            got = list(_digest.digest_many([self.local[p.name] for p in pairs], self.algo))
            self.verify_s += time.perf_counter() - t0
        for pair, value in zip(pairs, got):
            if self.algo is not None and value != pair.remote.digest:
                raise IntegrityError(
                    f"tensor {pair.name!r} ({pair.local.nbytes} bytes) from peer {self.peer} "
                    f"failed its {self.algo} digest check (source {pair.remote.digest}, "
                    f"received {value}); the tensor is not usable: retry from another "
                    "source or fall back to disk")
            if self.on_tensor_done is not None:
                self.on_tensor_done(pair.name)

    def _wait(self, req: Any, nbytes: int, deadline: float, what: str,
              timeout_message: Callable[[], str], since: float | None = None) -> str:
        """Poll a posted request until it leaves PROC; returns DONE or ERR.

        Spins for the first polls (a chunk lands in milliseconds), then sleeps between
        them; logs every 10 s while waiting; raises TransferTimeoutError with
        ``timeout_message()`` once ``deadline`` (monotonic) has passed, and PeerError
        once ``stall_s`` has passed since ``since`` (monotonic: the last time a byte
        landed) with nothing landing."""
        polls = 0
        nap = _POLL_SLEEP_S
        stall_at = (since + self.stall_s) if (self.stall_s and since is not None) else None
        while True:
            state = self.agent.state(req, self.peer, nbytes)
            if state != "PROC":
                return state
            now = time.monotonic()
            if now > deadline:
                raise TransferTimeoutError(timeout_message())
            if stall_at is not None and now > stall_at:
                raise PeerError(
                    f"no data from peer {self.peer} for {self.stall_s:g} s while waiting for "
                    f"{what} (MX_TRANSFER_STALL_S): the link may be down or the peer hung; "
                    "trying another source")
            if now - self._last_log > _STILL_WAITING_EVERY_S:
                log.info("still waiting for %s from %s after %.0f s", what, self.peer,
                         now - (deadline - self.deadline_s))
                self._last_log = now
            polls += 1
            if polls > self.spin_polls:
                time.sleep(nap)
                nap = min(2 * nap, self.max_nap_s)

    def _connect(self, deadline: float) -> None:
        """READ the first few KiB of the first piece before the clock starts.

        A new agent's first access to a peer opens the peer's memory (UCX cuda_ipc
        maps its IPC handle, ~ms for a multi-GB allocation; other transports set up
        their own state). That is connection setup, like the peer-access setup a
        peer copy does once: it lands in ``connect_seconds`` and in the caller's
        end-to-end time, not in the data-plane rate. The bytes land in the first
        tensor of this plan and are read again by the first chunk.

        It is also where UCX selects its protocols for this peer and reports them,
        so it runs inside the observer's window (see ``observer.py``).
        """
        peer = self.peer
        _, self.connect_s = connect_read(
            self.agent, peer, self.plan, 0, self.watch,
            lambda req, n: self._wait(req, n, deadline, f"the {n}-byte connect READ", lambda: (
                f"connecting to peer {peer} (a {n}-byte READ) did not finish within "
                f"{self.deadline_s} s; the peer may be hung"), since=time.monotonic()))

    def run(self) -> tuple[float, float, TransportVerdict | None]:
        plan, agent, peer = self.plan, self.agent, self.peer
        total = plan.total_bytes
        deadline = time.monotonic() + self.deadline_s
        local_h = remote_h = None
        inflight: list[tuple[int, Any, float]] = []  # (chunk index, request, post time)
        probe_verdict: TransportVerdict | None = None
        probing = len(plan.chunks) > 1 and plan.chunks[0].nbytes <= self.probe_bytes
        try:
            if plan.chunks:
                local_h = agent.prep(None, plan.local_descs, plan.local_mem)  # type: ignore[arg-type]
                remote_h = agent.prep(peer, plan.remote_descs, plan.remote_mem)  # type: ignore[arg-type]
                if self.connect:
                    self._connect(deadline)
            t0 = time.perf_counter()
            next_chunk, done_bytes, stopping = 0, 0, False
            landed = t0
            last_progress = time.monotonic()  # when a chunk last landed (stall clock)

            def post_more() -> None:
                nonlocal next_chunk, stopping
                # Post while the window allows (one at a time while the probe runs).
                window = 1 if probing else self.max_inflight
                while (not stopping and next_chunk < len(plan.chunks)
                       and len(inflight) < window):
                    if stopped(self.stop):
                        stopping = True
                        break
                    c = plan.chunks[next_chunk]
                    idx = np.arange(c.start, c.stop, dtype=np.int32)
                    last = next_chunk == len(plan.chunks) - 1
                    notif = self.done_notification if last else b""
                    req = agent.make_read(local_h, idx, remote_h, idx, peer, notif)
                    inflight.append((next_chunk, req, time.perf_counter()))
                    if agent.post(req, peer, c.nbytes) == "ERR":
                        raise PeerError(f"posting a READ of {c.nbytes} bytes to peer {peer} "
                                        "failed; the peer may have exited")
                    next_chunk += 1

            while next_chunk < len(plan.chunks) or inflight:
                post_more()
                if not inflight:
                    break  # stopping with nothing in flight
                ci, req, posted = inflight[0]
                c = plan.chunks[ci]
                state = self._wait(
                    req, c.nbytes, deadline,
                    f"chunk {ci + 1}/{len(plan.chunks)} ({c.nbytes} bytes)", lambda: (
                        f"READ from peer {peer} did not finish within {self.deadline_s} s: "
                        f"{done_bytes} of {total} bytes arrived ({ci}/{len(plan.chunks)} "
                        "chunks); the peer may be hung or the link far too slow"),
                    since=last_progress)
                if state == "ERR":
                    raise PeerError(
                        f"READ of chunk {ci + 1}/{len(plan.chunks)} ({c.nbytes} bytes) from peer "
                        f"{peer} failed after {done_bytes} of {total} bytes: the peer vanished "
                        "or its memory is gone; try another source")
                inflight.pop(0)
                agent.release(req)
                landed = time.perf_counter()
                last_progress = time.monotonic()
                done_bytes += c.nbytes
                if probing:
                    probing = False
                    # The first chunk carries the connection setup: judged on the
                    # cold floor here, the steady rate is judged after the last chunk.
                    self.first_chunk = (c.nbytes, landed - t0)
                    probe_verdict = assess(self.expected, c.nbytes, landed - posted,
                                           facts=self.watch.facts(),
                                           min_measure_bytes=min(self.probe_bytes, c.nbytes),
                                           cold=True)
                    if not probe_verdict.ok and self.refuse:
                        raise TransportError(f"transfer from {peer} refused after a "
                                             f"{c.nbytes}-byte probe: {probe_verdict.message}")
                # Refill the window before verifying: digests of this chunk then run
                # while the next chunks move, instead of holding up their posting
                # (that stall cost 60% of the rate on an H200 host).
                post_more()
                self._verify(ci)
                if self.progress is not None:
                    t_cb = time.perf_counter()
                    self.progress(done_bytes, total)
                    # A caller that sleeps here (a rate cap) holds the loop: that time
                    # is not the transport's, and must not read as a slow link.
                    self.held_s += time.perf_counter() - t_cb
                    last_progress = time.monotonic()  # the callback's time is not a stall
            if not plan.chunks:
                self._verify(0)  # only zero-byte tensors: nothing to read, still "done"
            # Data-plane time: first post to the last byte landing. Digests of earlier
            # chunks are computed while later chunks are in flight, so subtracting the
            # verification time from the wall time would overstate the rate (it once
            # printed 1063 GB/s over a 395 GB/s NVLink); only the last chunk's check
            # runs after the last byte and is left out.
            seconds = (landed - t0) if plan.chunks else 0.0
            if stopping:
                raise TransferCancelledError(
                    f"READ from peer {peer} stopped on request after {done_bytes} of {total} "
                    "bytes; tensors not reported done are incomplete")
            return max(seconds, 1e-9), self.verify_s, probe_verdict
        finally:
            for _, req, _ in inflight:
                agent.release(req)  # aborts what is still active
            for h in (local_h, remote_h):
                if h is not None:
                    agent.release(h)
