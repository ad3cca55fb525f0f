"""Readers of a cross-layout plan: move a source's boxes, then check and finish.

A :class:`~.plan.LayoutPlan` lists box copies per source. A reader moves one source's
copies into the target's buffers (its tensors and the scratch buffers of covering
reads), the way :mod:`modelexpress.p2p.readers` move whole tensors:

* :class:`LocalLayoutReader`: a source on this host that serves its memory over the
  local transport (:mod:`modelexpress.local`). Its memory is mapped here; host-to-host
  boxes are one strided torch copy each, device boxes one ``cuMemcpy`` per run.
* :class:`NixlLayoutReader`: any other source, by one-sided NIXL READs of byte runs
  (:mod:`.spans`). A copy whose runs are shorter than ``covering_below`` bytes is
  read instead as the contiguous span that covers it, into scratch, and gathered
  here: one descriptor and more bytes instead of one descriptor per row.

Then :func:`check_blocks` hashes every block the plan assembled and compares it with
the digest its source's table published (a mismatch names the sources to drop), and
:func:`finish` runs the scatters (covering reads, blocks held twice) and the fills.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from modelexpress._gc import paused as gc_paused
from modelexpress.errors import (ManifestMismatchError, PeerError, TransferCancelledError,
                                 TransferTimeoutError)
from modelexpress.layout.model import Box
from modelexpress.layout.plan import Check, Copy, LayoutPlan

if TYPE_CHECKING:
    import torch

    from modelexpress.local.protocol import LocalEndpoint
    from modelexpress.transfer import Manifest, NixlTransferManager
    from modelexpress.transfer.manifest import TensorEntry

__all__ = ["COVERING_BELOW", "HOST_COVERING_BELOW", "LayoutReader", "LocalLayoutReader",
           "NixlLayoutReader", "ReadStats", "allocate_scratch", "box_view", "check_blocks",
           "copy_boxes", "finish"]

log = logging.getLogger(__name__)

COVERING_BELOW = 64 << 10
"""A NIXL copy whose runs are shorter than this is read as its covering span (bytes),
and so is a same-host copy into a GPU that is not one pitched copy. ``bench/layout.py``
compares the two; see docs/benchmarks.md, "Across layouts"."""

HOST_COVERING_BELOW = 8 << 10
"""The same for a same-host copy into host memory. There each run is one piece of the
local transport's copy loop (about 1 us of Python each), and a covering span costs a
second copy of its bytes, into scratch memory that is new (its page faults) and then
out of it: rows of 1 and 2.75 KiB were faster covered (the pull 81 against 116 ms),
rows of 8 KiB took the same either way (126 and 127 ms), and rows of 28 KiB were much
faster read as runs (docs/benchmarks.md, "Across layouts")."""


@dataclasses.dataclass(frozen=True)
class ReadStats:
    """What one source's copies cost.

    Attributes:
        bytes: bytes moved (covering spans whole).
        seconds: data-plane time.
        descriptors: runs posted (NIXL) or copies made (local).
        transport: ``local``, or what UCX reported for the READ.
        detail: one line on how.
        connect_seconds: opening the source (mapping, or the connect READ), as far as
            this read waited for it (a source opened ahead: 0).
        close_seconds: closing it again (unmapping its memory), as far as this read
            waited for it (a close handed to ``close_later``: 0).
        checked: the checks (of those passed in) whose block was hashed as its bytes
            landed and matched its digest.
        failed: those hashed as they landed that did not match. A check in neither
            was not hashed here: the caller checks it (:func:`check_blocks`).
    """

    bytes: int
    seconds: float
    descriptors: int
    transport: str
    detail: str = ""
    connect_seconds: float = 0.0
    close_seconds: float = 0.0
    checked: tuple[Check, ...] = ()
    failed: tuple[Check, ...] = ()


class LayoutReader(Protocol):
    """Moves one source's copies of a :class:`~.plan.LayoutPlan`."""

    def read_copies(self, copies: Sequence[Copy], buffers: Mapping[str, "torch.Tensor"], *,
                    progress: Callable[[int], None], stop: Callable[[], bool],
                    deadline_s: float, checks: Sequence[Check] = (),
                    algorithm: str = "") -> ReadStats:
        """Copy ``copies`` (all of this source) into ``buffers`` (target tensors and
        scratch, by name).

        Args:
            progress: called with the bytes done so far.
            stop: True: stop at the next copy (TransferCancelledError).
            deadline_s: bound on the whole read.
            checks: checks of blocks this source alone supplies, which a reader may
                hash as their bytes land (``ReadStats.checked``/``failed``) with
                ``algorithm``; those it does not are the caller's.

        Raises:
            ManifestMismatchError: the source's manifest does not hold a tensor the
                layout names, or holds it with another shape or dtype.
            TransferError subclasses: the read failed.
        """
        ...


