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
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from modelexpress.errors import (ManifestMismatchError, PeerError, TransferCancelledError,
                                 TransferTimeoutError)
from modelexpress.layout.model import Box
from modelexpress.layout.plan import Check, Copy, LayoutPlan

if TYPE_CHECKING:
    import torch

    from modelexpress.local.protocol import LocalEndpoint
    from modelexpress.transfer import Manifest, NixlTransferManager
    from modelexpress.transfer.manifest import TensorEntry

__all__ = ["COVERING_BELOW", "LayoutReader", "LocalLayoutReader", "NixlLayoutReader",
           "ReadStats", "allocate_scratch", "box_view", "check_blocks", "copy_boxes", "finish"]

log = logging.getLogger(__name__)

COVERING_BELOW = 64 << 10
"""A NIXL copy whose runs are shorter than this is read as its covering span (bytes).
``bench/layout.py`` compares the two; see docs/benchmarks.md, "Across layouts"."""


@dataclasses.dataclass(frozen=True)
class ReadStats:
    """What one source's copies cost.

    Attributes:
        bytes: bytes moved (covering spans whole).
        seconds: data-plane time.
        descriptors: runs posted (NIXL) or copies made (local).
        transport: ``local``, or what UCX reported for the READ.
        detail: one line on how.
        connect_seconds: opening the source (mapping, or the connect READ).
    """

    bytes: int
    seconds: float
    descriptors: int
    transport: str
    detail: str = ""
    connect_seconds: float = 0.0


class LayoutReader(Protocol):
    """Moves one source's copies of a :class:`~.plan.LayoutPlan`."""

    def read_copies(self, copies: Sequence[Copy], buffers: Mapping[str, "torch.Tensor"], *,
                    progress: Callable[[int], None], stop: Callable[[], bool],
                    deadline_s: float) -> ReadStats:
        """Copy ``copies`` (all of this source) into ``buffers`` (target tensors and
        scratch, by name).

        Args:
            progress: called with the bytes done so far.
            stop: True: stop at the next copy (TransferCancelledError).
            deadline_s: bound on the whole read.

        Raises:
            ManifestMismatchError: the source's manifest does not hold a tensor the
                layout names, or holds it with another shape or dtype.
            TransferError subclasses: the read failed.
        """
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


