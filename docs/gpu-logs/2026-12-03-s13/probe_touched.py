"""Device probe (session 13, not part of the package; kept with its output): in-process
verified pulls into touched memory (the 70mb and 1gib cases) with the C loop at several
piece floors and the Python loop, each against a memcpy of the same bytes in the same
round. python scratch/probe_touched.py [--cases 70mb] [--rounds 15]"""
import argparse, json, os, sys, tempfile, time, statistics
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
sys.path.insert(0, os.path.join(HERE, ".."))
import local as bl  # bench/local.py

VARIANTS = {"c_1m": (True, 1 << 20), "c_512k": (True, 512 << 10), "c_2m": (True, 2 << 20),
            "c_8m": (True, 8 << 20), "py": (False, 1 << 20)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="70mb")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    import torch
    from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint, time_disk_load
    from modelexpress.local import LocalEndpoint, hostcopy, pull
    from modelexpress.p2p.target import allocate_like
    from modelexpress.transfer.manifest import Manifest
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory(prefix="mx-probe-") as tmp:
            ckpt = os.path.join(tmp, "ckpt")
            generate_llama_checkpoint(ckpt, LlamaShape(**bl.HOST_CASES[case]))
            info = os.path.join(tmp, "info.json")
            proc, d = bl._start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc")], info)
            try:
                ep, man = LocalEndpoint.from_json(d["endpoint"]), Manifest.from_json(d["manifest"])
                total = man.total_bytes
                src, dst = torch.ones(total, dtype=torch.uint8), torch.zeros(total, dtype=torch.uint8)
                dest = allocate_like(man)
                for t in dest.values():
                    t.view(-1).view(torch.uint8).fill_(0)
                time_disk_load(ckpt, cold=False)
                times = {k: [] for k in ["memcpy", *VARIANTS]}
                copy = {k: [] for k in VARIANTS}
                for _ in range(args.rounds):
                    t0 = time.perf_counter(); dst.copy_(src); times["memcpy"].append(time.perf_counter() - t0)
                    for k, (native, floor) in VARIANTS.items():
                        hostcopy.NATIVE, hostcopy._MIN_PIECE_BYTES = native, floor
                        r = pull(ep, man, dest)
                        assert r.verified == len(man.tensors)
                        times[k].append(r.seconds); copy[k].append(r.phases["copy"])
                out = {"case": case, "bytes": total, "cpus": os.cpu_count(), "rounds": args.rounds,
                       "median_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()},
                       "copy_median_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in copy.items()},
                       "vs_memcpy_per_round": {k: round(statistics.median([m / s for m, s in zip(times["memcpy"], times[k])]), 3) for k in VARIANTS}}
                print(json.dumps(out), flush=True)
            finally:
                bl._stop(proc)


if __name__ == "__main__":
    main()
