"""The wire protocol of the local transport: JSON messages and descriptors over a Unix socket.

A source listens on ``<MX_IPC_DIR>/mx-<source_id>.sock`` (``SOCK_SEQPACKET``: each
``sendmsg`` is one message, delivered whole with the descriptors attached to it, so
no framing is needed and descriptors can never be split from their message). A
target's session, one connection::

    target                                      source
    ------                                      ------
    connect
    hello {v, source_id, token,        ----->   check v, source_id, token (constant time)
           accepts}
                                       <-----   refused {reason}            -> close
                                       <-----   welcome {v, segments, batches}
                                       <-----   segments {items} + fds      (x batches,
                                                 <= MAX_FDS_PER_MESSAGE descriptors each)
    map everything, copy, verify
    bye                                ----->   close the connection: every descriptor the
    close                                       source opened for this peer is closed
                                       <-----   closing (the source is shutting down)

While the target copies, the connection stays open: it is the liveness channel.
The target checks it between copy chunks; an end-of-file (the source process died,
or closed the connection after ``closing``) fails the pull with a PeerError even
though already-mapped memory may still be readable, because a source that went away
may have been changing the weights it served.

A segment item: ``{"kind", "addr", "size", "device", "gpu", "fd", "ipc"}``:

=========  ====================================================  ==========================
kind       memory                                                handle
=========  ====================================================  ==========================
memfd      host memory in a memfd (``HostBuffer``, host arena)   fd (``fd`` = index)
vmm_fd     a CUDA VMM chunk (``cuMemCreate`` with POSIX-fd type)  fd from cuMemExport...
cuda_ipc   a cudaMalloc allocation (PyTorch's caching allocator)  ``ipc`` (64 bytes, hex)
file       the same bytes as part of a memfd segment, in the      fd of the file (read-only;
           checkpoint file they were loaded from (:mod:`.origin`)  items may share one index)
=========  ====================================================  ==========================

A ``file`` segment's ``offset`` is where its first byte lies in the file. It never
stands alone: the memfd segment over the same addresses is the reference a target
falls back to (bytes not in the page cache, digests that do not match). A source
sends ``file`` segments only to a target whose hello lists ``"file"`` in ``accepts``
(a target from before them would refuse the unknown kind), and only while the file is
unchanged since the load.

``addr`` is the start of the allocation in the source's address space: a tensor of
the source's manifest at ``addr + k`` is at offset ``k`` of the mapped segment.

``gpu`` names a device segment's GPU by UUID (``GPU-...``; ``""`` for host memory);
``device`` is the source's CUDA ordinal, meaningful only in the source's process (for
its logs). A target maps ``gpu`` to its own ordinal (:mod:`.devices`) and does not
read a segment on a GPU it cannot see, nor one that names no UUID (a source from
before UUIDs: the key is new in version 1 and readers of version 1 ignore it).
"""

from __future__ import annotations

import dataclasses
import json
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from modelexpress.errors import ConfigError, PeerError

__all__ = ["VERSION", "MAX_FDS_PER_MESSAGE", "MAX_MESSAGE_BYTES", "SEGMENT_KINDS", "HOST_KINDS",
           "LocalEndpoint", "Segment", "send", "recv", "socket_path"]

VERSION = 1
MAX_FDS_PER_MESSAGE = 200     # the kernel's SCM_MAX_FD is 253
MAX_MESSAGE_BYTES = 1 << 16   # segment batches stay far below a SEQPACKET's send buffer
SEGMENT_KINDS = ("memfd", "vmm_fd", "cuda_ipc", "file")
HOST_KINDS = ("memfd", "file")  # host memory: no GPU to name
_SUN_PATH_MAX = 107           # sockaddr_un.sun_path is 108 bytes with the NUL


def socket_path(ipc_dir: str, source_id: str) -> str:
    """The socket a source listens on.

    Raises:
        ConfigError: the path does not fit a Unix socket address (108 bytes).
    """
    path = f"{ipc_dir.rstrip('/')}/mx-{source_id}.sock"
    if len(path.encode()) > _SUN_PATH_MAX:
        raise ConfigError(f"Unix socket path {path!r} is {len(path.encode())} bytes; the limit "
                          f"is {_SUN_PATH_MAX}: set MX_IPC_DIR to a shorter directory")
    return path


