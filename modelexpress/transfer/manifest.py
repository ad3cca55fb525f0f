"""The manifest: what a source holds, tensor by tensor, serialized as versioned JSON.

A target validates a manifest against its own tensors before any byte moves
(:mod:`modelexpress.transfer.planner`) and checks digests after. The manifest also
lists the source's registered regions: a coalesced remote descriptor must fall in
one of them, or NIXL rejects it.

JSON, never pickle: the manifest crosses trust boundaries through the control plane.

Layout (version 1)::

    {"format": "modelexpress.manifest", "version": 1,
     "agent_name": "...", "host": "...", "digest_algorithm": "wsum-i32-v1",
     "tensors": [{"name", "dtype", "shape", "nbytes", "addr", "device", "digest"}, ...],
     "regions": [[addr, nbytes, device_index], ...],
     "attributes": {...}}

``attributes`` is optional: facts about the served weights that the transfer layer
does not interpret, checked by whoever pulls them (the vLLM loader publishes its
behavioural probe there). Readers of version 1 that predate it ignore it.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from modelexpress.errors import ConfigError, ManifestMismatchError
from modelexpress.transfer import digest as _digest

if TYPE_CHECKING:
    import torch

__all__ = ["FORMAT", "VERSION", "Manifest", "TensorEntry", "build_manifest", "tensor_entry",
           "dtype_name", "mem_kind"]

FORMAT = "modelexpress.manifest"
VERSION = 1


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (stable across torch versions)."""
    return str(dtype).removeprefix("torch.")


