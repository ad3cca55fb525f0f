"""The pickler that diverts large CPU tensors into the arena, and the rebuild functions.

``pickle.Pickler.reducer_override`` is consulted for every object before the
``dispatch_table`` and ``__reduce_ex__``. For a qualifying tensor it copies the
bytes into the arena once and returns a stub of a few dozen bytes; for anything
else it returns ``NotImplemented`` and the object is pickled exactly as without
the arena (for vLLM: its ``_reduce_tensor`` out-of-band path). Pickle's memo sees
the stub like any reduce value, so a tensor that appears twice in one message is
copied once.

Dispatch is on the EXACT type: ``torch.Tensor`` and ``torch.nn.Parameter`` (which
comes back as a Parameter sharing the arena storage). Any other subclass is
declined: rebuilding it from bytes would silently return a plain tensor.
"""

from __future__ import annotations

import pickle
from typing import Any, BinaryIO, Callable

import torch

from modelexpress.shm_arena.arena import ArenaWriter, Placement, lookup_reader

__all__ = ["ArenaPickler", "decline_reason", "rebuild_tensor", "rebuild_parameter"]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"shm arena stub names an unknown dtype {name!r}")
    return dtype


def rebuild_tensor(name: str, descriptor: int, gen: int, offset: int, nbytes: int,
                   dtype: str, shape: tuple[int, ...], requires_grad: bool) -> torch.Tensor:
    """Unpickle hook: a zero-copy view of the arena extent named by the stub."""
    reader = lookup_reader(name)
    tensor = reader.tensor(descriptor, gen, offset, nbytes, _dtype(dtype), shape)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def rebuild_parameter(name: str, descriptor: int, gen: int, offset: int, nbytes: int,
                      dtype: str, shape: tuple[int, ...],
                      requires_grad: bool) -> torch.nn.Parameter:
    """Unpickle hook for ``nn.Parameter``: wraps (shares) the same arena storage."""
    tensor = lookup_reader(name).tensor(descriptor, gen, offset, nbytes, _dtype(dtype), shape)
    return torch.nn.Parameter(tensor, requires_grad=requires_grad)


_REBUILD: dict[type, Callable[..., Any]] = {
    torch.Tensor: rebuild_tensor,
    torch.nn.Parameter: rebuild_parameter,
}


def decline_reason(tensor: torch.Tensor, min_bytes: int, capacity: int) -> str | None:
    """Why ``tensor`` (of an exact diverted type) cannot go to the arena, or None.

    The order matters for the counters: a tensor is counted under the first
    reason that applies.
    """
    if tensor.device.type != "cpu" or tensor.layout is not torch.strided:
        return "unsupported"
    if tensor.requires_grad and not tensor.is_leaf:
        return "unsupported"  # torch refuses to pickle these too
    if tensor.is_conj() or tensor.is_neg():
        return "unsupported"  # lazy bits: the raw bytes are not the values
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0 or nbytes < min_bytes:
        return "small"
    if not tensor.is_contiguous():
        return "non_contiguous"
    if nbytes > capacity:
        return "oversize"
    return None


class ArenaPickler(pickle.Pickler):
    """A protocol-5 pickler whose ``reducer_override`` diverts large tensors.

    Args:
        file: where the pickle stream goes.
        writer: the arena that receives the tensor bytes.
        min_tensor_bytes: smaller tensors take the normal path (default: the writer's).
        protocol: pickle protocol (5 for out-of-band buffers).
        buffer_callback: passed to :class:`pickle.Pickler` unchanged.
    """

    def __init__(self, file: BinaryIO, writer: ArenaWriter, *,
                 min_tensor_bytes: int | None = None,
                 protocol: int = pickle.HIGHEST_PROTOCOL,
                 buffer_callback: Callable[[pickle.PickleBuffer], Any] | None = None) -> None:
        super().__init__(file, protocol=protocol, buffer_callback=buffer_callback)
        self._writer = writer
        self._min_bytes = (writer.min_tensor_bytes if min_tensor_bytes is None
                           else min_tensor_bytes)
        self._placed: list[Placement] = []

    def dump(self, obj: Any) -> None:
        """Pickle ``obj``; if pickling fails, the tensors already placed are taken back."""
        self._placed = []
        try:
            super().dump(obj)
        except BaseException:
            self._writer.abort(self._placed)
            raise

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        rebuild = _REBUILD.get(cls)
        if rebuild is None:
            if isinstance(obj, torch.Tensor):
                self._writer.counters.record_declined("subclass", _nbytes(obj))
            return NotImplemented
        counters = self._writer.counters
        reason = decline_reason(obj, self._min_bytes, self._writer.capacity)
        if reason is not None:
            counters.record_declined(reason, _nbytes(obj))
            return NotImplemented
        try:
            src = obj.detach().reshape(-1).view(torch.uint8)
        except RuntimeError:
            counters.record_declined("unsupported", _nbytes(obj))
            return NotImplemented
        placement = self._writer.place(src)
        if placement is None:
            counters.record_declined("full", src.numel())
            return NotImplemented
        self._placed.append(placement)
        return rebuild, (self._writer.name, placement.descriptor, placement.gen,
                         placement.offset, placement.nbytes,
                         str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                         bool(obj.requires_grad))


def _nbytes(tensor: torch.Tensor) -> int:
    try:
        return tensor.numel() * tensor.element_size()
    except RuntimeError:
        return 0
