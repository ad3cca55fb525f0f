"""The checkpoint a layout is derived from, and the block digests a source publishes.

* :func:`checkpoint_table`: names, shapes and dtypes of a safetensors checkpoint from
  its file headers (no tensor data read), in the order vLLM's iterator yields them.
* :class:`BlockHasher`: a source that loads from disk hashes each checkpoint tensor's
  blocks (:func:`~modelexpress.layout.grid_units`) as vLLM's disk loader streams them,
  before any layout applies them: the digests are of the checkpoint, so a layout that
  disagrees with the bytes it describes is caught by whoever reads through it. It also
  checks what streamed against the headers' table.

This module needs torch; it does not import vLLM.
"""

from __future__ import annotations

import json
import logging
import pathlib
import struct
import time
from collections.abc import Iterable, Iterator, Mapping

import torch

from modelexpress.errors import LayoutUnavailableError
from modelexpress.layout import (BlockTable, CheckpointTensor, Layout, block_box, blocks_in,
                                 grid_units)

__all__ = ["BlockHasher", "block_algorithm", "checkpoint_table"]

logger = logging.getLogger(__name__)

LayoutUnavailable = LayoutUnavailableError

_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16",
                       "BF16": "bfloat16", "I64": "int64", "I32": "int32", "I16": "int16",
                       "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
                       "F8_E5M2": "float8_e5m2"}


def checkpoint_table(model_dir: str | pathlib.Path) -> tuple[CheckpointTensor, ...]:
    """Names, shapes and dtypes of a safetensors checkpoint, from the file headers only.

    The files are those of ``model.safetensors.index.json`` when there is one (as
    vLLM filters duplicates), else every ``*.safetensors``; sorted by name, tensors in
    header order sorted by name (what vLLM's safetensors iterator yields; the
    :class:`BlockHasher` checks it against what was streamed).

    Raises:
        LayoutUnavailable: no safetensors files, or a header that cannot be read.
    """
    folder = pathlib.Path(model_dir)
    if not folder.is_dir():
        folder = _snapshot_dir(str(model_dir))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as exc:
            raise LayoutUnavailable(f"cannot read {index}: {exc}") from exc
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LayoutUnavailable(f"no safetensors files in {folder}")
    out: list[CheckpointTensor] = []
    for path in files:
        for name, (shape, dtype) in sorted(_safetensors_header(path).items()):
            out.append(CheckpointTensor(name, shape, dtype))
    return tuple(out)