def mem_kind(device: str) -> str:
    """NIXL memory kind of a device string: ``"cpu"`` -> DRAM, ``"cuda:N"`` -> VRAM."""
    return "DRAM" if device == "cpu" else "VRAM"


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a manifest.

    Attributes:
        name: the tensor's name (state-dict key).
        dtype: torch dtype name without the ``torch.`` prefix.
        shape: logical shape.
        nbytes: bytes (numel * element size); the tensor is contiguous at ``addr``.
        addr: virtual address in the owner's process.
        device: ``"cpu"`` or ``"cuda:N"``.
        digest: digest per the manifest's algorithm, or None when not computed.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    addr: int
    device: str
    digest: str | None = None

    @property
    def device_index(self) -> int:
        """NIXL device id: the CUDA ordinal, 0 for DRAM."""
        return int(self.device.split(":")[1]) if ":" in self.device else 0

    @property
    def mem(self) -> str:
        return mem_kind(self.device)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "nbytes": self.nbytes, "addr": self.addr, "device": self.device,
                "digest": self.digest}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TensorEntry:
        try:
            entry = cls(name=str(obj["name"]), dtype=str(obj["dtype"]),
                        shape=tuple(int(x) for x in obj["shape"]), nbytes=int(obj["nbytes"]),
                        addr=int(obj["addr"]), device=str(obj["device"]),
                        digest=None if obj.get("digest") is None else str(obj["digest"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestMismatchError(f"malformed manifest tensor entry {obj!r}: {exc}") from exc
        if entry.nbytes < 0 or entry.addr < 0:
            raise ManifestMismatchError(f"manifest entry {entry.name!r} has a negative size/addr")
        return entry


def _device_str(tensor: torch.Tensor) -> str:
    return "cpu" if tensor.device.type == "cpu" else f"cuda:{tensor.device.index or 0}"


def tensor_entry(name: str, tensor: torch.Tensor, digest: str | None = None) -> TensorEntry:
    """Describe one contiguous tensor.

    Raises:
        ConfigError: the tensor is not contiguous (it cannot be one descriptor).
    """
    if not tensor.is_contiguous():
        raise ConfigError(f"tensor {name!r} is not contiguous; transfers need contiguous tensors "
                          "(call .contiguous() before registering)")
    return TensorEntry(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape),
                       nbytes=tensor.numel() * tensor.element_size(), addr=tensor.data_ptr(),
                       device=_device_str(tensor), digest=digest)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a source serves. Build with :func:`build_manifest`.

    Attributes:
        agent_name: the source's NIXL agent name (the target adds it as a peer).
        host: the source's hostname (same host selects CMA / cuda_ipc expectations).
        digest_algorithm: one of ``digest.ALGORITHMS``, or None when no digests.
        tensors: entries in the source's order (load order).
        regions: the source's registered regions as (addr, nbytes, device).
        attributes: opaque JSON facts for the puller (e.g. the vLLM probe).
    """

    agent_name: str
    host: str
    digest_algorithm: str | None
    tensors: tuple[TensorEntry, ...]
    regions: tuple[tuple[int, int, int], ...] = ()
    version: int = VERSION
    attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def to_json(self) -> str:
        """Serialize (compact JSON)."""
        return json.dumps({
            "format": FORMAT, "version": self.version, "agent_name": self.agent_name,
            "host": self.host, "digest_algorithm": self.digest_algorithm,
            "tensors": [t.to_json() for t in self.tensors],
            "regions": [list(r) for r in self.regions],
            "attributes": dict(self.attributes),
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and validate a serialized manifest.

        Raises:
            ManifestMismatchError: not a manifest, an unsupported version, or malformed.
        """
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ManifestMismatchError(f"manifest is not valid JSON: {exc}") from exc
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ManifestMismatchError(f"not a modelexpress manifest (format={obj.get('format')!r})"
                                        if isinstance(obj, dict) else "manifest is not an object")
        if obj.get("version") != VERSION:
            raise ManifestMismatchError(
                f"manifest version {obj.get('version')!r} is not supported (this build reads "
                f"version {VERSION}); upgrade the older side")
        algo = obj.get("digest_algorithm")
        if algo is not None and algo not in _digest.ALGORITHMS:
            raise ManifestMismatchError(
                f"manifest digest algorithm {algo!r} unknown; allowed: {_digest.ALGORITHMS}")
        tensors = tuple(TensorEntry.from_json(t) for t in obj.get("tensors", []))
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise ManifestMismatchError("manifest lists a tensor name twice")
        try:
            regions = tuple((int(a), int(n), int(d)) for a, n, d in obj.get("regions", []))
        except (TypeError, ValueError) as exc:
            raise ManifestMismatchError(f"malformed manifest regions: {exc}") from exc
        attributes = obj.get("attributes", {})
        if not isinstance(attributes, dict):
            raise ManifestMismatchError("malformed manifest attributes: not a JSON object")
        return cls(agent_name=str(obj.get("agent_name", "")), host=str(obj.get("host", "")),
                   digest_algorithm=algo, tensors=tensors, regions=regions,
                   attributes=attributes)


def build_manifest(tensors: Mapping[str, torch.Tensor], *, agent_name: str = "",
                   regions: Iterable[tuple[int, int, int]] = (), digests: bool = True,
                   digest_algorithm: str | None = None, host: str | None = None,
                   known_digests: Mapping[str, str] | None = None,
                   attributes: Mapping[str, Any] | None = None) -> Manifest:
    """Describe ``tensors`` (in their mapping order) for publishing.

    Usually called through ``NixlTransferManager.build_manifest``, which fills in
    ``agent_name`` and ``regions``.

    Args:
        tensors: name -> contiguous tensor, in load order.
        agent_name: the serving agent's name.
        regions: the serving agent's registered regions (addr, nbytes, device).
        digests: compute a digest per tensor (on the tensor's device).
        digest_algorithm: force an algorithm; default per :func:`digest.default_algorithm`.
        host: hostname; default this machine's.
        known_digests: digests the caller already computed with ``digest_algorithm``
            (name -> value), used instead of computing them again; every tensor must
            have one.
        attributes: JSON-able facts published with the manifest (see the module doc).

    Returns:
        The manifest.

    Raises:
        ConfigError: a tensor is not contiguous, or the algorithm cannot run on a device.
    """
    algo = None
    if digests:
        algo = digest_algorithm or _digest.default_algorithm(tensors.values())
        if algo not in _digest.ALGORITHMS:
            raise ConfigError(f"unknown digest algorithm {algo!r}; allowed: {_digest.ALGORITHMS}")
    if known_digests is not None:
        if algo is None or digest_algorithm is None:
            raise ConfigError("known_digests needs digests=True and the digest_algorithm "
                              "they were computed with")
        missing = [name for name in tensors if name not in known_digests]
        if missing:
            raise ConfigError(f"known_digests lacks {len(missing)} tensor(s), e.g. {missing[0]!r}")
        values = [known_digests[name] for name in tensors]
    else:
        values = (_digest.digest_many(list(tensors.values()), algo) if algo
                  else [None] * len(tensors))
    entries = tuple(tensor_entry(name, t, value)
                    for (name, t), value in zip(tensors.items(), values))
    return Manifest(agent_name=agent_name, host=host or socket.gethostname(),
                    digest_algorithm=algo, tensors=entries,
                    regions=tuple((int(a), int(n), int(d)) for a, n, d in regions),
                    attributes=dict(attributes or {}))
