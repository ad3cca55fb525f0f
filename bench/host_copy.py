"""Host copy routines into private and shared (arena) memory, in the same run.

The shm tensor arena's writer cost is one copy of each tensor into the shared
segment, so the copy routine sets it. This times one buffer (default 200 MiB,
warm source and destination pages) copied by:

* ``torch``: ``Tensor.copy_`` (what the benchmarks' memcpy floor uses),
* ``memcpy``: glibc ``memcpy`` through ctypes (one thread),
* ``stream1`` / ``streamN``: the arena's ``atomics.copy_in`` (non-temporal stores,
  GIL released) on one thread and split across up to 8 threads,

into private anonymous memory and into an :class:`ArenaWriter`'s segment, and
prints each median against ``torch`` into private memory.

Usage: python bench/host_copy.py [--quick] [--mib N] [--repeat N]
Prints one line per measurement, then ONE JSON object on the last line.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import statistics
import sys
import time
from typing import Any, Callable


def _median_ms(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, 3 repeats")
    parser.add_argument("--mib", type=int, default=None, help="buffer size (default 200)")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs (default 7)")
    args = parser.parse_args()
    args.mib = args.mib or (64 if args.quick else 200)
    args.repeat = args.repeat or (3 if args.quick else 7)

    import torch

    from modelexpress.shm_arena import ArenaWriter, atomics
    if not atomics.NATIVE:
        raise SystemExit("the shm arena C extension is not built: nothing to compare")

    nbytes = args.mib << 20
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(3)
    private_mm = mmap.mmap(-1, nbytes)
    private_mm.write(b"\0" * nbytes)  # warm pages
    private = torch.frombuffer(private_mm, dtype=torch.uint8)
    writer = ArenaWriter(1, nbytes + (64 << 20), prefault=True)
    if not writer.wait_warm(120):
        raise SystemExit("the arena did not finish pre-faulting within 120 s")
    shared_mm = writer._segment.mm
    shared_off = writer._layout.data_offset
    shared = writer._data[:nbytes]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.memcpy.restype = ctypes.c_void_p
    libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    def stream(mm: Any, off: int, threads: int) -> None:
        atomics.copy_in(mm, off, src, threads=threads)

    n_threads = atomics._copy_threads(nbytes)
    out: dict[str, Any] = {"bytes": nbytes, "torch_threads": torch.get_num_threads(),
                           "stream_threads": n_threads}
    for where, dst, mm, off in (("private", private, private_mm, 0),
                                ("shared", shared, shared_mm, shared_off)):
        cases = {
            "torch": lambda: dst.copy_(src),
            "memcpy": lambda: libc.memcpy(dst.data_ptr(), src.data_ptr(), nbytes),
            "stream1": lambda: stream(mm, off, 1),
            f"stream{n_threads}": lambda: stream(mm, off, n_threads),
        }
        for name, fn in cases.items():
            out[f"{name}_{where}_ms"] = round(_median_ms(fn, args.repeat), 2)
    base = out["torch_private_ms"]
    for key in [k for k in out if k.endswith("_ms")]:
        print(f"{key[:-3]:>18}: {out[key]:7.2f} ms  ({base / out[key]:.2f}x torch into private)",
              file=sys.stderr)
    writer.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
