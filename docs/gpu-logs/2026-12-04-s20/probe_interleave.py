"""Host pulls into touched memory, one process: pieces taken by rank vs in address order.

Each round: a torch memcpy of the same bytes, then every variant (50 ms apart):
  fresh       pull() as shipped (pieces of a block taken by rank: hostcopy.INTERLEAVE)
  fresh_addr  the same with hostcopy.INTERLEAVE off (pieces taken in address order)
  fresh_serial  the same with the manifest matched only once the source has answered
              (a Hello subclass that polls for the answer before returning): the
              order of the steps before client.Hello overlapped them
  kept        the pull's LocalSession made once and reused (a monkeypatch: no connect)
  kept_addr   kept, INTERLEAVE off
  kept_nover  kept, verify=False (the copy without hashing)
Usage: python probe_interleave.py 70mb|1gib ROUNDS
"""
import os, sys, tempfile, time, statistics, subprocess
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "bench"))
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import local as B
import torch
from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint, time_disk_load
from modelexpress.local import LocalEndpoint, pull, client, hostcopy
from modelexpress.p2p.target import allocate_like
from modelexpress.transfer.manifest import Manifest
case = sys.argv[1] if len(sys.argv) > 1 else "70mb"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
print("cpus", len(os.sched_getaffinity(0)), "torch threads", torch.get_num_threads(),
      "native", hostcopy.NATIVE, "stream fns", hostcopy._xxh3_stream_functions() is not None, flush=True)
with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "ckpt"); generate_llama_checkpoint(ckpt, LlamaShape(**B.HOST_CASES[case]))
    info = os.path.join(tmp, "info.json")
    proc, d = B._start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc")], info)
    try:
        time_disk_load(ckpt, cold=False)
        m = Manifest.from_json(d["manifest"]); ep = LocalEndpoint.from_json(d["endpoint"])
        print(case, m.total_bytes, "bytes,", len(m.tensors), "tensors, digest", m.digest_algorithm, flush=True)
        dest = allocate_like(m)
        for t in dest.values(): t.view(-1).view(torch.uint8).fill_(0)
        src = torch.ones(m.total_bytes, dtype=torch.uint8); dst = torch.zeros(m.total_bytes, dtype=torch.uint8)
        kept = client.LocalSession(ep)
        Orig, real_close = client.LocalSession, client.LocalSession.close
        phases = {}
        import select
        RealHello = client.Hello
        class SerialHello(RealHello):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                if self._sock is not None:
                    p = select.poll(); p.register(self._sock, select.POLLIN); p.poll(10000)
        class NoHello:
            def __init__(self, *a, **k): pass
            def close(self): pass
        def variant(v):
            hostcopy.INTERLEAVE = not v.endswith("_addr")
            if v == "fresh_serial":
                client.Hello = SerialHello
            if v.startswith("kept"):
                client.LocalSession = lambda *a, **k: kept
                client.Hello = NoHello
                Orig.close = lambda self: None
            try:
                r = pull(ep, m, dest, verify=v != "kept_nover")
                phases.setdefault(v, []).append(r.phases)
                return r.seconds
            finally:
                client.LocalSession = Orig; Orig.close = real_close; hostcopy.INTERLEAVE = True
                client.Hello = RealHello
        vs = ["fresh", "fresh_serial", "fresh_addr", "kept", "kept_addr", "kept_nover"]
        for v in vs: variant(v)
        phases.clear()
        mem, rows = [], {v: [] for v in vs}
        for i in range(rounds):
            time.sleep(0.05); t0 = time.perf_counter(); dst.copy_(src); a = time.perf_counter() - t0; mem.append(a)
            order = vs if i % 2 == 0 else vs[::-1]
            for v in order:
                time.sleep(0.05); t0 = time.perf_counter(); s = variant(v); w = time.perf_counter() - t0
                rows[v].append((a / w, w, s))
        print(case, "memcpy ms median", round(statistics.median(mem) * 1e3, 3), "best", round(min(mem) * 1e3, 3))
        for v in vs:
            print(f"{v:11s} memcpy/this median {statistics.median(x for x, _, _ in rows[v]):.3f} "
                  f"wall ms {statistics.median(w for _, w, _ in rows[v])*1e3:.3f} "
                  f"best {min(w for _, w, _ in rows[v])*1e3:.3f}", flush=True)
        for v, ps in phases.items():
            print(v, {k: round(statistics.median(p[k] for p in ps) * 1e3, 3) for k in ps[0]})
        real_close(kept)
    finally:
        B._stop(proc)
