"""ExtentAllocator: first fit at the lowest address, coalescing, double-free detection."""

from __future__ import annotations

import logging
import random

import pytest

from modelexpress.shm_arena import ExtentAllocator

log = logging.getLogger(__name__)


def test_first_fit_lowest_address_and_coalescing() -> None:
    a = ExtentAllocator(16 * 4096, 4096)
    x = a.alloc(4096)
    y = a.alloc(5000)  # rounds to two pages
    z = a.alloc(1)
    assert (x, y, z) == (0, 4096, 3 * 4096)
    a.free(y, 5000)
    assert a.alloc(4096) == 4096  # the hole at the bottom is reused first (warm pages)
    a.free(4096, 4096)
    a.free(x, 4096)
    a.free(z, 1)
    assert a.free_extents() == [(0, 16 * 4096)]
    assert a.used == 0


def test_larger_than_any_fixed_slot_fits_while_contiguous_space_remains() -> None:
    a = ExtentAllocator(100 * 4096, 4096)
    assert a.alloc(90 * 4096) == 0
    assert a.alloc(11 * 4096) is None  # only 10 pages left
    assert a.alloc(10 * 4096) == 90 * 4096


def test_double_free_and_bad_extent_raise() -> None:
    a = ExtentAllocator(8 * 4096, 4096)
    off = a.alloc(4096)
    a.free(off, 4096)
    with pytest.raises(ValueError, match="already free"):
        a.free(off, 4096)
    with pytest.raises(ValueError, match="outside"):
        a.free(8 * 4096, 4096)
    with pytest.raises(ValueError, match="power of two"):
        ExtentAllocator(4096, 3000)


def test_random_sequence_matches_a_page_bitmap() -> None:
    seed = random.randrange(1 << 30)
    log.info("seed=%d", seed)
    rng = random.Random(seed)
    pages = 256
    a = ExtentAllocator(pages * 4096, 4096)
    used = [False] * pages
    live: list[tuple[int, int]] = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off, n = live.pop(rng.randrange(len(live)))
            a.free(off, n)
            for p in range(off // 4096, off // 4096 + -(-n // 4096)):
                used[p] = False
        else:
            n = rng.randint(1, 20 * 4096)
            need = -(-n // 4096)
            off = a.alloc(n)
            # reference: the lowest run of `need` free pages
            expect = next((s for s in range(pages - need + 1)
                           if not any(used[s:s + need])), None)
            assert (None if off is None else off // 4096) == expect, f"seed={seed}"
            if off is not None:
                for p in range(off // 4096, off // 4096 + need):
                    used[p] = True
                live.append((off, n))
        assert a.used == sum(used) * 4096, f"seed={seed}"
