"""The arena: one shared segment, one writer, N zero-copy readers, no locks.

Layout of the segment (all words little-endian u64, 8-byte aligned)::

    0                4096                              data_offset            size
    +----------------+---------------------------------+---------------------+
    | header         | descriptor table                | data region         |
    | magic, version | n_descriptors x stride bytes    | tensors, variable   |
    | n_readers, ... | (stride = 8*(1+n_readers) -> 64)| size, page aligned  |
    +----------------+---------------------------------+---------------------+

    descriptor d:   +0: gen        written by the writer only
                    +8*(1+r): ack[r]  written by reader r only

Every shared word has exactly ONE writing process, so the protocol needs no
read-modify-write, only release stores and acquire loads (see ``atomics``).
``gen`` values come from one 64-bit counter starting at 1 and never repeat, so a
stale ack can never match a later use of the descriptor (no ABA).

State of descriptor d (the writer also keeps, privately, which data extent
d covers; readers learn it from the pickled stub, never from shared memory):

=====================  =====================  ==================================
gen                    ack[0..N-1]            meaning
=====================  =====================  ==================================
0                      0...0                  never used: free
g                      some ack[r] != g       published, some reader still holds it
g                      all ack[r] == g        released by every reader: free
=====================  =====================  ==================================

Writer (``ArenaWriter.place``, never blocks):
  1. reclaim: for each live descriptor, ``load_acquire(ack[r]) == gen`` for all r
     -> return its extent to the allocator. The acquire pairs with the reader's
     release, so every reader's last read of those bytes happened before the
     writer overwrites them.
  2. take a free descriptor and a free extent; none -> decline ("full").
  3. memcpy the tensor into the extent.
  4. ``store_release(gen, g)``: the bytes of step 3 are visible to any process
     that acquires ``gen == g``.
  5. the pickled stub (name, d, g, offset, nbytes, dtype, shape) travels in the
     message; the queue's own ordering delivers it.

Reader (``ArenaReader.tensor``):
  1. ``load_acquire(gen) == g`` (else the protocol is broken: raise).
  2. a tensor viewing the extent; no byte is copied or touched.
  3. when the tensor's storage is freed (every view and wrapper gone) and, if the
     mapping is pinned, a CUDA event recorded after the consuming H2D has
     completed: ``store_release(ack[r], g)``.

A descriptor whose message never reaches a reader (a reader died) stays live:
the arena shrinks and the writer declines with "full"; it never waits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import threading
import weakref
from typing import Any

import numpy as np
import torch

from modelexpress._closing import Closeable
from modelexpress.errors import ConfigError, ShmArenaError
from modelexpress.shm_arena import atomics
from modelexpress.shm_arena.allocator import ExtentAllocator
from modelexpress.shm_arena.metrics import ArenaCounters
from modelexpress.shm_arena.pinning import CompletionEvent, NoPinner, Pinner
from modelexpress.shm_arena.segment import ShmSegment

__all__ = ["ArenaHandle", "Placement", "ArenaWriter", "ArenaReader", "lookup_reader",
           "LAYOUT_VERSION"]

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
_MAGIC = int.from_bytes(b"MXSHMAR1", "little")
_HEADER_BYTES = 4096
# magic, version, n_readers, n_descriptors, stride, data_offset, data_bytes, creator pid
_HEADER = struct.Struct("<8Q")
_ALIGN = 4096
_MAX_READERS = 1024

# Reader registry: segment name -> this process's attached reader. Weak: the
# queue that attached it owns it; an entry vanishes with the reader, so nothing
# here keeps a mapping (or its pinned registration) alive. The rebuild functions
# in ``pickler`` resolve stubs through it.
_READERS: "weakref.WeakValueDictionary[str, ArenaReader]" = weakref.WeakValueDictionary()


def lookup_reader(name: str) -> "ArenaReader":
    """The reader attached to segment ``name`` in this process.

    Raises:
        ShmArenaError: none is attached (the queue was not created through an
            installed arena, or it was closed).
    """
    try:
        return _READERS[name]
    except KeyError:
        raise ShmArenaError(
            f"shm tensor arena {name!r} is not attached in process {os.getpid()}: the "
            "reader's queue must be created after install_shm_tensor_arena() ran in this "
            "process (the vLLM plugin does it when MX_SHM_TENSOR_ARENA=1)") from None


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


@dataclasses.dataclass(frozen=True)
class ArenaHandle:
    """What a reader needs to attach: picklable, a few dozen bytes."""

    name: str
    n_readers: int
    n_descriptors: int
    size: int
    layout_version: int = LAYOUT_VERSION


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the writer put one tensor; becomes the pickled stub."""

    descriptor: int
    gen: int
    offset: int
    nbytes: int


