"""Host-to-host copies of the local transport (``local.hostcopy``): parallel reads from a
memfd, digests hashed in the copy's own pass, and the pull with each digest algorithm."""

from __future__ import annotations

import os
import types

import pytest
import torch

from modelexpress import _threads
from modelexpress.errors import IntegrityError
from modelexpress.local import HostBuffer, HostMapping, LocalEndpoint, pull
from modelexpress.local.hostcopy import DigestsAlongside, DigestsInPass, HostCopier, digests_for
from modelexpress.local.protocol import Segment
from modelexpress.transfer import digest
from modelexpress.transfer.manifest import Manifest

from ._peers import make_tensors


def _source(sizes: list[int], seed: int) -> tuple[HostBuffer, list[tuple[int, int]]]:
    """A memfd buffer holding seeded bytes; (offset, size) of each 'tensor' in it."""
    g = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    buf = HostBuffer(total)
    view = buf.tensor(0, (total,), torch.uint8)
    view.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8, generator=g))
    spans, off = [], 0
    for n in sizes:
        spans.append((off, n))
        off += n
    return buf, spans


def _pairs(buf: HostBuffer, spans, algo: str, digested=lambda i: True):  # type: ignore[no-untyped-def]
    src = buf.tensor(0, (buf.nbytes,), torch.uint8)
    return [types.SimpleNamespace(name=f"t{i}", remote=types.SimpleNamespace(
        addr=buf.addr + off, nbytes=n,
        digest=digest.digest(src[off:off + n], algo) if digested(i) else None))
        for i, (off, n) in enumerate(spans)]


def _recorded_mapping(buf: HostBuffer) -> tuple[HostMapping, list[tuple[int, int]]]:
    """A mapping of ``buf`` whose ``read_into`` calls (the Python path's reads) are
    recorded as ``(offset, nbytes)``: the C loop reads without them."""
    mapping = HostMapping([Segment("memfd", buf.addr, buf.nbytes, -1)], [os.dup(buf.fd)])
    calls: list[tuple[int, int]] = []
    read = mapping.read_into

    def recording(seg: int, off: int, addr: int, nbytes: int) -> None:
        calls.append((off, nbytes))
        read(seg, off, addr, nbytes)

    mapping.read_into = recording  # type: ignore[method-assign]
    return mapping, calls


def _copies(mapping: HostMapping, pairs, dst, chunk: int):  # type: ignore[no-untyped-def]
    """The pull's host copies: one run per tensor, cut into chunks of ``chunk`` bytes."""
    runs = []
    for p in pairs:
        seg, off = mapping.locate(p.remote.addr, p.remote.nbytes)
        runs.append((seg, off, dst[p.name].data_ptr(), p.remote.nbytes))
    chunks: list[list[tuple[int, int, int, int]]] = [[]]
    filled = 0
    for seg, off, d, n in runs:
        pos = 0
        while pos < n:
            if filled >= chunk:
                chunks.append([])
                filled = 0
            take = min(n - pos, chunk - filled)
            chunks[-1].append((seg, off + pos, d + pos, take))
            pos += take
            filled += take
    return chunks


