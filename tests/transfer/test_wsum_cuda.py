"""The shipped ``wsum-i32-v1`` kernel (``_wsum_cuda``, PTX from ``_wsum_i32.cu``).

On CI: the shipped PTX is the one generated from the kernel source, where no GPU is the
driver's refusal sends digests to the other forms (said once), and the launch's table
names each tensor's bytes (a strided one's rows) in logical order. On the GPU machine:
the kernel equals the definition (the CPU form, pinned to numpy by test_wsum_oracle)
across its vector, unroll, grid-stride and tail boundaries, and on strided blocks.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from modelexpress.transfer import _wsum_cuda, _wsum_ptx, digest

_SRC = pathlib.Path(digest.__file__).with_name("_wsum_i32.cu")


def test_the_shipped_ptx_is_generated_from_the_kernel_source():
    """scripts/build_wsum_ptx.sh was run after the last change to _wsum_i32.cu, and
    the launch constants of _wsum_cuda match the source's."""
    src = _SRC.read_bytes()
    assert hashlib.sha256(src).hexdigest() == _wsum_ptx.SOURCE_SHA256, \
        "run scripts/build_wsum_ptx.sh"
    text = src.decode()
    assert int(re.search(r"#define THREADS (\d+)", text).group(1)) == _wsum_cuda._THREADS
    assert int(re.search(r"#define UNROLL (\d+)", text).group(1)) == _wsum_cuda._UNROLL
    assert re.search(r"^\.version 7\.0$", _wsum_ptx.PTX, re.M)  # CUDA 11.0+ drivers load it
    entry = re.search(rf"\.entry {_wsum_ptx.ENTRY}\(([^)]*)\)", _wsum_ptx.PTX)
    assert entry and entry.group(1).count(".param .u64") == 3  # table, n, out
    fatbin = _wsum_cuda.image("fatbin")
    assert fatbin[:4] == bytes.fromhex("50ed55ba")  # the fatbin header's magic (0xBA55ED50)
    assert _wsum_ptx.ENTRY.encode() in fatbin
    assert _wsum_cuda.image("ptx").endswith(b"\0")  # cuModuleLoadData reads PTX to its NUL
    with pytest.raises(Exception, match="allowed: fatbin, ptx"):
        _wsum_cuda.image("cubin")


_REFUSED = r"""
import json, logging
import torch
from modelexpress.transfer import digest
seen = []
class Count(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger("modelexpress.transfer.digest").addHandler(Count())
out = {"ready": [digest._cuda_ready(0), digest._cuda_ready(0)],
       "why": digest._cuda_refused, "warnings": len(seen),
       "form": digest.kernel_form("cuda:0"), "state": digest.kernel_state("cuda:0")}
t = torch.arange(1001, dtype=torch.int32)
out["cpu_digest"] = digest.digest(t, digest.WSUM) == digest.digest_many([t], digest.WSUM,
                                                                         impl="torch")[0]
out["used"] = digest.forms_used()
print(json.dumps(out))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a usable GPU "
                    "(here the driver loads the kernel: the GPU tests below cover it)")
def test_where_the_driver_cannot_load_the_kernel_the_refusal_is_said_once_and_digests_go_on():
    proc = subprocess.run([sys.executable, "-c", _REFUSED], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ready"] == [False, False]
    assert "cuda:0" in out["why"] or "libcuda" in out["why"], out["why"]
    assert out["warnings"] == 1
    assert out["form"] == "torch" and out["state"] == "not started"
    assert out["cpu_digest"] is True and out["used"] == {"torch": 2}


def _cases(dev: torch.device) -> list[torch.Tensor]:
    """uint8 views: sizes around the int4 vector (16 B), the unroll (4 vectors per
    thread), the grid-stride (several passes of the whole grid) and tail boundaries;
    16-, 8- and 4-byte-aligned starts; negative words; words whose b wraps past 2**64."""
    g = torch.Generator(device="cpu").manual_seed(24)
    grid_words = 4 * _wsum_cuda._THREADS * _wsum_cuda._UNROLL * \
        torch.cuda.get_device_properties(dev).multi_processor_count * _wsum_cuda._BLOCKS_PER_SM
    out = []
    for nbytes in (0, 1, 3, 4, 5, 15, 16, 17, 63, 64, 65, 4 * 1023 + 2, 4 * 4096,
                   4 * (grid_words + 7) + 3, 4 * (3 * grid_words + 1001) + 1):
        for offset in (0, 4, 8, 12):
            raw = torch.randint(0, 256, (nbytes + offset,), dtype=torch.uint8, generator=g)
            out.append(raw.to(dev)[offset:])
    wrap = torch.full((400_000,), 2**31 - 1, dtype=torch.int32).view(torch.uint8)
    out.append(wrap.to(dev))
    return out


@pytest.mark.gpu
def test_the_shipped_kernel_equals_the_definition_one_by_one_and_in_one_batch():
    dev = torch.device("cuda:0")
    digest.warm_up(digest.WSUM, [dev])
    assert digest.kernel_form(dev) == "cuda", digest._cuda_refused
    major, minor = torch.cuda.get_device_capability(0)
    if 10 * major + minor in _wsum_ptx.FATBIN_ARCHS:  # the H200: sm_90
        assert _wsum_cuda.image_of(0) == "fatbin"  # machine code, no translation
    cases = _cases(dev)
    want = [digest.digest(t.cpu(), digest.WSUM) for t in cases]
    assert digest.digest_many(cases, digest.WSUM, impl="cuda") == want
    for t, w in zip(cases, want):
        assert digest.digest_many([t], digest.WSUM, impl="cuda") == [w], (t.numel(),
                                                                         t.data_ptr() % 16)
    assert digest.digest_many(cases, digest.WSUM, impl="torch") == want
    # many small tensors in one launch (a chunk of an unfused checkpoint), empty ones among them
    g = torch.Generator(device="cpu").manual_seed(7)
    sizes = torch.randint(0, 5000, (400,), generator=g).tolist()
    small = [torch.randint(0, 256, (n + 4 * (i % 4),), dtype=torch.uint8, generator=g)
             .to(dev)[4 * (i % 4):] for i, n in enumerate(sizes)]
    assert digest.digest_many(small, digest.WSUM, impl="cuda") == [
        digest.digest(t.cpu(), digest.WSUM) for t in small]


_PTX_ONLY = r"""
import json
import torch
from modelexpress.transfer import _wsum_cuda, digest
_wsum_cuda.load(0, images=("ptx",))  # as on a GPU the fatbin has no machine code for
cases = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")[off:]
         for n, off in ((1 << 22, 0), (4 * 100_003 + 7, 4), (3, 0))]
