"""Layouts and cross-layout planning on hand-written layouts of a two-layer model shape.

The layouts here are what vLLM's loaders produce for a column-parallel weight (rows
split), a row-parallel weight (columns split), a merged qkv (three checkpoint tensors
stacked, KV heads replicated when TP exceeds them), a padded vocabulary and a
replicated norm; ``tests/engines/test_vllm_layout.py`` derives the real ones.
Digests are stand-ins computed from the block's coordinates, so that a plan can be
checked against "what a source would have published" without torch.
"""

from __future__ import annotations

import pytest

from modelexpress.layout import (BlockTable, CheckpointTensor, CoverageError, Fill, Layout,
                                 LayoutError, Piece, block_box, block_boxes, blocks_in,
                                 box_volume, grid_units, plan_layout, translate)

H, KV, I, V = 64, 16, 128, 100  # hidden, one KV head of 16, intermediate, a vocab of 100
CKPT = (CheckpointTensor("q", (H, H), "float32"), CheckpointTensor("k", (KV, H), "float32"),
        CheckpointTensor("v", (KV, H), "float32"), CheckpointTensor("o", (H, H), "float32"),
        CheckpointTensor("down", (H, I), "float32"), CheckpointTensor("embed", (V, H), "float32"),
        CheckpointTensor("norm", (H,), "float32"))
SLICED = {"q": {0}, "k": {0}, "v": {0}, "o": {1}, "down": {1}, "embed": {0}}


def _rows(start: int, n: int, width: int) -> tuple[tuple[int, int], ...]:
    return ((start, n), (0, width))


