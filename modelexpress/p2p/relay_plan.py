"""Fleet relay planning: which holder a target reads each chunk of a model from.

When many targets start together, every one reading the origin splits the origin's
uplink N ways: the last finishes after about ``N x T1`` (``T1``: one model over one
link). A target that is still receiving can serve the chunks it already verified,
so targets read from each other and the origin sends the model about once
(DESIGN.md, "Fleet relay"). This module is the pure part of that: given the holders
of a model when a transfer is claimed, pick the one the new target reads from and
the holders to fall back on. The server runs it at claim time
(``ControlPlane.claim_assignments``); ``bench/fleet_sim.py`` runs the same function
over modelled links for fleets of up to thousands.

Holders and refs
----------------
A holder is a READY source (``s:<source id>``: holds every chunk) or a live transfer
whose target relays (``t:<transfer id>``: holds a growing prefix of the chunks, in
manifest order, and advertises it in its progress reports). An :class:`Assignment`
is the upstream holder and the ``path`` behind it: the upstream first, then its own
upstream, and so on to a complete holder last. A target whose upstream dies or stalls
reads the chunks it still misses from the next holder on the path; the origin (a
complete holder) is always last, so a failure costs only the chunks not yet received.

Chain or tree
-------------
With equal links, a pipelined **chain** (origin -> t1 -> t2 -> ... -> tN, each
target reading chunk ``i`` from its predecessor while the predecessor reads chunk
``i + 1``) uses every uplink once at the full link rate, and the last target
finishes after ``T1 x (1 + (N - 1) h / K)`` for ``K`` chunks per model, where a hop
lags ``h`` chunks (:data:`HOP_CHUNKS`): within 1.3x of one target alone for
``(N - 1) h <= 0.3 K``. A tree of fan-out ``r`` gives each child ``1 / r`` of its
parent's uplink (leaves' uplinks stay idle), so it needs
``r x T1 x (1 + (depth - 1) h / K)`` with ``depth ~ log_r N``: at least twice a chain
until ``N h`` exceeds about ``K``, but it grows with ``log N`` instead of ``N``. So the
planner builds a chain while the fleet is small against the chunk count and an
``r``-ary tree beyond (:func:`choose_fanout` compares the two predictions); the
choice is made at each claim, from the transfers live then, not when a transfer is
created. ``MX_RELAY_READERS_PER_SOURCE`` fixes ``r`` instead (1: always a chain).

A holder's reader limit is ``r``, raised where links are known: a holder whose uplink
is ``k`` times the target's downlink serves ``k`` readers at their full rate (a
100 Gbit/s origin feeding 25 Gbit/s targets starts four chains). When every holder is
at its limit, the least loaded, shallowest one is taken: a transfer never waits for a
slot.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["Holder", "Assignment", "HOP_CHUNKS", "MIN_PIECE_BYTES", "PIECES_PER_MODEL",
           "assign", "choose_fanout", "predicted_t1", "piece_bytes", "tensor_chunks",
           "chunks_of", "source_ref", "transfer_ref", "parse_ref"]

_MAX_FANOUT = 8
HOP_CHUNKS = 3.5
"""How far behind its holder a relay reader runs, in chunks' time at the link rate:
the chunk itself, the reader's window of two chunks in flight, and the advert's poll
(measured: ~150 ms for 512 KiB chunks at 100 Mbit/s, 42 ms a chunk: bench/cluster.py,
docs/benchmarks.md "Fleet relay"). A planner that took one chunk kept chains far past
the point where a tree is faster."""


PIECES_PER_MODEL = 128
"""A relay piece is at most about this fraction of the model (:func:`piece_bytes`)."""
MIN_PIECE_BYTES = 256 << 10
"""The smallest piece :func:`piece_bytes` picks: each piece is a NIXL request."""
_LINK_PIECE_S = 0.005  # a piece lasts at least this long on a known link


def piece_bytes(total_bytes: int, most: int, link_mbit: float = 0.0) -> int:
    """Bytes per relay piece for a model of ``total_bytes``.

    A chain's last target trails one alone by ``(N - 1) x HOP_CHUNKS`` pieces' time, so
    what matters is a piece's share of the model, not its size: a fixed 2-4 MiB piece is
    a large share of a small model on a slow link (91 MB at 400 Mbit/s: the last of 8
    at 1.30 x one alone with 2 MiB pieces, 1.12 with 512 KiB; docs/benchmarks.md,
    "Fleet relay"). So a piece is the largest power of two within
    ``total_bytes / PIECES_PER_MODEL``, at least :data:`MIN_PIECE_BYTES` and what a
    known link carries in 5 ms (on fast links each request's fixed cost would show
    first), and at most ``most`` (``MX_RELAY_CHUNK_BYTES``; a smaller ``most`` wins).

    Args:
        total_bytes: the model's bytes (the origin's manifest).
        most: the largest piece.
        link_mbit: the reader's link when known (``MX_RELAY_LINK_MBIT``; 0: unknown).

    Returns:
        The piece size in bytes.

    Raises:
        ValueError: ``most < 1``.
    """
    if most < 1:
        raise ValueError(f"most must be >= 1 (got {most})")
    share = MIN_PIECE_BYTES
    while share * 2 <= total_bytes / PIECES_PER_MODEL:
        share *= 2
    link = int(link_mbit * 1e6 / 8 * _LINK_PIECE_S) if link_mbit > 0 else 0
    return min(most, max(share, link))


def source_ref(source_id: str) -> str:
    """The ref of a READY source (holds every chunk)."""
    return f"s:{source_id}"


def transfer_ref(transfer_id: str) -> str:
    """The ref of a relaying transfer (holds a prefix of the chunks)."""
    return f"t:{transfer_id}"


def parse_ref(ref: str) -> tuple[str, str]:
    """``("source" | "transfer", id)`` of a ref.

    Raises:
        ValueError: not ``s:<id>`` nor ``t:<id>``.
    """
    kind, sep, ident = ref.partition(":")
    if not sep or not ident or kind not in ("s", "t"):
        raise ValueError(f"{ref!r} is not a holder ref (s:<source id> or t:<transfer id>)")
    return ("source" if kind == "s" else "transfer"), ident


@dataclasses.dataclass(frozen=True)
class Holder:
    """One holder of a model as the planner sees it at a claim.

    Attributes:
        ref: ``s:<source id>`` or ``t:<transfer id>``.
        complete: holds every chunk now (a READY source).
        readers: live transfers reading from it now.
        path: a relaying transfer's own path (its upstream first); empty when complete.
        uplink_mbit: its uplink when known (0: unknown).
    """

    ref: str
    complete: bool
    readers: int = 0
    path: tuple[str, ...] = ()
    uplink_mbit: float = 0.0

    @property
    def depth(self) -> int:
        """Hops from a complete holder (0 for one)."""
        return 0 if self.complete else len(self.path)


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Where a target reads from.

    Attributes:
        upstream: the holder to read every chunk from while it keeps up.
        path: ``upstream`` first, then the holders to fall back on, a complete one last.
        fanout: the reader limit per holder used for this claim (1: a chain).
        saturated: every holder was at its limit; ``upstream`` is the least loaded.
    """

    upstream: str
    path: tuple[str, ...]
    fanout: int
    saturated: bool = False


