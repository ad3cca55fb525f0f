"""How a pull reads one source: the :class:`SourceReader` interface and its NIXL reader.

``pull`` validates sources, picks them, retries and stripes; moving one source's
bytes into (part of) the destination is a reader's job. A reader is chosen per
source, so a transport other than NIXL (e.g. same-host shared memory) plugs in by
offering a reader for the sources it can serve and leaving the rest to
:class:`NixlReader`.

:class:`AgentStart` creates the NIXL agent of a pull in a thread, so its fixed cost
(UCX contexts, workers, transports) overlaps the control-plane calls and the imports
a fresh process makes before any byte can move.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, runtime_checkable

from modelexpress.errors import PeerError

if TYPE_CHECKING:
    import torch

    from modelexpress.client import SourceInfo
    from modelexpress.transfer import Manifest, NixlTransferManager, StopSignal, TransferResult

__all__ = ["SourceReader", "HeldReader", "ReaderFactory", "NixlReader", "AgentStart",
           "uses_pull_agent"]


class SourceReader(Protocol):
    """Moves the tensors one source serves into a destination."""

    def read_into(self, dest: Mapping[str, "torch.Tensor"], *, allow_partial: bool,
                  progress: Callable[[int, int], None], stop: "StopSignal | None",
                  deadline_s: float) -> "TransferResult":
        """READ ``dest``'s tensors (a subset of the source's when striped).

        Args:
            dest: name -> destination tensor; only these names are read.
            allow_partial: names on one side only are skipped instead of an error.
            progress: ``progress(bytes_done, bytes_total)`` between chunks.
            stop: honoured between chunks.
            deadline_s: seconds this read may take.

        Returns:
            The data plane's result (``peer_seconds``: connecting to the source).

        Raises:
            TransferError and its subclasses, as :meth:`NixlTransferManager.read`.
        """
        ...


@runtime_checkable
class HeldReader(SourceReader, Protocol):
    """A reader that the pull holds beyond its READs.

    The relay's (:class:`~modelexpress.p2p.relay_pull.RelayedPull`) reads with the
    pull's own NIXL agent and serves what it received to the pulls planned behind it
    until the pull is over. ``pull`` starts its agent before the first READ for a
    reader that :attr:`uses_pull_agent`, calls :meth:`release` once its record is
    SUCCEEDED (before it returns: the caller owns the destination afterwards), and
    :meth:`close` when it ends, whatever the outcome. A reader without these members
    (NIXL's, the local transport's) holds nothing.

    Attributes:
        uses_pull_agent: reads with the pull's NIXL agent (its factory was handed the
            pull's manager), which the pull then starts on its own thread before any
            READ thread exists (see :class:`AgentStart`).
    """

    uses_pull_agent: bool

    def release(self) -> None:
        """The pull succeeded: finish what is held (may wait, bounded)."""
        ...

    def close(self) -> None:
        """The pull is over: drop what is held now. Idempotent."""
        ...


ReaderFactory = Callable[["SourceInfo", "Manifest"], "SourceReader | None"]
"""Picks the reader of one source (given its record and manifest), or None: another
factory's, or NIXL's."""


def uses_pull_agent(reader: SourceReader | None) -> bool:
    """Whether reading with ``reader`` needs the pull's NIXL agent: None (the pull's own
    NIXL READ) or a :class:`HeldReader` that says so."""
    return reader is None or (isinstance(reader, HeldReader) and reader.uses_pull_agent)


class NixlReader:
    """A NIXL READ from one source: load its agent metadata, READ, disconnect.

    Args:
        manager: the NIXL manager of this pull (its registrations hold the destination).
        info: the source (with ``agent_metadata``).
        manifest: its manifest.
        chunk_bytes, verify, refuse_slow_transport, stall_s: as
            :class:`~.options.PullOptions`.
    """

    def __init__(self, manager: "NixlTransferManager", info: "SourceInfo", manifest: "Manifest",
                 *, chunk_bytes: int, verify: bool, refuse_slow_transport: bool,
                 stall_s: float = 0.0) -> None:
        if info.agent_metadata is None:
            raise PeerError(f"source {info.id} (worker {info.worker_id}) has no agent metadata; "
                            "fetch it with get_source")
        self.manager = manager
        self.info = info
        self.manifest = manifest
        self.chunk_bytes = chunk_bytes
        self.verify = verify
        self.refuse_slow_transport = refuse_slow_transport
        self.stall_s = stall_s

    def read_into(self, dest: Mapping[str, "torch.Tensor"], *, allow_partial: bool,
                  progress: Callable[[int, int], None], stop: "StopSignal | None",
                  deadline_s: float) -> "TransferResult":
        t0 = time.perf_counter()
        assert self.info.agent_metadata is not None
        peer = self.manager.add_peer(self.info.agent_metadata)
        peer_s = time.perf_counter() - t0
        try:
            result = self.manager.read(
                self.manifest, dest, peer=peer, allow_partial=allow_partial,
                chunk_bytes=self.chunk_bytes, deadline_s=deadline_s, progress=progress,
                stop=stop, verify=self.verify, refuse_slow_transport=self.refuse_slow_transport,
                stall_s=self.stall_s or None)
        finally:
            self.manager.remove_peer(peer)
        return dataclasses.replace(result, peer_seconds=peer_s)


class AgentStart:
    """A NIXL manager being created (and a known destination registered).

    It is created on the calling thread, before anything else runs. It once ran in a
    thread, to overlap a fresh process's ``import torch`` and the control-plane calls;
    a striped pull then aborted in glibc ("break adjusted to free malloc space") in
    CI: UCX installs its memory hooks (UCM, which follow malloc's heap through brk)
    while the agent starts, and other threads allocating at that moment can corrupt
    the heap (UCX's own CI has hit the same abort). On a 2-core machine the overlap
    also saved nothing (bench/p2p.py --small). A destination on a GPU needs its CUDA
    context before UCX starts (``nixl_adapter._ensure_cuda_context``): pass that
    device, and it is made current first.

    Args:
        backend: NIXL backend plugin.
        device: the destination's CUDA device, or None for host memory.
        register: destination tensors to register once the agent exists.

    Attributes:
        seconds: how long creating (and registering) took.
        registered: ``register`` was given and is registered.
    """

    def __init__(self, backend: str, device: "torch.device | None" = None, *,
                 register: "Mapping[str, torch.Tensor] | None" = None) -> None:
        self._manager: "NixlTransferManager | None" = None
        self._error: BaseException | None = None
        self.seconds = 0.0
        self.registered = False
        self._create(backend, device, register)

    def _create(self, backend: str, device: "torch.device | None",
                register: "Mapping[str, torch.Tensor] | None") -> None:
        t0 = time.perf_counter()
        try:
            from modelexpress.transfer import NixlTransferManager

            if device is not None and device.type == "cuda":
                import torch

                # NIXL creates its CUDA context on the current device; the caller's
                # current device is restored afterwards.
                with torch.cuda.device(device):
                    self._manager = NixlTransferManager(backend=backend)
            else:
                self._manager = NixlTransferManager(backend=backend)
            if register:
                self._manager.register_tensors(dict(register))
                self.registered = True
        except BaseException as exc:  # noqa: BLE001 - re-raised where the manager is used
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - t0

    def get(self) -> "NixlTransferManager":
        """The manager; raises what creating it raised.

        Raises:
            what creating the manager raised.
        """
        if self._error is not None:
            raise self._error
        assert self._manager is not None
        return self._manager

    def close(self) -> None:
        """Close the manager. Idempotent."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None
