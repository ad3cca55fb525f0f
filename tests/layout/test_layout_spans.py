"""Box copies as byte runs (what NIXL posts) and the local copy, check and finish steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from modelexpress.layout import Check, Copy, Fill, LayoutPlan, Scatter
from modelexpress.layout.readers import _gather, box_view, check_blocks, copy_boxes, finish
from modelexpress.layout.spans import coalesce_runs, covering_span, pair_runs


def _apply_runs(src: torch.Tensor, dst: torch.Tensor, s_off, d_off, run: int) -> None:
    sb, db = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    for s, d in zip(s_off.tolist(), d_off.tolist()):
        db[d:d + run] = sb[s:s + run]


def test_a_row_range_is_one_run_and_a_column_slice_one_run_per_row() -> None:
    rows = pair_runs(((8, 4), (0, 16)), (32, 16), ((0, 4), (0, 16)), (4, 16), 4)
    assert (rows[0].tolist(), rows[1].tolist(), rows[2]) == ([8 * 16 * 4], [0], 4 * 16 * 4)
    cols = pair_runs(((0, 3), (8, 8)), (3, 16), ((0, 3), (0, 8)), (3, 8), 2)
    assert cols[0].tolist() == [16, 48, 80] and cols[1].tolist() == [0, 16, 32]
    assert cols[2] == 16


def test_runs_reproduce_a_strided_box_copy_exactly() -> None:
    gen = torch.Generator().manual_seed(7)
    src = torch.randn(6, 10, 12, generator=gen)
    dst = torch.zeros(4, 5, 24)
    src_box, dst_box = ((1, 4), (2, 5), (0, 12)), ((0, 4), (0, 5), (12, 12))
    s_off, d_off, run = pair_runs(src_box, src.shape, dst_box, dst.shape, 4)
    _apply_runs(src, dst, s_off, d_off, run)
    assert torch.equal(box_view(dst, dst_box), box_view(src, src_box))
    assert run == 12 * 4 and len(s_off) == 20


def test_pitched_runs_are_the_runs_when_they_lie_equally_spaced_and_none_otherwise() -> None:
    from modelexpress.layout.spans import pitched_runs

    rng = np.random.default_rng(5)
    seen = {True: 0, False: 0}
    for _ in range(400):
        shape = tuple(int(x) for x in rng.integers(1, 6, size=int(rng.integers(1, 4))))
        box = []
        for n in shape:
            start = int(rng.integers(0, n))
            box.append((start, int(rng.integers(1, n - start + 1))))
        box = tuple(box)
        dst_shape = tuple(n + int(rng.integers(0, 3)) for _, n in box)
        dst_box = tuple((int(rng.integers(0, d - n + 1)), n) for (_, n), d in zip(box, dst_shape))
        s_off, d_off, run = pair_runs(box, shape, dst_box, dst_shape, 4)
        got = pitched_runs(box, shape, dst_box, dst_shape, 4)
        even = (len(s_off) > 1 and len(set(np.diff(s_off).tolist())) == 1
                and len(set(np.diff(d_off).tolist())) == 1)
        assert (got is not None) == even, (box, shape, dst_box, dst_shape)
        seen[even] += 1
        if got is not None:
            s0, d0, s_pitch, d_pitch, n_run, rows = got
            assert n_run == run and rows == len(s_off)
            assert s_off.tolist() == [s0 + i * s_pitch for i in range(rows)]
            assert d_off.tolist() == [d0 + i * d_pitch for i in range(rows)]
    assert min(seen.values()) > 20  # both kinds were tried
    # a column half of a row-parallel weight: its rows, one pitch each side
    assert pitched_runs(((0, 4), (2, 2)), (4, 4), ((0, 4), (0, 2)), (4, 2), 2) == \
        (4, 0, 8, 4, 4, 4)


def test_coalescing_merges_runs_adjacent_on_both_sides_only() -> None:
    s, d, n = coalesce_runs(np.array([0, 8, 16, 40]), np.array([100, 108, 200, 208]),
                            np.array([8, 8, 8, 8]))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 16, 40], [100, 200, 208], [16, 8, 8])


def test_a_covering_span_read_then_gathered_equals_the_box() -> None:
    src = torch.arange(8 * 32, dtype=torch.float32).view(8, 32)
    box = ((2, 5), (16, 16))  # the right half of rows 2..6
    off, n = covering_span(box, src.shape, 4)
    assert (off, n) == ((2 * 32 + 16) * 4, ((6 * 32 + 31) - (2 * 32 + 16) + 1) * 4)
    scratch = torch.zeros(n + 64, dtype=torch.uint8)
    scratch[32:32 + n] = src.view(-1).view(torch.uint8)[off:off + n]
    dst = torch.zeros(5, 16)
    _gather(scratch, 32, off, src.shape, Copy("s", "w", box, "d", ((0, 5), (0, 16)), 0), dst)
    assert torch.equal(dst, src[2:7, 16:32])


def test_check_names_the_block_that_does_not_hash_to_its_digest_then_finish_fills() -> None:
    from modelexpress.transfer import digest as _digest

    src = {"w": torch.arange(64, dtype=torch.float32).view(8, 8)}
    dest = {"t": torch.zeros(10, 8)}
    copies = (Copy("s", "w", ((0, 8), (0, 8)), "t", ((0, 8), (0, 8)), 256),)
    good = _digest.digest(src["w"][0:4], "xxh3-128")
    second = _digest.digest(src["w"][4:8], "xxh3-128")
    checks = (Check("w", 0, good, "t", ((0, 4), (0, 8)), ("s",)),
              Check("w", 1, second, "t", ((4, 4), (0, 8)), ("s",)))
    plan = LayoutPlan(copies=copies, checks=checks, scratch=(),
                      scatters=(Scatter("t", ((0, 1), (0, 8)), "t", ((8, 1), (0, 8))),),
                      fills=(Fill("t", ((9, 1), (0, 8)), 0.5),), algorithm="xxh3-128",
                      needed_bytes=256, read_bytes=256, sources=("s",))
    assert copy_boxes(plan.copies, src, dest) == 256
    assert check_blocks(plan.checks, dest, plan.algorithm) == []
    dest["t"][5, 3] += 1  # a byte that went wrong
    assert [c.block for c in check_blocks(plan.checks, dest, plan.algorithm)] == [1]
    finish(plan, dest)
    assert torch.equal(dest["t"][8], src["w"][0]) and bool((dest["t"][9] == 0.5).all())


@pytest.mark.parametrize("algorithm", ["xxh3-128", "wsum-i32-v1"])
def test_column_strips_side_by_side_are_copied_together_and_hash_as_each_alone(
        algorithm: str) -> None:
    from modelexpress.layout.readers import block_views
    from modelexpress.transfer import digest as _digest

    gen = torch.Generator().manual_seed(3)
    dest = {"o": torch.randn(6, 32, generator=gen), "x": torch.randn(2, 5, 12, generator=gen)}
    boxes = [("o", ((0, 6), (8, 8))), ("o", ((0, 6), (0, 8))), ("o", ((0, 6), (16, 8))),
             ("o", ((0, 6), (28, 4))),     # another width: alone
             ("o", ((2, 2), (0, 32))),     # whole rows: contiguous, not copied
             ("x", ((0, 2), (1, 2), (0, 4))), ("x", ((0, 2), (1, 2), (4, 4))),
             ("x", ((0, 2), (3, 2), (0, 4)))]  # other rows of x: alone
    checks = [Check("ckpt", i, _digest.digest(box_view(dest[w], box).contiguous(), algorithm),
                    w, box, ("s",)) for i, (w, box) in enumerate(boxes)]
    # host memory: every block stays a view (the xxh3 digest copies strided rows itself)
    assert [v.data_ptr() for v in block_views(checks, dest)] == \
        [box_view(dest[w], box).data_ptr() for w, box in boxes]
    views = block_views(checks, dest, side_by_side=True)  # as for tensors on a GPU
    for i, (c, v) in enumerate(zip(checks, views)):
        assert torch.equal(v, box_view(dest[c.where], c.box))
        assert v.is_contiguous() == (i not in (3, 7))  # a strip alone stays a view
    # the three strips of o of width 8 are slices of one copy, as are x's first two
    assert len({views[i].untyped_storage().data_ptr() for i in (0, 1, 2)}) == 1
    assert views[0].untyped_storage().data_ptr() != dest["o"].untyped_storage().data_ptr()
    assert views[5].untyped_storage().data_ptr() == views[6].untyped_storage().data_ptr()
    assert views[4].data_ptr() == dest["o"][2].data_ptr()  # rows: the tensor itself
    assert check_blocks(checks, dest, algorithm) == []
    dest["o"][0, 17] += 1  # in the third strip (and in no other block)
    assert [c.block for c in check_blocks(checks, dest, algorithm)] == [2]


def test_a_destination_outside_host_and_cuda_memory_is_refused_before_the_control_plane(
        ) -> None:
    """Host memory and CUDA GPUs are filled (``device_refusal``); any other device makes
    the pull raise LayoutUnavailableError before it asks the control plane anything (a
    meta tensor here)."""
    from modelexpress.errors import LayoutUnavailableError
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p.layout_pull import device_refusal, pull_across_layouts

    class NoCalls:
        def __getattr__(self, name: str):  # noqa: ANN204
            raise AssertionError(f"the control plane was asked ({name})")

    assert device_refusal("cpu") is None and device_refusal(torch.device("cpu")) is None
    assert device_refusal("cuda:1") is None and device_refusal(torch.device("cuda", 0)) is None
    assert "fill host memory and CUDA GPUs only" in device_refusal("meta")
    dest = {"w": torch.empty(4, 4), "v": torch.empty(4, device="meta")}
    identity = ModelIdentity(model="m", dtype="float32", tp_size=1, rank=0)
    with pytest.raises(LayoutUnavailableError, match="its load device is meta"):
        pull_across_layouts(identity, lambda table: None, dest, client=NoCalls())  # type: ignore[arg-type]


@pytest.mark.parametrize("native", [False, True], ids=["python-loop", "c-loop"])
def test_blocks_one_source_supplies_are_hashed_as_they_land_and_the_rest_left_to_after(
        native: bool) -> None:
    """The local reader's copy loop hashes each block it lands whole and contiguous
    (a right one passes, a lying one fails); a block part of whose bytes landed another
    way, or that is strided in the destination, is in neither list (checked after)."""
    import os

    from modelexpress.layout.readers import _blocks_in_pass, _outcomes
    from modelexpress.local import HostBuffer, HostMapping
    from modelexpress.local.hostcopy import HostCopier
    from modelexpress.local.protocol import Segment
    from modelexpress.transfer import digest

    algo = digest.XXH3_BLOCKS_1M
    rows, cols = 64, 1 << 14  # 16 KiB rows: blocks of 16 rows are 256 KiB
    g = torch.Generator().manual_seed(3)
    want = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    buf = HostBuffer(rows * cols)
    buf.tensor(0, (rows * cols,), torch.uint8).copy_(want.view(-1))
    mapping = HostMapping([Segment("memfd", buf.addr, buf.nbytes, -1)], [os.dup(buf.fd)])
    dst = torch.zeros(rows, cols, dtype=torch.uint8)
    boxes = {"right": ((0, 16), (0, cols)), "lie": ((16, 16), (0, cols)),
             "partly": ((32, 16), (0, cols)), "strided": ((48, 16), (0, cols // 2))}
    lie = want[:16].flip(0).contiguous()  # the digest of other bytes than these rows'
    checks = [Check("w", i, digest.digest(lie if name == "lie" else
                                          box_view(want, box).contiguous(), algo),
                    "dst", box, ("s",))
              for i, (name, box) in enumerate(boxes.items())]
    in_pass = _blocks_in_pass(checks, {"dst": dst}, algo, "test peer")
    seg, off = mapping.locate(buf.addr, buf.nbytes)
    # rows 0-39 through the copier; rows 40-63 another way (as a gather would)
    copier = HostCopier(mapping, threads=2, native=native)
    copier.copy([(seg, off, dst.data_ptr(), 40 * cols)], in_pass)
    dst[40:] = want[40:]
    checked, failed = _outcomes(in_pass)
    assert [c.block for c in checked] == [0] and [c.block for c in failed] == [1]
    assert torch.equal(dst, want)
    left = [c for c in checks if c not in checked and c not in failed]
    assert [c.block for c in left] == [2, 3]
    assert check_blocks(left, {"dst": dst}, algo) == []  # their turn: after the copies


class _CudaDestination:
    """A destination tensor as `_runs_of` sees a CUDA one (its device, dtype, shape,
    element size and address), its bytes held in host memory: CI has no GPU; the GPU
    tests (tests/p2p/test_layout_devices.py) run the real cuMemcpy2DAsync."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.device, self.dtype, self.shape = t, torch.device("cuda", 0), t.dtype, t.shape

    def element_size(self) -> int:
        return self.t.element_size()

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def _apply_pitched(src: torch.Tensor, dst: torch.Tensor, job: tuple) -> None:
    """What cuMemcpy2D does: row i of ``run`` bytes from src + s0 + i * s_pitch to
    dst + d0 + i * d_pitch."""
    _c, _entry, s0, d_addr, s_pitch, d_pitch, run, rows = job
    sb, db = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    d0 = d_addr - dst.data_ptr()
    for i in range(rows):
        db[d0 + i * d_pitch:d0 + i * d_pitch + run] = sb[s0 + i * s_pitch:s0 + i * s_pitch + run]