def _tree_depth(n: int, fanout: int) -> int:
    """Depth of the deepest of ``n`` targets in a complete ``fanout``-ary tree under
    one origin (the origin has ``fanout`` children)."""
    if fanout == 1:
        return n
    depth, level, placed = 0, 1, 0
    while placed < n:
        level *= fanout
        placed += level
        depth += 1
    return depth


def predicted_t1(n: int, chunks: int, fanout: int, hop_chunks: float = HOP_CHUNKS) -> float:
    """Time to the last of ``n`` targets in units of ``T1``, equal links:
    ``fanout x (1 + (depth - 1) x hop_chunks / chunks)`` (see the module docstring),
    where a hop makes its reader lag ``hop_chunks`` chunks' time behind its holder."""
    if n <= 0:
        return 0.0
    depth = _tree_depth(n, fanout)
    return fanout * (1.0 + (depth - 1) * hop_chunks / max(chunks, 1))


def choose_fanout(n: int, chunks: int, max_fanout: int = _MAX_FANOUT,
                  hop_chunks: float = HOP_CHUNKS) -> int:
    """The reader limit per holder that :func:`predicted_t1` says finishes ``n``
    targets of a ``chunks``-chunk model first (ties: the smaller)."""
    best, best_t = 1, predicted_t1(n, chunks, 1, hop_chunks)
    for r in range(2, max(max_fanout, 1) + 1):
        t = predicted_t1(n, chunks, r, hop_chunks)
        if t < best_t - 1e-12:
            best, best_t = r, t
    return best


