"""From zero: fetch a model that no peer may hold yet; one target reads storage, the rest follow.

When a deployment scales from zero every target would otherwise read the whole
checkpoint from storage: N full reads at storage speed, contending. Here the targets of
one identity that start together read it from storage about once (DESIGN.md, "From
zero: the origin and its lease")::

    fetch(identity, storage)                         one loop per target, bounded by the
      |                                              pull's deadline (MX_TRANSFER_TIMEOUT_S)
      +- a READY source, nothing held yet ------> an ordinary pull() from peers   [peer]
      +- the origin lease is held, names a source
      |     FOLLOW: a transfer record the server plans behind the loading origin (a chain
      |     or a tree: the fleet relay's planner); each piece is read from the upstream
      |     holder once it advertises it, and served on (this target is a holder too)
      |     path exhausted (the origin died) -> keep every piece, contest the lease
      +- nobody holds the lease
            CONTEST: a holder defers to holders that are further ahead for a moment, so
            that the most advanced one (which holds every piece another holds) wins
            won, but a READY source (of this identity, or ``elsewhere``: the model's
                 loaded form) appeared meanwhile -> give the lease back [peer / raise]
            won  -> ORIGIN: verify the held prefix against the lease's digests, read the
                    rest from storage (StorageReader), serving each piece as it lands and
                    renewing the lease with the digests of what it read          [origin]
            lost -> follow the winner
      at the end: a follower verifies every tensor against the lease's digests (from
      storage's bytes) and reads a mismatch again from a READY holder; the origin goes
      READY with the digests and releases the lease; each holder keeps serving the
      transfers still reading from it for at most MX_RELAY_LINGER_S, then withdraws
      (:meth:`ZeroResult.release`).

Every holder is a :class:`~modelexpress.p2p.relay.RelayServer` over its destination (one
host allocation in the checkpoint's layout order: :mod:`modelexpress.storage.layout`):
published INITIALIZING with a watermark word before its first byte lands. The origin's
is the root of every path while it loads (the lease names it; the server's planner puts
it last on each path); followers read it as they read a relay. Storage is one more
reader behind the same piece interface (:class:`~modelexpress.storage.StorageReader`),
driven only by the origin.

Why followers check digests at the end and not per piece: nobody knows a tensor's digest
before storage's bytes of it were read. The origin computes each as it lands and merges
them into the lease at each renewal (at most ``_RENEW_EVERY_S`` apart), so digests
outlive an origin that dies, and the next origin verifies what it takes over. A
follower that received a bad tensor reads it again; nothing unverified is returned.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from modelexpress.errors import (ConflictError, IntegrityError, ManifestMismatchError, MxError,
                                 NoSourceError, NotFoundError, ServedElsewhereError,
                                 TransferCancelledError, TransferTimeoutError)
from modelexpress.p2p.options import PullOptions

if TYPE_CHECKING:
    import torch

    from modelexpress.client import MxClient, OriginLease, SourceInfo, TransferInfo
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p.relay import RelayServer
    from modelexpress.p2p.result import PullResult
    from modelexpress.storage import CheckpointLayout, Storage
    from modelexpress.transfer import NixlTransferManager, StopSignal

__all__ = ["ZeroFetch", "ZeroResult", "fetch"]

log = logging.getLogger(__name__)

_RENEW_EVERY_S = 1.0       # an origin renews its lease at least this often
_DIGESTS_EVERY_S = 0.1     # ...and sends new digests as soon as this after they are known
_WAIT_S = 0.1              # polls of the lease while another target is becoming the origin
_DEFER_S = 1.0             # a holder waits this long per holder ahead of it before contesting
_LIVE = ("PENDING", "RUNNING", "STOPPING")
_REPORT_EVERY_S = 0.2      # a holder's record hears its mark at most this often
_STILL_WAITING_EVERY_S = 10.0


@dataclasses.dataclass
class ZeroResult:
    """How a :func:`fetch` went.

    Attributes:
        role: ``origin`` (read storage for everyone), ``follower`` (read from the loading
            origin's fleet), ``peer`` (a READY source served it: an ordinary pull).
        tensors: name -> tensor, in the checkpoint's order (one host allocation).
        bytes: the model's bytes.
        storage_bytes: bytes this process read from storage (headers included).
        seconds: wall time of the fetch.
        verified: every tensor matched the digest storage's bytes gave.
        took_over: this origin took over from one that stopped renewing.
        rounds: follow/origin rounds it took (1 when nothing failed).
        pull: the :class:`~modelexpress.p2p.result.PullResult` of a ``peer`` fetch.
    """

    role: str
    tensors: dict[str, "torch.Tensor"]
    bytes: int
    storage_bytes: int
    seconds: float
    verified: bool
    took_over: bool = False
    rounds: int = 1
    pull: "PullResult | None" = None
    _holding: "_Holding | None" = dataclasses.field(default=None, repr=False)

    def release(self, linger_s: float | None = None) -> None:
        """Serve the transfers still reading from this target for at most ``linger_s``
        (default ``MX_RELAY_LINGER_S``), then withdraw. Call once the tensors are used
        (the caller may change them afterwards); idempotent."""
        holding, self._holding = self._holding, None
        if holding is not None:
            holding.release(linger_s)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (``--json`` output)."""
        return {"role": self.role, "bytes": self.bytes, "storage_bytes": self.storage_bytes,
                "seconds": round(self.seconds, 3), "verified": self.verified,
                "took_over": self.took_over, "rounds": self.rounds,
                "tensors": len(self.tensors),
                "pull": self.pull.to_dict() if self.pull is not None else None}


class _Lost(MxError):
    """This origin's lease went to another holder (it stops reading storage)."""


class _Holding:
    """A target's destination across roles and rounds: what it holds and who it serves."""

    def __init__(self, client: "MxClient", identity: "ModelIdentity", layout: "CheckpointLayout",
                 opts: PullOptions, worker: str) -> None:
        from modelexpress.checkpoint import allocate_slab
        from modelexpress.p2p.readers import AgentStart

        self.client, self.identity, self.layout, self.opts = client, identity, layout, opts
        self.worker = worker
        self.total = layout.total_bytes
        self.dest = allocate_slab(layout.specs(), "cpu")
        self.mark = 0
        self.server: "RelayServer | None" = None
        self.ref = ""
        self.record: "TransferInfo | None" = None
        self.tracker: Any = None
        self._reporter: _Reporter | None = None
        self._agent = AgentStart(opts.backend, None, register=self.dest)
        # the agent of the first relay source this target publishes (serve()), made now
        self._relay_agent: AgentStart | None = AgentStart(opts.backend)

    @property
    def manager(self) -> "NixlTransferManager":
        return self._agent.get()

    def serve(self, worker_id: str, record: "TransferInfo | None") -> None:
        """Publish the destination as a relay source under ``worker_id`` (INITIALIZING,
        its watermark at the current mark); the one published before is withdrawn."""
        from modelexpress.p2p.relay import RelayServer
        from modelexpress.p2p.relay_plan import source_ref, transfer_ref
        from modelexpress.p2p.tracking import TransferTracker
        from modelexpress.transfer.manifest import build_manifest

        self.withdraw(f"re-planned as {worker_id}")
        plain = build_manifest(self.dest, digests=False)
        ahead, self._relay_agent = self._relay_agent, None
        self.server = RelayServer(self.client, self.identity, self.dest, plain,
                                  worker_id=worker_id,
                                  heartbeat_interval_s=self.opts.heartbeat_interval_s,
                                  backend=self.opts.backend,
                                  manager=ahead.get() if ahead is not None else None)
        self.server.advance(self.mark)
        self.record = record
        self.ref = transfer_ref(record.id) if record is not None else source_ref(
            self.server.source_id)
        self.tracker = (TransferTracker(self.client, record.id, interval_s=0.5,
                                        source_id=record.source_id, run_by_target=True)
                        if record is not None else None)
        if self.tracker is not None:
            self._reporter = _Reporter(self.tracker, self.total)

    def advance(self, mark: int) -> None:
        """Every byte below ``mark`` landed: tell readers (the word, at once) and the
        record (from a thread of its own: the read loops never wait on HTTP)."""
        if mark <= self.mark:
            return
        self.mark = mark
        if self.server is not None:
            self.server.advance(mark)
        if self._reporter is not None:
            self._reporter.set(mark)

    def finish(self, state: str, error: str | None = None) -> None:
        """End the transfer record (if any) with ``state``."""
        reporter, self._reporter = self._reporter, None
        if reporter is not None:
            reporter.close()
        if self.tracker is not None:
            self.tracker.finish(state, error=error, done=self.mark)
            self.tracker = None

    def withdraw(self, why: str) -> None:
        """Stop serving and end the transfer record (FAILED: its readers re-plan)."""
        server, self.server = self.server, None
        self.finish("FAILED", error=f"from zero: {why}")
        if server is not None:
            server.close()

    def release(self, linger_s: float | None) -> None:
        linger = self.opts.relay_linger_s if linger_s is None else linger_s
        try:
            if self.server is not None and self.ref:
                _wait_unread(self.client, self.ref, self.identity.id, linger)
        except MxError as exc:
            log.warning("from zero: could not list the readers of %s (%s); withdrawing",
                        self.ref, exc)
        finally:
            server, self.server = self.server, None
            if server is not None:
                server.close()
            self._agent.close()
            if self._relay_agent is not None:
                self._relay_agent.close()
                self._relay_agent = None


class _Reporter:
    """Reports a holder's mark as its record's progress, coalesced, from its own thread."""

    def __init__(self, tracker: Any, total: int) -> None:
        self._tracker, self._total = tracker, total
        self._mark = self._sent = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mx-zero-report", daemon=True)
        self._thread.start()

    def set(self, mark: int) -> None:
        with self._cond:
            self._mark = mark
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._mark == self._sent and not self._closed:
                    self._cond.wait(1.0)
                if self._closed:
                    return
                mark = self._mark
            self._tracker.report(mark, self._total, force=True)
            self._sent = mark
            time.sleep(_REPORT_EVERY_S)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(10.0)


def _wait_unread(client: "MxClient", ref: str, identity_id: str, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until no live transfer reads from ``ref`` first."""
    end = time.monotonic() + timeout_s
    nap = 0.05
    while True:
        readers = [t.id for t in client.list_transfers(identity=identity_id)
                   if t.relay_path[:1] == (ref,) and t.state in _LIVE]
        if not readers or time.monotonic() >= end:
            if readers:
                log.info("from zero: %d transfers still read from %s after %.0f s; withdrawing "
                         "(they read the rest from the next holder)", len(readers), ref,
                         timeout_s)
            return
        time.sleep(min(nap, max(end - time.monotonic(), 0.0)))
        nap = min(nap * 2, 0.5)


class ZeroFetch:
    """One fetch from zero (:func:`fetch` is ``ZeroFetch(...).prepare().run()``).

    :meth:`prepare` allocates the destination and starts the NIXL agent (what a target
    needs whatever its role, the part of a fetch that costs CPU rather than waiting);
    :meth:`run` is the loop of the module docstring. Apart, a fleet started together
    can be timed from the moment it starts to read (``bench/cluster.py``).

    Args: as :func:`fetch` (``worker_id`` required).
    """

    def __init__(self, identity: "ModelIdentity", storage: "Storage",
                 layout: "CheckpointLayout", client: "MxClient", opts: PullOptions,
                 worker: str, stop: "StopSignal | None" = None,
                 progress: Callable[[int, int], None] | None = None,
                 elsewhere: Callable[[], bool] | None = None) -> None:
        self.identity, self.storage, self.layout = identity, storage, layout
        self.client, self.opts, self.worker = client, opts, worker
        self.stop, self.progress, self.elsewhere = stop, progress, elsewhere
        self.start = time.monotonic()
        self.end = self.start + opts.timeout_s
        self.holding: _Holding | None = None
        self.took_over = False
        self.rounds = 0
        self.said = self.start
        self.deferred = 0  # rounds this holder already let others take the lease first
        self.failed_root = ""  # the root source of the last path that gave out

    def prepare(self) -> "ZeroFetch":
        """Allocate the destination and start the NIXL agent, unless a READY source
        serves the model already (an ordinary pull then allocates its own)."""
        if self.holding is None and not self._ready():
            self._holding_for()
        return self

    def close(self) -> None:
        """Withdraw whatever this fetch serves (a failed or abandoned fetch). Idempotent."""
        holding, self.holding = self.holding, None
        if holding is not None:
            holding.withdraw("the fetch failed")
            holding.release(0.0)

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> ZeroResult:
        """Fetch (module docstring); the deadline counts from here.

        Raises:
            As :func:`fetch`.
        """
        self.start = self.said = time.monotonic()
        self.end = self.start + self.opts.timeout_s
        try:
            result = self._loop()
        except BaseException:
            self.close()
            raise
        log.info("from zero: %s fetched as %s in %.2f s (%d bytes; %d read from storage "
                 "here%s)", self.identity.model, result.role, result.seconds, result.bytes,
                 result.storage_bytes, "; took over from a dead origin" if result.took_over
                 else "")
        return result

    def _loop(self) -> ZeroResult:
        while True:
            self._go_on("fetching")
            if self._ready():
                if self.holding is None:
                    result = self._peer_pull()
                    if result is not None:
                        return result
                elif self._follow():  # the planner puts the READY source last on the path
                    return self._finish_follower()
            lease = self._lease()
            if lease is not None and lease.held and lease.holder != self.worker:
                if not lease.source_id:
                    self._wait(f"{lease.holder} to publish what it loads")
                    continue
                if lease.source_id == self.failed_root:
                    # Its origin died under this holder: keep serving what it holds (the
                    # holders behind it wait on it) until the lease lapses or changes hands.
                    self._wait(f"the origin lease of {lease.holder} to lapse")
                    continue
                if self._follow():
                    return self._finish_follower()
                continue
            if lease is None or not lease.held or lease.holder == self.worker:
                if self._defer():
                    continue
                try:
                    won = self.client.acquire_origin(self.identity, self.worker,
                                                     self.opts.origin_lease_s)
                except ConflictError:
                    continue  # another target won: follow it
                if self._ready():
                    # The origin finished between this loop's look for READY sources
                    # and its look at the lease (it turns its source READY, then releases
                    # the lease): read from it, not from storage. Seen on a loaded 2-core
                    # CI machine: of three engines started together, the third read the
                    # checkpoint from S3 again.
                    self._give_back(won)
                    continue
                if self.elsewhere is not None and self.elsewhere():
                    # The same race one level up: the origin's engine serves its loaded
                    # form now and withdrew the checkpoint before this target looked.
                    self._give_back(won)
                    raise ServedElsewhereError(
                        f"{self.identity.model} turned READY in another form while this "
                        "target took the origin lease; storage not read")
                try:
                    return self._originate(won)
                except _Lost as exc:
                    log.warning("from zero: %s; following the new origin", exc)
                    continue

    def _give_back(self, lease: "OriginLease") -> None:
        """Release a lease just won without reading anything."""
        try:
            self.client.renew_origin(self.identity, self.worker, lease.generation,
                                     self.opts.origin_lease_s, release=True)
        except (ConflictError, NotFoundError) as exc:  # lapsed or taken meanwhile: not ours
            log.debug("from zero: giving the origin lease back: %s", exc)

    def _go_on(self, what: str) -> None:
        if self.stop is not None and (self.stop.is_set() if isinstance(self.stop, threading.Event)
                                      else self.stop()):
            raise TransferCancelledError(f"fetch of {self.identity.model} stopped on request")
        if time.monotonic() > self.end:
            held = self.holding.mark if self.holding is not None else 0
            raise TransferTimeoutError(
                f"fetch of {self.identity.model} did not finish within {self.opts.timeout_s:g} s "
                f"(MX_TRANSFER_TIMEOUT_S) while {what}: {held} of {self.layout.total_bytes} "
                "bytes held")

    def _wait(self, what: str) -> None:
        now = time.monotonic()
        if now - self.said > _STILL_WAITING_EVERY_S:
            self.said = now
            log.info("from zero: still waiting for %s after %.0f s", what, now - self.start)
        time.sleep(_WAIT_S)

    def _ready(self) -> bool:
        return bool(self.client.list_sources(identity=self.identity, state="READY"))

    def _lease(self) -> "OriginLease | None":
        try:
            return self.client.get_origin(self.identity)
        except NotFoundError:
            return None

    def _defer(self) -> bool:
        """A holder with pieces lets holders further ahead take the lease first (they hold
        every piece it holds). True: it waited; look again."""
        if self.holding is None:
            return False
        own = self.holding.record.id if self.holding.record is not None else ""
        ahead = sum(1 for t in self.client.list_transfers(identity=self.identity)
                    if t.id != own and t.state in _LIVE and t.relay_path
                    and (t.bytes_done, t.id) > (self.holding.mark, own))
        if not ahead or self.deferred >= ahead:
            self.deferred = 0
            return False
        self.deferred += 1
        log.info("from zero: the origin lease is free; %d holders are further ahead than this "
                 "one (%d bytes): letting them take it first", ahead, self.holding.mark)
        time.sleep(_DEFER_S)
        return True

    # -- peer ---------------------------------------------------------------------------
    def _peer_pull(self) -> ZeroResult | None:
        from modelexpress.p2p.target import pull

        got: dict[str, "torch.Tensor"] = {}
        try:
            result = pull(self.identity, None, client=self.client, progress=self.progress,
                          stop=self.stop, on_destination=got.update,
                          options=self.opts.replace(timeout_s=max(self.end - time.monotonic(),
                                                                  1.0)))
        except (NoSourceError, ConflictError) as exc:
            log.info("from zero: the READY sources could not serve (%s); from zero then", exc)
            return None
        return ZeroResult("peer", got, result.bytes, self.storage.bytes_read,
                          time.monotonic() - self.start, result.verified, pull=result)

    # -- follower -----------------------------------------------------------------------
    def _holding_for(self) -> _Holding:
        if self.holding is None:
            self.holding = _Holding(self.client, self.identity, self.layout, self.opts,
                                    self.worker)
        return self.holding

    def _follow(self) -> bool:
        """One round behind the loading origin (or a READY source); True when every piece
        landed, False when the path gave out (the pieces held are kept)."""
        from modelexpress.p2p.relay import RelayReader, relay_worker_id
        from modelexpress.p2p.manifests import manifest_of

        self.rounds += 1
        holding = self._holding_for()
        try:
            record = self.client.start_transfer(self.identity, self.worker,
                                                run_by_target=True, relay_read=True,
                                                relay_serve=True)
        except ConflictError:
            self._wait("a holder to follow")  # the origin lapsed meanwhile
            return False
        try:
            root = self.client.get_source(record.source_id)
        except NotFoundError:
            # The path's root withdrew between the plan and this look: an origin that
            # finished withdraws its origin source once its engine serves the model (seen
            # on a loaded 2-core CI machine: the second of three engines then fell back
            # to a disk without weights). Look again: a READY source serves it now.
            log.info("from zero: %s withdrew before it was read; looking again",
                     record.source_id)
            try:
                self.client.finish_transfer(record.id, "FAILED",
                                            error=f"{record.source_id} withdrew before it "
                                                  "was read")
            except MxError as exc:
                log.debug("from zero: ending transfer %s: %s", record.id, exc)
            return False
        manifest = manifest_of(root)
        self._check(manifest)
        holding.serve(relay_worker_id(self.worker, record.id), record)
        log.info("from zero: following %s through %s (%d of %d bytes held)", root.worker_id,
                 " -> ".join(record.relay_path) or record.source_id, holding.mark, holding.total)
        reader = RelayReader(
            self.client, holding.manager, root, manifest, record.relay_path,
            identity_id=self.identity.id, chunk_bytes=self.opts.relay_chunk_bytes,
            link_mbit=self.opts.relay_link_mbit, stall_s=self.opts.stall_s, verify=False,
            refuse_slow_transport=self.opts.refuse_slow_transport, publish=holding.advance,
            have=holding.mark)
        try:
            reader.read_into(holding.dest, allow_partial=False,
                             progress=self._progress, stop=self.stop,
                             deadline_s=max(self.end - time.monotonic(), 1.0))
        except TransferCancelledError:
            holding.withdraw("stopped")
            raise
        except MxError as exc:
            holding.advance(reader.mark)
            self.failed_root = record.source_id
            log.warning("from zero: the path behind %s gave out at %d of %d bytes (%s); "
                        "keeping them", record.source_id, holding.mark, holding.total, exc)
            return False
        holding.advance(holding.total)
        return True

    def _check(self, manifest: Any) -> None:
        theirs = [(e.name, e.nbytes) for e in manifest.tensors]
        ours = [(t.name, t.nbytes) for t in self.layout.tensors]
        if theirs != ours:
            raise ManifestMismatchError(
                f"the loading origin of {self.identity.model} serves other tensors than "
                f"{self.layout.url} holds ({len(theirs)} against {len(ours)}): another "
                "checkpoint under the same identity; give it another --revision")

    def _finish_follower(self) -> ZeroResult:
        holding = self.holding
        assert holding is not None
        bad = self._verify(holding)
        if bad:
            self._read_again(bad)
        holding.finish("SUCCEEDED")
        return ZeroResult("follower", holding.dest, holding.total, self.storage.bytes_read,
                          time.monotonic() - self.start, True, rounds=self.rounds,
                          _holding=holding)

    def _verify(self, holding: _Holding) -> list[str]:
        """Tensors whose bytes differ from the digests the origins recorded from storage."""
        from modelexpress.transfer import digest as _digest

        names = [t.name for t in self.layout.tensors]
        while True:
            algo, want = self._reference_digests(names)
            if algo is not None:
                break
            self._go_on(f"waiting for the digests of the {len(names)} tensors from the origin")
            self._wait("the origin's digests")
        got = _digest.digest_many([holding.dest[n] for n in names], algo)
        bad = [n for n, g in zip(names, got) if g != want[n]]
        if bad:
            log.error("from zero: %d tensors differ from storage's digests (e.g. %s); reading "
                      "them again from a READY holder", len(bad), bad[:3])
        return bad

    def _reference_digests(self, names: list[str]) -> tuple[str | None, dict[str, str]]:
        """Every tensor's digest, as the origins recorded them in the lease, or else as a
        READY source of the identity publishes them (one that was published, not loaded
        from zero); ``(None, {})`` while neither has them all."""
        from modelexpress.p2p.manifests import manifest_of

        try:
            lease = self.client.get_origin(self.identity)
        except NotFoundError:
            lease = None
        if lease is not None and lease.digest_algorithm and all(
                n in lease.digests for n in names):
            return lease.digest_algorithm, dict(lease.digests)
        for info in self.client.list_sources(identity=self.identity, state="READY"):
            try:
                manifest = manifest_of(self.client.get_source(info.id))
            except MxError:
                continue
            theirs = {e.name: e.digest for e in manifest.tensors if e.digest}
            if manifest.digest_algorithm and all(n in theirs for n in names):
                return manifest.digest_algorithm, theirs
        return None, {}

    def _read_again(self, bad: list[str]) -> None:
        from modelexpress.p2p.target import pull

        holding = self.holding
        assert holding is not None
        sub = {n: holding.dest[n] for n in bad}
        pull(self.identity, sub, client=self.client, options=self.opts.replace(
            allow_partial=True, relay_read=False, relay_serve=False,
            timeout_s=max(self.end - time.monotonic(), 1.0)))
        still = self._verify(holding)
        if still:
            raise IntegrityError(f"{len(still)} tensors of {self.identity.model} still differ "
                                 f"from storage's digests after reading them again (e.g. "
                                 f"{still[0]!r})")

    # -- origin -------------------------------------------------------------------------
    def _originate(self, lease: "OriginLease") -> ZeroResult:
        from modelexpress.storage import StorageReader

        self.rounds += 1
        holding = self._holding_for()
        self.took_over = lease.generation > 1
        if holding.server is None:
            holding.serve(f"{self.worker}-origin", None)
        assert holding.server is not None
        gen = lease.generation
        ttl = self.opts.origin_lease_s
        self.client.renew_origin(self.identity, self.worker, gen, ttl,
                                 source_id=holding.server.source_id, storage=self.storage.url,
                                 bytes_total=holding.total, bytes_done=holding.mark)
        log.info("from zero: origin of %s (generation %d%s): reading %s from %d of %d bytes",
                 self.identity.model, gen, ", taking over" if self.took_over else "",
                 self.storage.url, holding.mark, holding.total)
        digests = _Digests(self.client.get_origin(self.identity), holding)
        have = digests.verify_prefix(holding.mark)
        failed: list[BaseException] = []
        lost = threading.Event()

        def stopped() -> bool:
            return lost.is_set() or (self.stop is not None and (
                self.stop.is_set() if isinstance(self.stop, threading.Event) else self.stop()))

        reader = StorageReader(self.storage, self.layout, self.opts.storage, have=have,
                               publish=holding.advance, tensor_done=digests.add)

        def run() -> None:
            try:
                reader.read_into(holding.dest, progress=self._progress, stop=stopped,
                                 deadline_s=max(self.end - time.monotonic(), 1.0))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                failed.append(exc)

        worker = threading.Thread(target=run, name="mx-origin-storage", daemon=True)
        worker.start()
        every = min(ttl / 3, _RENEW_EVERY_S)
        renewed = time.monotonic()
        try:
            while worker.is_alive():
                worker.join(_DIGESTS_EVERY_S)
                # Digests go out as soon as there are some (at most 10 a second): an
                # origin that dies costs its successor the tensors whose digests it had
                # not recorded (they are read from storage again); the lease's bytes_done
                # is the prefix whose digests are recorded.
                if not digests.pending() and time.monotonic() - renewed < every:
                    continue
                renewed = time.monotonic()
                try:
                    new = digests.take()
                    self.client.renew_origin(self.identity, self.worker, gen, ttl,
                                             digest_algorithm=digests.algorithm, digests=new,
                                             bytes_done=digests.recorded())
                except ConflictError as exc:
                    lost.set()
                    worker.join()
                    raise _Lost(f"the origin lease of {self.identity.model} went to another "
                                f"target ({exc})") from exc
                except MxError as exc:  # the control plane is down: keep reading, say so
                    digests.untake(new)
                    log.warning("from zero: renewing the origin lease failed: %s", exc)
        except BaseException:
            lost.set()
            worker.join()
            raise
        if failed:
            self._give_up(gen, digests, failed[0])
            raise failed[0]
        # ORDER: the digests first (followers verify against the lease), then READY (new
        # targets pull from it as from any source), then the lease goes.
        self.client.renew_origin(self.identity, self.worker, gen, ttl,
                                 digest_algorithm=digests.algorithm, digests=digests.take(),
                                 bytes_done=holding.total)
        holding.server.complete(digests.algorithm, digests.all())
        self.client.renew_origin(self.identity, self.worker, gen, ttl, release=True)
        holding.finish("SUCCEEDED")
        log.info("from zero: %s loaded from %s as its origin (%d bytes from storage) and "
                 "READY", self.identity.model, self.storage.url, reader.bytes_read)
        return ZeroResult("origin", holding.dest, holding.total, self.storage.bytes_read,
                          time.monotonic() - self.start, True, took_over=self.took_over,
                          rounds=self.rounds, _holding=holding)

    def _give_up(self, gen: int, digests: "_Digests", exc: BaseException) -> None:
        """Storage failed: hand the lease back with what was learnt, withdraw."""
        log.error("from zero: reading %s failed; the origin lease is released for another "
                  "target: %s", self.storage.url, exc)
        try:
            self.client.renew_origin(self.identity, self.worker, gen, self.opts.origin_lease_s,
                                     release=True, digest_algorithm=digests.algorithm,
                                     digests=digests.take())
        except MxError as err:
            log.warning("from zero: releasing the origin lease failed: %s", err)
        if self.holding is not None:
            self.holding.withdraw(f"storage failed: {exc}")
            self.holding.release(0.0)
            self.holding = None

    def _progress(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)


class _Digests:
    """An origin's digests: those the lease has, and those it computed since its last
    renewal (sent with the next)."""

    def __init__(self, lease: "OriginLease", holding: _Holding) -> None:
        from modelexpress.transfer import digest as _digest

        self.holding = holding
        self.known = dict(lease.digests)
        self.algorithm = lease.digest_algorithm or _digest.default_algorithm(
            holding.dest.values())
        self._new: dict[str, str] = {}
        self._lock = threading.Lock()

    def add(self, name: str) -> None:
        from modelexpress.transfer import digest as _digest

        (value,) = _digest.digest_many([self.holding.dest[name]], self.algorithm)
        with self._lock:
            self._new[name] = value

    def pending(self) -> bool:
        with self._lock:
            return bool(self._new)

    def take(self) -> dict[str, str]:
        """The digests computed since the last call (to send); they count as known."""
        with self._lock:
            new, self._new = self._new, {}
        self.known.update(new)
        return new

    def untake(self, new: dict[str, str]) -> None:
        """``new`` (from :meth:`take`) was not recorded: send it with the next renewal."""
        with self._lock:
            self._new = {**new, **self._new}
        for name in new:
            self.known.pop(name, None)

    def recorded(self) -> int:
        """Bytes of the prefix of whole tensors whose digests are known (recorded)."""
        pos = 0
        for t in self.holding.layout.tensors:
            if t.name not in self.known:
                break
            pos += t.nbytes
        return pos

    def all(self) -> dict[str, str]:
        self.take()
        return dict(self.known)

    def verify_prefix(self, mark: int) -> int:
        """The bytes of the held prefix to keep: every whole tensor below ``mark`` whose
        digest the lease has and matches; storage is read from the first that does not
        (its digest is missing: its origin died before renewing with it; or it differs)."""
        from modelexpress.transfer import digest as _digest

        pos = 0
        for t in self.holding.layout.tensors:
            if pos + t.nbytes > mark:
                break
            want = self.known.get(t.name)
            if want is None:
                log.info("from zero: tensor %r (held) has no recorded digest; reading it and "
                         "what follows from storage", t.name)
                return pos
            (got,) = _digest.digest_many([self.holding.dest[t.name]], self.algorithm)
            if got != want:
                log.warning("from zero: held tensor %r differs from storage's digest; reading "
                            "it and what follows from storage", t.name)
                return pos
            pos += t.nbytes
        return pos


def fetch(identity: "ModelIdentity", storage: "Storage", *, client: "MxClient",
          options: PullOptions | None = None, layout: "CheckpointLayout | None" = None,
          worker_id: str | None = None, progress: Callable[[int, int], None] | None = None,
          stop: "StopSignal | None" = None,
          elsewhere: Callable[[], bool] | None = None) -> ZeroResult:
    """Fetch ``identity``'s checkpoint: from READY peers, from its loading origin's fleet,
    or, as the origin, from ``storage`` (module docstring).

    Args:
        identity: what is fetched; every target of it must name the same.
        storage: where the checkpoint is (:func:`~modelexpress.storage.open_storage`).
        client: control-plane client.
        options: ``PullOptions.from_settings`` (deadline, relay pieces, storage, lease).
        layout: the checkpoint's layout when the caller read it already.
        worker_id: this target's worker id (default ``zero-<host>-<pid>-<random>``).
        progress: ``progress(bytes_done, bytes_total)``.
        stop: honoured between pieces.
        elsewhere: True when the model is READY in another form (an engine's loaded
            form, which its engine serves once the checkpoint it fetched is loaded):
            asked before this target reads storage as the origin.

    Returns:
        A :class:`ZeroResult`; call its ``release()`` once the tensors are used.

    Raises:
        StorageReadError, CheckpointError: this target was the origin and storage failed
            (the lease was released for another target; nothing is returned).
        TransferTimeoutError: ``options.timeout_s`` ran out.
        TransferCancelledError: ``stop``.
        IntegrityError: received tensors differ from storage's digests even when read
            again.
        ServedElsewhereError: ``elsewhere()`` said yes where this target would have read
            storage (the lease was given back).
    """
    from modelexpress.p2p.source import default_worker_id
    from modelexpress.storage import read_layout

    run = ZeroFetch(identity, storage, layout or read_layout(storage), client,
                    options or PullOptions(), worker_id or default_worker_id("zero"), stop,
                    progress, elsewhere)
    try:
        run.prepare()
    except BaseException:
        run.close()
        raise
    return run.run()
