"""Device probe, run from scratch/ of the working tree at commit e55e842 (session 12; kept
here with its output, not part of the package): fresh-process pulls with prefault of page-cache
destinations on/off and piece floors, vs the warm page-cache load; in-process touched
and fresh pulls vs memcpy. python scratch/probe_prefault.py [--cases 70mb,1gib] [--rounds 7]"""
import argparse, json, os, subprocess, sys, tempfile, time, statistics
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
sys.path.insert(0, os.path.join(HERE, ".."))
import local as bl  # bench/local.py

VARIANTS = {
    "base": {},
    "prefault": {"prefault": 1},
    "prefault_2m": {"prefault": 1, "min_piece": 2 << 20},
    "base_8m": {"min_piece": 8 << 20},
    "prefault_8m": {"prefault": 1, "min_piece": 8 << 20},
}


def patch(v):
    from modelexpress.local import hostcopy, memory
    if v.get("prefault"):
        memory.HostMapping.from_file = lambda self, seg: False
    if v.get("min_piece"):
        hostcopy._MIN_PIECE_BYTES = v["min_piece"]


def target(args):
    v = VARIANTS[args.variant]
    import torch, xxhash  # noqa
    import modelexpress.local.client, modelexpress.local.hostcopy, modelexpress.p2p.target  # noqa
    patch(v)
    from modelexpress.local import LocalEndpoint, pull
    from modelexpress.p2p.target import allocate_like
    from modelexpress.transfer.manifest import Manifest
    info = json.load(open(args.info))
    manifest = Manifest.from_json(info["manifest"])
    endpoint = LocalEndpoint.from_json(info["endpoint"])
    t0 = time.perf_counter()
    dest = allocate_like(manifest)
    r = pull(endpoint, manifest, dest, verify=True)
    assert r.verified == len(manifest.tensors)
    print(json.dumps({"seconds": time.perf_counter() - t0, "copy": r.phases.get("copy")}))


def fresh(variant, info, ckpt):
    if variant == "disk":
        return bl._host_target("disk", info, ckpt)["seconds"], None
    p = subprocess.run([sys.executable, __file__, "--target", "--variant", variant, "--info", info],
                       stdout=subprocess.PIPE, text=True, timeout=300)
    d = json.loads([l for l in p.stdout.splitlines() if l.startswith("{")][-1])
    return d["seconds"], d["copy"]


def in_process(info_path, rounds):
    import torch
    from modelexpress.local import LocalEndpoint, pull, hostcopy, memory
    from modelexpress.p2p.target import allocate_like
    from modelexpress.transfer.manifest import Manifest
    info = json.load(open(info_path))
    manifest = Manifest.from_json(info["manifest"])
    endpoint = LocalEndpoint.from_json(info["endpoint"])
    total = manifest.total_bytes
    src = torch.ones(total, dtype=torch.uint8); dst = torch.zeros(total, dtype=torch.uint8)
    warm = allocate_like(manifest)
    for x in warm.values():
        x.view(-1).view(torch.uint8).fill_(0)
    orig_ff, orig_min = memory.HostMapping.from_file, hostcopy._MIN_PIECE_BYTES
    t = {"memcpy": []}
    for _ in range(rounds):
        t0 = time.perf_counter(); dst.copy_(src); t["memcpy"].append(time.perf_counter() - t0)
        for n, v in VARIANTS.items():
            memory.HostMapping.from_file, hostcopy._MIN_PIECE_BYTES = orig_ff, orig_min
            patch(v)
            d = allocate_like(manifest)
            r = pull(endpoint, manifest, d, verify=True)
            t.setdefault(n + "_fresh", []).append(r.seconds)
            del d
            r = pull(endpoint, manifest, warm, verify=True)
            t.setdefault(n + "_touched", []).append(r.seconds)
    memory.HostMapping.from_file, hostcopy._MIN_PIECE_BYTES = orig_ff, orig_min
    res = {n: round(statistics.median(v) * 1e3, 2) for n, v in t.items()}
    res["touched_over_memcpy"] = {n: round(statistics.median(
        [m / x for m, x in zip(t["memcpy"], t[n + "_touched"])]), 3) for n in VARIANTS}
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", action="store_true")
    ap.add_argument("--variant", default="base")
    ap.add_argument("--info")
    ap.add_argument("--cases", default="70mb,1gib")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if args.target:
        return target(args)
    from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint, time_disk_load
    tmp = tempfile.mkdtemp()
    out = {}
    for case in args.cases.split(","):
        ckpt = os.path.join(tmp, f"ckpt-{case}")
        generate_llama_checkpoint(ckpt, LlamaShape(**bl.HOST_CASES[case]))
        info = os.path.join(tmp, f"info-{case}.json")
        proc, _ = bl._start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc")], info)
        try:
            time_disk_load(ckpt, cold=False)
            names = ["disk", *VARIANTS]
            t = {n: [] for n in names}
            c = {n: [] for n in names}
            for _ in range(args.rounds):
                for n in names:
                    s, cp = fresh(n, info, ckpt)
                    t[n].append(s); c[n].append(cp)
            inproc = in_process(info, args.rounds)
            med = {n: round(statistics.median(v) * 1e3, 2) for n, v in t.items()}
            ratio = {n: round(statistics.median([d / x for d, x in zip(t["disk"], t[n])]), 3)
                     for n in VARIANTS}
            cmed = {n: round(statistics.median(v) * 1e3, 2) for n, v in c.items() if v[0] is not None}
            out[case] = {"ms": med, "copy_ms": cmed, "load_over_pull": ratio, "in_process": inproc}
            print(case, json.dumps(out[case]), flush=True)
        finally:
            bl._stop(proc)
    print(json.dumps({"probe": "prefault", "cpus": os.cpu_count(), "results": out}))


if __name__ == "__main__":
    main()
