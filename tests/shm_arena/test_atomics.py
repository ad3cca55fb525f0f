"""Atomics: the C extension and the fallback agree; bounds and alignment are checked."""

from __future__ import annotations

import json
import mmap
import pathlib
import random
import subprocess
import sys

import pytest

from modelexpress.shm_arena import atomics


def test_native_extension_is_built() -> None:
    # CI builds the package with a compiler; a silent fallback would weaken ordering.
    assert atomics.NATIVE, "modelexpress.shm_arena._atomics did not build"


@pytest.mark.parametrize("load,store", [
    (atomics.load_acquire, atomics.store_release),
    (atomics.py_load_acquire, atomics.py_store_release),
])
def test_round_trip_and_checks(load, store) -> None:
    mm = mmap.mmap(-1, 4096)
    try:
        store(mm, 8, (1 << 64) - 1)
        store(mm, 16, 12345)
        assert load(mm, 8) == (1 << 64) - 1
        assert load(mm, 16) == 12345
        assert atomics.py_load_acquire(mm, 16) == atomics.load_acquire(mm, 16)
        assert mm[16:24] == (12345).to_bytes(8, "little")
        with pytest.raises(ValueError):
            load(mm, 4)  # unaligned
        with pytest.raises(ValueError):
            store(mm, 4096, 1)  # out of range
    finally:
        mm.close()


def test_populate_keeps_bytes() -> None:
    mm = mmap.mmap(-1, 1 << 20)
    try:
        mm[4096:4100] = b"keep"
        assert atomics.populate(mm, 0, 1 << 20) in ("madvise", "touch", "python")
        assert mm[4096:4100] == b"keep"
        with pytest.raises(ValueError):
            atomics.populate(mm, 1, 4096)  # not page aligned
    finally:
        mm.close()


@pytest.mark.parametrize("nbytes,offset,src_skew", [
    (0, 0, 0), (1, 3, 0), (63, 8, 1), (64, 16, 0), (65, 1, 7), (4096 + 17, 5, 3),
    ((33 << 20) + 17, 11, 5),  # >= 32 MiB: split across threads
])
def test_copy_in_is_byte_exact_at_any_alignment(nbytes: int, offset: int, src_skew: int) -> None:
    """The streaming copy (non-temporal stores, GIL released, one thread or split
    across threads) lands every byte, leaves the bytes around it alone, and checks
    its bounds."""
    import torch
    gen = torch.Generator().manual_seed(nbytes)
    backing = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, generator=gen)
    src = backing[src_skew:src_skew + nbytes]  # unaligned source starts too
    size = offset + nbytes + 4096
    mm = mmap.mmap(-1, size)
    try:
        mm[:] = b"\xab" * size
        threads = 1 if nbytes < (32 << 20) else 3  # one thread, or split (uneven parts)
        assert atomics.copy_in(mm, offset, src, threads=threads) is True
        assert mm[offset:offset + nbytes] == bytes(src.numpy())
        assert mm[:offset] == b"\xab" * offset
        assert mm[offset + nbytes:] == b"\xab" * (size - offset - nbytes)
        if nbytes:
            with pytest.raises(ValueError):
                atomics.copy_in(mm, size - nbytes + 1, src, threads=1)  # runs past the end
        # Unforced: small copies (and one-CPU machines) are left to torch.
        assert atomics.copy_in(mm, offset, src) is (nbytes >= (32 << 20)
                                                    and atomics._copy_threads(nbytes) >= 2)
    finally:
        mm.close()


