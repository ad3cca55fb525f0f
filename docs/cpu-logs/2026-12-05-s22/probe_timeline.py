"""A verified (then unverified) 70 MB pull into touched memory, 100 pulls after 5: the
medians of the time before the C loop starts (_copyloop.run wrapped), of the loop, and
after it. Run from a tree's root: PYTHONPATH=. python .../probe_timeline.py 100"""
import os, sys, tempfile, time, statistics
sys.path.insert(0, "bench")
import local as B
import torch
from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint
from modelexpress.local import LocalEndpoint, pull, hostcopy
from modelexpress.p2p.target import allocate_like
from modelexpress.transfer.manifest import Manifest
marks = []
real = hostcopy._copyloop.run
def timed(*a):
    marks.append(time.perf_counter())
    try:
        return real(*a)
    finally:
        marks.append(time.perf_counter())
hostcopy._copyloop = type("M", (), {"run": staticmethod(timed)})
n = int(sys.argv[1]) if len(sys.argv) > 1 else 60
with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "ckpt"); generate_llama_checkpoint(ckpt, LlamaShape(**B.HOST_CASES["70mb"]))
    info = os.path.join(tmp, "info.json")
    proc, d = B._start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc")], info)
    try:
        m = Manifest.from_json(d["manifest"]); ep = LocalEndpoint.from_json(d["endpoint"])
        dest = allocate_like(m)
        for t in dest.values(): t.view(-1).view(torch.uint8).fill_(0)
        for verify in (True, False):
            for _ in range(5): pull(ep, m, dest, verify=verify)
            before, after, loop = [], [], []
            for _ in range(n):
                time.sleep(0.02); marks.clear()
                t0 = time.perf_counter(); pull(ep, m, dest, verify=verify); t1 = time.perf_counter()
                before.append(marks[0] - t0); after.append(t1 - marks[-1]); loop.append(marks[-1] - marks[0])
            med = lambda xs: statistics.median(xs) * 1e3
            print(f"verify={verify}: before the loop {med(before):.3f} ms, loop {med(loop):.3f}, after {med(after):.3f}")
    finally:
        B._stop(proc)
