"""Where a 70 MB copy into new memory goes, in private anonymous memory (what
torch.empty, and so the pull's `allocate_like` slab, gets from malloc). Session 22's
probe (docs/cpu-logs/2026-12-05-s22/probe_fresh_faults.py) used `mmap.mmap(-1, n)`,
which is MAP_SHARED: shmem pages, whose faults cost several times an anonymous
page's, so its "new" rows measured shmem, not what the pull writes into.

Copies of a file's page cache (or, for torch, of a touched tensor) into new and into
touched memory; per round each variant once, medians of ROUNDS rounds:
  torch copy              tensor.copy_ (torch's threads, a slice each)
  C loop, address order   1 MiB pieces taken in address order by a shared counter
  C loop, by rank         1 MiB pieces of 33 equal ranges taken by rank in their range
                          (the first piece of every range, then the second, ...): the
                          order a pull's C loop takes them (`interleave`)
  C loop, prefault        address order, each piece populated first (PREFAULT:
                          MADV_POPULATE_WRITE where mincore says the page is new)
  C loop, slice/thread    one slice per thread
Memory: "private" (mmap MAP_PRIVATE|MAP_ANONYMOUS), "torch" (torch.empty, as the pull's
slab), "shared" (mmap MAP_SHARED|MAP_ANONYMOUS, as session 22's probe).
Run from the repository root (C extension built):
    PYTHONPATH=. python docs/gpu-logs/2026-12-05-s23/probe_fresh_private.py [MB] [ROUNDS]
"""
import array, ctypes, mmap, os, platform, statistics, sys, tempfile, time

import torch

from modelexpress.local import _copyloop
from modelexpress.local.hostcopy import _FILE, _PREFAULT, copy_threads

mb = int(sys.argv[1]) if len(sys.argv) > 1 else 70
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
size = mb << 20
threads = copy_threads()
PIECE = 1 << 20
RANGES = 33


def new_memory(kind):
    """(keep-alive object, address) of `size` new bytes of the given kind."""
    if kind == "torch":
        t = torch.empty(size, dtype=torch.uint8)
        return t, t.data_ptr()
    flags = mmap.MAP_PRIVATE if kind == "private" else mmap.MAP_SHARED
    m = mmap.mmap(-1, size, flags=flags)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def release(obj):
    if isinstance(obj, mmap.mmap):
        obj.close()


def order(how):
    """(offset, nbytes) of each piece, in the order the loop takes them."""
    if how == "slice":
        s = -(-size // threads)
        return [(a, min(s, size - a)) for a in range(0, size, s)]
    if how != "rank":
        return [(a, min(PIECE, size - a)) for a in range(0, size, PIECE)]
    r = -(-size // RANGES)
    ranges = [[(a, min(PIECE, min(b + r, size) - a)) for a in range(b, min(b + r, size), PIECE)]
              for b in range(0, size, r)]
    out = []
    for k in range(max(len(x) for x in ranges)):
        out += [x[k] for x in ranges if k < len(x)]
    return out


def c_loop(fd, dst, how, flag):
    p = array.array("q")
    for a, n in order(how):
        p.extend([fd, a, dst + a, n, flag, -1])
    n = len(p) // 6
    q = lambda k: array.array("q", bytes(8 * k))  # noqa: E731
    t0 = time.perf_counter()
    short, _, _ = _copyloop.run(p, array.array("q"), q(0), q(n), q(n), bytearray(0),
                                bytearray(0), threads, 0)
    took = time.perf_counter() - t0
    assert short == 0, "the page cache did not hold the file"
    return took


LOOPS = {"C loop, address order": ("addr", _FILE), "C loop, by rank": ("rank", _FILE),
         "C loop, prefault": ("addr", _FILE | _PREFAULT),
         "C loop, slice/thread": ("slice", _FILE)}
KINDS = ("private", "torch", "shared")

with tempfile.TemporaryDirectory(dir=os.environ.get("PROBE_DIR", os.getcwd())) as tmp:
    path = os.path.join(tmp, "data")
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    src = torch.frombuffer(bytearray(os.pread(fd, size, 0)), dtype=torch.uint8)
    touched_t = torch.ones(size, dtype=torch.uint8)
    touched = touched_t.data_ptr()
    rows = {}
    for _ in range(rounds):
        t0 = time.perf_counter(); touched_t.copy_(src)
        rows.setdefault("torch copy, touched", []).append(time.perf_counter() - t0)
        for kind in KINDS:
            keep, addr = new_memory(kind)
            t = torch.frombuffer(keep, dtype=torch.uint8) if kind != "torch" else keep
            t0 = time.perf_counter(); t.copy_(src)
            rows.setdefault(f"torch copy, new {kind}", []).append(time.perf_counter() - t0)
            del t; release(keep)
        for name, (how, flag) in LOOPS.items():
            rows.setdefault(f"{name}, touched", []).append(c_loop(fd, touched, how, flag))
            for kind in KINDS:
                keep, addr = new_memory(kind)
                rows.setdefault(f"{name}, new {kind}", []).append(c_loop(fd, addr, how, flag))
                release(keep)
    os.close(fd)
    print(f"{mb} MiB, {threads} threads (torch: {torch.get_num_threads()}), {rounds} rounds, "
          f"load {os.getloadavg()[0]:.2f}, kernel {platform.release()}")
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    for k, v in med.items():
        print(f"  {k:42s} {v:7.2f} ms")
    print("  new minus touched (ms):")
    for how in ("torch copy", *LOOPS):
        print(f"    {how:24s} " + "  ".join(
            f"{kind} {med[f'{how}, new {kind}'] - med[f'{how}, touched']:6.2f}" for kind in KINDS))
