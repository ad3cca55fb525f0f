"""The pulling side: find READY sources, validate, READ, verify, retry, stripe.

``pull`` never reports a half-filled tensor as loaded: it returns only when every
requested tensor arrived and (by default) matched its digest; on any failure it
raises, and the caller must treat the destination tensors as garbage.

One pull, step by step, and where each step lives::

    candidates      the server's ranking (and the pull's own record)   candidates.py
    readers         a reader per source: the caller's, the relay's,    readers.py,
                    the local transport's, else NIXL's                 relay_pull.py, local/
    destination     allocated from the first manifest, or the caller's
    validation      every candidate's tensors against the destination  (before any byte)
    reading         in turn or striped, progress, rate cap, stop       reading.py
    outcome         the PullResult, the record finished                 result.py, tracking.py

A new way to get bytes (a storage origin, a read across layouts) is another reader
from another factory, composed in :func:`_reader_factory`; a reader that holds
something beyond its READs (the relay's source, an origin's lease) is a
:class:`~modelexpress.p2p.readers.HeldReader`, released and closed here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from modelexpress.errors import (ConfigError, ManifestMismatchError, NoSourceError,
                                 TransferCancelledError)
from modelexpress.p2p.candidates import (by_preference, candidates, fetch_sources,
                                         no_source_message, skip_source)
from modelexpress.p2p.manifests import allocate_like
from modelexpress.p2p.options import PullOptions
from modelexpress.p2p.readers import HeldReader, uses_pull_agent
from modelexpress.p2p.reading import (Deadline, NixlSide, ProgressFn, Puller, Read, Source,
                                      read_in_turn, read_striped, stopped)
from modelexpress.p2p.relay_pull import relay_factory
from modelexpress.p2p.result import PHASES, PullClock, PullResult, SkippedSource
from modelexpress.p2p.tracking import TransferTracker, outcome_of

if TYPE_CHECKING:
    import torch

    from modelexpress.client import MxClient, SourceInfo, TransferInfo
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p.readers import ReaderFactory
    from modelexpress.transfer import NixlTransferManager, StopSignal, TransferResult

__all__ = ["pull"]

log = logging.getLogger(__name__)


def pull(identity: "ModelIdentity", dest: Mapping[str, "torch.Tensor"] | None = None, *,
         client: "MxClient", options: PullOptions | None = None,
         manager: "NixlTransferManager | None" = None, progress: ProgressFn | None = None,
         stop: "StopSignal | None" = None,
         on_destination: Callable[[Mapping[str, "torch.Tensor"]], None] | None = None,
         record: TransferTracker | None = None, fetched: Sequence["SourceInfo"] = (),
         readers: "ReaderFactory | None" = None) -> PullResult:
    """Pull the weights of ``identity`` from READY sources into ``dest``.

    Args:
        identity: what to pull; only sources publishing exactly this identity qualify.
        dest: name -> destination tensor (contiguous). When None, tensors are allocated
            on ``options.device`` from the first source's manifest (``on_destination``
            sees them before any byte moves; the result does not carry them, so pass a
            callback or your own ``dest`` to keep them).
        client: control-plane client.
        options: :class:`PullOptions` (``PullOptions.from_settings(settings)`` at an
            entry point); defaults when None.
        manager: NIXL manager to read with; the pull registers ``dest`` with it (what is
            registered already is skipped) and leaves it open, registrations included.
            When None, one is created when a source is read over NIXL (overlapping the
            imports and, with the local transport off, the control-plane calls) and closed.
        progress: ``progress(bytes_done, bytes_total)``, called from the READ loop.
        stop: ``threading.Event`` or callable; honoured between chunks.
        on_destination: called with the destination tensors before any byte moves.
        record: the transfer record the caller holds (an agent's REST transfer):
            progress and a stop go through it, and the caller finishes it. Without it,
            ``options.track`` makes the pull create, report on and finish its own.
        fetched: sources the caller already fetched with ``get_source``; their
            manifests are not fetched again.
        readers: picks the reader of a source (None from it: the local transport for a
            source on this host that publishes a local endpoint, unless
            ``options.local`` is off; otherwise NIXL); see :mod:`~modelexpress.p2p.readers`.
            No NIXL agent is created (nor ``dest`` registered with ``manager``) unless
            a source is read over NIXL.

    Returns:
        A :class:`PullResult`.

    Raises:
        NoSourceError: no READY source, or every attempt failed (the message lists why).
        ManifestMismatchError: the source's tensors do not match ``dest`` (before any
            byte moved); not retried, since every source of one identity has one layout.
        TransferCancelledError: ``stop`` was set, or the record was stopped.
        TransferTimeoutError: ``options.timeout_s`` ran out.
    """
    opts = options if options is not None else PullOptions()
    clock = PullClock()
    deadline = Deadline(opts.timeout_s)
    nixl = NixlSide(manager, opts, clock)
    tracker = record
    own_record: TransferTracker | None = None
    held: list[HeldReader] = []
    from modelexpress.transfer.digest import pause_builds, resume_builds, warm_up_for
    pause_builds()  # a digest kernel build waits for the pull (GIL: transfer.digest)
    try:
        with clock.phase("control_plane"):
            candidate_ids, own_record, own_info = candidates(client, identity, opts,
                                                             record is not None)
            tracker = tracker or own_record
            factory = _reader_factory(readers, client, own_info, identity, opts, nixl,
                                      own_record)
            ordered = by_preference(candidate_ids, opts.prefer)
            if not ordered:
                raise NoSourceError(f"no READY source for {identity.model} (identity "
                                    f"{identity.id}, rank {identity.rank}) on the control plane")
        stop_signal = _stop_signal(stop, tracker)
        skipped: list[SkippedSource] = []
        with clock.phase("control_plane"):
            sources = fetch_sources(client, ordered, opts,
                                    (*fetched, *(own_info.records if own_info else ())),
                                    skipped)
        if not sources:
            raise NoSourceError(no_source_message(identity, skipped))
        # The reader of each source: the caller's, the relay's, the local transport's
        # (same host), or None for NIXL. The NIXL agent is started only when a source
        # read first needs it.
        chosen = {info.id: factory(info, manifest) if factory is not None else None
                  for info, manifest in sources}
        held = [r for r in chosen.values() if isinstance(r, HeldReader)]
        first = sources[:opts.stripe] if opts.stripe > 1 else sources[:1]
        with clock.phase("imports"):
            import torch  # noqa: F401 - a fresh process pays this here, on the critical path
            from modelexpress.transfer.planner import plan_read  # noqa: F401
        if any(uses_pull_agent(chosen[info.id]) for info, _ in first):
            # On this thread, before any READ thread exists (see AgentStart).
            with clock.phase("agent_wait"):
                nixl.start(dest)
        if opts.verify:  # the GPU digest kernel, built once this pull is done
            warm_up_for(dest, opts.device)
        if dest is None:
            with clock.phase("allocate"):
                dest = allocate_like(sources[0][1], opts.device)
        if on_destination is not None:
            on_destination(dest)
        usable, total = _usable(sources, dest, opts, skipped)
        if tracker is not None:
            tracker.report(0, total, force=True)  # PENDING -> RUNNING, with the total
        if any(chosen[info.id] is None for info, _ in usable[:max(opts.stripe, 1)]):
            nixl.get(dest)  # register up front, before striped READs start in parallel
        puller = Puller(nixl=nixl, dest=dest, options=opts, deadline=deadline,
                        progress=progress, stop=stop_signal, tracker=tracker, chosen=chosen)
        puller.skipped = skipped
        puller.total = total
        if opts.stripe > 1 and len(usable) > 1:
            results = read_striped(puller, usable[:opts.stripe], usable, opts.max_attempts)
        else:
            results = read_in_turn(puller, usable[:opts.max_attempts], dest,
                                   opts.allow_partial, identity)
        agent_s = nixl.seconds
        nixl.close()  # disconnect, deregister, drop the agent: part of this pull
        out = _result(results, puller, sources, clock, tracker, agent_s)
        with clock.phase("control_plane"):
            if own_record is not None:  # the finish, with what a last report said
                own_record.succeed(out.bytes, rate_bps=out.gbps * 1e9, outcome=outcome_of(out))
            elif tracker is not None:  # the caller's record: it finishes it
                tracker.report(out.bytes, out.bytes, force=True, rate_bps=out.gbps * 1e9)
        # ORDER: after SUCCEEDED (a reader takes it as "holds it all"), before returning
        # (the caller may change the destination: relay_pull's docstring).
        for r in held:
            r.release()
        out = dataclasses.replace(out, total_seconds=clock.total(),
                                  phases=_phases(clock, results, puller, agent_s))
        log.info("pulled %s: %d bytes, %d tensors from %s in %.3f s (%.2f GB/s, %s; the "
                 "pull took %.3f s)%s", identity.model, out.bytes, out.tensors,
                 ",".join(out.source_ids), out.seconds, out.gbps, out.transport,
                 out.total_seconds,
                 f"; skipped {len(out.skipped)} source(s)" if out.skipped else "")
        return out
    except TransferCancelledError:
        if own_record is not None:
            own_record.finish("STOPPED", done=own_record.done)
        raise
    except BaseException as exc:
        if own_record is not None:
            own_record.finish("FAILED", error=f"{type(exc).__name__}: {exc}"[:8000],
                              done=own_record.done)
        raise
    finally:
        for r in held:
            r.close()  # released already unless the pull failed
        nixl.close()
        resume_builds()


def _reader_factory(readers: "ReaderFactory | None", client: "MxClient",
                    own_info: "TransferInfo | None", identity: "ModelIdentity",
                    opts: PullOptions, nixl: NixlSide, own_record: TransferTracker | None
                    ) -> "ReaderFactory | None":
    """The caller's readers first, then a relayed reader of the origin (when the server
    planned this pull on a relay path: ``own_info.relay_path``), then the local
    transport; None from all of them: NIXL."""
    advertise = ((lambda done, total: own_record.report(done, total, force=True))
                 if own_record is not None else None)
    local = _local_factory(opts)
    return _compose(readers, _compose(
        relay_factory(client, own_info, identity, opts, nixl.get, advertise=advertise,
                      local=local), local))


def _compose(first: "ReaderFactory | None", second: "ReaderFactory | None"
             ) -> "ReaderFactory | None":
    """A factory asking ``first``, then ``second`` for a source ``first`` has no reader for."""
    if first is None or second is None:
        return first or second
    return lambda info, manifest: first(info, manifest) or second(info, manifest)


def _local_factory(opts: PullOptions) -> "ReaderFactory | None":
    """The local transport's reader factory, or None when ``MX_IPC_DIR=off``."""
    if not opts.local.enabled:
        return None
    from modelexpress.local.reader import local_reader_factory

    try:
        return local_reader_factory(opts.local, chunk_bytes=opts.chunk_bytes,
                                    verify=opts.verify)
    except ConfigError as exc:  # no host id (no boot id, no MX_NODE_NAME): NIXL only
        log.warning("local transport off for this pull: %s", exc)
        return None


