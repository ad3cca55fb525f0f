"""Pull across parallel layouts: a target rank assembles its tensors from sources of
another tensor-parallel layout.

::

    pull_across_layouts(identity, target layout, dest)
      transfer record <- POST /v1/transfers layouts=any      the server ranks candidates:
                                                             this identity's, then other
                                                             layouts', a layout at a time
      candidates' records (manifest, layout), in order,      (no layout: passed over)
        until they hold a whole layout
      repeat (at most max_attempts plans):
        plan <- plan_layout(target, candidates not dropped)  coverage checked, nothing moved
          (none covers: the next whole layout's records)
        for each source the plan uses:                       a reader per source:
          reader.read_copies(its copies)                       local transport or NIXL
        failed checks / a failed read -> drop those sources, plan again
      scatters + fills; SUCCEEDED
      every byte checked (block digests), or NoSourceError and the caller loads from disk

The destination is the target's loaded form (:func:`modelexpress.engines.vllm.tensors.
collect_loaded_tensors`); regions no piece names keep what construction put there,
as a load from disk leaves them. On failure the destination is garbage: the caller
rebuilds (the vLLM loader does).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from modelexpress._gc import paused as gc_paused
from modelexpress.errors import (ConflictError, ControlPlaneError, LayoutError,
                                 LayoutUnavailableError, MxError, NoSourceError, TransferCancelledError, TransferError,
                                 TransferTimeoutError)
from modelexpress.layout import BlockTable, CheckpointTensor, Layout, plan_layout
from modelexpress.p2p.options import PullOptions
from modelexpress.p2p.tracking import TransferTracker, outcome_of
from modelexpress.wire import API_VERSION

if TYPE_CHECKING:
    import torch

    from modelexpress.client import MxClient, SourceInfo
    from modelexpress.identity import ModelIdentity
    from modelexpress.layout.readers import LayoutReader
    from modelexpress.transfer import Manifest, NixlTransferManager

__all__ = ["AcrossLayouts", "LayoutSource", "device_refusal",
           "layout_readers", "pull_across_layouts"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LayoutSource:
    """A candidate of another layout: its record, manifest and layout."""

    info: "SourceInfo"
    manifest: "Manifest"
    layout: Layout


LayoutReaderFactory = Callable[[LayoutSource], "LayoutReader"]
TargetLayout = Layout | Callable[[Sequence[CheckpointTensor]], Layout]
"""This rank's layout, or a function that derives it from the sources' checkpoint
table (a target whose checkpoint is not on its disk)."""


@dataclasses.dataclass(frozen=True)
class AcrossLayouts:
    """What :func:`pull_across_layouts` returns.

    Attributes:
        result: the :class:`~modelexpress.p2p.PullResult`.
        blocks: the checkpoint blocks the target checked, with their digests: what it
            publishes when it serves its own layout.
        layout: the target's layout the pull filled.
        checked_as_landed: how many of its block checks hashed the block as its
            bytes landed (the local transport's copy loop); the others were hashed after.
        hashing_seconds: the seconds spent hashing those others, beside the reads of
            later sources and after the last (``verify`` in the phases is only the
            latter's wait).
    """

    result: Any
    blocks: BlockTable
    layout: Layout
    checked_as_landed: int = 0
    hashing_seconds: float = 0.0


def device_refusal(device: "torch.device | str") -> str | None:
    """Why a destination on ``device`` cannot be filled across layouts, or None.

    Host memory and CUDA GPUs are filled (the readers' device paths: a ``cuMemcpyAsync``
    per run from a same-host source, NIXL READs into VRAM, ``wsum-i32-v1`` block digests
    on the GPU; ``tests/p2p/test_layout_devices.py``); any other device is refused
    before anything is asked of the control plane (a caller then pulls from its own
    layout or loads from disk, as before).
    """
    import torch

    kind = torch.device(device).type
    if kind in ("cpu", "cuda"):
        return None
    return (f"its load device is {device}: pulls across parallel layouts fill host memory "
            "and CUDA GPUs only")


def layout_readers(opts: PullOptions, manager: Callable[[], "NixlTransferManager"],
                   device: "torch.device", covering_below: int | None = None
                   ) -> LayoutReaderFactory:
    """The reader of each source: the local transport's for one on this host that
    publishes a local endpoint (unless ``MX_IPC_DIR=off``), else NIXL (``manager()``
    gives the pull's agent, made on first use)."""
    from modelexpress.layout.readers import COVERING_BELOW, LocalLayoutReader, NixlLayoutReader
    from modelexpress.local.reader import endpoint_of

    here = None
    if opts.local.enabled:
        try:
            here = opts.local.host_id
        except MxError as exc:
            log.warning("local transport off for this pull: %s", exc)

    def factory(source: LayoutSource) -> "LayoutReader":
        ep = endpoint_of(source.manifest)
        if here is not None and ep is not None and ep.host_id == here:
            return LocalLayoutReader(ep, source.manifest,
                                     None if device.type == "cpu" else (device.index or 0),
                                     covering_below=covering_below)
        if source.info.agent_metadata is None:
            raise TransferError(f"source {source.info.id} publishes no NIXL agent")
        return NixlLayoutReader(manager(), source.info.agent_metadata, source.manifest,
                                same_host=source.manifest.host == socket.gethostname(),
                                chunk_bytes=opts.chunk_bytes, stall_s=opts.stall_s or None,
                                refuse_slow_transport=opts.refuse_slow_transport,
                                covering_below=(COVERING_BELOW if covering_below is None
                                                else covering_below))

    return factory


def pull_across_layouts(identity: "ModelIdentity", target: TargetLayout,
                        dest: Mapping[str, "torch.Tensor"], *, client: "MxClient",
                        options: PullOptions | None = None,
                        manager: "NixlTransferManager | None" = None,
                        progress: Callable[[int, int], None] | None = None,
                        stop: "threading.Event | None" = None,
                        readers: LayoutReaderFactory | None = None,
                        covering_below: int | None = None,
                        before_writing: Callable[[], None] | None = None) -> Any:
    """Fill ``dest`` (this rank's loaded form) from sources of other parallel layouts.

    Args:
        identity: this rank's identity (its family names the weights in any layout).
        target: this rank's layout (:func:`modelexpress.engines.vllm.layout.derive_layout`),
            or a function that derives it from the checkpoint table the first candidate
            publishes (raising LayoutUnavailableError when it cannot).
        dest: name -> tensor of the loaded form; every tensor the layout names.
        client: control-plane client (API version 5).
        options: as for :func:`~modelexpress.p2p.pull` (policy, attempts, deadline, stall,
            chunk size, local transport, NIXL backend, worker id).
        manager: a NIXL manager to read with (default: one is made when a source is
            read over NIXL, and closed at the end).
        progress: ``progress(bytes_done, bytes_total)``.
        stop: set: stop at the next copy (TransferCancelledError).
        readers: picks each source's reader (default :func:`layout_readers`).
        covering_below: runs shorter than this are read as their covering span (default:
            the reader's own, :data:`~modelexpress.layout.readers.COVERING_BELOW` or, same
            host into host memory, :data:`~modelexpress.layout.readers.HOST_COVERING_BELOW`).
        before_writing: called once, just before the first byte is written into
            ``dest`` (a caller that must rebuild a destination written to learns it).

    Returns:
        :class:`AcrossLayouts`: the :class:`~modelexpress.p2p.PullResult` (``digests``
        empty: the checks were of checkpoint blocks; ``source_attributes`` of every
        source read) and the blocks checked.

    Raises:
        NoSourceError: no candidate of another layout, no plan covers the target, or
            every plan failed (the message lists why each source was dropped).
        TransferCancelledError: ``stop``, or a stop through the control plane.
        TransferTimeoutError: ``options.timeout_s`` ran out.
        ControlPlaneError: the server is older than API version 5.
        LayoutUnavailableError: a tensor of ``dest`` is neither in host memory nor on
            a CUDA GPU (:func:`device_refusal`); nothing was asked of the control plane.
    """
    import torch

    from modelexpress.layout.readers import allocate_scratch, finish
    from modelexpress.p2p.source import default_worker_id
    from modelexpress.p2p.result import PullResult

    opts = options or PullOptions()
    for tensor in dest.values():
        refused = device_refusal(tensor.device)
        if refused is not None:
            raise LayoutUnavailableError(f"no pull across layouts for {identity.model}: "
                                         f"{refused}")
    t_start = time.perf_counter()
    end = time.monotonic() + opts.timeout_s
    worker = opts.worker_id or default_worker_id("pull")
    try:
        record = client.start_transfer(identity, worker, policy=opts.policy,  # type: ignore[arg-type]
                                       run_by_target=True, across_layouts=True,
                                       records=1)  # the first is always read
    except ConflictError as exc:
        raise _nothing_to_try(f"no READY source of {identity.model} in any parallel layout "
                              f"(family {identity.family}): {exc}") from exc
    except ControlPlaneError as exc:
        if (client.server_api_version or API_VERSION) >= 5:
            raise
        raise _nothing_to_try(str(exc)) from exc  # an older server: as before, quietly
    tracker = TransferTracker(client, record.id, interval_s=opts.progress_interval_s,
                              source_id=record.source_id, run_by_target=True)
    control_s = time.perf_counter() - t_start
    skipped: list[SkippedSource] = []
    own_manager = None
    device = next(iter(dest.values())).device if dest else torch.device(opts.device)

    def nixl() -> "NixlTransferManager":
        nonlocal own_manager
        if manager is not None:
            return manager
        if own_manager is None:
            from modelexpress.p2p.readers import AgentStart

            own_manager = AgentStart(opts.backend, None if device.type == "cpu" else device)
        return own_manager.get()

    factory = readers or layout_readers(opts, nixl, device, covering_below)
    # The blocks of a source that finished are checked while the next one is read.
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mx-layout-check")
    stopped = (lambda: bool(stop is not None and stop.is_set())
               or tracker.stop_requested.is_set())
    try:
        t0 = time.perf_counter()
        candidates = _Candidates(client, record.candidates, identity, skipped,
                                 known=record.records)
        with gc_paused():  # parsing the records: many small objects, no cycles
            candidates.more()
        control_s += time.perf_counter() - t0
        if not candidates.fetched:
            raise _nothing_to_try(_message(identity, "no READY source of another layout "
                                           "publishes a layout", skipped))
        if callable(target):
            target = target(candidates.fetched[0].layout.checkpoint)
        dropped: set[str] = set()
        by_id = candidates.by_id  # grows as more records are fetched
        plan_s = 0.0
        for attempt in range(1, opts.max_attempts + 1):
            while True:
                t_plan = time.perf_counter()
                try:
                    plan = plan_layout(target, [(c.info.id, c.layout) for c in candidates.fetched
                                                if c.info.id not in dropped])
                    break
                except LayoutError as exc:
                    no_plan = exc
                finally:
                    plan_s += time.perf_counter() - t_plan
                t_more = time.perf_counter()
                with gc_paused():
                    more = candidates.more(dropped)  # the next whole layout, if any
                control_s += time.perf_counter() - t_more
                if not more:
                    raise NoSourceError(_message(identity, f"no plan covers this rank: {no_plan}",
                                                 skipped)) from no_plan
            buffers = {**dest, **allocate_scratch(plan, device)}
            if before_writing is not None:
                before_writing()
                before_writing = None
            log.info("cross-layout pull of %s rank %d/%d (attempt %d): %d bytes in %d copies "
                     "from %d source(s) of other layouts (%d bytes this rank holds)",
                     identity.model, target.rank, target.tp_size, attempt, plan.read_bytes,
                     len(plan.copies), len(plan.sources), plan.needed_bytes)
            checks = _Checks(plan, buffers, pool)
            sources = _Sources(factory, by_id)
            t_report = time.perf_counter()
            tracker.report(0, plan.read_bytes, force=True)  # RUNNING, with the total
            control_s += time.perf_counter() - t_report
            tracker.begin()
            try:
                t_data = time.perf_counter()
                results = _read(plan, sources, buffers, tracker, progress, stopped, end,
                                opts.timeout_s, skipped, checks)
                data_s = time.perf_counter() - t_data
                if results is None:  # a source failed: the plan is made again without it
                    checks.abandon()
                    dropped |= {s.source_id for s in skipped}
                    continue
                # what the pull waits for: the checks not yet run (those of the last
                # source's blocks); the others ran beside the reads, in the data plane
                t_verify = time.perf_counter()
                bad, hashing_s = checks.finish()
                verify_s = time.perf_counter() - t_verify
            finally:
                # the last source's close ran beside the checks above: what is left of it
                close_wait_s = sources.finish()
            if bad:
                dropped |= _blame(bad, by_id, skipped)
                continue
            finish(plan, buffers)
            result = _result(plan, results, by_id, skipped, record.id, data_s, verify_s,
                             close_wait_s, control_s, plan_s, t_start, PullResult)
            t_final = time.perf_counter()
            tracker.succeed(result.bytes, rate_bps=result.gbps * 1e9,
                            outcome=outcome_of(result))
            # the last round trips are control plane, as in a same-layout pull
            result = dataclasses.replace(
                result, total_seconds=time.perf_counter() - t_start,
                phases={**result.phases, "control_plane": round(
                    result.phases["control_plane"] + time.perf_counter() - t_final, 6)})
            log.info("pulled %s rank %d/%d across layouts: %d bytes from %s in %.3f s "
                     "(%.2f GB/s, %s; %d blocks verified, %d of them as they landed, the "
                     "rest in %.3f s; the pull took %.3f s)",
                     identity.model, target.rank, target.tp_size, result.bytes,
                     ",".join(result.source_ids), result.seconds, result.gbps,
                     result.transport, len(plan.checks), checks.in_pass, verify_s,
                     result.total_seconds)
            return AcrossLayouts(result, plan.verified_blocks(), target, checks.in_pass,
                                 hashing_s)
        raise NoSourceError(_message(identity, f"{opts.max_attempts} plan(s) failed", skipped))
    except TransferCancelledError:
        tracker.finish("STOPPED", done=tracker.done)
        raise
    except BaseException as exc:
        tracker.finish("FAILED", error=f"{type(exc).__name__}: {exc}"[:8000], done=tracker.done)
        raise
    finally:
        pool.shutdown(wait=True)
        if own_manager is not None:
            own_manager.close()


class _Checks:
    """The block checks of one plan: a block one source alone supplies is offered to
    its reader to hash as its bytes land (:meth:`of`); the rest, and those the reader
    left, run on ``pool`` as the sources they need finish. Every check is run once,
    on the bytes in the destination."""

    def __init__(self, plan: Any, buffers: Mapping[str, "torch.Tensor"],
                 pool: concurrent.futures.ThreadPoolExecutor) -> None:
        from modelexpress.layout.readers import check_blocks

        self._check = check_blocks
        self.plan, self.buffers, self.pool = plan, buffers, pool
        self.pending = list(plan.checks)
        self.done: set[str] = set()
        self.futures: list[concurrent.futures.Future] = []
        self.hashing_s = 0.0
        self.bad: list = []
        self.in_pass = 0

    def of(self, key: str) -> list:
        """The pending checks of blocks source ``key`` alone supplies."""
        return [c for c in self.pending if c.sources == (key,)]

    def read_checked(self, checked: Sequence[Any], failed: Sequence[Any]) -> None:
        """A reader hashed these as they landed: ``failed`` did not match."""
        taken = {id(c) for c in (*checked, *failed)}
        if taken:
            self.pending = [c for c in self.pending if id(c) not in taken]
            self.bad.extend(failed)
            self.in_pass += len(taken)

    def _run(self, checks: list) -> list:
        t0 = time.perf_counter()
        try:
            return self._check(checks, self.buffers, self.plan.algorithm)
        finally:
            self.hashing_s += time.perf_counter() - t0

    def source_done(self, key: str) -> None:
        self.done.add(key)
        ready = [c for c in self.pending if self.done.issuperset(c.sources)]
        if ready:
            self.pending = [c for c in self.pending if not self.done.issuperset(c.sources)]
            self.futures.append(self.pool.submit(self._run, ready))

    def finish(self) -> tuple[list, float]:
        """The failed checks, and the seconds spent hashing (overlapped with the reads
        but for the last source's)."""
        bad = self.bad + [c for f in self.futures for c in f.result()]
        if self.pending:
            bad += self._run(self.pending)
        return bad, self.hashing_s

    def abandon(self) -> None:
        concurrent.futures.wait(self.futures)  # nothing may read the buffers after this


class _Sources:
    """The readers of one plan's sources: each source is opened ahead, on a thread of its
    own, while the previous one's copies run, and closed off the pull's path once its
    copies are done (:class:`~modelexpress.layout.readers.OpensAhead`: mapping and
    unmapping a same-host source's memory; a NIXL reader is made ahead and connects
    as its READ begins). :meth:`finish` waits for all of it (bounded by the reader's
    own connect timeout) and says how long the pull waited."""

    def __init__(self, factory: LayoutReaderFactory, by_id: Mapping[str, LayoutSource]) -> None:
        self._factory, self.by_id = factory, by_id
        self._opener = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="mx-layout-open")
        self._closer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="mx-layout-close")
        self._ahead: dict[str, concurrent.futures.Future] = {}
        self._closes: list[concurrent.futures.Future] = []

    def _open(self, key: str) -> Any:
        reader = self._factory(self.by_id[key])
        if callable(getattr(reader, "open", None)):
            reader.open()
        return reader

    def ahead(self, key: str) -> None:
        """Start opening ``key``'s source now."""
        if key not in self._ahead:
            self._ahead[key] = self._opener.submit(self._open, key)

    def get(self, key: str) -> tuple[Any, float]:
        """``key``'s reader, open, and the seconds this call waited for it."""
        self.ahead(key)
        t0 = time.perf_counter()
        reader = self._ahead.pop(key).result()
        return reader, time.perf_counter() - t0

    def read_args(self, reader: Any) -> dict[str, Any]:
        """``read_copies``'s extra arguments for ``reader``: its close off the path."""
        return {"close_later": self.close_later} if callable(getattr(reader, "close", None)) \
            else {}

    def close_later(self, close: Callable[[], None]) -> None:
        self._closes.append(self._closer.submit(close))

    def finish(self) -> float:
        """Close every source (those opened ahead and never read too); the seconds it
        waited. Never raises: a close that failed is logged."""
        t0 = time.perf_counter()
        for future in self._ahead.values():
            try:
                reader = future.result()
            except BaseException:  # noqa: BLE001 - it was never read: nothing to report
                continue
            if callable(getattr(reader, "close", None)):
                self.close_later(reader.close)
        self._ahead.clear()
        for future in self._closes:
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - the bytes are in; say it, go on
                log.warning("closing a source after a cross-layout pull failed: %s: %s",
                            type(exc).__name__, exc)
        self._opener.shutdown(wait=True)
        self._closer.shutdown(wait=True)
        return time.perf_counter() - t0


def _read(plan: Any, sources: _Sources, buffers: Mapping[str, "torch.Tensor"],
          tracker: TransferTracker, progress: Callable[[int, int], None] | None,
          stopped: Callable[[], bool], end: float, timeout_s: float, skipped: list,
          checks: _Checks) -> dict[str, Any] | None:
    """Each source's copies of ``plan``, in order, its reader offered the checks of the
    blocks it alone supplies (``checks.source_done(key)`` after each), the next source
    opened while they run; the ReadStats by source (``connect_seconds``: what the pull
    waited for the opening), or None when one failed (it is in ``skipped``)."""
    total = plan.read_bytes
    done_before = 0
    results: dict[str, Any] = {}
    by_source = plan.by_source()
    order = list(by_source)
    if order:
        sources.ahead(order[0])
    for i, (key, copies) in enumerate(by_source.items()):
        tracker.reading = key
        share = sum(c.nbytes for c in copies)

        def report(done: int, base: int = done_before, share: int = share) -> None:
            # A reader counts the bytes it moved: reading covering spans, more than this
            # source's share of the plan (the control plane refuses a report past the
            # total, HTTP 422), so the count stops at the share.
            done = base + min(done, share)
            if progress is not None:
                progress(done, total)
            tracker.report(done, total)

        left = end - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"cross-layout pull deadline of {timeout_s:.0f} s ran out")
        try:
            reader, waited = sources.get(key)
            if i + 1 < len(order):
                sources.ahead(order[i + 1])
            stats = reader.read_copies(
                copies, buffers, progress=report, stop=stopped, deadline_s=left,
                checks=checks.of(key), algorithm=plan.algorithm, **sources.read_args(reader))
            results[key] = dataclasses.replace(
                stats, connect_seconds=stats.connect_seconds + waited)
        except (TransferCancelledError, NoSourceError):
            raise
        except MxError as exc:
            skipped.append(_skip(sources.by_id[key].info, f"{type(exc).__name__}: {exc}"))
            return None
        done_before += sum(c.nbytes for c in copies)
        checks.read_checked(results[key].checked, results[key].failed)
        checks.source_done(key)
    return results


