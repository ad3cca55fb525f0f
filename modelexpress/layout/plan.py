"""Cross-layout planning: which source regions fill which target regions, checked how.

Given the target rank's :class:`~.model.Layout` and the layouts of candidate sources
(in the control plane's order), :func:`plan_layout` decides before any byte moves:

1. **Units.** Every target piece is cut into the checkpoint's blocks (the sources'
   :class:`~.model.BlockTable` grid). A block inside one target piece is read straight
   into the target tensor; a block the target holds only part of (a grid that does not
   fit this layout's shard edges) is read whole into a *scratch* buffer, checked, and
   only its part is kept (a covering read: more bytes, still verified).
2. **Sources.** Each unit is taken from the first source, in the given order, whose
   pieces cover it alone and whose block table vouches for it; failing that, from
   several (their regions must not overlap and must vouch for the same digest). A unit
   no source covers makes the whole plan fail (:class:`CoverageError`): never a
   partially resharded model.
3. **Copies.** Units taken from the same source piece into the same target piece are
   merged back into one box, so a target whose shard is one source shard reads it as
   one copy; each source byte is read at most once per target (a checkpoint region
   several sources hold, e.g. KV heads replicated across ranks, is read from one).
4. **Checks.** One per block: the digest the supplying source's table gives, and where
   the block lies on the target once it arrived (:mod:`.readers` verifies them).

The plan is pure data; it imports neither torch nor numpy.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

from modelexpress._gc import paused as gc_paused
from modelexpress.errors import CoverageError
from modelexpress.layout.model import (BlockTable, Box, Fill, Layout, LayoutError, Piece,
                                       block_boxes, box_contains, box_intersect, box_volume,
                                       translate)

__all__ = ["Check", "Copy", "CoverageError", "LayoutPlan", "Scatter", "Scratch", "ITEMSIZE",
           "plan_layout"]

log = logging.getLogger(__name__)

ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
            "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1,
            "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}
"""Bytes per element by dtype name (torch's names without ``torch.``)."""


@dataclasses.dataclass(frozen=True)
class Copy:
    """Read ``src_tensor[src_box]`` of ``source`` into ``dst[dst_box]`` (a target tensor
    or a scratch buffer); ``nbytes`` is the box's size."""

    source: str
    src_tensor: str
    src_box: Box
    dst: str
    dst_box: Box
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Check:
    """Block ``block`` of ``ckpt`` lies at ``where[box]`` once read; it must hash to
    ``digest``. ``sources``: who supplied it."""

    ckpt: str
    block: int
    digest: str
    where: str
    box: Box
    sources: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Scratch:
    """A buffer a covering read lands in (one checkpoint block, in the target's dtype)."""

    key: str
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class Scatter:
    """After the checks: ``tensor[dst_box] <- src[src_box]`` on the target (``src`` is a
    scratch buffer, or a target tensor for a region the target holds twice)."""

    src: str
    src_box: Box
    tensor: str
    dst_box: Box


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """Everything a cross-layout pull does, decided before any byte moves.

    Attributes:
        copies: the reads, in source order then target order.
        checks: one per block assembled.
        scratch: buffers of the covering reads.
        scatters: local copies once the checks passed.
        fills: constants the target writes itself (padding).
        algorithm: the block digest algorithm.
        needed_bytes: bytes the target's pieces hold.
        read_bytes: bytes the copies move (more than ``needed_bytes`` only for covering
            reads).
        sources: the sources used, in the order given.
        units: the block grid of each checkpoint tensor the checks use.
        dtypes: the dtype each checkpoint tensor's blocks are hashed in (the target's).
    """

    copies: tuple[Copy, ...]
    checks: tuple[Check, ...]
    scratch: tuple[Scratch, ...]
    scatters: tuple[Scatter, ...]
    fills: tuple[Fill, ...]
    algorithm: str
    needed_bytes: int
    read_bytes: int
    sources: tuple[str, ...]
    units: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    dtypes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def verified_blocks(self) -> BlockTable:
        """The block table of what the target holds once the checks passed: the
        digests it checked (of the checkpoint, whoever supplied them), to publish when it
        serves its own layout."""
        digests: dict[str, dict[int, str]] = {}
        for c in self.checks:
            digests.setdefault(c.ckpt, {})[c.block] = c.digest
        return BlockTable(algorithm=self.algorithm,
                          units={k: v for k, v in self.units.items() if k in digests},
                          dtypes={k: v for k, v in self.dtypes.items() if k in digests},
                          digests=digests)

    def by_source(self) -> dict[str, list[Copy]]:
        """The copies of each source used, in plan order."""
        out: dict[str, list[Copy]] = {key: [] for key in self.sources}
        for c in self.copies:
            out[c.source].append(c)
        return out


@dataclasses.dataclass
class _Unit:
    """One block (or the part of it a target piece holds), to read and check."""

    ckpt: str
    block: int
    region: Box                  # checkpoint coordinates
    dst: str                     # target tensor, or scratch key
    dst_box: Box                 # where ``region`` lands in ``dst``
    target_piece: int            # -1 for scratch


def _scratch_key(ckpt: str, block: int) -> str:
    return f"#scratch:{ckpt}#{block}"


def plan_layout(target: Layout, sources: Sequence[tuple[str, Layout]]) -> LayoutPlan:
    """Plan reading ``target``'s pieces from ``sources`` (tried in the order given).

    Args:
        target: the layout this rank needs.
        sources: ``(key, layout)`` of each candidate, in preference order. Sources whose
            checkpoint or block grid disagrees with the first usable one are left out
            (logged).

    Returns:
        The plan.

    Raises:
        CoverageError: some block no usable source holds (the message names it).
        LayoutError: no source publishes block digests, or the target's tensors
            disagree with the sources' (dtype).
    """
    with gc_paused():  # tens of thousands of small objects, no cycles (modelexpress._gc)
        return _plan(target, sources)


def _plan(target: Layout, sources: Sequence[tuple[str, Layout]]) -> LayoutPlan:
    usable = _usable(target, sources)
    if not usable:
        raise CoverageError("no candidate source publishes a layout with block digests "
                            "for this checkpoint")
    algorithm = usable[0][1].blocks.algorithm  # type: ignore[union-attr]
    units_of = _grid(usable)
    by_ckpt = {key: layout.pieces_by_ckpt() for key, layout in usable}
    ckpt_shape = {c.name: c.shape for c in target.checkpoint}

    units: list[_Unit] = []
    scratch: dict[str, tuple[tuple[int, ...], str]] = {}
    scatters: list[Scatter] = []
    direct: dict[tuple[str, int], tuple[str, Box]] = {}  # block -> where it landed first
    for pi, piece in enumerate(target.pieces):
        grid = units_of.get(piece.ckpt)
        if grid is None:
            raise CoverageError(f"no source publishes block digests of checkpoint tensor "
                                f"{piece.ckpt!r} (needed by {piece.tensor})")
        shape = ckpt_shape[piece.ckpt]
        dtype = target.tensors[piece.tensor][1]
        for b, block in block_boxes(piece.src, shape, grid):
            if box_contains(piece.src, block):
                where = translate(block, piece.src, piece.dst)
                if (piece.ckpt, b) in direct:
                    # the target holds this block twice: read once, copy locally
                    first, first_box = direct[(piece.ckpt, b)]
                    scatters.append(Scatter(first, first_box, piece.tensor, where))
                    continue
                direct[(piece.ckpt, b)] = (piece.tensor, where)
                units.append(_Unit(piece.ckpt, b, block, piece.tensor, where, pi))
            else:
                key = _scratch_key(piece.ckpt, b)
                if key not in scratch:
                    scratch[key] = (tuple(n for _, n in block), dtype)
                    units.append(_Unit(piece.ckpt, b, block, key,
                                       tuple((0, n) for _, n in block), -1))
                part = box_intersect(block, piece.src)
                assert part is not None  # block_boxes yields blocks the piece touches
                scatters.append(Scatter(key, translate(part, block, tuple((0, n) for _, n in block)),
                                        piece.tensor, translate(part, piece.src, piece.dst)))

    # Each unit from one source if one covers it, else from several.
    parts: dict[tuple, list[Box]] = {}  # (source, its piece, unit dst, target piece) -> boxes
    checks: list[Check] = []
    piece_of = {key: {id(p): i for i, p in enumerate(layout.pieces)} for key, layout in usable}
    for unit in units:
        taken, digest = _assign(unit, usable, by_ckpt)
        for key, q, region in taken:
            group = (key, piece_of[key][id(q)], unit.dst, unit.target_piece,
                     unit.dst_box if unit.target_piece < 0 else None)
            parts.setdefault(group, []).append(region)
        checks.append(Check(unit.ckpt, unit.block, digest, unit.dst, unit.dst_box,
                            tuple(dict.fromkeys(k for k, _, _ in taken))))

    layouts = dict(usable)
    scratch_region = {u.dst: u.region for u in units if u.target_piece < 0}
    copies: list[Copy] = []
    read = 0
    for (key, qi, dst, tpi, scratch_box), regions in parts.items():
        q = layouts[key].pieces[qi]
        itemsize = ITEMSIZE.get(layouts[key].tensors[q.tensor][1], 0)
        for region in _merge(regions):
            if tpi >= 0:
                tp = target.pieces[tpi]
                dst_box = translate(region, tp.src, tp.dst)
            else:
                unit_region = scratch_region[dst]
                dst_box = translate(region, unit_region, tuple((0, n) for _, n in unit_region))
            nbytes = box_volume(region) * itemsize
            read += nbytes
            copies.append(Copy(key, q.tensor, translate(region, q.src, q.dst), dst, dst_box,
                               nbytes))
    needed = sum(box_volume(p.dst) * ITEMSIZE.get(target.tensors[p.tensor][1], 0)
                 for p in target.pieces)
    order = {key: i for i, (key, _) in enumerate(usable)}
    copies.sort(key=lambda c: order[c.source])
    used = tuple(key for key, _ in usable if any(c.source == key for c in copies))
    return LayoutPlan(copies=tuple(copies), checks=tuple(checks),
                      scratch=tuple(Scratch(k, s, d) for k, (s, d) in scratch.items()),
                      scatters=tuple(scatters), fills=target.fills, algorithm=algorithm,
                      needed_bytes=needed, read_bytes=read, sources=used,
                      units={p.ckpt: units_of[p.ckpt] for p in target.pieces},
                      dtypes={p.ckpt: target.tensors[p.tensor][1] for p in target.pieces})


def _usable(target: Layout, sources: Sequence[tuple[str, Layout]]) -> list[tuple[str, Layout]]:
    """The sources whose checkpoint, dtypes and block tables agree with the target's and
    with the first usable source's."""
    mine = target.checkpoint_by_name()
    out: list[tuple[str, Layout]] = []
    first_algorithm = None
    for key, layout in sources:
        why = None
        theirs = layout.checkpoint_by_name()
        clash = next((n for n, c in mine.items() if n in theirs and theirs[n] != c), None)
        if layout.blocks is None:
            why = "it publishes no block digests"
        elif clash is not None:
            why = f"its checkpoint differs at {clash!r} ({theirs[clash]} vs {mine[clash]})"
        elif first_algorithm is not None and layout.blocks.algorithm != first_algorithm:
            why = (f"its block digests are {layout.blocks.algorithm}, the first source's "
                   f"{first_algorithm}")
        else:
            bad = next((p.tensor for p in layout.pieces if p.tensor in target.tensors
                        and layout.tensors[p.tensor][1] != target.tensors[p.tensor][1]), None)
            if bad is not None:
                why = (f"its {bad} is {layout.tensors[bad][1]}, this target's "
                       f"{target.tensors[bad][1]}")
        if why is not None:
            log.warning("cross-layout source %s left out: %s", key, why)
            continue
        first_algorithm = first_algorithm or layout.blocks.algorithm  # type: ignore[union-attr]
        out.append((key, layout))
    return out


def _grid(usable: Sequence[tuple[str, Layout]]) -> dict[str, tuple[int, ...]]:
    """Block edges per checkpoint tensor: the first source's; a later source with other
    edges for a tensor is not used for it (its digests are of other blocks)."""
    out: dict[str, tuple[int, ...]] = {}
    for _key, layout in usable:
        assert layout.blocks is not None
        for ckpt, units in layout.blocks.units.items():
            out.setdefault(ckpt, units)
    return out


def _assign(unit: _Unit, usable: Sequence[tuple[str, Layout]],
            by_ckpt: Mapping[str, Mapping[str, list[Piece]]]
            ) -> tuple[list[tuple[str, Piece, Box]], str]:
    """The (source, source piece, region) parts that cover ``unit`` and the digest they
    vouch for. One source if any covers the unit alone, else several."""
    grid = None
    candidates = []
    region = unit.region
    for key, layout in usable:
        assert layout.blocks is not None
        units = layout.blocks.units.get(unit.ckpt)
        if grid is None and units is not None:
            grid = units
        digest = layout.blocks.digest(unit.ckpt, unit.block)
        if units != grid or digest is None:
            continue  # no digest of this block from it: it cannot be checked
        pieces = by_ckpt[key].get(unit.ckpt, ())
        whole = next((q for q in pieces if box_contains(q.src, region)), None)
        if whole is not None:  # one piece holds it all (the usual case)
            return [(key, whole, region)], digest
        parts = _cover(region, pieces)
        candidates.append((key, digest, parts))
        if sum(box_volume(r) for _, r in parts) == box_volume(region):
            return [(key, q, r) for q, r in parts], digest
    # Several sources together: greedy, regions disjoint, one digest.
    taken: list[tuple[str, Piece, Box]] = []
    digest = None
    for key, theirs, parts in candidates:
        if digest is not None and theirs != digest:
            continue
        for q, r in parts:
            if all(box_intersect(r, other) is None for _, _, other in taken):
                taken.append((key, q, r))
                digest = theirs
    if digest is None or sum(box_volume(r) for _, _, r in taken) != box_volume(unit.region):
        raise CoverageError(f"no source, nor several together, holds block {unit.block} "
                            f"{list(unit.region)} of checkpoint tensor {unit.ckpt!r} "
                            f"(needed by {unit.dst})")
    return taken, digest


def _cover(region: Box, pieces: Sequence[Piece]) -> list[tuple[Piece, Box]]:
    """The disjoint parts of ``region`` that ``pieces`` hold (first piece wins)."""
    out: list[tuple[Piece, Box]] = []
    for q in pieces:
        part = box_intersect(region, q.src)
        if part is not None and all(box_intersect(part, r) is None for _, r in out):
            out.append((q, part))
    return out


def _merge(boxes: list[Box]) -> list[Box]:
    """Merge boxes that are adjacent along one dimension and equal in the others."""
    boxes = sorted(boxes)
    changed = True
    while changed and len(boxes) > 1:
        changed = False
        out: list[Box] = []
        for b in boxes:
            if out:
                merged = _join(out[-1], b)
                if merged is not None:
                    out[-1] = merged
                    changed = True
                    continue
            out.append(b)
        boxes = sorted(out)
    return boxes


def _join(a: Box, b: Box) -> Box | None:
    d = -1
    for dim in range(len(a)):  # the one dimension they differ in
        if a[dim] != b[dim]:
            if d >= 0:
                return None
            d = dim
    if d < 0:
        return None
    (sa, na), (sb, nb) = a[d], b[d]
    if sa + na != sb:
        return None
    return a[:d] + ((sa, na + nb),) + a[d + 1:]
