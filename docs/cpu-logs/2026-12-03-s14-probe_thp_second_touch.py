"""Is MADV_HUGEPAGE slow on this VM because fresh guest memory is backed lazily by the
host? Fault 1 GiB with and without MADV_HUGEPAGE, several times in one process
(munmap between): if only the first huge-page pass is slow, the cost is the host
backing new guest-physical memory, not the guest kernel's huge-page faults."""
import ctypes, json, mmap, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
N = 1 << 30
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
def vm(): 
    d = dict(l.split() for l in open("/proc/vmstat"))
    return {k: int(d[k]) for k in ("thp_fault_alloc", "thp_fault_fallback", "compact_stall")}
out = []
for rnd in range(4):
    for huge in (False, True):
        a = libc.mmap(None, N, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if huge: libc.madvise(a, N, MADV_HUGEPAGE)
        v0 = vm(); t = time.perf_counter()
        libc.madvise(a, N, MADV_POPULATE_WRITE)
        ms = (time.perf_counter() - t) * 1e3
        v1 = vm()
        libc.munmap(a, N)
        out.append({"round": rnd, "huge": huge, "ms": round(ms, 1), **{k: v1[k] - v0[k] for k in v0}})
        print(json.dumps(out[-1]), flush=True)
