"""Fresh-process 70 MB pulls against the warm load, by variant (a probe, session 17).

Usage: python docs/gpu-logs/2026-12-04-s17/probe_fresh70.py [case] [rounds] [--nowarm].
Each round runs every variant once, each in a fresh process, interleaved: ``disk``
(the warm page-cache load), ``pull`` (as bench/local.py's fresh-process row did
before it imported modelexpress.local.hugepages untimed), ``pull_preimport`` (with
it), ``pull_preimport_threadsN`` (N copy threads). Then, in one process each, pulls
into touched memory against a torch memcpy of the same bytes (``warm*``). Medians
per variant and per phase, in ms."""
import json, os, subprocess, sys, tempfile, time
_root = os.path.dirname(os.path.abspath(__file__))
while not os.path.exists(os.path.join(_root, "bench", "local.py")):  # the repo, upwards
    _root = os.path.dirname(_root)
sys.path.insert(0, os.path.join(_root, "bench"))
if len(sys.argv) > 1 and sys.argv[1] == "--child":
    info, ckpt, variant = sys.argv[2], sys.argv[3], sys.argv[4]
    import safetensors.torch, torch, xxhash  # noqa
    import modelexpress.checkpoint, modelexpress.local.client, modelexpress.local.hostcopy  # noqa
    import modelexpress.local.memory, modelexpress.p2p.target, modelexpress.transfer.digest  # noqa
    import modelexpress.transfer.planner  # noqa
    if "preimport" in variant:
        import modelexpress.local.hugepages  # noqa
    threads = int(variant.split("threads")[1]) if "threads" in variant else 0
    if threads:
        modelexpress.local.hostcopy.copy_threads = lambda: threads
    if variant == "disk":
        from modelexpress.checkpoint import time_disk_load
        print(json.dumps({"total": time_disk_load(ckpt, cold=False)}))
        sys.exit(0)
    from modelexpress.local import LocalEndpoint, pull
    from modelexpress.p2p.target import allocate_like
    from modelexpress.transfer.manifest import Manifest
    d = json.load(open(info)); m = Manifest.from_json(d["manifest"]); ep = LocalEndpoint.from_json(d["endpoint"])
    if variant.startswith("warm"):  # touched memory, in process: pull vs torch memcpy, alternating
        dest = allocate_like(m)
        for t in dest.values(): t.view(-1).view(torch.uint8).fill_(0)
        src = torch.ones(m.total_bytes, dtype=torch.uint8); dst = torch.zeros(m.total_bytes, dtype=torch.uint8)
        for _ in range(3): pull(ep, m, dest); dst.copy_(src)
        ratios, copies, pulls = [], [], []
        for _ in range(15):
            time.sleep(0.05); t0 = time.perf_counter(); dst.copy_(src); a = time.perf_counter() - t0
            time.sleep(0.05); r = pull(ep, m, dest, verify=True)
            ratios.append(a / r.seconds); copies.append(r.phases["copy"]); pulls.append(r.seconds)
        med = lambda xs: sorted(xs)[len(xs) // 2]
        print(json.dumps({"total": med(pulls), "memcpy_over_pull": med(ratios), "copy": med(copies)}))
        sys.exit(0)
    t0 = time.perf_counter()
    dest = allocate_like(m)
    t1 = time.perf_counter()
    r = pull(ep, m, dest, verify=True)
    t2 = time.perf_counter()
    print(json.dumps({"total": t2 - t0, "alloc": t1 - t0, "pull_call": t2 - t1,
                      "outside_t0": (t2 - t1) - r.seconds,
                      "unphased": r.seconds - sum(r.phases.values()), **r.phases}))
    sys.exit(0)
import local as B
from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint
case = sys.argv[1] if len(sys.argv) > 1 else "70mb"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
ncpu = len(os.sched_getaffinity(0))
variants = {"disk": None, "pull": None, "pull_preimport": None}
for k in (8, 4):
    if k < ncpu:
        variants[f"pull_preimport_threads{k}"] = None
warm = [] if "--nowarm" in sys.argv else ["warm"] + [f"warm_threads{k}" for k in (8, 4) if k < ncpu]
print("cpus", ncpu, "env", {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}, flush=True)
with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "ckpt"); generate_llama_checkpoint(ckpt, LlamaShape(**B.HOST_CASES[case]))
    info = os.path.join(tmp, "info.json")
    proc, d = B._start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc")], info)
    try:
        from modelexpress.checkpoint import time_disk_load
        time_disk_load(ckpt, cold=False)
        rows = {v: [] for v in variants}
        for i in range(rounds):
            for v, k in variants.items():
                pre = ["taskset", "-c", f"0-{k - 1}"] if k else []
                out = subprocess.run(pre + [sys.executable, __file__, "--child", info, ckpt, v],
                                     stdout=subprocess.PIPE, text=True, timeout=120).stdout
                rows[v].append(json.loads([l for l in out.splitlines() if l.startswith("{")][-1]))
        disk = [r["total"] for r in rows["disk"]]
        print("disk per round ms", [round(x * 1e3, 1) for x in disk])
        for v, rs in rows.items():
            ratio = sorted(a / r["total"] for a, r in zip(disk, rs))[len(rs) // 2]
            med = {k: round(sorted(r[k] for r in rs)[len(rs) // 2] * 1e3, 2) for k in rs[0]}
            print(f"{v:24s} load/this {ratio:.3f}  medians ms {med}", flush=True)
        for v in warm:
            out = subprocess.run([sys.executable, __file__, "--child", info, ckpt, v],
                                 stdout=subprocess.PIPE, text=True, timeout=300).stdout
            print(f"{v:24s} {out.strip().splitlines()[-1]}", flush=True)
    finally:
        B._stop(proc)
