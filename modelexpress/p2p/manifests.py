"""A source's manifest as the data plane reads it, and destination tensors shaped by one.

Used by every side that reads a source (a pull, the relay's reader, the agent), so it
sits below all of them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from modelexpress.errors import ManifestMismatchError

if TYPE_CHECKING:
    import torch

    from modelexpress.client import SourceInfo
    from modelexpress.transfer import Manifest

__all__ = ["allocate_like", "manifest_of"]


def manifest_of(info: "SourceInfo") -> "Manifest":
    """The transfer-layer manifest of a source fetched with ``get_source``.

    Raises:
        ManifestMismatchError: the stored manifest is missing or malformed.
    """
    from modelexpress.transfer import Manifest

    if info.manifest is None:
        raise ManifestMismatchError(f"source {info.id} has no manifest (fetch it with get_source)")
    return Manifest.from_json(json.dumps(info.manifest))


def allocate_like(manifest: "Manifest", device: str = "cpu",
                  contiguous: bool = True) -> dict[str, "torch.Tensor"]:
    """Empty destination tensors matching a manifest (names, dtypes, shapes), in its order.

    Args:
        manifest: the source's manifest.
        device: where to allocate.
        contiguous: carve every tensor from one allocation (one NIXL region, one IPC
            handle; see ``checkpoint.allocate_slab``) instead of one allocation each.
    """
    import torch

    from modelexpress.checkpoint import allocate_slab

    specs = []
    for entry in manifest.tensors:
        dtype = getattr(torch, entry.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ManifestMismatchError(f"tensor {entry.name!r} has unknown dtype {entry.dtype!r}")
        specs.append((entry.name, tuple(entry.shape), dtype))
    if contiguous:
        return allocate_slab(specs, device)
    return {name: torch.empty(shape, dtype=dtype, device=device) for name, shape, dtype in specs}
