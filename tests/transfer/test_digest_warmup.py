"""The GPU digest kernel is ready before a pull's first verification: the
shipped kernel loads as the pull starts; where the driver refuses it, the Triton build
runs on a background thread and, until it is ready, digests use the torch form.

No GPU on CI: the Triton build's state machine runs in a fresh process under Triton's
interpreter (the kernel on CPU tensors, as test_wsum_oracle does), the driver's refusal
where no GPU is (test_wsum_cuda.py); the CPU paths run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from modelexpress.transfer import digest

_BUILD = r"""
import json, threading
import torch
from modelexpress.transfer import digest
dev = torch.device("cpu")  # the interpreter runs the kernel on CPU tensors
raws = [torch.arange(n, dtype=torch.int64).to(torch.uint8) for n in (8192, 4099)]
raws.append(torch.arange(8200, dtype=torch.int64).to(torch.uint8)[4:])  # not 16-aligned
want = digest._torch_pairs(raws)
out = {}
# While a pull runs (paused), the build starts no step.
digest.pause_builds()
build = digest._KernelBuild(dev)
build.lock.acquire()  # later: held at its lock, as while it compiles
digest._builds[str(dev)] = build
build.thread.start()
out["paused_state"] = [digest.kernel_state(dev), build.in_step, build.done.is_set()]
digest.resume_builds()
# A pull that must not run beside a step (a NIXL agent's creation) waits for it, bounded.
digest.pause_builds(wait_running_s=0.05)
digest.resume_builds()
# A digest does not wait for the build.
out["while_building"] = digest._triton_batch(raws)
out["state_while_building"] = digest.kernel_state(dev)
digest.wait_for_builds(timeout_s=0.05)  # bounded: returns with the build still held
build.lock.release()
digest.wait_for_builds()
out["state_after"] = digest.kernel_state(dev)
out["variants"] = sorted(build.ready)
out["kernel_equals_torch_form"] = digest._triton_batch(raws) == want
out["threads_named"] = [t.name for t in threading.enumerate() if t.name.startswith("mx-digest")]
print(json.dumps(out))
"""


@pytest.mark.triton
def test_the_kernel_builds_in_the_background_and_digests_do_not_wait_for_it():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["paused_state"] == ["warming", False, False]
    assert out["while_building"] is None  # the torch form takes it
    assert out["state_while_building"] == "warming"
    assert out["state_after"] == "ready" and out["variants"] == [False, True]
    assert out["kernel_equals_torch_form"] is True
    assert out["threads_named"] == []  # the build's thread ended


def test_cpu_pulls_start_no_build_and_digests_stay_on_the_cpu():
    before = dict(digest._builds)
    digest.warm_up(digest.WSUM, ["cpu", torch.device("cpu")])
    digest.warm_up_for({"x": torch.zeros(4)}, "cpu")
    digest.warm_up_for(None, "cpu")
    digest.warm_up(digest.XXH3, ["cuda:0"])  # a CPU-only algorithm: nothing to build
    digest.prepare(digest.WSUM, [torch.zeros(4)])
    assert digest._builds == before
    assert digest.kernel_state("cuda:0") in ("not started", "broken")
    t = torch.arange(1000, dtype=torch.int32)
    assert digest.digest_many([t], digest.WSUM) == [digest.digest(t, digest.WSUM)]
    digest.wait_for_builds()  # nothing running: returns at once


def test_a_streaming_hasher_gives_the_digest_of_the_whole_tensor():
    t = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8)
    view = memoryview(t.numpy())
    for algo in (digest.XXH3, digest.BLAKE2B):
        h = digest.hasher(algo)
        for start in range(0, t.numel(), 300_000):
            h.update(view[start:start + 300_000])
        assert digest.stream_digest(h, t.numel()) == digest.digest(t, algo)
    assert digest.hasher(digest.WSUM) is None


@pytest.mark.parametrize("algo,b", [(digest.XXH3_BLOCKS, 8 << 20), (digest.XXH3_BLOCKS_1M, 1 << 20)])
def test_a_block_digest_is_xxh3_of_each_block_then_of_their_digests(algo, b):
    """``xxh3-128-b8m`` and ``-b1m`` by their definition, from the xxhash package alone:
    a tensor of one block has its plain xxh3-128; a larger one the xxh3-128 of its
    blocks' digests, the last block short. A batch large enough to be hashed on several
    threads gives the same digests as one tensor at a time, and one changed byte in the
    middle block changes only its tensor's digest."""
    import xxhash

    assert digest.block_bytes(algo) == b
    g = torch.Generator().manual_seed(11)
    big = torch.randint(0, 256, (2 * b + 12345,), dtype=torch.uint8, generator=g)
    small = big[:b].clone()
    raw = big.numpy().tobytes()
    want_big = xxhash.xxh3_128(b"".join(xxhash.xxh3_128(raw[a:a + b]).digest()
                                        for a in range(0, len(raw), b))).hexdigest()
    assert digest.digest(big, algo) == f"{want_big}:{big.numel()}"
    assert digest.digest(small, algo) == digest.digest(small, digest.XXH3)
    empty = torch.empty(0, dtype=torch.uint8)
    assert digest.digest(empty, algo) == digest.digest(empty, digest.XXH3)
    batch = [big, small, empty] * -(-digest._PARALLEL_BYTES // (3 * b))  # threads' size
    assert sum(t.numel() for t in batch) >= digest._PARALLEL_BYTES
    together = digest.digest_many(batch, algo)
    assert together == [digest.digest(t, algo) for t in batch]
    changed = big.clone()
    changed[b + 7] ^= 1
    got = digest.digest_many([changed, small], algo)
    assert got[0] != together[0] and got[1] == together[1]
    # one hasher per block, combined, as the copy threads of a local pull do
    hs = []
    for a in range(0, big.numel(), b):
        h = digest.hasher(algo)
        h.update(memoryview(big.numpy())[a:a + b])
        hs.append(h)
    assert digest.combine_blocks(hs, big.numel()) == together[0]
    assert digest.block_bytes(digest.XXH3) is None
    # the two block sizes are different digests of the same bytes
    other = digest.XXH3_BLOCKS if algo == digest.XXH3_BLOCKS_1M else digest.XXH3_BLOCKS_1M
    assert digest.digest(big, other) != together[0]


@pytest.mark.parametrize("algo", [digest.XXH3_BLOCKS, digest.XXH3_BLOCKS_1M])
def test_a_column_slice_is_hashed_in_logical_order_block_by_block(algo):
    """A strided matrix whose rows are contiguous (a column strip of a row-parallel
    weight, as a pull across layouts checks it) is hashed a block at a time from its
    rows, not copied out whole: its digest is that of the same bytes made contiguous,
    whether a block boundary falls inside a row or on one, a block spans one row or
    many, on one thread or several (a batch over ``_PARALLEL_BYTES``); one changed
    element in the middle block changes its digest."""
    b = digest.block_bytes(algo)
    g = torch.Generator().manual_seed(12)
    rows = 3 * b // (4 * 1000) + 7  # float32 rows of 1000 elements: blocks cut rows
    wide = torch.randn(rows, 1300, generator=g)
    cases = [
        wide[:, 100:1100],                                    # rows of 4000 bytes
        wide.to(torch.bfloat16)[:, 300:],                     # 2000 bytes, odd offset
        torch.randint(0, 256, (b // 512 + 3, 1024), dtype=torch.uint8, generator=g)[:, :512],
        wide[:, 5:6],                                         # one element per row
        torch.randn(3, 10, generator=g)[1:, 2:9],             # smaller than a block
    ]
    assert all(not t.is_contiguous() and t.stride(1) == 1 for t in cases)
    want = [digest.digest(t.contiguous(), algo) for t in cases]
    assert digest.digest_many(cases, algo) == want
    assert [digest.digest(t, algo) for t in cases] == want
    batch = cases * -(-digest._PARALLEL_BYTES // sum(t.numel() * t.element_size()
                                                     for t in cases))
    assert digest.digest_many(batch, algo) == want * (len(batch) // len(cases))
    changed = wide.clone()
    changed[rows // 2, 600] += 1.0
    assert digest.digest(changed[:, 100:1100], algo) != want[0]


def test_the_default_digest_of_host_tensors_has_small_blocks_below_512_mib():
    """1 MiB blocks for a model of less than 512 MiB in all (its 16-thread copy is cut
    into pieces under 8 MiB), 8 MiB blocks from there on; a GPU tensor anywhere makes
    it wsum. Expanded tensors: their sizes without the memory."""
    mib = torch.zeros(1, dtype=torch.uint8).expand(1 << 20)
    assert digest.default_algorithm([mib]) == digest.XXH3_BLOCKS_1M
    assert digest.default_algorithm([]) == digest.XXH3_BLOCKS_1M
    assert digest.default_algorithm([mib] * 511) == digest.XXH3_BLOCKS_1M
    assert digest.default_algorithm([mib] * 512) == digest.XXH3_BLOCKS
    wide = torch.zeros(1, dtype=torch.float32).expand(128 << 20)  # 512 MiB of fp32
    assert digest.default_algorithm([wide]) == digest.XXH3_BLOCKS


_GPU_FIRST = r"""
import json
import torch
from modelexpress.transfer import digest
dev = torch.device("cuda:0")
g = torch.Generator(device=dev).manual_seed(5)
ts = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device=dev, generator=g)
      for n in (1 << 20, 4097, 3)]
ts.append(torch.arange(9000, dtype=torch.int32, device=dev).view(torch.uint8)[4:])  # 4-aligned
out = {"state_before": digest.kernel_state(dev), "form_before": digest.kernel_form(dev)}
digest.warm_up(digest.WSUM, [dev])  # what a pull does as it starts
out["state_warm"] = digest.kernel_state(dev)
out["form_warm"] = digest.kernel_form(dev)
first = digest.digest_many(ts, digest.WSUM)
out["used_by_first"] = digest.forms_used()
out["triton_build_started"] = str(dev) in digest._builds
want = digest.digest_many(ts, digest.WSUM, impl="torch")
out["same"] = first == want and digest.digest_many(ts, digest.WSUM, impl="triton") == want
print(json.dumps(out))
"""


@pytest.mark.gpu
def test_a_fresh_process_first_gpu_digest_uses_the_shipped_kernel_loaded_at_warm_up():
    """On an H200 host: in a fresh process, the warm-up a pull starts with loads the
    shipped kernel, so the first digest already runs on it (no torch form, no Triton
    build); the torch form and the Triton kernel give the same digests for 16- and
    4-byte-aligned tensors."""
    proc = subprocess.run([sys.executable, "-c", _GPU_FIRST], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(out)
    assert out["state_before"] == "not started" and out["form_before"] == "torch"
    assert out["state_warm"] == "ready" and out["form_warm"] == "cuda"
    assert out["used_by_first"] == {"cuda": 4}
    assert out["triton_build_started"] is False
    assert out["same"] is True