def _snapshot_dir(model: str) -> pathlib.Path:
    try:
        from huggingface_hub import snapshot_download

        return pathlib.Path(snapshot_download(model, local_files_only=True,
                                              allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # noqa: BLE001 - any hub failure: no local checkpoint
        raise LayoutUnavailable(f"{model} is not a local directory nor in the local "
                                f"Hugging Face cache ({type(exc).__name__}: {exc})") from exc


def _safetensors_header(path: pathlib.Path) -> dict[str, tuple[tuple[int, ...], str]]:
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise LayoutUnavailable(f"cannot read the safetensors header of {path}: {exc}") from exc
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise LayoutUnavailable(f"{path.name}: tensor {name!r} has dtype "
                                    f"{entry.get('dtype')!r}, which layouts do not cover")
        out[name] = (tuple(int(x) for x in entry["shape"]), dtype)
    return out


def block_algorithm(device: torch.device) -> str:
    """The block digest algorithm of a device kind: ``wsum-i32-v1`` on a GPU (computed
    where the blocks are, bit-identical everywhere), ``xxh3-128-b1m`` on the CPU (its
    1 MiB pieces hashed on several threads: a target checks every block it assembled
    after its copies, unlike a same-layout pull whose copy loop hashes as it lands)."""
    from modelexpress.transfer import digest as _digest

    if device.type != "cpu":
        return _digest.WSUM
    return (_digest.XXH3_BLOCKS_1M if _digest.can_compute(_digest.XXH3_BLOCKS_1M, torch.empty(0))
            else _digest.BLAKE2B)


class BlockHasher:
    """Hashes checkpoint blocks as vLLM's disk loader streams the checkpoint.

    Wrap the loader's weight iterator with :meth:`wrap`; afterwards :meth:`table`
    gives the :class:`~modelexpress.layout.BlockTable` of the blocks ``layout``'s
    pieces touch, hashed in the dtype the loaded tensors hold them in, on ``device``.

    Args:
        layout: this rank's layout (from the checkpoint's headers).
        sliced: the dimensions the loaders slice (:func:`derive_layout`).
        device: where to hash (the load device).
    """

    def __init__(self, layout: Layout, sliced: Mapping[str, set[int]],
                 device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.algorithm = block_algorithm(device)
        ckpt = layout.checkpoint_by_name()
        self.units: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self.wanted: dict[str, set[int]] = {}
        self.problem: str | None = None
        for p in layout.pieces:
            shape = ckpt[p.ckpt].shape
            units = self.units.setdefault(p.ckpt, grid_units(shape, sliced.get(p.ckpt, ())))
            dtype = layout.tensors[p.tensor][1]
            if self.dtypes.setdefault(p.ckpt, dtype) != dtype:
                self.problem = (f"checkpoint tensor {p.ckpt} is loaded in two dtypes "
                                f"({self.dtypes[p.ckpt]} and {dtype})")
            self.wanted.setdefault(p.ckpt, set()).update(blocks_in(p.src, shape, units))
        self.digests: dict[str, dict[int, str]] = {}
        self.streamed: list[CheckpointTensor] = []
        self.seconds = 0.0

    def wrap(self, weights: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``weights`` unchanged, hashing the blocks of each on the way."""
        for name, tensor in weights:
            t0 = time.perf_counter()
            self.streamed.append(CheckpointTensor(name, tuple(tensor.shape),
                                                  str(tensor.dtype).removeprefix("torch.")))
            if name in self.wanted and self.problem is None:
                try:
                    self._hash(name, tensor)
                except Exception as exc:  # noqa: BLE001 - the load goes on without them
                    self.problem = f"hashing {name} failed ({type(exc).__name__}: {exc})"
            self.seconds += time.perf_counter() - t0
            yield name, tensor

    def _hash(self, name: str, tensor: torch.Tensor) -> None:
        from modelexpress.transfer import digest as _digest

        dtype = getattr(torch, self.dtypes[name])
        data = tensor.detach().to(device=self.device, dtype=dtype)
        shape, units = tuple(data.shape), self.units[name]
        indices = sorted(self.wanted[name])
        views = [data[tuple(slice(s, s + n) for s, n in block_box(i, shape, units))]
                 for i in indices]
        self.digests[name] = dict(zip(indices, _digest.digest_many(views, self.algorithm)))

    def table(self) -> BlockTable:
        """The digests of the blocks streamed so far.

        Raises:
            LayoutUnavailable: the stream did not match the layout's checkpoint (other
                tensors, shapes or dtypes), a tensor it needs did not stream, or hashing
                failed.
        """
        if self.problem is not None:
            raise LayoutUnavailable(self.problem)
        expected = {c.name: c for c in self.layout.checkpoint}
        streamed = {c.name: c for c in self.streamed}
        differs = next((n for n in expected if streamed.get(n) != expected[n]), None)
        if differs is not None or set(streamed) != set(expected):
            name = differs or next(iter(set(streamed) ^ set(expected)))
            raise LayoutUnavailable(f"the checkpoint the loader streamed differs from its "
                                    f"headers at {name!r}")
        missing = next((n for n in self.wanted if n not in self.digests), None)
        if missing is not None:
            raise LayoutUnavailable(f"checkpoint tensor {missing!r} was not streamed")
        return BlockTable(algorithm=self.algorithm, units=dict(self.units),
                          dtypes=dict(self.dtypes), digests=self.digests)

    def streamed_order(self) -> tuple[CheckpointTensor, ...]:
        """The checkpoint as the loader streamed it."""
        return tuple(self.streamed)
