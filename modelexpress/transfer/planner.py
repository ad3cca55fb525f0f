"""Descriptor planning: match, validate, coalesce, chunk.

1. **Match** source (manifest) and target tensors by name. A dtype, shape or size
   difference is a :class:`ManifestMismatchError` before any byte moves; names on
   one side only are an error unless the caller allows a partial transfer.
2. **Coalesce**: NIXL posts each descriptor separately (~5 us each) and does not
   merge adjacent ones (3000 tensors: 139 GB/s vs 396 GB/s as one descriptor
   between two H200s). Pairs are walked in source address order; a pair whose local *and*
   remote bytes directly follow the previous descriptor's is merged into it, as
   long as the merged span stays inside one registered region on each side (NIXL
   rejects a descriptor that straddles two registrations).
3. **Chunk**: descriptors are grouped into chunks of at most ``chunk_bytes`` (one
   larger descriptor is split at the same offsets on both sides) so that progress
   is reported and a stop honoured between chunks. The first chunk can be smaller
   (``first_chunk_bytes``) so that the transport rate check runs early.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from modelexpress.errors import ConfigError, ManifestMismatchError
from modelexpress.transfer.manifest import Manifest, TensorEntry, tensor_entry

if TYPE_CHECKING:
    import torch

__all__ = ["Chunk", "Pair", "ReadPlan", "RegionIndex", "coalesce", "match", "plan_read",
           "plan_runs"]

_MAX_LISTED = 8  # problems listed in one error message


@dataclasses.dataclass(frozen=True)
class Pair:
    """One tensor to read: the local destination and the remote source."""

    name: str
    local: TensorEntry
    remote: TensorEntry


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A group of descriptor pieces posted as one NIXL request."""

    start: int          # first piece index (into ReadPlan.local_descs rows)
    stop: int           # one past the last piece index
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """Everything a READ needs, computed before any byte moves.

    Attributes:
        pairs: matched tensors in source address order.
        descriptors: descriptor count after coalescing (before chunk splitting).
        local_descs / remote_descs: Nx3 uint64 arrays (addr, nbytes, device) of pieces.
        chunks: consecutive piece ranges.
        done_after: per pair, the index of the chunk after which all its bytes arrived
            (chunks complete in order).
        local_mem / remote_mem: NIXL memory kinds of each side.
    """

    pairs: tuple[Pair, ...]
    descriptors: int
    local_descs: np.ndarray
    remote_descs: np.ndarray
    chunks: tuple[Chunk, ...]
    done_after: tuple[int, ...]
    local_mem: str
    remote_mem: str

    @property
    def total_bytes(self) -> int:
        # The chunks' bytes: the pairs' (zero-byte tensors add nothing), or those of the
        # runs a plan_runs() plan carries without pairs.
        return sum(c.nbytes for c in self.chunks)


