"""Per-tensor digests, computed where the tensor lives.

Three algorithms, named in the manifest so that source and target agree:

``xxh3-128``
    xxHash's XXH3 128-bit over the tensor's bytes (a zero-copy numpy view), from the
    ``xxhash`` package. 22.6 GB/s here against 0.92 GB/s for blake2b (bench/digest.py): on a
    CPU target the digest check, not the transfer, bounded the pull with blake2b.
    CPU tensors only. A non-cryptographic hash: it guards against transfer faults.

``blake2b-128``
    :func:`hashlib.blake2b` over the tensor's bytes (a zero-copy numpy view; hashlib
    releases the GIL). 0.92 GB/s here (bench/digest.py). CPU tensors only.

``wsum-i32-v1``
    A position-weighted sum over the bytes viewed as int32 words ``w[j]``:
    ``a = sum(w[j])`` and ``b = sum((j + 1) * w[j])``, both modulo 2**64, plus the
    byte count. Integer addition is associative modulo 2**64, so the result is exact
    and identical on any device and in any reduction order: a GPU source and a CPU
    target agree bit for bit. It is computed with torch on the tensor's own device
    (no device-to-host copy of the data: only two int64 scalars come back), in
    bounded chunks so the int64 temporaries stay small. Any single changed word
    changes ``a`` (|delta| < 2**32 is never 0 mod 2**64); swapped words change ``b``.
    It is an integrity check against transfer faults, not a cryptographic hash.

The default is ``wsum-i32-v1`` whenever any tensor is on a GPU, else ``xxh3-128``
(``blake2b-128`` where ``xxhash`` is not installed).
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Iterable
from typing import TYPE_CHECKING

from modelexpress.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["ALGORITHMS", "BLAKE2B", "WSUM", "XXH3", "default_algorithm", "digest",
           "can_compute"]

BLAKE2B = "blake2b-128"
WSUM = "wsum-i32-v1"
XXH3 = "xxh3-128"
ALGORITHMS = (BLAKE2B, WSUM, XXH3)

# Words per reduction step: 2**24 int32 words = 64 MiB of input, 128 MiB of int64
# temporaries. Bounded so a 4 GiB tensor does not need 8 GiB of scratch.
_CHUNK_WORDS = 1 << 24
_BLOCK = 4096  # words per row of the two-reduction form; divides _CHUNK_WORDS
_MASK = (1 << 64) - 1


def _xxhash_available() -> bool:
    return importlib.util.find_spec("xxhash") is not None


def default_algorithm(tensors: Iterable[torch.Tensor]) -> str:
    """``wsum-i32-v1`` if any tensor is on a GPU (it must be hashed there), else
    ``xxh3-128`` (``blake2b-128`` without the xxhash package)."""
    if any(t.device.type != "cpu" for t in tensors):
        return WSUM
    return XXH3 if _xxhash_available() else BLAKE2B


def can_compute(algorithm: str, tensor: torch.Tensor) -> bool:
    """Whether ``algorithm`` can be computed where ``tensor`` lives without copying it."""
    if algorithm == WSUM:
        return True
    if tensor.device.type != "cpu":
        return False
    return algorithm == BLAKE2B or (algorithm == XXH3 and _xxhash_available())


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    import torch
    t = tensor if tensor.is_contiguous() else tensor.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


def _blake2b(tensor: torch.Tensor) -> str:
    raw = _flat_bytes(tensor)
    h = hashlib.blake2b(digest_size=16)
    if raw.numel():
        h.update(memoryview(raw.numpy()))
    return f"{h.hexdigest()}:{raw.numel()}"


def _xxh3(tensor: torch.Tensor) -> str:
    import xxhash

    raw = _flat_bytes(tensor)
    h = xxhash.xxh3_128()
    if raw.numel():
        h.update(memoryview(raw.numpy()))
    return f"{h.hexdigest()}:{raw.numel()}"


def _wsum_words(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a = sum(w)`` and ``b = sum((i + 1) * w)`` (int64 tensors, wrapping mod 2**64).

    Each chunk is viewed as rows of :data:`_BLOCK` words and copied to int64 once;
    then ``b = BLOCK * sum_j(j * rowsum_j) + sum_k((k + 1) * colsum_k)``, two plain
    reductions. The first version multiplied every word by its weight, which read
    and wrote ~68 bytes per 4-byte word and bounded a verified GPU pull at ~150 GB/s;
    this reads and writes ~28 (bench/digest.py measures it). Integer arithmetic mod
    2**64 makes the two forms equal bit for bit (a test checks it against numpy).
    """
    import torch
    dev = words.device
    a = torch.zeros((), dtype=torch.int64, device=dev)
    b = torch.zeros((), dtype=torch.int64, device=dev)
    cols_weight = torch.arange(1, _BLOCK + 1, dtype=torch.int64, device=dev)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start:start + _CHUNK_WORDS]
        full = chunk.numel() // _BLOCK * _BLOCK
        s = torch.zeros((), dtype=torch.int64, device=dev)
        local = torch.zeros((), dtype=torch.int64, device=dev)
        if full:
            w = chunk[:full].view(-1, _BLOCK).to(torch.int64)
            rows = w.sum(dim=1)
            cols = w.sum(dim=0)
            row_index = torch.arange(rows.numel(), dtype=torch.int64, device=dev)
            s = rows.sum()
            local = (row_index * rows).sum() * _BLOCK + (cols_weight * cols).sum()
        if full < chunk.numel():  # fewer than _BLOCK words left
            rest = chunk[full:].to(torch.int64)
            s = s + rest.sum()
            weights = torch.arange(full + 1, chunk.numel() + 1, dtype=torch.int64, device=dev)
            local = local + (weights * rest).sum()
        # sum((start + i + 1) * w) = sum((i + 1) * w) + start * sum(w), all mod 2**64
        b += local + s * start
        a += s
    return a, b


