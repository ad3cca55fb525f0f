"""VmmArena bump math and error handling on the stub backend (no memory)."""

from __future__ import annotations

import pytest

from modelexpress.errors import (
    ArenaClosedError,
    ArenaExhaustedError,
    BackendError,
    ConfigError,
    InvalidFreeError,
)
from modelexpress.vmm import DEFAULT_TOTAL_BYTES, StubVmmBackend, VmmArena, VmmBackend

MiB = 1 << 20
GRAN = 2 * MiB


def make(use_extension: bool, total: int = 1 << 30, **kw) -> tuple[VmmArena, StubVmmBackend]:
    backend = StubVmmBackend(granularity=GRAN, **kw)
    return VmmArena(total, backend=backend, use_extension=use_extension), backend


def test_default_reserves_16_tib(use_extension):
    backend = StubVmmBackend()
    with VmmArena(backend=backend, use_extension=use_extension) as arena:
        assert arena.total_bytes == DEFAULT_TOTAL_BYTES == 16 << 40
        assert backend.calls[0] == ("reserve", (16 << 40,))
    assert isinstance(backend, VmmBackend)


def test_bump_alignment_and_rounding(use_extension):
    arena, backend = make(use_extension, total=GRAN * 10 + 1)  # rounds up to 11 granules
    assert arena.total_bytes == GRAN * 11
    sizes = [1, GRAN, GRAN + 1, 3 * GRAN - 7]
    vas = [arena.malloc(s) for s in sizes]
    assert [va - arena.base for va in vas] == [0, GRAN, 2 * GRAN, 4 * GRAN]
    assert all(va % GRAN == 0 for va in vas)
    assert arena.live_allocations() == [(vas[0], GRAN), (vas[1], GRAN), (vas[2], 2 * GRAN),
                                        (vas[3], 3 * GRAN)]
    assert arena.registered_range() == (arena.base, 7 * GRAN)
    assert arena.used_bytes == arena.mapped_bytes == 7 * GRAN
    assert arena.live_allocation_count == 4
    # create -> map -> set_access for every chunk, in that order
    assert [c for c, _ in backend.calls[1:4]] == ["create", "map", "set_access"]
    assert backend.counts["create"] == backend.counts["map"] == backend.counts["set_access"] == 4
    arena.close()


def test_holes_keep_bump_and_other_chunks(use_extension):
    arena, backend = make(use_extension)
    vas = [arena.malloc(GRAN) for _ in range(5)]
    arena.free(vas[2])
    arena.free(vas[0])
    assert arena.live_allocations() == [(vas[1], GRAN), (vas[3], GRAN), (vas[4], GRAN)]
    assert arena.used_bytes == 5 * GRAN  # holes do not move the bump pointer
    assert arena.mapped_bytes == 3 * GRAN
    nxt = arena.malloc(1)
    assert nxt == arena.base + 5 * GRAN  # no reuse of holes
    assert set(backend.mapped) == {vas[1], vas[3], vas[4], nxt}
    arena.close()
    assert backend.mapped == {} and backend.handles == set() and backend.reservations == {}


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8", True, None])
def test_bad_sizes_are_config_errors(use_extension, bad):
    arena, _ = make(use_extension)
    with pytest.raises(ConfigError, match="positive int"):
        arena.malloc(bad)
    arena.close()


def test_bad_total_bytes():
    with pytest.raises(ConfigError):
        VmmArena(0, backend=StubVmmBackend())
    with pytest.raises(ConfigError):
        StubVmmBackend(granularity=3 * MiB)


def test_double_free_and_unknown_free(use_extension):
    arena, _ = make(use_extension)
    va = arena.malloc(GRAN)
    arena.free(va)
    with pytest.raises(InvalidFreeError, match="not a live allocation"):
        arena.free(va)
    other = arena.malloc(2 * GRAN)
    with pytest.raises(InvalidFreeError):
        arena.free(other + GRAN)  # inside an allocation, not its start
    arena.close()


def test_exhausted(use_extension):
    arena, backend = make(use_extension, total=4 * GRAN)
    arena.malloc(3 * GRAN)
    with pytest.raises(ArenaExhaustedError, match="exhausted"):
        arena.malloc(GRAN + 1)
    assert arena.malloc(GRAN) == arena.base + 3 * GRAN  # exact fit still works
    assert backend.counts["create"] == 2  # the refused request never reached the backend
    arena.close()


def test_use_after_close_and_idempotent_close(use_extension):
    arena, backend = make(use_extension)
    va = arena.malloc(GRAN)
    arena.close()
    arena.close()
    assert arena.closed and backend.closed
    assert backend.mapped == {} and backend.handles == set()
    with pytest.raises(ArenaClosedError):
        arena.malloc(GRAN)
    with pytest.raises(ArenaClosedError):
        arena.free(va)
    assert arena.live_allocations() == [] and arena.mapped_bytes == 0


@pytest.mark.parametrize("step,undone", [
    ("create", []),
    ("map", ["release"]),
    ("set_access", ["unmap", "release"]),
])
def test_failure_at_each_step_rolls_back(use_extension, step, undone):
    arena, backend = make(use_extension, fail={step: 2})
    first = arena.malloc(GRAN)
    n = len(backend.calls)
    with pytest.raises(BackendError, match="injected"):
        arena.malloc(GRAN)
    steps = [c for c, _ in backend.calls[n:]]
    assert steps[steps.index(step) + 1:] == undone
    assert len(backend.handles) == 1 and set(backend.mapped) == {first}  # nothing leaked
    assert arena.used_bytes == GRAN and arena.live_allocation_count == 1
    assert arena.stats()["malloc_failures"] == 1
    assert arena.malloc(GRAN) == arena.base + GRAN  # the failed slot was given back
    arena.close()


def test_failed_rollback_keeps_original_error(use_extension):
    arena, backend = make(use_extension, fail={"set_access": 1, "unmap": 1})
    with pytest.raises(BackendError, match="set_access"):
        arena.malloc(GRAN)
    assert backend.counts["release"] == 1  # release still ran after the failed unmap
    arena.close()


def test_reserve_failure_leaves_nothing(use_extension):
    backend = StubVmmBackend(fail={"reserve": 1})
    with pytest.raises(BackendError):
        VmmArena(1 << 30, backend=backend, use_extension=use_extension)
    assert backend.reservations == {}