@pytest.mark.parametrize("native", [False, True], ids=["python-loop", "c-loop"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("algo", [digest.XXH3_BLOCKS, digest.XXH3_BLOCKS_1M, digest.XXH3,
                                  digest.BLAKE2B])
def test_digests_in_the_copy_pass_equal_the_digests_of_the_landed_bytes(seed, threads, algo,
                                                                         native):
    """Tensors split across chunks, one tensor outweighing the others (its pieces land
    on every thread, in any order, and are hashed in order), tiny and empty tensors, a
    tensor without a digest: every byte lands and every digest is checked. With 4 MiB
    chunks a block of ``xxh3-128-b8m`` is cut in two by a chunk end (its hasher is fed
    from two copies), and the 19 MiB tensor has three blocks, the last a short one (20
    of ``xxh3-128-b1m``, most cut by no chunk end).
    The C loop hashes each xxh3 range that lands whole in one copy itself, and leaves
    those a chunk end cuts to the Python hashers (blake2b: the Python loop runs)."""
    sizes = [3 << 20, 5, 0, 19 << 20 | 4097, 4097, 1 << 20, 77, 6 << 20]
    buf, spans = _source(sizes, seed)
    mapping = HostMapping([Segment("memfd", buf.addr, buf.nbytes, -1)], [os.dup(buf.fd)])
    try:
        pairs = _pairs(buf, spans, algo, digested=lambda i: i != 5)
        dst = {p.name: torch.full((p.remote.nbytes,), 7, dtype=torch.uint8) for p in pairs}
        check = digests_for(algo, pairs, dst, "test peer")
        assert isinstance(check, DigestsInPass)
        copier = HostCopier(mapping, threads=threads, native=native)
        for chunk in _copies(mapping, pairs, dst, chunk=4 << 20):
            copier.copy(chunk, check)
        copier.close()
        in_c = check.hashed_by_the_loop()
        if native and algo != digest.BLAKE2B:
            assert any(in_c) and not all(in_c)  # ranges cut by a chunk end: in Python
        else:
            assert not any(in_c)
        assert check.finish() == len(pairs) - 1
        src = buf.tensor(0, (buf.nbytes,), torch.uint8)
        for p, (off, n) in zip(pairs, spans):
            assert torch.equal(dst[p.name], src[off:off + n]), p.name
    finally:
        mapping.close()
        buf.close()


@pytest.mark.parametrize("algo", [digest.XXH3, digest.BLAKE2B])
def test_pieces_landing_out_of_order_on_several_threads_are_hashed_in_order(seed, algo):
    """A tensor's pieces land on 4 threads in a shuffled order (the last first): its
    hasher still sees its bytes in order, each once, and the digest is the tensor's."""
    import random
    import threading

    from modelexpress.local.hostcopy import _Stream
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (3 << 20 | 123,), dtype=torch.uint8, generator=g)
    n = data.numel()
    cuts = sorted({0, n, *random.Random(seed).sample(range(1, n), 40)})
    pieces = [(data.data_ptr() + a, b - a) for a, b in zip(cuts, cuts[1:])]
    order = list(reversed(pieces[:5])) + random.Random(seed + 1).sample(pieces[5:],
                                                                        len(pieces) - 5)
    stream = _Stream(data.data_ptr(), n, lambda: digest.hasher(algo))
    queue = iter(order)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                piece = next(queue, None)
            if piece is None:
                return
            stream.landed(*piece)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert stream.fed == n
    assert digest.stream_digest(stream.h, stream.fed) == digest.digest(data, algo)


@pytest.mark.parametrize("algo", [digest.XXH3_BLOCKS, digest.XXH3_BLOCKS_1M, digest.XXH3])
def test_a_wrong_digest_is_named_after_a_copy_with_digests_in_the_pass(seed, algo):
    buf, spans = _source([2 << 20, 3 << 20], seed)
    mapping = HostMapping([Segment("memfd", buf.addr, buf.nbytes, -1)], [os.dup(buf.fd)])
    try:
        pairs = _pairs(buf, spans, algo)
        pairs[1].remote.digest = "0" * 32 + f":{3 << 20}"
        dst = {p.name: torch.empty(p.remote.nbytes, dtype=torch.uint8) for p in pairs}
        check = digests_for(algo, pairs, dst, "test peer")
        copier = HostCopier(mapping, threads=2)
        for chunk in _copies(mapping, pairs, dst, chunk=1 << 30):
            copier.copy(chunk, check)
        copier.close()
        with pytest.raises(IntegrityError, match="1 tensor.*test peer.*'t1'"):
            check.finish()
    finally:
        mapping.close()
        buf.close()


def test_wsum_digests_of_a_host_copy_run_alongside_it(seed):
    """wsum-i32-v1 (a GPU source's digests) has no streaming form: each tensor is
    digested once it has landed, on the digest threads."""
    buf, spans = _source([1 << 20, 4099, 2 << 20], seed)
    mapping = HostMapping([Segment("memfd", buf.addr, buf.nbytes, -1)], [os.dup(buf.fd)])
    try:
        pairs = _pairs(buf, spans, digest.WSUM)
        dst = {p.name: torch.empty(p.remote.nbytes, dtype=torch.uint8) for p in pairs}
        check = digests_for(digest.WSUM, pairs, dst, "test peer")
        assert isinstance(check, DigestsAlongside)
        copier = HostCopier(mapping, threads=2)
        done = 0
        for chunk in _copies(mapping, pairs, dst, chunk=1 << 20):
            copier.copy(chunk)
            done += sum(c[3] for c in chunk)
            check.landed(done)
        copier.close()
        assert check.finish() == len(pairs)
    finally:
        mapping.close()
        buf.close()


def _copy_threads() -> list[int]:
    import threading
    return sorted(t.ident for t in threading.enumerate() if t.name.startswith("mx-worker"))


def test_a_copy_into_new_memory_too_small_for_its_threads_is_cut_into_finer_pieces():
    """Fine pieces (into new memory, or in the C loop): 8 MiB while every thread gets
    about four; finer (down to 1 MiB) when not: 70 MB on 16 threads in 1 MiB pieces, on 2
    threads in 8 MiB; 1 GiB in 8 MiB. Else (the Python loop into touched memory) always
    8 MiB."""
    from modelexpress.local.hostcopy import _piece_bytes
    mib = 1 << 20
    assert _piece_bytes(70_483_200, 16, fine=True) == mib
    assert _piece_bytes(70_483_200, 2, fine=True) == 8 * mib
    assert _piece_bytes(300 * mib, 16, fine=True) == 4 * mib
    assert _piece_bytes(1 << 30, 16, fine=True) == 8 * mib
    assert _piece_bytes(3 * mib, 3, fine=True) == mib  # never under the floor
    assert _piece_bytes(70_483_200, 16, fine=False) == 8 * mib
    assert _piece_bytes(3 * mib, 3, fine=False) == 8 * mib


def test_the_copier_cuts_finer_pieces_only_into_new_memory(seed):
    """The copier asks the kernel whether the destination was touched (``mincore``):
    a 24 MiB copy on 8 threads goes in 1 MiB pieces into a new allocation and in
    8 MiB pieces into the same memory once written; the bytes land either way. (The
    pieces are cut before either loop runs them: the Python loop's reads are counted.)"""
    import mmap
    n = 24 << 20
    buf, _ = _source([n], seed)
    mapping = HostMapping([Segment("memfd", buf.addr, buf.nbytes, -1)], [os.dup(buf.fd)])
    # A new anonymous mapping: no page of it is resident until written.
    area = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dst = torch.frombuffer(area, dtype=torch.uint8)
    sizes: list[int] = []
    read = mapping.read_into

    def recording(seg: int, off: int, addr: int, nbytes: int) -> None:
        sizes.append(nbytes)
        read(seg, off, addr, nbytes)

    mapping.read_into = recording  # type: ignore[method-assign]
    try:
        copier = HostCopier(mapping, threads=8, native=False)
        copier.copy([(0, 0, dst.data_ptr(), n)])
        assert set(sizes) == {1 << 20} and len(sizes) == 24
        assert torch.equal(dst, buf.tensor(0, (n,), torch.uint8))
        sizes.clear()
        copier.copy([(0, 0, dst.data_ptr(), n)])
        assert sizes == [8 << 20] * 3
    finally:
        del dst
        area.close()
        mapping.close()
        buf.close()


def test_copy_threads_are_the_processes_and_a_failed_lane_waits_for_the_others(seed):
    """The calling thread copies pieces itself and the process's copy threads the
    others, kept from one copy to the next; a piece that fails raises only after every
    other piece has landed."""
    from modelexpress.errors import BackendError
    buf, spans = _source([6 << 20], seed)
    mapping = HostMapping([Segment("memfd", buf.addr, buf.nbytes, -1)], [os.dup(buf.fd)])
    try:
        dst = torch.zeros(6 << 20, dtype=torch.uint8)
        copier = HostCopier(mapping, threads=3, native=False)
        thirds = [(0, a, dst.data_ptr() + a, 2 << 20) for a in (0, 2 << 20, 4 << 20)]
        copier.copy(thirds)  # three pieces: the caller and two copy threads
        first = _copy_threads()
        # the process's pool: started by this copy or by an earlier one in this process
        # (on a many-core machine, an earlier copy of 16 threads may have started 15)
        assert 1 <= len(first) <= _threads.MAX_THREADS - 1  # the caller copies too
        copier.copy(thirds)
        # kept, not started anew (the pool may still add one: it starts a thread
        # whenever it counts none idle, and a copy whose first helper took every piece
        # left the second unstarted)
        again = _copy_threads()
        assert set(first) <= set(again) and len(again) <= _threads.MAX_THREADS - 1
        assert torch.equal(dst, buf.tensor(0, (6 << 20,), torch.uint8))
        dst.zero_()
        # The first piece reads into an address that is not mapped; the other one lands
        # its bytes all the same.
        bad = [(0, 0, 4096, 2 << 20), (0, 2 << 20, dst.data_ptr() + (2 << 20), 4 << 20)]
        with pytest.raises(BackendError, match="failed"):
            copier.copy(bad)
        assert torch.equal(dst[2 << 20:], buf.tensor(0, (6 << 20,), torch.uint8)[2 << 20:])
        copier.close()
    finally:
        mapping.close()
        buf.close()


@pytest.mark.parametrize("native", [False, True], ids=["python-loop", "c-loop"])
def test_rows_land_as_their_runs_and_a_hashed_range_among_them_is_still_hashed(seed, native):
    """The rows of a column slice, given as :class:`Rows`: every row lands where its run
    would (strided in the source and in the destination), beside plain runs. In the C
    loop they are its pieces with no ``read_into`` call; rows longer than a piece, and
    rows into a range the pass hashes (here a "tensor" of one row, with a digest), are
    cut as runs of their own, so that range is hashed and checked like any other."""
    import numpy as np

    from modelexpress.local.hostcopy import Rows

    buf, _ = _source([8 << 20], seed)
    mapping, calls = _recorded_mapping(buf)
    try:
        src = buf.tensor(0, (8 << 20,), torch.uint8)
        n_rows, run, s_pitch, d_pitch = 700, 1000, 3000, 2500
        dst = torch.zeros(n_rows * d_pitch + (2 << 20), dtype=torch.uint8)
        base = dst.data_ptr()
        rows = Rows(0, np.arange(n_rows, dtype=np.int64) * s_pitch + 17,
                    base + np.arange(n_rows, dtype=np.int64) * d_pitch, run)
        plain_at = n_rows * d_pitch
        copier = HostCopier(mapping, threads=2, native=native)
        copier.copy([(0, 5 << 20, base + plain_at, 1 << 20)], rows=[rows])
        for i in (0, 1, n_rows // 2, n_rows - 1):
            got = dst[i * d_pitch:i * d_pitch + run]
            assert torch.equal(got, src[i * s_pitch + 17:i * s_pitch + 17 + run]), i
            assert not dst[i * d_pitch + run:(i + 1) * d_pitch].any(), i  # between rows: untouched
        assert torch.equal(dst[plain_at:plain_at + (1 << 20)], src[5 << 20:6 << 20])
        assert (calls == []) == native, calls  # the C loop read them itself

        # rows 1.5 MiB long, each more than one piece of the C loop (1 MiB at least)
        dst.zero_()
        long_rows = Rows(0, np.array([0, 3 << 20], dtype=np.int64),
                         base + np.array([0, 2 << 20], dtype=np.int64), 3 << 19)
        copier.copy([], rows=[long_rows])
        assert torch.equal(dst[:3 << 19], src[:3 << 19])
        assert torch.equal(dst[2 << 20:(2 << 20) + (3 << 19)], src[3 << 20:(3 << 20) + (3 << 19)])

        # a range the pass hashes among the rows (row 10's destination): its bytes are
        # fed to its hasher, and checked
        dst.zero_()
        at = 10 * d_pitch
        want = src[10 * s_pitch + 17:10 * s_pitch + 17 + run]
        pair = types.SimpleNamespace(name="t", remote=types.SimpleNamespace(
            addr=0, nbytes=run, digest=digest.digest(want, digest.XXH3)))
        check = DigestsInPass(digest.XXH3, [pair], {"t": dst[at:at + run]}, "test peer")
        copier.copy([], check, rows=[rows])
        assert check.finish() == 1
        assert torch.equal(dst[at:at + run], want)
        copier.close()
    finally:
        mapping.close()
        buf.close()


def test_the_c_loop_reads_every_piece_without_python_and_a_failed_piece_raises_last(seed):
    """The C loop reads the pieces itself (no ``read_into`` call); a piece into an
    address that is not mapped is left to the Python path, which raises, after every
    other piece has landed."""
    from modelexpress.errors import BackendError
    buf, _ = _source([6 << 20], seed)
    mapping, calls = _recorded_mapping(buf)
    try:
        dst = torch.zeros(6 << 20, dtype=torch.uint8)
        want = buf.tensor(0, (6 << 20,), torch.uint8)
        copier = HostCopier(mapping, threads=3, native=True)
        copier.copy([(0, a, dst.data_ptr() + a, 2 << 20) for a in (0, 2 << 20, 4 << 20)])
        assert calls == [] and torch.equal(dst, want)
        dst.zero_()
        bad = [(0, 0, 4096, 2 << 20), (0, 2 << 20, dst.data_ptr() + (2 << 20), 4 << 20)]
        with pytest.raises(BackendError, match="failed"):
            copier.copy(bad)
        # only the failed pieces (the C loop cut the copy in 1 MiB), again, in Python
        assert sorted(calls) == [(0, 1 << 20), (1 << 20, 1 << 20)]
        assert torch.equal(dst[2 << 20:], want[2 << 20:])
    finally:
        mapping.close()
        buf.close()


@pytest.mark.parametrize("pages", ["small", "advised", "thp-always"])
def test_the_c_loop_populates_new_small_pages_before_a_page_cache_read_not_huge_ones(
        seed, pages, tmp_path, monkeypatch):
    """A copy read from a file's page cache into new memory: the C loop is told to
    populate each new destination piece first (FILE | PREFAULT) where those pages are
    small, and to let the read fault them in (FILE) where they fault in huge (advised
    ``MADV_HUGEPAGE`` for this chunk, or THP ``always``); every byte lands either way."""
    import mmap

    from modelexpress.local import hostcopy, hugepages
    if pages == "advised" and hugepages.thp_mode() != "madvise":
        pytest.skip(f"THP is {hugepages.thp_mode()!r} here: MADV_HUGEPAGE is asked for "
                    "only under madvise (CI's kernel has madvise)")
    n = 12 << 20
    buf, _ = _source([n], seed)
    want = buf.tensor(0, (n,), torch.uint8)
    path = tmp_path / "ckpt"
    path.write_bytes(want.numpy().tobytes())
    os.pread(fd := os.open(path, os.O_RDONLY), n, 0)  # in the page cache
    mapping = HostMapping([Segment("memfd", buf.addr, n, -1)], [os.dup(buf.fd)],
                          files=[(Segment("file", buf.addr, n, -1, offset=0), fd)])
    seen: list[int] = []
    real = hostcopy._copyloop

    class Spy:
        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return getattr(real, name)

        def run(self, pieces, *rest):  # type: ignore[no-untyped-def]
            seen.extend(pieces[4::6])
            return real.run(pieces, *rest)

    monkeypatch.setattr(hostcopy, "_copyloop", Spy())
    monkeypatch.setattr(hugepages, "MIN_BYTES", 4 << 20)
    huge = {"small": hugepages.HugePages("off", kernel_mode="madvise"),
            "advised": hugepages.HugePages("on", kernel_mode="madvise"),
            "thp-always": hugepages.HugePages("off", kernel_mode="always")}[pages]
    new = mmap.mmap(-1, n + (2 << 20), flags=mmap.MAP_PRIVATE)  # nothing touched it
    try:
        dst = torch.frombuffer(new, dtype=torch.uint8, count=n)
        seg, off = mapping.locate(buf.addr, n)
        assert mapping.from_file(seg)
        HostCopier(mapping, threads=3, native=True, huge_pages=huge).copy(
            [(seg, off, dst.data_ptr(), n)])
        assert torch.equal(dst, want) and mapping.file_bytes == n
        flags = set(seen)
        if pages == "small":
            assert flags == {hostcopy._FILE | hostcopy._PREFAULT}
        else:
            assert flags == {hostcopy._FILE}
            assert huge.used is (pages == "advised")
        del dst
    finally:
        new.close()
        mapping.close()
        buf.close()


def test_the_c_loop_digest_is_the_xxhash_packages():
    """The C loop hashes through the xxhash package's own XXH3_128bits, checked once
    against ``xxhash.xxh3_128`` (a build that disagreed would leave hashing to Python)."""
    import ctypes

    import xxhash

    from modelexpress.local import hostcopy
    addr = hostcopy._xxh3_address()
    assert addr
    fn = ctypes.CFUNCTYPE(hostcopy._XXH128, ctypes.c_char_p, ctypes.c_size_t)(addr)
    for data in (b"", b"x", bytes(range(256)) * 4099):
        got = fn(data, len(data))
        want = xxhash.xxh3_128(data).digest()
        assert got.high64.to_bytes(8, "big") + got.low64.to_bytes(8, "big") == want


def test_the_c_loop_refuses_buffers_of_the_wrong_shape_naming_the_argument():
    """``_copyloop.run`` checks every buffer before it reads anything: a piece list
    that is not whole 6-word pieces, a result array sized for another number of
    pieces or streams, a stream index out of range each raise ValueError naming it."""
    import array
    import ctypes

    from modelexpress.local import _copyloop
    src = bytearray(b"abcdefgh")
    dst = bytearray(8)

    def run(pieces, streams=(), left=None, done=None, err=None, digests=None, hashed=None):  # type: ignore[no-untyped-def]
        np_, ns = len(pieces) // 6, len(streams) // 2
        q = lambda n: array.array("q", [0] * n)  # noqa: E731
        _copyloop.run(array.array("q", pieces), array.array("q", streams),
                      q(ns) if left is None else left, q(np_) if done is None else done,
                      q(np_) if err is None else err,
                      bytearray(16 * ns) if digests is None else digests,
                      bytearray(ns) if hashed is None else hashed, 1, 0)

    fd = os.memfd_create("copyloop-args")
    try:
        os.write(fd, src)
        addr = ctypes.addressof((ctypes.c_char * 8).from_buffer(dst))
        ok = [fd, 0, addr, 8, 0, -1]
        run(ok)
        assert dst == src  # the well-formed call reads
        with pytest.raises(ValueError, match="pieces: 40 bytes, not whole 48-byte items"):
            run(ok[:5])
        with pytest.raises(ValueError, match="done: 16 bytes, expected 1 items of 8 bytes"):
            run(ok, done=array.array("q", [0, 0]))
        with pytest.raises(ValueError, match="digests: 0 bytes, expected 1 items of 16"):
            run(ok[:5] + [0], streams=[addr, 8], digests=bytearray(0))
        with pytest.raises(ValueError, match="piece 0: stream 1 of 1"):
            run(ok[:5] + [1], streams=[addr, 8])
        with pytest.raises(ValueError, match="no xxh3 function"):
            run(ok[:5] + [0], streams=[addr, 8])
        with pytest.raises(BufferError):  # a read-only result buffer
            run(ok, err=bytes(8))
    finally:
        os.close(fd)


def _run_c_loop(pieces, streams, threads, stream_fns,  # type: ignore[no-untyped-def]
                interleave=True):
    """``_copyloop.run`` on plain lists; (done, err, digests, hashed)."""
    import array

    from modelexpress.local import _copyloop, hostcopy
    np_, ns = len(pieces) // 6, len(streams) // 2
    left = array.array("q", [0] * ns)
    for k in range(np_):
        if pieces[6 * k + 5] >= 0:
            left[pieces[6 * k + 5]] += 1
    done, err = array.array("q", [0] * np_), array.array("q", [0] * np_)
    digests, hashed = bytearray(16 * ns), bytearray(ns)
    extra = (stream_fns, interleave) if stream_fns is not None else ()
    summary = _copyloop.run(array.array("q", pieces), array.array("q", streams), left, done,
                            err, digests, hashed, threads, hostcopy._xxh3_address(), *extra)
    # what it says is left to do: the pieces left short; bytes and misses of file pieces
    short = [k for k in range(np_) if done[k] < pieces[6 * k + 3]]
    files = [k for k in range(np_) if pieces[6 * k + 4] & hostcopy._FILE]
    assert summary == (len(short), sum(done[k] for k in files),
                       sum(1 for k in files if k in short and not err[k]))
    return done, err, digests, hashed


@pytest.mark.parametrize("fed,interleave", [(True, True), (True, False), (False, False)],
                         ids=["fed-taken-by-rank", "fed-taken-in-address-order",
                              "hashed-whole"])
def test_the_c_loop_digests_every_range_from_pieces_landing_on_many_threads(seed, fed,
                                                                           interleave):
    """Ranges cut into many small pieces (4 KiB up to 300 KiB, odd sizes) read on 8
    threads: with the stream functions each range is fed in address order as its pieces
    land on any thread (the pieces taken by their rank in their range, the default, or
    in address order), without them hashed whole at its end; either way every range's
    digest is the xxhash package's of its bytes, over rounds that race differently. A
    range with a piece that is not read here (fd -1: a page-cache miss, say) gets no
    digest (hashed 0: the caller hashes it), and the others are not held up by it."""
    import random

    import xxhash

    from modelexpress.local import hostcopy
    fns = hostcopy._xxh3_stream_functions()
    assert fns is not None  # the xxhash package the project depends on exports them
    rng = random.Random(seed)
    sizes = [5, 3 << 20 | 4097, 300 << 10, 1, 2 << 20]
    total = sum(sizes)
    fd = os.memfd_create("copyloop-feed")
    try:
        src = torch.randint(0, 256, (total,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed))
        os.write(fd, bytes(src.numpy()))
        for round_ in range(5):
            dst = torch.zeros(total, dtype=torch.uint8)
            base = dst.data_ptr()
            pieces, streams, off = [], [], 0
            for s, n in enumerate(sizes):
                streams += [base + off, n]
                pos = 0
                while pos < n:
                    take = min(n - pos, rng.choice([4096, 5000, 65536, 300 << 10]))
                    gone = round_ == 4 and s == 1 and pos > 0 and not any(
                        p == -1 for p in pieces[0::6])  # one piece of range 1 not read
                    pieces += [-1 if gone else fd, off + pos, base + off + pos, take, 0, s]
                    pos += take
                off += n
            done, err, digests, hashed = _run_c_loop(pieces, streams, 8,
                                                     fns if fed else None, interleave)
            off = 0
            for s, n in enumerate(sizes):
                want = xxhash.xxh3_128(bytes(src[off:off + n].numpy())).digest()
                if round_ == 4 and s == 1:
                    assert hashed[s] == 0  # its unread piece: left to the caller
                else:
                    assert hashed[s] == 1 and bytes(digests[16 * s:16 * s + 16]) == want, \
                        (round_, s)
                    assert torch.equal(dst[off:off + n], src[off:off + n])
                off += n
            assert not any(err)
    finally:
        os.close(fd)


def test_the_c_loop_refuses_pieces_that_do_not_cover_their_range_in_order():
    """Fed in order, a range's pieces must be consecutive and cover it byte after byte
    (what the copier cuts); anything else is refused before a byte is read."""
    from modelexpress.local import hostcopy
    fns = hostcopy._xxh3_stream_functions()
    fd = os.memfd_create("copyloop-order")
    try:
        os.write(fd, bytes(64))
        dst = torch.zeros(64, dtype=torch.uint8)
        a = dst.data_ptr()
        with pytest.raises(ValueError, match="piece 2: stream 0's pieces are not consecutive"):
            _run_c_loop([fd, 0, a, 16, 0, 0, fd, 16, a + 16, 16, 0, -1,
                         fd, 32, a + 32, 32, 0, 0], [a, 64, a + 64, 0], 2, fns)
        with pytest.raises(ValueError, match="piece 1: not the next bytes of stream 0"):
            _run_c_loop([fd, 0, a, 16, 0, 0, fd, 32, a + 32, 32, 0, 0], [a, 64], 2, fns)
        with pytest.raises(ValueError, match="stream 0: its pieces do not cover it"):
            _run_c_loop([fd, 0, a, 16, 0, 0], [a, 64], 2, fns)
        assert not any(dst)
    finally:
        os.close(fd)


def test_two_c_loop_copies_at_once_each_land_every_byte(seed):
    """Two copies at once in one process (two pulls): one has the kept helper threads,
    the other starts threads of its own; both land every byte and every digest."""
    import threading

    import xxhash

    from modelexpress.local import hostcopy
    fns = hostcopy._xxh3_stream_functions()
    n = 8 << 20
    fd = os.memfd_create("copyloop-two")
    try:
        src = torch.randint(0, 256, (n,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed))
        os.write(fd, bytes(src.numpy()))
        want = xxhash.xxh3_128(bytes(src.numpy())).digest()
        failures: list[str] = []

        def copy_rounds() -> None:
            for _ in range(20):
                dst = torch.zeros(n, dtype=torch.uint8)
                pieces = []
                for a in range(0, n, 256 << 10):
                    pieces += [fd, a, dst.data_ptr() + a, 256 << 10, 0, 0]
                _, _, digests, hashed = _run_c_loop(pieces, [dst.data_ptr(), n], 4, fns)
                if not (hashed[0] and bytes(digests) == want and torch.equal(dst, src)):
                    failures.append("a copy landed wrong bytes or digest")

        threads = [threading.Thread(target=copy_rounds) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert failures == []
    finally:
        os.close(fd)


def test_the_c_loop_keeps_its_helper_threads_with_signals_blocked():
    """A process's C-loop copies on 4 threads start 3 helpers once and reuse them (no
    thread more after further copies), and the helpers block every signal, so that
    SIGINT or SIGTERM for the process reaches the main thread (the process here runs
    no torch: its OpenMP threads would be counted too)."""
    import subprocess
    import sys
    code = r"""
import array, ctypes, os
from modelexpress.local import _copyloop
def tasks():
    return sorted(int(t) for t in os.listdir("/proc/self/task"))
fd = os.memfd_create("copyloop-pool")
os.write(fd, bytes(range(256)) * 4096)
out = ctypes.create_string_buffer(1 << 20)
def copy():
    pieces = []
    for a in range(0, 1 << 20, 64 << 10):
        pieces += [fd, a, ctypes.addressof(out) + a, 64 << 10, 0, -1]
    q = lambda n: array.array("q", [0] * n)
    _copyloop.run(array.array("q", pieces), array.array("q"), q(0), q(16), q(16),
                  bytearray(0), bytearray(0), 4, 0)
    assert out.raw == bytes(range(256)) * 4096
before = tasks()
copy()
after = tasks()
for _ in range(20):
    copy()
assert tasks() == after, (after, tasks())
helpers = [t for t in after if t not in before]
assert len(helpers) == 3, (before, after)
for t in helpers:
    blk = int([l for l in open(f"/proc/self/task/{t}/status") if l.startswith("SigBlk")][0].split()[1], 16)
    assert blk & (1 << 1) and blk & (1 << 14), hex(blk)  # SIGINT (2), SIGTERM (15)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_c_loop_lets_go_of_helpers_with_nothing_left_and_keeps_them():
    """Copies too small for their threads (1 or 2 pieces on 8 threads, 400 times), and
    copies with pieces for every thread among them: the helpers that wake after the
    last piece was taken are let go (the call does not wait for them), and come back for
    the next copy. Every copy lands every byte, no copy waits past the subprocess's
    bound, and the pool keeps its 7 helpers (none started again)."""
    import subprocess
    import sys
    code = r"""
import array, ctypes, os
from modelexpress.local import _copyloop
fd = os.memfd_create("copyloop-letgo")
data = bytes(range(256)) * 1024  # 256 KiB
os.write(fd, data)
out = ctypes.create_string_buffer(len(data))
q = lambda n: array.array("q", [0] * n)
def copy(piece):
    ctypes.memset(out, 0, len(data))
    pieces = []
    for a in range(0, len(data), piece):
        pieces += [fd, a, ctypes.addressof(out) + a, piece, 0, -1]
    n = len(pieces) // 6
    done = q(n)
    assert _copyloop.run(array.array("q", pieces), array.array("q"), q(0), done, q(n),
                         bytearray(0), bytearray(0), 8, 0) == (0, 0, 0)
    assert out.raw == data and all(d == piece for d in done)
copy(len(data) // 8)
tasks = sorted(os.listdir("/proc/self/task"))
for i in range(400):
    copy(len(data) // (1 + i % 2))
    if i % 50 == 0:
        copy(len(data) // 64)
assert sorted(os.listdir("/proc/self/task")) == tasks
print("ok", len(tasks))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["ok", "8"], (r.stdout, r.stderr)


def test_the_c_loop_digests_only_the_ranges_with_pieces_in_the_call(seed):
    """A call is handed every range of a pull, and pieces of some of them only (one
    chunk of several): the ranges with pieces get their digests (fed in order, and
    hashed whole at their end), the others none (hashed 0), with the pieces' ranges
    first, last or in the middle."""
    import xxhash

    from modelexpress.local import hostcopy
    sizes = [3 << 20, 1 << 20, 4097, 2 << 20]
    total = sum(sizes)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    fd = os.memfd_create("copyloop-some")
    try:
        os.write(fd, bytes(src.numpy()))
        for fns in (hostcopy._xxh3_stream_functions(), None):
            for here in ({1, 2}, {0, 3}, {2}):
                dst = torch.zeros(total, dtype=torch.uint8)
                base = dst.data_ptr()
                pieces, streams, off = [], [], 0
                for r, n in enumerate(sizes):
                    streams += [base + off, n]
                    if r in here:
                        for a in range(0, n, 256 << 10):
                            pieces += [fd, off + a, base + off + a, min(256 << 10, n - a), 0, r]
                    off += n
                _, _, digests, hashed = _run_c_loop(pieces, streams, 4, fns)
                off = 0
                for r, n in enumerate(sizes):
                    if r in here:
                        want = xxhash.xxh3_128(bytes(src[off:off + n].numpy())).digest()
                        assert hashed[r] == 1 and bytes(digests[16 * r:16 * r + 16]) == want
                    else:
                        assert hashed[r] == 0 and not dst[off:off + n].any()
                    off += n
    finally:
        os.close(fd)


@pytest.mark.parametrize("native", [False, True], ids=["python-loop", "c-loop"])
def test_a_forked_child_copies_on_copy_threads_of_its_own(seed, native):
    """A process that forks after a parallel copy (an engine forking its workers): the
    parent's copy threads (the process's Python workers, or the C loop's kept helpers)
    do not exist in the child, which starts its own and lands every byte."""
    import ctypes
    import time
    buf, spans = _source([4 << 20], seed)
    mapping = HostMapping([Segment("memfd", buf.addr, buf.nbytes, -1)], [os.dup(buf.fd)])
    try:
        landed = torch.empty(4 << 20, dtype=torch.uint8)
        quarters = [(0, a, landed.data_ptr() + a, 1 << 20) for a in range(0, 4 << 20, 1 << 20)]
        HostCopier(mapping, threads=4, native=native).copy(quarters)  # threads take some
        if not native:
            assert _copy_threads()
        want = bytes(buf.tensor(0, (4 << 20,), torch.uint8).numpy())
        assert bytes(landed.numpy()) == want
        pid = os.fork()
        if pid == 0:  # no torch in the child: only reads into a ctypes buffer
            code = 1
            try:
                out = (ctypes.c_ubyte * (4 << 20))()
                HostCopier(mapping, threads=4, native=native).copy(
                    [(0, a, ctypes.addressof(out) + a, 1 << 20) for a in range(0, 4 << 20, 1 << 20)])
                code = 0 if bytes(out) == want else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child's copy did not finish in 30 s")
            time.sleep(0.02)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        mapping.close()
        buf.close()


def test_read_into_refuses_a_range_outside_its_segment_and_after_close():
    from modelexpress.errors import ConfigError
    buf = HostBuffer(4096)
    mapping = HostMapping([Segment("memfd", buf.addr, buf.nbytes, -1)], [os.dup(buf.fd)])
    out = torch.empty(8192, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="outside a shared segment of 4096 bytes"):
        mapping.read_into(0, 4000, out.data_ptr(), 100)
    mapping.close()
    with pytest.raises(ConfigError, match="after close"):
        mapping.read_into(0, 0, out.data_ptr(), 10)
    buf.close()


@pytest.mark.parametrize("algo", [digest.BLAKE2B, digest.WSUM, digest.XXH3, digest.XXH3_BLOCKS])
def test_a_pull_verifies_each_digest_algorithm_a_source_may_publish(make_source, algo):
    """Over the socket from a source process: blake2b, plain xxh3 and xxh3-128-b8m (the
    default of a model of 512 MiB or more; hashed in the pass) and wsum (alongside) as
    well as the default of these small sources, xxh3-128-b1m (the other tests)."""
    src = make_source(mib=8, digest_algorithm=algo)
    endpoint = LocalEndpoint.from_json(src.info["endpoint"])
    manifest = Manifest.from_json(src.info["manifest"])
    assert manifest.digest_algorithm == algo
    dst = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for t in manifest.tensors}
    res = pull(endpoint, manifest, dst, chunk_bytes=3 << 20)
    assert res.verified == len(manifest.tensors)
    want = make_tensors(src.seed, src.mib)
    assert all(torch.equal(want[k].view(torch.uint8), dst[k].view(torch.uint8)) for k in want)
    bad_name = manifest.tensors[-1].name
    bad = Manifest.from_json(manifest.to_json().replace(
        manifest.tensors[-1].digest, "0" * 32 + f":{manifest.tensors[-1].nbytes}"))
    with pytest.raises(IntegrityError, match=bad_name.replace(".", r"\.")):
        pull(endpoint, bad, dst)
