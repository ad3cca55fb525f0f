"""Storage as one more reader behind the piece interface: :class:`StorageReader`.

It fills destination tensors (laid out as the checkpoint's :class:`~.layout.CheckpointLayout`
says) from storage, in the layout's order, and reports the **watermark** as a relay does
(:mod:`modelexpress.p2p.relay`): a byte offset into the tensors' bytes laid end to end,
below which every byte has landed. So a loading origin serves each piece as soon as
storage gave it, to followers that read it exactly as they read a relay.

::

    ranges:  |r0|r1|r2|r3|r4|r5|r6| ...     (at most range_bytes; one file each; several
                                             small tensors that lie together share one)
    window:  at most `concurrency` ranges in flight, the oldest first
    landed:   x  x     x                     r0, r1, r3 landed
    mark:    ------|                         the prefix of landed ranges: r0 + r1

A wide window reads faster from a store that serves each connection slowly, but the
mark moves only when the oldest range lands: the window is what a follower may wait
for at worst, so ranges are small for a small model (:func:`range_bytes_for`) and the
window is ``MX_STORAGE_CONCURRENCY`` of them.

``have``: the bytes of the prefix the destination already holds (an origin that took
over from a dead one, with pieces its followers had): only the rest is read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Mapping

from modelexpress.errors import (ConfigError, ManifestMismatchError, TransferCancelledError,
                                 TransferTimeoutError)
from modelexpress.storage.base import Storage, StorageOptions
from modelexpress.storage.layout import CheckpointLayout

if TYPE_CHECKING:
    import torch

    from modelexpress.transfer import StopSignal, TransferResult

__all__ = ["StorageReader", "range_bytes_for", "read_checkpoint"]

log = logging.getLogger(__name__)

_MIN_RANGE = 256 << 10
_PER_MODEL = 128
_STILL_WAITING_EVERY_S = 10.0


def range_bytes_for(total_bytes: int, most: int) -> int:
    """Bytes per storage range for a model of ``total_bytes``: the largest power of two
    within ``total_bytes / 128``, at least 256 KiB, at most ``most`` (the rule of the
    relay's pieces, ``relay_plan.piece_bytes``, so one range is about one piece)."""
    share = _MIN_RANGE
    while share * 2 <= total_bytes / _PER_MODEL:
        share *= 2
    return max(min(most, share), 4096)


@dataclasses.dataclass(frozen=True)
class _Range:
    file: str
    offset: int          # in the file
    nbytes: int
    end: int             # global end offset (the watermark once it landed)
    segments: tuple[tuple[int, int, int], ...]  # (tensor index, offset in it, bytes)


def _ranges(layout: CheckpointLayout, have: int, range_bytes: int) -> list[_Range]:
    """The layout's bytes from ``have`` on, cut into ranges (see the module docstring)."""
    out: list[_Range] = []
    pos = 0
    cur: dict | None = None

    def close() -> None:
        nonlocal cur
        if cur is not None and cur["nbytes"]:
            out.append(_Range(cur["file"], cur["offset"], cur["nbytes"], cur["end"],
                              tuple(cur["segments"])))
        cur = None

    for i, t in enumerate(layout.tensors):
        start, end = pos, pos + t.nbytes
        pos = end
        if end <= have:
            continue
        at = max(have - start, 0)  # bytes of this tensor already held
        while at < t.nbytes:
            if cur is not None and (cur["file"] != t.file
                                    or cur["offset"] + cur["nbytes"] != t.offset + at
                                    or cur["nbytes"] >= range_bytes):
                close()
            if cur is None:
                cur = {"file": t.file, "offset": t.offset + at, "nbytes": 0, "end": start + at,
                       "segments": []}
            n = min(t.nbytes - at, range_bytes - cur["nbytes"])
            cur["segments"].append((i, at, n))
            cur["nbytes"] += n
            cur["end"] += n
            at += n
    close()
    return out


class StorageReader:
    """Reads a stored checkpoint into its destination tensors, advancing a watermark.

    Args:
        storage: where it is.
        layout: its tensors (:func:`~.layout.read_layout`).
        options: concurrency and the largest range.
        have: bytes of the prefix the destination already holds (not read again).
        publish: ``publish(mark)``, called whenever the landed prefix grows (an origin's
            :meth:`~modelexpress.p2p.relay.RelayServer.advance`).
        tensor_done: ``tensor_done(name)``, called in order for each tensor once all its
            bytes landed (an origin digests it for the lease).
    """

    def __init__(self, storage: Storage, layout: CheckpointLayout, options: StorageOptions, *,
                 have: int = 0, publish: Callable[[int], None] | None = None,
                 tensor_done: Callable[[str], None] | None = None) -> None:
        self.storage = storage
        self.layout = layout
        self.options = options
        self.have = have
        self.publish = publish
        self.tensor_done = tensor_done
        self.range_bytes = range_bytes_for(layout.total_bytes, options.range_bytes)
        self.bytes_read = 0

    def _views(self, dest: Mapping[str, "torch.Tensor"]) -> list[memoryview]:
        import torch

        views = []
        for t in self.layout.tensors:
            d = dest.get(t.name)
            if d is None:
                raise ManifestMismatchError(f"tensor {t.name!r} of {self.layout.url} has no "
                                            "destination")
            if d.device.type != "cpu" or not d.is_contiguous():
                raise ConfigError(f"the destination of {t.name!r} must be contiguous host "
                                  f"memory to be read from storage (got {d.device})")
            if d.numel() * d.element_size() != t.nbytes:
                raise ManifestMismatchError(
                    f"tensor {t.name!r}: the destination holds "
                    f"{d.numel() * d.element_size()} bytes, the checkpoint {t.nbytes}")
            views.append(memoryview(d.reshape(-1).view(torch.uint8).numpy()))
        return views

    def read_into(self, dest: Mapping[str, "torch.Tensor"], *, allow_partial: bool = False,
                  progress: Callable[[int, int], None] = lambda done, total: None,
                  stop: "StopSignal | None" = None,
                  deadline_s: float = 600.0) -> "TransferResult":
        """Read every byte from ``have`` on into ``dest`` (see the module docstring).

        Raises:
            StorageReadError: a range could not be read (the ranges in flight are waited
                for, bounded by ``MX_STORAGE_TIMEOUT_S``; what landed stays below the
                mark, nothing above it counts).
            TransferCancelledError: ``stop`` was set.
            TransferTimeoutError: ``deadline_s`` ran out.
            ManifestMismatchError: ``dest`` does not match the layout.
        """
        views = self._views(dest)
        total = self.layout.total_bytes
        ranges = _ranges(self.layout, self.have, self.range_bytes)
        ends = [0]
        for t in self.layout.tensors:
            ends.append(ends[-1] + t.nbytes)
        next_tensor = next((i for i, e in enumerate(ends[1:]) if e > self.have),
                           len(self.layout.tensors))
        local = threading.local()
        t0 = time.perf_counter()
        end_at = time.monotonic() + deadline_s

        def fetch(r: _Range) -> int:
            if len(r.segments) == 1:
                i, at, n = r.segments[0]
                self.storage.read(r.file, r.offset, views[i][at:at + n])
                return r.nbytes
            scratch = getattr(local, "buf", None)
            if scratch is None or len(scratch) < r.nbytes:
                scratch = local.buf = bytearray(max(r.nbytes, self.range_bytes))
            view = memoryview(scratch)[:r.nbytes]
            self.storage.read(r.file, r.offset, view)
            pos = 0
            for i, at, n in r.segments:
                views[i][at:at + n] = view[pos:pos + n]
                pos += n
            return r.nbytes

        mark = self.have
        done: set[int] = set()
        first = 0  # oldest range not yet in the prefix
        said = time.monotonic()
        pool = concurrent.futures.ThreadPoolExecutor(self.options.concurrency,
                                                     thread_name_prefix="mx-storage")
        inflight: dict[concurrent.futures.Future, int] = {}
        posted = 0
        try:
            while first < len(ranges):
                while posted < len(ranges) and len(inflight) < self.options.concurrency:
                    inflight[pool.submit(fetch, ranges[posted])] = posted
                    posted += 1
                now = time.monotonic()
                if stop is not None and (stop.is_set() if isinstance(stop, threading.Event)
                                         else stop()):
                    raise TransferCancelledError(
                        f"read of {self.layout.url} stopped on request after {mark} of "
                        f"{total} bytes")
                if now > end_at:
                    raise TransferTimeoutError(
                        f"read of {self.layout.url} did not finish within {deadline_s:g} s: "
                        f"{mark} of {total} bytes")
                finished, _ = concurrent.futures.wait(
                    list(inflight), timeout=min(0.5, max(end_at - now, 0.01)),
                    return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in finished:
                    k = inflight.pop(fut)
                    self.bytes_read += fut.result()  # StorageReadError: the read failed
                    done.add(k)
                moved = False
                while first < len(ranges) and first in done:
                    done.discard(first)
                    mark = ranges[first].end
                    first += 1
                    moved = True
                if moved:
                    if self.publish is not None:
                        self.publish(mark)  # ORDER: every byte below it landed
                    while next_tensor < len(self.layout.tensors) and ends[next_tensor + 1] <= mark:
                        if self.tensor_done is not None:
                            self.tensor_done(self.layout.tensors[next_tensor].name)
                        next_tensor += 1
                    progress(mark, total)
                elif time.monotonic() - said > _STILL_WAITING_EVERY_S:
                    said = time.monotonic()
                    log.info("storage: still reading %s: %d of %d bytes after %.0f s",
                             self.layout.url, mark, total, time.perf_counter() - t0)
        except BaseException:
            for fut in inflight:
                fut.cancel()
            raise
        finally:
            # Reads in flight write into ``dest``: wait for them (each bounded by the
            # storage's own timeout) before the caller may drop or reuse it.
            pool.shutdown(wait=True, cancel_futures=True)
        while next_tensor < len(self.layout.tensors):  # zero-byte tensors at the end
            if self.tensor_done is not None:
                self.tensor_done(self.layout.tensors[next_tensor].name)
            next_tensor += 1
        seconds = max(time.perf_counter() - t0, 1e-9)
        log.info("storage: read %d bytes of %s in %.3f s (%.3f GB/s; %d ranges of at most %d "
                 "bytes, %d at once)%s", self.bytes_read, self.layout.url, seconds,
                 self.bytes_read / seconds / 1e9, len(ranges), self.range_bytes,
                 self.options.concurrency,
                 f"; {self.have} bytes were held already" if self.have else "")
        return _result(self.bytes_read, seconds, len(ranges), len(self.layout.tensors),
                       self.layout.url)


def _result(nbytes: int, seconds: float, ranges: int, tensors: int,
            url: str) -> "TransferResult":
    from modelexpress.transfer import TransferResult
    from modelexpress.transfer.transport import TransportVerdict

    gbps = nbytes / seconds / 1e9
    verdict = TransportVerdict(ok=True, expected="storage", observed=(), gbps=gbps,
                               floor_gbps=0.0, message=f"read from {url}")
    return TransferResult(bytes=nbytes, seconds=seconds, gbps=gbps, descriptors=ranges,
                          chunks=ranges, tensors=tensors, transport="storage",
                          verdict=verdict, warnings=(), verified=False, verify_seconds=0.0,
                          peer=url, expected_transport="storage",
                          transport_detail=f"read from {url}")


def read_checkpoint(storage: Storage, options: StorageOptions | None = None
                    ) -> tuple[CheckpointLayout, dict[str, "torch.Tensor"]]:
    """Read a whole stored checkpoint into one host allocation (no peers involved).

    Returns:
        The layout and name -> tensor, in its order.

    Raises:
        As :func:`~.layout.read_layout` and :meth:`StorageReader.read_into`.
    """
    from modelexpress.checkpoint import allocate_slab
    from modelexpress.storage.layout import read_layout

    layout = read_layout(storage)
    dest = allocate_slab(layout.specs(), "cpu")
    StorageReader(storage, layout, options or StorageOptions()).read_into(dest)
    return layout, dest