@pytest.mark.skipif(not atomics.NATIVE, reason="the C extension is not built")
@pytest.mark.parametrize("nbytes,threads,chunk", [
    (0, 4, 64), (1000, 4, 64), (64 * 7, 8, 64), (1 << 20, 3, 4096 + 64), ((1 << 20) + 5, 2, 1 << 20),
])
def test_parallel_copy_claims_every_chunk_once(nbytes: int, threads: int, chunk: int) -> None:
    """Threads claiming chunks from a shared counter: more threads than chunks, a
    partial last chunk and a chunk larger than the copy all land every byte once."""
    import torch

    from modelexpress.shm_arena import _atomics
    gen = torch.Generator().manual_seed(nbytes + threads)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    size = nbytes + 256
    mm = mmap.mmap(-1, size)
    try:
        mm[:] = b"\xcd" * size
        _atomics.stream_copy(mm, 100, src.data_ptr() if nbytes else 0, nbytes,
                                      threads, chunk)
        assert mm[100:100 + nbytes] == bytes(src.numpy())
        assert mm[:100] == b"\xcd" * 100 and mm[100 + nbytes:] == b"\xcd" * (size - 100 - nbytes)
        for bad in ((0, 64), (65, 64), (2, 0), (2, 100)):  # threads 1..64, chunk k*64
            with pytest.raises(ValueError):
                _atomics.stream_copy(mm, 0, src.data_ptr() or 1, 0, *bad)
    finally:
        mm.close()


ROOT = pathlib.Path(__file__).resolve().parents[2]
WITHOUT = ROOT / "tests" / "without.py"
HIDDEN = "modelexpress.shm_arena._atomics"

# A fresh process without the extension: tensors through the arena (one of them large
# enough for the streaming copy, which falls back to torch), read back and released.
ROUND_TRIPS = r"""
import io, json, logging, pickle, sys
import torch

class Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

keep = Keep()
logging.getLogger("modelexpress").addHandler(keep)
from modelexpress.shm_arena import ArenaPickler, ArenaReader, ArenaWriter, atomics

seed = int(sys.argv[1])
equal, reclaimed = [], 0
with ArenaWriter(1, 64 << 20, n_descriptors=8, prefault=True) as writer:
    with ArenaReader(writer.handle, 0) as reader:
        for i, n in enumerate((4096, 1 << 20, 40 << 20, 77, 3 << 20)):
            src = torch.randint(0, 256, (n,), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(seed + i))
            bio = io.BytesIO()
            ArenaPickler(bio, writer, min_tensor_bytes=1).dump(src)
            out = pickle.loads(bio.getvalue())
            equal.append(bool(torch.equal(out, src)))
            del out
            reader.flush_releases()
            reclaimed += writer.reclaim()
print(json.dumps({"native": atomics.NATIVE, "loaded": "%s" in sys.modules,
                  "equal": equal, "reclaimed": reclaimed, "warnings": keep.messages}))
""" % HIDDEN


def test_without_the_extension_the_arena_falls_back_and_warns_once() -> None:
    seed = random.randrange(1 << 20)
    proc = subprocess.run([sys.executable, str(WITHOUT), HIDDEN, "-c", ROUND_TRIPS, str(seed)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, f"seed={seed}\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["native"] is False and out["loaded"] is False  # really without it
    assert out["equal"] == [True] * 5 and out["reclaimed"] == 5, (seed, out)
    assert len(out["warnings"]) == 1, out["warnings"]
    assert HIDDEN in out["warnings"][0] and "C compiler" in out["warnings"][0]


def test_without_the_extension_forked_readers_still_get_every_tensor() -> None:
    # The arena's multi-process scenario (3 forked readers, 120 messages, one reader
    # holding tensors to the end) on the fallback atomics. A process that forked after
    # its parent warned inherits that; one that uses the fallback first warns once.
    seed = random.randrange(1 << 30)
    proc = subprocess.run([sys.executable, str(WITHOUT), HIDDEN,
                           str(ROOT / "tests" / "shm_arena" / "scenarios.py"), "lifecycle",
                           str(seed)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, f"seed={seed}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    said = [line for line in proc.stderr.splitlines() if HIDDEN in line]
    assert 1 <= len(said) <= 4, proc.stderr[-3000:]  # the writer and 3 readers at most
