"""Which sources a pull may read: the server's ranking, the caller's preference, and
each candidate's manifest.

A tracked pull starts its transfer record here (the server ranks the candidates and,
when asked, plans a relay path); an untracked one asks the server for the ranking
alone. Manifests are fetched lazily, in that order, only for as many candidates as
the pull may try.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

from modelexpress.errors import ConflictError, MxError, NoSourceError
from modelexpress.p2p.manifests import manifest_of
from modelexpress.p2p.result import SkippedSource
from modelexpress.p2p.source import default_worker_id
from modelexpress.p2p.tracking import TransferTracker

if TYPE_CHECKING:
    from modelexpress.client import MxClient, SourceInfo, TransferInfo
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p.options import PullOptions
    from modelexpress.transfer import Manifest

__all__ = ["by_preference", "candidates", "fetch_sources", "no_source_message", "skip_source"]

log = logging.getLogger(__name__)


def candidates(client: "MxClient", identity: "ModelIdentity", opts: PullOptions,
               has_record: bool
               ) -> tuple[list[str], TransferTracker | None, "TransferInfo | None"]:
    """Source ids in the server's order and, when the pull tracks itself, its tracker
    and its record (whose ``relay_path`` is set for ``opts.relay_read``, and whose
    ``records`` hold the first candidates' whole records: API version 6)."""
    if has_record or not opts.track:
        return [s.id for s in client.rank_sources(identity, policy=opts.policy)], None, None  # type: ignore[arg-type]
    try:
        record = client.start_transfer(identity, opts.worker_id or default_worker_id("pull"),
                                       policy=opts.policy,  # type: ignore[arg-type]
                                       run_by_target=True,
                                       relay_read=opts.relay_read and opts.stripe == 1,
                                       relay_serve=(opts.relay_serve and opts.relay_read
                                                    and opts.stripe == 1),
                                       # those fetch_sources would ask for next
                                       records=max(opts.stripe, opts.max_attempts))
    except ConflictError as exc:
        raise NoSourceError(f"no READY source for {identity.model} (identity {identity.id}, "
                            f"rank {identity.rank}): {exc}") from exc
    log.info("pull of %s is transfer %s (%d candidate sources)", identity.model, record.id,
             len(record.candidates))
    return list(record.candidates), TransferTracker(
        client, record.id, interval_s=opts.progress_interval_s, source_id=record.source_id,
        run_by_target=True), record


def by_preference(ids: Sequence[str], prefer: Sequence[str]) -> list[str]:
    """``ids`` (the server's order) with those in ``prefer`` first, in ``prefer``'s order."""
    return [i for i in prefer if i in ids] + [i for i in ids if i not in set(prefer)]


def fetch_sources(client: "MxClient", ids: Sequence[str], opts: PullOptions,
                  fetched: Sequence["SourceInfo"], skipped: list[SkippedSource]
                  ) -> list[tuple["SourceInfo", "Manifest"]]:
    """Manifests of the first usable candidates, fetched lazily (a source may vanish
    between the list and the get); those the caller fetched already are reused."""
    known = {info.id: info for info in fetched}
    excluded = set(opts.exclude_workers)
    out: list[tuple["SourceInfo", "Manifest"]] = []
    for source_id in ids:
        if len(out) >= max(opts.stripe, opts.max_attempts):
            break
        full = known.get(source_id)
        if full is None or full.manifest is None or full.agent_metadata is None:
            try:
                full = client.get_source(source_id)
            except MxError as exc:
                log.warning("skipping source %s: could not fetch its manifest: %s",
                            source_id, exc)
                skipped.append(SkippedSource(source_id, "?",
                                             f"could not fetch its manifest: {exc}"))
                continue
        if full.worker_id in excluded:
            continue
        try:
            out.append((full, manifest_of(full)))
        except MxError as exc:
            skipped.append(skip_source(full, f"unusable manifest: {exc}"))
    return out


def skip_source(info: "SourceInfo", reason: str) -> SkippedSource:
    """A source passed over, and why (logged)."""
    log.warning("skipping source %s (worker %s): %s", info.id, info.worker_id, reason)
    return SkippedSource(info.id, info.worker_id, reason)


def no_source_message(identity: "ModelIdentity", skipped: Sequence[SkippedSource]) -> str:
    """The NoSourceError message of a pull that found no source to read: each tried."""
    why = "; ".join(f"{s.source_id} ({s.worker_id}): {s.reason}" for s in skipped)
    return (f"no source could serve {identity.model} (identity {identity.id}, rank "
            f"{identity.rank}); tried {len(skipped)}: {why}")
