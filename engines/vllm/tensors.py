"""Every tensor a loaded vLLM model holds, named the same way in every process.

A peer-to-peer load must move *all* of a model's memory that the forward pass reads,
not just ``model.state_dict()``. After ``process_weights_after_loading`` many vLLM
quantization methods and kernels keep the tensors they actually use as plain Python
attributes: on the module (``layer.weight_scale = t`` where ``t`` is not a Parameter),
on the module's ``quant_method``, or on a kernel object the method built (a repacked
weight, a workspace, a permutation). A target that pulls only parameters and buffers
keeps its placeholder values in those tensors and produces silently wrong output.

:func:`collect_model_tensors` walks the module tree and, from every module, its
parameters, its buffers and the objects reachable from its attributes (lists, tuples,
dicts with str/int keys, dataclasses, ``__dict__`` and ``__slots__`` objects, tensor
subclasses through ``__tensor_flatten__``), to a bounded depth. Names are the attribute
paths (``layers.0.mlp.quant_method.kernel.w_q``), so two processes running the same code
on the same layout produce the same names in the same order.

Each distinct storage is returned once: tied weights, a Parameter that re-wraps a
transposed view of its original, or a scale stored both on the layer and on its kernel
all alias one storage, and writing it twice would be wasted bandwidth (and two
overlapping NIXL descriptors). A storage that one contiguous tensor covers exactly is
returned as that tensor (typed: the manifest then checks dtype and shape); any other
storage (a transposed view, several views into one buffer) is returned as a flat
``uint8`` view of the whole storage, so the bytes move regardless of the views' strides.

This module needs torch only; it does not import vLLM.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["collect_model_tensors", "collect_loaded_tensors", "LAYOUT_VERSION",
           "DEFAULT_EXCLUDE"]

logger = logging.getLogger(__name__)

# Part of the identity: bump when the naming or dedup rules here change, so peers that
# would name the same memory differently never pair up. "2": peers exchange the loaded
# form (parameters and buffers before post-processing), see collect_loaded_tensors.
LAYOUT_VERSION = "2"

# Attribute names never walked. ``kv_cache``: vLLM's attention layers point at the KV
# cache once the engine allocated it (GBs, per-request state, not weights); at the end
# of a load it is still empty, but a later in-place reload must never serve it.
DEFAULT_EXCLUDE = frozenset({"kv_cache"})

# nn.Module's own bookkeeping (hooks, the registries walked explicitly below).
_MODULE_INTERNALS = frozenset(vars(nn.Module()))

# Leaves that cannot hold a tensor; stopping here keeps the walk cheap and never calls
# into foreign objects (functions, classes, modules, process groups).
_LEAF_TYPES: tuple[type, ...] = (
    str, bytes, bytearray, int, float, complex, bool, type(None), range, slice,
    torch.dtype, torch.device, torch.Size, enum.Enum, type, types.ModuleType,
    types.FunctionType, types.BuiltinFunctionType, types.MethodType,
    types.BuiltinMethodType, functools.partial, memoryview,
)

_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)


def collect_model_tensors(model: nn.Module, *, max_depth: int = 6,
                          exclude: frozenset[str] = DEFAULT_EXCLUDE) -> dict[str, torch.Tensor]:
    """Name every tensor storage ``model`` holds, once each, in a deterministic order.

    Args:
        model: a loaded (and post-processed) model.
        max_depth: how many attribute hops below a module the walk follows into
            non-module objects (kernel objects rarely nest more than three deep).
        exclude: attribute names never followed (see :data:`DEFAULT_EXCLUDE`).

    Returns:
        ``{name: tensor}``: tensors detached from autograd that share memory with the
        model, so writing into them (a pull) updates the model in place. Tensors on the
        ``meta`` device and empty storages are left out.

    Raises:
        ValueError: two different storages got the same name (a bug in the walk).
    """
    walker = _Walker(model, max_depth=max_depth, exclude=exclude)
    return _dedupe_storages(walker.walk())


def collect_loaded_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights in their *loaded* form: parameters and buffers, once per storage.

    This is what vLLM's ``load_weights`` fills and ``process_weights_after_loading``
    starts from. Call it between the two: the returned tensors share memory with the
    model's parameters at that moment, and keep that memory alive if post-processing
    later replaces a parameter (so a source can still serve the loaded form).

    Args:
        model: a model built by vLLM (weights loaded, or about to be pulled into).

    Returns:
        ``{name: tensor}`` in ``named_parameters`` then ``named_buffers`` order; tied
        weights and views appear once (see :func:`collect_model_tensors`); tensors on
        the ``meta`` device and empty ones are left out.

    Raises:
        ValueError: two different storages got the same name (a bug).
    """
    def items() -> Iterator[tuple[str, torch.Tensor]]:
        yield from model.named_parameters(remove_duplicate=False)
        yield from model.named_buffers(remove_duplicate=False)

    return _dedupe_storages(items())