def _stop_signal(stop: "StopSignal | None", tracker: TransferTracker | None) -> "StopSignal":
    """The pull's stop: the caller's, or a stop asked through the record."""
    if tracker is None:
        return stop or (lambda: False)
    return lambda: stopped(stop) or tracker.stop_requested.is_set()


def _usable(sources: Sequence[Source], dest: Mapping[str, "torch.Tensor"], opts: PullOptions,
            skipped: list[SkippedSource]) -> tuple[list[Source], int]:
    """The sources whose tensors fit the destination, and the bytes a READ moves.

    Every candidate is validated before any byte moves. A source whose tensors do not
    fit (another checkpoint published under the same identity) is skipped with the
    reason, not allowed to fail the pull; when none fits, the first mismatch is raised.
    """
    from modelexpress.transfer.planner import plan_read

    usable, mismatch, total = [], None, 0
    for info, manifest in sources:
        try:
            total = plan_read(manifest, dest, allow_partial=opts.allow_partial,
                              chunk_bytes=opts.chunk_bytes).total_bytes
        except ManifestMismatchError as exc:
            skipped.append(skip_source(info, f"its tensors do not match the destination: {exc}"))
            mismatch = mismatch or exc
            continue
        usable.append((info, manifest))
    if not usable:
        assert mismatch is not None
        raise mismatch
    return usable, total


