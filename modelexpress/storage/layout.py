"""A stored checkpoint's tensors from its safetensors headers alone: :func:`read_layout`.

An origin publishes the manifest of what it is loading before the first tensor's bytes
arrive, so it needs every tensor's name, dtype, shape and place from the files' headers
(8 bytes of header length, then a JSON header: ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}}`` relative to the data that follows). Two small reads
per file, whatever the model's size.

The layout's order (files by name, tensors by offset within a file) is the order of the
origin's manifest, of every follower's destination and of the watermark: byte ``m`` of
the watermark is byte ``m`` of the files' data regions laid end to end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from typing import TYPE_CHECKING, Any

from modelexpress.errors import CheckpointError
from modelexpress.storage.base import Storage, StoredFile

if TYPE_CHECKING:
    import torch

__all__ = ["TensorSpan", "CheckpointLayout", "read_layout", "DTYPES"]

_MAX_HEADER = 100 << 20  # safetensors caps its JSON header at 100 MB

DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
          "BF16": ("bfloat16", 2), "I64": ("int64", 8), "I32": ("int32", 4),
          "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1),
          "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1)}
"""safetensors dtype codes -> (torch dtype name, bytes per element)."""


@dataclasses.dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's bytes are in a stored checkpoint.

    Attributes:
        name, dtype, shape: the tensor (``dtype`` a torch dtype name).
        file: the file's name (:class:`~.base.StoredFile`).
        offset: its first byte in that file (the header included).
        nbytes: its size.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    """Every tensor of a stored checkpoint, in load order.

    Attributes:
        url: the storage's URL (no credentials).
        files: its files, sorted by name.
        tensors: by file, then by offset.
    """

    url: str
    files: tuple[StoredFile, ...]
    tensors: tuple[TensorSpan, ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def specs(self) -> list[tuple[str, tuple[int, ...], "torch.dtype"]]:
        """``(name, shape, torch dtype)`` in order: what
        :func:`~modelexpress.checkpoint.allocate_slab` takes."""
        import torch

        return [(t.name, t.shape, getattr(torch, t.dtype)) for t in self.tensors]


def _header(storage: Storage, f: StoredFile) -> dict[str, Any]:
    where = f"{storage.url}/{f.name}"
    if f.size < 8:
        raise CheckpointError(f"{where} ({f.size} bytes) is too short for a safetensors file "
                              "(an 8-byte header length, then the header)")
    head = bytearray(8)
    storage.read(f.name, 0, memoryview(head))
    (length,) = struct.unpack("<Q", head)
    if length > _MAX_HEADER or 8 + length > f.size:
        raise CheckpointError(f"{where} ({f.size} bytes) says its header is {length} bytes: it "
                              "is truncated or not a safetensors file; upload it again")
    raw = bytearray(length)
    storage.read(f.name, 8, memoryview(raw))
    try:
        header = json.loads(bytes(raw))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{where}: its header is not JSON ({exc}): not a safetensors "
                              "file") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: its header is not a JSON object")
    header["__data_start__"] = 8 + length
    return header


def read_layout(storage: Storage) -> CheckpointLayout:
    """Read every file's header and lay out its tensors.

    Raises:
        CheckpointError: a file is not safetensors, is shorter than its header says
            (truncated), or names a tensor another file also has; a dtype this reader
            does not know.
        StorageReadError: the storage could not be read.
    """
    files = tuple(storage.files())
    tensors: list[TensorSpan] = []
    seen: dict[str, str] = {}
    for f in files:
        header = _header(storage, f)
        start = header.pop("__data_start__")
        header.pop("__metadata__", None)
        spans = []
        for name, spec in header.items():
            where = f"{storage.url}/{f.name}"
            try:
                code, shape = spec["dtype"], tuple(int(d) for d in spec["shape"])
                begin, end = (int(x) for x in spec["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{where}: tensor {name!r} has a malformed header entry "
                                      f"({exc})") from exc
            if code not in DTYPES:
                raise CheckpointError(f"{where}: tensor {name!r} has dtype {code}; allowed: "
                                      f"{', '.join(sorted(DTYPES))}")
            dtype, size = DTYPES[code]
            if end - begin != math.prod(shape) * size or begin < 0:
                raise CheckpointError(f"{where}: tensor {name!r} spans {end - begin} bytes, "
                                      f"not the {math.prod(shape) * size} its shape and dtype "
                                      "need")
            if start + end > f.size:
                raise CheckpointError(
                    f"{where} is truncated: its header puts tensor {name!r} at bytes "
                    f"{start + begin}-{start + end} but the file holds {f.size}; upload it "
                    "again")
            if name in seen:
                raise CheckpointError(f"tensor {name!r} appears in both {seen[name]} and "
                                      f"{f.name}; a checkpoint names each tensor once")
            seen[name] = f.name
            spans.append(TensorSpan(name, dtype, shape, f.name, start + begin, end - begin))
        tensors += sorted(spans, key=lambda t: t.offset)
    return CheckpointLayout(storage.url, files, tuple(tensors))
