"""Where a 70 MB copy into new memory goes: torch's copy against the C loop's reads of a
file's page cache, into new (anonymous, never touched) and into touched memory, in
pieces as the pull cuts them (1 MiB, taken in address order by a shared counter) and in
one slice per thread. Per round each variant runs once, into a fresh mapping where
"new"; medians of ROUNDS rounds. Run from the repository root (C extension built):
    PYTHONPATH=. python docs/cpu-logs/2026-12-05-s22/probe_fresh_faults.py [MB] [ROUNDS]
"""
import array, ctypes, mmap, os, statistics, sys, tempfile, time

import torch

from modelexpress.local import _copyloop
from modelexpress.local.hostcopy import _FILE, copy_threads

mb = int(sys.argv[1]) if len(sys.argv) > 1 else 70
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
size = mb << 20
threads = copy_threads()


def fresh():
    # NB (session 23): mmap(-1, n) is MAP_SHARED, so these are shmem pages, not the private
    # anonymous memory a pull writes into; see docs/gpu-logs/2026-12-05-s23/probe_fresh_private.py
    m = mmap.mmap(-1, size)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def c_loop(fd, dst, piece):
    p = array.array("q")
    for a in range(0, size, piece):
        p.extend([fd, a, dst + a, min(piece, size - a), _FILE, -1])
    n = len(p) // 6
    q = lambda k: array.array("q", bytes(8 * k))  # noqa: E731
    done = q(n)
    t0 = time.perf_counter()
    short, _, _ = _copyloop.run(p, array.array("q"), q(0), done, q(n), bytearray(0),
                                bytearray(0), threads, 0)
    took = time.perf_counter() - t0
    assert short == 0, "the page cache did not hold the file"
    return took


with tempfile.TemporaryDirectory(dir=os.environ.get("PROBE_DIR", os.getcwd())) as tmp:
    path = os.path.join(tmp, "data")
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    os.pread(fd, size, 0)  # in the page cache
    src = torch.frombuffer(bytearray(os.pread(fd, size, 0)), dtype=torch.uint8)
    touched_map, touched = fresh()
    ctypes.memset(touched, 1, size)
    touched_t = torch.frombuffer(touched_map, dtype=torch.uint8)
    rows = {k: [] for k in ("torch copy, touched", "torch copy, new",
                            "C loop 1 MiB pieces, touched", "C loop 1 MiB pieces, new",
                            "C loop a slice per thread, touched",
                            "C loop a slice per thread, new")}
    slice_ = -(-size // threads)
    for _ in range(rounds):
        t0 = time.perf_counter(); touched_t.copy_(src)
        rows["torch copy, touched"].append(time.perf_counter() - t0)
        m, addr = fresh()
        t = torch.frombuffer(m, dtype=torch.uint8)
        t0 = time.perf_counter(); t.copy_(src)
        rows["torch copy, new"].append(time.perf_counter() - t0)
        del t; m.close()
        for name, piece in (("1 MiB pieces", 1 << 20), ("a slice per thread", slice_)):
            rows[f"C loop {name}, touched"].append(c_loop(fd, touched, piece))
            m, addr = fresh()
            rows[f"C loop {name}, new"].append(c_loop(fd, addr, piece))
            m.close()
    os.close(fd)
    print(f"{mb} MiB, {threads} threads (torch: {torch.get_num_threads()}), {rounds} rounds, "
          f"load {os.getloadavg()[0]:.2f}")
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    for k, v in med.items():
        print(f"  {k:38s} {v:7.2f} ms")
    for how in ("torch copy", "C loop 1 MiB pieces", "C loop a slice per thread"):
        print(f"  new - touched, {how:26s} {med[how + ', new'] - med[how + ', touched']:7.2f} ms")