class _Walker:
    """One traversal; ``_seen`` stops cycles and repeated shared objects."""

    def __init__(self, model: nn.Module, *, max_depth: int, exclude: frozenset[str]) -> None:
        self._model = model
        self._max_depth = max_depth
        self._exclude = exclude
        self._seen: set[int] = set()
        # Modules of the tree are walked in named_modules() order under their own
        # names; a reference to one from an attribute is not a second copy.
        self._tree_modules = {id(m) for m in model.modules()}

    def walk(self) -> Iterator[tuple[str, torch.Tensor]]:
        for mod_name, module in self._model.named_modules():
            self._seen.add(id(module))
            prefix = f"{mod_name}." if mod_name else ""
            yield from self._module_own(prefix, module, depth=0)

    def _module_own(self, prefix: str, module: nn.Module,
                    depth: int) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in module._parameters.items():
            if param is not None and name not in self._exclude:
                yield from self._value(prefix + name, param, depth)
        for name, buf in module._buffers.items():
            if buf is not None and name not in self._exclude:
                yield from self._value(prefix + name, buf, depth)
        for name, value in vars(module).items():
            if name in _MODULE_INTERNALS or name in self._exclude:
                continue
            yield from self._value(prefix + name, value, depth + 1)

    def _value(self, path: str, value: Any, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(value, torch.Tensor):
            yield from self._tensor(path, value, depth)
            return
        if isinstance(value, _LEAF_TYPES) or depth > self._max_depth:
            return
        if id(value) in self._seen:
            return
        self._seen.add(id(value))
        if isinstance(value, nn.Module):
            if id(value) in self._tree_modules:
                return
            # A module held outside the tree (e.g. a kernel's helper module): walk it
            # like an object, including its own submodules.
            yield from self._module_own(path + ".", value, depth)
            for sub_name, sub in value._modules.items():
                if sub is not None:
                    yield from self._value(f"{path}.{sub_name}", sub, depth + 1)
            return
        if isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                yield from self._value(f"{path}.{index}", item, depth + 1)
            return
        if isinstance(value, dict):
            for key, item in value.items():
                # Only keys that name the same slot in every process.
                if isinstance(key, (str, int)) and key not in self._exclude:
                    yield from self._value(f"{path}.{key}", item, depth + 1)
            return
        if isinstance(value, (set, frozenset)):
            # Unordered: no stable name. No vLLM kernel keeps weights in a set today.
            if any(isinstance(item, torch.Tensor) for item in value):
                logger.warning("modelexpress: %s is a set holding tensors; they are not "
                               "transferred (no stable order to name them)", path)
            return
        yield from self._object(path, value, depth)

    def _object(self, path: str, value: Any, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
        # vars() and __slots__ only: reading properties could run foreign code.
        attrs: dict[str, Any] = {}
        if dataclasses.is_dataclass(value) or hasattr(value, "__dict__"):
            try:
                attrs.update(vars(value))
            except TypeError:
                pass  # e.g. a C-level object exposing __dict__ as a property
        for cls in type(value).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if isinstance(slot, str) and slot not in ("__dict__", "__weakref__"):
                    try:
                        attrs.setdefault(slot, object.__getattribute__(value, slot))
                    except AttributeError:
                        pass  # an unset slot
        for name, item in attrs.items():
            if name not in self._exclude:
                yield from self._value(f"{path}.{name}", item, depth + 1)

    def _tensor(self, path: str, tensor: torch.Tensor,
                depth: int) -> Iterator[tuple[str, torch.Tensor]]:
        if type(tensor) not in _PLAIN_TENSOR_TYPES and hasattr(tensor, "__tensor_flatten__"):
            # A wrapper subclass (torchao and friends) owns no storage of its own; its
            # data lives in the inner tensors it names.
            if id(tensor) in self._seen:
                return
            self._seen.add(id(tensor))
            inner_names, _ctx = tensor.__tensor_flatten__()
            for inner in inner_names:
                yield from self._value(f"{path}.{inner}", getattr(tensor, inner), depth + 1)
            return
        yield path, tensor


def _dedupe_storages(items: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    groups: dict[tuple[str, int], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in items:
        if tensor.device.type == "meta":
            logger.debug("modelexpress: %s is on the meta device; skipped", name)
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            continue
        groups.setdefault((str(tensor.device), storage.data_ptr()), []).append((name, tensor))

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
