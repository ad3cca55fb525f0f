"""A checkpoint and its tensor-parallel layouts written by hand, for pulls across layouts
without vLLM's model classes.

The GPU tests use it: the GPU host's vLLM build (0.26.0, CUDA) does not build models on
the CPU the way ``tests/engines/vllm_layouts.py`` does with the CPU build, and what a
pull into GPU memory exercises (the readers' device paths, block digests on the GPU)
does not depend on which loader derived the layout. The layouts are those vLLM's loaders
give (``tests/engines/test_vllm_layout.py`` derives the real ones): a merged qkv whose
one KV head every rank holds, row-parallel ``o`` and ``down`` (columns split), a
vocabulary padded to 64 and split, a replicated norm. The checkpoint's values come from
a seed, so a source process and the test build the same bytes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping

import torch

from modelexpress.identity import ModelIdentity
from modelexpress.layout import (BlockTable, CheckpointTensor, Fill, Layout, Piece, block_box,
                                 blocks_in, grid_units)
from modelexpress.transfer import digest as _digest

MODEL = "layout-tests/synthetic"


def _dims() -> tuple[int, int, int, int]:
    """Hidden size, KV rows, MLP width, vocabulary: the tests' small ones, or
    ``LAYOUT_SYNTHETIC_DIMS="H,KV,INTER,VOCAB"`` (``bench/layout.py --synthetic`` sets it;
    its source processes inherit it, so every process builds the same checkpoint)."""
    raw = os.environ.get("LAYOUT_SYNTHETIC_DIMS")
    if not raw:
        return 512, 128, 1024, 1000
    h, kv, inter, vocab = (int(x) for x in raw.split(","))
    if h % 8 or inter % 8:
        raise ValueError(f"LAYOUT_SYNTHETIC_DIMS={raw!r}: H and INTER must split 8 ways")
    return h, kv, inter, vocab


def _layers() -> int:
    """Layers: one, or ``LAYOUT_SYNTHETIC_LAYERS`` (``bench/layout.py --layers``), each
    with its own qkv, o, down and norm."""
    layers = int(os.environ.get("LAYOUT_SYNTHETIC_LAYERS", "1"))
    if layers < 1:
        raise ValueError(f"LAYOUT_SYNTHETIC_LAYERS={layers}: at least one layer")
    return layers


H, KV, INTER, VOCAB = _dims()
LAYERS = _layers()
_LAYER = {"q": ((H, H), {0}), "k": ((KV, H), {0}), "v": ((KV, H), {0}), "o": ((H, H), {1}),
          "down": ((H, INTER), {1})}


def _prefix(layer: int) -> str:
    return "" if LAYERS == 1 else f"l{layer}."


def layer_name(layer: int, name: str) -> str:
    """The checkpoint's (and the loaded form's) name of ``name`` in layer ``layer``."""
    return _prefix(layer) + name


def _checkpoint_shapes() -> dict[str, tuple[tuple[int, ...], set[int]]]:
    out = {}
    for layer in range(LAYERS):
        out.update({_prefix(layer) + n: v for n, v in _LAYER.items()})
        if layer == 0:
            out["embed"] = ((VOCAB, H), {0})
        out[_prefix(layer) + "norm"] = ((H,), set())
    return out


SHAPES = {name: shape for name, (shape, _) in _checkpoint_shapes().items()}
SLICED = {name: sliced for name, (_, sliced) in _checkpoint_shapes().items() if sliced}


def identity(tp: int, rank: int, dtype: str = "float32") -> ModelIdentity:
    return ModelIdentity(model=MODEL, dtype=dtype, tp_size=tp, rank=rank,
                         extra=(("test", "synthetic"),))


class Checkpoint(Mapping[str, torch.Tensor]):
    """The checkpoint's tensors (the same bytes in every process), each made from a seed
    of its own when it is looked up: at the bench's sizes (``--layers``) the whole
    checkpoint is not held anywhere at once. Made on the CPU, or on the device
    ``LAYOUT_SYNTHETIC_SEED_DEVICE`` names (``bench/layout.py`` on a GPU: seconds where
    the CPU takes minutes; other bytes than the CPU's, the same in every process)."""

    def __init__(self, dtype: str = "float32") -> None:
        self._dtype = getattr(torch, dtype)
        self._seeds = {name: 1234 + i for i, name in enumerate(SHAPES)}
        self._device = torch.device(os.environ.get("LAYOUT_SYNTHETIC_SEED_DEVICE", "cpu"))

    def __getitem__(self, name: str) -> torch.Tensor:
        gen = torch.Generator(self._device).manual_seed(self._seeds[name])
        return torch.randn(SHAPES[name], generator=gen, device=self._device).to(self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(SHAPES)

    def __len__(self) -> int:
        return len(SHAPES)


def checkpoint(dtype: str = "float32") -> Checkpoint:
    """The checkpoint (:class:`Checkpoint`)."""
    return Checkpoint(dtype)


def checkpoint_bytes(dtype: str = "float32") -> int:
    """The checkpoint's size."""
    return sum(math.prod(s) for s in SHAPES.values()) * torch.empty((), dtype=getattr(
        torch, dtype)).element_size()


def _rows(start: int, n: int, width: int) -> tuple[tuple[int, int], ...]:
    return ((start, n), (0, width))


def layout(tp: int, rank: int, dtype: str = "float32") -> Layout:
    """Rank ``rank`` of ``tp``'s layout, without block digests (:func:`with_blocks`)."""
    q = H // tp
    per_vocab = -(-VOCAB // 64) * 64 // tp  # padded to 64, then split
    v0 = rank * per_vocab
    v_held = max(min(per_vocab, VOCAB - v0), 0)
    pieces: list[Piece] = []
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for layer in range(LAYERS):
        at = _prefix(layer)
        pieces += [
            Piece(at + "qkv", _rows(0, q, H), at + "q", _rows(rank * q, q, H)),
            Piece(at + "qkv", _rows(q, KV, H), at + "k", _rows(0, KV, H)),
            Piece(at + "qkv", _rows(q + KV, KV, H), at + "v", _rows(0, KV, H)),
            Piece(at + "o", ((0, H), (0, H // tp)), at + "o",
                  ((0, H), (rank * H // tp, H // tp))),
            Piece(at + "down", ((0, H), (0, INTER // tp)), at + "down",
                  ((0, H), (rank * INTER // tp, INTER // tp))),
        ]
        tensors.update({at + "qkv": ((q + 2 * KV, H), dtype), at + "o": ((H, H // tp), dtype),
                        at + "down": ((H, INTER // tp), dtype)})
        if layer == 0:
            pieces.append(Piece("embed", _rows(0, v_held, H), "embed", _rows(v0, v_held, H)))
            tensors["embed"] = ((per_vocab, H), dtype)
        pieces.append(Piece(at + "norm", ((0, H),), at + "norm", ((0, H),)))
        tensors[at + "norm"] = ((H,), dtype)
    fills = ((Fill("embed", _rows(v_held, per_vocab - v_held, H), 0.0),)
             if v_held < per_vocab else ())
    ckpt = tuple(CheckpointTensor(name, shape, dtype) for name, shape in SHAPES.items())
    return Layout(checkpoint=ckpt, tensors=tensors, pieces=tuple(pieces), fills=fills,
                  tp_size=tp, rank=rank)


def with_blocks(lay: Layout, ckpt: Mapping[str, torch.Tensor], device: str) -> Layout:
    """``lay`` with the digests of the checkpoint blocks it touches, hashed on ``device``
    as a source hashes them (``wsum-i32-v1`` on a GPU, ``xxh3-128-b1m`` on the CPU)."""
    algorithm = _digest.WSUM if device.startswith("cuda") else _digest.XXH3_BLOCKS_1M
    units = {name: grid_units(shape, SLICED.get(name, ())) for name, shape in SHAPES.items()}
    digests: dict[str, dict[int, str]] = {}
    for p in lay.pieces:
        data = ckpt[p.ckpt].to(device)
        wanted = sorted(blocks_in(p.src, SHAPES[p.ckpt], units[p.ckpt]))
        views = [data[tuple(slice(s, s + n) for s, n in block_box(i, SHAPES[p.ckpt],
                                                                   units[p.ckpt]))]
                 for i in wanted]
        digests.setdefault(p.ckpt, {}).update(zip(wanted, _digest.digest_many(views, algorithm)))
    dtypes = {c.name: c.dtype for c in lay.checkpoint}
    return lay.with_blocks(BlockTable(algorithm, units, dtypes, digests))


def assemble(lay: Layout, ckpt: Mapping[str, torch.Tensor], out: dict[str, torch.Tensor]
             ) -> None:
    """Write ``lay``'s pieces and fills of ``ckpt`` into ``out`` (its tensors, any device):
    the rank's loaded form."""
    for p in lay.pieces:
        dst = out[p.tensor][tuple(slice(s, s + n) for s, n in p.dst)]
        dst.copy_(ckpt[p.ckpt][tuple(slice(s, s + n) for s, n in p.src)].reshape(dst.shape))
    for f in lay.fills:
        out[f.tensor][tuple(slice(s, s + n) for s, n in f.dst)].fill_(f.value)


def specs(lay: Layout) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of ``lay``'s tensors (for ``allocate_slab``)."""
    return [(name, tuple(shape), getattr(torch, dtype))
            for name, (shape, dtype) in lay.tensors.items()]
