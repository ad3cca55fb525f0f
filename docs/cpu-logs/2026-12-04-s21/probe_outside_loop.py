"""A verified 70 MB pull into touched memory: the time outside the C copy loop.

Times each pull() whole and the C loop's call inside it (_copyloop.run, wrapped), 60
pulls 20 ms apart after 5 untimed, verified and then unverified, and prints the medians
and the pull's time outside the loop (Python, the socket, the mapping): what the
tree's Python costs, apart from the copy whose speed the machine's load moves.
Run from a tree's root with that tree on PYTHONPATH (and its C extension built):
    PYTHONPATH=. python docs/cpu-logs/2026-12-04-s21/probe_outside_loop.py
"""
import os, sys, tempfile, time, statistics
sys.path.insert(0, "bench")
import local as B
import torch
from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint
from modelexpress.local import LocalEndpoint, pull, hostcopy
from modelexpress.p2p.target import allocate_like
from modelexpress.transfer.manifest import Manifest
loop = []
real = hostcopy._copyloop.run
def timed(*a):
    t0 = time.perf_counter()
    try:
        return real(*a)
    finally:
        loop.append(time.perf_counter() - t0)
hostcopy._copyloop = type("M", (), {"run": staticmethod(timed)})
with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "ckpt"); generate_llama_checkpoint(ckpt, LlamaShape(**B.HOST_CASES["70mb"]))
    info = os.path.join(tmp, "info.json")
    proc, d = B._start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc")], info)
    try:
        m = Manifest.from_json(d["manifest"]); ep = LocalEndpoint.from_json(d["endpoint"])
        dest = allocate_like(m)
        for t in dest.values(): t.view(-1).view(torch.uint8).fill_(0)
        print(hostcopy.__file__, m.digest_algorithm)
        for verify in (True, False):
            for _ in range(5): pull(ep, m, dest, verify=verify)
            loop.clear(); walls = []
            for _ in range(60):
                time.sleep(0.02); t0 = time.perf_counter(); pull(ep, m, dest, verify=verify)
                walls.append(time.perf_counter() - t0)
            out = [w - c for w, c in zip(walls, loop)]
            print(f"verify={verify}: pull {statistics.median(walls)*1e3:.3f} ms, C loop "
                  f"{statistics.median(loop)*1e3:.3f} ms, outside it {statistics.median(out)*1e3:.3f} ms")
    finally:
        B._stop(proc)
