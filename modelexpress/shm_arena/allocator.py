"""Variable-size extent allocator for the arena's data region (writer-private).

Why variable-size: a fixed-slot arena refuses any tensor larger than a slot
(vLLM 0.33's arena: 8 x 256 MB, so a 300 MB tensor falls back although 2 GB are
free) and wastes the rest of a slot on every smaller tensor. Here the data
region is one range and each tensor gets exactly its (page-rounded) size.

Policy: first fit, lowest address first, with coalescing of neighbours on free.
Lowest-address-first keeps reusing the same warm pages (the steady-state working
set stays at the bottom of the region) instead of walking the whole region like
a ring would. Only the writer process allocates, under the writer's lock, so
this class needs no cross-process synchronisation; readers never see it.
"""

from __future__ import annotations

import bisect

__all__ = ["ExtentAllocator"]


class ExtentAllocator:
    """First-fit allocator over ``[0, capacity)`` with ``align``-byte granularity.

    Args:
        capacity: bytes managed.
        align: every offset and size is a multiple of this (a power of two).

    Raises:
        ValueError: capacity or align is invalid.
    """

    def __init__(self, capacity: int, align: int = 4096) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two (got {align})")
        if capacity < align:
            raise ValueError(f"capacity must be at least align={align} (got {capacity})")
        self.align = align
        self.capacity = capacity - capacity % align
        # Free extents as two parallel sorted lists (starts, ends): bisect needs
        # plain sorted sequences, and extents never overlap.
        self._starts: list[int] = [0]
        self._ends: list[int] = [self.capacity]
        self._used = 0

    def round(self, nbytes: int) -> int:
        """Size actually reserved for ``nbytes`` (rounded up to ``align``, at least one unit)."""
        return max(self.align, -(-nbytes // self.align) * self.align)

    @property
    def used(self) -> int:
        """Bytes currently allocated (rounded sizes)."""
        return self._used

    @property
    def largest_free(self) -> int:
        """Size of the largest free extent."""
        return max((e - s for s, e in zip(self._starts, self._ends)), default=0)

    def alloc(self, nbytes: int) -> int | None:
        """Reserve ``nbytes``; return the offset, or None when no extent fits."""
        size = self.round(nbytes)
        for i, (start, end) in enumerate(zip(self._starts, self._ends)):
            if end - start >= size:
                if end - start == size:
                    del self._starts[i]
                    del self._ends[i]
                else:
                    self._starts[i] = start + size
                self._used += size
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return an extent obtained from :meth:`alloc` (same ``nbytes``).

        Raises:
            ValueError: the extent overlaps free space (double free) or is out of range.
        """
        size = self.round(nbytes)
        end = offset + size
        if offset < 0 or end > self.capacity or offset % self.align:
            raise ValueError(f"extent [{offset}, {end}) is outside the arena or unaligned")
        i = bisect.bisect_left(self._starts, offset)
        overlaps_next = i < len(self._starts) and self._starts[i] < end
        overlaps_prev = i > 0 and self._ends[i - 1] > offset
        if overlaps_next or overlaps_prev:
            raise ValueError(f"extent [{offset}, {end}) is already free (double free)")
        merge_left = i > 0 and self._ends[i - 1] == offset
        merge_right = i < len(self._starts) and self._starts[i] == end
        if merge_left and merge_right:
            self._ends[i - 1] = self._ends[i]
            del self._starts[i]
            del self._ends[i]
        elif merge_left:
            self._ends[i - 1] = end
        elif merge_right:
            self._starts[i] = offset
        else:
            self._starts.insert(i, offset)
            self._ends.insert(i, end)
        self._used -= size

    def free_extents(self) -> list[tuple[int, int]]:
        """The free extents as ``(start, end)`` pairs, lowest first (for tests and diagnostics)."""
        return list(zip(self._starts, self._ends))
