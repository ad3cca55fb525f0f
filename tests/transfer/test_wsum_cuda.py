"""The shipped ``wsum-i32-v1`` kernel (``_wsum_cuda``, PTX from ``_wsum_i32.cu``).

On CI: the shipped PTX is the one generated from the kernel source, and where no GPU
is, the driver's refusal sends digests to the other forms (said once). On the GPU
machine: the kernel equals the definition (the CPU form, pinned to numpy by
test_wsum_oracle) across its vector, unroll, grid-stride and tail boundaries.
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