class OpensAhead(Protocol):
    """A reader whose source can be opened before its copies run (on another thread,
    while an earlier source's copies run) and closed after them off the caller's
    path: :class:`LocalLayoutReader` (mapping and unmapping a source's memory)."""

    def open(self) -> None:
        """Open the source now; :meth:`read_copies` then uses it. Idempotent."""
        ...

    def close(self) -> None:
        """Close the source (no copy of it may be pending). Idempotent."""
        ...


def box_view(t: "torch.Tensor", box: Box) -> "torch.Tensor":
    """The view of ``t`` that ``box`` covers."""
    return t[tuple(slice(start, start + size) for start, size in box)]


def _entry(entries: Mapping[str, "TensorEntry"], copy: Copy, dtype: Any) -> "TensorEntry":
    """The manifest entry a copy reads, checked against what the copy assumes of it."""
    entry = entries.get(copy.src_tensor)
    want = str(dtype).removeprefix("torch.")
    if (entry is None or entry.dtype != want or len(entry.shape) != len(copy.src_box)
            or any(s + n > dim for (s, n), dim in zip(copy.src_box, entry.shape))):
        raise ManifestMismatchError(
            f"the manifest does not hold {copy.src_tensor} as the source's layout says "
            f"({'absent' if entry is None else f'{entry.dtype} {list(entry.shape)}'}; the "
            f"layout reads {want} box {list(copy.src_box)})")
    return entry


def copy_boxes(copies: Sequence[Copy], sources: Mapping[str, "torch.Tensor"],
               buffers: Mapping[str, "torch.Tensor"],
               progress: Callable[[int], None] = lambda done: None,
               stop: Callable[[], bool] = lambda: False) -> int:
    """Copy each box of ``sources`` (tensors by name, readable here) into ``buffers``;
    returns the bytes copied."""
    done = 0
    for c in copies:
        if stop():
            raise TransferCancelledError("cross-layout read stopped")
        target = box_view(buffers[c.dst], c.dst_box)
        target.copy_(box_view(sources[c.src_tensor], c.src_box).reshape(target.shape))
        done += c.nbytes
        progress(done)
    return done


@dataclasses.dataclass
class _Runs:
    """A source's copies as byte runs (:func:`_runs_of`)."""

    direct: list[tuple[Copy, "TensorEntry", Any, Any, int]]  # copy, entry, src offs, dst addrs, run
    covering: list[tuple[Copy, "TensorEntry", int, int, int]]  # copy, entry, span off, n, at
    scratch_bytes: int
    device: Any
    # copy, entry, first src off, first dst addr, src pitch, dst pitch, run, rows
    pitched: list[tuple[Copy, "TensorEntry", int, int, int, int, int, int]] = \
        dataclasses.field(default_factory=list)

    @property
    def moved(self) -> int:
        """The bytes these runs read from the source."""
        return (sum(len(s) * n for _, _, s, _, n in self.direct)
                + sum(n for _, _, _, n, _ in self.covering)
                + sum(run * rows for *_, run, rows in self.pitched))


# cuMemcpy2D's pitches are bounded (CU_DEVICE_ATTRIBUTE_MAX_PITCH: 2^31 - 1 on the GPUs
# this runs on); a copy whose rows lie further apart takes the per-run path
_MAX_PITCH = (1 << 31) - 1