class _Layout:
    """Offsets shared by writer and reader."""

    def __init__(self, n_readers: int, n_descriptors: int) -> None:
        self.n_readers = n_readers
        self.n_descriptors = n_descriptors
        self.stride = _round_up(8 * (1 + n_readers), 64)  # one cache line or more per descriptor
        self.data_offset = _round_up(_HEADER_BYTES + n_descriptors * self.stride, _ALIGN)

    def gen_offset(self, desc: int) -> int:
        return _HEADER_BYTES + desc * self.stride

    def ack_offset(self, desc: int, reader: int) -> int:
        return _HEADER_BYTES + desc * self.stride + 8 * (1 + reader)


class ArenaWriter(Closeable):
    """The single writer: creates the segment and places tensors in it.

    Args:
        n_readers: readers that must each release a tensor before its space is reused.
        capacity_bytes: size of the data region.
        n_descriptors: most tensors live at once (each needs one descriptor).
        min_tensor_bytes: the default divert threshold of picklers over this arena.
        prefault: fault the whole segment in from a background thread right away,
            so no message pays first-touch page allocation.

    Raises:
        ConfigError: a bad argument (the message says the allowed range).
        ShmSpaceError: ``/dev/shm`` is too small.
        ShmArenaError: the segment could not be created.
    """

    def __init__(self, n_readers: int, capacity_bytes: int, *, n_descriptors: int = 256,
                 min_tensor_bytes: int = 1 << 20, prefault: bool = True,
                 log_interval_s: float = 60.0) -> None:
        if not 1 <= n_readers <= _MAX_READERS:
            raise ConfigError(f"n_readers must be in 1..{_MAX_READERS} (got {n_readers})")
        if capacity_bytes < _ALIGN:
            raise ConfigError(f"capacity_bytes must be at least {_ALIGN} (got {capacity_bytes})")
        if min_tensor_bytes < 1:
            raise ConfigError(f"min_tensor_bytes must be at least 1 (got {min_tensor_bytes})")
        if n_descriptors < 1:
            raise ConfigError(f"n_descriptors must be at least 1 (got {n_descriptors})")
        self._layout = _Layout(n_readers, n_descriptors)
        capacity = _round_up(capacity_bytes, _ALIGN)
        size = self._layout.data_offset + capacity
        self._segment = ShmSegment.create(size)
        try:
            self._init_state(n_readers, n_descriptors, capacity, size, min_tensor_bytes,
                             log_interval_s)
        except BaseException:
            self._segment.close()  # never leave a segment behind a failed constructor
            raise
        if prefault:
            self._segment.start_populate(0)
        self._finalizer = weakref.finalize(self, _close_writer, self._segment, self.__dict__)
        log.info("shm tensor arena %s: %d MiB for %d readers, %d descriptors%s",
                 self.handle.name, capacity >> 20, n_readers, n_descriptors,
                 ", pre-faulting" if prefault else "")

    def _init_state(self, n_readers: int, n_descriptors: int, capacity: int, size: int,
                    min_tensor_bytes: int, log_interval_s: float) -> None:
        mm = self._segment.mm
        _HEADER.pack_into(mm, 0, _MAGIC, LAYOUT_VERSION, n_readers, n_descriptors,
                          self._layout.stride, self._layout.data_offset, capacity, os.getpid())
        self.handle = ArenaHandle(self._segment.name, n_readers, n_descriptors, size)
        self.capacity = capacity
        self.min_tensor_bytes = min_tensor_bytes
        self.counters = ArenaCounters(log_interval_s)
        self._alloc = ExtentAllocator(capacity, _ALIGN)
        self._free_desc = list(range(n_descriptors - 1, -1, -1))  # pop() -> lowest first
        self._live: dict[int, Placement] = {}
        self._next_gen = 1
        self._lock = threading.Lock()
        # One uint8 tensor over the data region, sliced per tensor (slicing a
        # tensor costs ~1 us; a new frombuffer per message would cost more).
        self._data = torch.frombuffer(mm, dtype=torch.uint8, offset=self._layout.data_offset,
                                      count=capacity)

    @property
    def name(self) -> str:
        """Segment name (what readers attach by)."""
        return self.handle.name

    def wait_warm(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for pre-faulting to finish; True when done (or off)."""
        return self._segment.wait_populated(timeout)

    @property
    def prefault_seconds(self) -> float | None:
        """How long pre-faulting took, once done."""
        return self._segment.populate_seconds

    def place(self, src: torch.Tensor) -> Placement | None:
        """Copy a contiguous uint8 CPU tensor into the arena.

        Args:
            src: 1-D contiguous ``torch.uint8`` view of the tensor's bytes.

        Returns:
            Where it went, or None when no descriptor or extent is free right now
            (the caller takes the normal path; this never waits).

        Raises:
            ShmArenaError: the writer is closed.
        """
        nbytes = src.numel()
        with self._lock:
            if self._segment.closed:
                raise ShmArenaError(f"shm tensor arena {self.name} is closed")
            self._reclaim_locked()
            if not self._free_desc:
                return None
            offset = self._alloc.alloc(nbytes)
            if offset is None:
                return None
            desc = self._free_desc.pop()
            gen = self._next_gen
            self._next_gen += 1
            if not atomics.copy_in(self._segment.mm, self._layout.data_offset + offset, src):
                self._data[offset:offset + nbytes].copy_(src)
            # ORDER: publish only after the copy; release makes the bytes visible
            # before any reader can acquire this gen.
            atomics.store_release(self._segment.mm, self._layout.gen_offset(desc), gen)
            placement = Placement(desc, gen, offset, nbytes)
            self._live[desc] = placement
        self.counters.record_diverted(nbytes)
        return placement

    def abort(self, placements: list[Placement]) -> None:
        """Take back placements whose message was never sent (pickling failed).

        No reader ever saw their stubs, so their space is free again at once.
        """
        with self._lock:
            for p in placements:
                if self._live.get(p.descriptor) == p:
                    del self._live[p.descriptor]
                    self._alloc.free(p.offset, p.nbytes)
                    self._free_desc.append(p.descriptor)
                    self.counters.record_released(p.nbytes)

    def reclaim(self) -> int:
        """Return the space of every tensor all readers released; returns how many."""
        with self._lock:
            return self._reclaim_locked()

    def _reclaim_locked(self) -> int:
        if not self._live:
            return 0
        mm = self._segment.mm
        layout = self._layout
        done = []
        for desc, p in self._live.items():
            # ORDER: acquire pairs with each reader's release of its ack, so the
            # readers' last loads of the extent precede our next store into it.
            if all(atomics.load_acquire(mm, layout.ack_offset(desc, r)) == p.gen
                   for r in range(layout.n_readers)):
                done.append(p)
        for p in done:
            del self._live[p.descriptor]
            self._alloc.free(p.offset, p.nbytes)
            self._free_desc.append(p.descriptor)
            self.counters.record_released(p.nbytes)
        return len(done)

    def stats(self) -> dict[str, Any]:
        """Capacity, use and counters, for logs and diagnostics."""
        with self._lock:
            snap = self.counters.snapshot()
            return {"name": self.name, "capacity": self.capacity, "used": self._alloc.used,
                    "live_tensors": len(self._live), "largest_free": self._alloc.largest_free,
                    "diverted": snap.diverted, "diverted_bytes": snap.diverted_bytes,
                    "declined": snap.declined}

    def close(self) -> None:
        """Unlink the segment (creator process only) and unmap it. Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._segment.closed


def _close_writer(segment: ShmSegment, state: dict[str, Any]) -> None:
    # Drop our own view of the mapping first, or the unmap sees it as exported.
    state.pop("_data", None)
    segment.close()


class ArenaReader(Closeable):
    """One reader's attachment to a writer's segment.

    Args:
        handle: the writer's :class:`ArenaHandle`.
        reader_rank: this reader's index, ``0 <= reader_rank < handle.n_readers``.
        pinner: page-locks the mapping lazily and records completion events.
        register: put this reader in the process registry that stub rebuilds use.

    Raises:
        ConfigError: bad rank or an incompatible layout version.
        ShmArenaError: the segment is missing or its header does not match.
    """

    def __init__(self, handle: ArenaHandle, reader_rank: int, *, pinner: Pinner | None = None,
                 register: bool = True) -> None:
        if handle.layout_version != LAYOUT_VERSION:
            raise ConfigError(f"arena layout version {handle.layout_version} is not supported "
                              f"(this modelexpress speaks {LAYOUT_VERSION}); run the same "
                              "modelexpress version in the writer and the readers")
        if not 0 <= reader_rank < handle.n_readers:
            raise ConfigError(f"reader_rank must be in 0..{handle.n_readers - 1} "
                              f"(got {reader_rank})")
        self.handle = handle
        self.reader_rank = reader_rank
        self._segment = ShmSegment.attach(handle.name, handle.size)
        fields = _HEADER.unpack_from(self._segment.mm, 0)
        if fields[0] != _MAGIC or fields[2:4] != (handle.n_readers, handle.n_descriptors):
            self._segment.close()
            raise ShmArenaError(f"segment {handle.name} is not the arena its handle describes "
                                f"(header {fields[:4]})")
        self._layout = _Layout(handle.n_readers, handle.n_descriptors)
        self._pinner: Pinner = pinner if pinner is not None else NoPinner()
        self._pin_tried = False
        self._pinned_address: int | None = None
        # Releases waiting for the next flush (pinned path), then for their event.
        self._pending: list[tuple[int, int]] = []
        self._deferred: list[tuple[CompletionEvent, list[tuple[int, int]]]] = []
        self._finalizer = weakref.finalize(self, _close_reader, self._segment, self._pinner,
                                           self.__dict__)
        if register:
            _READERS[handle.name] = self

    @property
    def pinned(self) -> bool:
        """True once the mapping is page-locked in this process."""
        return self._pinned_address is not None

    def pin_now(self) -> bool:
        """Page-lock the mapping now if this process has a device context; True if pinned.

        Called at attach by the vLLM adapter so the one-time registration is not
        paid inside the first message; otherwise it happens at the first tensor.
        """
        self._ensure_pinned()
        return self.pinned

    def warm_up(self) -> None:
        """Run the rebuild path once, on the segment header; nothing is acknowledged.

        Called at attach by the vLLM adapter (like :meth:`pin_now`) so a worker's
        first message does not pay this path's first-call costs (in a forked worker
        also the copy-on-write faults of the pages the path touches) inside its
        latency. Reads no data extent.
        """
        holder = np.frombuffer(self._segment.mm, dtype=np.uint8, count=64, offset=0)
        weakref.finalize(holder, _noop)
        view = torch.from_numpy(holder).view(torch.bfloat16).view((32,))
        del view, holder

    def _ensure_pinned(self) -> None:
        if self._pin_tried or not self._pinner.can_pin():
            return
        self._pin_tried = True
        holder = np.frombuffer(self._segment.mm, dtype=np.uint8)
        address = holder.ctypes.data
        del holder  # the address stays valid as long as the mapping does
        if self._pinner.register(address, self._segment.size):
            self._pinned_address = address

    def tensor(self, descriptor: int, gen: int, offset: int, nbytes: int,
               dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor viewing a placed extent; zero bytes copied, no page touched.

        The extent is released when the storage is freed (all views and wrappers
        gone) and, when pinned, once the next completion event after that is done.

        Raises:
            ShmArenaError: the descriptor does not hold ``gen`` (a protocol violation:
                the writer reused space a reader had not released), or the stub is bad.
        """
        layout = self._layout
        if not 0 <= descriptor < layout.n_descriptors or offset < 0 or \
                layout.data_offset + offset + nbytes > self._segment.size:
            raise ShmArenaError(f"stub (descriptor {descriptor}, offset {offset}, {nbytes} "
                                f"bytes) is outside arena {self.handle.name}")
        # ORDER: acquire pairs with the writer's release of gen; the bytes are ours after it.
        current = atomics.load_acquire(self._segment.mm, layout.gen_offset(descriptor))
        if current != gen:
            raise ShmArenaError(f"arena {self.handle.name} descriptor {descriptor} holds "
                                f"generation {current}, the message expects {gen}")
        self._ensure_pinned()
        holder = np.frombuffer(self._segment.mm, dtype=np.uint8, count=nbytes,
                               offset=layout.data_offset + offset)
        # The storage of every tensor made from `holder` keeps it alive, so this
        # fires only when the last view/wrapper of the storage is gone. (The
        # tensor itself cannot carry the finalizer: views do not keep it alive.)
        weakref.finalize(holder, self._storage_freed, descriptor, gen)
        return torch.from_numpy(holder).view(dtype).view(shape)

    def _storage_freed(self, descriptor: int, gen: int) -> None:
        # Runs in whatever thread freed the storage (GC included): only an atomic
        # store or a list append (atomic under the GIL) happen here.
        if self._pinned_address is None:
            self._ack(descriptor, gen)
        else:
            self._pending.append((descriptor, gen))

    def _ack(self, descriptor: int, gen: int) -> None:
        try:
            # ORDER: release: this reader's loads of the extent precede the writer's reuse.
            atomics.store_release(self._segment.mm, self._layout.ack_offset(descriptor,
                                                                            self.reader_rank), gen)
        except (ValueError, BufferError):
            pass  # the mapping is already closed: the writer is gone too

    def flush_releases(self) -> None:
        """Acknowledge pinned releases whose H2D has completed. Call once per receive."""
        if self._deferred:
            waiting = []
            for event, items in self._deferred:
                if event.query():
                    for d, g in items:
                        self._ack(d, g)
                else:
                    waiting.append((event, items))
            self._deferred = waiting
        if not self._pending:
            return
        items = []
        while self._pending:  # pop in place: a finalizer may append concurrently
            items.append(self._pending.pop())
        event = self._pinner.record_event()
        if event is None:
            for d, g in items:
                self._ack(d, g)
        else:
            self._deferred.append((event, items))

    def close(self) -> None:
        """Unpin and unmap (the mapping stays while tensors view it). Idempotent."""
        self._finalizer()


def _noop() -> None:
    return None


def _close_reader(segment: ShmSegment, pinner: Pinner, state: dict[str, Any]) -> None:
    address = state.get("_pinned_address")
    if address is not None:
        state["_pinned_address"] = None
        pinner.unregister(address)
    segment.close()
