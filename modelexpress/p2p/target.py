"""The pulling side: find READY sources, validate, READ, verify, retry, stripe.

``pull`` never reports a half-filled tensor as loaded: it returns only when every
requested tensor arrived and (by default) matched its digest; on any failure it
raises, and the caller must treat the destination tensors as garbage.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from modelexpress.errors import (ConfigError, ConflictError, ControlPlaneError,
                                 ManifestMismatchError, MxError, NoSourceError,
                                 TransferCancelledError, TransferError, TransferTimeoutError)

if TYPE_CHECKING:
    import torch

    from modelexpress.client import MxClient, SourceInfo, TransferInfo
    from modelexpress.identity import ModelIdentity
    from modelexpress.transfer import Manifest, NixlTransferManager, StopSignal

__all__ = ["PullResult", "SkippedSource", "pull", "allocate_like", "manifest_of"]

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]


@dataclasses.dataclass(frozen=True)
class SkippedSource:
    """A source that was tried (or passed over) and why."""

    source_id: str
    worker_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class PullResult:
    """Outcome of a successful :func:`pull`.

    Attributes:
        source_ids: the source(s) the bytes came from (several when striped).
        bytes: bytes received.
        seconds: wall time from the first READ to the last byte (validation and
            control-plane calls excluded; ``total_seconds`` includes them).
        gbps: bytes / seconds / 1e9.
        transport: the transport(s) UCX reported for the READs (``cma``, ``tcp``,
            ``cuda_ipc``, ``rc_mlx5``...; several joined with ``,``), or ``unknown``;
            never inferred (see ``TransferResult.transport``).
        expected_transport: the family the memory kinds and hosts call for.
        transport_detail: where ``transport`` was read, or why it is unknown.
        descriptors: NIXL descriptors posted (after coalescing).
        tensors: tensors received.
        verified: every tensor's digest was checked and matched.
        skipped: sources skipped, with reasons.
        warnings: data-plane warnings (e.g. a slow transport).
        total_seconds: wall time of the whole call.
        verify_seconds: time spent computing digests (mostly overlapped with the
            READ: a chunk is checked while the next ones move).
        connect_seconds: opening the source's memory before the clock starts (a
            4 KiB READ; in ``total_seconds``, not in ``seconds``).
        source_attributes: source id -> the ``attributes`` its manifest published
            (facts for the caller to check, e.g. the vLLM loader's probe).
        transfer_id: the control plane's record of this pull (None when the caller
            keeps its own, ``track=False``).
        phases: where ``total_seconds`` went, in seconds: ``control_plane`` (the
            transfer record, candidates, manifests), ``agent`` (creating the NIXL
            agent; 0 with a caller's manager), ``register`` (registering the
            destination), ``connect`` and ``data_plane`` (as above; ``verify`` overlaps
            the data plane), ``other`` (the rest: planning, peers, bookkeeping).
    """

    source_ids: tuple[str, ...]
    bytes: int
    seconds: float
    gbps: float
    transport: str
    descriptors: int
    tensors: int
    verified: bool
    skipped: tuple[SkippedSource, ...]
    warnings: tuple[str, ...]
    total_seconds: float
    verify_seconds: float = 0.0
    connect_seconds: float = 0.0
    source_attributes: Mapping[str, Mapping[str, object]] = dataclasses.field(
        default_factory=dict)
    transfer_id: str | None = None
    expected_transport: str = ""
    transport_detail: str = ""
    phases: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """JSON-able form (for ``--json`` output)."""
        data = dataclasses.asdict(self)
        data["skipped"] = [dataclasses.asdict(s) for s in self.skipped]
        data["source_attributes"] = {k: dict(v) for k, v in self.source_attributes.items()}
        data["phases"] = dict(self.phases)
        return data


def manifest_of(info: "SourceInfo") -> "Manifest":
    """The transfer-layer manifest of a source fetched with ``get_source``.

    Raises:
        ManifestMismatchError: the stored manifest is missing or malformed.
    """
    from modelexpress.transfer import Manifest

    if info.manifest is None:
        raise ManifestMismatchError(f"source {info.id} has no manifest (fetch it with get_source)")
    return Manifest.from_json(json.dumps(info.manifest))


def allocate_like(manifest: "Manifest", device: str = "cpu",
                  contiguous: bool = True) -> dict[str, "torch.Tensor"]:
    """Empty destination tensors matching a manifest (names, dtypes, shapes), in its order.

    Args:
        manifest: the source's manifest.
        device: where to allocate.
        contiguous: carve every tensor from one allocation (one NIXL region, one IPC
            handle; see ``checkpoint.allocate_slab``) instead of one allocation each.
    """
    import torch

    from modelexpress.checkpoint import allocate_slab

    specs = []
    for entry in manifest.tensors:
        dtype = getattr(torch, entry.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ManifestMismatchError(f"tensor {entry.name!r} has unknown dtype {entry.dtype!r}")
        specs.append((entry.name, tuple(entry.shape), dtype))
    if contiguous:
        return allocate_slab(specs, device)
    return {name: torch.empty(shape, dtype=dtype, device=device) for name, shape, dtype in specs}


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


class _Tracker:
    """This pull's transfer record: progress (rate-limited), stop from the REST API, finish.

    A control-plane error while reporting never fails the pull: the data plane goes
    on, and only what operators see lags.
    """

    def __init__(self, client: "MxClient", record: "TransferInfo", interval_s: float) -> None:
        self.client = client
        self.id = record.id
        self.interval_s = interval_s
        self.stop_requested = threading.Event()
        self.reading: str | None = None  # the source being read
        self._named = record.source_id   # the source the record names
        self._last = 0.0
        self._started = time.monotonic()
        self._lock = threading.Lock()

    def report(self, done: int, total: int, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last < self.interval_s:
                return
            self._last = now
            moved = self.reading if self.reading not in (None, self._named) else None
        try:
            reply = self.client.report_progress(
                self.id, done, total, done / max(now - self._started, 1e-9), source_id=moved)
        except ControlPlaneError as exc:
            log.warning("progress report for transfer %s failed: %s", self.id, exc)
            return
        if moved is not None:
            self._named = moved
        if reply.stop and not self.stop_requested.is_set():
            log.info("transfer %s: stop requested through the control plane; stopping at "
                     "the next chunk", self.id)
            self.stop_requested.set()

    def finish(self, state: str, error: str | None = None, done: int | None = None) -> None:
        try:
            if state == "STOPPED" and not self.stop_requested.is_set():
                self.client.stop_transfer(self.id)  # the caller stopped it: say so first
            self.client.finish_transfer(self.id, state, error=error, bytes_done=done)
        except ConflictError as exc:
            if state != "SUCCEEDED":
                log.warning("could not record transfer %s as %s: %s", self.id, state, exc)
                return
            # A stop asked after the last chunk won the race (the server allows one
            # outcome); end the record as stopped rather than leave it STOPPING.
            log.info("transfer %s was stopped as it finished: %s", self.id, exc)
            self.finish("STOPPED", done=done)
        except MxError as exc:
            log.warning("could not record transfer %s as %s: %s", self.id, state, exc)


class _Puller:
    """One pull: sources to try, the manager, the destination, bookkeeping."""

    def __init__(self, *, client: "MxClient", manager: "NixlTransferManager",
                 dest: Mapping[str, "torch.Tensor"], allow_partial: bool, verify: bool,
                 deadline: _Deadline, progress: ProgressFn | None, stop: "StopSignal | None",
                 chunk_bytes: int, refuse_slow_transport: bool, max_gbps: float = 0.0,
                 tracker: _Tracker | None = None) -> None:
        self.client = client
        self.manager = manager
        self.dest = dest
        self.allow_partial = allow_partial
        self.verify = verify
        self.deadline = deadline
        self.progress = progress
        self.stop = stop
        self.chunk_bytes = chunk_bytes
        self.refuse_slow = refuse_slow_transport
        self.skipped: list[SkippedSource] = []
        self._done: dict[str, int] = {}
        self._lock = threading.Lock()
        self.total = 0
        self._max_bps = max_gbps * 1e9
        self._rate_start: float | None = None
        self.tracker = tracker

    def _report(self, key: str, done: int) -> None:
        with self._lock:
            self._done[key] = done
            total_done = sum(self._done.values())
        if self.progress is not None:
            self.progress(min(total_done, self.total), self.total)
        self._throttle(total_done)

    def _throttle(self, total_done: int) -> None:
        """Sleep between chunks until the average rate is under ``max_gbps``.

        The clock starts with the first READ, so setup time is no credit; a stop or
        the deadline ends the sleep early (the READ loop then raises).
        """
        if self._max_bps <= 0 or self._rate_start is None:
            return
        ahead = total_done / self._max_bps - (time.monotonic() - self._rate_start)
        remaining = self.deadline.end - time.monotonic()
        end = time.monotonic() + min(ahead, remaining)
        while time.monotonic() < end and not _stopped(self.stop):
            time.sleep(min(end - time.monotonic(), 0.05))
        if ahead > remaining and not _stopped(self.stop):
            raise TransferTimeoutError(
                f"pull deadline of {self.deadline.seconds:.0f} s ran out with the receive "
                f"rate capped at {self._max_bps / 1e9:g} GB/s (MX_TRANSFER_MAX_GBPS)")

    def read_from(self, info: "SourceInfo", manifest: "Manifest",
                  dest: Mapping[str, "torch.Tensor"], key: str, allow_partial: bool):  # noqa: ANN201
        """READ ``dest`` from one source; returns the data plane's TransferResult."""
        assert info.agent_metadata is not None
        if self._rate_start is None:
            self._rate_start = time.monotonic()
        if self.tracker is not None:
            self.tracker.reading = info.id
        peer = self.manager.add_peer(info.agent_metadata)
        try:
            return self.manager.read(
                manifest, dest, peer=peer, allow_partial=allow_partial,
                chunk_bytes=self.chunk_bytes,
                deadline_s=self.deadline.left(f"before reading from source {info.id}"),
                progress=lambda done, _total: self._report(key, done), stop=self.stop,
                verify=self.verify, refuse_slow_transport=self.refuse_slow)
        except TransferCancelledError:
            raise  # what arrived before the stop is reported as is
        except BaseException:
            self._report(key, 0)  # a failed attempt's bytes do not count
            raise
        finally:
            self.manager.remove_peer(peer)

    def skip(self, info: "SourceInfo", reason: str) -> None:
        self.skip_id(info.id, reason, info.worker_id)

    def skip_id(self, source_id: str, reason: str, worker_id: str = "?") -> None:
        log.warning("skipping source %s (worker %s): %s", source_id, worker_id, reason)
        self.skipped.append(SkippedSource(source_id, worker_id, reason))


