"""70 MB into touched memory, one process: where a pull's time goes against memcpy (a probe kept with its logs).

Variants, interleaved each round with a torch memcpy of the same bytes:
  fresh          pull() as today (connect, map, plan, copy+hash, close)
  fresh_addr     the same with hostcopy.LARGEST_FIRST off: an A/B of the experiment in
                 largest_first.diff (without that patch the flag is read by nothing and
                 the two variants are the same code)
  kept           the same with one session kept (LocalSession/close monkeypatched)
  kept_addr      kept, with hostcopy.LARGEST_FIRST off (as fresh_addr)
  kept_nover     kept, verify=False (the copy without hashing)
  kept_py        kept, on the Python loop (hostcopy.NATIVE off; listed in the _pool and
                 _feed runs, which this version no longer runs)
  kept_tN        kept, N copy threads
  loop           HostCopier.copy alone on the kept session (no plan, no digests)
  loop_tiny      HostCopier.copy of 16 x 64 KiB pieces on 16 threads: thread start cost
"""
import os, sys, tempfile, time, statistics, subprocess
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import local as B
import torch
from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint, time_disk_load
from modelexpress.local import LocalEndpoint, pull, client, hostcopy
from modelexpress.local.hostcopy import HostCopier
from modelexpress.p2p.target import allocate_like
from modelexpress.transfer.manifest import Manifest
case = sys.argv[1] if len(sys.argv) > 1 else "70mb"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
print("cpus", len(os.sched_getaffinity(0)), "torch threads", torch.get_num_threads(), flush=True)
print(subprocess.run("lscpu | grep -Ei 'model name|cache|numa|socket|core'", shell=True,
                     capture_output=True, text=True).stdout, flush=True)
with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "ckpt"); generate_llama_checkpoint(ckpt, LlamaShape(**B.HOST_CASES[case]))
    info = os.path.join(tmp, "info.json")
    proc, d = B._start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc")], info)
    try:
        time_disk_load(ckpt, cold=False)
        m = Manifest.from_json(d["manifest"]); ep = LocalEndpoint.from_json(d["endpoint"])
        dest = allocate_like(m)
        for t in dest.values(): t.view(-1).view(torch.uint8).fill_(0)
        src = torch.ones(m.total_bytes, dtype=torch.uint8); dst = torch.zeros(m.total_bytes, dtype=torch.uint8)
        kept = client.LocalSession(ep)
        real_close = client.LocalSession.close
        Orig = client.LocalSession
        order = sorted(m.tensors, key=lambda t: t.addr)
        runs = [(*kept.host_segment(t.addr, t.nbytes), dest[t.name].data_ptr(), t.nbytes) for t in order if t.nbytes]
        big = max(order, key=lambda t: t.nbytes)
        tiny = torch.zeros(16 << 16, dtype=torch.uint8)
        tiny_runs = [(*kept.host_segment(big.addr, 1 << 16), tiny.data_ptr() + (i << 16), 1 << 16) for i in range(16)]
        real_threads = hostcopy.copy_threads
        def variant(v):
            if v.startswith("fresh"):
                hostcopy.LARGEST_FIRST = v == "fresh"
                try:
                    return pull(ep, m, dest, verify=True).seconds
                finally:
                    hostcopy.LARGEST_FIRST = True
            if v.startswith("loop"):
                c = HostCopier(kept.host_map, threads=16 if v == "loop_tiny" else None)
                t0 = time.perf_counter(); c.copy(tiny_runs if v == "loop_tiny" else runs); c.close()
                return time.perf_counter() - t0
            client.LocalSession = lambda *a, **k: kept
            Orig.close = lambda self: None
            if "_t" in v:
                k = int(v.split("_t")[1]); hostcopy.copy_threads = lambda: k
            if v == "kept_py": hostcopy.NATIVE = False
            hostcopy.LARGEST_FIRST = v != "kept_addr"
            try:
                r = pull(ep, m, dest, verify=v != "kept_nover")
                phases.setdefault(v, []).append(r.phases)
                return r.seconds
            finally:
                client.LocalSession = Orig; Orig.close = real_close; hostcopy.copy_threads = real_threads; hostcopy.NATIVE = True; hostcopy.LARGEST_FIRST = True
        ncpu = len(os.sched_getaffinity(0))
        print("xxh3 address", hex(hostcopy._xxh3_address()), "native", hostcopy.NATIVE, flush=True)
        import xxhash
        blk = torch.ones(8 << 20, dtype=torch.uint8); mv = memoryview(blk.numpy())
        for _ in range(3): xxhash.xxh3_128(mv)
        t0 = time.perf_counter(); [xxhash.xxh3_128(mv) for _ in range(20)]; dt = (time.perf_counter() - t0) / 20
        print(f"xxh3_128 of 8 MiB (hot): {dt*1e3:.3f} ms, {8*1.048576/dt/1e3:.1f} GB/s", flush=True)
        phases = {}
        vs = ["fresh", "fresh_addr", "kept", "kept_addr", "kept_nover", "loop", "loop_tiny"] + [f"kept_t{k}" for k in (4, 8, 12) if k < ncpu]
        for v in vs: variant(v)
        mem, rows = [], {v: [] for v in vs}
        for _ in range(rounds):
            time.sleep(0.05); t0 = time.perf_counter(); dst.copy_(src); a = time.perf_counter() - t0; mem.append(a)
            for v in vs:
                time.sleep(0.05); t0 = time.perf_counter(); s = variant(v); w = time.perf_counter() - t0
                rows[v].append((a / w, w, s))
        print(case, "memcpy ms", round(statistics.median(mem) * 1e3, 3), "best", round(min(mem) * 1e3, 3))
        for v in vs:
            print(f"{v:12s} memcpy/this {statistics.median(x for x, _, _ in rows[v]):.3f} "
                  f"wall ms {statistics.median(w for _, w, _ in rows[v])*1e3:.3f} "
                  f"own ms {statistics.median(s for _, _, s in rows[v])*1e3:.3f} best wall {min(w for _, w, _ in rows[v])*1e3:.3f}", flush=True)
        for v, ps in phases.items():
            print(v, {k: round(statistics.median(p[k] for p in ps) * 1e3, 3) for k in ps[0]})
        real_close(kept)
    finally:
        B._stop(proc)