print(json.dumps({"image": _wsum_cuda.image_of(0), "form": digest.kernel_form("cuda:0"),
                  "same": digest.digest_many(cases, digest.WSUM, impl="cuda")
                  == [digest.digest(t.cpu(), digest.WSUM) for t in cases]}))
"""


@pytest.mark.gpu
def test_the_shipped_ptx_loads_and_equals_the_definition_where_no_machine_code_fits(tmp_path):
    """The PTX, translated by the driver (an empty JIT cache: CUDA_CACHE_PATH new)."""
    import os
    env = {**os.environ, "CUDA_CACHE_PATH": str(tmp_path / "cuda-cache")}
    proc = subprocess.run([sys.executable, "-c", _PTX_ONLY], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"image": "ptx", "form": "cuda", "same": True}


@pytest.mark.gpu
def test_the_shipped_kernel_reads_after_work_queued_on_the_current_stream():
    """A digest right after a copy enqueued on a side stream the current one waits on
    (as a pull's copies are) sees the copied bytes."""
    dev = torch.device("cuda:0")
    src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device=dev)
    want = digest.digest_many([src], digest.WSUM, impl="torch")
    for _ in range(3):
        dst = torch.zeros_like(src)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream(dev).wait_stream(side)
        assert digest.digest_many([dst], digest.WSUM, impl="cuda") == want


def _strided_cases(dev: torch.device | str) -> list[torch.Tensor]:
    """Blocks as a pull across layouts checks them where they lie: column strips of
    float32, bfloat16 and int8 matrices (rows of whole int4 vectors, of whole words only,
    of odd bytes), strips at 4-, 8- and 12-byte offsets, a box of a 3D tensor whose
    outer dimensions fold into rows, one that does not fold, and one of a single row."""
    g = torch.Generator(device="cpu").manual_seed(11)

    def mat(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raw = torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int64, generator=g)
        if dtype == torch.int8:
            return raw.to(torch.int8).to(dev)
        return raw.to(torch.int32).view(dtype).to(dev)  # bf16: twice the columns

    a = mat((300, 1024), torch.float32)          # rows of 4 KiB
    b = mat((77, 4096), torch.bfloat16)           # bf16: 2 elements a word
    c = mat((64, 999), torch.int8)
    d = mat((6, 40, 96), torch.float32)
    return [a[:, 0:256], a[:, 4:260], a[:, 1:258], a[:, 3:1021], a[5:299, 512:1024],
            b[:, 0:2048], b[:, 2:6146], b[:, 1:3], c[:, 8:72], c[:, 1:4],
            d[:, 10:30, :], d[1:5, :, 16:48], d[2:3, 0:1, 4:68], a[7:8, 3:900]]


def test_rows_of_names_equal_runs_a_fixed_pitch_apart_and_nothing_else():
    t = torch.zeros(8, 16, dtype=torch.float32)
    assert _wsum_cuda.rows_of(t) is None  # contiguous
    assert _wsum_cuda.rows_of(t[:, 4:12]) == (8, 32, 64)
    assert _wsum_cuda.rows_of(t[2:5]) is None  # whole rows: contiguous
    assert _wsum_cuda.rows_of(t[:, 3]) == (8, 4, 64)  # a column: rows of one element
    cube = torch.zeros(4, 5, 6, dtype=torch.bfloat16)
    assert _wsum_cuda.rows_of(cube[:, :, 2:4]) == (20, 4, 12)  # outer dims fold
    assert _wsum_cuda.rows_of(cube[:, 1:3, :]) == (4, 24, 60)
    assert _wsum_cuda.rows_of(cube[:, 1:3, 2:4]) is None  # two pitches: copied out
    assert _wsum_cuda.rows_of(t[:, 4:12].t()) is None  # transposed: not runs in order
    assert _wsum_cuda.rows_of(torch.zeros(1, 16).expand(8, 16)) is None  # rows repeat
    assert _wsum_cuda.rows_of(t[:, 4:4]) is None  # no bytes
    assert _wsum_cuda.hashable_rows(cube[:, :, 2:4]) == (20, 4, 12)
    assert _wsum_cuda.hashable_rows(cube[:, :, 1:2]) is None  # rows of 2 bytes
    assert _wsum_cuda.hashable_rows(cube[:, :, 1:3]) is None  # 2-byte aligned start