def pull(identity: "ModelIdentity", dest: Mapping[str, "torch.Tensor"] | None = None, *,
         client: "MxClient | None" = None, server: str | None = None,
         token: str | None = None, device: str = "cpu", timeout_s: float = 600.0,
         verify: bool = True, allow_partial: bool = False, progress: ProgressFn | None = None,
         stop: "StopSignal | None" = None, policy: str = "random", max_attempts: int = 3,
         stripe: int = 1, prefer: Sequence[str] = (), exclude_workers: Sequence[str] = (),
         manager: "NixlTransferManager | None" = None, chunk_bytes: int = 1 << 30,
         refuse_slow_transport: bool = False, on_destination: Callable[
             [Mapping[str, "torch.Tensor"]], None] | None = None,
         max_gbps: float = 0.0, track: bool = True, worker_id: str | None = None,
         progress_interval_s: float = 0.5, backend: str = "UCX") -> PullResult:
    """Pull the weights of ``identity`` from READY sources into ``dest``.

    Args:
        identity: what to pull; only sources publishing exactly this identity qualify.
        dest: name -> destination tensor (contiguous). When None, tensors are allocated
            on ``device`` from the first source's manifest (``on_destination`` sees them
            before any byte moves; the result does not carry them, so pass a callback
            or your own ``dest`` to keep them).
        client: control-plane client (or pass ``server``).
        server: control-plane URL; a client is made (and closed) for this call.
        token: the server's bearer token, with ``server``.
        device: where to allocate when ``dest`` is None.
        timeout_s: deadline for the whole pull, all attempts included.
        verify: check digests (``MX_VERIFY_DIGESTS``).
        allow_partial: tensors present on one side only are skipped instead of an error.
        progress: ``progress(bytes_done, bytes_total)``, called from the READ loop.
        stop: ``threading.Event`` or callable; honoured between chunks.
        policy: ``random`` or ``spread`` (``MX_SOURCE_POLICY``).
        max_attempts: sources tried at most (``MX_MAX_SOURCE_ATTEMPTS``).
        stripe: read from up to this many sources at once, each a contiguous share of
            the tensors (falls back to fewer when fewer are READY).
        prefer: source ids to try first, in order (e.g. the one the server assigned).
        exclude_workers: worker ids never chosen (e.g. this worker's own source).
        manager: NIXL manager to read with; one is created and closed when None.
        chunk_bytes: bytes per READ chunk (``MX_TRANSFER_CHUNK_BYTES``).
        refuse_slow_transport: fail on a detected transport fallback.
        on_destination: called with the destination tensors before any byte moves.
        max_gbps: cap on the receive rate in GB/s, enforced between chunks (0: none;
            ``MX_TRANSFER_MAX_GBPS``).
        track: make this pull a transfer the control plane knows: a record created for
            it (run by this process), the server's order of candidate sources, progress
            reports, a stop through the REST API honoured at the next chunk, and the
            outcome recorded. An agent, whose transfers already have a record, passes
            False (the server's order of candidates is used either way).
        worker_id: this process's worker id in that record (default
            ``pull-<host>-<pid>-<random>``); its own sources are never candidates.
        progress_interval_s: at most one progress report per this many seconds.
        backend: the NIXL backend of the manager made when ``manager`` is None
            (``MX_NIXL_BACKEND``).

    Returns:
        A :class:`PullResult`.

    Raises:
        NoSourceError: no READY source, or every attempt failed (the message lists why).
        ManifestMismatchError: the source's tensors do not match ``dest`` (before any
            byte moved); not retried, since every source of one identity has one layout.
        TransferCancelledError: ``stop`` was set.
        TransferTimeoutError: ``timeout_s`` ran out.
    """
    if max_attempts < 1 or stripe < 1 or timeout_s <= 0 or max_gbps < 0:
        raise ConfigError(f"max_attempts and stripe must be >= 1, timeout_s > 0 and "
                          f"max_gbps >= 0 (got {max_attempts}, {stripe}, {timeout_s}, "
                          f"{max_gbps})")
    from modelexpress.transfer import NixlTransferManager

    own_client = None
    if client is None:
        if server is None:
            raise ConfigError("pull needs client= (an MxClient) or server= (the control-plane URL)")
        from modelexpress.client import MxClient
        client = own_client = MxClient(server, token=token)
    tracker: _Tracker | None = None
    try:
        started = time.monotonic()
        deadline = _Deadline(timeout_s)
        candidate_ids, tracker = _candidates(client, identity, policy=policy, track=track,
                                             worker_id=worker_id,
                                             interval_s=progress_interval_s)
        by_preference = ([i for i in prefer if i in candidate_ids]
                         + [i for i in candidate_ids if i not in set(prefer)])
        if not by_preference:
            raise NoSourceError(f"no READY source for {identity.model} (identity {identity.id}, "
                                f"rank {identity.rank}) on the control plane")

        user_stop = stop
        stop_signal = stop if tracker is None else (
            lambda: _stopped(user_stop) or tracker.stop_requested.is_set())

        def report(done: int, total: int) -> None:
            if progress is not None:
                progress(done, total)
            if tracker is not None:
                tracker.report(done, total)

        phases = {"control_plane": time.monotonic() - started, "agent": 0.0, "register": 0.0}
        owns = manager is None
        t0 = time.monotonic()
        mgr = manager or NixlTransferManager(backend=backend)
        phases["agent"] = time.monotonic() - t0
        puller = _Puller(client=client, manager=mgr, dest=dest or {}, allow_partial=allow_partial,
                         verify=verify, deadline=deadline, progress=report, stop=stop_signal,
                         chunk_bytes=chunk_bytes, refuse_slow_transport=refuse_slow_transport,
                         max_gbps=max_gbps, tracker=tracker)
        try:
            # Fetch manifests lazily: a source may vanish between list and get.
            fetched: list[tuple["SourceInfo", "Manifest"]] = []
            excluded = set(exclude_workers)
            t0 = time.monotonic()
            for source_id in by_preference:
                if len(fetched) >= max(stripe, max_attempts):
                    break
                try:
                    full = client.get_source(source_id)
                except MxError as exc:
                    puller.skip_id(source_id, f"could not fetch its manifest: {exc}")
                    continue
                if full.worker_id in excluded:
                    continue
                try:
                    fetched.append((full, manifest_of(full)))
                except MxError as exc:
                    puller.skip(full, f"unusable manifest: {exc}")
            phases["control_plane"] += time.monotonic() - t0
            if not fetched:
                raise NoSourceError(_no_source_message(identity, puller.skipped))
            attributes = {info.id: manifest.attributes for info, manifest in fetched}
            if dest is None:
                dest = allocate_like(fetched[0][1], device)
                puller.dest = dest
            if on_destination is not None:
                on_destination(dest)
            # Validate every candidate before any byte moves. A source whose tensors do
            # not fit the destination (another checkpoint published under the same
            # identity) is skipped with the reason, not allowed to fail the pull.
            usable, plans, mismatch = [], [], None
            for info, manifest in fetched:
                try:
                    plans.append(mgr.plan(manifest, dest, allow_partial=allow_partial))
                except ManifestMismatchError as exc:
                    puller.skip(info, f"its tensors do not match the destination: {exc}")
                    mismatch = mismatch or exc
                    continue
                usable.append((info, manifest))
            if not usable:
                assert mismatch is not None
                raise mismatch
            fetched = usable
            puller.total = plans[0].total_bytes
            if owns:
                # Register once up front: striped READs run in parallel threads and must
                # not race to register the same destination memory.
                t0 = time.monotonic()
                mgr.register_tensors(dict(dest))
                phases["register"] = time.monotonic() - t0
            if stripe > 1 and len(fetched) > 1:
                results = _pull_striped(puller, fetched[:stripe], fetched, max_attempts)
            else:
                results = _pull_sequential(puller, fetched[:max_attempts], dest, allow_partial,
                                           identity)
        finally:
            if owns:
                mgr.close()
        seconds = max(r.seconds for _, r in results)
        total = time.monotonic() - started
        phases["connect"] = max(r.connect_seconds for _, r in results)
        phases["data_plane"] = seconds
        phases["verify"] = sum(r.verify_seconds for _, r in results)
        phases["other"] = max(total - sum(v for k, v in phases.items() if k != "verify"), 0.0)
        nbytes = sum(r.bytes for _, r in results)
        out = PullResult(
            source_ids=tuple(info.id for info, _ in results), bytes=nbytes, seconds=seconds,
            gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            transport=",".join(sorted({r.transport for _, r in results})),
            descriptors=sum(r.descriptors for _, r in results),
            tensors=sum(r.tensors for _, r in results),
            verified=all(r.verified for _, r in results), skipped=tuple(puller.skipped),
            warnings=tuple(w for _, r in results for w in r.warnings),
            total_seconds=total,
            verify_seconds=sum(r.verify_seconds for _, r in results),
            connect_seconds=max(r.connect_seconds for _, r in results),
            source_attributes={info.id: attributes[info.id] for info, _ in results},
            transfer_id=tracker.id if tracker is not None else None,
            expected_transport=",".join(sorted({r.expected_transport for _, r in results})),
            transport_detail="; ".join(dict.fromkeys(r.transport_detail for _, r in results)),
            phases={k: round(v, 6) for k, v in phases.items()})
        log.info("pulled %s: %d bytes, %d tensors from %s in %.3f s (%.2f GB/s, %s)%s",
                 identity.model, out.bytes, out.tensors, ",".join(out.source_ids), out.seconds,
                 out.gbps, out.transport,
                 f"; skipped {len(out.skipped)} source(s)" if out.skipped else "")
        if tracker is not None:
            tracker.report(out.bytes, out.bytes, force=True)
            tracker.finish("SUCCEEDED", done=out.bytes)
        return out
    except TransferCancelledError:
        if tracker is not None:
            tracker.finish("STOPPED")
        raise
    except BaseException as exc:
        if tracker is not None:
            tracker.finish("FAILED", error=f"{type(exc).__name__}: {exc}"[:8000])
        raise
    finally:
        if own_client is not None:
            own_client.close()


