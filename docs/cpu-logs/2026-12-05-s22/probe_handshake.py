"""Hello, LocalSession(hello=) and close alone against a 70 MB checkpoint source:
medians over 200 rounds after 20, and of the first read of the answer (recv1), the
second (recv2) and the memfd mapping. Run from a tree's root with PYTHONPATH=. ;
with inline_handshake.patch applied, MX_PROBE_HELLO_INLINE=0/1 turns it off/on."""
import os, sys, tempfile, time, statistics, functools
sys.path.insert(0, "bench")
import local as B
from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint
from modelexpress.local import LocalEndpoint, client, protocol, memory
T = {}
def wrap(mod, name):
    f = getattr(mod, name)
    def g(*a, **k):
        t0 = time.perf_counter()
        try: return f(*a, **k)
        finally: T.setdefault(name, []).append(time.perf_counter() - t0)
    setattr(mod, name, g)
wrap(protocol, "recv"); wrap(memory, "HostMapping")
with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "ckpt"); generate_llama_checkpoint(ckpt, LlamaShape(**B.HOST_CASES["70mb"]))
    info = os.path.join(tmp, "info.json")
    proc, d = B._start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc")], info)
    try:
        ep = LocalEndpoint.from_json(d["endpoint"])
        rows = []
        for i in range(220):
            time.sleep(0.005)
            if i == 20: T.clear()
            t0 = time.perf_counter(); h = client.Hello(ep); t1 = time.perf_counter()
            s = client.LocalSession(ep, hello=h); t2 = time.perf_counter()
            s.close(); t3 = time.perf_counter()
            if i >= 20: rows.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
        for k, name in enumerate(("hello", "session", "close", "all")):
            xs = sorted(r[k] for r in rows)
            print(f"{name:8s} median {statistics.median(xs)*1e3:.3f} ms")
        r = T["recv"]; print("recv1", statistics.median(r[0::2])*1e3, "recv2", statistics.median(r[1::2])*1e3, "map", statistics.median(T["HostMapping"])*1e3)
    finally:
        B._stop(proc)
