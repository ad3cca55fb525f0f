"""CUDA VMM on a real device (the H200 machine; skipped on CI, which has no GPU).

Bytes are checked with driver memcpy / torch compares, never assumed.
"""

from __future__ import annotations

import ctypes
import os

import pytest

from modelexpress.errors import ArenaError, BackendError
from modelexpress.vmm import CudaVmmBackend, VmmArena, use_arena

pytestmark = pytest.mark.gpu

MiB = 1 << 20

# Llama-3-8B: hidden 4096, 32 layers, 8 KV heads of 128, MLP 14336, vocab 128256, bf16.
_LAYER = [
    ("input_layernorm", (4096,)),
    ("q_proj", (4096, 4096)),
    ("k_proj", (1024, 4096)),
    ("v_proj", (1024, 4096)),
    ("o_proj", (4096, 4096)),
    ("post_attention_layernorm", (4096,)),
    ("gate_proj", (14336, 4096)),
    ("up_proj", (14336, 4096)),
    ("down_proj", (4096, 14336)),
]


def llama3_8b_shapes(layers: int = 32) -> list[tuple[str, tuple[int, ...]]]:
    shapes = [("embed_tokens", (128256, 4096))]
    for i in range(layers):
        shapes += [(f"layers.{i}.{name}", shape) for name, shape in _LAYER]
    return shapes + [("norm", (4096,)), ("lm_head", (128256, 4096))]


def _drv():
    from cuda.bindings import driver
    return driver


def _free_mem() -> int:
    import torch
    free, _ = torch.cuda.mem_get_info(0)
    return free


class _FailAt:
    """A real CudaVmmBackend whose ``step`` raises on its ``nth`` call (rollback tests)."""

    def __init__(self, inner: CudaVmmBackend, step: str, nth: int = 1) -> None:
        self._inner, self._step, self._nth, self._n = inner, step, nth, 0
        self.kind, self.device, self.granularity = inner.kind, inner.device, inner.granularity
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        fn = getattr(self._inner, name)
        if name not in ("reserve", "release_reservation", "create", "map", "set_access",
                        "unmap", "release", "close"):
            return fn

        def call(*args):
            self.calls.append(name)
            if name == self._step:
                self._n += 1
                if self._n == self._nth:
                    raise BackendError(f"injected failure of {name}")
            return fn(*args)
        return call


def test_cuda_backend_write_read_and_hole():
    import torch
    torch.cuda.init()
    drv = _drv()
    backend = CudaVmmBackend(0)
    gran = backend.granularity
    assert gran >= 2 * MiB or gran & (gran - 1) == 0
    with VmmArena(64 << 30, device=0, backend=backend) as arena:
        sizes = [1, gran, gran + 1, 3 * gran, 5 * MiB]
        vas = [arena.malloc(s) for s in sizes]
        assert vas == sorted(vas) and vas[0] == arena.base
        for i, (va, size) in enumerate(zip(vas, sizes)):
            assert drv.cuMemsetD8(drv.CUdeviceptr(va), i + 1, size)[0] == 0
        arena.free(vas[2])
        for i, (va, size) in enumerate(zip(vas, sizes)):
            if i == 2:
                continue
            host = (ctypes.c_char * size)()
            err, = drv.cuMemcpyDtoH(ctypes.addressof(host), drv.CUdeviceptr(va), size)
            assert err == 0 and host.raw == bytes([i + 1]) * size, f"chunk {i} corrupted"
        assert len(arena.live_allocations()) == 4
        assert arena.mapped_bytes == sum(s for _, s in arena.live_allocations())


@pytest.mark.parametrize("step", ["create", "map", "set_access"])
def test_cuda_rollback_on_each_step(step):
    import torch
    torch.cuda.init()
    inner = CudaVmmBackend(0)
    backend = _FailAt(inner, step)
    torch.cuda.synchronize()
    before = _free_mem()
    with VmmArena(1 << 30, device=0, backend=backend) as arena:
        with pytest.raises(BackendError, match="injected"):
            arena.malloc(64 * MiB)
        assert arena.live_allocation_count == 0 and arena.mapped_bytes == 0
        assert arena.used_bytes == 0  # the failed slot was the top: given back
        after = _free_mem()
        assert abs(before - after) < 64 * MiB, "physical memory leaked by the rollback"
        va = arena.malloc(64 * MiB)  # the arena still works after the failure
        assert va == arena.base
    expected_undo = {"create": [], "map": ["release"], "set_access": ["unmap", "release"]}[step]
    idx = backend.calls.index(step)
    assert backend.calls[idx + 1: idx + 1 + len(expected_undo)] == expected_undo


def test_cuda_real_out_of_memory_rolls_back():
    import torch
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    with VmmArena(4 * total, device=0, backend=CudaVmmBackend(0)) as arena:
        with pytest.raises(BackendError, match="cuMemCreate"):
            arena.malloc(2 * total)
        assert arena.used_bytes == 0 and arena.live_allocation_count == 0


