"""Registration strategies: which memory regions to hand to NIXL.

``per_tensor``
    One region per tensor (overlapping tensors, e.g. views, merged). Always valid.
    Costs one registration each: 128-238 ms and 751 KB of agent metadata for 3000
    tensors on an H200 host, vs 0.7 KB for one region.
``spans``
    For DRAM: the union of tensors that touch or overlap (one region per run).
    For VRAM: one region per underlying storage (a cudaMalloc block can be named by
    one CUDA IPC handle; a span across two allocations cannot).
``segments``
    VRAM only: one region per caching-allocator segment that holds a tensor (from
    ``torch.cuda.memory_snapshot``), so tensors allocated one by one in load order can
    still be coalesced into few descriptors. DRAM falls back to ``spans``.
``single_region``
    The arena's used range ``[base, base + used)`` as one region: the dmabuf path of
    the VMM arena seed (one ``ibv_reg_dmabuf_mr`` over many ``cuMemCreate`` handles),
    and for the host backend one DRAM region that CMA/TCP read across handles.
``per_chunk``
    One region per live arena allocation (one physical handle each).

:func:`choose_arena_strategy` picks what is valid; see its docstring for the rules.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from modelexpress.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["ArenaLike", "Region", "Strategy", "StrategyChoice", "choose_arena_strategy",
           "regions_for_arena", "regions_for_tensors"]

log = logging.getLogger(__name__)

Region = tuple[int, int, int]  # (addr, nbytes, device index)


class Strategy(str, enum.Enum):
    PER_TENSOR = "per_tensor"
    SPANS = "spans"
    SEGMENTS = "segments"
    SINGLE_REGION = "single_region"
    PER_CHUNK = "per_chunk"


class ArenaLike(Protocol):
    """What registration needs of a ``modelexpress.vmm.VmmArena``."""

    granularity: int
    backend: Any  # has .kind in {"host", "cuda", "stub"}

    def registered_range(self) -> tuple[int, int]: ...
    def live_allocations(self) -> list[tuple[int, int]]: ...


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    """The strategy :func:`choose_arena_strategy` picked and why."""

    strategy: Strategy
    reason: str


def _tensor_span(t: torch.Tensor) -> tuple[int, int, int]:
    n = t.numel() * t.element_size()
    dev = 0 if t.device.type == "cpu" else int(t.device.index or 0)
    return t.data_ptr(), t.data_ptr() + n, dev


def _union(spans: Iterable[tuple[int, int, int]], touch: bool) -> list[Region]:
    """Merge overlapping spans (and touching ones when ``touch``), per device."""
    out: list[list[int]] = []
    for start, stop, dev in sorted(s for s in spans if s[1] > s[0]):
        if out and out[-1][2] == dev and (start < out[-1][1] or (touch and start == out[-1][1])):
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop, dev])
    return [(a, b - a, d) for a, b, d in out]


def _cuda_segments(device_spans: list[tuple[int, int, int]]) -> list[Region]:
    import torch
    segments = sorted((int(s["address"]), int(s["address"]) + int(s["total_size"]),
                       int(s["device"])) for s in torch.cuda.memory_snapshot())
    chosen: set[tuple[int, int, int]] = set()
    leftovers: list[tuple[int, int, int]] = []
    for start, stop, dev in device_spans:
        seg = next((s for s in segments if s[2] == dev and s[0] <= start and stop <= s[1]), None)
        if seg is None:
            leftovers.append((start, stop, dev))  # not from the caching allocator (arena, IPC)
        else:
            chosen.add(seg)
    return [(a, b - a, d) for a, b, d in sorted(chosen)] + _union(leftovers, touch=False)


def regions_for_tensors(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor],
                        strategy: Strategy | str = Strategy.SPANS) -> dict[str, list[Region]]:
    """Regions to register for ``tensors``, grouped by NIXL memory kind.

    Args:
        tensors: the tensors (a mapping's values are used).
        strategy: per_tensor, spans or segments.

    Returns:
        ``{"DRAM": [...], "VRAM": [...]}`` (kinds without tensors omitted).

    Raises:
        ConfigError: unknown or arena-only strategy, or a non-contiguous tensor.
    """
    strategy = Strategy(strategy)
    if strategy in (Strategy.SINGLE_REGION, Strategy.PER_CHUNK):
        raise ConfigError(f"{strategy.value} applies to an arena; use register_arena "
                          "(allowed here: per_tensor, spans, segments)")
    values = list(tensors.values()) if isinstance(tensors, Mapping) else list(tensors)
    for t in values:
        if not t.is_contiguous():
            raise ConfigError("only contiguous tensors can be registered; call .contiguous()")
    dram_tensors = [t for t in values if t.device.type == "cpu"]
    vram_tensors = [t for t in values if t.device.type != "cpu"]
    out: dict[str, list[Region]] = {}
    if dram_tensors:
        if strategy == Strategy.PER_TENSOR:
            out["DRAM"] = _union((_tensor_span(t) for t in dram_tensors), touch=False)
        else:
            # Whole storages: tensors carved from one allocation (a slab, with alignment
            # padding between them) are one region, not one per gap-separated run.
            out["DRAM"] = _union(_storage_spans(dram_tensors), touch=True)
    if vram_tensors:
        if strategy == Strategy.PER_TENSOR:
            out["VRAM"] = _union((_tensor_span(t) for t in vram_tensors), touch=False)
        elif strategy == Strategy.SEGMENTS:
            out["VRAM"] = _cuda_segments([_tensor_span(t) for t in vram_tensors])
        else:
            out["VRAM"] = _union(_storage_spans(vram_tensors), touch=False)
    return out


def _storage_spans(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(start, end, device) of each distinct storage behind ``tensors``."""
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() == 0:
            continue
        device = int(t.device.index or 0) if t.device.type != "cpu" else 0
        storages[(s.data_ptr(), device)] = (s.data_ptr(), s.data_ptr() + s.nbytes(), device)
    return list(storages.values())


def choose_arena_strategy(arena: ArenaLike, tensors: Iterable[torch.Tensor], *,
                          transport: str = "auto", force_single_region: bool = False
                          ) -> StrategyChoice:
    """Pick how to register an arena's tensors.

    Rules, in order:

    1. an empty arena (``used == 0``) -> per_tensor;
    2. any tensor outside ``[base, base + used)`` -> per_tensor (the region would not
       cover it);
    3. ``force_single_region`` (``MX_VMM_ARENA_SINGLE_MR=1``) -> single_region, logged as a
       warning on ``cuda_ipc``: only safe on dmabuf/IB;
    4. a CUDA arena with more than one live allocation on ``cuda_ipc`` -> per_chunk: a
       CUDA IPC handle names exactly one ``cuMemCreate`` allocation, so one region
       over several publishes an rkey covering only the first (openucx/ucx#11283);
    5. otherwise single_region (host arena: one DRAM region that CMA/TCP read across
       handles; CUDA arena on dmabuf/IB; one handle on cuda_ipc).

    Args:
        arena: a ``VmmArena`` (see :class:`ArenaLike`).
        tensors: the tensors that must be covered.
        transport: ``"auto"`` (host arena -> ``"dram"``, CUDA arena -> ``"cuda_ipc"``,
            the same-host NVLink case), ``"cuda_ipc"``, ``"dmabuf"`` or ``"dram"``.
        force_single_region: the ``MX_VMM_ARENA_SINGLE_MR`` override.

    Returns:
        The choice and its reason.

    Raises:
        ConfigError: unknown transport.
    """
    allowed = ("auto", "cuda_ipc", "dmabuf", "dram")
    if transport not in allowed:
        raise ConfigError(f"transport must be one of {allowed} (got {transport!r})")
    kind = getattr(arena.backend, "kind", "stub")
    if transport == "auto":
        transport = "cuda_ipc" if kind == "cuda" else "dram"
    base, used = arena.registered_range()
    if used == 0:
        return StrategyChoice(Strategy.PER_TENSOR, "the arena is empty (used == 0)")
    spans = [_tensor_span(t) for t in tensors]
    outside = [s for s in spans if not (base <= s[0] and s[1] <= base + used)]
    if outside:
        return StrategyChoice(
            Strategy.PER_TENSOR,
            f"{len(outside)} of {len(spans)} tensors lie outside the arena range "
            f"[{base:#x}, {base + used:#x})")
    handles = len(arena.live_allocations())
    if force_single_region:
        if transport == "cuda_ipc" and handles > 1:
            log.warning("MX_VMM_ARENA_SINGLE_MR=1 forces one region over %d arena handles on "
                        "cuda_ipc; peers can only map the first handle there (safe on "
                        "dmabuf/IB only, openucx/ucx#11283)", handles)
        return StrategyChoice(Strategy.SINGLE_REGION, "forced by MX_VMM_ARENA_SINGLE_MR")
    if kind == "cuda" and transport == "cuda_ipc" and handles > 1:
        return StrategyChoice(
            Strategy.PER_CHUNK,
            f"{handles} physical handles on cuda_ipc: one IPC handle names one cuMemCreate "
            "allocation (openucx/ucx#11283), so each handle is its own region")
    return StrategyChoice(Strategy.SINGLE_REGION,
                          f"{handles} handles, transport {transport}: one region is valid")


def regions_for_arena(arena: ArenaLike, strategy: Strategy, device: int) -> list[Region]:
    """Regions of an arena for single_region or per_chunk.

    Raises:
        ConfigError: another strategy (those are computed from tensors).
    """
    if strategy == Strategy.SINGLE_REGION:
        base, used = arena.registered_range()
        return [(base, used, device)]
    if strategy == Strategy.PER_CHUNK:
        return [(va, size, device) for va, size in arena.live_allocations()]
    raise ConfigError(f"regions_for_arena handles single_region and per_chunk, not {strategy}")