class RegionIndex:
    """Registered regions of one side, for "is this span inside one region" queries."""

    def __init__(self, regions: Sequence[tuple[int, int, int]]) -> None:
        merged = sorted((int(a), int(a) + int(n), int(d)) for a, n, d in regions if n > 0)
        self._starts = [r[0] for r in merged]
        self._regions = merged

    def containing(self, addr: int, end: int, device: int) -> int | None:
        """Index of a region holding [addr, end) on ``device``, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        # Regions may overlap (a tensor registered twice); scan back a little.
        while i >= 0 and self._starts[i] <= addr:
            start, stop, dev = self._regions[i]
            if dev == device and end <= stop:
                return i
            i -= 1
        return None


def match(manifest: Manifest, local: Mapping[str, torch.Tensor], *,
          allow_partial: bool = False) -> list[Pair]:
    """Match the manifest against local tensors by name and check each pair.

    Args:
        manifest: the source's manifest.
        local: name -> destination tensor (contiguous).
        allow_partial: names present on only one side are skipped instead of failing.

    Returns:
        The matched pairs, in the manifest's order.

    Raises:
        ManifestMismatchError: a dtype/shape/size differs, a name is missing on one side
            (unless ``allow_partial``), or nothing matched at all.
    """
    remote = manifest.by_name()
    problems: list[str] = []
    missing_local = [n for n in remote if n not in local]
    extra_local = [n for n in local if n not in remote]
    if not allow_partial:
        if missing_local:
            problems.append(f"{len(missing_local)} source tensors have no local destination "
                            f"(e.g. {missing_local[:_MAX_LISTED]})")
        if extra_local:
            problems.append(f"{len(extra_local)} local tensors are not in the source manifest "
                            f"(e.g. {extra_local[:_MAX_LISTED]})")
    pairs: list[Pair] = []
    for entry in manifest.tensors:
        tensor = local.get(entry.name)
        if tensor is None:
            continue
        if not tensor.is_contiguous():
            problems.append(f"{entry.name}: local tensor is not contiguous")
            continue
        mine = tensor_entry(entry.name, tensor)
        if (mine.dtype != entry.dtype or mine.nbytes != entry.nbytes
                or mine.shape != tuple(entry.shape)):
            diffs = [f"{what} source={a} local={b}" for what, a, b in (
                ("dtype", entry.dtype, mine.dtype), ("shape", list(entry.shape), list(mine.shape)),
                ("nbytes", entry.nbytes, mine.nbytes)) if a != b]
            problems.append(f"{entry.name}: " + ", ".join(diffs))
            continue
        pairs.append(Pair(entry.name, mine, entry))
    if problems:
        shown = "; ".join(problems[:_MAX_LISTED])
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise ManifestMismatchError(
            f"source {manifest.agent_name or '?'} and local tensors differ: {shown}{more}. "
            "Nothing was transferred; load the same model/revision/dtype/parallel layout "
            "on both sides" + ("" if allow_partial else " or allow a partial transfer"))
    if not pairs:
        raise ManifestMismatchError(
            f"no tensor of source {manifest.agent_name or '?'} matches a local tensor")
    return pairs


def coalesce(pairs: Sequence[Pair], local_regions: RegionIndex | None,
             remote_regions: RegionIndex | None) -> list[tuple[int, int, int, int, int, int, int]]:
    """Merge runs of pairs contiguous on both sides into single descriptors.

    Args:
        pairs: in source address order.
        local_regions / remote_regions: registered regions; None disables merging.

    Returns:
        Descriptors ``(local_addr, remote_addr, nbytes, local_dev, remote_dev,
        first_pair, last_pair)``.
    """
    out: list[list[int]] = []
    for i, p in enumerate(pairs):
        la, ra, n = p.local.addr, p.remote.addr, p.local.nbytes
        if n == 0:
            continue  # nothing to move; NIXL rejects empty descriptors
        ld, rd = p.local.device_index, p.remote.device_index
        if out and local_regions is not None and remote_regions is not None:
            prev = out[-1]
            if (prev[0] + prev[2] == la and prev[1] + prev[2] == ra
                    and prev[3] == ld and prev[4] == rd
                    and local_regions.containing(prev[0], la + n, ld) is not None
                    and remote_regions.containing(prev[1], ra + n, rd) is not None):
                prev[2] += n
                prev[6] = i
                continue
        out.append([la, ra, n, ld, rd, i, i])
    return [tuple(d) for d in out]  # type: ignore[misc]


def plan_read(manifest: Manifest, local: Mapping[str, torch.Tensor], *,
              local_regions: Sequence[tuple[int, int, int]] = (), allow_partial: bool = False,
              coalesce_descriptors: bool = True, chunk_bytes: int = 1 << 30,
              first_chunk_bytes: int | None = None) -> ReadPlan:
    """Plan a READ of ``manifest``'s tensors into ``local``.

    Args:
        manifest: the source's manifest (with its registered regions).
        local: name -> destination tensor.
        local_regions: this side's registered regions (addr, nbytes, device).
        allow_partial: see :func:`match`.
        coalesce_descriptors: merge contiguous runs (False: one descriptor per tensor).
        chunk_bytes: most bytes per posted request.
        first_chunk_bytes: a smaller first chunk (for an early rate check).

    Returns:
        The plan.

    Raises:
        ManifestMismatchError: see :func:`match`.
        ConfigError: bad chunk size, or tensors of mixed memory kinds on one side.
    """
    if chunk_bytes <= 0 or (first_chunk_bytes is not None and first_chunk_bytes <= 0):
        raise ConfigError(f"chunk sizes must be > 0 (got {chunk_bytes}, {first_chunk_bytes})")
    pairs = sorted(match(manifest, local, allow_partial=allow_partial),
                   key=lambda p: (p.remote.device_index, p.remote.addr))
    local_mems = {p.local.mem for p in pairs}
    remote_mems = {p.remote.mem for p in pairs}
    if len(local_mems) > 1 or len(remote_mems) > 1:
        raise ConfigError(
            f"one READ moves one memory kind per side; got local {sorted(local_mems)} and "
            f"remote {sorted(remote_mems)}: split the tensors into one read per kind")
    descs = coalesce(pairs, RegionIndex(local_regions) if coalesce_descriptors else None,
                     RegionIndex(manifest.regions) if coalesce_descriptors else None)

    local_rows: list[tuple[int, int, int]] = []
    remote_rows: list[tuple[int, int, int]] = []
    chunks: list[Chunk] = []
    start, filled = 0, 0
    limit = first_chunk_bytes or chunk_bytes

    def close_chunk() -> None:
        nonlocal start, filled, limit
        if len(local_rows) > start:
            chunks.append(Chunk(start, len(local_rows), filled))
        start, filled, limit = len(local_rows), 0, chunk_bytes

    for la, ra, n, ld, rd, first, last in descs:
        off = 0
        while off < n:
            if filled >= limit:
                close_chunk()
            take = min(n - off, limit - filled)
            local_rows.append((la + off, take, ld))
            remote_rows.append((ra + off, take, rd))
            off += take
            filled += take
    close_chunk()

    # done_after[pair] = chunk index holding the pair's last byte.
    piece_chunk = np.empty(len(local_rows), dtype=np.int64)
    for ci, c in enumerate(chunks):
        piece_chunk[c.start:c.stop] = ci
    done_after = [0] * len(pairs)
    piece = 0
    for la, ra, n, ld, rd, first, last in descs:
        # Walk the pieces of this descriptor and the pairs inside it together.
        piece_end = la
        for pi in range(first, last + 1):
            pair_end = pairs[pi].local.addr + pairs[pi].local.nbytes
            while piece_end < pair_end:
                piece_end = int(local_rows[piece][0] + local_rows[piece][1])
                piece += 1
            done_after[pi] = int(piece_chunk[piece - 1]) if piece else 0

    return ReadPlan(
        pairs=tuple(pairs), descriptors=len(descs),
        local_descs=np.array(local_rows, dtype=np.uint64).reshape(-1, 3),
        remote_descs=np.array(remote_rows, dtype=np.uint64).reshape(-1, 3),
        chunks=tuple(chunks), done_after=tuple(done_after),
        local_mem=next(iter(local_mems)), remote_mem=next(iter(remote_mems)))


def plan_runs(local_descs: np.ndarray, remote_descs: np.ndarray, *, local_mem: str,
              remote_mem: str, chunk_bytes: int = 1 << 30,
              first_chunk_bytes: int | None = None) -> ReadPlan:
    """A plan of byte runs a caller chose itself (a cross-layout read: boxes of tensors,
    ``modelexpress.layout.spans``), chunked like :func:`plan_read`'s. It has no pairs:
    nothing in it is verified by tensor digest (the caller checks what it assembled).

    Args:
        local_descs / remote_descs: Nx3 (addr, nbytes, device) rows, the same sizes row
            by row, in the order to read them.
        local_mem / remote_mem: NIXL memory kinds (``DRAM``, ``VRAM``).
        chunk_bytes, first_chunk_bytes: as :func:`plan_read`.

    Raises:
        ConfigError: bad chunk sizes, or rows that differ in size between the sides.
    """
    if chunk_bytes <= 0 or (first_chunk_bytes is not None and first_chunk_bytes <= 0):
        raise ConfigError(f"chunk sizes must be > 0 (got {chunk_bytes}, {first_chunk_bytes})")
    local_descs = np.asarray(local_descs, dtype=np.uint64).reshape(-1, 3)
    remote_descs = np.asarray(remote_descs, dtype=np.uint64).reshape(-1, 3)
    if len(local_descs) != len(remote_descs) or not np.array_equal(local_descs[:, 1],
                                                                   remote_descs[:, 1]):
        raise ConfigError("local and remote runs differ in number or size")
    local_rows: list[tuple[int, int, int]] = []
    remote_rows: list[tuple[int, int, int]] = []
    chunks: list[Chunk] = []
    start, filled = 0, 0
    limit = first_chunk_bytes or chunk_bytes
    for (la, n, ld), (ra, _, rd) in zip(local_descs.tolist(), remote_descs.tolist()):
        off = 0
        while off < n:
            if filled >= limit:
                chunks.append(Chunk(start, len(local_rows), filled))
                start, filled, limit = len(local_rows), 0, chunk_bytes
            take = min(n - off, limit - filled)
            local_rows.append((la + off, take, ld))
            remote_rows.append((ra + off, take, rd))
            off += take
            filled += take
    if len(local_rows) > start:
        chunks.append(Chunk(start, len(local_rows), filled))
    return ReadPlan(pairs=(), descriptors=len(local_descs),
                    local_descs=np.array(local_rows, dtype=np.uint64).reshape(-1, 3),
                    remote_descs=np.array(remote_rows, dtype=np.uint64).reshape(-1, 3),
                    chunks=tuple(chunks), done_after=(), local_mem=local_mem,
                    remote_mem=remote_mem)
