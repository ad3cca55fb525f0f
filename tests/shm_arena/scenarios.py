"""Multi-process arena scenarios, each run by the tests in a fresh interpreter.

Usage: python scenarios.py NAME SEED. Exit code 0 means every check passed;
anything else (an AssertionError traceback, a reader's non-zero exit) fails the
test that ran it. Readers are forked; messages are pickle streams sent over pipes.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import random
import sys
import zlib

import torch

from modelexpress.shm_arena import ArenaPickler, ArenaReader, ArenaWriter

MIB = 1 << 20


def shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("mx_shm_arena")}


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy())


def _reader(handle, rank: int, conn, keep_every: int) -> None:
    reader = ArenaReader(handle, rank)
    kept: list[tuple[torch.Tensor, int]] = []
    while True:
        stream = conn.recv_bytes()
        if stream == b"stop":
            break
        reader.flush_releases()
        msg_id, expected, tensor = pickle.loads(stream)
        assert crc(tensor) == expected, f"reader {rank} message {msg_id}: bytes differ"
        if keep_every and msg_id % keep_every == 0:
            kept.append((tensor, expected))  # retained across many later messages
        del tensor
        conn.send(("ok", msg_id))
    for tensor, expected in kept:
        assert crc(tensor) == expected, f"reader {rank}: a retained tensor was overwritten"
    conn.send(("done", len(kept)))


def lifecycle(seed: int) -> None:
    """3 forked readers, 120 messages; reader 2 retains every 10th tensor to the end."""
    rng = random.Random(seed)
    before = shm_entries()
    writer = ArenaWriter(3, 48 * MIB, n_descriptors=64, prefault=True)
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for rank in range(3):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_reader, args=(writer.handle, rank, child,
                                                 10 if rank == 2 else 0), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    diverted_before_hold = None
    for msg_id in range(120):
        n = rng.randint(64 * 1024, 2 * MIB)
        tensor = torch.randint(0, 256, (n,), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(seed + msg_id))
        bio = io.BytesIO()
        ArenaPickler(bio, writer, min_tensor_bytes=1).dump((msg_id, crc(tensor), tensor))
        tensor.fill_(0)  # the sender reuses its buffer at once: readers must not notice
        for conn in pipes:
            conn.send_bytes(bio.getvalue())
        for conn in pipes:
            assert conn.poll(60), "reader did not answer within 60 s"
            assert conn.recv() == ("ok", msg_id)
        if msg_id == 0:
            # all three readers answered, but reader 2 still holds message 0's tensor
            assert writer.reclaim() == 0, "space reused before every reader released it"
            diverted_before_hold = writer.counters.diverted
    assert diverted_before_hold == 1
    for conn in pipes:
        conn.send_bytes(b"stop")
    for conn in pipes:
        assert conn.poll(60)
        status = conn.recv()
        assert status[0] == "done"
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0, f"reader exit code {proc.exitcode}"
    snap = writer.counters.snapshot()
    assert snap.diverted + snap.declined["full"] == 120, snap
    writer.reclaim()
    assert writer.stats()["live_tensors"] == 0, writer.stats()
    writer.close()
    assert shm_entries() == before, "segment leaked"


def _drop_copy(writer: ArenaWriter) -> None:
    del writer  # a forked child's copy must not unlink the parent's segment
    import gc
    gc.collect()
    os._exit(0)


def leaks(seed: int) -> None:
    """Segments vanish on close, on garbage collection, and never in forked children."""
    before = shm_entries()
    ctx = mp.get_context("fork")
    writer = ArenaWriter(2, 4 * MIB, prefault=True)
    path = os.path.join("/dev/shm", writer.name)
    child = ctx.Process(target=_drop_copy, args=(writer,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert os.path.exists(path), "a forked child unlinked the parent's segment"
    # closing while a reader still views a tensor: unlinked now, unmapped later
    reader = ArenaReader(writer.handle, 0)
    bio = io.BytesIO()
    ArenaPickler(bio, writer, min_tensor_bytes=1).dump(torch.ones(1000))
    view = pickle.loads(bio.getvalue())
    writer.close()
    assert not os.path.exists(path)
    assert view.sum() == 1000
    del view
    reader.close()
    # dropped without close(): the finalizer unlinks
    dropped = ArenaWriter(1, MIB, prefault=True)
    name = dropped.name
    del dropped
    import gc
    gc.collect()
    assert not os.path.exists(os.path.join("/dev/shm", name))
    # never closed at all: unlinked at interpreter exit (checked by the caller)
    global _leftover
    _leftover = ArenaWriter(1, MIB, prefault=False)
    print(_leftover.name)
    assert shm_entries() - before == {_leftover.name}


if __name__ == "__main__":
    name, seed = sys.argv[1], int(sys.argv[2])
    print(f"scenario={name} seed={seed}", flush=True)
    {"lifecycle": lifecycle, "leaks": leaks}[name](seed)