def _blame(bad: Sequence[Any], by_id: Mapping[str, LayoutSource], skipped: list) -> set[str]:
    """The sources that supplied blocks that failed their checks (each in ``skipped``)."""
    blamed = {s for check in bad for s in check.sources}
    for key in sorted(blamed):
        first = next(c for c in bad if key in c.sources)
        skipped.append(_skip(by_id[key].info, (
            f"{sum(key in c.sources for c in bad)} block(s) it supplied do not match the "
            f"checkpoint digests it published (first: block {first.block} of {first.ckpt}): "
            "its layout disagrees with its bytes, or a byte went wrong on the way")))
    return blamed


def _nothing_to_try(message: str) -> NoSourceError:
    """A NoSourceError before any byte moved (``nothing_tried``: a caller logs it quietly,
    as the ordinary case of a first load)."""
    exc = NoSourceError(message)
    exc.nothing_tried = True  # type: ignore[attr-defined]
    return exc


class _Candidates:
    """The candidates of other layouts, their records (manifest and layout) fetched in
    the server's order only as far as the pull needs them: until the fetched sources
    hold a whole layout (one source of every rank of one tensor-parallel size), and then
    again only when no plan covers the target with those not dropped. The server puts
    one source of every rank first (``ControlPlane.rank_sources``), so a target in a
    fleet of many replicas fetches one record per rank it reads, not every replica's.
    Those of this very identity are for :func:`~modelexpress.p2p.pull` (tried before
    this) and are passed over. Records that came with the transfer's record (``known``:
    API version 6) are not asked for again."""

    def __init__(self, client: "MxClient", ids: Sequence[str], identity: "ModelIdentity",
                 skipped: list, known: Sequence["SourceInfo"] = ()) -> None:
        self._client, self._identity, self._skipped = client, identity, skipped
        # this very identity's are left out (the server names sources identity:worker)
        self._ids = [s for s in ids if not s.startswith(f"{identity.id}:")]
        self._known = {info.id: info for info in known}
        self._next = 0
        self.fetched: list[LayoutSource] = []
        self.by_id: dict[str, LayoutSource] = {}

    def more(self, dropped: Collection[str] = ()) -> bool:
        """Fetch records in order until those fetched and not ``dropped`` hold a whole
        layout they did not hold before, or none is left; whether any was added."""
        added = False
        while self._next < len(self._ids):
            source = self._fetch_one(self._ids[self._next])
            self._next += 1
            if source is None:
                continue
            self.fetched.append(source)
            self.by_id[source.info.id] = source
            added = True
            if _whole_layout(source, [c for c in self.fetched if c.info.id not in dropped]):
                break
        return added

    def _fetch_one(self, source_id: str) -> LayoutSource | None:
        from modelexpress.p2p.manifests import manifest_of
        from modelexpress.p2p.result import SkippedSource

        info = self._known.get(source_id)
        if info is None or info.manifest is None:
            try:
                info = self._client.get_source(source_id)
            except MxError as exc:
                self._skipped.append(SkippedSource(source_id, "?", f"could not fetch it: {exc}"))
                return None
        if info.identity_id == self._identity.id:
            return None
        if info.layout is None:
            self._skipped.append(_skip(info, "it published no layout"))
            return None
        try:
            return LayoutSource(info, manifest_of(info), Layout.from_json(info.layout))
        except (LayoutError, MxError) as exc:
            self._skipped.append(_skip(info, f"unusable layout or manifest: {exc}"))
            return None


