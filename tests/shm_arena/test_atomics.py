"""Atomics: the C extension and the fallback agree; bounds and alignment are checked."""

from __future__ import annotations

import mmap

import pytest

from modelexpress.shm_arena import atomics


def test_native_extension_is_built() -> None:
    # CI builds the package with a compiler; a silent fallback would weaken ordering.
    assert atomics.NATIVE, "modelexpress.shm_arena._atomics did not build"


@pytest.mark.parametrize("load,store", [
    (atomics.load_acquire, atomics.store_release),
    (atomics.py_load_acquire, atomics.py_store_release),
])
def test_round_trip_and_checks(load, store) -> None:
    mm = mmap.mmap(-1, 4096)
    try:
        store(mm, 8, (1 << 64) - 1)
        store(mm, 16, 12345)
        assert load(mm, 8) == (1 << 64) - 1
        assert load(mm, 16) == 12345
        assert atomics.py_load_acquire(mm, 16) == atomics.load_acquire(mm, 16)
        assert mm[16:24] == (12345).to_bytes(8, "little")
        with pytest.raises(ValueError):
            load(mm, 4)  # unaligned
        with pytest.raises(ValueError):
            store(mm, 4096, 1)  # out of range
    finally:
        mm.close()


def test_populate_keeps_bytes() -> None:
    mm = mmap.mmap(-1, 1 << 20)
    try:
        mm[4096:4100] = b"keep"
        assert atomics.populate(mm, 0, 1 << 20) in ("madvise", "touch", "python")
        assert mm[4096:4100] == b"keep"
        with pytest.raises(ValueError):
            atomics.populate(mm, 1, 4096)  # not page aligned
    finally:
        mm.close()
