"""Which GPU is which across processes: GPUs are named by UUID at every process boundary.

A CUDA ordinal means something only inside one process: with ``CUDA_VISIBLE_DEVICES``
(engines pinned to GPUs, containers given some of them) ordinal 0 of one process is
ordinal 3 of another, or a GPU the other cannot see at all. So whatever crosses a
process boundary (local transport segments and endpoints, manifest attributes,
source records, logs) names a GPU by its UUID (``GPU-8c3a...``, as ``nvidia-smi -L``
and ``CUDA_VISIBLE_DEVICES`` spell it), and each process maps that to its own
ordinal through a :class:`DeviceInventory`::

    source (CUDA_VISIBLE_DEVICES=GPU-b)          target (CUDA_VISIBLE_DEVICES=GPU-a,GPU-b)
    cuda:0 ──uuid_of──> "GPU-b" ──── wire ────> ordinal_of("GPU-b") = 1 -> maps for cuda:1
                                                (not seen here: None -> not read over the
                                                local transport; the pull reads NIXL)

The inventory is passed in as an object: :class:`CudaDevices` asks this process's CUDA
runtime (through PyTorch), :class:`StaticDevices` is a fixed list (CPU tests, where the
device list is faked at this boundary, and processes that must see no GPU).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from modelexpress.errors import PeerError

if TYPE_CHECKING:
    from modelexpress.local.protocol import Segment

__all__ = ["CudaDevices", "DeviceInventory", "StaticDevices", "gpu_uuid", "gpus_of",
           "local_segments", "ordinal_of", "uuid_of", "visible_devices_text"]

log = logging.getLogger(__name__)


class DeviceInventory(Protocol):
    """The GPUs this process sees, by its own ordinal."""

    def uuids(self) -> Sequence[str]:
        """GPU UUIDs in ordinal order: ``uuids()[k]`` is ``cuda:k`` here."""
        ...


def gpu_uuid(raw: object) -> str:
    """A UUID as CUDA reports it (``uuid.UUID``, 16 bytes, hex text) in ``GPU-<uuid>`` form.

    MIG instances (``MIG-...``) and strings already prefixed are kept as they are.
    """
    if isinstance(raw, (bytes, bytearray)):
        h = bytes(raw).hex()
        raw = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    text = str(raw).strip()
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


class StaticDevices:
    """A fixed device list (ordinal k is ``uuids[k]``)."""

    def __init__(self, uuids: Iterable[str] = ()) -> None:
        self._uuids = tuple(gpu_uuid(u) for u in uuids)

    def uuids(self) -> Sequence[str]:
        return self._uuids

    def __repr__(self) -> str:
        return f"StaticDevices({list(self._uuids)})"


class CudaDevices:
    """This process's CUDA devices, asked once (PyTorch's ``get_device_properties().uuid``).

    A process without CUDA (no torch, no driver, no visible device) sees none.
    """

    def __init__(self) -> None:
        self._uuids: tuple[str, ...] | None = None
        self._lock = threading.Lock()

    def uuids(self) -> Sequence[str]:
        with self._lock:
            if self._uuids is None:
                self._uuids = self._ask()
            return self._uuids

    @staticmethod
    def _ask() -> tuple[str, ...]:
        try:
            import torch
            if not torch.cuda.is_available():
                return ()
            return tuple(gpu_uuid(torch.cuda.get_device_properties(k).uuid)
                         for k in range(torch.cuda.device_count()))
        except Exception as exc:  # noqa: BLE001 - a broken CUDA install means "no GPU here"
            log.warning("cannot list this process's CUDA devices (%s): none are used for "
                        "the local transport", exc)
            return ()

    def __repr__(self) -> str:
        return "CudaDevices()"


def uuid_of(devices: DeviceInventory, ordinal: int) -> str:
    """The UUID of this process's ``cuda:ordinal``; ``""`` when it has no such device."""
    uuids = devices.uuids()
    return uuids[ordinal] if 0 <= ordinal < len(uuids) else ""


def ordinal_of(devices: DeviceInventory, uuid: str) -> int | None:
    """This process's ordinal of the GPU ``uuid``, or None when it does not see it."""
    try:
        return list(devices.uuids()).index(gpu_uuid(uuid))
    except ValueError:
        return None


def visible_devices_text() -> str:
    """``CUDA_VISIBLE_DEVICES`` of this process as a message shows it."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "unset" if value is None else repr(value)


def local_segments(segments: Sequence["Segment"], devices: DeviceInventory,
                   peer: str) -> list["Segment"]:
    """The source's segments with each device segment's ordinal made this process's own.

    Host segments pass unchanged. A device segment names its GPU by UUID (``gpu``); its
    ``device`` (the source's ordinal) is replaced by the ordinal of that GPU here.

    Raises:
        PeerError: a device segment names no UUID (a source from before GPU UUIDs:
            its ordinal means nothing here), or lies on a GPU this process does not
            see. Raised before anything is mapped, so the caller can read the source
            another way (over NIXL).
    """
    out = []
    for seg in segments:
        if seg.kind == "memfd":
            out.append(seg)
            continue
        if not seg.gpu:
            raise PeerError(f"{peer} names its GPU by ordinal only (its cuda:{seg.device}; a "
                            "modelexpress from before GPU UUIDs): a GPU ordinal means nothing "
                            "in another process, so it is not read over the local transport")
        ordinal = ordinal_of(devices, seg.gpu)
        if ordinal is None:
            seen = ", ".join(devices.uuids()) or "none"
            raise PeerError(f"{peer} serves memory on GPU {seg.gpu} (its cuda:{seg.device}), "
                            f"which this process does not see (CUDA_VISIBLE_DEVICES="
                            f"{visible_devices_text()}; GPUs here: {seen}): not read over "
                            "the local transport")
        out.append(dataclasses.replace(seg, device=ordinal))
    return out


def gpus_of(tensors: Iterable[object], inventory: DeviceInventory | None = None) -> dict[str, str]:
    """``{"cuda:N": UUID}`` for the CUDA devices the given tensors are on (none: ``{}``).

    What a source publishes beside its manifest's ``cuda:N`` devices (those stay the
    source's own ordinals: NIXL's remote descriptors need them) so that other
    processes know which GPUs they are.
    """
    ordinals = sorted({t.device.index or 0 for t in tensors  # type: ignore[attr-defined]
                       if getattr(getattr(t, "device", None), "type", "") == "cuda"})
    if not ordinals:
        return {}
    inv = inventory or CudaDevices()
    return {f"cuda:{k}": uuid_of(inv, k) for k in ordinals if uuid_of(inv, k)}
