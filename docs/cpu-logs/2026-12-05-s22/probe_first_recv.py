"""A 70 MB verified pull into touched memory: when the first read of the source's answer
starts, and how long it waits (the window the match and the hello overlap).
Run from a tree's root: PYTHONPATH=. python docs/cpu-logs/2026-12-05-s22/probe_first_recv.py"""
import os, sys, tempfile, time, statistics
sys.path.insert(0, "bench")
import local as B
import torch
from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint
from modelexpress.local import LocalEndpoint, pull, client, protocol
from modelexpress.p2p.target import allocate_like
from modelexpress.transfer.manifest import Manifest
from modelexpress.transfer import planner
rec = []
real = protocol.recv
def timed(*a):
    t0 = time.perf_counter()
    try: return real(*a)
    finally: rec.append((t0, time.perf_counter()))
protocol.recv = timed
with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "ckpt"); generate_llama_checkpoint(ckpt, LlamaShape(**B.HOST_CASES["70mb"]))
    info = os.path.join(tmp, "info.json")
    proc, d = B._start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc")], info)
    try:
        m = Manifest.from_json(d["manifest"]); ep = LocalEndpoint.from_json(d["endpoint"])
        dest = allocate_like(m)
        for t in dest.values(): t.view(-1).view(torch.uint8).fill_(0)
        for _ in range(5): pull(ep, m, dest)
        w1, start = [], []
        for _ in range(100):
            time.sleep(0.02); rec.clear()
            t0 = time.perf_counter(); pull(ep, m, dest)
            w1.append(rec[0][1] - rec[0][0]); start.append(rec[0][0] - t0)
        print(f"first recv starts {statistics.median(start)*1e3:.3f} ms into the pull, waits {statistics.median(w1)*1e3:.3f} ms")
    finally:
        B._stop(proc)