def _verdict(result: "TransferResult") -> str:
    if not result.verdict.ok:
        return "slow"
    return "unknown" if result.verdict.gbps is None else "ok"


def _result(results: Sequence[Read], puller: Puller, sources: Sequence[Source],
            clock: PullClock, tracker: TransferTracker | None, agent_s: float) -> PullResult:
    seconds = max(r.seconds for _, r in results)
    nbytes = sum(r.bytes for _, r in results)
    verdicts = {_verdict(r) for _, r in results}
    attributes = {info.id: manifest.attributes for info, manifest in sources}
    verified = all(r.verified for _, r in results)
    algo, digests = _verified_digests(results, sources, puller) if verified else (None, {})
    return PullResult(
        source_ids=tuple(info.id for info, _ in results), bytes=nbytes, seconds=seconds,
        gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        transport=",".join(sorted({r.transport for _, r in results})),
        descriptors=sum(r.descriptors for _, r in results),
        tensors=sum(r.tensors for _, r in results),
        verified=verified, skipped=tuple(puller.skipped),
        warnings=tuple(puller.warnings) + tuple(w for _, r in results for w in r.warnings),
        total_seconds=clock.total(),
        verify_seconds=sum(r.verify_seconds for _, r in results),
        connect_seconds=max(r.connect_seconds for _, r in results),
        source_attributes={info.id: attributes[info.id] for info, _ in results},
        transfer_id=tracker.id if tracker is not None else None,
        expected_transport=",".join(sorted({r.expected_transport for _, r in results})),
        transport_detail="; ".join(dict.fromkeys(r.transport_detail for _, r in results)),
        verdict="slow" if "slow" in verdicts else "ok" if verdicts == {"ok"} else "unknown",
        phases=_phases(clock, results, puller, agent_s), digest_algorithm=algo,
        digests=digests)