def test_use_arena_llama3_8b_every_byte_and_dmabuf():
    import torch
    torch.cuda.init()
    shapes = llama3_8b_shapes(int(os.environ.get("MX_TEST_LAYERS", "32")))
    arena = VmmArena(device=0, backend=CudaVmmBackend(0), use_extension=True)
    with use_arena(arena, 0):
        tensors = [torch.empty(shape, dtype=torch.bfloat16, device="cuda:0")
                   for _, shape in shapes]
    # Fill outside use_arena: the pattern's temporaries must not land in the arena.
    for i, t in enumerate(tensors):
        # A per-tensor pattern: every element depends on its index and the tensor.
        t.view(torch.int16).copy_(
            (torch.arange(t.numel(), device="cuda:0", dtype=torch.int32) * 7 + i * 131)
            .remainder(65521).sub(32760).to(torch.int16).view(t.shape))
    torch.cuda.synchronize()
    base, used = arena.registered_range()
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors)
    for t in tensors:
        assert base <= t.data_ptr() < base + used, "tensor outside the arena"
    assert arena.mapped_bytes >= tensor_bytes
    assert arena.mapped_bytes - tensor_bytes <= 0.02 * tensor_bytes, (
        f"overhead {arena.mapped_bytes - tensor_bytes} bytes over {tensor_bytes}")
    for i, ((name, shape), t) in enumerate(zip(shapes, tensors)):
        want = ((torch.arange(t.numel(), device="cuda:0", dtype=torch.int32) * 7 + i * 131)
                .remainder(65521).sub(32760).to(torch.int16).view(shape))
        assert torch.equal(t.view(torch.int16), want), f"{name} corrupted"
    stats = arena.stats()
    assert stats["mallocs"] == arena.live_allocation_count and stats["malloc_failures"] == 0
    fd = arena.backend.export_dmabuf(base, used)
    assert fd >= 0
    os.close(fd)
    del tensors, t, want
    arena.close()
    assert arena.closed


def test_use_arena_nesting_refused_and_close_releases():
    import torch
    torch.cuda.init()
    torch.cuda.synchronize()
    before = _free_mem()
    a = VmmArena(1 << 40, device=0, backend=CudaVmmBackend(0), use_extension=True)
    b = VmmArena(1 << 40, device=0, backend=CudaVmmBackend(0), use_extension=True)
    with use_arena(a, 0):
        x = torch.ones(64 * MiB // 4, device="cuda:0")
        with pytest.raises(ArenaError, match="nesting"):
            with use_arena(b, 0):
                pass
    assert a.base <= x.data_ptr() < a.base + a.used_bytes
    assert float(x.sum()) == 64 * MiB // 4
    del x
    a.close()
    b.close()
    torch.cuda.synchronize()
    assert abs(_free_mem() - before) < 64 * MiB, "arena memory not returned on close"


def test_maybe_enter_vmm_arena_lives_past_load_and_rolls_back():
    import torch
    from modelexpress.vmm import maybe_enter_vmm_arena
    torch.cuda.init()
    with maybe_enter_vmm_arena(True, device=0, total_bytes=1 << 40) as arena:
        assert arena is not None
        w = torch.full((1024, 1024), 3.0, device="cuda:0")
    assert not arena.closed and arena.base <= w.data_ptr() < arena.base + arena.used_bytes
    assert float(w.sum()) == 3.0 * 1024 * 1024  # the weights outlive the load block
    del w
    arena.close()
    with pytest.raises(RuntimeError, match="load failed"):
        with maybe_enter_vmm_arena(True, device=0, total_bytes=1 << 40) as failed:
            torch.empty(1 << 20, device="cuda:0")
            raise RuntimeError("load failed")
    assert failed.closed  # rollback closed the arena


def test_auto_handle_type_exports_posix_fds_and_keeps_the_dmabuf_range():
    """'auto' asks for POSIX-fd handles where the device supports them (the H200 does):
    every chunk exports a descriptor, and a dmabuf over the range still works."""
    import torch
    backend = CudaVmmBackend(0, handle_type="auto")
    assert backend.handle_type == "posix_fd"
    fds0 = len(os.listdir("/proc/self/fd"))
    with VmmArena(1 << 36, backend=backend) as arena:
        vas = [arena.malloc(n) for n in (2 * MiB, 6 * MiB, 4 * MiB)]
        exported = arena.export_chunks()
        assert [(va, size) for va, size, _ in exported] == arena.live_allocations()
        assert all(fd >= 0 for _, _, fd in exported)
        for _, _, fd in exported:
            os.close(fd)
        base, used = arena.registered_range()
        dmabuf = backend.export_dmabuf(base, used)
        os.close(dmabuf)
        assert vas[0] == base
    torch.cuda.synchronize()
    assert len(os.listdir("/proc/self/fd")) == fds0


def test_none_handle_type_refuses_export():
    with VmmArena(1 << 34, backend=CudaVmmBackend(0, handle_type="none")) as arena:
        arena.malloc(2 * MiB)
        with pytest.raises(Exception, match="cannot be exported"):
            arena.export_chunks()
