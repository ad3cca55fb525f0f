"""_copyloop.run alone: median time of a call that copies SIZE bytes in PIECES pieces on
THREADS threads (the caller and THREADS-1 kept helpers), 2000 calls after 50, from a
memfd into touched memory. Args: SIZE PIECES THREADS."""
import array, ctypes, os, statistics, sys, time
from modelexpress.local import _copyloop
size, npieces, threads = (int(x) for x in sys.argv[1:4])
fd = os.memfd_create("letgo")
os.write(fd, os.urandom(size))
out = ctypes.create_string_buffer(size)
piece = size // npieces
pieces = array.array("q")
for a in range(0, size, piece):
    pieces.extend([fd, a, ctypes.addressof(out) + a, min(piece, size - a), 0, -1])
n = len(pieces) // 6
q = lambda k: array.array("q", bytes(8 * k))
ts = []
for i in range(2050):
    done, err = q(n), q(n)
    t0 = time.perf_counter()
    _copyloop.run(pieces, array.array("q"), q(0), done, err, bytearray(0), bytearray(0), threads, 0)
    if i >= 50:
        ts.append(time.perf_counter() - t0)
    time.sleep(0.0005)
ts.sort()
print(f"{size >> 10} KiB in {n} pieces on {threads} threads: median {statistics.median(ts)*1e6:.1f} us, "
      f"p90 {ts[int(len(ts)*0.9)]*1e6:.1f} us")