def _wsum(tensor: torch.Tensor) -> str:
    import torch
    raw = _flat_bytes(tensor)
    nbytes = raw.numel()
    whole = nbytes - nbytes % 4
    if raw.storage_offset() % 4:
        raw = raw.clone()  # int32 view needs 4-byte alignment; rare (views at odd offsets)
    words = raw[:whole].view(torch.int32)
    a, b = _wsum_words(words)
    av, bv = int(a.item()) & _MASK, int(b.item()) & _MASK
    if whole != nbytes:  # the 1-3 tail bytes, read on the device then moved (<= 3 bytes)
        tail = int.from_bytes(bytes(raw[whole:].cpu().tolist()), "little")
        av = (av + tail) & _MASK
        bv = (bv + tail * (words.numel() + 1)) & _MASK
    return f"{av:016x}{bv:016x}:{nbytes}"


def digest(tensor: torch.Tensor, algorithm: str) -> str:
    """Digest of ``tensor``'s bytes, computed on its device.

    Args:
        tensor: any tensor (non-contiguous tensors are hashed in logical order).
        algorithm: one of :data:`ALGORITHMS`.

    Returns:
        A hex string with the byte count appended (``"<hex>:<nbytes>"``).

    Raises:
        ConfigError: unknown algorithm, or blake2b asked of a GPU tensor.
    """
    if algorithm == WSUM:
        return _wsum(tensor)
    if algorithm == XXH3:
        if tensor.device.type != "cpu":
            raise ConfigError(f"{XXH3} is CPU-only and the tensor is on {tensor.device}; use "
                              f"{WSUM} (computed on the GPU) for GPU tensors")
        if not _xxhash_available():
            raise ConfigError(f"the source's digests are {XXH3} and the xxhash package is not "
                              "installed here: pip install xxhash, or pull with verify=False")
        return _xxh3(tensor)
    if algorithm == BLAKE2B:
        if tensor.device.type != "cpu":
            raise ConfigError(
                f"{BLAKE2B} is CPU-only and the tensor is on {tensor.device}; use {WSUM} "
                "(computed on the GPU) for GPU tensors")
        return _blake2b(tensor)
    raise ConfigError(f"unknown digest algorithm {algorithm!r}; allowed: {', '.join(ALGORITHMS)}")