def _verified_digests(results: Sequence[Read], sources: Sequence[Source], puller: Puller
                      ) -> tuple[str | None, dict[str, str]]:
    """The digests the received tensors were verified against, from the manifests of
    the sources that delivered them (one algorithm, every destination covered), else
    ``(None, {})``."""
    manifests = {info.id: manifest for info, manifest in sources}
    delivered = [manifests[info.id] for info, _ in results if info.id in manifests]
    algos = {m.digest_algorithm for m in delivered}
    if len(algos) != 1 or None in algos:
        return None, {}
    digests: dict[str, str] = {}
    for m in delivered:
        digests.update((e.name, e.digest) for e in m.tensors
                       if e.digest is not None and e.name in puller.dest)
    if set(digests) != set(puller.dest):
        return None, {}
    return algos.pop(), digests


def _phases(clock: PullClock, results: Sequence[Read], puller: Puller,
            agent_s: float) -> dict[str, float]:
    total = clock.total()
    phases = dict(clock.phases)
    phases["peer"] = puller.peer_seconds
    phases["connect"] = max(r.connect_seconds for _, r in results)
    phases["data_plane"] = max(r.seconds for _, r in results)
    phases["other"] = max(total - sum(phases.values()), 0.0)
    phases["agent"] = agent_s
    phases["verify"] = sum(r.verify_seconds for _, r in results)
    return {k: round(phases[k], 6) for k in PHASES}