def _emulate(table: object, n: int) -> list[str]:
    """The digests the kernel computes from its table, read from host memory at the
    addresses in it (words in logical order: a contiguous item's, or each row's in turn)."""
    import ctypes

    import numpy as np
    rows = np.asarray(table)[:6 * n].reshape(n, 6).astype(np.int64)
    out = []
    for ptr, words, vec, tail, row, pitch in rows.tolist():
        if row == words:
            raw = ctypes.string_at(ptr, 4 * words + tail) if words + tail else b""
        else:
            assert tail == 0 and words % row == 0 and vec in (0, words // 4)
            raw = b"".join(ctypes.string_at(ptr + 4 * pitch * r, 4 * row)
                           for r in range(words // row))
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
            torch.empty(0, dtype=torch.uint8)
        out.append(digest.digest(t, digest.WSUM))
    return out


def test_the_kernels_table_reads_each_tensors_bytes_in_logical_order():
    """The table the launch is given (items_of's items), read back on the CPU as the
    kernel reads it: every tensor's words (a strided one's rows in turn, a misaligned
    one's copy) hash to the digest of its bytes copied out; every tensor with bytes
    gets 1 to a full grid of blocks, by its loads."""
    import numpy as np
    tensors = [t for t in _strided_cases("cpu") if _wsum_cuda.hashable_rows(t) is not None]
    assert len(tensors) >= 8
    flat = [torch.arange(n, dtype=torch.uint8) for n in (0, 3, 4, 17, 4096)]
    odd = [torch.arange(40, dtype=torch.uint8)[1:37]]  # misaligned: copied out
    mixed = flat + tensors + odd
    items, copies = _wsum_cuda.items_of(mixed)
    assert len(copies) == 1 and items[-1][0] == copies[0].data_ptr()
    table = _wsum_cuda.table(items, max_blocks=64)
    got = _emulate(table, len(mixed))
    assert got == [digest.digest(t.contiguous(), digest.WSUM) for t in mixed]
    first = table[6 * len(mixed):].astype(np.int64)
    blocks = np.diff(first)
    assert first[0] == 0 and blocks[0] == 0  # the empty tensor has none
    assert (blocks[1:] >= 1).all() and (blocks <= 64).all()
    # a block per unrolled step of a block's threads (a load: a vector, or a word after
    # the last vector): a vector short of one step, one; ten steps, ten, in rows of
    # whole vectors too; a large tensor a full grid
    step = 16 * _wsum_cuda._THREADS * _wsum_cuda._UNROLL
    sized = [(1 << 20, n, n, n) for n in (step - 16, 10 * step, 1 << 30)]
    sized.append((1 << 20, 10 * step, 2 * step, 3 * step))
    assert np.diff(_wsum_cuda.table(sized, 64)[-5:].astype(np.int64)).tolist() == [1, 10, 64, 10]


@pytest.mark.gpu
def test_the_shipped_kernel_hashes_strided_blocks_where_they_lie_as_copied_out():
    """Column strips and boxes (rows of whole vectors, of whole words; those it cannot
    take are copied out first) digest as their bytes copied out, one by one and in one
    batch with contiguous tensors; strips_hashed_in_place says so for this GPU (then
    check_blocks copies no strip out) and for nothing else."""
    dev = torch.device("cuda:0")
    digest.warm_up(digest.WSUM, [dev])
    assert digest.kernel_form(dev) == "cuda", digest._cuda_refused
    cases = _strided_cases(dev)
    assert sum(_wsum_cuda.hashable_rows(t) is not None for t in cases) >= 8
    want = [digest.digest(t.cpu().contiguous(), digest.WSUM) for t in cases]
    assert digest.digest_many(cases, digest.WSUM, impl="cuda") == want
    for t, w in zip(cases, want):
        assert digest.digest_many([t], digest.WSUM, impl="cuda") == [w], (t.shape, t.stride())
    mixed = _cases(dev) + cases
    assert digest.digest_many(mixed, digest.WSUM, impl="cuda") == [
        digest.digest(t.cpu().contiguous(), digest.WSUM) for t in mixed]
    assert digest.digest_many(cases, digest.WSUM, impl="torch") == want
    assert digest.strips_hashed_in_place(digest.WSUM, dev)
    assert not digest.strips_hashed_in_place(digest.XXH3_BLOCKS_1M, dev)
    assert not digest.strips_hashed_in_place(digest.WSUM, "cpu")
