"""The control plane's rules on top of a :class:`~modelexpress.server.store.Store`.

HTTP lives in ``app.py``; this module is what the routes call. It owns the state
machines (``states.py``), source selection, staleness and garbage collection. Every
state change goes through ``Store.update`` so it is atomic on every backend.

Time is wall-clock (``time.time``) because records outlive the process and are
shared between replicas; a monotonic clock would mean nothing to another process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Callable

from modelexpress.errors import ConflictError, NotFoundError, ValidationError
from modelexpress.identity import ModelIdentity
# At start-up, not at the first relay claim: imported there, the package's first import
# (about 0.1 s) fell inside a pulling engine's model-loading phase (an 8B target on one
# H100, vLLM 0.26: the pull's control plane 0.130 s of 0.195 s).
from modelexpress.p2p.relay_plan import (Holder, assign, choose_fanout, chunks_of,
                                         piece_bytes, source_ref, transfer_ref)
from modelexpress.server import content
from modelexpress.server.origins import OriginLeases
from modelexpress.server.states import (
    LIVE, TERMINAL, SourceState, TransferState, check_source_move, check_transfer_move,
)
from modelexpress.server.store import Record, Store

__all__ = ["ControlPlane", "source_id_for", "CLAIM_REDELIVERY_S"]

log = logging.getLogger(__name__)

_S = SourceState
_T = TransferState

CLAIM_REDELIVERY_S = 15.0
"""A transfer an agent claimed this long ago and never started is handed out again at
its next poll (``ControlPlane.claim_assignments``)."""


def source_id_for(identity_id: str, worker_id: str) -> str:
    """The id of the source that ``worker_id`` publishes for ``identity_id``.

    Several workers may serve one identity; one worker serves an identity once,
    so publishing again replaces its own record.
    """
    return f"{identity_id}:{worker_id}"


class ControlPlane:
    """Sources, transfers and agents with their rules.

    Args:
        store: where records live (shared by all replicas).
        stale_after_s: a source without a heartbeat for this long is STALE.
        gc_after_s: STALE sources, finished transfers and silent agents older than
            this are deleted by :meth:`sweep`.
        max_manifest_bytes: largest manifest (as compact JSON) a source may publish.
        default_policy: ``random`` or ``spread`` when a transfer names no source.
        clock: wall-clock seconds; tests pass a fake to age records.
        on_finish: called with the record each time a finish report moves a transfer
            to its final state (the app's metrics count outcomes with it).
        readers_per_source: live readers per holder before a claim goes to another
            (``MX_RELAY_READERS_PER_SOURCE``; 0: the relay planner chooses, see
            :mod:`modelexpress.p2p.relay_plan`).
        relay_chunk_bytes: ``MX_RELAY_CHUNK_BYTES``: with the model's size and the
            target's link, the piece count the planner's chain-or-tree choice assumes
            (:func:`~modelexpress.p2p.relay_plan.piece_bytes`, as the target's reader).
    """

    def __init__(self, store: Store, *, stale_after_s: float, gc_after_s: float,
                 max_manifest_bytes: int, default_policy: str = "random",
                 clock: Callable[[], float] = time.time,
                 on_finish: Callable[[Record], None] = lambda record: None,
                 readers_per_source: int = 0, relay_chunk_bytes: int = 4 << 20) -> None:
        self.store = store
        self.stale_after_s = stale_after_s
        self.gc_after_s = gc_after_s
        self.max_manifest_bytes = max_manifest_bytes
        self.default_policy = default_policy
        self.clock = clock
        self.on_finish = on_finish
        self.readers_per_source = readers_per_source
        self.relay_chunk_bytes = relay_chunk_bytes
        # Claims plan against the claims made before them (a reader limit counts the
        # readers already placed): one at a time on this replica. Across replicas two
        # claims racing may both see a slot free; the worst case is one holder with a
        # reader over its limit, which is what a saturated fleet gets anyway.
        self._claim_lock = threading.Lock()
        self._rng = random.Random()
        self.origins = OriginLeases(store, clock)

    # --- sources -------------------------------------------------------------
    def _effective(self, src: Record, now: float) -> Record:
        """A live source past its heartbeat deadline reads as STALE even before the sweep."""
        if src["state"] != _S.STALE.value and now - src["last_heartbeat"] > self.stale_after_s:
            return {**src, "state": _S.STALE.value}
        return src

    def publish_source(self, identity: ModelIdentity, worker_id: str, *, endpoint: str,
                       agent_metadata: str, manifest: dict[str, Any], state: SourceState,
                       devices: Sequence[str] = (), layout: dict[str, Any] | None = None
                       ) -> Record:
        """Create or replace the source of ``worker_id`` for ``identity``.

        ``devices``: UUIDs of the GPUs the source serves from (API version 2 publishers).
        ``layout``: the layout of its loaded form (API version 5 publishers), stored
        beside the manifest; it makes the source a candidate for targets of other
        parallel layouts (:meth:`rank_sources`).

        Raises:
            ValidationError: the manifest, or the layout, is larger than
                ``max_manifest_bytes`` (413).
            ConflictError: the manifest serves other content than a READY source of the
                same identity (``content.py``); the message names the first tensor that
                differs. The publisher's previous record, if any, is left as it was.
        """
        blob = json.dumps(manifest, separators=(",", ":"), allow_nan=False)
        if len(blob) > self.max_manifest_bytes:
            raise ValidationError(
                f"manifest is {len(blob)} bytes as JSON; the limit is "
                f"{self.max_manifest_bytes} (MX_SERVER_MAX_MANIFEST_BYTES)")
        layout_bytes = (len(json.dumps(layout, separators=(",", ":"), allow_nan=False))
                        if layout is not None else 0)
        if layout_bytes > self.max_manifest_bytes:
            raise ValidationError(
                f"layout is {layout_bytes} bytes as JSON; the limit is "
                f"{self.max_manifest_bytes} (MX_SERVER_MAX_MANIFEST_BYTES)")
        now = self.clock()
        sid = source_id_for(identity.id, worker_id)
        fp = content.fingerprint(manifest)
        self._refuse_conflict(sid, identity, manifest, fp)
        old = self.store.get("sources", sid)
        old_blob = self.store.get("blobs", sid) if old else None
        record = {
            "id": sid, "identity_id": identity.id, "identity": identity.to_dict(),
            "worker_id": worker_id, "endpoint": endpoint, "state": state.value,
            "created_at": old["created_at"] if old else now, "updated_at": now,
            "last_heartbeat": now, "manifest_bytes": len(blob), "fingerprint": fp,
            "devices": list(devices), "family": identity.family, "layout_bytes": layout_bytes,
        }
        # Blob first: a reader that finds the summary must also find its manifest.
        self.store.put("blobs", {"id": sid, "manifest": manifest, "agent_metadata": agent_metadata,
                                 **({"layout": layout} if layout is not None else {})})
        self.store.put("sources", record)
        try:
            # Again after writing: two conflicting publishes racing (on two replicas)
            # both passed the first check; each now sees the other and backs out, so
            # at worst both get a 409, never both stay.
            self._refuse_conflict(sid, identity, manifest, fp)
        except ConflictError:
            if old is not None and old_blob is not None:
                self.store.put("blobs", old_blob)
                self.store.put("sources", old)
            else:
                self.store.delete("sources", sid)
                self.store.delete("blobs", sid)
            raise
        log.info("source %s published (%s, worker %s, %s, manifest %d bytes)",
                 sid, identity.model, worker_id, state.value, len(blob))
        return record

    def _refuse_conflict(self, source_id: str, identity: ModelIdentity,
                         manifest: dict[str, Any], fp: str) -> None:
        """Raise ConflictError when a READY source of ``identity`` (not ``source_id``)
        serves other content than ``manifest``."""
        checked = {fp}  # one source per fingerprint is enough: equal hash, equal content
        for other in self.list_sources(identity_id=identity.id, state=_S.READY):
            if other["id"] == source_id or other.get("fingerprint") in checked:
                continue
            if other.get("fingerprint"):
                checked.add(other["fingerprint"])
            theirs = self.store.get("blobs", other["id"])
            if theirs is None:
                continue  # deleted meanwhile
            if content.coexist(manifest, theirs["manifest"]):
                continue  # content variants: the reader picks one (content.py)
            diff = content.first_difference(manifest, theirs["manifest"])
            if diff is not None:
                raise ConflictError(
                    f"manifest of {source_id} conflicts with READY source {other['id']} of "
                    f"the same identity ({identity.model} revision {identity.revision}, "
                    f"dtype {identity.dtype}, rank {identity.rank}): {diff}. Publish "
                    "different weights under another revision, or withdraw that source "
                    "first (DELETE /v1/sources/{id}).")

    def heartbeat(self, source_id: str, state: SourceState | None) -> Record:
        """Record a heartbeat, optionally moving the source to ``state``.

        Raises:
            NotFoundError: unknown (or garbage-collected) source: publish again.
            ConflictError: illegal move (e.g. READY -> INITIALIZING).
        """
        now = self.clock()
        was = _S.READY

        def beat(src: Record) -> Record:
            nonlocal was
            old = was = _S(src["state"])
            new = state or (_S.READY if old is _S.STALE else old)
            check_source_move(source_id, old, new)
            return {**src, "state": new.value, "last_heartbeat": now, "updated_at": now}

        try:
            rec = self.store.update("sources", source_id, beat)
        except NotFoundError:
            raise NotFoundError(f"source {source_id} not found (never published, deleted, "
                                "or collected after being STALE): publish it again") from None
        if was is not _S.READY and rec["state"] == _S.READY.value:
            # Becoming READY (from INITIALIZING, or revived from STALE) is when its
            # content starts to count: the same rule as a publish, checked only on this
            # rare move so the every-few-seconds heartbeat stays one store update.
            blob = self.store.get("blobs", source_id)
            if blob is not None:
                try:
                    self._refuse_conflict(source_id, ModelIdentity.from_dict(rec["identity"]),
                                          blob["manifest"], rec.get("fingerprint")
                                          or content.fingerprint(blob["manifest"]))
                except ConflictError:
                    def back(src: Record) -> Record:
                        if src["state"] != _S.READY.value:
                            return src
                        return {**src, "state": was.value, "updated_at": now}
                    with contextlib.suppress(NotFoundError):
                        self.store.update("sources", source_id, back)
                    raise
        return rec

    def get_source(self, source_id: str, *, with_blob: bool = False) -> Record:
        """Return a source (effective state), optionally with manifest and metadata.

        Raises:
            NotFoundError: no such source.
        """
        src = self.store.get("sources", source_id)
        if src is None:
            raise NotFoundError(f"source {source_id} not found")
        src = self._effective(src, self.clock())
        if with_blob:
            blob = self.store.get("blobs", source_id) or {"manifest": {}, "agent_metadata": ""}
            src = {**src, "manifest": blob["manifest"], "agent_metadata": blob["agent_metadata"],
                   "layout": blob.get("layout")}
        return src

    def candidate_records(self, candidates: Sequence[str], count: int, *,
                          other_than: str | None = None) -> list[Record]:
        """The whole records (:meth:`get_source` with its blob) of the first ``count``
        of ``candidates``, in order: those of another identity than ``other_than``
        when given. A candidate gone since it was ranked is passed over."""
        out: list[Record] = []
        for source_id in candidates:
            if len(out) >= count:
                break
            try:
                src = self.get_source(source_id, with_blob=True)
            except NotFoundError:
                continue
            if other_than is None or src["identity_id"] != other_than:
                out.append(src)
        return out

    def list_sources(self, *, model: str | None = None, revision: str | None = None,
                     state: SourceState | None = None, rank: int | None = None,
                     identity_id: str | None = None, worker_id: str | None = None
                     ) -> list[Record]:
        """Sources matching every given filter, oldest first."""
        now = self.clock()
        out = []
        for src in self.store.list("sources"):
            src = self._effective(src, now)
            ident = src["identity"]
            if ((model is not None and ident["model"] != model)
                    or (revision is not None and ident["revision"] != revision)
                    or (rank is not None and ident["rank"] != rank)
                    or (state is not None and src["state"] != state.value)
                    or (identity_id is not None and src["identity_id"] != identity_id)
                    or (worker_id is not None and src["worker_id"] != worker_id)):
                continue
            out.append(src)
        return sorted(out, key=lambda s: (s["created_at"], s["id"]))

    def delete_source(self, source_id: str) -> None:
        """Delete a source and its manifest.

        Raises:
            NotFoundError: no such source.
        """
        if not self.store.delete("sources", source_id):
            raise NotFoundError(f"source {source_id} not found")
        self.store.delete("blobs", source_id)
        log.info("source %s deleted", source_id)

    # --- transfers -----------------------------------------------------------
    def rank_sources(self, identity_id: str, target_worker: str | None,
                     policy: str | None = None, *,
                     across_layouts: ModelIdentity | None = None) -> list[Record]:
        """READY sources of ``identity_id`` in the order a target should try them.

        The one selection policy of the product: agents, library and CLI pulls and the
        vLLM loader all take this order. ``random`` shuffles; ``spread`` puts the sources
        with the fewest live transfers (PENDING, RUNNING, STOPPING; every kind of pull
        has a record) first, random among ties. The target's own sources are left out.

        With ``across_layouts`` (the target's identity), READY sources of the same
        weights in other parallel layouts that published a layout follow, a layout at a
        time: layouts whose every rank is READY first, then fewer ranks first (fewer
        sources to read), then by the policy (for ``spread``: the layout's fewest live
        transfers); within a layout, the first source of each rank (by the policy) in
        rank order, then the second of each rank, and so on.
        A target reading across layouts takes each region from the first of these that
        holds it (:mod:`modelexpress.layout.plan`).

        Raises:
            ValidationError: unknown policy.
        """
        policy = policy or self.default_policy
        if policy not in ("random", "spread"):
            raise ValidationError(f"unknown source policy {policy!r}; allowed: random, spread")
        ready = [s for s in self.list_sources(identity_id=identity_id, state=_S.READY)
                 if target_worker is None or s["worker_id"] != target_worker]
        load = self._live_load() if policy == "spread" else {}
        ready = self._by_policy(ready, load)
        if across_layouts is None:
            return ready
        return ready + self._other_layouts(across_layouts, target_worker, load)

    def _live_load(self) -> dict[str, int]:
        """Live transfers per source (what ``spread`` ranks by)."""
        load: dict[str, int] = {}
        for t in self.store.list("transfers"):
            if t["state"] in {s.value for s in LIVE}:
                load[t["source_id"]] = load.get(t["source_id"], 0) + 1
        return load

    def _by_policy(self, sources: list[Record], load: dict[str, int]) -> list[Record]:
        """Shuffled; then, for ``spread`` (``load`` given), fewest live transfers first."""
        sources = list(sources)
        self._rng.shuffle(sources)
        if load:
            sources.sort(key=lambda s: load.get(s["id"], 0))  # stable: random among ties
        return sources

    def _other_layouts(self, identity: ModelIdentity, target_worker: str | None,
                       load: dict[str, int]) -> list[Record]:
        """READY sources of ``identity``'s weights in other layouts, a layout at a time
        (see :meth:`rank_sources`)."""
        family = identity.family
        groups: dict[tuple[int, int], list[Record]] = {}
        for s in self.list_sources(state=_S.READY):
            if (s["identity_id"] == identity.id or not s.get("layout_bytes")
                    or (target_worker is not None and s["worker_id"] == target_worker)):
                continue
            if (s.get("family") or ModelIdentity.from_dict(s["identity"]).family) != family:
                continue
            ident = s["identity"]  # one layout: its ranks are identities of their own
            groups.setdefault((ident["tp_size"], ident["pp_size"]), []).append(s)

        def ranks(group: list[Record]) -> int:
            ident = group[0]["identity"]
            return int(ident["tp_size"]) * int(ident["pp_size"])

        def complete(group: list[Record]) -> bool:
            return {int(s["identity"]["rank"]) for s in group} == set(range(ranks(group)))

        order = self._by_policy(list(groups.values()), {})
        order.sort(key=lambda g: (not complete(g), ranks(g),
                                  sum(load.get(s["id"], 0) for s in g)))
        out: list[Record] = []
        for group in order:
            # one source of every rank (each rank's first by the policy), in rank order,
            # then a second of every rank, ...: a target that fetches the candidates'
            # records in this order until it holds a whole layout fetches one per rank
            by_rank: dict[int, list[Record]] = {}
            for s in self._by_policy(group, load):
                by_rank.setdefault(int(s["identity"]["rank"]), []).append(s)
            for turn in range(max(len(v) for v in by_rank.values())):
                out.extend(by_rank[r][turn] for r in sorted(by_rank) if turn < len(by_rank[r]))
        return out

    def _pick_source(self, identity_id: str, target_worker: str, policy: str) -> Record:
        ranked = self.rank_sources(identity_id, target_worker, policy)
        if not ranked:
            raise ConflictError(
                f"no READY source for identity {identity_id} other than the target "
                f"{target_worker}; publish one or wait for a source to become READY")
        return ranked[0]

    def _check_source(self, source_id: str, identity_id: str) -> Record:
        src = self.get_source(source_id)
        if src["identity_id"] != identity_id:
            raise ConflictError(f"source {source_id} serves identity {src['identity_id']}, "
                                f"not {identity_id}")
        if src["state"] != _S.READY.value:
            raise ConflictError(f"source {source_id} is {src['state']}, not READY")
        return src

    def create_transfer(self, identity_id: str, target_worker: str, *,
                        source_id: str | None = None, policy: str | None = None,
                        run_by_target: bool = False, relay_read: bool = False,
                        relay_serve: bool = False,
                        across_layouts: ModelIdentity | None = None) -> Record:
        """Start a transfer (PENDING) of ``identity_id`` to ``target_worker``.

        Args:
            run_by_target: the target process runs the pull itself (library, CLI,
                vLLM loader): the record is born claimed, so no agent picks it up.
            relay_read: with ``run_by_target`` and no named source, plan it now as an
                agent's claim is planned (:meth:`_plan_claim`): a ``relay_path`` that may
                start at a relaying agent's live transfer. It is no holder itself (a
                pull process does not relay: ``relay`` stays false) unless
                ``relay_serve``: then it is a holder as a relaying agent's claim is (a
                vLLM engine's pull, which serves its destination while it receives).
            across_layouts: the target's identity: the candidates include sources of
                other parallel layouts (:meth:`rank_sources`); no relay is planned.

        Returns:
            The record; ``candidates`` lists the READY sources in the order to try
            (the chosen ``source_id`` first).

        Raises:
            NotFoundError: the named source does not exist.
            ConflictError: no READY source (or the named one is not READY / serves
                another identity).
        """
        ranked = self.rank_sources(identity_id, target_worker, policy,
                                   across_layouts=across_layouts)
        loading = (self._loading_origin(identity_id, target_worker)
                   if run_by_target and relay_read and not ranked else None)
        if source_id is not None:
            src = self._check_source(source_id, identity_id)
        elif ranked:
            src = ranked[0]
        elif loading is not None:
            src = loading  # a relay reader follows the origin while it loads
        else:
            raise ConflictError(
                f"no READY source for identity {identity_id} other than the target "
                f"{target_worker}; publish one or wait for a source to become READY")
        candidates = [src["id"]] + [s["id"] for s in ranked if s["id"] != src["id"]]
        now = self.clock()
        record = {
            "id": uuid.uuid4().hex, "identity_id": identity_id, "target_worker": target_worker,
            "source_id": src["id"], "source_worker": src["worker_id"],
            "source_endpoint": src["endpoint"], "state": _T.PENDING.value,
            "bytes_done": 0, "bytes_total": 0, "rate_bps": 0.0, "error": None,
            "stop_requested": False, "claimed": run_by_target, "restarts": 0,
            "created_at": now, "updated_at": now, "started_at": None, "finished_at": None,
            "run_by_target": run_by_target, "candidates": candidates, "outcome": None,
            "source_named": source_id is not None,  # the claim keeps a source asked for
            "layouts": "any" if across_layouts is not None else "same",
        }
        if run_by_target and relay_read and source_id is None and across_layouts is None:
            # Born claimed, so planned now: the claim is the creation.
            with self._claim_lock:
                record.update(self._plan_claim(record, {"relay": "1"}, holder=relay_serve))
                self.store.create("transfers", record)
        else:
            self.store.create("transfers", record)
        log.info("transfer %s created: %s from %s to %s", record["id"], identity_id,
                 src["worker_id"], target_worker)
        return record

    def get_transfer(self, transfer_id: str) -> Record:
        """Raises NotFoundError for an unknown id."""
        rec = self.store.get("transfers", transfer_id)
        if rec is None:
            raise NotFoundError(f"transfer {transfer_id} not found")
        return rec

    def list_transfers(self, *, state: TransferState | None = None,
                       target_worker: str | None = None, identity_id: str | None = None
                       ) -> list[Record]:
        """Transfers matching every given filter, oldest first."""
        out = [t for t in self.store.list("transfers")
               if (state is None or t["state"] == state.value)
               and (target_worker is None or t["target_worker"] == target_worker)
               and (identity_id is None or t["identity_id"] == identity_id)]
        return sorted(out, key=lambda t: (t["created_at"], t["id"]))

    def _move(self, transfer_id: str, fn: Callable[[Record], Record]) -> Record:
        try:
            return self.store.update("transfers", transfer_id, fn)
        except NotFoundError:
            raise NotFoundError(f"transfer {transfer_id} not found") from None

    def progress(self, transfer_id: str, bytes_done: int, bytes_total: int,
                 rate_bps: float, source_id: str | None = None) -> Record:
        """Record progress; PENDING becomes RUNNING. The caller checks ``stop_requested``.

        Args:
            source_id: the source the target reads from now, when it moved on from
                the one the record names (a failed source, the next candidate).

        Raises:
            ConflictError: the transfer is finished (SUCCEEDED/FAILED/STOPPED).
            NotFoundError: unknown transfer or ``source_id``.
        """
        now = self.clock()
        src = self.get_source(source_id) if source_id is not None else None

        def step(t: Record) -> Record:
            old = _T(t["state"])
            new = _T.STOPPING if old is _T.STOPPING else _T.RUNNING
            check_transfer_move(transfer_id, old, new)
            moved = {} if src is None else _naming(src)
            return {**t, "state": new.value, "bytes_done": bytes_done,
                    "bytes_total": bytes_total, "rate_bps": rate_bps, "updated_at": now,
                    "claimed": True, "started_at": t["started_at"] or now, **moved}

        return self._move(transfer_id, step)

    def finish(self, transfer_id: str, state: TransferState, error: str | None,
               bytes_done: int | None, outcome: dict[str, Any] | None = None, *,
               source_id: str | None = None) -> Record:
        """The worker's final report. Repeating the same final state is a no-op
        (so a client may retry a finish whose reply was lost).

        Args:
            bytes_done: the final byte count; with SUCCEEDED also the record's
                ``bytes_total`` (and the outcome's ``rate_bps`` its rate), what a last
                progress report set before API version 6.
            outcome: how it went (``modelexpress.wire.TransferOutcome`` as a dict);
                stored on the record and passed to ``on_finish`` (the metrics).
            source_id: with SUCCEEDED, the source read last, named on the record as a
                progress report names it; a source no longer known is left out (the
                transfer is over either way).

        Raises:
            ConflictError: illegal move, e.g. SUCCEEDED after a stop was asked.
        """
        now = self.clock()
        moved = False
        src = None
        if source_id is not None and state is _T.SUCCEEDED:
            try:
                src = self.get_source(source_id)
            except NotFoundError:
                log.info("transfer %s finished from source %s, which is gone: the record "
                         "keeps the source it names", transfer_id, source_id)

        def end(t: Record) -> Record:
            nonlocal moved  # fn may run again after a concurrent write: the last run counts
            old = _T(t["state"])
            moved = old is not state
            if not moved:
                return t
            check_transfer_move(transfer_id, old, state)
            last = {}
            if state is _T.SUCCEEDED and bytes_done is not None:
                # what a pull's last progress report said (API version 6 folds it in here)
                last = {"bytes_total": bytes_done}
                if outcome is not None and outcome.get("rate_bps") is not None:
                    last["rate_bps"] = outcome["rate_bps"]
                if src is not None:
                    last.update(_naming(src))
            return {**t, "state": state.value, "updated_at": now, "finished_at": now,
                    "error": error if state is not _T.SUCCEEDED else None,
                    "bytes_done": t["bytes_done"] if bytes_done is None else bytes_done,
                    "outcome": outcome, **last}

        rec = self._move(transfer_id, end)
        if moved:
            # Once per transfer and final state: a retried finish is not counted twice.
            self.on_finish(rec)
        log.info("transfer %s finished: %s%s%s", transfer_id, state.value,
                 f" ({error})" if error else "",
                 f" over {outcome['transport']}, verdict {outcome['verdict']}"
                 if outcome else "")
        return rec

    def stop(self, transfer_id: str) -> Record:
        """Ask a transfer to stop. Unclaimed PENDING stops at once; otherwise STOPPING
        until the worker confirms STOPPED. Stopping a stopping/stopped transfer is a no-op.

        Raises:
            ConflictError: the transfer already SUCCEEDED or FAILED.
        """
        now = self.clock()

        def halt(t: Record) -> Record:
            old = _T(t["state"])
            if old in (_T.STOPPING, _T.STOPPED):
                return t
            new = _T.STOPPED if old is _T.PENDING and not t["claimed"] else _T.STOPPING
            check_transfer_move(transfer_id, old, new)
            return {**t, "state": new.value, "stop_requested": True, "updated_at": now,
                    "finished_at": now if new is _T.STOPPED else None}

        rec = self._move(transfer_id, halt)
        log.info("transfer %s stop requested: now %s", transfer_id, rec["state"])
        return rec

    def restart(self, transfer_id: str) -> Record:
        """Put a STOPPED or FAILED transfer back to PENDING (same id, counters reset).

        The source is kept while it is READY; otherwise a new one is picked.

        Raises:
            ConflictError: the transfer is not STOPPED/FAILED, or no READY source.
        """
        current = self.get_transfer(transfer_id)
        if current.get("run_by_target"):
            raise ConflictError(f"transfer {transfer_id} was run by its target process "
                                f"({current['target_worker']}), not by an agent: nothing "
                                "would pick it up again; run that pull again instead")
        try:
            src = self._check_source(current["source_id"], current["identity_id"])
        except (NotFoundError, ConflictError):
            src = self._pick_source(current["identity_id"], current["target_worker"],
                                    self.default_policy)
        now = self.clock()

        def again(t: Record) -> Record:
            check_transfer_move(transfer_id, _T(t["state"]), _T.PENDING)
            return {**t, "state": _T.PENDING.value, "bytes_done": 0, "rate_bps": 0.0,
                    "error": None, "stop_requested": False, "claimed": False,
                    "outcome": None, "restarts": t["restarts"] + 1, "updated_at": now, "started_at": None,
                    "finished_at": None, "source_id": src["id"],
                    "source_worker": src["worker_id"], "source_endpoint": src["endpoint"]}

        return self._move(transfer_id, again)

    # --- agents --------------------------------------------------------------
    def register_agent(self, agent_id: str, endpoint: str, labels: dict[str, str]) -> Record:
        """Register (or re-register) an agent. A re-registering agent is a restarted
        process: its claimed-but-not-started transfers are released so it gets them again."""
        now = self.clock()
        old = self.store.get("agents", agent_id)
        record = {"id": agent_id, "endpoint": endpoint, "labels": dict(labels),
                  "registered_at": now, "last_seen": now}
        self.store.put("agents", record)
        for t in self.list_transfers(state=_T.PENDING, target_worker=agent_id):
            if t["claimed"]:
                try:
                    self._move(t["id"], lambda r: {**r, "claimed": False}
                               if r["state"] == _T.PENDING.value else r)
                except NotFoundError:
                    continue
        log.info("agent %s %s (endpoint %r)", agent_id,
                 "re-registered" if old else "registered", endpoint)
        return record

    def get_agent(self, agent_id: str) -> Record:
        """Raises NotFoundError for an unknown agent."""
        rec = self.store.get("agents", agent_id)
        if rec is None:
            raise NotFoundError(f"agent {agent_id} not found; register it with PUT /v1/agents/{agent_id}")
        return rec

    def claim_assignments(self, agent_id: str) -> list[Record]:
        """Claim every unclaimed PENDING transfer targeted at ``agent_id``.

        Claiming is atomic, so two pollers (or two replicas) never both get one.

        A claim whose reply never reached the agent (the replica died while sending
        it) would leave the transfer PENDING and claimed forever. An agent polls only
        between transfers (it runs them one at a time), so a transfer it claimed more
        than ``CLAIM_REDELIVERY_S`` ago and never started (no progress: still PENDING)
        was lost on the way: the poll hands it out again. The delay keeps two
        concurrent polls of one agent (on two replicas) from both getting a fresh claim.

        Raises:
            NotFoundError: the agent is not registered.
        """
        now = self.clock()
        try:
            self.store.update("agents", agent_id, lambda a: {**a, "last_seen": now})
        except NotFoundError:
            raise NotFoundError(f"agent {agent_id} not found; register it with "
                                f"PUT /v1/agents/{agent_id}") from None

        def lost(r: Record) -> bool:
            return (r["claimed"] and not r.get("run_by_target")
                    and now - r.get("claimed_at", r["updated_at"]) > CLAIM_REDELIVERY_S)

        claimed = []
        agent = self.store.get("agents", agent_id) or {"labels": {}}
        for t in self.list_transfers(state=_T.PENDING, target_worker=agent_id):
            if t["claimed"] and not lost(t):
                continue

            def claim(r: Record) -> Record:
                if r["state"] != _T.PENDING.value or (r["claimed"] and not lost(r)):
                    raise ConflictError("already claimed")
                return {**r, "claimed": True, "claimed_at": now, "updated_at": now, **planned}
            with self._claim_lock:
                planned = self._plan_claim(t, agent.get("labels") or {})
                try:
                    claimed.append(self._move(t["id"], claim))
                except (ConflictError, NotFoundError):
                    continue  # another poll or a stop got there first
            if t["claimed"]:
                log.warning("transfer %s: claimed by agent %s %.0f s ago and never started; "
                            "handed out again (the reply to that poll was lost?)", t["id"],
                            agent_id, now - t.get("claimed_at", t["updated_at"]))
        return claimed

    def _plan_claim(self, t: Record, labels: dict[str, str], *, holder: bool = True
                    ) -> dict[str, Any]:
        """Where a claimed transfer reads from, decided now rather than at creation.

        Every holder of the model counts its live readers; the relay planner
        (:func:`~modelexpress.p2p.relay_plan.assign`) takes the shallowest one with a
        free slot. Holders are the READY sources of the identity and, when the claiming
        agent relays (label ``relay=1``), the live transfers of agents that relay: the
        target then reads each chunk from that transfer's relay source as soon as it
        advertises it, and ``relay_path`` lists the holders behind it down to a READY
        source. With no READY source, the source of the identity's live origin (its
        lease names it: ``origins.py``) takes that place while it still loads: the
        path ends there and the reader follows its watermark (DESIGN.md, "From zero").
        A transfer that names a source no longer READY gets another holder;
        a source named at creation that is at its reader limit gives way to one that
        is not. ``holder`` False: the transfer reads through relays but serves nobody
        (a pull process, :meth:`create_transfer`'s ``relay_read``), so no later claim
        reads from it.

        Returns:
            Fields to store on the record (nothing when no READY source is left: the
            agent then fails the transfer on the source it was given).
        """
        if t.get("source_named"):
            return {}
        target = t["target_worker"]
        ready = [s for s in self.list_sources(identity_id=t["identity_id"], state=_S.READY)
                 if s["worker_id"] != target and not s["worker_id"].startswith(f"{target}-")]
        if not ready:
            # From zero: the origin reading storage is the root of every path while it
            # loads (its watermark grows like a relay's; the reader follows it).
            loading = self._loading_origin(t["identity_id"], target)
            ready = [loading] if loading is not None else []
        if not ready:
            return {}
        relays = labels.get("relay") == "1"
        live = [x for x in self.list_transfers(identity_id=t["identity_id"])
                if x["id"] != t["id"] and x["state"] in {s.value for s in LIVE}
                and x["claimed"]]
        readers: dict[str, int] = {}
        for x in live:
            path = x.get("relay_path") or [source_ref(x["source_id"])]
            readers[path[0]] = readers.get(path[0], 0) + 1
        holders = [Holder(source_ref(s["id"]), True, readers.get(source_ref(s["id"]), 0))
                   for s in ready]
        if relays:
            holders += [Holder(transfer_ref(x["id"]), False,
                               readers.get(transfer_ref(x["id"]), 0),
                               tuple(x["relay_path"]), _mbit(x.get("relay_uplink_mbit")))
                        for x in live if x.get("relay") and x.get("relay_path")]
        downlink = _mbit(labels.get("downlink_mbit"))
        fanout = self.readers_per_source
        if fanout <= 0:
            blob = self.store.get("blobs", ready[0]["id"]) or {}
            tensors = (blob.get("manifest") or {}).get("tensors") or []
            total = sum(int(e.get("nbytes", 0)) for e in tensors if isinstance(e, dict))
            piece = piece_bytes(total, self.relay_chunk_bytes, downlink)  # as the reader's
            fanout = choose_fanout(len(live) + 1, chunks_of(total, piece))
        a = assign(holders, fanout=fanout, downlink_mbit=downlink)
        src = next(s for s in ready if source_ref(s["id"]) == a.path[-1])
        ranked = [s["id"] for s in ready if s["id"] != src["id"]]
        log.info("transfer %s to %s reads from %s (%d holders, %d readers each%s)", t["id"],
                 target, a.upstream, len(holders), fanout,
                 "; all at their limit" if a.saturated else "")
        return {"source_id": src["id"], "source_worker": src["worker_id"],
                "source_endpoint": src["endpoint"], "candidates": [src["id"], *ranked],
                "relay": relays and holder, "relay_path": list(a.path) if relays else [],
                "relay_uplink_mbit": _mbit(labels.get("uplink_mbit"))}

    def _loading_origin(self, identity_id: str, target_worker: str) -> Record | None:
        """The source the live origin of ``identity_id`` serves while it loads (its
        lease is held and names it; the source is not STALE, nor the target's own)."""
        sid = self.origins.loading_origin(identity_id)
        src = self.store.get("sources", sid) if sid else None
        if src is None:
            return None
        src = self._effective(src, self.clock())
        if (src["state"] == _S.STALE.value or src["identity_id"] != identity_id
                or src["worker_id"] == target_worker
                or src["worker_id"].startswith(f"{target_worker}-")):
            return None
        return src

    def list_agents(self) -> list[Record]:
        """Every registered agent, by id."""
        return sorted(self.store.list("agents"), key=lambda a: a["id"])

    # --- housekeeping --------------------------------------------------------
    def sweep(self) -> dict[str, int]:
        """Persist STALE for silent sources and delete records older than ``gc_after_s``.

        Safe to run on every replica at once: each change is an atomic update that
        re-checks its condition.

        Returns:
            Counts: ``staled``, ``sources_deleted``, ``transfers_deleted``, ``agents_deleted``.
        """
        now = self.clock()
        counts = {"staled": 0, "sources_deleted": 0, "transfers_deleted": 0,
                  "agents_deleted": 0, "leases_deleted": 0}
        for src in self.store.list("sources"):
            if src["state"] == _S.STALE.value:
                if now - src["updated_at"] > self.gc_after_s:
                    self.store.delete("sources", src["id"])
                    self.store.delete("blobs", src["id"])
                    counts["sources_deleted"] += 1
                continue
            if now - src["last_heartbeat"] > self.stale_after_s:
                def stale(s: Record) -> Record:
                    if s["state"] == _S.STALE.value or now - s["last_heartbeat"] <= self.stale_after_s:
                        return s  # revived or already marked meanwhile
                    return {**s, "state": _S.STALE.value, "updated_at": now}
                try:
                    new = self.store.update("sources", src["id"], stale)
                except NotFoundError:
                    continue
                counts["staled"] += new["state"] == _S.STALE.value and new["updated_at"] == now
        for t in self.store.list("transfers"):
            if t["state"] in {s.value for s in TERMINAL} and now - t["updated_at"] > self.gc_after_s:
                counts["transfers_deleted"] += self.store.delete("transfers", t["id"])
        for a in self.store.list("agents"):
            if now - a["last_seen"] > self.gc_after_s:
                counts["agents_deleted"] += self.store.delete("agents", a["id"])
        counts["leases_deleted"] = self.origins.sweep(self.gc_after_s)
        if any(counts.values()):
            log.info("sweep: %s", counts)
        return counts

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Sources and transfers by (effective) state, for metrics."""
        now = self.clock()
        sources = {s.value: 0 for s in SourceState}
        for src in self.store.list("sources"):
            sources[self._effective(src, now)["state"]] += 1
        transfers = {s.value: 0 for s in TransferState}
        for t in self.store.list("transfers"):
            transfers[t["state"]] += 1
        return sources, transfers


def _mbit(value: Any) -> float:
    """A link speed label (Mbit/s) as a number; 0 when absent or not a number."""
    try:
        return max(float(value), 0.0)
    except (TypeError, ValueError):
        return 0.0


def _naming(src: Record) -> Record:
    """The fields of a transfer record that name the source it reads."""
    return {"source_id": src["id"], "source_worker": src["worker_id"],
            "source_endpoint": src["endpoint"]}