def layout_of(tp: int, rank: int, digests: bool = True) -> Layout:
    """The layout vLLM gives rank ``rank`` of ``tp`` for the checkpoint above."""
    q = H // tp
    kv_rank = 0  # one KV head: every rank holds it (vLLM replicates KV heads when TP > 1)
    per_vocab = -(-V // 64) * 64 // tp  # vLLM pads the vocabulary to 64, then splits it
    v0 = rank * per_vocab
    v_held = max(min(per_vocab, V - v0), 0)
    pieces = [
        Piece("qkv", _rows(0, q, H), "q", _rows(rank * q, q, H)),
        Piece("qkv", _rows(q, KV, H), "k", _rows(kv_rank, KV, H)),
        Piece("qkv", _rows(q + KV, KV, H), "v", _rows(kv_rank, KV, H)),
        Piece("o", ((0, H), (0, H // tp)), "o", ((0, H), (rank * H // tp, H // tp))),
        Piece("down", ((0, H), (0, I // tp)), "down", ((0, H), (rank * I // tp, I // tp))),
        Piece("embed", _rows(0, v_held, H), "embed", _rows(v0, v_held, H)),
        Piece("norm", ((0, H),), "norm", ((0, H),)),
    ]
    fills = (Fill("embed", _rows(v_held, per_vocab - v_held, H), 0.0),) if v_held < per_vocab else ()
    tensors = {"qkv": ((q + 2 * KV, H), "float32"), "o": ((H, H // tp), "float32"),
               "down": ((H, I // tp), "float32"), "embed": ((per_vocab, H), "float32"),
               "norm": ((H,), "float32")}
    layout = Layout(checkpoint=CKPT, tensors=tensors, pieces=tuple(pieces), fills=fills,
                    tp_size=tp, rank=rank)
    return layout.with_blocks(_table(layout)) if digests else layout


def fake_digest(ckpt: str, index: int) -> str:
    return f"{ckpt}/{index}"


def _table(layout: Layout, units: dict | None = None) -> BlockTable:
    shapes = {c.name: c.shape for c in layout.checkpoint}
    units = units or {name: grid_units(shape, SLICED.get(name, ())) for name, shape in shapes.items()}
    digests: dict[str, dict[int, str]] = {}
    for p in layout.pieces:
        for b in blocks_in(p.src, shapes[p.ckpt], units[p.ckpt]):
            digests.setdefault(p.ckpt, {})[b] = fake_digest(p.ckpt, b)
    return BlockTable("xxh3-128", units, {n: "float32" for n in shapes}, digests)


def test_json_round_trip_keeps_every_field() -> None:
    layout = layout_of(2, 1)
    again = Layout.loads(layout.dumps())
    assert again == layout
    assert again.blocks is not None and again.blocks.digest("q", 4) == "q/4"


@pytest.mark.parametrize("break_it, words", [
    (lambda o: o.update(version=99), "version 99"),
    (lambda o: o["pieces"].append(["nope", [[0, 1]], "q", [[0, 1], [0, 1]]]), "undeclared"),
    (lambda o: o["pieces"].append(["norm", [[0, 65]], "norm", [[0, 65]]]), "outside"),
    (lambda o: o["pieces"].append(["o", [[0, 64], [0, 32]], "o", [[0, 32], [0, 64]]]),
     "same elements"),
    (lambda o: o.update(format="other"), "not a modelexpress layout"),
])
def test_malformed_layouts_are_refused_with_the_reason(break_it, words) -> None:
    obj = layout_of(2, 0).to_json()
    break_it(obj)
    with pytest.raises(LayoutError, match=words):
        Layout.from_json(obj)


def test_grid_edges_fall_on_every_tp_shard_edge_of_1_2_4_8() -> None:
    # a linear dimension and vLLM's padded vocabulary (128256 is Llama 3's)
    for size, padded in ((4096, 4096), (14336, 14336), (128256, 128256), (30522, 30528)):
        unit = grid_units((size,), {0})[0]
        for tp in (2, 4, 8):
            edges = [r * padded // tp for r in range(1, tp)]
            assert all(edge % unit == 0 for edge in edges), (size, tp)
    assert grid_units((64, 128), {1}) == (64, 16)  # an unsliced dimension is one block


def test_block_boxes_tile_the_tensor() -> None:
    shape, units = (100, 64), grid_units((100, 64), {0, 1})
    boxes = [block_box(i, shape, units) for i in blocks_in(((0, 100), (0, 64)), shape, units)]
    assert sum(box_volume(b) for b in boxes) == 100 * 64
    assert boxes[-1] == ((96, 4), (56, 8))  # the last block is clipped


def test_block_boxes_are_blocks_in_with_their_boxes() -> None:
    shape, units = (100, 3, 64), grid_units((100, 3, 64), {0, 2})
    for box in (((0, 100), (0, 3), (0, 64)), ((13, 50), (1, 1), (9, 30)),
                ((99, 1), (2, 1), (63, 1)), ((0, 0), (0, 3), (0, 64))):
        assert list(block_boxes(box, shape, units)) == \
            [(i, block_box(i, shape, units)) for i in blocks_in(box, shape, units)]


def test_translate_maps_a_sub_box_through_a_piece() -> None:
    # rows 8..16 of checkpoint k land at rows 40..48 of qkv
    assert translate(((8, 8), (0, 64)), ((0, 16), (0, 64)), ((32, 16), (0, 64))) == \
        ((40, 8), (0, 64))
    # row 3 of a 2-d checkpoint tensor is a 1-d tensor's elements 128..192
    row = (((3, 1), (0, 64)), ((128, 64),))
    assert translate(((3, 1), (16, 8)), *row) == ((144, 8),)
    for _ in range(2):  # the second time from the pairing worked out the first time
        with pytest.raises(LayoutError, match="is not inside"):
            translate(((4, 1), (16, 8)), *row)
        with pytest.raises(LayoutError, match="same elements"):
            translate(((0, 1), (0, 8)), ((0, 2), (0, 64)), ((0, 64),))


def test_tp2_to_tp1_reads_each_rank_once_and_whole() -> None:
    target = layout_of(1, 0, digests=False)
    plan = plan_layout(target, [("r0", layout_of(2, 0)), ("r1", layout_of(2, 1))])
    assert plan.read_bytes == plan.needed_bytes  # no byte twice, no covering read
    assert not plan.scratch
    assert set(plan.sources) == {"r0", "r1"}
    # the replicated KV head comes from the first rank only
    k = [c for c in plan.copies if c.dst == "qkv" and c.dst_box[0] == (H, KV)]
    assert [c.source for c in k] == ["r0"]
    # a row-parallel weight: one copy per source rank, each its whole tensor
    o = sorted((c.source, c.src_box, c.dst_box) for c in plan.copies if c.dst == "o")
    assert o == [("r0", ((0, H), (0, H // 2)), ((0, H), (0, H // 2))),
                 ("r1", ((0, H), (0, H // 2)), ((0, H), (H // 2, H // 2)))]
    # every block checked once, with the digest the supplying source published
    assert all(c.digest == fake_digest(c.ckpt, c.block) for c in plan.checks)
    assert len({(c.ckpt, c.block) for c in plan.checks}) == len(plan.checks)


def test_tp1_to_tp2_reads_only_this_ranks_half() -> None:
    source = layout_of(1, 0)
    for rank in (0, 1):
        target = layout_of(2, rank, digests=False)
        plan = plan_layout(target, [("s", source)])
        assert plan.read_bytes == plan.needed_bytes < source.loaded_bytes({"float32": 4})
        o = [c for c in plan.copies if c.dst == "o"]
        assert [c.src_box for c in o] == [((0, H), (rank * H // 2, H // 2))]
        assert plan.fills == target.fills


def test_a_block_the_target_holds_in_part_is_read_whole_into_scratch() -> None:
    # A grid that does not fit TP=2's edges (a unit of 24 rows on the 64 q rows).
    units = {c.name: grid_units(c.shape, SLICED.get(c.name, ())) for c in CKPT}
    units["q"] = (24, H)
    source = layout_of(1, 0, digests=False)
    source = source.with_blocks(_table(source, units))
    plan = plan_layout(layout_of(2, 0, digests=False), [("s", source)])
    # rows 0..32 of q: blocks 0 (0..24) and 1 (24..48), the second read whole
    assert [s.shape for s in plan.scratch] == [(24, H)]
    assert plan.read_bytes == plan.needed_bytes + 16 * H * 4
    scatter = next(s for s in plan.scatters if s.src.startswith("#scratch"))
    assert scatter.src_box == ((0, 8), (0, H)) and scatter.dst_box == ((24, 8), (0, H))


def test_a_source_that_lacks_a_region_leaves_it_to_the_next() -> None:
    r0, r1 = layout_of(2, 0), layout_of(2, 1)
    plan = plan_layout(layout_of(1, 0, digests=False), [("r0", r0), ("full", layout_of(1, 0)),
                                                        ("r1", r1)])
    assert "r1" not in plan.sources  # "full" covers what r0 lacks before r1 is asked
    with pytest.raises(CoverageError, match="checkpoint tensor 'q'"):
        plan_layout(layout_of(1, 0, digests=False), [("r0", r0)])


def test_a_source_without_block_digests_is_not_used() -> None:
    with pytest.raises(CoverageError, match="block digests"):
        plan_layout(layout_of(1, 0, digests=False), [("s", layout_of(1, 0, digests=False))])


def test_a_source_of_another_checkpoint_is_left_out() -> None:
    other = layout_of(1, 0)
    other = Layout(checkpoint=tuple(CheckpointTensor(c.name, c.shape, "bfloat16")
                                    for c in other.checkpoint),
                   tensors=other.tensors, pieces=other.pieces, fills=other.fills,
                   blocks=other.blocks)
    plan = plan_layout(layout_of(2, 0, digests=False), [("other", other), ("s", layout_of(1, 0))])
    assert plan.sources == ("s",)


def test_a_block_is_assembled_from_several_sources_when_none_holds_it_alone() -> None:
    # Coarse blocks (the whole of q is one block): neither TP=2 rank holds a block of q.
    units = {c.name: grid_units(c.shape, SLICED.get(c.name, ())) for c in CKPT}
    units["q"] = (H, H)
    r0, r1 = (layout_of(2, r, digests=False) for r in (0, 1))
    r0, r1 = r0.with_blocks(_table(r0, units)), r1.with_blocks(_table(r1, units))
    plan = plan_layout(layout_of(1, 0, digests=False), [("r0", r0), ("r1", r1)])
    check = next(c for c in plan.checks if c.ckpt == "q")
    assert check.sources == ("r0", "r1")
    assert plan.read_bytes == plan.needed_bytes