class LocalLayoutReader:
    """Copies a same-host source's boxes from its mapped memory.

    Args:
        endpoint: the source's local endpoint (published in its manifest).
        manifest: its manifest.
        device: CUDA ordinal of the destination, None for host memory.
        timeout_s: bound on connecting.
    """

    transport = "local"

    def __init__(self, endpoint: "LocalEndpoint", manifest: "Manifest",
                 device: int | None = None, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.manifest = manifest
        self.device = device
        self.timeout_s = timeout_s
        self.copied = 0

    def read_copies(self, copies: Sequence[Copy], buffers: Mapping[str, "torch.Tensor"], *,
                    progress: Callable[[int], None], stop: Callable[[], bool],
                    deadline_s: float) -> ReadStats:
        import torch

        from modelexpress.local.client import LocalSession

        end = time.monotonic() + deadline_s
        t0 = time.perf_counter()
        session = LocalSession(self.endpoint, self.device, timeout_s=self.timeout_s,
                               files=False)
        connect_s = time.perf_counter() - t0
        stream = None
        try:
            entries = self.manifest.by_name()
            views: dict[str, torch.Tensor] = {}
            t1 = time.perf_counter()
            done = runs = 0
            for c in copies:
                if stop():
                    raise TransferCancelledError("cross-layout read stopped")
                if time.monotonic() > end:
                    raise TransferTimeoutError(f"cross-layout read from {self.endpoint.source_id} "
                                               f"did not finish within {deadline_s:.0f} s")
                dst = buffers[c.dst]
                entry = _entry(entries, c, dst.dtype)
                if entry.device == "cpu" and dst.device.type == "cpu":
                    if c.src_tensor not in views:
                        raw = session.host_map.tensor(
                            session.local_addr(entry.addr, entry.nbytes, True), entry.nbytes)
                        views[c.src_tensor] = raw.view(dst.dtype).view(entry.shape)
                    copy_boxes([c], views, buffers)
                    runs += 1
                else:
                    from modelexpress.layout.spans import pair_runs
                    from modelexpress.local.cuda import memcpy_async

                    if stream is None:
                        stream = torch.cuda.Stream(device=dst.device if dst.is_cuda else None)
                    base = session.local_addr(entry.addr, entry.nbytes, entry.device == "cpu")
                    s_off, d_off, run = pair_runs(c.src_box, entry.shape, c.dst_box,
                                                  dst.shape, dst.element_size())
                    for s, d in zip(s_off.tolist(), d_off.tolist()):
                        memcpy_async(dst.data_ptr() + d, base + s, run, stream.cuda_stream)
                    runs += len(s_off)
                done += c.nbytes
                self.copied = done
                progress(done)
            if stream is not None:
                stream.synchronize()
            seconds = time.perf_counter() - t1
        except (KeyError, ValueError) as exc:
            raise PeerError(f"{self.endpoint.source_id}: {exc}") from exc
        finally:
            session.close()
        return ReadStats(bytes=done, seconds=max(seconds, 1e-9), descriptors=runs,
                         transport=self.transport, connect_seconds=connect_s,
                         detail=f"modelexpress.local over {self.endpoint.path}: {runs} copies")


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
                    deadline_s: float) -> ReadStats:
        import numpy as np
        import torch

        from modelexpress.layout.spans import coalesce_runs, covering_span, pair_runs

        local, remote, lengths = [], [], []
        gathers: list[tuple[Copy, Any, int, int]] = []  # (copy, entry, span offset, at)
        scratch_bytes = 0
        device = None
        entries = self.manifest.by_name()
        for c in copies:
            dst = buffers[c.dst]
            device = dst.device
            entry = _entry(entries, c, dst.dtype)
            itemsize = dst.element_size()
            s_off, d_off, run = pair_runs(c.src_box, entry.shape, c.dst_box, dst.shape, itemsize)
            if len(s_off) > 1 and run < self.covering_below:
                off, n = covering_span(c.src_box, entry.shape, itemsize)
                gathers.append((c, entry, off, scratch_bytes))
                scratch_bytes += -(-n // 256) * 256
                continue
            s, d, n = coalesce_runs(entry.addr + s_off, dst.data_ptr() + d_off,
                                    np.full(len(s_off), run, dtype=np.int64))
            local.append(np.stack([d, n, np.full(len(d), _dev(dst), dtype=np.int64)], 1))
            remote.append(np.stack([s, n, np.full(len(s), entry.device_index, dtype=np.int64)], 1))
        scratch = None
        if gathers:
            scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=device)
            for c, entry, off, at in gathers:
                n = covering_span(c.src_box, entry.shape, buffers[c.dst].element_size())[1]
                local.append(np.array([[scratch.data_ptr() + at, n, _dev(scratch)]],
                                      dtype=np.int64))
                remote.append(np.array([[entry.addr + off, n, entry.device_index]],
                                       dtype=np.int64))
        if not local:
            return ReadStats(0, 1e-9, 0, "none")
        local_descs = np.concatenate(local).astype(np.uint64)
        remote_descs = np.concatenate(remote).astype(np.uint64)
        register = {name: t for name, t in buffers.items()}
        if scratch is not None:
            register["#scratch"] = scratch
        self.manager.ensure_registered(register)
        peer = self.manager.add_peer(self.metadata)
        try:
            result = self.manager.read_runs(
                peer, local_descs, remote_descs,
                local_mem="DRAM" if device is None or device.type == "cpu" else "VRAM",
                remote_mem=self.manifest.tensors[0].mem if self.manifest.tensors else "DRAM",
                same_host=self.same_host, chunk_bytes=self.chunk_bytes, deadline_s=deadline_s,
                progress=lambda done, _total: progress(done), stop=stop,
                refuse_slow_transport=self.refuse, stall_s=self.stall_s)
        finally:
            self.manager.remove_peer(peer)
        for c, entry, off, at in gathers:
            dst = buffers[c.dst]
            _gather(scratch, at, off, entry.shape, c, dst)
        return ReadStats(bytes=result.bytes, seconds=result.seconds,
                         descriptors=result.descriptors, transport=result.transport,
                         connect_seconds=result.connect_seconds,
                         detail=(f"{result.transport_detail}; {len(gathers)} covering read(s) "
                                 f"({scratch_bytes} bytes) gathered here"))


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
    hashes a strided view in logical order, as the source hashed the checkpoint's block).
    """
    from modelexpress.transfer import digest as _digest

    if not checks:
        return []
    views = [box_view(buffers[c.where], c.box) for c in checks]
    got = _digest.digest_many(views, algorithm)
    return [c for c, value in zip(checks, got) if value != c.digest]


def finish(plan: LayoutPlan, buffers: Mapping[str, "torch.Tensor"]) -> None:
    """The scatters (after the checks) and the fills of ``plan``."""
    for s in plan.scatters:
        target = box_view(buffers[s.tensor], s.dst_box)
        target.copy_(box_view(buffers[s.src], s.src_box).reshape(target.shape))
    for f in plan.fills:
        box_view(buffers[f.tensor], f.dst).fill_(f.value)