def _runs_of(copies: Sequence[Copy], entries: Mapping[str, "TensorEntry"],
             buffers: Mapping[str, "torch.Tensor"], covering_below: int,
             pitched: bool = False) -> _Runs:
    """Each copy as byte runs contiguous on both sides, or, when they are shorter than
    ``covering_below``, as the one span of the source that covers them (read into a
    scratch buffer at ``at``, then gathered: :func:`_gather`). With ``pitched`` (a
    reader that has 2D copies), a CUDA source and a CUDA destination, a copy of several
    runs equally spaced on both sides is one pitched copy instead, whatever its run."""
    import numpy as np

    from modelexpress.layout.spans import covering_span, pair_runs, pitched_runs

    out = _Runs([], [], 0, None)
    for c in copies:
        dst = buffers[c.dst]
        out.device = dst.device
        entry = _entry(entries, c, dst.dtype)
        itemsize = dst.element_size()
        if (pitched and dst.device.type == "cuda"
                and entry.device != "cpu"):  # GPU to GPU: what the GPU tests cover
            rows = pitched_runs(c.src_box, entry.shape, c.dst_box, dst.shape, itemsize)
            if rows is not None:
                s0, d0, s_pitch, d_pitch, run, n = rows
                if n > 1 and run <= min(s_pitch, d_pitch) and max(s_pitch, d_pitch) <= _MAX_PITCH:
                    out.pitched.append((c, entry, s0, dst.data_ptr() + d0, s_pitch, d_pitch,
                                        run, n))
                    continue
        s_off, d_off, run = pair_runs(c.src_box, entry.shape, c.dst_box, dst.shape, itemsize)
        if len(s_off) > 1 and run < covering_below:
            off, n = covering_span(c.src_box, entry.shape, itemsize)
            out.covering.append((c, entry, off, n, out.scratch_bytes))
            out.scratch_bytes += -(-n // 256) * 256
        else:
            out.direct.append((c, entry, s_off, dst.data_ptr() + d_off.astype(np.int64), run))
    return out


def _gather_all(runs: _Runs, scratch: "torch.Tensor | None",
                buffers: Mapping[str, "torch.Tensor"]) -> None:
    for c, entry, off, _n, at in runs.covering:
        _gather(scratch, at, off, entry.shape, c, buffers[c.dst])


class LocalLayoutReader:
    """Copies a same-host source's boxes out of the memory it shares (memfds).

    Host to host, the runs go to the local transport's :class:`~modelexpress.local.
    hostcopy.HostCopier` (``pread`` on several threads, in C where it is built: no page
    faults on a mapping, the path a same-layout pull takes); runs shorter than
    ``covering_below`` are read as their covering span into scratch and gathered here.
    GPU to GPU, a copy whose runs lie equally spaced on both sides (a 2D box: the rows
    of a column slice) is one ``cuMemcpy2DAsync`` from the mapped source; any other run
    into a GPU is a ``cuMemcpyAsync`` (short ones read as their covering span, as above).

    Args:
        endpoint: the source's local endpoint (published in its manifest).
        manifest: its manifest.
        device: CUDA ordinal of the destination, None for host memory.
        timeout_s: bound on connecting.
        covering_below: see :data:`COVERING_BELOW`; default :data:`HOST_COVERING_BELOW`
            into host memory, :data:`COVERING_BELOW` into a GPU.
    """

    transport = "local"

    def __init__(self, endpoint: "LocalEndpoint", manifest: "Manifest",
                 device: int | None = None, timeout_s: float = 10.0,
                 covering_below: int | None = None) -> None:
        self.endpoint = endpoint
        self.manifest = manifest
        self.device = device
        self.timeout_s = timeout_s
        self.covering_below = (covering_below if covering_below is not None else
                               HOST_COVERING_BELOW if device is None else COVERING_BELOW)
        self.copied = 0
        self._session: Any = None
        self._lock = threading.Lock()

    def open(self) -> None:
        """Connect and map the source's memory now (see :class:`OpensAhead`)."""
        from modelexpress.local.client import LocalSession

        with self._lock:
            if self._session is None:
                self._session = LocalSession(self.endpoint, self.device,
                                             timeout_s=self.timeout_s, files=False)

    def close(self) -> None:
        """Unmap the source's memory and say bye (see :class:`OpensAhead`)."""
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.close()

    def read_copies(self, copies: Sequence[Copy], buffers: Mapping[str, "torch.Tensor"], *,
                    progress: Callable[[int], None], stop: Callable[[], bool],
                    deadline_s: float, checks: Sequence[Check] = (),
                    algorithm: str = "",
                    close_later: Callable[[Callable[[], None]], Any] | None = None
                    ) -> ReadStats:
        """As :meth:`LayoutReader.read_copies`; ``close_later(fn)``: run the close
        ``fn`` off this path (every copy is done when it is handed over), else the
        source is closed here."""
        import torch

        end = time.monotonic() + deadline_s
        t0 = time.perf_counter()
        self.open()
        session = self._session
        connect_s = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            with gc_paused():
                runs = _runs_of(copies, self.manifest.by_name(), buffers, self.covering_below,
                                pitched=self.device is not None)
            planned_s = time.perf_counter() - t1
            timed = ""
            scratch = (torch.empty(runs.scratch_bytes, dtype=torch.uint8, device=runs.device)
                       if runs.covering else None)
            in_pass = None
            if runs.device is None or runs.device.type == "cpu":
                in_pass = _blocks_in_pass(checks, buffers, algorithm, self.endpoint.source_id)
                count = self._host(session, runs, scratch, progress, stop, end, deadline_s,
                                   in_pass)
            else:
                count, issued_s, done_s = self._device(session, runs, scratch)
                timed = (f", copies issued in {issued_s * 1e3:.2f} ms and done "
                         f"{done_s * 1e3:.2f} ms later")
            _gather_all(runs, scratch, buffers)
            checked, failed = _outcomes(in_pass)
            seconds = time.perf_counter() - t1
        except (KeyError, ValueError) as exc:
            raise PeerError(f"{self.endpoint.source_id}: {exc}") from exc
        finally:
            t_close = time.perf_counter()
            if close_later is not None:
                close_later(self.close)
            else:
                self.close()
            close_s = time.perf_counter() - t_close
        moved = runs.moved
        self.copied = moved
        progress(moved)
        return ReadStats(bytes=moved, seconds=max(seconds, 1e-9), descriptors=count,
                         transport=self.transport, connect_seconds=connect_s,
                         close_seconds=close_s,
                         detail=(f"modelexpress.local over {self.endpoint.path}: {count} runs, "
                                 f"{len(runs.pitched)} pitched (2D), "
                                 f"{len(runs.covering)} covering span(s) gathered here, "
                                 f"{len(checked) + len(failed)} block(s) hashed as they "
                                 f"landed; runs planned in {planned_s * 1e3:.2f} ms{timed}, "
                                 f"{seconds * 1e3:.2f} ms in all"),
                         checked=checked, failed=failed)

    def _host(self, session: Any, runs: _Runs, scratch: "torch.Tensor | None",
              progress: Callable[[int], None], stop: Callable[[], bool], end: float,
              deadline_s: float, in_pass: Any = None) -> int:
        from modelexpress.local.hostcopy import HostCopier, Rows

        jobs: list[tuple[int, int, int, int] | Rows] = []
        where: dict[str, tuple[int, int]] = {}

        def base(entry: "TensorEntry") -> tuple[int, int]:
            if entry.device != "cpu":
                raise PeerError(f"{self.endpoint.source_id} serves {entry.name} on "
                                f"{entry.device}; this destination is host memory")
            if entry.name not in where:
                where[entry.name] = session.host_segment(entry.addr, entry.nbytes)
            return where[entry.name]

        for _c, entry, s_off, d_addr, run in runs.direct:
            seg, off0 = base(entry)
            if len(s_off) > 1:  # rows: cut into pieces without Python per row
                jobs.append(Rows(seg, s_off.astype("int64") + off0, d_addr.astype("int64"), run))
            else:
                jobs.append((seg, off0 + int(s_off[0]), int(d_addr[0]), run))
        for _c, entry, off, n, at in runs.covering:
            seg, off0 = base(entry)
            jobs.append((seg, off0 + off, scratch.data_ptr() + at, n))  # type: ignore[union-attr]
        copier = HostCopier(session.host_map)
        try:
            done = 0
            for chunk in _chunks(jobs, _LOCAL_CHUNK_BYTES):
                if stop():
                    raise TransferCancelledError("cross-layout read stopped")
                if time.monotonic() > end:
                    raise TransferTimeoutError(f"cross-layout read from {self.endpoint.source_id} "
                                               f"did not finish within {deadline_s:.0f} s")
                copier.copy([j for j in chunk if isinstance(j, tuple)], in_pass,
                            rows=[j for j in chunk if isinstance(j, Rows)])
                done += sum(_job_bytes(j) for j in chunk)
                progress(done)
        finally:
            copier.close()
        return sum(len(j.offsets) if isinstance(j, Rows) else 1 for j in jobs)

    def _device(self, session: Any, runs: _Runs, scratch: "torch.Tensor | None"
                ) -> tuple[int, float, float]:
        """The copies into a GPU on a stream of their own: ``(copies, seconds to issue
        them, seconds from then until they were done)``."""
        import torch

        from modelexpress.local.cuda import memcpy2d_async, memcpy_async

        t0 = time.perf_counter()
        stream = torch.cuda.Stream(device=runs.device)
        count = 0
        for _c, entry, s0, d0, s_pitch, d_pitch, run, rows in runs.pitched:
            src = session.local_addr(entry.addr, entry.nbytes, entry.device == "cpu")
            memcpy2d_async(d0, d_pitch, src + s0, s_pitch, run, rows, stream.cuda_stream)
            count += 1
        for _c, entry, s_off, d_addr, run in runs.direct:
            src = session.local_addr(entry.addr, entry.nbytes, entry.device == "cpu")
            for s, d in zip(s_off.tolist(), d_addr.tolist()):
                memcpy_async(d, src + s, run, stream.cuda_stream)
            count += len(s_off)
        for _c, entry, off, n, at in runs.covering:
            src = session.local_addr(entry.addr, entry.nbytes, entry.device == "cpu")
            memcpy_async(scratch.data_ptr() + at, src + off, n, stream.cuda_stream)  # type: ignore[union-attr]
            count += 1
        t1 = time.perf_counter()
        stream.synchronize()
        return count, t1 - t0, time.perf_counter() - t1


def _blocks_in_pass(checks: Sequence[Check], buffers: Mapping[str, "torch.Tensor"],
                    algorithm: str, peer: str) -> Any:
    """The blocks of ``checks`` that the local transport's copy loop can hash as their
    bytes land (contiguous in host memory, not overlapping another), as the ranges of a
    :class:`~modelexpress.local.hostcopy.DigestsInPass` (one "tensor" per block, named
    by its index in ``checks``); None when there are none or ``algorithm`` does not
    stream. The others are left to :func:`check_blocks`."""
    import types

    from modelexpress.local.hostcopy import DigestsInPass
    from modelexpress.transfer.digest import hasher

    if not checks or not algorithm or hasher(algorithm) is None:
        return None
    spans = []
    for i, c in enumerate(checks):
        view = box_view(buffers[c.where], c.box)
        if view.device.type == "cpu" and view.numel() and view.is_contiguous():
            spans.append((view.data_ptr(), view.numel() * view.element_size(), i, view))
    spans.sort(key=lambda x: x[0])
    order, views, end = [], {}, 0
    for start, nbytes, i, view in spans:
        if start < end:
            continue  # overlaps the block before it: checked after the copy instead
        end = start + nbytes
        order.append(types.SimpleNamespace(
            name=str(i), remote=types.SimpleNamespace(digest=checks[i].digest)))
        views[str(i)] = view
    if not order:
        return None
    in_pass = DigestsInPass(algorithm, order, views, peer)
    in_pass.checks = checks  # type: ignore[attr-defined]
    return in_pass


def _outcomes(in_pass: Any) -> tuple[tuple[Check, ...], tuple[Check, ...]]:
    """The checks hashed whole as they landed: those that matched, those that did not
    (a block some of whose bytes did not land through the copy loop is in neither)."""
    if in_pass is None:
        return (), ()
    checked, failed = [], []
    for name, want, got in in_pass.outcomes():
        if got.startswith("(only "):
            continue
        (checked if got == want else failed).append(in_pass.checks[int(name)])
    return tuple(checked), tuple(failed)


_LOCAL_CHUNK_BYTES = 256 << 20  # progress and stop between HostCopier calls


def _job_bytes(job: Any) -> int:
    """The bytes of a host job: a ``(segment, offset, dst, nbytes)`` run or its Rows."""
    return job[3] if isinstance(job, tuple) else job.total


def _chunks(jobs: Sequence[Any], limit: int) -> list[list[Any]]:
    out: list[list[Any]] = [[]]
    filled = 0
    for job in jobs:
        if filled >= limit and out[-1]:
            out.append([])
            filled = 0
        out[-1].append(job)
        filled += _job_bytes(job)
    return [c for c in out if c]


class NixlLayoutReader:
    """Reads a source's boxes as NIXL byte runs.

    Args:
        manager: the pull's NIXL manager (the target buffers are registered with it
            here, scratch included).
        metadata: the source's agent metadata.
        manifest: its manifest.
        same_host: the source is on this host (for the expected transport).
        chunk_bytes, stall_s, refuse_slow_transport: as ``PullOptions``.
        covering_below: read a copy whose runs are shorter than this as one covering
            span and gather it here (:data:`COVERING_BELOW`); 0: always the runs.
    """

    def __init__(self, manager: "NixlTransferManager", metadata: bytes, manifest: "Manifest",
                 *, same_host: bool, chunk_bytes: int = 1 << 30, stall_s: float | None = None,
                 refuse_slow_transport: bool = False,
                 covering_below: int = COVERING_BELOW) -> None:
        self.manager = manager
        self.metadata = metadata
        self.manifest = manifest
        self.same_host = same_host
        self.chunk_bytes = chunk_bytes
        self.stall_s = stall_s
        self.refuse = refuse_slow_transport
        self.covering_below = covering_below

    def read_copies(self, copies: Sequence[Copy], buffers: Mapping[str, "torch.Tensor"], *,
                    progress: Callable[[int], None], stop: Callable[[], bool],
                    deadline_s: float, checks: Sequence[Check] = (),
                    algorithm: str = "") -> ReadStats:
        import numpy as np
        import torch

        from modelexpress.layout.spans import coalesce_runs

        with gc_paused():
            runs = _runs_of(copies, self.manifest.by_name(), buffers, self.covering_below)
        scratch = (torch.empty(runs.scratch_bytes, dtype=torch.uint8, device=runs.device)
                   if runs.covering else None)
        local, remote = [], []
        for _c, entry, s_off, d_addr, run in runs.direct:
            s, d, n = coalesce_runs(entry.addr + s_off, d_addr,
                                    np.full(len(s_off), run, dtype=np.int64))
            dev = 0 if runs.device.type == "cpu" else int(runs.device.index or 0)
            local.append(np.stack([d, n, np.full(len(d), dev, dtype=np.int64)], 1))
            remote.append(np.stack([s, n, np.full(len(s), entry.device_index, dtype=np.int64)], 1))
        for _c, entry, off, n, at in runs.covering:
            local.append(np.array([[scratch.data_ptr() + at, n, _dev(scratch)]],  # type: ignore[union-attr]
                                  dtype=np.int64))
            remote.append(np.array([[entry.addr + off, n, entry.device_index]], dtype=np.int64))
        if not local:
            return ReadStats(0, 1e-9, 0, "none")
        register = dict(buffers)
        if scratch is not None:
            register["#scratch"] = scratch
        self.manager.ensure_registered(register)
        peer = self.manager.add_peer(self.metadata)
        try:
            result = self.manager.read_runs(
                peer, np.concatenate(local).astype(np.uint64),
                np.concatenate(remote).astype(np.uint64),
                local_mem="DRAM" if runs.device.type == "cpu" else "VRAM",
                remote_mem=self.manifest.tensors[0].mem if self.manifest.tensors else "DRAM",
                same_host=self.same_host, chunk_bytes=self.chunk_bytes, deadline_s=deadline_s,
                progress=lambda done, _total: progress(done), stop=stop,
                refuse_slow_transport=self.refuse, stall_s=self.stall_s)
        finally:
            self.manager.remove_peer(peer)
        _gather_all(runs, scratch, buffers)
        return ReadStats(bytes=result.bytes, seconds=result.seconds,
                         descriptors=result.descriptors, transport=result.transport,
                         connect_seconds=result.connect_seconds,
                         detail=(f"{result.transport_detail}; {len(runs.covering)} covering "
                                 f"span(s) ({runs.scratch_bytes} bytes) gathered here"))


def _dev(t: "torch.Tensor") -> int:
    return 0 if t.device.type == "cpu" else int(t.device.index or 0)


def _gather(scratch: "torch.Tensor", at: int, span_off: int, shape: Sequence[int], copy: Copy,
            dst: "torch.Tensor") -> None:
    """Copy ``copy``'s box out of the covering span read into ``scratch`` at ``at``."""
    from modelexpress.layout.spans import contiguous_strides

    itemsize = dst.element_size()
    strides = contiguous_strides(shape)
    first = sum(s * st for (s, _), st in zip(copy.src_box, strides))
    n = sum((s + k - 1) * st for (s, k), st in zip(copy.src_box, strides)) - first + 1
    elems = scratch[at:at + n * itemsize].view(dst.dtype)
    assert span_off == first * itemsize
    # as_strided's offset counts from the storage's start, not from the view's
    src = elems.as_strided([k for _, k in copy.src_box], strides, elems.storage_offset())
    target = box_view(dst, copy.dst_box)
    target.copy_(src.reshape(target.shape))


def allocate_scratch(plan: LayoutPlan, device: "torch.device | str") -> dict[str, "torch.Tensor"]:
    """The scratch buffers of ``plan``'s covering reads, on ``device``."""
    import torch

    return {s.key: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device)
            for s in plan.scratch}


