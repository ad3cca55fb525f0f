"""The layout of a rank's loaded form: which checkpoint region each tensor region holds.

A source publishes it beside its manifest; a target of another tensor-parallel layout
computes its own and intersects the two (:mod:`.plan`). Everything is in elements of
row-major boxes, never in addresses: the manifest says where a tensor lives, the
layout what it holds.

::

    Layout
    ├── checkpoint   [CheckpointTensor(name, shape, dtype)]   the checkpoint, in the
    │                                                         order its loader iterated it
    ├── tensors      {name: (shape, dtype)}                   loaded-form tensors written
    ├── pieces       [Piece(tensor, dst box, ckpt, src box)]  dst region <- checkpoint region
    ├── fills        [Fill(tensor, dst box, value)]           dst region <- a constant
    └── blocks       BlockTable | None                        digests of checkpoint blocks

A *box* is one ``(start, size)`` per dimension. A piece's two boxes hold the same
elements in the same row-major order once their size-1 dimensions are dropped (the
weight loaders narrow, chunk and copy; they never transpose, or the layout could not
be derived and the model is refused). Regions of a tensor that no piece or fill
names are not written by the loader: a target keeps what building the model put
there, as a load from disk does.

Block digests: every checkpoint tensor is cut into a grid of blocks (:func:`grid_units`:
at most eight per dimension the loaders slice, aligned with the shard boundaries of
tensor-parallel sizes 1, 2, 4 and 8 and with vLLM's vocabulary padding), and a source
publishes the digest of each block it holds, *computed from the checkpoint as it was
read from disk*, not from its own memory through its layout. A target that assembled a
block from a source checks it against that digest: a source whose layout says one
thing and whose memory holds another is caught there, as is a byte damaged on the way.

JSON (version 1)::

    {"format": "modelexpress.layout", "version": 1, "tp_size": 2, "rank": 0,
     "checkpoint": [[name, [dims], dtype], ...],
     "tensors": {name: [[dims], dtype]},
     "pieces": [[tensor, [[start, size], ...], ckpt, [[start, size], ...]], ...],
     "fills": [[tensor, [[start, size], ...], value], ...],
     "blocks": {"algorithm": "xxh3-128", "units": {ckpt: [unit per dim]},
                "dtypes": {ckpt: dtype}, "digests": {ckpt: {block index: digest}}}}

This module imports neither torch nor numpy.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from modelexpress.errors import LayoutError

__all__ = ["FORMAT", "VERSION", "Box", "BlockTable", "CheckpointTensor", "Fill", "Layout",
           "LayoutError", "Piece", "block_box", "block_boxes", "block_count", "blocks_in",
           "box_contains", "box_intersect", "box_volume", "grid_units", "squeeze_dims",
           "translate"]

FORMAT = "modelexpress.layout"
VERSION = 1
_MAX_PARTS = 8  # blocks per sliced dimension: TP sizes 1, 2, 4 and 8 split on their edges
_VOCAB_PAD = 64  # vLLM pads vocabularies to a multiple of 64 before splitting them

Box = tuple[tuple[int, int], ...]
"""``((start, size), ...)``: one per dimension, in elements."""


# --- boxes ------------------------------------------------------------------------------
def box_volume(box: Box) -> int:
    """Elements in ``box``."""
    return math.prod(size for _, size in box)


def box_intersect(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover, or None when they do not meet."""
    out = []
    for (sa, na), (sb, nb) in zip(a, b, strict=True):
        start, end = max(sa, sb), min(sa + na, sb + nb)
        if end <= start:
            return None
        out.append((start, end - start))
    return tuple(out)


def box_contains(outer: Box, inner: Box) -> bool:
    """Whether ``inner`` lies inside ``outer``."""
    if len(outer) != len(inner):
        raise ValueError(f"boxes of {len(outer)} and {len(inner)} dimensions")
    for (so, no), (si, ni) in zip(outer, inner):  # a loop: planning calls this per block
        if si < so or si + ni > so + no:
            return False
    return True