def _limit(holder: Holder, fanout: int, downlink_mbit: float) -> int:
    if holder.uplink_mbit > 0 and downlink_mbit > 0:
        return max(fanout, int(holder.uplink_mbit // downlink_mbit))
    return fanout


def assign(holders: Sequence[Holder], *, fanout: int, downlink_mbit: float = 0.0
           ) -> Assignment:
    """Pick the upstream of a new target among ``holders``.

    The shallowest holder with a free reader slot (``fanout``, raised by known links),
    complete holders before relaying ones at equal depth, then the fewest readers, then
    the largest known uplink; ties keep the given order (the server passes holders
    oldest first). Filling the shallowest level first builds a chain for ``fanout=1``
    and a balanced tree otherwise.

    Args:
        holders: every holder of the model (the target's own excluded).
        fanout: readers per holder (:func:`choose_fanout`, or the setting).
        downlink_mbit: the target's downlink when known (0: unknown).

    Returns:
        The :class:`Assignment`.

    Raises:
        ValueError: no holder, none complete on any path, or ``fanout < 1``.
    """
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1 (got {fanout})")
    if not holders:
        raise ValueError("no holder of the model to read from")
    order = {h.ref: i for i, h in enumerate(holders)}

    def key(h: Holder) -> tuple:
        return (h.depth, not h.complete, h.readers, -h.uplink_mbit, order[h.ref])

    free = [h for h in holders if h.readers < _limit(h, fanout, downlink_mbit)]
    saturated = not free
    if saturated:
        # Over-subscribe the holder whose readers would each get the largest share.
        pick = min(holders, key=lambda h: (
            (h.readers + 1) / _limit(h, fanout, downlink_mbit), h.depth, order[h.ref]))
    else:
        pick = min(free, key=key)
    path = (pick.ref,) if pick.complete else (pick.ref, *pick.path)
    if not path or not any(h.complete and h.ref == path[-1] for h in holders):
        complete = [h.ref for h in holders if h.complete]
        if not complete:
            raise ValueError("no complete holder (READY source) of the model: a relay "
                             "chain must end at one")
        if path[-1] not in complete:
            path = (*path, complete[0])
    return Assignment(upstream=pick.ref, path=path, fanout=fanout, saturated=saturated)


def tensor_chunks(nbytes: Sequence[int], chunk_bytes: int) -> list[tuple[int, int, int]]:
    """Group tensors (in manifest order) into relay chunks of whole tensors.

    A chunk closes once it holds ``chunk_bytes`` or more; a tensor larger than that is a
    chunk of its own. Whole tensors keep every chunk verifiable by the manifest's
    per-tensor digests.

    Args:
        nbytes: each tensor's size, in manifest order.
        chunk_bytes: target bytes per chunk (``MX_RELAY_CHUNK_BYTES``).

    Returns:
        ``(first tensor, one past the last, end offset in bytes)`` per chunk; the end
        offsets are the prefix sizes a holder advertises.

    Raises:
        ValueError: ``chunk_bytes < 1``.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1 (got {chunk_bytes})")
    out: list[tuple[int, int, int]] = []
    start, filled, offset = 0, 0, 0
    for i, n in enumerate(nbytes):
        filled += int(n)
        offset += int(n)
        if filled >= chunk_bytes:
            out.append((start, i + 1, offset))
            start, filled = i + 1, 0
    if start < len(nbytes):
        out.append((start, len(nbytes), offset))
    return out


def chunks_of(total_bytes: int, chunk_bytes: int) -> int:
    """About how many chunks a model of ``total_bytes`` has (for :func:`choose_fanout`)."""
    return max(1, math.ceil(total_bytes / max(chunk_bytes, 1)))
