"""The pulling side: find READY sources, validate, READ, verify, retry, stripe.

``pull`` never reports a half-filled tensor as loaded: it returns only when every
requested tensor arrived and (by default) matched its digest; on any failure it
raises, and the caller must treat the destination tensors as garbage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

from modelexpress.errors import (ConflictError, ManifestMismatchError, MxError, NoSourceError,
                                 TransferCancelledError, TransferError, TransferTimeoutError)
from modelexpress.p2p.manifests import allocate_like, manifest_of
from modelexpress.p2p.options import PullOptions
from modelexpress.p2p.relay_pull import RelayedPull, relay_factory
from modelexpress.p2p.result import PHASES, PullResult, SkippedSource
from modelexpress.p2p.tracking import RateCap, TransferTracker, outcome_of

if TYPE_CHECKING:
    import torch

    from modelexpress.client import MxClient, SourceInfo, TransferInfo
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p.readers import AgentStart, ReaderFactory, SourceReader
    from modelexpress.transfer import Manifest, NixlTransferManager, StopSignal, TransferResult

__all__ = ["pull"]

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self, what: str) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"pull deadline of {self.seconds:.0f} s ran out {what}")
        return left


def _stopped(stop: "StopSignal | None") -> bool:
    if stop is None:
        return False
    return stop.is_set() if isinstance(stop, threading.Event) else bool(stop())


def _stripes(manifest: "Manifest", names: Sequence[str], n: int) -> list[list[str]]:
    """Split ``names`` (in manifest order) into ``n`` contiguous runs of similar bytes.

    Contiguous runs keep coalescing effective: neighbours in load order are usually
    neighbours in memory on both sides.
    """
    sizes = manifest.by_name()
    ordered = [e.name for e in manifest.tensors if e.name in set(names)]
    total = sum(sizes[name].nbytes for name in ordered)
    out: list[list[str]] = [[]]
    acc = 0
    for name in ordered:
        if len(out) < n and acc >= total * len(out) / n and out[-1]:
            out.append([])
        out[-1].append(name)
        acc += sizes[name].nbytes
    return [s for s in out if s]


class _Nixl:
    """The pull's NIXL side, made only when a source is read over NIXL.

    A pull whose sources are all on this host (the local transport) never creates a
    NIXL agent nor registers its destination: both cost more than a small local copy
    (docs/benchmarks.md, "Local transport"). When the first sources to read need NIXL,
    :meth:`start` creates the agent before the READs begin; otherwise :meth:`get`
    creates it on first use (a local read that fell back to NIXL).
    """

    def __init__(self, manager: "NixlTransferManager | None", opts: PullOptions,
                 clock: "_Clock") -> None:
        self.manager = manager
        self.opts = opts
        self.clock = clock
        self.start_: "AgentStart | None" = None
        self.registered = False
        self.used = False
        self._lock = threading.Lock()

    def start(self, dest: Mapping[str, "torch.Tensor"] | None) -> None:
        """Create the agent (registering ``dest`` if known)."""
        if self.manager is None and self.start_ is None:
            self.start_ = _start_agent(self.opts, dest)

    def get(self, dest: Mapping[str, "torch.Tensor"]) -> "NixlTransferManager":
        """The manager, with ``dest`` registered (once: striped READs run in parallel
        threads and must not race to register the same memory)."""
        with self._lock:
            self.used = True
            if self.manager is None or self.start_ is not None:
                self.start(dest)
                assert self.start_ is not None
                with self.clock.phase("agent_wait"):
                    self.manager = self.start_.get()
                self.registered = self.registered or self.start_.registered
            if not self.registered:
                # (A caller's manager skips what it registered already.)
                with self.clock.phase("register"):
                    self.manager.register_tensors(dict(dest))
                self.registered = True
            return self.manager

    @property
    def seconds(self) -> float:
        return self.start_.seconds if self.start_ is not None else 0.0

    def close(self) -> None:
        """Drop an agent this pull created (disconnect, deregister). Idempotent."""
        if self.start_ is not None:
            with self.clock.phase("close"):
                self.start_.close()
            self.start_ = None
            self.manager = None


def _compose(first: "ReaderFactory | None", second: "ReaderFactory | None"
             ) -> "ReaderFactory | None":
    """A factory asking ``first`` (the caller's), then ``second`` (the local transport)."""
    if first is None or second is None:
        return first or second
    return lambda info, manifest: first(info, manifest) or second(info, manifest)


class _Puller:
    """One pull: the destination, the reader of each source, progress, the rate cap."""

    def __init__(self, *, nixl: _Nixl, dest: Mapping[str, "torch.Tensor"],
                 options: PullOptions, deadline: _Deadline, progress: ProgressFn | None,
                 stop: "StopSignal", tracker: TransferTracker | None,
                 chosen: Mapping[str, "SourceReader | None"]) -> None:
        self.nixl = nixl
        self.dest = dest
        self.options = options
        self.deadline = deadline
        self.progress = progress
        self.stop = stop
        self.tracker = tracker
        self.chosen = chosen
        self.skipped: list[SkippedSource] = []
        self.warnings: list[str] = []
        self.peer_seconds = 0.0
        self.total = 0
        self._done: dict[str, int] = {}
        self._lock = threading.Lock()
        self.rate = RateCap(options.max_gbps, lambda: _stopped(stop), deadline.end,
                            deadline.seconds)

    def _report(self, key: str, done: int) -> None:
        with self._lock:
            self._done[key] = done
            total_done = sum(self._done.values())
        if self.progress is not None:
            self.progress(min(total_done, self.total), self.total)
        if self.tracker is not None:
            self.tracker.report(min(total_done, self.total), self.total)
        self.rate.wait(total_done)

    def reader_for(self, info: "SourceInfo", manifest: "Manifest",
                   nixl: bool = False) -> "SourceReader":
        """The reader chosen for this source (the caller's, the local transport's), else
        (or with ``nixl``) a NIXL READ."""
        from modelexpress.p2p.readers import NixlReader

        chosen = None if nixl else self.chosen.get(info.id)
        return chosen or NixlReader(self.nixl.get(self.dest), info, manifest,
                                    chunk_bytes=self.options.chunk_bytes,
                                    verify=self.options.verify,
                                    refuse_slow_transport=self.options.refuse_slow_transport,
                                    stall_s=self.options.stall_s)

    def read_from(self, info: "SourceInfo", manifest: "Manifest",
                  dest: Mapping[str, "torch.Tensor"], key: str,
                  allow_partial: bool, reader: "SourceReader | None" = None) -> "TransferResult":
        """READ ``dest`` from one source; returns the data plane's TransferResult."""
        if self.rate.started is None and self.tracker is not None:
            self.tracker.begin()
        self.rate.start()
        if self.tracker is not None:
            self.tracker.reading = info.id
        try:
            result = (reader or self.reader_for(info, manifest)).read_into(
                dest, allow_partial=allow_partial,
                progress=lambda done, _total: self._report(key, done), stop=self.stop,
                deadline_s=self.deadline.left(f"before reading from source {info.id}"))
        except TransferCancelledError:
            raise  # what arrived before the stop is reported as is
        except BaseException:
            self._report(key, 0)  # a failed attempt's bytes do not count
            raise
        with self._lock:
            self.peer_seconds = max(self.peer_seconds, result.peer_seconds)
        return result

    def skip(self, info: "SourceInfo", reason: str) -> None:
        self.skip_id(info.id, reason, info.worker_id)

    def skip_id(self, source_id: str, reason: str, worker_id: str = "?") -> None:
        log.warning("skipping source %s (worker %s): %s", source_id, worker_id, reason)
        self.skipped.append(SkippedSource(source_id, worker_id, reason))


class _Clock:
    """Where a pull's time goes on its critical path (see ``PullResult.phases``)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] += time.perf_counter() - t0

    def total(self) -> float:
        return time.perf_counter() - self.started


def _on_host(dest: Mapping[str, "torch.Tensor"] | None, device: str) -> bool:
    if dest is None:
        return device == "cpu"
    return all(t.device.type == "cpu" for t in dest.values())


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
    clock = _Clock()
    deadline = _Deadline(opts.timeout_s)
    nixl = _Nixl(manager, opts, clock)
    tracker = record
    own_record: TransferTracker | None = None
    relayed: list[RelayedPull] = []
    from modelexpress.transfer.digest import pause_builds, resume_builds, warm_up_for
    pause_builds()  # a digest kernel build waits for the pull (GIL: transfer.digest)
    try:
        with clock.phase("control_plane"):
            candidate_ids, own_record, own_info = _candidates(client, identity, opts,
                                                              record is not None)
            tracker = tracker or own_record
            advertise = ((lambda done, total: own_record.report(done, total, force=True))
                         if own_record is not None else None)
            # The caller's readers first, then a relayed reader of the origin (when the
            # server planned this pull on a relay path), then the local transport.
            local = _local_factory(opts)
            factory = _compose(readers, _compose(
                relay_factory(client, own_info, identity, opts, nixl.get,
                              advertise=advertise, local=local), local))
            by_preference = ([i for i in opts.prefer if i in candidate_ids]
                             + [i for i in candidate_ids if i not in set(opts.prefer)])
            if not by_preference:
                raise NoSourceError(f"no READY source for {identity.model} (identity "
                                    f"{identity.id}, rank {identity.rank}) on the control plane")
        user_stop = stop
        stop_signal: "StopSignal" = (
            (lambda: _stopped(user_stop) or tracker.stop_requested.is_set())
            if tracker is not None else (stop or (lambda: False)))
        skipped: list[SkippedSource] = []
        with clock.phase("control_plane"):
            sources = _fetch_sources(client, by_preference, opts, fetched, skipped)
        if not sources:
            raise NoSourceError(_no_source_message(identity, skipped))
        # The reader of each source: the caller's, the local transport's (same host), or
        # None for NIXL. The NIXL agent is started only when a source read first needs it.
        chosen = {info.id: factory(info, manifest) if factory is not None else None
                  for info, manifest in sources}
        first = sources[:opts.stripe] if opts.stripe > 1 else sources[:1]
        relayed = [r for r in chosen.values() if isinstance(r, RelayedPull)]
        needs_nixl = any(chosen[info.id] is None or isinstance(chosen[info.id], RelayedPull)
                         for info, _ in first)
        with clock.phase("imports"):
            import torch  # noqa: F401 - a fresh process pays this here, on the critical path
            from modelexpress.transfer.planner import plan_read
        if needs_nixl:
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
        # Validate every candidate before any byte moves. A source whose tensors do not
        # fit the destination (another checkpoint published under the same identity) is
        # skipped with the reason, not allowed to fail the pull.
        usable, mismatch, total = [], None, 0
        for info, manifest in sources:
            try:
                total = plan_read(manifest, dest, allow_partial=opts.allow_partial,
                                  chunk_bytes=opts.chunk_bytes).total_bytes
            except ManifestMismatchError as exc:
                skipped.append(_skipped(info, f"its tensors do not match the destination: {exc}"))
                mismatch = mismatch or exc
                continue
            usable.append((info, manifest))
        if not usable:
            assert mismatch is not None
            raise mismatch
        if tracker is not None:
            tracker.report(0, total, force=True)  # PENDING -> RUNNING, with the total
        if any(chosen[info.id] is None for info, _ in usable[:max(opts.stripe, 1)]):
            nixl.get(dest)  # register up front, before striped READs start in parallel
        puller = _Puller(nixl=nixl, dest=dest, options=opts, deadline=deadline,
                         progress=progress, stop=stop_signal, tracker=tracker, chosen=chosen)
        puller.skipped = skipped
        puller.total = total
        if opts.stripe > 1 and len(usable) > 1:
            results = _pull_striped(puller, usable[:opts.stripe], usable, opts.max_attempts)
        else:
            results = _pull_sequential(puller, usable[:opts.max_attempts], dest,
                                       opts.allow_partial, identity)
        agent_s = nixl.seconds
        nixl.close()  # disconnect, deregister, drop the agent: part of this pull
        out = _result(results, puller, sources, clock, tracker, agent_s)
        with clock.phase("control_plane"):
            if tracker is not None:
                tracker.report(out.bytes, out.bytes, force=True, rate_bps=out.gbps * 1e9)
            if own_record is not None:
                own_record.finish("SUCCEEDED", done=out.bytes, outcome=outcome_of(out))
        # ORDER: after SUCCEEDED (a reader takes it as "holds it all"), before returning
        # (the caller may change the destination: relay_pull's docstring).
        for r in relayed:
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
        for r in relayed:
            r.close()  # withdrawn already unless the pull failed
        nixl.close()
        resume_builds()


def _local_factory(opts: PullOptions) -> "ReaderFactory | None":
    """The local transport's reader factory, or None when ``MX_IPC_DIR=off``."""
    if not opts.local.enabled:
        return None
    from modelexpress.errors import ConfigError
    from modelexpress.local.reader import local_reader_factory

    try:
        return local_reader_factory(opts.local, chunk_bytes=opts.chunk_bytes,
                                    verify=opts.verify)
    except ConfigError as exc:  # no host id (no boot id, no MX_NODE_NAME): NIXL only
        log.warning("local transport off for this pull: %s", exc)
        return None


def _start_agent(opts: PullOptions, dest: Mapping[str, "torch.Tensor"] | None) -> "AgentStart":
    from modelexpress.p2p.readers import AgentStart

    if _on_host(dest, opts.device):
        return AgentStart(opts.backend, None, register=dest)
    import torch

    device = next(iter(dest.values())).device if dest else torch.device(opts.device)
    return AgentStart(opts.backend, device, register=dest)


def _skipped(info: "SourceInfo", reason: str) -> SkippedSource:
    log.warning("skipping source %s (worker %s): %s", info.id, info.worker_id, reason)
    return SkippedSource(info.id, info.worker_id, reason)


def _candidates(client: "MxClient", identity: "ModelIdentity", opts: PullOptions,
                has_record: bool
                ) -> tuple[list[str], TransferTracker | None, "TransferInfo | None"]:
    """Source ids in the server's order and, when the pull tracks itself, its tracker
    and its record (whose ``relay_path`` is set for ``opts.relay_read``)."""
    if has_record or not opts.track:
        return [s.id for s in client.rank_sources(identity, policy=opts.policy)], None, None  # type: ignore[arg-type]
    from modelexpress.p2p.source import default_worker_id

    try:
        record = client.start_transfer(identity, opts.worker_id or default_worker_id("pull"),
                                       policy=opts.policy,  # type: ignore[arg-type]
                                       run_by_target=True,
                                       relay_read=opts.relay_read and opts.stripe == 1,
                                       relay_serve=(opts.relay_serve and opts.relay_read
                                                    and opts.stripe == 1))
    except ConflictError as exc:
        raise NoSourceError(f"no READY source for {identity.model} (identity {identity.id}, "
                            f"rank {identity.rank}): {exc}") from exc
    log.info("pull of %s is transfer %s (%d candidate sources)", identity.model, record.id,
             len(record.candidates))
    return list(record.candidates), TransferTracker(
        client, record.id, interval_s=opts.progress_interval_s, source_id=record.source_id,
        run_by_target=True), record


def _fetch_sources(client: "MxClient", ids: Sequence[str], opts: PullOptions,
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
            skipped.append(_skipped(full, f"unusable manifest: {exc}"))
    return out


def _verdict(result: "TransferResult") -> str:
    if not result.verdict.ok:
        return "slow"
    return "unknown" if result.verdict.gbps is None else "ok"


def _result(results: list, puller: _Puller, sources: list, clock: _Clock,  # noqa: ANN001
            tracker: TransferTracker | None, agent_s: float) -> PullResult:
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


def _verified_digests(results: list, sources: list, puller: _Puller  # noqa: ANN001
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


def _phases(clock: _Clock, results: list, puller: _Puller,  # noqa: ANN001
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


def _no_source_message(identity: "ModelIdentity", skipped: Sequence[SkippedSource]) -> str:
    why = "; ".join(f"{s.source_id} ({s.worker_id}): {s.reason}" for s in skipped)
    return (f"no source could serve {identity.model} (identity {identity.id}, rank "
            f"{identity.rank}); tried {len(skipped)}: {why}")


_RETRYABLE = (TransferError,)


def _pull_sequential(puller: _Puller, fetched, dest, allow_partial, identity):  # noqa: ANN001,ANN202
    """Try the sources in order until one delivers.

    A source read over the local transport that failed before copying anything while
    it still listened (it refused, was busy, or its memory cannot be mapped here) is
    read again over NIXL when it published agent metadata; one that is gone or died
    mid-copy is skipped for the next source.
    """
    for info, manifest in fetched:
        reader = None
        for over_nixl in (False, True):
            try:
                reader = puller.reader_for(info, manifest, nixl=over_nixl)
                result = puller.read_from(info, manifest, dest, "all", allow_partial, reader)
            except (TransferCancelledError, ManifestMismatchError):
                raise
            except TransferTimeoutError:
                puller.deadline.left(f"after trying source {info.id}")  # whole deadline gone?
                puller.skip(info, "timed out")
                break
            except _RETRYABLE as exc:
                retry = getattr(reader, "nixl_may_retry", None)
                if (not over_nixl and retry is not None and retry()
                        and info.agent_metadata is not None):
                    note = (f"source {info.id}: the local transport failed before copying "
                            f"({type(exc).__name__}: {exc}); reading it over NIXL")
                    log.warning("%s", note)
                    puller.warnings.append(note)
                    continue
                puller.skip(info, f"{type(exc).__name__}: {exc}")
                break
            if _stopped(puller.stop):
                raise TransferCancelledError("pull stopped")
            return [(info, result)]
    raise NoSourceError(_no_source_message(identity, puller.skipped))


def _pull_striped(puller: _Puller, stripes_from, fetched, max_attempts):  # noqa: ANN001,ANN202
    """Read contiguous shares of the tensors from several sources at once.

    One NIXL agent serves every stripe: its READs are posted from separate threads,
    each against its own peer. A failed stripe is retried, alone, from the other
    sources (bounded by ``max_attempts`` in total).
    """
    manifest0 = fetched[0][1]
    groups = _stripes(manifest0, list(puller.dest), len(stripes_from))
    results: list = [None] * len(groups)
    errors: list[BaseException | None] = [None] * len(groups)

    def run(i: int) -> None:
        info, manifest = stripes_from[i]
        sub = {name: puller.dest[name] for name in groups[i]}
        try:
            results[i] = (info, puller.read_from(info, manifest, sub, f"s{i}", True))
        except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"mx-stripe-{i}")
               for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(puller.deadline.end - time.monotonic(), 0.0) + 5.0)
    if any(t.is_alive() for t in threads):
        raise TransferTimeoutError(
            f"striped reads did not finish within the {puller.deadline.seconds:.0f} s deadline")
    attempts = len(groups)
    for i, exc in enumerate(errors):
        if exc is None:
            continue
        if isinstance(exc, (TransferCancelledError, ManifestMismatchError)):
            raise exc
        info = stripes_from[i][0]
        puller.skip(info, f"stripe {i}: {type(exc).__name__}: {exc}")
        sub = {name: puller.dest[name] for name in groups[i]}
        for other, manifest in fetched:
            if attempts >= max_attempts + len(groups) - 1:
                break
            if other.id in {s.source_id for s in puller.skipped}:
                continue
            attempts += 1
            try:
                results[i] = (other, puller.read_from(other, manifest, sub, f"s{i}", True))
                break
            except (TransferCancelledError, ManifestMismatchError):
                raise
            except _RETRYABLE as retry_exc:
                puller.skip(other, f"stripe {i} retry: {type(retry_exc).__name__}: {retry_exc}")
        if results[i] is None:
            raise NoSourceError(f"stripe {i} ({len(sub)} tensors) could not be read from any "
                                f"source: " + "; ".join(s.reason for s in puller.skipped))
    return results
