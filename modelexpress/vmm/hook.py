"""use_arena: route PyTorch's CUDA allocations into a VmmArena.

PyTorch's caching allocator takes a pluggable allocator per ``torch.cuda.MemPool``:
allocations made on this thread inside ``use_arena`` go to a pool whose segments
come from ``mx_malloc`` / ``mx_free`` in ``_alloc_ext`` (so the arena sees
segment-sized requests: small tensors are packed into 2 MiB and 20 MiB segments,
large ones rounded to 2 MiB, as under the stock allocator).

Lifetimes, which PyTorch and vLLM both got wrong once (segfaults from callbacks
collected while the caching allocator still called them):

* the ``CUDAPluggableAllocator`` (it dlopens our .so and holds the function
  pointers) is created once and kept for the process lifetime;
* each arena's ``MemPool`` is kept alive by the arena itself until ``close()``,
  which first drops the pool (its destructor empties the pool's cached segments
  through ``mx_free`` while the arena can still unmap them) and only then unmaps.
  Dropping it earlier would let the caching allocator free segments into a closed
  arena; keeping it for the whole process would keep freed arenas' VA in the pool.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator

from modelexpress.errors import ArenaError, ConfigError, DependencyError
from modelexpress.vmm._core import ExtCore, extension_error, load_extension
from modelexpress.vmm.arena import VmmArena

__all__ = ["ARENA_AVAILABLE", "use_arena"]

log = logging.getLogger(__name__)

ARENA_AVAILABLE: bool = load_extension() is not None
"""True when the C extension is built (the CUDA arena path can be used)."""

_lock = threading.Lock()
_allocator: Any = None  # process lifetime, on purpose (see module docstring)
_active: VmmArena | None = None


def _pluggable_allocator(torch: Any, ext: Any) -> Any:
    global _allocator
    with _lock:
        if _allocator is None:
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(
                ext.__file__, "mx_malloc", "mx_free")
        return _allocator


@contextlib.contextmanager
def use_arena(arena: VmmArena, device: int | None = None) -> Iterator[VmmArena]:
    """Route this thread's CUDA allocations into ``arena`` for the ``with`` body.

    Tensors allocated inside stay in the arena after the block; they must be gone
    before ``arena.close()``.

    Args:
        arena: an open arena with the CUDA backend and the C core.
        device: CUDA device ordinal (default: the arena's).

    Yields:
        The arena.

    Raises:
        DependencyError: the C extension or torch is missing.
        ConfigError: the arena is not a CUDA arena on the C core.
        ArenaError: another ``use_arena`` is active (nesting is refused).
    """
    global _active
    ext = load_extension()
    if ext is None:
        raise DependencyError(f"use_arena needs the _alloc_ext C extension, which is not "
                              f"built ({extension_error()}); reinstall with a C++ compiler")
    from modelexpress._optional import require
    torch = require("torch", "use_arena")
    if arena.backend.kind != "cuda" or not isinstance(arena._core, ExtCore):
        raise ConfigError("use_arena needs a CUDA arena on the C core "
                          f"(got backend {arena.backend.kind!r}); use arena.empty() on host")
    if arena.closed:
        raise ArenaError("use_arena on a closed VmmArena")
    dev = arena.device if device is None else device
    allocator = _pluggable_allocator(torch, ext)
    with _lock:
        if _active is not None:
            raise ArenaError("use_arena is already active; nesting is refused "
                             f"(active: {_active!r})")
        if not ext.set_active(arena._core.capsule):
            raise ArenaError("another arena is active in _alloc_ext; nesting is refused")
        _active = arena
    try:
        with torch.cuda.device(dev):
            pool = torch.cuda.MemPool(allocator.allocator())
        holder = [pool]

        def release_pool() -> None:
            # Kernels may still read the pool's blocks: finish them before unmapping.
            torch.cuda.synchronize(dev)
            holder.clear()  # ~MemPool empties the pool's cached segments via mx_free

        arena.add_close_callback(release_pool)
        del pool
        log.debug("use_arena: routing allocations on device %d into %r", dev, arena)
        with torch.cuda.use_mem_pool(holder[0], dev):
            yield arena
    finally:
        with _lock:
            ext.set_active(None)
            _active = None