def check_blocks(checks: Sequence[Check], buffers: Mapping[str, "torch.Tensor"],
                 algorithm: str) -> list[Check]:
    """The checks whose block does not hash to its digest (empty: all good).

    Blocks are hashed where they lie (:func:`~modelexpress.transfer.digest.digest_many`
    hashes a strided view in logical order, as the source hashed the checkpoint's block):
    on a GPU whose digest kernel hashes a column strip in place
    (:func:`~modelexpress.transfer.digest.strips_hashed_in_place`) the strips are not
    copied out at all, else see :func:`block_views`.
    """
    import torch

    from modelexpress.transfer import digest as _digest

    if not checks:
        return []
    gpus = {buffers[c.where].device for c in checks} - {torch.device("cpu")}
    in_place = all(_digest.strips_hashed_in_place(algorithm, d) for d in gpus)
    with gc_paused():
        views = block_views(checks, buffers, side_by_side=False if in_place else None)
    got = _digest.digest_many(views, algorithm)
    return [c for c, value in zip(checks, got) if value != c.digest]


def block_views(checks: Sequence[Check], buffers: Mapping[str, "torch.Tensor"],
                side_by_side: bool | None = None) -> list["torch.Tensor"]:
    """Each check's block where it lies, as a tensor in the block's logical order.

    A block that is not contiguous where it lies (a column strip of a row-parallel
    weight) is copied to be hashed unless the digest hashes it in place (the shipped GPU
    kernel: :func:`check_blocks` then passes ``side_by_side=False``). Where it is copied
    on a GPU (``side_by_side`` None: for the tensors on a CUDA device), strips of one
    tensor side by side along one dimension, of one width, are copied together: one
    copy that puts the strips one after the other, each then a contiguous slice of it,
    instead of one copy (a kernel launch and an allocation) per strip. In host memory
    the strips stay views: the xxh3 digest copies a strided block's rows into a reused
    buffer of one digest block on the hashing threads, where one large copy first was
    slower (a 0.93 GB pull's checks waited 62-63 ms against 13-17 ms, 2-core VM:
    docs/benchmarks.md). The digests are the same.
    """
    views: list[Any] = [None] * len(checks)
    strips: dict[tuple, list[int]] = {}  # (where, dim, other dims' boxes, width) -> checks
    for i, c in enumerate(checks):
        tensor = buffers[c.where]
        views[i] = view = box_view(tensor, c.box)
        if view.is_contiguous() or not (side_by_side if side_by_side is not None
                                        else tensor.device.type == "cuda"):
            continue
        # the last dimension the box does not span whole (a box spanning all is contiguous)
        d = max((dim for dim, ((start, size), n) in enumerate(zip(c.box, tensor.shape))
                 if start or size != n), default=None)
        if d is None:  # a tensor that is not contiguous itself: hashed as it is
            continue
        strips.setdefault((c.where, d, c.box[:d], c.box[d + 1:], c.box[d][1]), []).append(i)
    for (where, d, before, after, width), idx in strips.items():
        idx.sort(key=lambda i: checks[i].box[d][0])
        chain: list[int] = []
        for i in idx + [-1]:
            if i >= 0 and chain and checks[i].box[d][0] == checks[chain[-1]].box[d][0] + width:
                chain.append(i)
                continue
            if len(chain) > 1:
                union = before + ((checks[chain[0]].box[d][0], len(chain) * width),) + after
                together = box_view(buffers[where], union).unflatten(
                    d, (len(chain), width)).movedim(d, 0).contiguous()
                for j, k in enumerate(chain):
                    views[k] = together[j]
            chain = [i]
    return views


def finish(plan: LayoutPlan, buffers: Mapping[str, "torch.Tensor"]) -> None:
    """The scatters (after the checks) and the fills of ``plan``."""
    for s in plan.scatters:
        target = box_view(buffers[s.tensor], s.dst_box)
        target.copy_(box_view(buffers[s.src], s.src_box).reshape(target.shape))
    for f in plan.fills:
        box_view(buffers[f.tensor], f.dst).fill_(f.value)
