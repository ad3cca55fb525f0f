"""Fresh-session 70 MB pulls into touched memory: median time of each step of pull()."""
import os, sys, tempfile, time, statistics, functools
sys.path.insert(0, "bench")
import local as B
import torch
from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint
from modelexpress.local import LocalEndpoint, pull, client, hostcopy, hugepages
from modelexpress.transfer import planner, digest
from modelexpress.p2p.target import allocate_like
from modelexpress.transfer.manifest import Manifest
T = {}
def wrap(mod, name, label=None):
    f = getattr(mod, name)
    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter()
        try: return f(*a, **k)
        finally: T.setdefault(label or name, []).append(time.perf_counter() - t0)
    setattr(mod, name, g)
top = [(client.Hello, "__init__"), (planner, "match"), (digest, "pause_builds"), (digest, "resume_builds"), (hugepages, "HugePages"),
       (client.LocalSession, "__init__"), (client, "_plan"), (client, "_digests_alongside"),
       (client._Runner, "__init__"), (client._Runner, "run"), (hostcopy.DigestsInPass, "finish"),
       (client.LocalSession, "close"), (client, "LocalPullResult")]
for mod, name in top: wrap(mod, name, f"{getattr(mod, '__name__', '')}.{name}")
from modelexpress.local import protocol, memory
inner = [(protocol, "recv"), (memory, "HostMapping"), (hostcopy.HostCopier, "copy"), (hostcopy._copyloop, "run"), (hostcopy.HostCopier, "_copy_native")]
for mod, name in inner: wrap(mod, name, f"  ({getattr(mod, '__name__', '')}.{name})")
case = sys.argv[1] if len(sys.argv) > 1 else "70mb"
with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "ckpt"); generate_llama_checkpoint(ckpt, LlamaShape(**B.HOST_CASES[case]))
    info = os.path.join(tmp, "info.json")
    proc, d = B._start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc")], info)
    try:
        m = Manifest.from_json(d["manifest"]); ep = LocalEndpoint.from_json(d["endpoint"])
        dest = allocate_like(m)
        for t in dest.values(): t.view(-1).view(torch.uint8).fill_(0)
        for _ in range(5): pull(ep, m, dest)
        T.clear(); walls = []
        for _ in range(40):
            time.sleep(0.03); t0 = time.perf_counter(); pull(ep, m, dest); walls.append(time.perf_counter() - t0)
        w = statistics.median(walls) * 1e3
        print(f"pull wall median {w:.3f} ms")
        acc = 0.0
        for k, v in T.items():
            med = statistics.median(v) * 1e3 * len(v) / 40
            if not k.startswith("  "): acc += med
            print(f"{k:45s} {med:.3f} ms per pull")
        print(f"{'unaccounted':45s} {w - acc:.3f} ms")
    finally:
        B._stop(proc)
