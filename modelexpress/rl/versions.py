"""Weight versions of an RL run as modelexpress sources, in a fixed pool of host buffers.

A trainer produces version after version of the same tensors. Each version is
published as an ordinary source (so engines pull it with :func:`~modelexpress.p2p.pull`,
the local transport on one host and NIXL across hosts), under an identity that names
the version:

::

    ModelIdentity(model=<run name>, revision=<version>, dtype="mixed",
                  extra=(("mx_rl", "weights"), ("mx_rl_shard", "<i>/<n>")))

``revision`` is where a checkpoint's version already lives, so a version needs no new
identity field, and two versions can never be mistaken for each other (their ids
differ). ``mx_rl`` keeps RL sources apart from the vLLM loader's sources of the same
name; ``mx_rl_shard`` names the trainer shard (a rank that holds part of the model).

Memory is reused, never grown: :class:`VersionPool` owns ``slots`` sets of host
buffers (2 by default: the version engines are switching to and the one before it),
each registered with its own NIXL agent once. Publishing a version takes the slot of
the oldest version, withdraws that version (STALE) and copies the new bytes in:

::

    slot    state                         what can happen next
    ------  ----------------------------  ------------------------------------------
    empty   no buffers yet                publish: allocate, register, serve
    served  READY, leases == 0            publish (oldest slot): withdraw, copy, serve
    leased  READY, an update in flight    publish must not take it: VersionBusyError

A version is *in use* while a weight update of it is in flight (a lease, taken by the
trainer engine around its update round trip); a slot in use is never overwritten. One
agent per slot (not one for the pool) because withdrawing a source stops its agent's
progress thread, which would stop serving every other version on a shared agent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from modelexpress.errors import ConfigError, WeightUpdateError
from modelexpress.identity import ModelIdentity

if TYPE_CHECKING:
    import torch

    from modelexpress.client import MxClient
    from modelexpress.local import HostBuffer, LocalOptions
    from modelexpress.p2p.source import SourceHandle
    from modelexpress.transfer import NixlTransferManager

__all__ = ["RL_EXTRA", "VersionBusyError", "VersionPool", "PublishedVersion", "version_identity"]

log = logging.getLogger(__name__)

RL_EXTRA = ("mx_rl", "weights")
"""The ``extra`` pair every RL weight version carries in its identity."""


class VersionBusyError(WeightUpdateError):
    """Every slot holds a version with an update in flight; none can be overwritten."""


def version_identity(model: str, version: str, *, dtype: str = "mixed", shard: int = 0,
                     shards: int = 1) -> ModelIdentity:
    """The identity of one trainer shard of one weight version.

    Args:
        model: the run's name (what engines are told at ``init_weight_transfer_engine``).
        version: the weight version (any non-empty string; the trainer counts 1, 2, ...).
        dtype: identity ``dtype``; ``"mixed"`` (a version's tensors keep the trainer's
            dtypes, which the manifest carries per tensor).
        shard, shards: this trainer shard and how many publish (``0 <= shard < shards``).

    Raises:
        ConfigError: an empty version, or a shard outside ``[0, shards)``.
    """
    if not str(version):
        raise ConfigError("a weight version must be a non-empty string")
    if not 0 <= shard < shards:
        raise ConfigError(f"trainer shard must be in [0, {shards}) (got {shard})")
    return ModelIdentity(model=model, revision=str(version), dtype=dtype,
                         extra=(RL_EXTRA, ("mx_rl_shard", f"{shard}/{shards}")))


@dataclasses.dataclass
class _Slot:
    index: int
    buffers: dict[str, "torch.Tensor"] = dataclasses.field(default_factory=dict)
    host: "HostBuffer | None" = None  # the memfd the buffers are views of (local transport)
    manager: "NixlTransferManager | None" = None
    handle: "SourceHandle | None" = None
    version: str | None = None
    leases: int = 0
    published_at: float = 0.0


@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    """What :meth:`VersionPool.publish` did.

    Attributes:
        version: the version published.
        identity: its identity (``to_dict()`` is what engines are sent).
        source_id: the control plane's id of the source.
        bytes: bytes copied into the slot.
        copy_seconds: time copying the trainer's tensors into the slot.
        publish_seconds: time registering (first use of a slot only) and publishing.
        withdrew: the version this publish withdrew to reuse its slot, if any.
        slot: the slot index.
    """

    version: str
    identity: ModelIdentity
    source_id: str
    bytes: int
    copy_seconds: float
    publish_seconds: float
    withdrew: str | None
    slot: int


class VersionPool:
    """``slots`` published weight versions in reused host buffers (module docstring).

    Args:
        client: control-plane client the sources are published with.
        model: the run's name (identity ``model``).
        slots: how many versions stay published (>= 1; 2 lets a late engine still pull
            the previous version while the newest is served).
        shard, shards: this trainer shard of how many.
        heartbeat_interval_s: ``MX_HEARTBEAT_INTERVAL_S`` of the sources.
        backend: NIXL backend of the slots' agents (``MX_NIXL_BACKEND``).
        guardian: start a guardian per source, so a killed trainer's versions turn STALE
            at once instead of when the server times them out.
        local: serve engines on this host over the local transport too
            (``LocalOptions.from_settings``); the slots' buffers are then memfd-backed.
            None or ``MX_IPC_DIR=off``: NIXL only.
    """

    def __init__(self, client: "MxClient", model: str, *, slots: int = 2, shard: int = 0,
                 shards: int = 1, heartbeat_interval_s: float = 5.0, backend: str = "UCX",
                 guardian: bool = True, local: "LocalOptions | None" = None) -> None:
        if slots < 1:
            raise ConfigError(f"a version pool needs at least 1 slot (got {slots})")
        if not model:
            raise ConfigError("the run's model name must be a non-empty string")
        version_identity(model, "0", shard=shard, shards=shards)  # validates the shard
        self.client = client
        self.model = model
        self.shard = shard
        self.shards = shards
        self._heartbeat_s = heartbeat_interval_s
        self._backend = backend
        self._guardian = guardian
        self._local = local if local is not None and local.enabled else None
        self._slots = [_Slot(i) for i in range(slots)]
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ publishing
    def publish(self, version: str, tensors: Iterable[tuple[str, "torch.Tensor"]]
                ) -> PublishedVersion:
        """Copy ``tensors`` into the oldest free slot and publish them as ``version``.

        Args:
            version: the version's name (unique within the pool).
            tensors: ``(name, tensor)`` pairs as the trainer holds them (any device;
                copied to host). Iterated once.

        Returns:
            A :class:`PublishedVersion`.

        Raises:
            VersionBusyError: every slot has an update in flight.
            ConfigError: ``version`` is already published, or the pool is closed.
            RegistrationError, ControlPlaneError: registering or publishing failed (the
                slot is then empty; the other versions keep serving).
        """
        from modelexpress.p2p.source import serve_source

        version = str(version)
        with self._lock:
            if self._closed:
                raise ConfigError("the version pool is closed")
            if any(s.version == version for s in self._slots):
                raise ConfigError(f"version {version!r} of {self.model} is already published")
            free = [s for s in self._slots if s.leases == 0]
            if not free:
                raise VersionBusyError(
                    f"every one of the {len(self._slots)} slots of {self.model} holds a version "
                    f"with an update in flight ({[s.version for s in self._slots]}); finish an "
                    "update first or give the pool more slots")
            slot = min(free, key=lambda s: (s.handle is not None, s.published_at))
            slot.leases += 1  # ORDER: held while copying, so no other publish takes this slot
        withdrew = slot.version
        try:
            self._withdraw(slot)
            t0 = time.perf_counter()
            nbytes = self._copy_in(slot, tensors)
            t1 = time.perf_counter()
            identity = version_identity(self.model, version, shard=self.shard,
                                        shards=self.shards)
            slot.handle = serve_source(identity, slot.buffers, client=self.client,
                                       manager=self._manager(slot), digests=True,
                                       heartbeat_interval_s=self._heartbeat_s,
                                       attributes={"mx_rl_version": version},
                                       guardian=self._guardian, local=self._local,
                                       host_buffers=(slot.host,) if slot.host else (),
                                       own_host_buffers=False)
            slot.version = version
            slot.published_at = time.monotonic()
            t2 = time.perf_counter()
        finally:
            with self._lock:
                slot.leases -= 1
        log.info("published %s version %s (shard %d/%d): %d tensors, %d bytes, copy %.3f s, "
                 "publish %.3f s, slot %d%s", self.model, version, self.shard, self.shards,
                 len(slot.buffers), nbytes, t1 - t0, t2 - t1, slot.index,
                 f", withdrew version {withdrew}" if withdrew else "")
        return PublishedVersion(version, identity, slot.handle.source_id, nbytes, t1 - t0,
                                t2 - t1, withdrew, slot.index)

    def _manager(self, slot: _Slot) -> "NixlTransferManager":
        if slot.manager is None:
            from modelexpress.transfer import NixlTransferManager

            slot.manager = NixlTransferManager(backend=self._backend)
        return slot.manager

    def _copy_in(self, slot: _Slot, tensors: Iterable[tuple[str, "torch.Tensor"]]) -> int:
        """Copy into the slot's buffers; reallocate only when the layout changed."""
        import torch

        incoming = list(tensors)
        layout = [(n, tuple(t.shape), t.dtype) for n, t in incoming]
        if layout != [(n, tuple(b.shape), b.dtype) for n, b in slot.buffers.items()]:
            if slot.buffers:
                log.warning("%s: the trainer's tensors changed layout; slot %d reallocates",
                            self.model, slot.index)
            if slot.manager is not None:  # its registrations cover the old buffers
                slot.manager.close()
                slot.manager = None
            if slot.host is not None:
                slot.host.close()  # views still held elsewhere keep their pages
                slot.host = None
            if self._local is not None:
                from modelexpress.local import host_buffer_like

                slot.host, slot.buffers = host_buffer_like(
                    {n: t for n, t in incoming}, copy=False, name=f"mx-rl-{self.model}")
            else:
                slot.buffers = {n: torch.empty(shape, dtype=dtype)
                                for n, shape, dtype in layout}
        nbytes = 0
        with torch.no_grad():
            for name, tensor in incoming:
                buf = slot.buffers[name]
                buf.copy_(tensor.detach())
                nbytes += buf.numel() * buf.element_size()
        return nbytes

    def _withdraw(self, slot: _Slot) -> None:
        handle, slot.handle, version, slot.version = slot.handle, None, slot.version, None
        if handle is not None:
            handle.close()
            log.info("withdrew %s version %s (slot %d reused)", self.model, version, slot.index)

    # ------------------------------------------------------------------ leases
    @contextlib.contextmanager
    def lease(self, version: str) -> Iterator[None]:
        """Mark ``version`` in use (an update of it in flight) for the ``with`` block.

        Raises:
            ConfigError: ``version`` is not published.
        """
        with self._lock:
            slot = next((s for s in self._slots if s.version == str(version)), None)
            if slot is None:
                raise ConfigError(f"version {version!r} of {self.model} is not published "
                                  f"(published: {self.versions()})")
            slot.leases += 1
        try:
            yield
        finally:
            with self._lock:
                slot.leases -= 1

    def versions(self) -> list[str]:
        """The published versions, oldest first."""
        return [s.version for s in sorted(self._slots, key=lambda s: s.published_at)
                if s.version is not None]

    def buffer_bytes(self) -> int:
        """Host bytes the pool holds (what stays constant from version to version)."""
        return sum(b.numel() * b.element_size() for s in self._slots for b in s.buffers.values())

    def buffer_addresses(self) -> list[int]:
        """Data pointers of every slot's buffers (tests check memory is reused)."""
        return [b.data_ptr() for s in self._slots for b in s.buffers.values()]

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Withdraw every version and drop the buffers and agents. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for slot in self._slots:
            try:
                self._withdraw(slot)
            finally:
                if slot.manager is not None:
                    slot.manager.close()
                    slot.manager = None
                if slot.host is not None:
                    slot.host.close()
                    slot.host = None
                slot.buffers = {}

    def __enter__(self) -> VersionPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer never raises
            pass
