"""The local transport's CUDA paths (GPU hosts only): CUDA IPC and VMM POSIX-fd segments.

Each test runs a real source process (tests/local/_peers.py) and pulls in this
process; bytes are compared with the seeded data, descriptors counted in both.
"""

from __future__ import annotations

import pytest
import torch

from modelexpress.local import LocalEndpoint, fd_count, pull
from modelexpress.transfer.digest import forms_used, wait_for_builds
from modelexpress.transfer.manifest import Manifest

from ._peers import make_tensors

pytestmark = pytest.mark.gpu


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


DEVICES = ["cuda:0", pytest.param("cuda:1", marks=pytest.mark.skipif(
    not _two_gpus(), reason=f"needs two GPUs; "
                            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} here"))]


def _parts(src):  # type: ignore[no-untyped-def]
    return LocalEndpoint.from_json(src.info["endpoint"]), Manifest.from_json(src.info["manifest"])


def _dst(manifest: Manifest, device: str) -> dict[str, torch.Tensor]:
    return {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype), device=device)
            for t in manifest.tensors}


def _equal(src, dst) -> bool:  # type: ignore[no-untyped-def]
    want = make_tensors(src.seed, src.mib)
    return all(torch.equal(want[k].view(torch.uint8), dst[k].cpu().view(torch.uint8)) for k in want)


@pytest.mark.parametrize("dst_device", DEVICES)
@pytest.mark.parametrize("layout,kind", [("cuda", "cuda_ipc"), ("vmm", "vmm_fd")])
def test_gpu_pull_maps_the_source_memory_and_copies_every_byte(make_source, layout, kind,
                                                               dst_device):
    src = make_source(layout, mib=64)
    endpoint, manifest = _parts(src)
    assert manifest.digest_algorithm == "wsum-i32-v1"
    src_fds = src.fds()
    dst = _dst(manifest, dst_device)
    before = forms_used()
    res = pull(endpoint, manifest, dst, chunk_bytes=8 << 20)
    assert res.transport == "local" and set(res.segments) == {kind}, res
    assert res.verified == len(manifest.tensors)
    # verified by the shipped kernel, which the pull loaded as it started
    used = {k: n - before.get(k, 0) for k, n in forms_used().items() if n != before.get(k, 0)}
    assert used == {"cuda": len(manifest.tensors)}, used
    assert _equal(src, dst)
    # no descriptor left behind (the source may close one it held before: <=)
    assert src.fds_settle(src_fds) <= src_fds
    # The first pull in a process also opens the driver's own descriptors (a device's
    # context, peer mappings): count from the second pull, which must leave none.
    dst2 = _dst(manifest, dst_device)
    wait_for_builds()  # the digest kernel's background build holds descriptors while it runs
    my_fds = fd_count()
    pull(endpoint, manifest, dst2, chunk_bytes=8 << 20)
    assert _equal(src, dst2)
    wait_for_builds()
    assert fd_count() == my_fds
    assert src.fds_settle(src_fds) <= src_fds


def test_gpu_arena_to_arena_merges_copies_across_chunks(make_source):
    """Source and target both load in a VMM arena: runs contiguous on both sides are
    copied as one cuMemcpy across chunk boundaries. The target runs in its own process
    (it installs the arena allocator, which lives for the process) and checks that its
    context is healthy after closing its arena."""
    src = make_source("vmm", mib=64)
    r = _run_target(src, "--dst-device", "cuda:0", "--dst-arena")
    n = len(Manifest.from_json(src.info["manifest"]).tensors)
    assert r["ok"] and r["equal"] and r["context_ok"], r
    assert r["copies"] < n, r


def test_gpu_host_source_to_device_and_device_source_to_host(make_source):
    host_src = make_source("buffer", mib=32)
    endpoint, manifest = _parts(host_src)
    dst = _dst(manifest, "cuda:0")
    res = pull(endpoint, manifest, dst, verify=False)
    assert res.segments == {"memfd": 1} and _equal(host_src, dst)
    dev_src = make_source("vmm", mib=32)
    endpoint, manifest = _parts(dev_src)
    dst = _dst(manifest, "cpu")
    res = pull(endpoint, manifest, dst, verify=False)
    assert res.segments == {"vmm_fd": res.segments["vmm_fd"]} and _equal(dev_src, dst)


def _run_target(src, *extra: str) -> dict:  # type: ignore[no-untyped-def]
    import json
    import subprocess
    import sys

    from .conftest import PEERS, ROOT
    p = subprocess.run([sys.executable, str(PEERS), "target", str(src.info_path),
                        "--seed", str(src.seed), "--mib", str(src.mib), *extra],
                       stdout=subprocess.PIPE, cwd=ROOT, text=True, timeout=120)
    assert p.returncode == 0, p.stdout
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(r)
    return r


@pytest.mark.parametrize("layout", ["cuda", "vmm"])
def test_gpu_source_killed_mid_copy_is_a_peer_error(make_source, layout):
    """The target runs in its own process: a copy in flight when the source dies reads
    memory the source owned, and a fault there would end this test process's context."""
    src = make_source(layout, mib=64)
    r = _run_target(src, "--dst-device", "cuda:0", "--kill-source", str(src.pid),
                    "--chunk-bytes", str(1 << 20))
    assert r.get("killed") and not r["ok"] and "went away" in r["error"], r
    if layout == "vmm":
        # an imported VMM handle keeps the pages alive: copies in flight stay valid, and
        # every received descriptor is closed (the driver's own first-use descriptors
        # in a fresh process make the count of the IPC case not comparable)
        assert r["context_ok"], r
        assert r["fds_after"] == r["fds_before"], r
