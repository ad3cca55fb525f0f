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


def test_digest_many_equals_one_by_one_and_checks_its_arguments() -> None:
    rng = np.random.default_rng(7)
    tensors = [torch.frombuffer(bytearray(rng.bytes(n)), dtype=torch.uint8) if n else
               torch.empty(0, dtype=torch.uint8) for n in (0, 1, 4, 4099, 70_001)]
    tensors.append(torch.arange(12, dtype=torch.float32).view(3, 4).t())  # non-contiguous
    for algo in digest.ALGORITHMS:
        assert digest.digest_many(tensors, algo) == [digest.digest(t, algo) for t in tensors]
    assert digest.digest_many(tensors[:5], digest.WSUM) == [
        _oracle(bytes(t.numpy())) for t in tensors[:5]]
    assert digest.digest_many([], digest.WSUM) == []
    with pytest.raises(Exception, match="unknown digest impl"):
        digest.digest_many(tensors, digest.WSUM, impl="opencl")
    with pytest.raises(Exception, match="for CUDA tensors"):  # the shipped kernel
        digest.digest_many(tensors[1:2], digest.WSUM, impl="cuda")
    with pytest.raises(Exception, match="Triton"):  # the kernel is for CUDA tensors only
        digest.digest_many(tensors[1:2], digest.WSUM, impl="triton")
    with pytest.raises(Exception, match="unknown digest algorithm"):
        digest.digest_many(tensors, "md5")


_INTERPRETED = r"""
import json, sys
import numpy as np, torch
from modelexpress.transfer import _wsum_triton
tensors = []
for n, offset, fill in json.loads(sys.argv[1]):
    rng = np.random.default_rng(n)
    raw = (np.resize(np.array(fill, dtype=np.uint8), n + offset) if fill is not None else
           np.frombuffer(rng.bytes(n + offset), dtype=np.uint8).copy())
    tensors.append(torch.from_numpy(raw)[offset:])  # offset 4: not 16-byte aligned
out = [[[a, b], bytes(t.numpy()).hex()] for t, (a, b) in
       zip(tensors, _wsum_triton.wsum_batch(tensors, max_programs=3))]
print(json.dumps(out))
"""


@pytest.mark.triton
def test_triton_kernel_matches_the_definition_under_the_interpreter() -> None:
    """The GPU kernel's logic on CI: Triton's interpreter runs it on CPU tensors.
    One batch whose tensors cross tile (2048 words) and grid-stride (3 programs)
    boundaries, with 0-3 tail bytes, one not 16-byte aligned, and one (100k words of
    2**31 - 1) whose ``b`` wraps past 2**64."""
    import json
    import os
    import subprocess
    import sys

    cases = [[0, 0, None], [1, 0, None], [3, 0, None], [4, 0, None], [4 * 2047 + 2, 0, None],
             [8192, 4, None], [4 * 2048 * 3 + 1, 0, None], [4 * (2048 * 7 + 5) + 3, 4, None],
             [400_000, 0, [0xFF, 0xFF, 0xFF, 0x7F]]]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    for (a, b), raw_hex in results:
        raw = bytes.fromhex(raw_hex)
        assert f"{a:016x}{b:016x}:{len(raw)}" == _oracle(raw)