def test_a_column_slice_into_a_gpu_is_one_pitched_copy_and_other_boxes_are_not() -> None:
    from modelexpress.layout.readers import _runs_of
    from modelexpress.transfer.manifest import TensorEntry

    src = torch.arange(8 * 32, dtype=torch.float32).view(8, 32)
    dst = torch.zeros(8, 64)
    entries = {"w": TensorEntry("w", "float32", (8, 32), src.nbytes, 0, "cuda:0")}
    # a TP=2 shard of a row-parallel weight into the right half of the TP=1 tensor
    column = Copy("s", "w", ((0, 8), (0, 32)), "d", ((0, 8), (32, 32)), src.nbytes)
    runs = _runs_of([column], entries, {"d": _CudaDestination(dst)}, 64 << 10, pitched=True)
    assert not runs.direct and not runs.covering and len(runs.pitched) == 1
    *_, s_pitch, d_pitch, run, rows = runs.pitched[0]
    assert (s_pitch, d_pitch, run, rows) == (32 * 4, 64 * 4, 32 * 4, 8)
    assert runs.moved == src.nbytes
    _apply_pitched(src, dst, runs.pitched[0])
    assert torch.equal(dst[:, 32:], src) and not dst[:, :32].any()
    # a row range is one run: nothing to pitch
    rows_copy = Copy("s", "w", ((2, 4), (0, 32)), "d", ((0, 4), (0, 32)), 4 * 32 * 4)
    runs = _runs_of([rows_copy], entries, {"d": _CudaDestination(torch.zeros(4, 32))},
                    64 << 10, pitched=True)
    assert len(runs.direct) == 1 and not runs.pitched
    # a 3D box whose runs are not equally spaced takes the covering span, as before
    src3 = torch.zeros(4, 6, 8)
    entries3 = {"w": TensorEntry("w", "float32", (4, 6, 8), src3.nbytes, 0, "cuda:0")}
    box3 = Copy("s", "w", ((0, 2), (0, 3), (0, 4)), "d", ((0, 2), (0, 3), (0, 4)), 96)
    runs = _runs_of([box3], entries3, {"d": _CudaDestination(torch.zeros(2, 3, 4))},
                    64 << 10, pitched=True)
    assert len(runs.covering) == 1 and not runs.pitched
    # host destinations, host sources, and readers without 2D copies never pitch
    host_entries = {"w": TensorEntry("w", "float32", (8, 32), src.nbytes, 0, "cpu")}
    for buffers, ents, pitched in (({"d": dst}, entries, True),
                                   ({"d": _CudaDestination(dst)}, host_entries, True),
                                   ({"d": _CudaDestination(dst)}, entries, False)):
        runs = _runs_of([column], ents, buffers, 64 << 10, pitched=pitched)
        assert len(runs.covering) == 1 and not runs.pitched
