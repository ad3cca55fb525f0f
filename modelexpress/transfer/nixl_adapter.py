"""The one module that touches NIXL names.

Everything else in :mod:`modelexpress.transfer` sees :class:`NixlAgent`, plain
tuples and our error tree. NIXL raises one exception class per status
(``nixlRemoteDisconnectError``, ``nixlNotFoundError``, ...) with no common base, so
:data:`ERROR_MAP` lists every one of them and :func:`translate` turns a caught
NIXL exception into a :class:`~modelexpress.errors.TransferError` subclass whose
message names the operation, the peer, the size and what to do. A test enumerates
the classes exported by the installed bindings and fails if one is missing here.

The wheel is ``nixl-cu12`` (module ``nixl_cu12``) on CPU machines and ``nixl-cu13``
on CUDA 13 hosts; the ``nixl`` meta package provides the plain name. We take the
first one installed.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Literal, TypeVar

from modelexpress._optional import available
from modelexpress.errors import (
    ConfigError,
    DependencyError,
    PeerError,
    RegistrationError,
    TransferCancelledError,
    TransferError,
    TransportError,
)
from modelexpress.transfer import ucx_report

__all__ = [
    "ERROR_MAP",
    "MemKind",
    "NixlAgent",
    "XferState",
    "nixl_error_classes",
    "nixl_module",
    "translate",
]

log = logging.getLogger(__name__)

MemKind = Literal["DRAM", "VRAM"]
XferState = Literal["DONE", "PROC", "ERR"]
T = TypeVar("T")

# After a failed READ, progress calls beyond one per queued descriptor: UCX's flush of
# the discarded endpoint and its completion each take one.
_DRAIN_SPARE = 8
_DRAIN_S = 5.0  # bound on those calls (each moves one queued operation: microseconds)
# How long releasing an in-flight READ waits for it: one posted READ lands in
# milliseconds over CMA, RDMA or a healthy TCP link; only a hung peer takes longer.
_SETTLE_S = 1.0

_CANDIDATES = ("nixl", "nixl_cu13", "nixl_cu12")
_INSTALL_HINT = "pip install 'modelexpress[nixl]' (nixl-cu12) or 'modelexpress[nixl-cu13]'"

# NIXL status class name -> (our error class, what the caller should do).
# Registration overrides the class (see translate): any failure while registering
# memory is a RegistrationError whatever status NIXL reported.
ERROR_MAP: dict[str, tuple[type[TransferError], str]] = {
    "nixlRemoteDisconnectError": (
        PeerError, "the peer disconnected or exited; pick another source or retry"),
    "nixlNotFoundError": (
        PeerError, "the peer or its memory is unknown here; re-add the peer from fresh "
                   "metadata (it may have restarted or deregistered)"),
    "nixlNotAllowedError": (
        PeerError, "the peer refused the operation; check that it registered this memory"),
    "nixlCancelledError": (
        TransferCancelledError, "the transfer was cancelled; start a new one if needed"),
    "nixlNotSupportedError": (
        TransportError, "no NIXL backend can move this memory type between these peers; "
                        "check the backend plugin and UCX transports (modelexpress doctor)"),
    "nixlBackendError": (
        TransferError, "the NIXL backend (UCX) failed; run with UCX_LOG_LEVEL=info for details"),
    "nixlInvalidParamError": (
        TransferError, "NIXL rejected a descriptor; this is a modelexpress bug, please report it"),
    "nixlMismatchError": (
        TransferError, "local and remote descriptor lists differ in length or memory type; "
                       "this is a modelexpress bug, please report it"),
    "nixlNotPostedError": (
        TransferError, "the transfer was never posted; this is a modelexpress bug"),
    "nixlRepostActiveError": (
        TransferError, "a transfer handle was re-posted while still active; modelexpress bug"),
    "nixlNoTelemetryError": (
        TransferError, "NIXL telemetry is disabled; modelexpress measures rates itself"),
    "nixlUnknownError": (
        TransferError, "NIXL reported an unknown error; run with UCX_LOG_LEVEL=info"),
}

_module: ModuleType | None = None
_module_lock = threading.Lock()


def nixl_module() -> ModuleType:
    """Import and return the installed NIXL python package.

    Raises:
        DependencyError: no NIXL wheel is installed.
    """
    global _module
    with _module_lock:
        if _module is None:
            for name in _CANDIDATES:
                if available(name):
                    _module = importlib.import_module(name)
                    break
            else:
                raise DependencyError(f"NIXL is required for transfers; install it: {_INSTALL_HINT}")
        return _module


def _bindings() -> ModuleType:
    return importlib.import_module(nixl_module().__name__ + "._bindings")


def nixl_error_classes() -> dict[str, type[BaseException]]:
    """Every exception class the installed NIXL bindings export, by name."""
    bindings = _bindings()
    return {name: obj for name, obj in vars(bindings).items()
            if inspect.isclass(obj) and issubclass(obj, BaseException)}


_error_tuple: tuple[type[BaseException], ...] | None = None


def _nixl_errors() -> tuple[type[BaseException], ...]:
    global _error_tuple
    if _error_tuple is None:
        _error_tuple = tuple(nixl_error_classes().values())
    return _error_tuple


def translate(exc: BaseException, op: str, *, peer: str = "", nbytes: int | None = None,
              registering: bool = False) -> TransferError:
    """Map a NIXL exception to our error tree (the caller raises it ``from exc``).

    Args:
        exc: the exception NIXL raised.
        op: what we were doing, for the message ("READ", "register 3 DRAM regions").
        peer: remote agent name, when there is one.
        nbytes: bytes involved, when known.
        registering: the failure happened while registering memory.

    Returns:
        A :class:`TransferError` subclass instance with an actionable message.
    """
    name = type(exc).__name__
    cls, hint = ERROR_MAP.get(name, (TransferError, "unexpected NIXL error; please report it"))
    if registering:
        cls = RegistrationError
        hint = ("registration failed; check that the memory is mapped and of the declared "
                f"type (DRAM/VRAM). NIXL said: {hint}")
    parts = [f"NIXL {op} failed with {name}: {exc}"]
    if peer:
        parts.append(f"peer={peer}")
    if nbytes is not None:
        parts.append(f"bytes={nbytes}")
    return cls(", ".join(parts) + f". {hint}")


def _ensure_cuda_context() -> None:
    """Create the current device's CUDA context before UCX starts, when CUDA is in use.

    UCX decides what its CUDA transports can do when the backend is created; a
    process whose CUDA context did not exist yet then moved VRAM at ~0.5 GB/s (the
    TCP fallback) on an H200 host, while the same READ after a CUDA call ran on
    cuda_ipc. Only a process that already imported torch and sees a GPU is touched,
    and only its current device (set it with ``torch.cuda.set_device`` first), so
    CPU-only users and the other GPUs pay nothing.
    """
    torch = sys.modules.get("torch")
    # A torch still being imported (by another thread: a pull into host memory imports
    # it while its agent starts) has made no CUDA context and is not ours to touch.
    if torch is None or getattr(torch.__spec__, "_initializing", False) \
            or not torch.cuda.is_available():
        return
    torch.cuda.synchronize(torch.cuda.current_device())


class NixlAgent:
    """One NIXL agent behind our names. Thread-safe: every call takes one lock.

    The lock matters because a source's progress thread polls the worker while
    another thread may register memory or read; NIXL's default sync mode without
    the listener thread is ``NONE`` (no internal locking).

    UCX cannot cancel a READ, and a failed one can leave others behind it queued: over
    CMA each worker progress moves one queued operation of a peer whose operations
    fail, while NIXL stops progressing once nothing succeeds. A worker destroyed with
    any still queued aborts the process (UCX's ``ucs_arbiter_group_is_empty``
    assertion; a READ of 48 pieces posted to a peer just killed did it 5 times in 6).
    So the agent knows how many descriptors its posted READs hold: a READ that fails
    is followed by that many progress calls, releasing one still in flight first
    waits for it to settle (nothing lands after :meth:`release` returns), and
    :meth:`close` progresses whatever is still owed before the agent goes.

    Args:
        name: agent name; a uuid-based one when None (names must be unique per peer pair;
            keep the first 31 characters unique within a process: UCX names its
            protocol report after them).
        backend: NIXL backend plugin, one of those the installed NIXL offers (``UCX``,
            ``LIBFABRIC``, ...; case-insensitive). Only UCX reports which transport it
            used.
        enable_prog_thread: NIXL's own progress thread. Off by default: on the GPU
            machine it measured 396 GB/s off vs 236-299 GB/s on (GPU.md). With it
            off, a passive source must call :meth:`progress` in a loop.
        listen_port: NIXL listener port; 0 = any (we exchange metadata out of band).
        num_threads: backend worker threads (0 = backend default).

    Raises:
        ConfigError: ``backend`` is not a plugin this NIXL offers (the message lists them).
        DependencyError: NIXL is not installed.
        TransferError: the agent or backend could not be created.
    """

    def __init__(self, name: str | None = None, *, backend: str = "UCX",
                 enable_prog_thread: bool = False, listen_port: int = 0,
                 num_threads: int = 0) -> None:
        if not isinstance(backend, str) or not backend.strip():
            raise ConfigError(f"backend must name a NIXL backend plugin such as 'UCX' "
                              f"(got {backend!r})")
        nixl = nixl_module()
        _ensure_cuda_context()
        self.name = name or f"mx-{uuid.uuid4().hex}"
        self._lock = threading.RLock()
        self._closed = False
        self._agent: Any = None
        self._descs: dict[int, int] = {}  # id(READ request) -> its descriptor count
        # Posted READs last seen in flight, by id (held: an id is not reused meanwhile).
        self._live: dict[int, Any] = {}
        self._owed = 0  # progress calls owed before the worker may be destroyed
        self._notifs: dict[str, list[bytes]] = {}  # met while draining, for progress()
        config = nixl.nixl_agent_config(enable_prog_thread=enable_prog_thread,
                                        enable_listen_thread=False, listen_port=listen_port,
                                        num_threads=num_threads, backends=[])
        # ORDER: UCX installs malloc hooks while the agent starts, and a GPU digest kernel
        # built on another thread allocates all along (p2p.readers.AgentStart): none runs.
        from modelexpress.transfer.digest import pause_builds, resume_builds
        pause_builds(wait_running_s=120.0)
        try:
            agent = nixl.nixl_agent(self.name, config)
            plugins = sorted(str(p) for p in agent.get_plugin_list())
        except _nixl_errors() as exc:
            raise translate(exc, f"create agent {self.name}") from exc
        except RuntimeError as exc:  # "No plugins available" is a plain RuntimeError
            raise TransferError(f"NIXL agent {self.name} could not start: {exc}. "
                                "Check NIXL_PLUGIN_DIR and the wheel installation.") from exc
        finally:
            resume_builds()
        # NIXL's plugin names are upper case; accept "ucx" for "UCX".
        self.backend = {p.upper(): p for p in plugins}.get(backend.strip().upper(), "")
        if not self.backend:
            raise ConfigError(f"NIXL backend {backend!r} is not available; this NIXL offers "
                              f"{', '.join(plugins) or 'no plugins'} (UCX moves memory between "
                              "agents and is the default)")
        params = {"num_threads": str(num_threads)} if num_threads else {}
        # UCX reads where to write its protocol report while its backend starts
        # (ucx_report: the transport a result names is read from that report).
        starting = ucx_report.ucx_env() if self.backend == "UCX" else contextlib.nullcontext()
        try:
            with starting:
                agent.create_backend(self.backend, params)
        except _nixl_errors() as exc:
            raise TransferError(
                f"NIXL backend plugin {self.backend} is installed but did not start "
                f"({type(exc).__name__}: {exc}): its library or devices are missing here. "
                f"This NIXL offers {', '.join(plugins)}; UCX is the default") from exc
        except RuntimeError as exc:
            raise TransferError(f"NIXL agent {self.name} could not start backend "
                                f"{self.backend}: {exc}") from exc
        self._agent = agent

    # -- plumbing -----------------------------------------------------------------
    def _call(self, op: str, fn: Callable[..., T], *args: Any, peer: str = "",
              nbytes: int | None = None, registering: bool = False, **kw: Any) -> T:
        with self._lock:
            if self._closed:
                raise TransferError(f"NIXL agent {self.name} is closed; cannot {op}")
            try:
                return fn(*args, **kw)
            except _nixl_errors() as exc:
                raise translate(exc, op, peer=peer, nbytes=nbytes,
                                registering=registering) from exc

    # -- introspection --------------------------------------------------------------
    def plugins(self) -> list[str]:
        """NIXL backend plugins found (e.g. UCX, POSIX, GDS)."""
        return list(self._call("list plugins", self._agent.get_plugin_list))

    def mem_types(self) -> list[str]:
        """Memory segment types the backend serves (e.g. DRAM_SEG, VRAM_SEG)."""
        return list(self._call("query memory types", self._agent.get_backend_mem_types,
                               self.backend))

    # -- memory -------------------------------------------------------------------
    def register(self, regions: Sequence[tuple[int, int, int]], mem: MemKind) -> Any:
        """Register ``(addr, nbytes, device)`` regions. Returns an opaque handle for
        :meth:`deregister`.

        Raises:
            RegistrationError: NIXL refused a region.
        """
        total = sum(r[1] for r in regions)
        descs = [(int(a), int(n), int(d), "") for a, n, d in regions]
        return self._call(f"register {len(descs)} {mem} regions", self._agent.register_memory,
                          descs, mem, [self.backend], nbytes=total, registering=True)

    def deregister(self, handle: Any) -> None:
        """Deregister what :meth:`register` returned."""
        self._call("deregister memory", self._agent.deregister_memory, handle, [self.backend],
                   registering=True)

    # -- peers ----------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's metadata (connection info + registered regions) for peers."""
        return bytes(self._call("get agent metadata", self._agent.get_agent_metadata))

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name."""
        name = self._call("load peer metadata", self._agent.add_remote_agent, metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, peer: str) -> None:
        """Forget a peer and disconnect from it."""
        self._call("remove peer", self._agent.remove_remote_agent, peer, peer=peer)

    # -- transfers ------------------------------------------------------------------
    def prep(self, peer: str | None, descs: Any, mem: MemKind) -> Any:
        """Prepare a descriptor list: local when ``peer`` is None, else the peer's.

        Args:
            peer: remote agent name, or None for the local side.
            descs: an Nx3 uint64 numpy array of (addr, nbytes, device).
            mem: memory type of all descriptors.
        """
        who = "NIXL_INIT_AGENT" if peer is None else peer
        return self._call(f"prepare {len(descs)} {mem} descriptors", self._agent.prep_xfer_dlist,
                          who, descs, mem, [self.backend], peer=peer or "")

    def make_read(self, local: Any, local_idx: Any, remote: Any, remote_idx: Any,
                  peer: str, notif: bytes = b"") -> Any:
        """Build a READ request from prepared lists and index arrays."""
        xfer = self._call("create READ request", self._agent.make_prepped_xfer, "READ", local,
                          local_idx, remote, remote_idx, notif, [self.backend], peer=peer)
        with self._lock:
            self._descs[id(xfer)] = max(len(local_idx), 1)
        return xfer

    def post(self, xfer: Any, peer: str, nbytes: int) -> XferState:
        """Post a request; returns DONE, PROC or ERR."""
        return self._seen(xfer, "post READ", self._agent.transfer, peer, nbytes)

    def state(self, xfer: Any, peer: str, nbytes: int) -> XferState:
        """Poll a posted request (this also progresses the worker)."""
        return self._seen(xfer, "check READ", self._agent.check_xfer_state, peer, nbytes)

    def _seen(self, xfer: Any, op: str, fn: Callable[[Any], XferState], peer: str,
              nbytes: int) -> XferState:
        """``fn(xfer)``, keeping track of what is in flight, and draining what a failure
        left queued (see the class docstring)."""
        with self._lock:
            try:
                state = self._call(op, fn, xfer, peer=peer, nbytes=nbytes)
            except TransferError:
                if not self._closed:
                    self._live.pop(id(xfer), None)
                    self._drain(self._queued(xfer))
                raise
            if state == "PROC":
                self._live[id(xfer)] = xfer
            else:
                self._live.pop(id(xfer), None)
                if state == "ERR":
                    self._drain(self._queued(xfer))
            return state

    def _queued(self, failed: Any) -> int:
        """Progress calls that move everything a failure may have left queued: one per
        descriptor of the failed READ and of those still in flight, and a few for the
        flush UCX queues behind them when it discards the peer's endpoint."""
        return (self._descs.get(id(failed), 1) + sum(self._descs.get(i, 1) for i in self._live)
                + _DRAIN_SPARE)

    def _drain(self, calls: int) -> None:
        """Progress the worker ``calls`` times (the caller holds the lock), keeping the
        notifications met for :meth:`progress`."""
        end = time.monotonic() + _DRAIN_S
        for _ in range(calls):
            try:
                notifs = self._agent.get_new_notifs()
            except _nixl_errors() as exc:
                log.warning("NIXL agent %s: progressing the worker after a failed READ "
                            "failed: %s", self.name, exc)
                return
            self._keep(notifs)
            if time.monotonic() > end:
                log.warning("NIXL agent %s: %d progress calls after a failed READ took over "
                            "%g s; stopped", self.name, calls, _DRAIN_S)
                return

    def release(self, handle: Any) -> None:
        """Release a request or prepared-list handle; a failure is logged, not raised,
        because release runs on error paths where the original error matters more.

        A READ still in flight is first polled until it lands or fails, for at most
        ``_SETTLE_S`` (UCX cannot cancel it: released early, it would go on landing
        into memory its caller may reuse). One that does not settle in time (a hung
        peer over TCP) is released anyway, and :meth:`close` progresses the worker
        for it before the agent goes."""
        with self._lock:
            if self._closed:
                return
            key = id(handle)
            if key in self._live:
                self._settle(handle)
            self._live.pop(key, None)
            self._descs.pop(key, None)
            try:
                handle.release()
            except _nixl_errors() as exc:
                log.warning("NIXL could not release %r on agent %s: %s", handle, self.name, exc)

    def _settle(self, xfer: Any) -> None:
        """Poll an in-flight READ until it is no longer in flight, bounded (lock held)."""
        end = time.monotonic() + _SETTLE_S
        while True:
            try:
                state = self._seen(xfer, "settle READ", self._agent.check_xfer_state, "", 0)
            except TransferError:
                return  # failed: _seen drained what it left queued
            if state != "PROC":
                return
            if time.monotonic() > end:
                log.warning("NIXL agent %s: a READ of %d descriptors released while still "
                            "in flight after %g s (the peer may be hung)", self.name,
                            self._descs.get(id(xfer), 1), _SETTLE_S)
                self._owed += self._descs.get(id(xfer), 1) + _DRAIN_SPARE
                return
            time.sleep(0.0002)

    def progress(self) -> dict[str, list[bytes]]:
        """Progress the worker once and return new notifications by peer name."""
        with self._lock:
            self._keep(self._call("progress worker", self._agent.get_new_notifs))
            out, self._notifs = self._notifs, {}
        return out

    def _keep(self, notifs: dict[Any, list[bytes]]) -> None:
        """Add NIXL's notifications (peer names may be bytes) to those not yet returned."""
        for k, v in notifs.items():
            self._notifs.setdefault(k.decode() if isinstance(k, bytes) else str(k),
                                    []).extend(v)

    # -- lifetime -------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drop the agent. Idempotent. Callers disconnect peers and deregister first.

        READs never released, or released before they settled, are progressed first:
        the worker must have nothing queued when it is destroyed (class docstring)."""
        with self._lock:
            if self._closed:
                return
            owed = self._owed + sum(self._descs.get(i, 1) + _DRAIN_SPARE for i in self._live)
            if owed:
                self._drain(owed)
            self._closed = True
            self._live.clear()
            self._descs.clear()
            self._agent = None  # the bindings tear the agent down when collected

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must never raise
            pass
