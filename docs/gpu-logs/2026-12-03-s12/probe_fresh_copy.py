# Run on the 16-core GPU host as scratch/probe_fresh_copy.py (session 12), ROUNDS=5 under a
# 100 s limit: 3 rounds finished (probe_fresh_copy.log). Not part of the package.
"""Where does a pull into new memory lose to a load? 70 MB from a file's page cache into
a new allocation, in fresh processes, 16 threads, no digests: pread in pieces (the
pull's copy), memmove from a mapping of the file in pieces, lanes vs interleaved
pieces, and torch's copy_ from the mapping (the load's clone)."""
import ctypes, json, mmap, os, statistics, subprocess, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor

N = 70_483_200
VARIANTS = ["torch_map", "pread_1m", "pread_8m", "pread_lanes", "memmove_1m", "memmove_lanes",
            "memmove_1m_populated_src"]


def child(variant, path, threads):
    import torch
    libc = ctypes.CDLL(None, use_errno=True)
    pread = libc.pread
    pread.restype = ctypes.c_ssize_t
    pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    memmove = ctypes.memmove
    fd = os.open(path, os.O_RDONLY)
    pool = ThreadPoolExecutor(threads)
    list(pool.map(lambda _: time.sleep(0.01), range(threads)))  # threads started, untimed
    t0 = time.perf_counter()
    dst = torch.empty(N, dtype=torch.uint8)
    d = dst.data_ptr()
    if variant.startswith("torch"):
        m = mmap.mmap(fd, N, prot=mmap.PROT_READ)
        import numpy as np
        src = torch.from_numpy(np.frombuffer(m, dtype=np.uint8))
        dst.copy_(src)
    else:
        if variant.startswith("memmove"):
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if "populated" in variant else 0)
            m = mmap.mmap(fd, N, flags=flags, prot=mmap.PROT_READ)
            import numpy as np
            s = np.frombuffer(m, dtype=np.uint8).ctypes.data

            def one(a_n):
                a, n = a_n
                memmove(d + a, s + a, n)
        else:
            def one(a_n):
                a, n = a_n
                done = 0
                while done < n:
                    got = pread(fd, d + a + done, n - done, a + done)
                    assert got > 0
                    done += got
        if variant.endswith("lanes"):
            lane = -(-N // threads)
            pieces = [(a, min(lane, N - a)) for a in range(0, N, lane)]
        else:
            size = (8 << 20) if variant.endswith("8m") else (1 << 20)
            pieces = [(a, min(size, N - a)) for a in range(0, N, size)]
        list(pool.map(one, pieces))
    el = time.perf_counter() - t0
    ref = open(path, "rb").read(4096)
    assert bytes(dst[:4096].numpy()) == ref
    print(json.dumps({"s": el}))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    rounds = int(os.environ.get("ROUNDS", "5"))
    threads = min(16, os.cpu_count() or 1)
    path = os.path.join(tempfile.mkdtemp(), "blob")
    with open(path, "wb") as f:
        f.write(os.urandom(N))
    open(path, "rb").read()
    t = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v in VARIANTS:
            p = subprocess.run([sys.executable, __file__, "--child", v, path, str(threads)],
                               stdout=subprocess.PIPE, text=True, timeout=120)
            t[v].append(json.loads(p.stdout.strip().splitlines()[-1])["s"])
        print(json.dumps({"round_ms": {v: round(x[-1] * 1e3, 2) for v, x in t.items()}}),
              flush=True)
    out = {v: round(statistics.median(x) * 1e3, 2) for v, x in t.items()}
    print(json.dumps({"probe": "fresh_copy", "threads": threads, "rounds": rounds, "ms": out,
                      "min_ms": {v: round(min(x) * 1e3, 2) for v, x in t.items()}}))


if __name__ == "__main__":
    main()
