"""Manifest, digests, planning and registration choice: pure logic, no NIXL."""

from __future__ import annotations

import pytest
import torch

from modelexpress.errors import ConfigError, ManifestMismatchError
from modelexpress.transfer import digest
from modelexpress.transfer.manifest import Manifest, build_manifest
from modelexpress.transfer.planner import plan_read
from modelexpress.transfer.registration import (
    Strategy,
    choose_arena_strategy,
    regions_for_tensors,
)


def _carved(sizes: list[int], dtype=torch.float32) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    buf = torch.arange(sum(sizes), dtype=dtype)
    out, off = {}, 0
    for i, n in enumerate(sizes):
        out[f"t{i}"] = buf[off:off + n]
        off += n
    return buf, out


def _manifest(tensors: dict[str, torch.Tensor]) -> Manifest:
    regions = [(r[0], r[1], r[2]) for r in regions_for_tensors(tensors, "spans")["DRAM"]]
    return build_manifest(tensors, agent_name="src", regions=regions)


def test_manifest_json_roundtrip_is_versioned_and_rejects_other_versions() -> None:
    _, tensors = _carved([3, 5])
    m = _manifest(tensors)
    again = Manifest.from_json(m.to_json())
    assert again == m and again.digest_algorithm == digest.XXH3_BLOCKS_1M  # small
    bad = m.to_json().replace('"version":1', '"version":99')
    with pytest.raises(ManifestMismatchError, match="version 99"):
        Manifest.from_json(bad)
    with pytest.raises(ManifestMismatchError):
        Manifest.from_json(b"\x80\x04pickle")


@pytest.mark.parametrize("algo", digest.ALGORITHMS)
def test_digest_detects_one_changed_byte_and_swapped_words(algo: str) -> None:
    t = torch.randint(0, 1 << 30, (1001,), dtype=torch.int32)
    base = digest.digest(t, algo)
    flipped = t.clone()
    flipped.view(torch.uint8)[1234] ^= 1
    assert digest.digest(flipped, algo) != base
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    if int(t[3]) != int(t[4]):
        assert digest.digest(swapped, algo) != base
    odd = torch.arange(7, dtype=torch.uint8)  # 7 bytes: the 3-byte tail path
    assert digest.digest(odd, algo) != digest.digest(odd.clone().add_(1), algo)


def test_wsum_is_chunk_and_layout_independent() -> None:
    t = torch.randint(-1000, 1000, ((1 << 24) + 37,), dtype=torch.int32)  # > one chunk
    assert digest.digest(t, digest.WSUM) == digest.digest(t.clone(), digest.WSUM)
    # non-contiguous input hashes its logical (contiguous) bytes
    m = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    assert digest.digest(m.t(), digest.WSUM) == digest.digest(m.t().contiguous(), digest.WSUM)


def test_mismatches_fail_before_any_transfer_with_names() -> None:
    _, src = _carved([4, 4, 4])
    m = _manifest(src)
    local = {"t0": torch.zeros(4), "t1": torch.zeros(4, dtype=torch.float16), "t2": torch.zeros(2, 2)}
    with pytest.raises(ManifestMismatchError) as err:
        plan_read(m, local)
    assert "t1: dtype source=float32 local=float16" in str(err.value)
    assert "t2: shape" in str(err.value)
    with pytest.raises(ManifestMismatchError, match="no local destination"):
        plan_read(m, {"t0": torch.zeros(4)})
    plan = plan_read(m, {"t0": torch.zeros(4)}, allow_partial=True)
    assert [p.name for p in plan.pairs] == ["t0"]
    with pytest.raises(ManifestMismatchError, match="not in the source manifest"):
        plan_read(m, {**{k: torch.zeros(4) for k in src}, "extra": torch.zeros(1)})