def squeeze_dims(box: Box) -> list[int]:
    """Indices of the dimensions of ``box`` whose size is not 1."""
    return [d for d, (_, size) in enumerate(box) if size != 1]


def translate(sub: Box, frm: Box, to: Box) -> Box:
    """The box of ``to`` that holds what ``sub`` (inside ``frm``) holds.

    ``frm`` and ``to`` are the two boxes of one piece: their dimensions of size other
    than 1 correspond in order. A dimension of size 1 keeps ``to``'s start.

    Raises:
        LayoutError: the two boxes do not correspond (a bug in whoever paired them).
    """
    pairs, fixed, base = _pairing(frm, to)
    for df in fixed:
        if sub[df] != frm[df]:
            raise LayoutError(f"box {sub} is not inside {frm}")
    out = list(base)
    for df, dt, shift in pairs:
        start, size = sub[df]
        out[dt] = (start + shift, size)
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _pairing(frm: Box, to: Box) -> tuple[tuple[tuple[int, int, int], ...], tuple[int, ...],
                                         tuple[tuple[int, int], ...]]:
    """What :func:`translate` needs of one pair of boxes, worked out once per pair (a
    plan translates every block of a piece through the same pair): the corresponding
    dimensions ``(from, to, start shift)``, the dimensions of ``frm`` of size 1, and the
    result's dimensions of size 1."""
    dims_from, dims_to = squeeze_dims(frm), squeeze_dims(to)
    if [frm[d][1] for d in dims_from] != [to[d][1] for d in dims_to]:
        raise LayoutError(f"boxes {frm} and {to} do not hold the same elements")
    pairs = tuple((df, dt, to[dt][0] - frm[df][0]) for df, dt in zip(dims_from, dims_to))
    fixed = tuple(d for d in range(len(frm)) if d not in dims_from)
    return pairs, fixed, tuple((start, 1) for start, _ in to)


