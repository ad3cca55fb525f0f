"""Tensor layouts shared by the test source process (_peer.py) and the tests.

Every layout is deterministic: ``make(kind, fill=True)`` on either side yields the
same names, shapes and bytes, so the target can check what it received.
"""

from __future__ import annotations

import zlib

import torch

# model-like shapes of one small transformer layer (bf16), repeated to reach a count
_LAYER = [((64,), torch.bfloat16), ((64, 64), torch.bfloat16), ((192, 64), torch.bfloat16),
          ((64, 192), torch.bfloat16), ((64,), torch.float32), ((16, 64), torch.bfloat16)]


def shapes(kind: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) in load order."""
    if kind == "single":
        return [("embed.weight", (4096, 2048), torch.bfloat16)]          # 16 MiB
    if kind == "many":
        out = []
        for i in range(3000):
            shape, dtype = _LAYER[i % len(_LAYER)]
            out.append((f"layers.{i // len(_LAYER)}.p{i % len(_LAYER)}", shape, dtype))
        return out
    if kind == "chunky":                                                  # 48 x 1 MiB
        return [(f"blk.{i}", (512, 1024), torch.bfloat16) for i in range(48)]
    raise ValueError(kind)


def fill(name: str, t: torch.Tensor) -> None:
    """Deterministic bytes for tensor ``name``."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    raw = t.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), generator=g, dtype=torch.uint8))


def fill_cuda(name: str, t: torch.Tensor) -> None:
    """:func:`fill` for a GPU tensor (filled on the CPU, copied once)."""
    host = torch.empty(t.shape, dtype=t.dtype)
    fill(name, host)
    t.copy_(host)


def carve(kind: str, filled: bool, device: str = "cpu",
          specs: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None,
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """All tensors of ``kind`` (or ``specs``) as contiguous views of one buffer."""
    specs = specs if specs is not None else shapes(kind)
    sizes = [torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for _, s, d in specs]
    buf = torch.zeros(sum(sizes), dtype=torch.uint8)
    out, off = {}, 0
    for (name, shape, dtype), n in zip(specs, sizes):
        t = buf[off:off + n].view(dtype).view(shape)
        if filled:
            fill(name, t)
        out[name] = t
        off += n
    if device != "cpu":
        buf = buf.to(device)
        out, off = {}, 0
        for (name, shape, dtype), n in zip(specs, sizes):
            out[name] = buf[off:off + n].view(dtype).view(shape)
            off += n
    return buf, out


def specs_of(manifest) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of a manifest's tensors, for building matching destinations."""
    return [(e.name, e.shape, getattr(torch, e.dtype)) for e in manifest.tensors]


def expected(manifest) -> dict[str, torch.Tensor]:
    """The bytes the source filled each manifest tensor with."""
    _, out = carve("", filled=True, specs=specs_of(manifest))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8)))


def arena_tensors(arena, filled: bool) -> dict[str, torch.Tensor]:
    """Four tensors in an arena, each a whole number of granules, so consecutive
    allocations are contiguous and one descriptor crosses handle boundaries."""
    g = arena.granularity
    out = {}
    for i, granules in enumerate((1, 3, 2, 1)):
        t = arena.empty((granules * g // 2,), torch.bfloat16)
        if filled:
            fill(f"arena.{i}", t)
        out[f"arena.{i}"] = t
    return out
