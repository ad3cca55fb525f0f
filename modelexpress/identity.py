"""Content-addressed identity of a set of weights one worker rank holds.

Two workers can exchange weights when they agree on every field here. The id is a
hash of the canonical fields and deliberately does NOT include the modelexpress
version: the reference implementation splits its source pools on every upgrade,
which turns a routine rollout into a cold start for every target.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from modelexpress.errors import ConfigError

__all__ = ["ModelIdentity"]

_ID_VERSION = 1  # bump only if the canonical form itself changes


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """What a worker rank holds.

    Args:
        model: model name or path as the engine knows it (e.g. ``meta-llama/Llama-3.1-8B``).
        revision: checkpoint revision (commit, tag, or ``"main"``).
        dtype: weight dtype as the engine loaded it (``"bfloat16"``...).
        quantization: quantization method, or ``"none"``.
        tp_size, pp_size, ep_size: parallel layout.
        rank: this worker's rank within the layout (the tensors differ per rank).
        extra: other engine facts that change the bytes (e.g. a loader post-processing
            version); part of the hash.
    """

    model: str
    revision: str = "main"
    dtype: str = "bfloat16"
    quantization: str = "none"
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    rank: int = 0
    extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("identity.model must be a non-empty string")
        for name in ("tp_size", "pp_size", "ep_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"identity.{name} must be >= 1 (got {getattr(self, name)})")
        world = self.tp_size * self.pp_size
        if not 0 <= self.rank < world:
            raise ConfigError(
                f"identity.rank must be in [0, {world}) for tp={self.tp_size} pp={self.pp_size} "
                f"(got {self.rank})")
        # normalise extra into a sorted tuple of string pairs so equal facts hash equal
        object.__setattr__(self, "extra", tuple(sorted((str(k), str(v)) for k, v in self.extra)))

    def canonical(self) -> dict[str, Any]:
        """The fields that define the identity, in a stable JSON-able form."""
        data = dataclasses.asdict(self)
        data["extra"] = [list(pair) for pair in self.extra]
        data["v"] = _ID_VERSION
        return data

    @property
    def id(self) -> str:
        """Hex digest of the canonical JSON (sha256, first 32 hex chars)."""
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    @property
    def family(self) -> str:
        """The id of these weights in any tensor- or pipeline-parallel layout: the
        canonical fields without ``tp_size``, ``pp_size`` and ``rank``. Sources of one
        family hold regions of the same checkpoint loaded the same way; a target pulls
        across layouts from them when they publish their layouts
        (:mod:`modelexpress.layout`)."""
        data = self.canonical()
        for key in ("tp_size", "pp_size", "rank"):
            data.pop(key)
        data["family"] = 1
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def to_dict(self) -> dict[str, Any]:
        """JSON form for the wire (includes the id for convenience)."""
        data = self.canonical()
        data.pop("v")
        data["id"] = self.id
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelIdentity":
        """Inverse of :meth:`to_dict`; an ``id`` that does not match the fields is an error."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields - {"id"}
        if unknown:
            raise ConfigError(f"unknown identity fields {sorted(unknown)}; allowed: {sorted(fields)}")
        kwargs = {k: v for k, v in data.items() if k in fields}
        if "extra" in kwargs:
            kwargs["extra"] = tuple(tuple(pair) for pair in kwargs["extra"])
        ident = cls(**kwargs)
        if "id" in data and data["id"] != ident.id:
            raise ConfigError(f"identity id {data['id']} does not match its fields ({ident.id})")
        return ident
