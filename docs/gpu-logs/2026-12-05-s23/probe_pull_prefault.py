"""A/B, in whole pulls: the C loop populating each new destination piece before its
page-cache read (PREFAULT on FILE pieces: MADV_POPULATE_WRITE where mincore says the
page is new) against the faults taken inside the read (today's choice, from session
12's measurement with the Python loop). The bench's 70 MB (or 1 GiB) checkpoint and
source (bench/local.py --serve-host); per round, alternating which goes first: a
verified pull into new memory (`allocate_like`, as `modelexpress pull` gets it) and
into touched memory, with each flag; a torch copy into new memory as the baseline.
Then fresh processes (bench/local.py's --host-target, as its process_pull rows: the
imports untimed, then allocate_like + a verified pull with huge pages `auto`), each
flag alternating, against a fresh process's warm page-cache load. The switch is the module constant `hostcopy._FILE` (1: FILE; 3: FILE|PREFAULT), as the
tree stood at 271a441, where it ran on the device (probe_pull_prefault_*.log). Since
then the copier itself sets PREFAULT on page-cache reads into small new pages, so on
later trees both arms populate there.
    PYTHONPATH=. python docs/gpu-logs/2026-12-05-s23/probe_pull_prefault.py [70mb|1gib] [ROUNDS]
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch  # noqa: E402

import local as bench  # noqa: E402  bench/local.py
from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint  # noqa: E402
from modelexpress.local import LocalEndpoint, hostcopy, pull  # noqa: E402
from modelexpress.p2p.target import allocate_like  # noqa: E402
from modelexpress.transfer.manifest import Manifest  # noqa: E402

case = sys.argv[1] if len(sys.argv) > 1 else "70mb"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
FLAGS = {"faults in the read": 1, "populate first": 3}
FRESH = """import sys; sys.path.insert(0, 'bench'); import argparse, local
from modelexpress.local import hostcopy; hostcopy._FILE = int(sys.argv[1])
local.host_target(argparse.Namespace(host_target=sys.argv[2], info=sys.argv[3]))"""


def fresh_process(flag, what, info_path):
    out = subprocess.run([sys.executable, "-c", FRESH, str(flag), what, info_path],
                         stdout=subprocess.PIPE, text=True, timeout=300, check=True).stdout
    return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])

with tempfile.TemporaryDirectory(dir=os.environ.get("PROBE_DIR", os.getcwd())) as tmp:
    ckpt = os.path.join(tmp, "ckpt")
    generate_llama_checkpoint(ckpt, LlamaShape(**bench.HOST_CASES[case]))
    proc, info = bench._start_source(["--serve-host", ckpt, "--ipc-dir",
                                      os.path.join(tmp, "ipc")], os.path.join(tmp, "info.json"))
    try:
        endpoint = LocalEndpoint.from_json(info["endpoint"])
        manifest = Manifest.from_json(info["manifest"])
        total = manifest.total_bytes
        src = torch.ones(total, dtype=torch.uint8)
        touched = allocate_like(manifest)
        for t in touched.values():
            t.view(-1).view(torch.uint8).fill_(0)
        for _ in range(3):  # warm-up: imports, the C loop's pool, the page cache
            pull(endpoint, manifest, touched, verify=True)
        rows = {}
        for rnd in range(rounds):
            bench._settle()
            fresh = torch.empty(total, dtype=torch.uint8)
            t0 = time.perf_counter(); fresh.copy_(src)
            rows.setdefault("torch copy, new", []).append(time.perf_counter() - t0)
            del fresh
            order = list(FLAGS.items())
            for name, flag in order if rnd % 2 == 0 else order[::-1]:
                hostcopy._FILE = flag
                try:
                    for where in ("new", "touched"):
                        dest = allocate_like(manifest) if where == "new" else touched
                        bench._settle()
                        r = pull(endpoint, manifest, dest, verify=True)
                        assert r.verified == len(manifest.tensors)
                        rows.setdefault(f"page-cache share {where}, {name}", []).append(
                            r.page_cache_bytes / total)
                        rows.setdefault(f"pull {where}, {name}", []).append(r.seconds)
                        rows.setdefault(f"copy phase {where}, {name}", []).append(
                            r.phases["copy"])
                        del dest
                finally:
                    hostcopy._FILE = 1
        info_path = os.path.join(tmp, "info.json")
        for rnd in range(max(3, rounds // 2)):
            rows.setdefault("fresh process: disk load", []).append(
                fresh_process(1, f"disk:{ckpt}", info_path)["seconds"])
            for name, flag in order if rnd % 2 == 0 else order[::-1]:
                r = fresh_process(flag, f"pull:{ckpt}", info_path)
                rows.setdefault(f"fresh process: pull, {name}", []).append(r["seconds"])
                rows.setdefault(f"fresh process: copy phase, {name}", []).append(
                    r["phases"]["copy"])
    finally:
        bench._stop(proc)
    print(f"{case}: {total / 1e6:.1f} MB, {hostcopy.copy_threads()} copy threads, {rounds} "
          f"rounds, load {os.getloadavg()[0]:.2f}; medians")
    for k, v in rows.items():
        if k.startswith("page-cache share"):
            print(f"  {k:38s} {statistics.median(v):.3f} (min {min(v):.3f})")
            continue
        print(f"  {k:38s} {statistics.median(v) * 1e3:7.2f} ms  (min {min(v) * 1e3:.2f})")
    base = statistics.median(rows["torch copy, new"])
    for name in FLAGS:
        print(f"  pull new / torch copy new, {name}: "
              f"{base / statistics.median(rows[f'pull new, {name}']):.3f}; fresh process, "
              f"disk load / pull: {statistics.median(rows['fresh process: disk load']) / statistics.median(rows[f'fresh process: pull, {name}']):.3f}")