@dataclasses.dataclass(frozen=True)
class LocalEndpoint:
    """What a target needs to pull from a source over the local transport.

    The source publishes it with its manifest (the credential travels only through the
    control plane, which authenticates both sides). ``token`` is left out of ``repr``.

    Attributes:
        host_id: the source's :func:`~modelexpress.local.hostid.host_id`.
        path: the source's Unix socket.
        source_id: names the source in the socket path and in the handshake.
        token: the credential the source checks.
        gpus: UUIDs of the GPUs its device segments lie on (none for host memory).
    """

    host_id: str
    path: str
    source_id: str
    token: str = dataclasses.field(repr=False)
    gpus: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"transport": "local", "v": VERSION, "host_id": self.host_id,
                "path": self.path, "source_id": self.source_id, "token": self.token,
                "gpus": list(self.gpus)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LocalEndpoint:
        """Parse :meth:`to_json`'s form.

        Raises:
            ConfigError: not a local endpoint, another version, or a field missing.
        """
        if obj.get("transport") != "local" or obj.get("v") != VERSION:
            raise ConfigError(f"not a version-{VERSION} local endpoint: transport="
                              f"{obj.get('transport')!r} v={obj.get('v')!r}")
        try:
            return cls(host_id=str(obj["host_id"]), path=str(obj["path"]),
                       source_id=str(obj["source_id"]), token=str(obj["token"]),
                       gpus=tuple(str(g) for g in obj.get("gpus") or ()))
        except KeyError as exc:
            raise ConfigError(f"local endpoint lacks {exc.args[0]!r}") from exc


@dataclasses.dataclass(frozen=True)
class Segment:
    """One shared allocation as described on the wire (see the module docstring).

    Attributes:
        kind: one of :data:`SEGMENT_KINDS`.
        addr: start in the source's address space.
        size: bytes.
        device: CUDA ordinal, -1 for host memory: the source's on the wire, this
            process's once :func:`~modelexpress.local.devices.local_segments` mapped it.
        ipc: the CUDA IPC handle (``cuda_ipc`` only).
        gpu: the GPU's UUID (device segments); what other processes go by.
        offset: where a ``file`` segment's bytes start in its file.
    """

    kind: str
    addr: int
    size: int
    device: int
    ipc: bytes | None = None
    gpu: str = ""
    offset: int = 0

    def to_item(self, fd_index: int) -> dict[str, Any]:
        item = {"kind": self.kind, "addr": self.addr, "size": self.size,
                "device": self.device, "gpu": self.gpu, "fd": fd_index,
                "ipc": self.ipc.hex() if self.ipc is not None else None}
        if self.kind == "file":
            item["offset"] = self.offset
        return item

    @property
    def where(self) -> str:
        """For logs: ``host`` or the GPU's UUID."""
        return "host" if self.kind in HOST_KINDS else (self.gpu or f"source cuda:{self.device}")

    @classmethod
    def from_item(cls, item: Mapping[str, Any]) -> tuple[Segment, int]:
        try:
            kind = str(item["kind"])
            seg = cls(kind=kind, addr=int(item["addr"]), size=int(item["size"]),
                      device=int(item["device"]),
                      ipc=bytes.fromhex(item["ipc"]) if item.get("ipc") else None,
                      gpu=str(item.get("gpu") or ""), offset=int(item.get("offset") or 0))
            fd_index = int(item["fd"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PeerError(f"malformed segment from the source: {item!r} ({exc})") from exc
        if kind not in SEGMENT_KINDS or seg.size <= 0 or seg.addr < 0 or seg.offset < 0:
            raise PeerError(f"bad segment from the source: {item!r}")
        if (kind == "cuda_ipc") != (seg.ipc is not None) or (kind == "cuda_ipc") != (fd_index < 0):
            raise PeerError(f"segment {item!r}: a cuda_ipc segment carries an IPC handle and "
                            "no descriptor, the others a descriptor")
        return seg, fd_index

    @property
    def end(self) -> int:
        return self.addr + self.size


def send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one message (with descriptors). Raises OSError as the socket does."""
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES or len(fds) > MAX_FDS_PER_MESSAGE:
        raise ConfigError(f"local transport message too large: {len(data)} bytes, "
                          f"{len(fds)} descriptors")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv(sock: socket.socket, peer: str) -> tuple[dict[str, Any] | None, list[int]]:
    """Receive one message; ``(None, [])`` at end-of-file.

    The caller owns (and must close) every descriptor returned.

    Raises:
        PeerError: a truncated or malformed message (descriptors received with it are
            closed first).
        OSError / TimeoutError: from the socket.
    """
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, MAX_FDS_PER_MESSAGE)
    if not data and not fds:
        return None, []
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise PeerError(f"{peer}: a message or its descriptors were truncated "
                            f"(flags 0x{flags:x})")
        try:
            msg = json.loads(data)
        except ValueError as exc:
            raise PeerError(f"{peer}: not a protocol message ({exc})") from exc
        if not isinstance(msg, dict) or "op" not in msg:
            raise PeerError(f"{peer}: not a protocol message: {data[:200]!r}")
    except BaseException:
        close_fds(fds)
        raise
    return msg, fds


def close_fds(fds: Sequence[int]) -> None:
    """Close descriptors, ignoring ones already closed."""
    import os
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
