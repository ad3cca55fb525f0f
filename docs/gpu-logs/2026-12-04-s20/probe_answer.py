"""How long a local source takes to answer a hello (hello sent -> welcome readable),
idle 30 ms between connections, against the manifest match the target does meanwhile."""
import os, sys, tempfile, time, statistics, select
sys.path.insert(0, "bench")
import local as B, torch
from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint
from modelexpress.local import LocalEndpoint, client
from modelexpress.transfer import planner
from modelexpress.p2p.target import allocate_like
from modelexpress.transfer.manifest import Manifest
with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "ckpt"); generate_llama_checkpoint(ckpt, LlamaShape(**B.HOST_CASES["70mb"]))
    info = os.path.join(tmp, "info.json")
    proc, d = B._start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc")], info)
    try:
        ep = LocalEndpoint.from_json(d["endpoint"]); m = Manifest.from_json(d["manifest"])
        dest = allocate_like(m)
        ans, mat = [], []
        for i in range(60):
            time.sleep(0.03)
            t0 = time.perf_counter(); h = client.Hello(ep); t1 = time.perf_counter()
            p = select.poll(); p.register(h._sock, select.POLLIN); p.poll(5000); t2 = time.perf_counter()
            s = client.LocalSession(ep, hello=h); s.close()
            time.sleep(0.03)
            t3 = time.perf_counter(); planner.match(m, dest); mat.append(time.perf_counter() - t3)
            ans.append((t1 - t0, t2 - t1))
        print("hello (connect+send) ms", round(statistics.median(a for a, _ in ans) * 1e3, 3),
              "answer after hello ms", round(statistics.median(b for _, b in ans) * 1e3, 3),
              "p90", round(sorted(b for _, b in ans)[54] * 1e3, 3),
              "| match (cold) ms", round(statistics.median(mat) * 1e3, 3))
    finally:
        B._stop(proc)
