"""A vLLM model's weights in their loaded form, named the same way in every process.

Peers exchange what vLLM's ``load_weights`` produces (parameters and buffers, before
``process_weights_after_loading``), not the post-processed state: post-processing may
keep what the forward pass reads where no tensor walk reaches it (oneDNN handles and
packed weights captured by closures on vLLM's CPU build). See ``loader.py`` for the
design, ``probe.py`` for the check that it held.

Names are ``named_parameters`` / ``named_buffers`` names, so two processes running the
same vLLM code on the same layout produce the same names in the same order. Each
distinct storage is returned once: tied weights and views of one buffer alias a
storage, and writing it twice would be wasted bandwidth (and two overlapping NIXL
descriptors). A storage that one contiguous tensor covers exactly is returned as that
tensor (typed: the manifest then checks dtype and shape); any other storage is
returned as a flat ``uint8`` view of the whole storage, so the bytes move regardless
of the views' strides.

This module needs torch only; it does not import vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["collect_loaded_tensors", "LAYOUT_VERSION"]

logger = logging.getLogger(__name__)

# Part of the identity: bump when the naming or dedup rules here change, so peers that
# would name the same memory differently never pair up. "2": peers exchange the loaded
# form (parameters and buffers before post-processing).
LAYOUT_VERSION = "2"


def collect_loaded_tensors(model: nn.Module, *, meta: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights in their *loaded* form: parameters and buffers, once per storage.

    This is what vLLM's ``load_weights`` fills and ``process_weights_after_loading``
    starts from. Call it between the two: the returned tensors share memory with the
    model's parameters at that moment, and keep that memory alive if post-processing
    later replaces a parameter (so a source can still serve the loaded form).

    Args:
        model: a model built by vLLM (weights loaded, or about to be pulled into).
        meta: name a model built on the ``meta`` device (``layout.py`` derives a layout
            on one) by the same rules; otherwise meta tensors are left out.

    Returns:
        ``{name: tensor}`` in ``named_parameters`` then ``named_buffers`` order; tied
        weights and views appear once (see the module docstring); tensors on
        the ``meta`` device (unless ``meta``) and empty ones are left out.

    Raises:
        ValueError: two different storages got the same name (a bug).
    """
    def items() -> Iterator[tuple[str, torch.Tensor]]:
        yield from model.named_parameters(remove_duplicate=False)
        yield from model.named_buffers(remove_duplicate=False)

    return _dedupe_storages(items(), meta)


def _dedupe_storages(items: Iterator[tuple[str, torch.Tensor]],
                     meta: bool = False) -> dict[str, torch.Tensor]:
    groups: dict[tuple[str, int], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in items:
        if tensor.device.type == "meta" and not meta:
            logger.debug("modelexpress: %s is on the meta device; skipped", name)
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            continue
        # Meta storages have no address: the storage object itself tells them apart.
        key = storage._cdata if tensor.device.type == "meta" else storage.data_ptr()
        groups.setdefault((str(tensor.device), key), []).append((name, tensor))

    out: dict[str, torch.Tensor] = {}
    for members in groups.values():
        name, tensor = _representative(members)
        if name in out:
            raise ValueError(f"two storages are both named {name!r}")
        out[name] = tensor
        logger.debug("modelexpress: %s %s %s (%d aliases)", name, tensor.dtype,
                     tuple(tensor.shape), len(members) - 1)
    return out


def _representative(members: list[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor]:
    """One tensor that covers the whole storage of ``members`` (they all share it)."""
    storage = members[0][1].untyped_storage()
    for name, tensor in members:
        if (tensor.is_contiguous() and tensor.storage_offset() == 0
                and tensor.numel() * tensor.element_size() == storage.nbytes()):
            return name, tensor.detach()
    # No single view covers it: move the raw bytes under the first name.
    name, tensor = members[0]
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return name, flat
