"""modelexpress.shm_arena: zero-copy tensor IPC through one shared-memory arena.

One writer copies a large CPU tensor into the arena once; every local reader gets
a tensor viewing the same bytes. Usable without vLLM: an :class:`ArenaWriter`
with an :class:`ArenaPickler` on the sending side, an :class:`ArenaReader`
attached by the writer's :class:`ArenaHandle` on each receiving side. The
protocol (layout, states, ordering) is drawn in :mod:`modelexpress.shm_arena.arena`.
This package imports torch and numpy (it needs them); ``import modelexpress``
does not import it.
"""

from modelexpress.shm_arena.allocator import ExtentAllocator
from modelexpress.shm_arena.arena import (
    LAYOUT_VERSION,
    ArenaHandle,
    ArenaReader,
    ArenaWriter,
    Placement,
    lookup_reader,
)
from modelexpress.shm_arena.atomics import NATIVE as NATIVE_ATOMICS
from modelexpress.shm_arena.metrics import DECLINE_REASONS, ArenaCounters, CounterSnapshot
from modelexpress.shm_arena.pickler import (
    ArenaPickler,
    decline_reason,
    rebuild_parameter,
    rebuild_tensor,
)
from modelexpress.shm_arena.pinning import (
    CompletionEvent,
    CudaPinner,
    NoPinner,
    Pinner,
    default_pinner,
)
from modelexpress.shm_arena.segment import SHM_DIR, ShmSegment, check_shm_free_space

__all__ = [
    "ArenaCounters",
    "ArenaHandle",
    "ArenaPickler",
    "ArenaReader",
    "ArenaWriter",
    "CompletionEvent",
    "CounterSnapshot",
    "CudaPinner",
    "DECLINE_REASONS",
    "ExtentAllocator",
    "LAYOUT_VERSION",
    "NATIVE_ATOMICS",
    "NoPinner",
    "Pinner",
    "Placement",
    "SHM_DIR",
    "ShmSegment",
    "check_shm_free_space",
    "decline_reason",
    "default_pinner",
    "lookup_reader",
    "rebuild_parameter",
    "rebuild_tensor",
]