def _candidates(client: "MxClient", identity: "ModelIdentity", *, policy: str, track: bool,
                worker_id: str | None,
                interval_s: float) -> tuple[list[str], "_Tracker | None"]:
    """Source ids in the server's order and, with ``track``, this pull's record."""
    from modelexpress.p2p.selection import POLICIES

    if policy not in POLICIES:
        raise ConfigError(f"unknown source policy {policy!r}; allowed: {', '.join(POLICIES)}")
    if not track:
        return [s.id for s in client.rank_sources(identity, policy=policy)], None
    from modelexpress.p2p.source import default_worker_id

    try:
        record = client.start_transfer(identity, worker_id or default_worker_id("pull"),
                                       policy=policy, run_by_target=True)
    except ConflictError as exc:
        raise NoSourceError(f"no READY source for {identity.model} (identity {identity.id}, "
                            f"rank {identity.rank}): {exc}") from exc
    log.info("pull of %s is transfer %s (%d candidate sources)", identity.model, record.id,
             len(record.candidates))
    return list(record.candidates), _Tracker(client, record, interval_s)


def _no_source_message(identity: "ModelIdentity", skipped: Sequence[SkippedSource]) -> str:
    why = "; ".join(f"{s.source_id} ({s.worker_id}): {s.reason}" for s in skipped)
    return (f"no source could serve {identity.model} (identity {identity.id}, rank "
            f"{identity.rank}); tried {len(skipped)}: {why}")


_RETRYABLE = (TransferError,)


def _pull_sequential(puller: _Puller, fetched, dest, allow_partial, identity):  # noqa: ANN001,ANN202
    for info, manifest in fetched:
        try:
            result = puller.read_from(info, manifest, dest, "all", allow_partial)
        except (TransferCancelledError, ManifestMismatchError):
            raise
        except TransferTimeoutError:
            puller.deadline.left(f"after trying source {info.id}")  # whole deadline gone?
            puller.skip(info, "timed out")
            continue
        except _RETRYABLE as exc:
            puller.skip(info, f"{type(exc).__name__}: {exc}")
            continue
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