def test_coalescing_needs_contiguity_on_both_sides_and_one_region_each() -> None:
    sizes = [16, 32, 8, 64, 4]
    _, src = _carved(sizes)
    m = _manifest(src)
    buf, dst = _carved(sizes)
    local_regions = regions_for_tensors(dst, "spans")["DRAM"]
    plan = plan_read(m, dst, local_regions=local_regions)
    assert plan.descriptors == 1 and plan.local_descs.shape == (1, 3)
    assert plan_read(m, dst, local_regions=local_regions,
                     coalesce_descriptors=False).descriptors == 5
    # local registered per tensor: spans cannot cross registrations
    per = regions_for_tensors(dst, "per_tensor")["DRAM"]
    assert plan_read(m, dst, local_regions=per).descriptors == 5
    # local order differs from the source in the middle: runs break there
    _, shuffled = _carved([16, 32, 64, 8, 4])
    remap = {"t0": shuffled["t0"], "t1": shuffled["t1"], "t2": shuffled["t3"],
             "t3": shuffled["t2"], "t4": shuffled["t4"]}
    assert plan_read(m, remap, local_regions=regions_for_tensors(remap, "spans")["DRAM"]
                     ).descriptors == 4  # [t0 t1] t2 t3 t4


def test_chunks_split_descriptors_and_track_tensor_completion() -> None:
    sizes = [1000, 10, 3000, 500]  # float32: 4000, 40, 12000, 2000 bytes
    _, src = _carved(sizes)
    m = _manifest(src)
    _, dst = _carved(sizes)
    plan = plan_read(m, dst, local_regions=regions_for_tensors(dst, "spans")["DRAM"],
                     chunk_bytes=4096, first_chunk_bytes=1000)
    assert plan.descriptors == 1
    assert sum(c.nbytes for c in plan.chunks) == plan.total_bytes == 18040
    assert plan.chunks[0].nbytes == 1000 and all(c.nbytes <= 4096 for c in plan.chunks)
    assert int(plan.local_descs[:, 1].sum()) == 18040
    # each tensor is done after the chunk holding its last byte
    ends = {"t0": 4000, "t1": 4040, "t2": 16040, "t3": 18040}
    bounds, acc = [], 0
    for c in plan.chunks:
        acc += c.nbytes
        bounds.append(acc)
    for pair, ci in zip(plan.pairs, plan.done_after):
        assert bounds[ci] >= ends[pair.name] > (bounds[ci - 1] if ci else 0)


class _Arena:
    """A stand-in with the VmmArena attributes registration reads (no memory)."""

    def __init__(self, kind: str, base: int, used: int, handles: int) -> None:
        self.granularity = 1 << 21
        self.backend = type("B", (), {"kind": kind})()
        self._range = (base, used)
        self._live = [(base + i * (used // max(handles, 1)), used // max(handles, 1))
                      for i in range(handles)]

    def registered_range(self) -> tuple[int, int]:
        return self._range

    def live_allocations(self) -> list[tuple[int, int]]:
        return self._live


def test_arena_strategy_choice_rules() -> None:
    t = torch.zeros(1024)
    base = t.data_ptr()
    assert choose_arena_strategy(_Arena("host", base, 0, 0), [t]).strategy == Strategy.PER_TENSOR
    outside = torch.zeros(1024)
    c = choose_arena_strategy(_Arena("host", base, 4096, 1), [t, outside])
    assert c.strategy == Strategy.PER_TENSOR and "1 of 2 tensors" in c.reason
    assert choose_arena_strategy(_Arena("host", base, 4096, 4), [t]).strategy == Strategy.SINGLE_REGION
    cuda_multi = _Arena("cuda", base, 4096, 4)
    assert choose_arena_strategy(cuda_multi, [t]).strategy == Strategy.PER_CHUNK
    assert choose_arena_strategy(cuda_multi, [t], transport="dmabuf").strategy == Strategy.SINGLE_REGION
    assert choose_arena_strategy(cuda_multi, [t], force_single_region=True).strategy == Strategy.SINGLE_REGION
    assert choose_arena_strategy(_Arena("cuda", base, 4096, 1), [t]).strategy == Strategy.SINGLE_REGION
    with pytest.raises(ConfigError, match="allowed|one of"):
        choose_arena_strategy(cuda_multi, [t], transport="nvlink")


def test_zero_byte_tensors_get_no_descriptor() -> None:
    _, src = _carved([4, 0, 4])
    m = _manifest(src)
    _, dst = _carved([4, 0, 4])
    plan = plan_read(m, dst, local_regions=regions_for_tensors(dst, "spans")["DRAM"])
    assert plan.descriptors == 1 and int(plan.local_descs[:, 1].sum()) == 32
    assert len(plan.pairs) == 3 and plan.done_after == (0, 0, 0)
