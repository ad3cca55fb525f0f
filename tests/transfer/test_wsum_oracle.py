"""``wsum-i32-v1`` equals its definition, computed independently with numpy.

The implementation reduces rows and columns of a reshaped chunk instead of weighting
every word; this pins it to ``a = sum(w)``, ``b = sum((i + 1) * w)`` mod 2**64 across
row, chunk and tail boundaries, so a CPU target and a GPU source keep agreeing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from modelexpress.transfer import digest

MASK = (1 << 64) - 1


def _oracle(raw: bytes) -> str:
    whole = len(raw) - len(raw) % 4
    w = np.frombuffer(raw[:whole], dtype="<i4").astype(np.int64)
    with np.errstate(over="ignore"):  # int64 arithmetic wraps mod 2**64, as defined
        a = int(w.sum(dtype=np.int64)) & MASK
        b = int((np.arange(1, w.size + 1, dtype=np.int64) * w).sum(dtype=np.int64)) & MASK
    if whole != len(raw):
        tail = int.from_bytes(raw[whole:], "little")
        a = (a + tail) & MASK
        b = (b + tail * (w.size + 1)) & MASK
    return f"{a:016x}{b:016x}:{len(raw)}"


@pytest.mark.parametrize("nbytes", [0, 3, 4, 17, 4 * 4095, 4 * 4096, 4 * 4097 + 2,
                                    4 * 100_003, 4 * ((1 << 24) + 4096 * 3 + 5) + 1])
def test_wsum_matches_its_definition(nbytes: int) -> None:
    rng = np.random.default_rng(nbytes)
    raw = rng.bytes(nbytes)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if nbytes else torch.empty(
        0, dtype=torch.uint8)
    assert digest.digest(t, digest.WSUM) == _oracle(raw)
