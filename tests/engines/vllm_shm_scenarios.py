"""Scenarios of the modelexpress arena inside vLLM's real MessageQueue (CPU).

Usage: python vllm_shm_scenarios.py NAME SEED. Each runs in a fresh interpreter;
readers are forked and attach through ``MessageQueue.create_from_handle`` (the
way vLLM's workers do); exit code 0 means every check passed. The vLLM imported
is whichever ``PYTHONPATH`` selects; ``MX_TEST_EXPECT_VLLM`` (a version prefix)
makes the scenario fail if it is not the release the caller meant to test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import sys
import time
import zlib

import torch

MIB = 1 << 20


def shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("mx_shm_arena")}


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def arena_range(mq) -> tuple[int, int]:
    import numpy as np
    base = np.frombuffer(mq.tensor_arena._segment.mm, dtype=np.uint8)
    return base.ctypes.data, base.nbytes


def in_arena(t: torch.Tensor, rng: tuple[int, int]) -> bool:
    return rng[0] <= t.data_ptr() < rng[0] + rng[1]


class Tagged(torch.Tensor):
    pass


# ----------------------------------------------------------------------------- api
def api(seed: int) -> None:
    """Install/uninstall, idempotence, which queues get an arena, the plugin, the version gate."""
    import vllm
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from modelexpress.engines.vllm import shm
    from modelexpress.engines.vllm.plugin import register
    from modelexpress.errors import ShmArenaError
    from modelexpress.shm_arena import ArenaWriter

    assert shm.installed_config() is None
    os.environ["MX_SHM_TENSOR_ARENA"] = "1"
    os.environ["MX_SHM_ARENA_BYTES"] = str(8 * MIB)
    register()
    register()  # idempotent
    assert shm.installed_config() is not None
    assert shm.installed_config().arena_bytes == 8 * MIB
    assert shm.install_shm_tensor_arena(arena_bytes=16 * MIB) is False  # already installed
    init_before = MessageQueue.__init__

    q2 = MessageQueue(2, 2)
    assert isinstance(q2.tensor_arena, ArenaWriter)
    assert q2.handle.mx_shm_arena.name == q2.tensor_arena.name
    assert q2.handle.tensor_arena_handle is None  # vLLM's own arena is not created too
    # Default threshold 1 MiB (vLLM inlines smaller buffers into the pickle): a 2 MiB
    # tensor, which vLLM's own 8 MiB threshold would send once per reader, is diverted.
    import io

    from modelexpress.shm_arena import ArenaPickler
    ArenaPickler(io.BytesIO(), q2.tensor_arena).dump(
        [torch.ones(MIB // 2), torch.ones(MIB // 8)])  # 2 MiB and 512 KiB of float32
    stats = q2.tensor_arena.stats()
    assert stats["diverted"] == 1 and stats["declined"]["small"] == 1, stats
    q_vllm = MessageQueue(2, 2, enable_shm_tensor_arena=True)
    assert isinstance(q_vllm.tensor_arena, ArenaWriter), "ours replaces vLLM's arena"
    q1 = MessageQueue(1, 1)
    assert q1.tensor_arena is None, "one-reader queues keep vLLM's path (min_readers=2)"
    remote = MessageQueue(3, 2, connect_ip="127.0.0.1")
    assert remote.tensor_arena is None, "queues with remote readers get no arena"
    assert len(shm_entries()) >= 2
    for q in (q2, q_vllm, q1, remote):
        q.shutdown()
    del q2, q_vllm, q1, remote

    assert shm.uninstall_shm_tensor_arena() is True
    assert shm.uninstall_shm_tensor_arena() is False
    assert MessageQueue.__init__ is not init_before
    plain = MessageQueue(2, 2)
    assert plain.tensor_arena is None
    del plain
    assert shm.install_shm_tensor_arena(arena_bytes=4 * MIB) is True
    assert isinstance(MessageQueue(2, 2).tensor_arena, ArenaWriter)
    shm.uninstall_shm_tensor_arena()

    real = vllm.__version__
    vllm.__version__ = "0.34.0"  # an unsupported release must be refused, clearly
    try:
        shm.install_shm_tensor_arena()
    except ShmArenaError as exc:
        assert "0.33" in str(exc) and "0.34.0" in str(exc), exc
    else:
        raise AssertionError("vLLM 0.34.0 was accepted")
    finally:
        vllm.__version__ = real
    assert shm.installed_config() is None


# ----------------------------------------------------------------------------- round trip
def _cases() -> list[tuple[str, torch.Tensor, bool]]:
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (4 * MIB,), dtype=torch.uint8, generator=g)
    return [  # name, tensor, expected on the arena
        ("fp32", raw.view(torch.float32).clone(), True),
        ("bf16", raw.view(torch.bfloat16).clone(), True),
        ("fp8", raw.view(torch.float8_e4m3fn).clone(), True),
        ("int8", raw.view(torch.int8).clone().view(1024, -1), True),
        ("zero_dim", torch.tensor(2.5), False),  # below the divert threshold
        ("large", torch.randint(0, 256, (300 * 1000 * 1000,), dtype=torch.uint8,
                                generator=g), True),  # above vLLM's 256 MB slot
        ("param", torch.nn.Parameter(raw.view(torch.float32).clone()), True),
        ("non_contiguous", raw.view(torch.float32).view(1024, -1).t(), False),
        ("subclass", raw.view(torch.float32).clone().as_subclass(Tagged), False),
    ]


def _rt_reader(handle, rank: int, results) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    rng = arena_range(mq)
    while True:
        msg = mq.dequeue(timeout=120)
        if msg is None:
            break
        name, tensor, expected_crc, expect_arena = msg
        got = (crc(tensor) == expected_crc, type(tensor).__name__, in_arena(tensor, rng))
        if got != (True, msg[1].__class__.__name__, expect_arena):
            results.put((rank, name, "FAIL", got))
        else:
            results.put((rank, name, "ok", got))
        del msg, tensor


def roundtrip(seed: int) -> None:
    """Every case byte-exact through 3 forked readers, with the sender overwriting at once."""
    before = shm_entries()
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from modelexpress.engines.vllm import install_shm_tensor_arena
    install_shm_tensor_arena(arena_bytes=640 * MIB, min_tensor_bytes=64 * 1024)
    mq = MessageQueue(3, 3)
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rt_reader, args=(mq.export_handle(), r, results))
             for r in range(3)]
    for p in procs:
        p.daemon = True  # a failing writer must not leave readers waiting
    for p in procs:
        p.start()
    mq.wait_until_ready()
    for name, tensor, on_arena in _cases():
        expected = crc(tensor)
        mq.enqueue((name, tensor, expected, on_arena))
        # The sender overwrites (and then frees) its tensor right after enqueue.
        if tensor.is_contiguous() and type(tensor) is torch.Tensor:
            tensor.reshape(-1).view(torch.uint8).fill_(0xA5)
        del tensor
        for _ in range(3):
            rank, case, status, got = results.get(timeout=120)
            assert status == "ok", (rank, case, got)
    mq.enqueue(None)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"reader exit code {p.exitcode}"
    stats = mq.tensor_arena.stats()
    assert stats["diverted"] == 6, stats
    assert stats["declined"]["non_contiguous"] == 1 and stats["declined"]["subclass"] >= 1
    del mq
    import gc
    gc.collect()
    assert shm_entries() == before, "segment leaked"


# ----------------------------------------------------------------------------- stress
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2, torch.int8,
          torch.int32, torch.uint8]


def _message(rng: random.Random, msg_id: int) -> list[torch.Tensor]:
    out = []
    for k in range(rng.choice((1, 1, 2, 3))):
        dtype = rng.choice(DTYPES)
        nbytes = int(2 ** rng.uniform(10, 22))  # 1 KiB .. 4 MiB
        n = max(1, nbytes // dtype.itemsize)
        g = torch.Generator().manual_seed(msg_id * 7 + k)
        out.append(torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8,
                                 generator=g).view(dtype))
    return out


def _stress_reader(handle, rank: int, seed: int, n_msgs: int, done) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    rng = random.Random(seed * 31 + rank)
    held: list[tuple[int, torch.Tensor, int]] = []
    verified = 0
    for expect_id in range(n_msgs):
        msg_id, tensors, crcs = mq.dequeue(timeout=120)
        assert msg_id == expect_id
        for t, c in zip(tensors, crcs):
            assert crc(t) == c, f"reader {rank} message {msg_id}: checksum mismatch"
            verified += 1
            if rng.random() < 0.1:
                held.append((msg_id + rng.randint(1, 40), t, c))  # keep it a while
        del tensors
        keep = []
        for until, t, c in held:
            if until <= msg_id:
                assert crc(t) == c, f"reader {rank}: a held tensor changed before release"
            else:
                keep.append((until, t, c))
        held = keep
    for _, t, c in held:
        assert crc(t) == c
    done.put((rank, verified))


def stress(seed: int) -> None:
    """4 forked readers, 2,000 messages of random sizes and dtypes, every tensor checksummed."""
    before = shm_entries()
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from modelexpress.engines.vllm import install_shm_tensor_arena
    n_msgs = int(os.environ.get("MX_TEST_STRESS_MESSAGES", "2000"))
    # Small arena and threshold: diversion, fallback to the normal path (full)
    # and reuse of released space all happen many times.
    install_shm_tensor_arena(arena_bytes=8 * MIB, min_tensor_bytes=32 * 1024, n_descriptors=64)
    mq = MessageQueue(4, 4)
    ctx = mp.get_context("fork")
    done = ctx.Queue()
    procs = [ctx.Process(target=_stress_reader,
                         args=(mq.export_handle(), r, seed, n_msgs, done), daemon=True)
             for r in range(4)]
    for p in procs:
        p.start()
    mq.wait_until_ready()
    rng = random.Random(seed)
    began = time.monotonic()
    total = 0
    for msg_id in range(n_msgs):
        tensors = _message(rng, msg_id)
        crcs = [crc(t) for t in tensors]
        mq.enqueue((msg_id, tensors, crcs), timeout=120)
        for t in tensors:  # the sender reuses its memory immediately
            t.view(torch.uint8).fill_(0)
        total += len(tensors)
    results = sorted(done.get(timeout=180) for _ in range(4))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"reader exit code {p.exitcode}"
    assert [v for _, v in results] == [total] * 4, results
    stats = mq.tensor_arena.stats()
    print(f"stress: {n_msgs} messages, {total} tensors, {time.monotonic() - began:.1f} s, "
          f"stats={stats}", flush=True)
    assert stats["diverted"] > 0 and stats["declined"]["small"] > 0
    del mq
    import gc
    gc.collect()
    assert shm_entries() == before, "segment leaked"


if __name__ == "__main__":
    name, seed = sys.argv[1], int(sys.argv[2])
    import vllm
    print(f"scenario={name} seed={seed} vllm={vllm.__version__} ({vllm.__file__})", flush=True)
    expect = os.environ.get("MX_TEST_EXPECT_VLLM")
    assert expect is None or vllm.__version__.startswith(expect), (vllm.__version__, expect)
    {"api": api, "roundtrip": roundtrip, "stress": stress}[name](seed)
    print("ok", flush=True)
