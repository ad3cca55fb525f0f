"""LocalSource: a source's memory served to peers on the same host over a Unix socket.

The source side of the local transport (protocol in :mod:`.protocol`). A publisher
registers what it serves (host buffers, a VMM arena, CUDA tensors), starts the
source, and publishes :attr:`LocalSource.endpoint` (socket path + credential) with
its manifest. Each peer connection is served by one thread::

    accept ─> hello? ──(bad version / id / token, or max_peers)──> refused, close
                │ ok
                v
             welcome, segments (+ fds: memfd dups by the kernel, VMM fds exported for
                │       this peer and closed here as soon as they are sent)
                v
             hold: wait for bye / end-of-file (max_hold_s) ──> close the connection
                │
             close() of the source: "closing" to every peer, then close

A refused peer gets no descriptor and no address. Descriptors the source opened for
a peer never outlive the ``send``; the kernel keeps the in-flight copies alive.
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from modelexpress._closing import ClosedOnCollect
from modelexpress.errors import ConfigError, PeerError
from modelexpress.local import protocol
from modelexpress.local.origin import refill_page_cache
from modelexpress.local.protocol import LocalEndpoint, Segment

if TYPE_CHECKING:
    import torch

    from modelexpress.local.devices import DeviceInventory

    from modelexpress.local.memory import HostBuffer
    from modelexpress.vmm.arena import VmmArena

__all__ = ["LocalSource"]

log = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.2     # how often the accept and hold loops look at the closed flag
_JOIN_S = 10.0           # close() waits this long for peer threads


class _Shared:
    """A registered segment and how to get a descriptor for one peer."""

    __slots__ = ("segment", "fd", "owns_fd", "origin")

    def __init__(self, segment: Segment, fd: int = -1, owns_fd: bool = False,
                 origin: Any = None) -> None:
        self.segment, self.fd, self.owns_fd = segment, fd, owns_fd
        self.origin = origin  # a file segment's local.origin.FileOrigin


class LocalSource(ClosedOnCollect):
    """Serve registered memory to same-host peers as descriptors over a Unix socket.

    Args:
        ipc_dir: the directory processes of one node share (``MX_IPC_DIR``); created
            if missing.
        host_id: :func:`~modelexpress.local.hostid.host_id` of this process.
        source_id: names the socket; default random (16 hex digits).
        token: the credential peers must present; default random (256 bits).
        max_peers: connections served at once; more are refused ("busy").
        handshake_timeout_s: a peer must send its hello within this.
        max_hold_s: a peer may keep its mapping this long, then it is disconnected.
        inventory: this process's GPUs (:class:`~modelexpress.local.devices.DeviceInventory`;
            default :class:`~modelexpress.local.devices.CudaDevices`): device segments
            are published under their GPU's UUID, which peers map to their own ordinal.

    Raises:
        ConfigError: bad arguments, or the socket path is too long.
    """

    def __init__(self, ipc_dir: str, *, host_id: str, source_id: str | None = None,
                 token: str | None = None, max_peers: int = 64,
                 handshake_timeout_s: float = 10.0, max_hold_s: float = 3600.0,
                 inventory: "DeviceInventory | None" = None) -> None:
        self._closed = True
        if max_peers < 1 or handshake_timeout_s <= 0 or max_hold_s <= 0:
            raise ConfigError("max_peers >= 1 and positive timeouts are required, got "
                              f"max_peers={max_peers} handshake_timeout_s={handshake_timeout_s} "
                              f"max_hold_s={max_hold_s}")
        self.source_id = source_id or secrets.token_hex(8)
        self.ipc_dir = ipc_dir
        self.path = protocol.socket_path(ipc_dir, self.source_id)
        self._token = token or secrets.token_hex(32)
        self.host_id = host_id
        self.max_peers = max_peers
        self.handshake_timeout_s = handshake_timeout_s
        self.max_hold_s = max_hold_s
        self._inventory = inventory
        self._shared: list[_Shared] = []
        self._lock = threading.Lock()
        self._peers: dict[int, socket.socket] = {}
        self._threads: list[threading.Thread] = []  # peer threads (_peer_thread)
        self._handoff: "queue.SimpleQueue[socket.socket | None]" = queue.SimpleQueue()
        self._idle = 0  # peer threads waiting on _handoff (under _lock)
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._refill: threading.Thread | None = None  # reads back an evicted page cache
        self.counters = dict.fromkeys(("connections", "refused", "served", "failed"), 0)
        self._closed = False

    # ------------------------------------------------------------ registration

    @property
    def endpoint(self) -> LocalEndpoint:
        """What a peer needs (the credential included): publish it with the manifest."""
        gpus = tuple(dict.fromkeys(s.gpu for s in self.segments if s.gpu))
        return LocalEndpoint(host_id=self.host_id, path=self.path, source_id=self.source_id,
                             token=self._token, gpus=gpus)

    @property
    def token(self) -> str:
        """The credential peers must present."""
        return self._token

    def add_host_buffer(self, buf: "HostBuffer") -> None:
        """Serve a :class:`~modelexpress.local.memory.HostBuffer` (it must stay open),
        and the runs of it loaded from checkpoint files as those files' page cache
        (``buf.file_extents``; :mod:`.origin`)."""
        self._add(_Shared(Segment("memfd", buf.addr, buf.nbytes, -1), buf.fd, owns_fd=False))
        for ext in buf.file_extents:
            self._add(_Shared(Segment("file", buf.addr + ext.buf_offset, ext.nbytes, -1,
                                      offset=ext.file_offset),
                              ext.origin.fd, owns_fd=False, origin=ext.origin))

    def add_vmm_arena(self, arena: "VmmArena") -> int:
        """Serve every live chunk of a VMM arena (host or CUDA backend).

        Host chunks are memfds (a duplicate descriptor is kept); CUDA chunks are
        exported per peer as POSIX fds, so the arena's backend must have been created
        with ``handle_type="posix_fd"`` (``maybe_enter_vmm_arena`` does where the device
        supports it).

        Returns:
            The number of chunks registered.

        Raises:
            ConfigError: the arena's backend cannot export chunks.
            BackendError: an export failed.
        """
        chunks = arena.live_allocations()
        if arena.backend.kind == "host":
            for va, size, fd in arena.export_chunks():
                self._add(_Shared(Segment("memfd", va, size, -1), fd, owns_fd=True))
        elif arena.backend.kind == "cuda":
            from modelexpress.local.cuda import describe_allocations
            for exp in describe_allocations((va, size, arena.device) for va, size in chunks):
                self._add(_Shared(self._device_segment(exp)))
        else:
            raise ConfigError(f"a {arena.backend.kind!r} arena has no memory to share")
        return len(chunks)

    def add_tensors(self, tensors: Mapping[str, "torch.Tensor"] | Iterable["torch.Tensor"]) -> None:
        """Serve the memory of CUDA tensors not yet covered (CUDA IPC or VMM chunk exports).

        CPU tensors must already lie in a registered host buffer or host arena.

        Raises:
            ConfigError: a CPU tensor outside every registered host segment.
            BackendError: a CUDA allocation cannot be shared.
        """
        values = list(tensors.values()) if isinstance(tensors, Mapping) else list(tensors)
        cuda_ranges = []
        for t in values:
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                continue
            addr = t.data_ptr()
            if self._covered(addr, nbytes, -1 if t.device.type == "cpu" else t.device.index or 0):
                continue
            if t.device.type == "cpu":
                raise ConfigError(
                    f"a CPU tensor ({tuple(t.shape)}, {t.dtype}, {nbytes} bytes) is not in "
                    "shared memory: load it into a HostBuffer (host_buffer_like) first")
            cuda_ranges.append((addr, nbytes, t.device.index or 0))
        if cuda_ranges:
            from modelexpress.local.cuda import describe_allocations
            for exp in describe_allocations(cuda_ranges):
                if not self._covered(exp.addr, exp.size, exp.device):
                    self._add(_Shared(self._device_segment(exp)))

    def _device_segment(self, exp: Any) -> Segment:
        """A device allocation as published: named by its GPU's UUID (module devices)."""
        from modelexpress.local.devices import CudaDevices, uuid_of
        if self._inventory is None:
            self._inventory = CudaDevices()
        gpu = uuid_of(self._inventory, exp.device)
        if not gpu:
            raise ConfigError(f"{exp} is on cuda:{exp.device}, which has no UUID in this "
                              f"process's device list {list(self._inventory.uuids())}")
        return Segment(exp.kind, exp.addr, exp.size, exp.device, exp.ipc, gpu=gpu)

    def uncovered(self, ranges: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """The ``(addr, nbytes, device)`` ranges (device -1: host) no segment holds."""
        return [r for r in ranges if r[1] and not self._covered(*r)]

    def _covered(self, addr: int, nbytes: int, device: int) -> bool:
        with self._lock:
            return any(s.segment.device == device and s.segment.addr <= addr
                       and addr + nbytes <= s.segment.end for s in self._shared)

    def _add(self, shared: _Shared) -> None:
        if self._closed:
            raise ConfigError("LocalSource: registration after close()")
        with self._lock:
            self._shared.append(shared)

    @property
    def segments(self) -> list[Segment]:
        with self._lock:
            return [s.segment for s in self._shared]

    # ------------------------------------------------------------ serving

    def start(self) -> LocalEndpoint:
        """Listen on the socket and serve peers on background threads.

        Returns:
            :attr:`endpoint`.

        Raises:
            ConfigError: the socket cannot be created (the message names the path).
        """
        if self._listener is not None:
            return self.endpoint
        os.makedirs(self.ipc_dir, exist_ok=True)
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # a stale socket of a dead source with our random id
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(self.path)
            # The credential, not the file mode, is the access control: peers in other
            # pods may run under other uids.
            os.chmod(self.path, 0o666)
            sock.listen(self.max_peers)
            sock.settimeout(_ACCEPT_POLL_S)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"LocalSource cannot listen on {self.path}: {exc}; check "
                              "MX_IPC_DIR exists and is writable") from exc
        self._listener = sock
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"mx-local-{self.source_id}")
        self._accept_thread.start()
        self._spawn_peer_thread()  # ready before the first peer connects
        log.info("local source %s serving %d segments (%d bytes; %s) on %s", self.source_id,
                 len(self._shared), sum(s.segment.size for s in self._shared if s.origin is None),
                 ", ".join(dict.fromkeys(s.segment.where for s in self._shared)) or "nothing",
                 self.path)
        return self.endpoint

    @property
    def active_peers(self) -> int:
        with self._lock:
            return len(self._peers)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.warning("local source %s: accept failed", self.source_id, exc_info=True)
                time.sleep(_ACCEPT_POLL_S)
                continue
            with self._lock:
                self.counters["connections"] += 1
                busy = len(self._peers) >= self.max_peers
                if not busy:
                    self._peers[conn.fileno()] = conn
            if busy:
                # On a thread: the refusal first reads the peer's hello (bounded), since
                # closing a Unix socket with an unread message resets the peer, which
                # then loses the refusal and sees only ECONNRESET.
                threading.Thread(target=self._refuse_after_hello, daemon=True,
                                 args=(conn, f"busy: {self.max_peers} peers already connected"),
                                 name=f"mx-local-busy-{self.source_id}").start()
                continue
            with self._lock:
                spare = self._idle > 0
                self._idle -= spare
            if not spare:
                self._spawn_peer_thread(idle=False)
            self._handoff.put(conn)

    def _spawn_peer_thread(self, idle: bool = True) -> None:
        """One more peer thread; ``idle``: counted as waiting for a connection at once
        (else the caller hands it the connection it is starting for)."""
        t = threading.Thread(target=self._peer_thread, daemon=True,
                             name=f"mx-local-peer-{self.source_id}")
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            self._idle += idle
        t.start()

    def _peer_thread(self) -> None:
        """Serves one peer after another: a thread that finished a peer waits for the
        next, so a connection's handshake does not wait for a thread to start (~0.4 ms
        on the CI machine, most of a local pull's connect; bench/local.py --host)."""
        while True:
            conn = self._handoff.get()
            if conn is None or self._stop.is_set():
                return
            self._serve_peer(conn, then_idle=True)

    def _refuse_after_hello(self, conn: socket.socket, reason: str) -> None:
        try:
            conn.settimeout(min(1.0, self.handshake_timeout_s))
            _, fds = protocol.recv(conn, "peer")
            protocol.close_fds(fds)
        except (OSError, PeerError):
            pass
        self._refuse(conn, reason)

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        with self._lock:
            self.counters["refused"] += 1
        try:
            conn.settimeout(1.0)
            protocol.send(conn, {"op": "refused", "reason": reason})
        except OSError:
            pass
        finally:
            conn.close()

    def _serve_peer(self, conn: socket.socket, then_idle: bool = False) -> None:
        """One peer's handshake and hold; ``then_idle``: the calling peer thread counts
        as idle again in the same step that frees the peer's slot, so a peer that
        connects right after this one left finds it (not a new thread)."""
        key = conn.fileno()
        peer = _peer_name(conn)
        handed = False
        try:
            conn.settimeout(self.handshake_timeout_s)
            msg, fds = protocol.recv(conn, peer)
            protocol.close_fds(fds)  # a hello carries none; never keep a peer's fds
            reason = self._check_hello(msg)
            if reason:
                log.warning("local source %s refused %s: %s", self.source_id, peer, reason)
                with self._lock:
                    self._peers.pop(key, None)
                handed = True
                self._refuse(conn, reason)
                return
            accepts = msg.get("accepts") if msg is not None else None
            sent = self._send_segments(conn, isinstance(accepts, list) and "file" in accepts)
            with self._lock:
                self.counters["served"] += 1
            log.info("local source %s: %s mapped %d segments", self.source_id, peer, sent)
            self._hold(conn, peer)
            self._refill_page_cache()
        except (OSError, PeerError, ValueError) as exc:
            with self._lock:
                self.counters["failed"] += 1
            log.warning("local source %s: %s: %s", self.source_id, peer, exc)
        finally:
            # ORDER: the slot is freed before the socket closes: a connection accepted
            # after the close may get the same descriptor number, the key of its slot
            # (a refused peer's slot was freed before its refusal closed the socket).
            with self._lock:
                if not handed:
                    self._peers.pop(key, None)
                if then_idle and not self._stop.is_set():
                    self._idle += 1
            if not handed:
                conn.close()

    def _check_hello(self, msg: dict[str, Any] | None) -> str:
        if msg is None:
            return "closed before hello"
        if msg.get("op") != "hello" or msg.get("v") != protocol.VERSION:
            return f"not a version-{protocol.VERSION} hello (op={msg.get('op')!r} v={msg.get('v')!r})"
        if msg.get("source_id") != self.source_id:
            return f"hello for another source ({msg.get('source_id')!r})"
        token = msg.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(),
                                                                 self._token.encode()):
            return "wrong credential"
        return ""

    def _send_segments(self, conn: socket.socket, files: bool) -> int:
        """Send the segments (``file`` ones only when ``files`` and their file is
        unchanged); returns how many."""
        with self._lock:
            shared = list(self._shared)
        fresh: dict[int, bool] = {}  # one fstat per origin per peer
        shared = [s for s in shared if s.origin is None or (
            files and fresh.setdefault(id(s.origin), s.origin.unchanged()))]
        per = protocol.MAX_FDS_PER_MESSAGE
        batches = [shared[i:i + per] for i in range(0, len(shared), per)]
        protocol.send(conn, {"op": "welcome", "v": protocol.VERSION,
                             "segments": len(shared), "batches": len(batches)})
        for batch in batches:
            items, fds, opened = [], [], []
            index: dict[int, int] = {}  # file segments of one file share its descriptor
            try:
                for s in batch:
                    seg = s.segment
                    if seg.kind == "cuda_ipc":
                        items.append(seg.to_item(-1))
                        continue
                    if seg.kind == "vmm_fd":
                        from modelexpress.local.cuda import export_vmm_fd
                        fd = export_vmm_fd(seg.addr, seg.device)
                        opened.append(fd)
                    else:
                        fd = s.fd
                    if seg.kind == "file":
                        if fd not in index:
                            index[fd] = len(fds)
                            fds.append(fd)
                        items.append(seg.to_item(index[fd]))
                        continue
                    items.append(seg.to_item(len(fds)))
                    fds.append(fd)
                protocol.send(conn, {"op": "segments", "items": items}, fds)
            finally:
                # ORDER: after sendmsg the kernel holds its own references to the
                # in-flight files; closing ours now is what keeps a peer's fds from
                # piling up here.
                protocol.close_fds(opened)
        return len(shared)

    def _hold(self, conn: socket.socket, peer: str) -> None:
        conn.settimeout(_ACCEPT_POLL_S)
        until = time.monotonic() + self.max_hold_s
        while not self._stop.is_set():
            if time.monotonic() > until:
                log.warning("local source %s: %s held its mapping over max_hold_s=%.0f s; "
                            "disconnecting", self.source_id, peer, self.max_hold_s)
                return
            try:
                msg, fds = protocol.recv(conn, peer)
            except TimeoutError:
                continue
            protocol.close_fds(fds)
            if msg is None or msg.get("op") == "bye":
                return
        try:  # the source is closing: tell the peer, whose liveness check then fails
            protocol.send(conn, {"op": "closing"})
        except OSError:
            pass

    def _refill_page_cache(self) -> None:
        """After a peer is done: read back, on a thread of its own, what the page cache
        of the checkpoint files this source serves has lost (``origin.refill_page_cache``:
        pulls read the memfd where it is evicted and never start a disk read
        themselves). One at a time; none once the source closes."""
        with self._lock:
            if self._stop.is_set() or (self._refill is not None and self._refill.is_alive()):
                return
            origins = list({id(s.origin): s.origin for s in self._shared
                            if s.origin is not None}.values())
            if not origins:
                return
            self._refill = threading.Thread(target=refill_page_cache,
                                            args=(origins, self.source_id),
                                            name="mx-local-refill", daemon=True)
            self._refill.start()

    # ------------------------------------------------------------ close

    def close(self) -> None:
        """Stop serving: tell peers, close every connection and descriptor, remove the
        socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join(_JOIN_S)
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._handoff.put(None)  # wakes each idle peer thread; busy ones see _stop
        deadline = time.monotonic() + _JOIN_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            leftover = list(self._peers.values())
            self._peers.clear()
            shared, self._shared = self._shared, []
        for conn in leftover:
            conn.close()
        protocol.close_fds([s.fd for s in shared if s.owns_fd])


def _peer_name(conn: socket.socket) -> str:
    """``pid P uid U`` of the connected process (SO_PEERCRED), for logs."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", raw)
        return f"peer pid {pid} uid {uid}"
    except OSError:
        return "peer"
