"""The local transport end to end on the CPU: real processes, memfds over SCM_RIGHTS."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from modelexpress.errors import (
    IntegrityError,
    ManifestMismatchError,
    PeerError,
    TransferCancelledError,
    TransferTimeoutError,
)
from modelexpress.local import LocalEndpoint, fd_count, pull
from modelexpress.transfer.manifest import Manifest

from ._peers import make_tensors
from .conftest import PEERS, ROOT


def _dst(manifest: Manifest) -> dict[str, torch.Tensor]:
    return {t.name: torch.full(t.shape, 0, dtype=getattr(torch, t.dtype)) for t in manifest.tensors}


def _parts(src):  # type: ignore[no-untyped-def]
    return LocalEndpoint.from_json(src.info["endpoint"]), Manifest.from_json(src.info["manifest"])


def _equal(seed: int, mib: int, dst: dict[str, torch.Tensor]) -> bool:
    want = make_tensors(seed, mib)
    return want.keys() == dst.keys() and all(
        torch.equal(want[k].view(torch.uint8), dst[k].view(torch.uint8)) for k in want)


@pytest.mark.parametrize("layout", ["buffer", "buffers", "arena"])
def test_pull_copies_every_byte_and_leaves_no_descriptor_in_either_process(make_source, layout):
    src = make_source(layout)
    endpoint, manifest = _parts(src)
    src_fds, my_fds = src.fds(), fd_count()
    dst = _dst(manifest)
    progress: list[tuple[int, int]] = []
    res = pull(endpoint, manifest, dst, chunk_bytes=4 << 20,
               progress=lambda done, total: progress.append((done, total)))
    assert res.transport == "local"
    assert res.nbytes == manifest.total_bytes and res.verified == len(manifest.tensors)
    assert _equal(src.seed, src.mib, dst)
    assert progress[-1] == (manifest.total_bytes, manifest.total_bytes)
    assert [d for d, _ in progress] == sorted(d for d, _ in progress) and len(progress) > 1
    assert fd_count() == my_fds
    assert src.fds_settle(src_fds) == src_fds
    if layout == "buffers":
        assert res.segments == {"memfd": len(manifest.tensors)}


@pytest.mark.parametrize("layout", ["buffer", "arena"])
def test_contiguous_runs_are_copied_in_one_read_per_shared_memfd(make_source, layout):
    """Tensors contiguous at the source and at the destination are one copy, as long as
    one memfd holds them (a host copy is a pread of one file): a buffer's adjacent
    tensors merge, a host arena's chunks (one memfd each) do not."""
    from modelexpress.local import host_buffer_like
    src = make_source(layout, mib=8)
    endpoint, manifest = _parts(src)
    # the destination laid out exactly like the source: contiguous in the same order
    shapes = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for t in manifest.tensors}
    gran = os.sysconf("SC_PAGE_SIZE")
    offs, total = {}, 0
    for t in manifest.tensors:
        offs[t.name] = t.addr - manifest.tensors[0].addr
        total = max(total, offs[t.name] + t.nbytes)
    buf, _ = host_buffer_like({"x": torch.empty(total + gran, dtype=torch.uint8)}, copy=False)
    try:
        dst = {n: buf.tensor(offs[n], tuple(v.shape), v.dtype) for n, v in shapes.items()}
        res = pull(endpoint, manifest, dst, chunk_bytes=1 << 40)
        assert _equal(src.seed, src.mib, dst)
        ordered = sorted(manifest.tensors, key=lambda t: t.addr)
        if layout == "buffer":
            runs = 1 + sum(1 for a, b in zip(ordered, ordered[1:])
                           if a.addr + a.nbytes != b.addr)
            assert res.copies == runs < len(ordered), res
        else:  # one chunk (memfd) per tensor
            assert res.copies == len(ordered) == res.segments["memfd"], res
        del dst
    finally:
        buf.close()


def test_wrong_credential_is_refused_and_gets_no_descriptor(make_source):
    src = make_source()
    endpoint, manifest = _parts(src)
    src_fds, my_fds = src.fds(), fd_count()
    bad = LocalEndpoint(endpoint.host_id, endpoint.path, endpoint.source_id, "0" * 64)
    with pytest.raises(PeerError, match="wrong credential"):
        pull(bad, manifest, _dst(manifest))
    assert fd_count() == my_fds
    assert src.fds_settle(src_fds) == src_fds
    # the source still serves the right credential afterwards
    dst = _dst(manifest)
    pull(endpoint, manifest, dst)
    assert _equal(src.seed, src.mib, dst)


def test_a_source_killed_mid_copy_fails_the_pull_with_a_peer_error(make_source):
    src = make_source(mib=32)
    endpoint, manifest = _parts(src)
    my_fds = fd_count()
    killed: list[float] = []

    def progress(done: int, total: int) -> None:
        if not killed:
            os.kill(src.pid, signal.SIGKILL)
            src.proc.wait(10)
            killed.append(time.monotonic())

    t0 = time.monotonic()
    with pytest.raises(PeerError, match="went away after"):
        pull(endpoint, manifest, _dst(manifest), chunk_bytes=1 << 20, progress=progress,
             deadline_s=30)
    assert killed and time.monotonic() - t0 < 30
    assert fd_count() == my_fds
    # a dead source's socket refuses at once
    with pytest.raises(PeerError, match="not listening"):
        pull(endpoint, manifest, _dst(manifest), deadline_s=5)


