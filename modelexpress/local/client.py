"""The target side of the local transport: connect, map, copy, verify, unmap.

:func:`pull` is what a pull path calls for a source on the same host::

    connect + hello ──> (the manifest matched while the source answers)
        ──> segments + fds ──> map (HostMapping / CudaMapping)
        ──> plan: tensors in source order; a run contiguous on both sides is one copy;
            copies grouped into chunks of ~chunk_bytes
        ──> per chunk: stop? deadline? source alive? then enqueue the copies
            (cuMemcpyAsync on the destination's stream / on the host, pread from the
            memfds on a few threads: local.hostcopy); at most two chunks in flight on
            a GPU, progress after each completes
        ──> synchronize, verify digests (transfer.digest, as the NIXL path does; host
            to host: each tensor's digest as soon as it landed, alongside the copy)
        ──> bye, unmap, close (always, also on errors)

A source that dies mid-copy is seen at the next chunk boundary (the connection reads
end-of-file) and fails the pull with PeerError, so the caller tries its next source.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, Union

from modelexpress._closing import ClosedOnCollect
from modelexpress.errors import (
    ConfigError,
    IntegrityError,
    PeerError,
    TransferCancelledError,
    TransferTimeoutError,
)
from modelexpress.local import protocol
from modelexpress.local.protocol import LocalEndpoint, Segment

if TYPE_CHECKING:
    import torch

    from modelexpress.local.devices import DeviceInventory
    from modelexpress.transfer.manifest import Manifest

__all__ = ["Hello", "LocalPullResult", "LocalSession", "pull", "TRANSPORT"]

log = logging.getLogger(__name__)

TRANSPORT = "local"
DEFAULT_CHUNK_BYTES = 1 << 30
# Host copies are synchronous, and a chunk's last pieces (the hashing of its largest
# tensor: local.hostcopy) leave the other copy threads idle until it ends: on the
# 16-core GPU host 1 GiB pulled in 44-49 ms as one chunk, 64-69 ms as four of 256 MiB.
# A stop is seen between chunks: within 0.3 s of host copying on the 2-core CI machine.
_HOST_CHUNK_BYTES = 1 << 30
_IN_FLIGHT = 2                 # GPU chunks enqueued ahead (keeps the copy engine busy)


class _Event(Protocol):
    def is_set(self) -> bool: ...


StopFlag = Union[_Event, Callable[[], bool]]
"""A threading.Event-like flag or a callable (``transfer.StopSignal``)."""


@dataclasses.dataclass(frozen=True)
class LocalPullResult:
    """What a local pull did.

    Attributes:
        transport: always ``"local"`` (observed: these bytes moved by our own copies).
        nbytes: bytes copied.
        tensors: tensors received.
        copies: copy operations issued (after merging contiguous runs).
        segments: segments the source shared, by kind.
        seconds: the whole pull; ``phases`` splits it (warm-up of the GPU digest kernel,
            connect+map, plan, copy, verify, close).
        gbps: ``nbytes`` / copy phase (the data plane), GB/s.
        verified: tensors whose digest was checked.
        page_cache_bytes: bytes read from the source's checkpoint file's page cache
            (the rest of the host bytes from its memfds; :mod:`.origin`).
        page_cache_misses: reads of that file the page cache did not serve in full
            (pages evicted since the source's load). Nothing waits on the disk: the rest
            is read again without waiting, from the page cache where the kernel's
            readahead (which the miss itself starts) has brought it back by then, else
            from the memfds. Later pulls may then hit again.
        huge_pages: whether new host destination memory was advised ``MADV_HUGEPAGE``
            (the ``huge_pages`` argument of :func:`pull`; :mod:`.hugepages`).
    """

    transport: str
    nbytes: int
    tensors: int
    copies: int
    segments: dict[str, int]
    seconds: float
    gbps: float
    verified: int
    phases: dict[str, float]
    page_cache_bytes: int = 0
    page_cache_misses: int = 0
    huge_pages: bool = False


def _peer(endpoint: LocalEndpoint) -> str:
    return f"local source {endpoint.source_id} ({endpoint.path})"


def _say_hello(endpoint: LocalEndpoint, timeout_s: float, files: bool) -> socket.socket:
    """A socket connected to the source, the hello sent on it (closed on failure).

    Raises:
        PeerError: the source is not listening, or the connection failed.
        TransferTimeoutError: connecting took longer than ``timeout_s``.
    """
    peer = _peer(endpoint)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(endpoint.path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise PeerError(f"{peer} is not listening ({exc}); it exited or runs on "
                            "another node") from exc
        try:
            protocol.send(sock, {"op": "hello", "v": protocol.VERSION,
                                 "source_id": endpoint.source_id, "token": endpoint.token,
                                 "accepts": ["file"] if files else []})
        except (BrokenPipeError, ConnectionResetError):
            # A source that refuses at once (busy) may close before our hello; its
            # refusal is still queued on the socket.
            pass
    except BaseException as exc:
        sock.close()
        if isinstance(exc, TimeoutError):
            raise TransferTimeoutError(f"{peer} did not answer within {timeout_s:.0f} s") \
                from exc
        if isinstance(exc, OSError):
            raise PeerError(f"{peer}: {exc}") from exc
        raise
    return sock


class Hello:
    """The first half of a :class:`LocalSession`: connected to the source, hello sent.

    The source's answer (its segments and descriptors) is read by the session made
    with ``hello=``; a caller may do other work between the two while the source
    answers (:func:`pull` matches the manifest meanwhile). A connection that fails is
    not raised here but by :meth:`take`, so that the caller's own checks made in
    between report first.

    Args:
        endpoint: the source's :class:`LocalEndpoint`.
        timeout_s: bound on connecting and on each handshake message.
        files: ask for ``file`` segments (see :class:`LocalSession`).
    """

    def __init__(self, endpoint: LocalEndpoint, timeout_s: float = 10.0,
                 files: bool = True) -> None:
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._error: PeerError | TransferTimeoutError | None = None
        try:
            self._sock = _say_hello(endpoint, timeout_s, files)
        except (PeerError, TransferTimeoutError) as exc:
            self._error = exc

    def take(self) -> socket.socket:
        """The connected socket, now the caller's to close.

        Raises:
            PeerError: the source was not listening or refused the connection.
            MxTimeoutError: connecting took longer than ``timeout_s``.
            ValueError: taken already (or closed).
        """
        if self._error is not None:
            raise self._error
        sock, self._sock = self._sock, None
        if sock is None:
            raise ValueError("this hello was taken or closed already")
        return sock

    def close(self) -> None:
        """Close the connection if nobody took it. Idempotent."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class LocalSession(ClosedOnCollect):
    """One connection to a local source with its memory mapped here.

    Args:
        endpoint: the source's :class:`LocalEndpoint`.
        device: CUDA device of the destination (device segments are mapped for it);
            None when every destination is on the host.
        timeout_s: bound on connecting and on each handshake message.
        inventory: this process's GPUs (default: CUDA's); the source's device segments
            name GPUs by UUID and are mapped for this process's ordinal of each.
        files: ask for ``file`` segments (host bytes also readable from the source's
            checkpoint file's page cache, :mod:`.origin`); False: memfds only.
        hello: the connection made and the hello sent already (:class:`Hello`, made
            with the same ``endpoint``); its ``timeout_s`` and ``files`` apply, not
            these. The session takes it (and closes it on failure).

    Raises:
        PeerError: the source is unreachable, refused (e.g. wrong credential), or sent
            something malformed, or serves memory on a GPU this process does not see
            (``inventory``); nothing stays open.
        MxTimeoutError: the source did not answer within ``timeout_s``.
        ValueError: ``hello`` was taken by another session already.
    """

    def __init__(self, endpoint: LocalEndpoint, device: int | None = None,
                 timeout_s: float = 10.0, inventory: "DeviceInventory | None" = None,
                 files: bool = True, *, hello: "Hello | None" = None) -> None:
        self._closed = True
        self.endpoint = endpoint
        self.peer = _peer(endpoint)
        self.host_map: Any = None
        self.cuda_map: Any = None
        self.segments: list[Segment] = []
        if hello is None:
            hello = Hello(endpoint, timeout_s, files)
        sock = hello.take()
        received: list[int] = []
        try:
            msg, fds = self._recv(sock)
            protocol.close_fds(fds)
            if msg.get("op") == "refused":
                raise PeerError(f"{self.peer} refused the connection: {msg.get('reason')}")
            if msg.get("op") != "welcome" or msg.get("v") != protocol.VERSION:
                raise PeerError(f"{self.peer}: unexpected answer {msg!r}")
            pairs: list[tuple[Segment, int]] = []
            for _ in range(int(msg["batches"])):
                batch, fds = self._recv(sock)
                received.extend(fds)
                if batch.get("op") != "segments":
                    raise PeerError(f"{self.peer}: expected segments, got {batch.get('op')!r}")
                for item in batch["items"]:
                    seg, idx = Segment.from_item(item)
                    if idx >= len(fds):
                        raise PeerError(f"{self.peer}: segment names descriptor {idx}, "
                                        f"{len(fds)} arrived")
                    pairs.append((seg, fds[idx] if idx >= 0 else -1))
            if len(pairs) != int(msg["segments"]):
                raise PeerError(f"{self.peer}: announced {msg['segments']} segments, "
                                f"sent {len(pairs)}")
            dev_at = [i for i, (s, _) in enumerate(pairs) if s.kind not in protocol.HOST_KINDS]
            if dev_at:
                # GPUs by UUID: the source's ordinals mean nothing here (devices.py)
                from modelexpress.local.devices import CudaDevices, local_segments
                mine = local_segments([pairs[i][0] for i in dev_at], inventory or CudaDevices(),
                                      self.peer)
                for i, s in zip(dev_at, mine):
                    pairs[i] = (s, pairs[i][1])
            self.segments = [s for s, _ in pairs]
            self._map(pairs, device)
            received = []  # the mappings own (and have closed) them now
        except TimeoutError as exc:
            self._teardown(sock, received)
            raise TransferTimeoutError(f"{self.peer} did not answer within "
                                       f"{hello.timeout_s:.0f} s") from exc
        except OSError as exc:
            self._teardown(sock, received)
            raise PeerError(f"{self.peer}: {exc}") from exc
        except BaseException:
            self._teardown(sock, received)
            raise
        self._sock = sock
        self._closed = False

    def _recv(self, sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
        msg, fds = protocol.recv(sock, self.peer)
        if msg is None:
            raise PeerError(f"{self.peer} closed the connection during the handshake")
        return msg, fds

    def _map(self, pairs: Sequence[tuple[Segment, int]], device: int | None) -> None:
        from modelexpress.local.memory import HostMapping, group_segments
        host = [(s, fd) for s, fd in pairs if s.kind == "memfd"]
        files = [(s, fd) for s, fd in pairs if s.kind == "file"]
        dev = [(s, fd) for s, fd in pairs if s.kind not in protocol.HOST_KINDS]
        if host or files:
            # ORDER: a mapping closes the fds it was given, also when it fails; the
            # caller's list is cleared only after both mappings exist.
            self.host_map = HostMapping([s for s, _ in host], [fd for _, fd in host], files)
        if dev:
            if device is None:
                device = dev[0][0].device
            from modelexpress.local.cuda import CudaMapping
            segs = [s for s, _ in dev]
            groups = [[dev[i] for i in g] for g in group_segments(segs)]
            self.cuda_map = CudaMapping(groups, device)

    @staticmethod
    def _teardown(sock: socket.socket, fds: Sequence[int]) -> None:
        protocol.close_fds(fds)
        sock.close()

    def local_addr(self, src_addr: int, nbytes: int, host: bool) -> int:
        """Where the source's ``[src_addr, +nbytes)`` is mapped in this process."""
        return self._mapping(src_addr, nbytes, host).local_addr(src_addr, nbytes)

    def host_segment(self, src_addr: int, nbytes: int) -> tuple[int, int]:
        """``(segment, offset)`` of the source's host ``[src_addr, +nbytes)`` (for
        ``HostMapping.read_into``)."""
        return self._mapping(src_addr, nbytes, True).locate(src_addr, nbytes)

    def _mapping(self, src_addr: int, nbytes: int, host: bool) -> Any:
        mapping = self.host_map if host else self.cuda_map
        if mapping is None:
            raise PeerError(f"{self.peer} shared no {'host' if host else 'device'} memory, "
                            f"but the manifest places 0x{src_addr:x}+{nbytes} there")
        return mapping

    def alive(self) -> bool:
        """False once the source went away (end-of-file) or announced it is closing."""
        if self._closed:
            return False
        p = select.poll()
        p.register(self._sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        if not p.poll(0):
            return True
        try:
            data = self._sock.recv(protocol.MAX_MESSAGE_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False if not data else b'"closing"' not in data

    def close(self) -> None:
        """Say bye, unmap everything, close the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            protocol.send(self._sock, {"op": "bye"})
        except OSError:
            pass
        try:
            for m in (self.cuda_map, self.host_map):
                if m is not None:
                    m.close()
        finally:
            self._sock.close()


@dataclasses.dataclass
class _Copy:
    src: int        # local address of the mapped source bytes; host: offset in its memfd
    dst: int
    nbytes: int
    host: bool      # host -> host (pread from the memfd), else cuMemcpyAsync
    dst_device: int  # -1: host
    key: tuple[int, int] = (0, 0)  # (source segment, destination allocation): merge within


class _DstAllocations:
    """The destination allocation of each device tensor (cuMemGetAddressRange, cached;
    a sorted list searched by bisection: a 483-tensor rank set scanned linearly cost
    more than its copies on one GPU)."""

    def __init__(self) -> None:
        self._bases: list[int] = []
        self._ends: list[int] = []

        self._key: dict[int, int] = {}

    def key(self, ptr: int) -> int:
        """The allocation's base for cudaMalloc memory; one shared key (-2) for all VMM
        memory, so adjacent VMM chunks (an arena) merge."""
        import bisect
        k = bisect.bisect_right(self._bases, ptr) - 1
        if k >= 0 and ptr < self._ends[k]:
            return self._key[self._bases[k]]
        from modelexpress.local.cuda import allocation_range, is_vmm
        base, size = allocation_range(ptr)
        k = bisect.bisect_left(self._bases, base)
        self._bases.insert(k, base)
        self._ends.insert(k, base + size)
        self._key[base] = -2 if is_vmm(base) else base
        return self._key[base]


def _plan(session: LocalSession, pairs: Sequence[Any], dst: Mapping[str, "torch.Tensor"],
          chunk_bytes: int) -> list[list[_Copy]]:
    """Copies merged over runs contiguous on both sides, then split into chunks.

    A device copy is merged only within one source group and one destination
    allocation: cuMemcpy refuses a range that spans two cudaMalloc allocations, even
    adjacent ones (seen on an H200 host: CUDA_ERROR_INVALID_VALUE). VMM chunks mapped
    side by side (a source arena imported into one range; a destination arena) merge.
    Host-to-host runs merge within one source memfd (one ``pread`` reads one file).
    """
    runs: list[_Copy] = []
    allocs = _DstAllocations()
    for p in sorted(pairs, key=lambda p: p.remote.addr):
        n = p.remote.nbytes
        if n == 0:
            continue
        t = dst[p.name]
        src_host = p.remote.device == "cpu"
        dst_dev = -1 if t.device.type == "cpu" else (t.device.index or 0)
        host = src_host and dst_dev < 0
        if host:
            segment, src = session.host_segment(p.remote.addr, n)
            key = (segment, -1)
        else:
            src = session.local_addr(p.remote.addr, n, host=src_host)
            src_key = -1 if src_host else session.cuda_map.group_of(p.remote.addr)
            dst_key = t.data_ptr() if dst_dev < 0 else allocs.key(t.data_ptr())
            key = (src_key, dst_key)
        c = _Copy(src, t.data_ptr(), n, host, dst_dev, key)
        last = runs[-1] if runs else None
        if (last is not None and last.host == c.host and last.dst_device == c.dst_device
                and last.key == c.key
                and last.src + last.nbytes == c.src and last.dst + last.nbytes == c.dst):
            last.nbytes += n
        else:
            runs.append(c)
    chunks: list[list[_Copy]] = [[]]
    filled = 0
    for r in runs:
        limit = min(chunk_bytes, _HOST_CHUNK_BYTES) if r.host else chunk_bytes
        off = 0
        while off < r.nbytes:
            if filled >= limit:
                chunks.append([])
                filled = 0
            n = min(r.nbytes - off, limit - filled)
            chunks[-1].append(_Copy(r.src + off, r.dst + off, n, r.host, r.dst_device, r.key))
            off += n
            filled += n
    return [c for c in chunks if c]


def pull(endpoint: LocalEndpoint, manifest: "Manifest", tensors: Mapping[str, "torch.Tensor"], *,
         verify: bool = True, stop: StopFlag | None = None, deadline_s: float = 600.0,
         progress: Callable[[int, int], None] | None = None,
         chunk_bytes: int = DEFAULT_CHUNK_BYTES, connect_timeout_s: float = 10.0,
         allow_partial: bool = False, inventory: "DeviceInventory | None" = None,
         huge_pages: str = "auto") -> LocalPullResult:
    """Copy a same-host source's tensors into ``tensors`` over the local transport.

    Args:
        endpoint: the source's endpoint (published with its manifest).
        manifest: the source's manifest (names, shapes, addresses, digests).
        tensors: name -> destination tensor (contiguous; CPU or one CUDA device).
        verify: check each received tensor's digest against the manifest.
        stop: checked between chunks; set -> TransferCancelledError.
        deadline_s: the whole pull's bound.
        progress: ``progress(bytes_done, bytes_total)`` after each chunk.
        chunk_bytes: bytes between checks of stop, deadline and the source's liveness.
        connect_timeout_s: bound on connecting and the handshake.
        allow_partial: tensors on one side only are skipped instead of failing.
        inventory: this process's GPUs (see :class:`LocalSession`).
        huge_pages: ``auto``, ``on`` or ``off``: whether new host destination memory
            may be faulted in as transparent huge pages (``MX_LOCAL_HUGE_PAGES``;
            :mod:`modelexpress.local.hugepages`).

    Returns:
        A :class:`LocalPullResult`.

    Raises:
        ManifestMismatchError: names/dtypes/shapes differ (before anything is mapped).
        PeerError: refused, unreachable, or the source went away mid-copy.
        TransferTimeoutError: ``deadline_s`` ran out.
        TransferCancelledError: ``stop`` was set.
        IntegrityError: a digest did not match (names the tensor).
        ConfigError: destinations on several CUDA devices, a bad chunk size or
            huge-pages mode.
    """
    from modelexpress.local.hugepages import MODES, HugePages
    from modelexpress.transfer.planner import match
    if chunk_bytes <= 0:
        raise ConfigError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    if huge_pages not in MODES:
        raise ConfigError(f"huge_pages must be one of {', '.join(MODES)}, got {huge_pages!r}")
    huge = HugePages(huge_pages)
    t0 = time.monotonic()
    deadline = t0 + deadline_s
    # ORDER: the hello goes out first, and the manifest is matched while the source
    # answers (a 70 MB pull's connect+map on the 16-core host: 0.52 ms, 0.98 with the
    # match first). A mismatch still reports before a failed connect: Hello keeps that
    # error for take().
    hello = Hello(endpoint, timeout_s=max(0.1, min(connect_timeout_s, deadline_s)))
    t_hello = time.monotonic()
    try:
        pairs = match(manifest, tensors, allow_partial=allow_partial)
        devices = {t.device.index or 0 for t in (tensors[p.name] for p in pairs)
                   if t.device.type == "cuda"}
        if len(devices) > 1:
            raise ConfigError(f"local pull destinations are on several CUDA devices "
                              f"{sorted(devices)}; pull each device's tensors separately")
    except BaseException:
        hello.close()
        raise
    device = devices.pop() if devices else None
    from modelexpress.transfer.digest import pause_builds, resume_builds, warm_up
    # ORDER: paused first: a Triton build that warm_up starts (where the driver refuses
    # the shipped kernel) must not import Triton beside the connect and the copies
    pause_builds()  # no kernel build step beside the copies (GIL: transfer.digest)
    t_warm = time.monotonic()
    try:
        if verify and device is not None:  # the GPU digest kernel, ready before the copies end
            warm_up(manifest.digest_algorithm, [f"cuda:{device}"])
        t_conn = time.monotonic()
        phases: dict[str, float] = {"warm-up": t_conn - t_warm}
        session = LocalSession(endpoint, device=device, inventory=inventory, hello=hello)
    except BaseException:
        hello.close()
        resume_builds()
        raise
    t_map = time.monotonic()
    phases["connect+map"] = t_hello - t0 + t_map - t_conn  # not the match in between
    total = sum(p.remote.nbytes for p in pairs)
    n_copies = page_cache_bytes = page_cache_misses = 0
    try:
        # A GPU destination copies on its own stream; a host destination of device
        # memory (device -> host) on the stream of the device that memory is mapped for.
        stream_device = device if device is not None else (
            session.cuda_map.device if session.cuda_map is not None else None)
        with contextlib.ExitStack() as ctx:
            if stream_device is not None:
                from modelexpress.local.cuda import on_device
                ctx.enter_context(on_device(stream_device))
            host_map = session.host_map
            for attempt in (1, 2):
                t_start = time.monotonic()
                from_files = host_map.file_bytes if host_map is not None else 0
                missed = host_map.file_misses if host_map is not None else 0
                chunks = _plan(session, pairs, tensors, chunk_bytes)
                n_copies = sum(len(c) for c in chunks)
                digests = _digests_alongside(manifest, pairs, tensors, chunks, session.peer,
                                             verify)
                if digests is not None:
                    ctx.callback(digests.close)
                t_plan = time.monotonic()
                phases["plan"] = phases.get("plan", 0.0) + t_plan - t_start
                _Runner(session, total, progress, stream_device, digests, huge).run(
                    chunks, stop, deadline, deadline_s)
                t_copy = time.monotonic()
                phases["copy"] = phases.get("copy", 0.0) + t_copy - t_plan
                if host_map is not None:
                    page_cache_bytes = host_map.file_bytes - from_files
                    page_cache_misses = host_map.file_misses - missed
                try:
                    if digests is not None:  # the tail: digests of the last tensors to land
                        verified = digests.finish()
                    else:
                        verified = _verify(manifest, pairs, tensors, session.peer) if verify else 0
                except IntegrityError as exc:
                    if attempt == 2 or not page_cache_bytes:
                        raise
                    # The memfds are the reference; the file only a faster copy of them
                    # while it is unchanged (local/origin.py). Nothing landed is kept.
                    log.warning("local pull from %s: %s, after %d bytes read from the "
                                "source's checkpoint file (changed on disk since its load?): "
                                "copying everything again from its memfds", session.peer, exc,
                                page_cache_bytes)
                    host_map.files_on = False
                    continue
                finally:
                    phases["verify"] = phases.get("verify", 0.0) + time.monotonic() - t_copy
                break
    finally:
        t_close = time.monotonic()
        session.close()
        phases["close"] = time.monotonic() - t_close
        resume_builds()
    kinds: dict[str, int] = {}
    for s in session.segments:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    seconds = time.monotonic() - t0
    gbps = total / phases["copy"] / 1e9 if phases.get("copy") else 0.0
    # ORDER: the parenthesis first, as bench/vllm_engine.py's _LOCAL_READ_RE reads it.
    log.info("local pull from %s: %d bytes, %d tensors, %d copies in %.3f s (connect+map "
             "%.3f s, copy %.3f s at %.1f GB/s, digests %.3f s); %d bytes from the page cache "
             "of the source's checkpoint file (%d reads found pages evicted); new memory in "
             "%s pages", session.peer, total, len(pairs), n_copies, seconds,
             phases.get("connect+map", 0.0), phases.get("copy", 0.0), gbps,
             phases.get("verify", 0.0), page_cache_bytes, page_cache_misses,
             "huge" if huge.used else "small")
    return LocalPullResult(transport=TRANSPORT, nbytes=total, tensors=len(pairs), copies=n_copies,
                           segments=kinds, seconds=seconds, gbps=gbps, verified=verified,
                           phases=phases, page_cache_bytes=page_cache_bytes,
                           page_cache_misses=page_cache_misses, huge_pages=huge.used)


_COPY_STREAMS = 4  # side streams device copies are spread over


class _Runner:
    """Runs the chunks: checks, enqueues, retires; ``done`` counts completed bytes."""

    def __init__(self, session: LocalSession, total: int, progress: Callable[[int, int], None] | None,
                 device: int | None, digests: Any = None, huge_pages: Any = None) -> None:
        import torch
        self.session, self.total, self.progress = session, total, progress
        self.digests = digests  # hostcopy.DigestsAlongside, told what landed
        self.huge_pages = huge_pages  # hugepages.HugePages of the pull, or None
        self.copier: Any = None  # hostcopy.HostCopier, made at the first host copy
        self.stream = torch.cuda.current_stream(device) if device is not None else None
        # Device copies go round-robin over a few side streams, so that one copy's launch
        # and DMA setup overlap the previous copy (a rank of many separate allocations
        # is hundreds of copies); each chunk ends with the main stream waiting on them.
        self.side: list[Any] = []
        if self.stream is not None:
            self.side = [torch.cuda.Stream(device) for _ in range(_COPY_STREAMS)]
            for side in self.side:
                side.wait_stream(self.stream)  # after whatever the caller enqueued
        self.in_flight: list[tuple[Any, int]] = []   # (event, bytes), oldest first
        self.done = 0

    def _advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.digests is not None:
            self.digests.landed(self.done)
        if self.progress is not None:
            self.progress(self.done, self.total)

    def retire(self, keep: int) -> None:
        while len(self.in_flight) > keep:
            event, n = self.in_flight.pop(0)
            event.synchronize()
            self._advance(n)

    def run(self, chunks: Sequence[Sequence[_Copy]], stop: StopFlag | None, deadline: float,
            deadline_s: float) -> None:
        try:
            for chunk in chunks:
                self._check(stop, deadline, deadline_s)
                self._chunk(chunk)
            self.retire(0)
        except BaseException:
            if self.digests is not None:
                self.digests.close()  # nothing more to check: drop what has not started
            # ORDER: copies already enqueued read the mappings the caller unmaps next.
            for stream in self.side:
                stream.synchronize()
            if self.stream is not None:
                self.stream.synchronize()
            raise
        finally:
            if self.copier is not None:
                self.copier.close()

    def _check(self, stop: StopFlag | None, deadline: float, deadline_s: float) -> None:
        # ORDER: checked before enqueuing, so nothing is copied from a source that went away.
        peer, done, total = self.session.peer, self.done, self.total
        if stop is not None and (stop.is_set() if hasattr(stop, "is_set") else stop()):
            raise TransferCancelledError(f"local pull from {peer} stopped after "
                                         f"{done} of {total} bytes")
        if time.monotonic() > deadline:
            raise TransferTimeoutError(f"local pull from {peer} ran past its {deadline_s:.0f} s "
                                       f"deadline after {done} of {total} bytes")
        if not self.session.alive():
            raise PeerError(f"{peer} went away after {done} of {total} bytes; try another source")

    def _chunk(self, chunk: Sequence[_Copy]) -> None:
        import torch
        host_bytes = dev_bytes = n_dev = 0
        host = [(c.key[0], c.src, c.dst, c.nbytes) for c in chunk if c.host]
        if host:
            if self.copier is None:
                from modelexpress.local.hostcopy import HostCopier
                self.copier = HostCopier(self.session.host_map, huge_pages=self.huge_pages)
            in_pass = self.digests if self.digests is not None and self.digests.hot else None
            self.copier.copy(host, in_pass)
            host_bytes = sum(h[3] for h in host)
        for c in (c for c in chunk if not c.host):
            from modelexpress.local.cuda import memcpy_async
            assert self.stream is not None, "a device copy needs a stream"
            side = self.side[n_dev % len(self.side)]
            memcpy_async(c.dst, c.src, c.nbytes, side.cuda_stream)
            dev_bytes += c.nbytes
            n_dev += 1
        if host_bytes:
            self._advance(host_bytes)
        if dev_bytes:
            for side in self.side[:n_dev]:
                self.stream.wait_stream(side)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self.in_flight.append((ev, dev_bytes))
            self.retire(_IN_FLIGHT - 1)


def _digests_alongside(manifest: "Manifest", pairs: Sequence[Any],
                       tensors: Mapping[str, "torch.Tensor"], chunks: Sequence[Sequence[_Copy]],
                       peer: str, verify: bool) -> Any:
    """When every copy is host to host, the CPU digests run with the copy
    (``hostcopy.digests_for``: in the copy's own pass, or beside it); None otherwise
    (digests after the copy)."""
    if not verify or manifest.digest_algorithm is None or not all(
            c.host for chunk in chunks for c in chunk):
        return None
    from modelexpress.local.hostcopy import digests_for
    order = sorted(pairs, key=lambda p: p.remote.addr)  # _plan's order: bytes land in it
    return digests_for(manifest.digest_algorithm, order, tensors, peer)


def _verify(manifest: "Manifest", pairs: Sequence[Any], tensors: Mapping[str, "torch.Tensor"],
            peer: str) -> int:
    from modelexpress.transfer.digest import digest_many
    algo = manifest.digest_algorithm
    todo = [p for p in pairs if p.remote.digest is not None]
    if algo is None or not todo:
        return 0
    got = digest_many([tensors[p.name] for p in todo], algo)
    bad = [(p.name, p.remote.digest, g) for p, g in zip(todo, got) if g != p.remote.digest]
    if bad:
        name, want, have = bad[0]
        raise IntegrityError(f"{len(bad)} tensor(s) from {peer} failed its {algo} digest "
                             f"check, e.g. {name!r}: expected {want}, got {have}; the source's "
                             "memory changed or a copy failed: try another source")
    return len(todo)


def fd_count(pid: int | None = None) -> int:
    """Open descriptors of a process (``/proc/PID/fd``), for tests and diagnostics."""
    return len(os.listdir(f"/proc/{pid or os.getpid()}/fd"))
