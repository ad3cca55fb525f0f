"""Device probe (session 13, not part of the package; kept with its output): fresh-process
verified pulls of the 70mb case with the C piece loop at several piece policies, the Python
loop, huge pages on the destination, populating it first, against the warm page-cache load in fresh processes.
python scratch/probe_c_loop.py [--case 70mb] [--rounds 7]"""
import argparse, json, os, subprocess, sys, tempfile, time, statistics
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
sys.path.insert(0, os.path.join(HERE, ".."))
import local as bl  # bench/local.py

VARIANTS = {
    "c": {},
    "py": {"python": 1},
    "c_min512k": {"min_piece": 512 << 10},
    "c_8m": {"min_piece": 8 << 20},
    "c_k1": {"per_thread": 1},
    "c_huge": {"huge": 1},
    "c_t8": {"threads": 8},
    "c_2m": {"min_piece": 2 << 20, "per_thread": 32},
    "c_prefault": {"prefault": 1},
}


def target(args):
    v = VARIANTS[args.variant]
    import torch, xxhash  # noqa
    import modelexpress.local.client, modelexpress.local.hostcopy, modelexpress.p2p.target  # noqa
    import modelexpress.transfer.digest, modelexpress.transfer.planner, modelexpress.checkpoint  # noqa
    from modelexpress.local import hostcopy, LocalEndpoint, pull
    from modelexpress import _threads
    if v.get("python"):
        hostcopy.NATIVE = False
    if v.get("min_piece"):
        hostcopy._MIN_PIECE_BYTES = v["min_piece"]
    if v.get("per_thread"):
        hostcopy._PIECES_PER_THREAD = v["per_thread"]
    if v.get("prefault"):  # file pieces read as plain preads, destination populated first
        from modelexpress.local import memory
        orig = memory.HostMapping.read_source

        def as_memfd(self, seg, off, n):
            got = orig(self, seg, off, n)
            return None if got is None else (got[0], got[1], False)
        memory.HostMapping.read_source = as_memfd
    if v.get("threads"):
        _threads.MAX_THREADS = v["threads"]
    from modelexpress.p2p.target import allocate_like
    from modelexpress.transfer.manifest import Manifest
    info = json.load(open(args.info))
    manifest = Manifest.from_json(info["manifest"])
    endpoint = LocalEndpoint.from_json(info["endpoint"])
    t0 = time.perf_counter()
    dest = allocate_like(manifest)
    if v.get("huge"):
        for t in dest.values():
            a, n = t.data_ptr(), t.numel() * t.element_size()
            lo, hi = -(-a // (2 << 20)) * (2 << 20), (a + n) // (2 << 20) * (2 << 20)
            if hi > lo:
                hostcopy._madvise(lo, hi - lo, 14)  # MADV_HUGEPAGE
    r = pull(endpoint, manifest, dest, verify=True)
    assert r.verified == len(manifest.tensors)
    print(json.dumps({"seconds": time.perf_counter() - t0, "copy": r.phases.get("copy"),
                      "phases": r.phases}))


def fresh(variant, info, ckpt):
    if variant == "disk":
        return bl._host_target("disk", info, ckpt)["seconds"], None
    p = subprocess.run([sys.executable, __file__, "--target", "--variant", variant, "--info", info],
                       stdout=subprocess.PIPE, text=True, timeout=300)
    d = json.loads([l for l in p.stdout.splitlines() if l.startswith("{")][-1])
    return d["seconds"], d["copy"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", action="store_true")
    p.add_argument("--variant", default="c")
    p.add_argument("--info", default="")
    p.add_argument("--case", default="70mb")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    if args.target:
        return target(args)
    from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint, time_disk_load
    with tempfile.TemporaryDirectory(prefix="mx-probe-") as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        generate_llama_checkpoint(ckpt, LlamaShape(**bl.HOST_CASES[args.case]))
        info = os.path.join(tmp, "info.json")
        proc, _ = bl._start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc")], info)
        try:
            time_disk_load(ckpt, cold=False)
            names = ["disk"] + args.variants.split(",")
            secs = {k: [] for k in names}
            copy = {k: [] for k in names}
            for r in range(args.rounds):
                for k in names:
                    s, c = fresh(k, info, ckpt)
                    secs[k].append(s)
                    copy[k].append(c)
                print(json.dumps({"round": r, "ms": {k: round(secs[k][-1] * 1e3, 2) for k in names}}), flush=True)
            med = {k: statistics.median(v) for k, v in secs.items()}
            from modelexpress.local import hostcopy
            out = {"case": args.case, "cpus": os.cpu_count(), "rounds": args.rounds,
                   "c_loop_built": hostcopy.NATIVE, "c_hashes": bool(hostcopy._xxh3_address()),
                   "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
                   "copy_median_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in copy.items() if v[0] is not None},
                   "vs_disk_per_round": {k: round(statistics.median([d / s for d, s in zip(secs["disk"], secs[k])]), 3) for k in names if k != "disk"}}
            print(json.dumps(out), flush=True)
        finally:
            bl._stop(proc)


if __name__ == "__main__":
    main()
