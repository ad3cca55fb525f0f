"""A source loaded from a checkpoint file also serves the file's page cache.

Real processes (tests/local/_peers.py): the source loads a safetensors checkpoint as
``modelexpress publish`` does; targets pull with digests verified and compare every
byte with the seeded data. Each fallback to the memfds is exercised: a file changed
on disk after the load, a change no fstat shows (caught by the digests), an evicted
page cache, and a target that does not ask for file segments.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import subprocess
import sys
import time

import pytest

from tests.local.conftest import PEERS, ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _target(src, *extra: str) -> dict:  # type: ignore[no-untyped-def]
    proc = subprocess.run([sys.executable, str(PEERS), "target", str(src.info_path),
                           "--seed", str(src.seed), "--mib", str(src.mib), *extra],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"log": proc.stderr}


def _nowait_works(path: str) -> bool:
    """Whether this filesystem reads without waiting (tmpfs does not: the memfds then)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
        return True
    except OSError as exc:
        return exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL)
    finally:
        os.close(fd)


@pytest.mark.parametrize("loop", ["c", "python"])
def test_a_source_loaded_from_a_checkpoint_serves_its_page_cache_and_every_byte_arrives(
        make_source, loop):
    src = make_source("checkpoint", mib=12)
    out = _target(src, *(["--python-loop"] if loop == "python" else []))
    assert out["ok"], out["error"]
    from modelexpress.transfer.manifest import Manifest
    assert out["equal"] and out["verified"] == len(Manifest.from_json(src.info["manifest"]).tensors)
    assert out["segments"].get("file", 0) >= 2  # unaligned tensors: several extents, one fd
    if _nowait_works(src.info["checkpoint"]):
        assert out["page_cache_bytes"] == out["nbytes"] and out["page_cache_misses"] == 0
    else:
        assert out["page_cache_bytes"] == 0
    assert out["fds_after"] == out["fds_before"]


def test_a_checkpoint_rewritten_in_place_after_the_load_is_served_from_the_memfd_only(
        make_source):
    src = make_source("checkpoint", mib=4)
    path = src.info["checkpoint"]
    st = os.stat(path)
    with open(path, "r+b") as f:  # the last byte of the data, changed in place
        f.seek(st.st_size - 1)
        last = f.read(1)
        f.seek(st.st_size - 1)
        f.write(bytes([last[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime back: ctime still tells
    out = _target(src)
    assert out["ok"], out["error"]
    assert out["equal"] and out["page_cache_bytes"] == 0
    assert "file" not in out["segments"]


def test_file_bytes_that_fail_their_digest_are_copied_again_from_the_memfds(make_source):
    src = make_source("checkpoint_stale", mib=4)
    out = _target(src)
    assert out["ok"], out["error"]
    assert out["equal"] and out["page_cache_bytes"] == 0
    assert "copying everything again from its memfds" in out["log"]


def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache now (mincore over a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            rc = libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
            assert rc == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def _cachestat_works(path: str) -> bool:
    """Whether the kernel counts a file's cached pages (cachestat, Linux 6.5)."""
    from modelexpress.local.origin import cached_share
    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_share(fd, 0, 4096) is not None
    finally:
        os.close(fd)


def test_cached_share_counts_the_cached_pages_of_a_range_and_reads_none(tmp_path):
    from modelexpress.local.origin import cached_share
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 << 20))
    if not _cachestat_works(str(path)):
        pytest.skip("this kernel has no cachestat (Linux < 6.5): pulls read as before")
    if not _nowait_works(str(path)):
        pytest.skip("tmpfs: the file is its page cache, nothing can be evicted")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.pread(fd, 4 << 20, 0)
        assert cached_share(fd, 0, 4 << 20) == 1.0
        os.posix_fadvise(fd, 0, 2 << 20, os.POSIX_FADV_DONTNEED)
        assert cached_share(fd, 0, 2 << 20) == 0.0
        assert cached_share(fd, 2 << 20, 2 << 20) == 1.0
        assert cached_share(fd, 1 << 20, 2 << 20) == 0.5  # half each side of the drop
        assert cached_share(fd, 0, 2 << 20) == 0.0  # asking read nothing back in
    finally:
        os.close(fd)


@pytest.mark.parametrize("loop", ["c", "python"])
def test_an_evicted_page_cache_is_read_from_the_memfds_then_read_back_by_the_source(
        make_source, loop):
    # larger than a device's readahead window (8 MiB on the 2-core VM's disk): one
    # WILLNEED of the whole file would bring back only that window
    src = make_source("checkpoint", mib=24)
    path = src.info["checkpoint"]
    nowait = _nowait_works(path)  # tmpfs: no page cache to evict, memfd reads anyway
    if nowait:
        from modelexpress.checkpoint import drop_page_cache
        for _ in range(20):  # DONTNEED is advice: bounded retries, then checked
            drop_page_cache(path)
            if _resident_pages(path) == 0:
                break
            time.sleep(0.05)
        assert _resident_pages(path) == 0, "the kernel kept the checkpoint's page cache"
    out = _target(src, *(["--python-loop"] if loop == "python" else []))
    assert out["ok"], out["error"]
    assert out["equal"]
    if not nowait:
        assert out["page_cache_bytes"] == 0 and out["page_cache_misses"] == 0
        return
    if _cachestat_works(path):
        # The target saw that the page cache held none of it and read the memfds: no
        # file read, so no miss (and no readahead started by one).
        assert out["page_cache_bytes"] == 0 and out["page_cache_misses"] == 0
        # Once the peer is done the source reads its page cache back itself, and the
        # next pull reads it.
        size = os.path.getsize(path)
        pages = -(-size // mmap.PAGESIZE)
        deadline = time.monotonic() + 30
        while _resident_pages(path) < pages and time.monotonic() < deadline:
            time.sleep(0.05)
        # (readahead is advice: a few pages may stay out; the pull reads them elsewhere)
        assert _resident_pages(path) >= 0.99 * pages, "the source did not read its page cache back"
        again = _target(src, *(["--python-loop"] if loop == "python" else []))
        assert again["ok"] and again["equal"]
        assert again["page_cache_bytes"] >= 0.9 * again["nbytes"]
        return
    # Without cachestat the first read of the file misses; that miss starts the
    # kernel's readahead (Linux 6.18), and later reads may then hit the page cache: how
    # many bytes come from each is timing, that a miss was taken is not.
    assert out["page_cache_misses"] >= 1
    assert out["page_cache_bytes"] <= out["nbytes"]


def test_a_target_that_does_not_ask_for_file_segments_gets_memfds_only(make_source):
    from modelexpress.local import LocalEndpoint, LocalSession
    src = make_source("checkpoint", mib=2)
    ep = LocalEndpoint.from_json(src.info["endpoint"])
    with LocalSession(ep, files=False) as old:
        assert {s.kind for s in old.segments} == {"memfd"}
    with LocalSession(ep) as new:
        assert {s.kind for s in new.segments} == {"memfd", "file"}