# --- the block grid ------------------------------------------------------------------
def grid_units(shape: Sequence[int], sliced: Iterable[int]) -> tuple[int, ...]:
    """Block edge per dimension: ``round_up(size, 64) / 8`` on a sliced dimension, the
    whole size on the others.

    Why that edge: a dimension a TP size ``t`` in {2, 4, 8} splits is cut at multiples
    of ``size / t`` (linear layers; ``size`` a multiple of 64 in practice) or of
    ``round_up(size, 64) / t`` (vLLM's padded vocabulary): both are multiples of the
    unit, so every shard is whole blocks and a target verifies what it reads without
    reading more. Other sizes still work: a block a target needs only part of is read
    whole and checked before the part is kept (:mod:`.plan`).
    """
    sliced = set(sliced)
    units = []
    for d, size in enumerate(shape):
        if d in sliced and size > 0:
            padded = -(-size // _VOCAB_PAD) * _VOCAB_PAD
            units.append(max(padded // _MAX_PARTS, 1))
        else:
            units.append(max(size, 1))
    return tuple(units)


def block_count(shape: Sequence[int], units: Sequence[int]) -> tuple[int, ...]:
    """Blocks per dimension."""
    return tuple(max(-(-size // unit), 1) for size, unit in zip(shape, units, strict=True))


def block_box(index: int, shape: Sequence[int], units: Sequence[int]) -> Box:
    """The box of block ``index`` (row-major over the grid), clipped to ``shape``."""
    counts = block_count(shape, units)
    coords = []
    for n in reversed(counts):
        coords.append(index % n)
        index //= n
    coords.reverse()
    return tuple((c * u, min(u, size - c * u))
                 for c, u, size in zip(coords, units, shape, strict=True))


def blocks_in(box: Box, shape: Sequence[int], units: Sequence[int]) -> Iterator[int]:
    """Indices of the blocks that ``box`` touches, in row-major order."""
    return (index for index, _ in block_boxes(box, shape, units))


def block_boxes(box: Box, shape: Sequence[int], units: Sequence[int]
                ) -> Iterator[tuple[int, Box]]:
    """``(index, block box)`` of the blocks that ``box`` touches, in row-major order
    (each box as :func:`block_box` gives it; the grid worked out once)."""
    if not box:
        yield 0, ()
        return
    counts = block_count(shape, units)
    axes = []
    for (start, size), u, n in zip(box, units, shape, strict=True):
        if size <= 0:
            return
        axes.append([(c, (c * u, min(u, n - c * u)))
                     for c in range(start // u, (start + size - 1) // u + 1)])
    for combo in itertools.product(*axes):
        index = 0
        for (c, _), n in zip(combo, counts):
            index = index * n + c
        yield index, tuple(b for _, b in combo)


# --- records -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CheckpointTensor:
    """One checkpoint tensor as the loader saw it (its dtype on disk)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class Piece:
    """``tensor[dst] <- ckpt[src]`` (the two boxes hold the same elements in order)."""

    tensor: str
    dst: Box
    ckpt: str
    src: Box


@dataclasses.dataclass(frozen=True)
class Fill:
    """``tensor[dst] <- value`` (vocabulary padding)."""

    tensor: str
    dst: Box
    value: float


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """Digests of checkpoint blocks, as the loaded dtype holds them.

    Attributes:
        algorithm: a :mod:`modelexpress.transfer.digest` algorithm.
        units: checkpoint tensor -> block edge per dimension (:func:`grid_units`).
        dtypes: checkpoint tensor -> the dtype its blocks were hashed in (the loaded
            tensors' dtype; the loader casts while it copies).
        digests: checkpoint tensor -> {block index: digest}; a source lists the blocks
            it holds.
    """

    algorithm: str
    units: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, str]
    digests: Mapping[str, Mapping[int, str]]

    def digest(self, ckpt: str, index: int) -> str | None:
        """The digest of one block, or None when this table does not have it."""
        return self.digests.get(ckpt, {}).get(index)

    def to_json(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm,
                "units": {k: list(v) for k, v in self.units.items()},
                "dtypes": dict(self.dtypes),
                "digests": {k: {str(i): d for i, d in v.items()}
                            for k, v in self.digests.items()}}

    @classmethod
    def from_json(cls, obj: Any) -> "BlockTable":
        try:
            return cls(algorithm=str(obj["algorithm"]),
                       units={str(k): tuple(int(u) for u in v)
                              for k, v in obj["units"].items()},
                       dtypes={str(k): str(v) for k, v in obj["dtypes"].items()},
                       digests={str(k): {int(i): str(d) for i, d in v.items()}
                                for k, v in obj["digests"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LayoutError(f"malformed block table: {exc!r}") from exc


@dataclasses.dataclass(frozen=True)
class Layout:
    """What one rank's loaded tensors hold (see the module docstring).

    Attributes:
        checkpoint: the checkpoint's tensors in the loader's order.
        tensors: loaded-form tensor -> (shape, dtype), for every tensor a piece or fill
            writes.
        pieces, fills: the writes, in the order the loader made them (none overlap).
        blocks: the block digests this rank can vouch for, or None.
        tp_size, rank: what the layout was derived for (informational).
    """

    checkpoint: tuple[CheckpointTensor, ...]
    tensors: Mapping[str, tuple[tuple[int, ...], str]]
    pieces: tuple[Piece, ...]
    fills: tuple[Fill, ...] = ()
    blocks: BlockTable | None = None
    tp_size: int = 1
    rank: int = 0

    def checkpoint_by_name(self) -> dict[str, CheckpointTensor]:
        return {c.name: c for c in self.checkpoint}

    def pieces_by_ckpt(self) -> dict[str, list[Piece]]:
        out: dict[str, list[Piece]] = {}
        for p in self.pieces:
            out.setdefault(p.ckpt, []).append(p)
        return out

    def loaded_bytes(self, itemsize: Mapping[str, int]) -> int:
        """Bytes the pieces write (``itemsize``: dtype name -> bytes per element)."""
        return sum(box_volume(p.dst) * itemsize[self.tensors[p.tensor][1]] for p in self.pieces)

    def with_blocks(self, blocks: BlockTable | None) -> "Layout":
        return dataclasses.replace(self, blocks=blocks)

    # --- JSON ------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The JSON object published with a source."""
        out: dict[str, Any] = {
            "format": FORMAT, "version": VERSION, "tp_size": self.tp_size, "rank": self.rank,
            "checkpoint": [[c.name, list(c.shape), c.dtype] for c in self.checkpoint],
            "tensors": {k: [list(s), d] for k, (s, d) in self.tensors.items()},
            "pieces": [[p.tensor, _box_json(p.dst), p.ckpt, _box_json(p.src)]
                       for p in self.pieces],
            "fills": [[f.tensor, _box_json(f.dst), f.value] for f in self.fills],
        }
        if self.blocks is not None:
            out["blocks"] = self.blocks.to_json()
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def from_json(cls, obj: Any) -> "Layout":
        """Parse and check a published layout.

        Raises:
            LayoutError: not a layout, another version, malformed, or inconsistent (a
                piece naming a tensor or checkpoint tensor it does not declare, a box
                outside its tensor, two boxes that do not correspond).
        """
        if not isinstance(obj, Mapping) or obj.get("format") != FORMAT:
            raise LayoutError("not a modelexpress layout")
        if obj.get("version") != VERSION:
            raise LayoutError(f"layout version {obj.get('version')!r} is not supported (this "
                              f"build reads version {VERSION})")
        try:
            checkpoint = tuple(CheckpointTensor(str(n), tuple(int(x) for x in s), str(d))
                               for n, s, d in obj["checkpoint"])
            tensors = {str(k): (tuple(int(x) for x in s), str(d))
                       for k, (s, d) in obj["tensors"].items()}
            pieces = tuple(Piece(str(t), _box(dst), str(c), _box(src))
                           for t, dst, c, src in obj["pieces"])
            fills = tuple(Fill(str(t), _box(dst), float(v)) for t, dst, v in obj.get("fills", []))
            blocks = BlockTable.from_json(obj["blocks"]) if obj.get("blocks") else None
            layout = cls(checkpoint=checkpoint, tensors=tensors, pieces=pieces, fills=fills,
                         blocks=blocks, tp_size=int(obj.get("tp_size", 1)),
                         rank=int(obj.get("rank", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise LayoutError(f"malformed layout: {exc!r}") from exc
        layout.check()
        return layout

    @classmethod
    def loads(cls, text: str | bytes) -> "Layout":
        try:
            return cls.from_json(json.loads(text))
        except ValueError as exc:
            if isinstance(exc, LayoutError):
                raise
            raise LayoutError(f"layout is not valid JSON: {exc}") from exc

    def check(self) -> None:
        """Raise LayoutError when a piece or fill does not fit what the layout declares."""
        ckpt = self.checkpoint_by_name()
        if len(ckpt) != len(self.checkpoint):
            raise LayoutError("the layout lists a checkpoint tensor twice")
        for p in self.pieces:
            if p.tensor not in self.tensors or p.ckpt not in ckpt:
                raise LayoutError(f"piece {p.tensor} <- {p.ckpt} names an undeclared tensor")
            _check_box(p.dst, self.tensors[p.tensor][0], p.tensor)
            _check_box(p.src, ckpt[p.ckpt].shape, p.ckpt)
            translate(p.src, p.src, p.dst)  # raises when the boxes do not correspond
        for f in self.fills:
            if f.tensor not in self.tensors:
                raise LayoutError(f"fill of {f.tensor} names an undeclared tensor")
            _check_box(f.dst, self.tensors[f.tensor][0], f.tensor)


def _box_json(box: Box) -> list[list[int]]:
    return [[s, n] for s, n in box]


def _box(raw: Any) -> Box:
    return tuple((int(s), int(n)) for s, n in raw)


def _check_box(box: Box, shape: Sequence[int], name: str) -> None:
    if len(box) != len(shape) or any(s < 0 or n < 0 or s + n > dim
                                     for (s, n), dim in zip(box, shape)):
        raise LayoutError(f"box {box} lies outside {name} of shape {tuple(shape)}")
