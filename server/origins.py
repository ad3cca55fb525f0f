"""The origin lease: which one target of a model reads it from storage when no peer holds it.

When targets of an identity start and no source of it is READY or loading, exactly one
of them becomes the **origin**: it reads the checkpoint from storage and serves each
piece as it lands; the others read from it (and from each other) instead of from
storage (DESIGN.md, "From zero"). Who that one is, is decided here, by a lease per
identity in the store::

    (no record) --acquire--> HELD(holder, generation 1, expires_at)
    HELD --renew by holder--> HELD (expires_at moves; source, progress, digests merged)
    HELD --release by holder--> RELEASED (holder empty; digests and source kept)
    HELD, past expires_at --acquire by anyone--> HELD(new holder, generation + 1)
    RELEASED --acquire by anyone--> HELD(new holder, generation + 1)

Exactly one caller wins an acquire: a missing record is created with
:meth:`Store.create` (one insert: the store refuses a second with the same id), and a
lapsed or released one is taken with :meth:`Store.update` (atomic on both backends:
``BEGIN IMMEDIATE`` on SQLite, WATCH/MULTI on Redis; the update function runs again
on the value a racing writer left, and then finds it held). A holder that stopped
renewing (killed, partitioned) loses the lease at ``expires_at``; until someone else
takes it, its own renewal still succeeds (nothing was lost). A renewal or release
that names a generation other than the record's is refused: that holder was replaced
and must stop acting as the origin.

The record also carries what the origin learnt that must outlive it: the source it
serves while loading (``source_id``, which the relay planner makes the root of every
follower's path), its progress, and the digest of every tensor it read from storage,
merged at each renewal. A follower verifies what it received against these digests
(they were computed from storage's bytes, by whichever origin read them), and the next
origin after a failure verifies the pieces it takes from followers against them
(``modelexpress.p2p.zero``).

Time is the server's wall clock (``ControlPlane.clock``), as for heartbeats.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

from modelexpress.errors import ConflictError, NotFoundError, ValidationError
from modelexpress.server.store import Record, Store

__all__ = ["OriginLeases", "MAX_TTL_S"]

log = logging.getLogger(__name__)

MAX_TTL_S = 3600.0
"""Longest lease a holder may ask for (a lease outlives its holder by at most this)."""


def _held(rec: Record, now: float) -> bool:
    return bool(rec.get("holder")) and now < rec["expires_at"]


def _public(rec: Record, with_digests: bool, now: float) -> Record:
    """The record as the API returns it: ``held`` said, the digests only when asked."""
    out = {**rec, "digest_count": len(rec.get("digests") or {}), "held": _held(rec, now)}
    if not with_digests:
        out["digests"] = {}
    return out


class OriginLeases:
    """The origin leases of every identity (the ``leases`` collection).

    Args:
        store: the control plane's store.
        clock: wall-clock seconds (the control plane's).
    """

    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock

    def acquire(self, identity_id: str, holder: str, ttl_s: float) -> Record:
        """Take the origin lease of ``identity_id`` for ``holder`` (re-taking one it holds
        renews it).

        Returns:
            The lease (``generation`` identifies this holding; renew and release name it).

        Raises:
            ConflictError: another holder's lease has not expired (the message says whose
                and for how long).
            ValidationError: ``ttl_s`` out of range.
        """
        _check_ttl(ttl_s)
        now = self.clock()
        fresh = {"id": identity_id, "identity_id": identity_id, "holder": holder,
                 "generation": 1, "acquired_at": now, "renewed_at": now,
                 "expires_at": now + ttl_s, "ttl_s": ttl_s, "source_id": None,
                 "digest_algorithm": None, "digests": {}, "bytes_done": 0,
                 "bytes_total": 0, "storage": ""}
        if self.store.get("leases", identity_id) is None:
            try:
                self.store.create("leases", fresh)
                log.info("origin lease of %s taken by %s (generation 1, %g s)", identity_id,
                         holder, ttl_s)
                return _public(fresh, False, now)
            except ConflictError:
                pass  # created by a racing caller meanwhile: take it over below, or lose

        def take(rec: Record) -> Record:
            now_ = self.clock()
            if rec.get("holder") == holder and _held(rec, now_):
                return {**rec, "renewed_at": now_, "expires_at": now_ + ttl_s, "ttl_s": ttl_s}
            if _held(rec, now_):
                raise ConflictError(
                    f"the origin lease of identity {identity_id} is held by {rec['holder']} "
                    f"(generation {rec['generation']}) for {rec['expires_at'] - now_:.1f} s "
                    "more; follow its source, or take the lease once it lapses")
            # ORDER: a new generation, so the previous holder's renewals are refused from
            # now on; the progress and digests of the tensors read so far stay.
            return {**rec, "holder": holder, "generation": rec["generation"] + 1,
                    "acquired_at": now_, "renewed_at": now_, "expires_at": now_ + ttl_s,
                    "ttl_s": ttl_s, "source_id": None}

        try:
            rec = self.store.update("leases", identity_id, take)
        except NotFoundError:  # deleted by a sweep between the get and the update
            return self.acquire(identity_id, holder, ttl_s)
        log.info("origin lease of %s taken by %s (generation %d, %g s)", identity_id, holder,
                 rec["generation"], ttl_s)
        return _public(rec, False, self.clock())

    def renew(self, identity_id: str, holder: str, generation: int, ttl_s: float, *,
              source_id: str | None = None, digest_algorithm: str | None = None,
              digests: Mapping[str, str] | None = None, bytes_done: int | None = None,
              bytes_total: int | None = None, storage: str | None = None,
              release: bool = False) -> Record:
        """Extend the holder's lease by ``ttl_s`` (or, with ``release``, end it) and merge
        what it reports.

        Args:
            source_id: the source the origin serves while loading.
            digest_algorithm, digests: digests of tensors it read from storage (merged).
            bytes_done, bytes_total: its progress.
            storage: where it reads from (no credentials), for operators.
            release: end the lease now (the origin finished, or gave up); the record
                keeps the digests and the source.

        Raises:
            ConflictError: ``holder``/``generation`` no longer hold the lease (another
                took it: stop acting as the origin); or digests of another algorithm
                than those recorded.
            NotFoundError: no lease for the identity.
        """
        _check_ttl(ttl_s)
        new_digests = dict(digests or {})

        def step(rec: Record) -> Record:
            now = self.clock()
            if rec.get("holder") != holder or rec["generation"] != generation:
                raise ConflictError(
                    f"the origin lease of identity {identity_id} is no longer held by "
                    f"{holder} (generation {generation}): it is "
                    + (f"held by {rec['holder']} (generation {rec['generation']})"
                       if rec.get("holder") else "released")
                    + "; stop reading storage as the origin")
            known = rec.get("digest_algorithm")
            if new_digests and known and digest_algorithm and digest_algorithm != known:
                raise ConflictError(
                    f"digests of identity {identity_id} are recorded with {known}, not "
                    f"{digest_algorithm}: an origin reports the algorithm the record has")
            out = {**rec, "renewed_at": now, "ttl_s": ttl_s,
                   "expires_at": now if release else now + ttl_s}
            if release:
                out["holder"] = ""
            if source_id is not None:
                out["source_id"] = source_id
            if new_digests:
                out["digests"] = {**(rec.get("digests") or {}), **new_digests}
                out["digest_algorithm"] = known or digest_algorithm
            for key, value in (("bytes_done", bytes_done), ("bytes_total", bytes_total),
                               ("storage", storage)):
                if value is not None:
                    out[key] = value
            return out

        try:
            rec = self.store.update("leases", identity_id, step)
        except NotFoundError:
            raise NotFoundError(f"no origin lease for identity {identity_id}: acquire it "
                                "first") from None
        if release:
            log.info("origin lease of %s released by %s (generation %d; %d digests)",
                     identity_id, holder, generation, len(rec.get("digests") or {}))
        return _public(rec, False, self.clock())

    def get(self, identity_id: str, *, with_digests: bool = True) -> Record:
        """The lease of ``identity_id`` (``held``: someone holds it and it has not
        expired).

        Raises:
            NotFoundError: no lease was ever taken for it (or it was collected).
        """
        rec = self.store.get("leases", identity_id)
        if rec is None:
            raise NotFoundError(f"no origin lease for identity {identity_id}")
        return _public(rec, with_digests, self.clock())

    def loading_origin(self, identity_id: str) -> str | None:
        """The source id of the live origin of ``identity_id`` (the lease is held and
        names a source), else None."""
        rec = self.store.get("leases", identity_id)
        if rec is None or not _held(rec, self.clock()):
            return None
        return rec.get("source_id") or None

    def sweep(self, gc_after_s: float) -> int:
        """Delete leases nobody held for ``gc_after_s`` (their digests are on the READY
        sources by then). Returns how many."""
        now = self.clock()
        gone = 0
        for rec in self.store.list("leases"):
            if not _held(rec, now) and now - rec["expires_at"] > gc_after_s:
                gone += self.store.delete("leases", rec["id"])
        return gone


def _check_ttl(ttl_s: float) -> None:
    if not 0 < ttl_s <= MAX_TTL_S:
        raise ValidationError(f"ttl_s must be > 0 and <= {MAX_TTL_S:g} (got {ttl_s!r})")

