"""ArenaWriter / ArenaReader / ArenaPickler in one process: round trips, lifecycle, fallbacks.

Cross-process behaviour (forked readers, leaks) is in test_arena_processes.py.
"""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from modelexpress.errors import ShmArenaError, ShmSpaceError
from modelexpress.shm_arena import (
    ArenaPickler,
    ArenaReader,
    ArenaWriter,
    check_shm_free_space,
)

MIB = 1 << 20


def send(writer: ArenaWriter, obj: object, min_bytes: int = 1) -> bytes:
    bio = io.BytesIO()
    ArenaPickler(bio, writer, min_tensor_bytes=min_bytes).dump(obj)
    return bio.getvalue()


@pytest.fixture
def pair():
    writer = ArenaWriter(1, 64 * MIB, n_descriptors=16, prefault=False)
    reader = ArenaReader(writer.handle, 0)
    yield writer, reader
    reader.close()
    writer.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn, torch.float8_e5m2, torch.int8,
                                   torch.uint8, torch.int64, torch.bool, torch.complex64])
def test_byte_exact_round_trip(pair, dtype) -> None:
    writer, _ = pair
    gen = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (3, 1000, 7), dtype=torch.uint8, generator=gen)
    src = src.view(-1).view(torch.uint8)[: 3 * 1000 * 7 // dtype.itemsize * dtype.itemsize]
    tensor = src.view(dtype)
    stream = send(writer, tensor)
    assert len(stream) < 300, "the bytes must travel in the arena, not the stream"
    out = pickle.loads(stream)
    assert out.dtype == dtype and out.shape == tensor.shape
    assert torch.equal(out.view(torch.uint8), tensor.view(torch.uint8))
    assert writer.counters.diverted == 1


def test_zero_dim_and_large(pair) -> None:
    writer, _ = pair
    scalar = torch.tensor(3.5, dtype=torch.float64)
    big = torch.arange(40 * MIB // 4, dtype=torch.int32)
    a, b = pickle.loads(send(writer, (scalar, big)))
    assert a.shape == () and a.item() == 3.5
    assert torch.equal(b, big)


def test_parameter_identity_and_requires_grad_kept(pair) -> None:
    writer, _ = pair
    param = torch.nn.Parameter(torch.randn(1000, 100))
    frozen = torch.nn.Parameter(torch.randn(1000), requires_grad=False)
    leaf = torch.randn(500, requires_grad=True)
    p, f, leaf_out = pickle.loads(send(writer, [param, frozen, leaf]))
    assert type(p) is torch.nn.Parameter and p.requires_grad
    assert type(f) is torch.nn.Parameter and not f.requires_grad
    assert type(leaf_out) is torch.Tensor and leaf_out.requires_grad
    assert torch.equal(p.detach(), param.detach()) and torch.equal(f, frozen)
    assert writer.counters.diverted == 3


class Tagged(torch.Tensor):
    pass


def test_noncontiguous_subclass_small_take_the_normal_path(pair) -> None:
    writer, _ = pair
    base = torch.arange(1 << 20, dtype=torch.float32).view(1024, 1024)
    strided = base.t()
    sub = torch.arange(1 << 18, dtype=torch.float32).as_subclass(Tagged)
    small = torch.ones(10)
    s, t, sm = pickle.loads(send(writer, [strided, sub, small], min_bytes=1024))
    assert torch.equal(s, strided) and type(t) is Tagged and torch.equal(sm, small)
    declined = writer.counters.snapshot().declined
    assert declined["non_contiguous"] == 1 and declined["small"] == 1
    assert declined["subclass"] >= 1
    assert writer.counters.diverted == 0


def test_same_tensor_twice_is_copied_once(pair) -> None:
    writer, _ = pair
    t = torch.ones(MIB)
    a, b = pickle.loads(send(writer, [t, t]))
    assert a is b and writer.counters.diverted == 1


def test_release_follows_storage_lifetime_views_included(pair) -> None:
    writer, reader = pair
    out = pickle.loads(send(writer, torch.zeros(4 * MIB, dtype=torch.uint8)))
    view = out[10:20]
    wrapper = torch.nn.Parameter(out, requires_grad=False)
    del out
    assert writer.reclaim() == 0
    del wrapper
    assert writer.reclaim() == 0, "a slice still views the storage"
    del view
    assert writer.reclaim() == 1
    assert writer.stats()["used"] == 0


def test_warm_up_changes_nothing_shared(pair) -> None:
    writer, reader = pair
    header = bytes(reader._segment.mm[:4096])
    reader.warm_up()
    assert bytes(reader._segment.mm[:4096]) == header, "warm_up wrote to the segment"
    held = pickle.loads(send(writer, torch.full((MIB,), 5, dtype=torch.uint8)))
    assert writer.reclaim() == 0 and int(held[7]) == 5  # the real path is unaffected
    del held
    assert writer.reclaim() == 1


def test_exhaustion_and_oversize_fall_back_and_variable_size_fits() -> None:
    with ArenaWriter(1, 32 * MIB, n_descriptors=4, prefault=False) as writer, \
            ArenaReader(writer.handle, 0):
        # a 24 MiB tensor: far above any fixed slot of an 8-slot 32 MiB arena
        held = pickle.loads(send(writer, torch.ones(24 * MIB, dtype=torch.uint8)))
        full = pickle.loads(send(writer, torch.ones(10 * MIB, dtype=torch.uint8)))
        too_big = pickle.loads(send(writer, torch.ones(33 * MIB, dtype=torch.uint8)))
        assert held.sum() == 24 * MIB and full.sum() == 10 * MIB and too_big.sum() == 33 * MIB
        snap = writer.counters.snapshot()
        assert snap.diverted == 1
        assert snap.declined["full"] == 1 and snap.declined["oversize"] == 1
        del held
        again = pickle.loads(send(writer, torch.ones(10 * MIB, dtype=torch.uint8)))
        assert writer.counters.diverted == 2 and again.sum() == 10 * MIB


def test_descriptor_exhaustion_falls_back() -> None:
    with ArenaWriter(1, 8 * MIB, n_descriptors=2, prefault=False) as writer, \
            ArenaReader(writer.handle, 0):
        kept = [pickle.loads(send(writer, torch.ones(1000))) for _ in range(3)]
        assert writer.counters.diverted == 2
        assert writer.counters.snapshot().declined["full"] == 1
        assert all(k.sum() == 1000 for k in kept)


def test_failed_dump_takes_placements_back(pair) -> None:
    writer, _ = pair

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        send(writer, [torch.ones(MIB), Unpicklable()])
    assert writer.stats()["live_tensors"] == 0 and writer.stats()["used"] == 0


def test_generation_mismatch_is_detected(pair) -> None:
    writer, reader = pair
    out = pickle.loads(send(writer, torch.ones(1000)))
    del out
    writer.reclaim()
    # a stale stub (old generation) must never yield a tensor over reused space
    placement = writer.place(torch.ones(100, dtype=torch.uint8))
    with pytest.raises(ShmArenaError, match="generation"):
        reader.tensor(placement.descriptor, placement.gen - 1, placement.offset, 100,
                      torch.uint8, (100,))


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class FakePinner:
    """CPU stand-in for CudaPinner with its semantics: register, then event-gated release."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.events: list[FakeEvent] = []

    def can_pin(self) -> bool:
        return True

    def register(self, address: int, nbytes: int) -> bool:
        self.registered.append((address, nbytes))
        return True

    def unregister(self, address: int) -> None:
        self.registered = [r for r in self.registered if r[0] != address]

    def record_event(self) -> FakeEvent:
        self.events.append(FakeEvent())
        return self.events[-1]


def test_pinned_release_waits_for_the_event() -> None:
    pinner = FakePinner()
    with ArenaWriter(1, 8 * MIB, prefault=False) as writer:
        reader = ArenaReader(writer.handle, 0, pinner=pinner)
        out = pickle.loads(send(writer, torch.ones(MIB)))
        assert reader.pinned and pinner.registered[0][1] == writer.handle.size
        del out
        assert writer.reclaim() == 0, "pinned: storage freed is not enough"
        reader.flush_releases()  # records the event
        assert writer.reclaim() == 0
        reader.flush_releases()  # event not complete yet
        assert writer.reclaim() == 0
        pinner.events[0].done = True
        reader.flush_releases()
        assert writer.reclaim() == 1
        reader.close()
        assert pinner.registered == []


def test_unknown_segment_is_a_clear_error() -> None:
    from modelexpress.shm_arena import rebuild_tensor
    with pytest.raises(ShmArenaError, match="install_shm_tensor_arena"):
        rebuild_tensor("mx_shm_arena_nope", 0, 1, 0, 4, "uint8", (4,), False)


def test_space_check_fails_fast() -> None:
    with pytest.raises(ShmSpaceError, match="MiB"):
        check_shm_free_space(1 << 62, "a test arena")


def test_metrics_exported() -> None:
    import importlib.util
    if importlib.util.find_spec("prometheus_client") is None:
        # A skip is not a pass: CI (MX_REQUIRE_DEPS=1, tests/conftest.py) installs it.
        reason = "prometheus_client is not installed (pip install 'modelexpress[server]')"
        if os.environ.get("MX_REQUIRE_DEPS") == "1":
            pytest.fail(f"MX_REQUIRE_DEPS=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    import prometheus_client
    reg = prometheus_client.REGISTRY

    def value(name: str, **labels: str) -> float:
        return reg.get_sample_value(name, labels) or 0.0

    before = value("mx_shm_arena_diverted_tensors_total")
    small_before = value("mx_shm_arena_declined_tensors_total", reason="small")
    with ArenaWriter(1, 8 * MIB, prefault=False) as writer, ArenaReader(writer.handle, 0):
        pickle.loads(send(writer, [torch.ones(MIB), torch.ones(2)], min_bytes=1024))
    assert value("mx_shm_arena_diverted_tensors_total") == before + 1
    assert value("mx_shm_arena_declined_tensors_total", reason="small") == small_before + 1


def test_close_is_idempotent_and_unlinks() -> None:
    writer = ArenaWriter(1, MIB, prefault=True)
    path = os.path.join("/dev/shm", writer.name)
    assert os.path.exists(path)
    writer.close()
    writer.close()
    assert not os.path.exists(path)
