"""Reading a pull's sources into its destination: in turn, or striped over several.

:func:`~modelexpress.p2p.target.pull` chooses the sources and a reader for each
(:mod:`~modelexpress.p2p.readers`); a :class:`Puller` drives those readers: it reports
progress (to the caller and the pull's record), holds the receive rate under its cap,
honours a stop and the pull's deadline, and collects the sources it had to skip.

* :func:`read_in_turn`: the sources in order until one delivers; a same-host source
  whose local copy failed before a byte moved is read again over NIXL.
* :func:`read_striped`: contiguous shares of the tensors from several sources at once,
  a failed share retried from the others.

:class:`NixlSide` is the pull's NIXL agent, made only when a source is read over NIXL.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from modelexpress.errors import (ManifestMismatchError, NoSourceError, TransferCancelledError,
                                 TransferError, TransferTimeoutError)
from modelexpress.p2p.candidates import no_source_message
from modelexpress.p2p.readers import AgentStart, NixlReader
from modelexpress.p2p.result import SkippedSource
from modelexpress.p2p.tracking import RateCap

if TYPE_CHECKING:
    import torch

    from modelexpress.client import SourceInfo
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p.options import PullOptions
    from modelexpress.p2p.readers import SourceReader
    from modelexpress.p2p.result import PullClock
    from modelexpress.p2p.tracking import TransferTracker
    from modelexpress.transfer import Manifest, NixlTransferManager, StopSignal, TransferResult

__all__ = ["Deadline", "NixlSide", "Puller", "RETRYABLE", "read_in_turn", "read_striped",
           "stopped", "stripes"]

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]
"""``progress(bytes_done, bytes_total)``."""
Source = tuple["SourceInfo", "Manifest"]
"""A candidate source and its manifest."""
Read = tuple["SourceInfo", "TransferResult"]
"""A source and what reading (part of) the destination from it returned."""


class Deadline:
    """The pull's whole deadline (``PullOptions.timeout_s``), shared by every READ."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self, what: str) -> float:
        """Seconds left; raises TransferTimeoutError naming ``what`` when none are."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"pull deadline of {self.seconds:.0f} s ran out {what}")
        return left


def stopped(stop: "StopSignal | None") -> bool:
    """Whether ``stop`` (an event, a callable or None) asks to stop."""
    if stop is None:
        return False
    return stop.is_set() if isinstance(stop, threading.Event) else bool(stop())


def stripes(manifest: "Manifest", names: Sequence[str], n: int) -> list[list[str]]:
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


class NixlSide:
    """The pull's NIXL side, made only when a source is read over NIXL.

    A pull whose sources are all on this host (the local transport) never creates a
    NIXL agent nor registers its destination: both cost more than a small local copy
    (docs/benchmarks.md, "Local transport"). When the first sources to read need NIXL,
    :meth:`start` creates the agent before the READs begin; otherwise :meth:`get`
    creates it on first use (a local read that fell back to NIXL).
    """

    def __init__(self, manager: "NixlTransferManager | None", opts: PullOptions,
                 clock: "PullClock") -> None:
        self.manager = manager
        self.opts = opts
        self.clock = clock
        self.start_: "AgentStart | None" = None
        self.registered = False
        self._lock = threading.Lock()

    def start(self, dest: Mapping[str, "torch.Tensor"] | None) -> None:
        """Create the agent (registering ``dest`` if known)."""
        if self.manager is None and self.start_ is None:
            self.start_ = start_agent(self.opts, dest)

    def get(self, dest: Mapping[str, "torch.Tensor"]) -> "NixlTransferManager":
        """The manager, with ``dest`` registered (once: striped READs run in parallel
        threads and must not race to register the same memory)."""
        with self._lock:
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


class Puller:
    """One pull: the destination, the reader of each source, progress, the rate cap."""

    def __init__(self, *, nixl: NixlSide, dest: Mapping[str, "torch.Tensor"],
                 options: PullOptions, deadline: Deadline, progress: ProgressFn | None,
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
        self.rate = RateCap(options.max_gbps, lambda: stopped(stop), deadline.end,
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
        """Pass over a source (logged, and listed in the result's ``skipped``)."""
        log.warning("skipping source %s (worker %s): %s", info.id, info.worker_id, reason)
        self.skipped.append(SkippedSource(info.id, info.worker_id, reason))


def on_host(dest: Mapping[str, "torch.Tensor"] | None, device: str) -> bool:
    """Whether the destination (or, not allocated yet, ``device``) is host memory."""
    if dest is None:
        return device == "cpu"
    return all(t.device.type == "cpu" for t in dest.values())


def start_agent(opts: PullOptions, dest: Mapping[str, "torch.Tensor"] | None) -> "AgentStart":
    """Create the pull's NIXL agent, on the destination's CUDA device when it has one."""
    if on_host(dest, opts.device):
        return AgentStart(opts.backend, None, register=dest)
    import torch

    device = next(iter(dest.values())).device if dest else torch.device(opts.device)
    return AgentStart(opts.backend, device, register=dest)


RETRYABLE = (TransferError,)


def read_in_turn(puller: Puller, fetched: Sequence[Source], dest: Mapping[str, "torch.Tensor"],
                 allow_partial: bool, identity: "ModelIdentity") -> list[Read]:
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
            except RETRYABLE as exc:
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
            if stopped(puller.stop):
                raise TransferCancelledError("pull stopped")
            return [(info, result)]
    raise NoSourceError(no_source_message(identity, puller.skipped))


def read_striped(puller: Puller, stripes_from: Sequence[Source], fetched: Sequence[Source],
                 max_attempts: int) -> list[Read]:
    """Read contiguous shares of the tensors from several sources at once.

    One NIXL agent serves every stripe: its READs are posted from separate threads,
    each against its own peer. A failed stripe is retried, alone, from the other
    sources (bounded by ``max_attempts`` in total).
    """
    manifest0 = fetched[0][1]
    groups = stripes(manifest0, list(puller.dest), len(stripes_from))
    results: list[Read | None] = [None] * len(groups)
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
            except RETRYABLE as retry_exc:
                puller.skip(other, f"stripe {i} retry: {type(retry_exc).__name__}: {retry_exc}")
        if results[i] is None:
            raise NoSourceError(f"stripe {i} ({len(sub)} tensors) could not be read from any "
                                f"source: " + "; ".join(s.reason for s in puller.skipped))
    return [r for r in results if r is not None]  # every stripe was read (or raised)
