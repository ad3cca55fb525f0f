"""The shm arena's pinned path with the real CUDA pinner (GPU hosts only)."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from modelexpress.shm_arena import ArenaPickler, ArenaReader, ArenaWriter
from modelexpress.shm_arena.pinning import CudaPinner

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def test_real_pin_then_release_only_after_the_h2d_event() -> None:
    torch.zeros(1, device="cuda")  # a CUDA context: the reader pins only then
    pinner = CudaPinner()
    with ArenaWriter(1, 64 * MIB, prefault=False) as writer:
        reader = ArenaReader(writer.handle, 0, pinner=pinner)
        src = torch.arange(8 * MIB // 4, dtype=torch.int32)
        buf = io.BytesIO()
        ArenaPickler(buf, writer, min_tensor_bytes=MIB).dump(src)
        got = pickle.loads(buf.getvalue())
        assert reader.pinned, "a reader with a CUDA context registers the mapping"
        on_gpu = got.to("cuda", non_blocking=True)  # pinned: a true async DMA
        del got
        reader.flush_releases()  # records the event after the H2D
        torch.cuda.synchronize()
        reader.flush_releases()  # the event has completed: the slot may go back
        assert writer.reclaim() == 1
        assert torch.equal(on_gpu.cpu(), src)
        reader.close()