def _whole_layout(last: LayoutSource, sources: Sequence[LayoutSource]) -> bool:
    """Whether ``sources`` hold every rank of ``last``'s tensor-parallel size."""
    size = last.layout.tp_size
    return {c.layout.rank for c in sources if c.layout.tp_size == size} >= set(range(size))


def _skip(info: "SourceInfo", reason: str) -> Any:
    from modelexpress.p2p.result import SkippedSource

    log.warning("cross-layout source %s (worker %s) dropped: %s", info.id, info.worker_id,
                reason)
    return SkippedSource(info.id, info.worker_id, reason)


def _message(identity: "ModelIdentity", why: str, skipped: Sequence[Any]) -> str:
    tried = "; ".join(f"{s.source_id} ({s.worker_id}): {s.reason}" for s in skipped)
    return (f"no pull across layouts for {identity.model} rank {identity.rank} of tp="
            f"{identity.tp_size}: {why}" + (f"; dropped: {tried}" if tried else ""))


def _result(plan, results, by_id, skipped, transfer_id, data_s, verify_s,  # noqa: ANN001, ANN202
            close_wait_s, control_s, plan_s, t_start, PullResult):  # noqa: N803
    nbytes = sum(r.bytes for r in results.values())
    # Opening a source (mapping it, or a NIXL reader's connect READ) and closing it
    # (unmapping) are not the data plane, as in a same-layout pull
    # (PullResult.connect_seconds, "close"). Counted is what the pull waited for: a
    # source opened ahead while the previous one's copies ran, and a close run beside
    # the next source's copies and the checks (close_wait_s: what was left of them
    # after the checks), cost only their wait.
    connect_s = min(sum(r.connect_seconds for r in results.values()), data_s)
    close_in = min(sum(r.close_seconds for r in results.values()), data_s - connect_s)
    close_s = close_in + close_wait_s
    seconds = max(data_s - connect_s - close_in, 1e-9)
    transports = sorted({r.transport for r in results.values()})
    total_s = time.perf_counter() - t_start
    return PullResult(
        source_ids=tuple(results), bytes=nbytes, seconds=seconds, gbps=nbytes / seconds / 1e9,
        transport=",".join(transports) or "none",
        descriptors=sum(r.descriptors for r in results.values()),
        tensors=len({c.dst for c in plan.copies if not c.dst.startswith("#")}),
        verified=True, skipped=tuple(skipped), warnings=(), total_seconds=total_s,
        verify_seconds=verify_s,
        connect_seconds=connect_s,
        source_attributes={k: dict(by_id[k].manifest.attributes) for k in results},
        transfer_id=transfer_id, expected_transport="", transport_detail="; ".join(
            r.detail for r in results.values() if r.detail),
        phases={"control_plane": round(control_s, 6), "plan": round(plan_s, 6),
                "connect": round(connect_s, 6), "close": round(close_s, 6),
                "data_plane": round(data_s - connect_s - close_in, 6),
                "verify": round(verify_s, 6),
                "other": round(max(total_s - control_s - plan_s - data_s - verify_s
                                   - close_wait_s, 0.0), 6)},
        verdict="ok" if transports == ["local"] else "unknown")