def test_stop_and_deadline_are_honoured_between_chunks(make_source):
    src = make_source(mib=16)
    endpoint, manifest = _parts(src)
    my_fds = fd_count()
    stop = threading.Event()
    with pytest.raises(TransferCancelledError):
        pull(endpoint, manifest, _dst(manifest), chunk_bytes=1 << 20, stop=stop,
             progress=lambda d, t: stop.set())
    with pytest.raises(TransferTimeoutError):
        pull(endpoint, manifest, _dst(manifest), chunk_bytes=1 << 20,
             progress=lambda d, t: time.sleep(0.3), deadline_s=0.5)
    assert fd_count() == my_fds


def test_a_wrong_digest_raises_integrity_error_naming_the_tensor(make_source):
    src = make_source(mib=4)
    endpoint, manifest = _parts(src)
    first = manifest.tensors[0]
    bad = Manifest.from_json(manifest.to_json().replace(first.digest, "0" * 32 + ":" + str(first.nbytes)))
    with pytest.raises(IntegrityError, match=first.name.replace(".", r"\.")):
        pull(endpoint, bad, _dst(manifest))


def test_a_shape_mismatch_fails_before_any_copy_and_leaves_no_descriptor(make_source, tmp_path):
    """The pull says hello before it matches the manifest (the source answers
    meanwhile): a mismatch still fails it with ManifestMismatchError before a byte is
    copied, closes that connection (no descriptor left in either process: the
    segments the source sent meanwhile included), and is what a pull from a source
    that is gone reports too (the caller's error first)."""
    src = make_source(mib=4)
    endpoint, manifest = _parts(src)
    dst = _dst(manifest)
    name = manifest.tensors[0].name
    dst[name] = torch.zeros(dst[name].numel() + 1, dtype=dst[name].dtype)
    src_fds, my_fds = src.fds(), fd_count()
    with pytest.raises(ManifestMismatchError, match=name.replace(".", r"\.")) as failed:
        pull(endpoint, manifest, dst)
    assert fd_count() == my_fds, "a connection is left open (its frame kept by the traceback)"
    del failed
    assert src.fds_settle(src_fds) == src_fds
    assert not any(t.view(torch.uint8).any() for t in dst.values())  # nothing copied
    gone = LocalEndpoint.from_json({**endpoint.to_json(), "path": str(tmp_path / "gone.sock")})
    with pytest.raises(ManifestMismatchError):
        pull(gone, manifest, dst)
    with pytest.raises(PeerError, match="not listening"):
        pull(gone, manifest, _dst(manifest))
    assert fd_count() == my_fds
    good = _dst(manifest)
    pull(endpoint, manifest, good)  # the source serves on
    assert _equal(src.seed, src.mib, good)


def _target(path: str, *prefix: str, token: str = "") -> subprocess.Popen:
    cmd = [*prefix, sys.executable, str(PEERS), "target", path]
    if token:
        cmd += ["--token", token]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=ROOT, text=True)


def _result(proc: subprocess.Popen, src) -> dict:  # type: ignore[no-untyped-def]
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    res = json.loads(out.strip().splitlines()[-1])
    return res


def test_several_concurrent_targets_each_get_every_byte(make_source):
    src = make_source(mib=24)
    src_fds = src.fds()
    procs = [_target(str(src.info_path)) for _ in range(4)]
    for p in procs:
        p.args += []  # noqa: B018 - kept for the failure message
    results = [_result(p, src) for p in procs]
    for r in results:
        assert r["ok"], r
        assert r["nbytes"] == Manifest.from_json(src.info["manifest"]).total_bytes
        assert r["fds_after"] == r["fds_before"], r
    assert src.fds_settle(src_fds) == src_fds


def _seed_args(src) -> list[str]:  # type: ignore[no-untyped-def]
    return ["--seed", str(src.seed), "--mib", str(src.mib)]


def test_target_processes_verify_bytes_against_the_seeded_data(make_source):
    src = make_source(mib=8)
    p = subprocess.Popen([sys.executable, str(PEERS), "target", str(src.info_path),
                          *_seed_args(src)], stdout=subprocess.PIPE, cwd=ROOT, text=True)
    r = _result(p, src)
    assert r["ok"] and r["equal"], r


def _can_unshare_pid() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "true"], timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_unshare_pid(),
                    reason="unshare --pid needs root or user namespaces; neither is available here")
def test_a_target_in_another_pid_namespace_pulls_over_the_socket(make_source):
    src = make_source(mib=8)
    src_fds = src.fds()
    p = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, str(PEERS), "target",
                          str(src.info_path), *_seed_args(src)],
                         stdout=subprocess.PIPE, cwd=ROOT, text=True)
    r = _result(p, src)
    assert r["ok"] and r["equal"], r
    assert r["pid"] == 1, "the target did not run in a new PID namespace"
    assert r["fds_after"] == r["fds_before"]
    assert src.fds_settle(src_fds) == src_fds


def test_a_target_with_a_wrong_token_in_another_process_is_refused(make_source):
    src = make_source(mib=2)
    r = _result(_target(str(src.info_path), token="f" * 64), src)
    assert not r["ok"] and "wrong credential" in r["error"], r
    assert r["fds_after"] == r["fds_before"]
