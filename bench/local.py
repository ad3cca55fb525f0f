"""The local transport (modelexpress.local) against a device copy measured in the same run.

A source process holds one tensor-parallel rank of Llama-3.1-70B at TP=8 (vLLM's fused
layout, bench/transfer.py's ``llama70b_tp8_shapes``; ``--layers`` scales it down) on
``cuda:0``, in PyTorch's caching allocator (served as CUDA IPC handles) or, with the
arena on (what ``MX_VMM_ARENA=1`` does), in the VMM arena (served as POSIX-fd handles).
This process is the target: it allocates the same tensors (in its own arena when the
arena is on), pulls them over the local transport, and measures in the same run:

* ``copy_one``: one 2 GiB ``copy_`` from the source device to the destination device
  (same GPU: device-to-device; ``cuda:0 -> cuda:1``: the peer copy);
* ``copy_set``: the same weight set copied tensor by tensor in one process (the work
  the pull does, without the transport);
* the pull: copy-phase GB/s (``--repeat`` pulls without digests), the whole pull's
  time (connect + map + copy + close), and one pull with digests verified.

Ratios are the pull's copy-phase rate over ``copy_one`` and ``copy_set``. Where NIXL is
installed, the source also times registering its tensors with NIXL (per tensor; per
arena chunk) and the agent metadata size: the cost a source would skip if every peer
were local.

Prints one line per result and ONE JSON object on the last line.
Usage: python bench/local.py [--layers 80] [--repeat 3] [--arena off,on] [--dst cuda:0,cuda:1]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

GIB = 1 << 30


def _shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    from transfer import llama70b_tp8_shapes  # bench/transfer.py
    return llama70b_tp8_shapes(layers)


def _allocate(shapes: list[tuple[str, tuple[int, ...]]], device: str) -> dict[str, Any]:
    from transfer import allocate
    return allocate(shapes, device)


# -- source process ----------------------------------------------------------------------
def serve(args: argparse.Namespace) -> None:
    import torch

    from modelexpress.local import LocalSource, host_id
    from modelexpress.transfer.manifest import build_manifest
    from modelexpress.vmm import maybe_enter_vmm_arena
    from transfer import fill

    dev = torch.device(args.device).index or 0
    torch.cuda.set_device(dev)
    arena = None
    if args.arena == "on":
        with maybe_enter_vmm_arena(True, dev) as arena:
            if arena is None:
                raise SystemExit("the VMM arena is unavailable here")
            tensors = _allocate(_shapes(args.layers), args.device)
    else:
        tensors = _allocate(_shapes(args.layers), args.device)
    fill(tensors)
    torch.cuda.synchronize(dev)
    info: dict[str, Any] = {"arena": args.arena}
    t0 = time.perf_counter()
    src = LocalSource(args.ipc_dir, host_id=host_id())
    if arena is not None:
        src.add_vmm_arena(arena)
    src.add_tensors(tensors)
    info["local_register_s"] = time.perf_counter() - t0
    info["segments"] = len(src.segments)
    t0 = time.perf_counter()
    manifest = build_manifest(tensors, agent_name="bench-local")
    info["manifest_digest_s"] = time.perf_counter() - t0
    info["nixl"] = _nixl_registration(tensors, arena, dev)
    src.start()
    info.update(endpoint=src.endpoint.to_json(), manifest=manifest.to_json())
    tmp = args.info + ".tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.rename(tmp, args.info)
    sys.stdin.read()
    src.close()
    if arena is not None:
        del tensors
        arena.close()


def _nixl_registration(tensors: dict[str, Any], arena: Any, dev: int) -> dict[str, Any]:
    from modelexpress._optional import available
    if not any(available(m) for m in ("nixl", "nixl_cu13", "nixl_cu12")):
        return {"skipped": "nixl is not installed"}
    from modelexpress.transfer.nixl_adapter import NixlAgent
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    agent = NixlAgent()
    out["agent_create_s"] = time.perf_counter() - t0
    try:
        sets = {"per_tensor": [(t.data_ptr(), t.numel() * t.element_size(), dev)
                               for t in tensors.values()]}
        if arena is not None:
            sets["per_chunk"] = [(va, size, dev) for va, size in arena.live_allocations()]
        for name, regions in sets.items():
            t0 = time.perf_counter()
            handle = agent.register(regions, "VRAM")
            out[f"{name}_register_s"] = time.perf_counter() - t0
            out[f"{name}_regions"] = len(regions)
            out[f"{name}_metadata_bytes"] = len(agent.metadata())
            t0 = time.perf_counter()
            agent.deregister(handle)
            out[f"{name}_deregister_s"] = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - reported in the output, the bench goes on
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        agent.close()
    return out


# -- target (this process) -----------------------------------------------------------------
def _time_copy(fn: Any, devices: list[int], repeat: int) -> float:
    import torch
    best = float("inf")
    for _ in range(repeat):
        for d in devices:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        fn()
        for d in devices:
            torch.cuda.synchronize(d)
        best = min(best, time.perf_counter() - t0)
    return best


def _probe_span(endpoint: Any, d: int) -> dict[str, Any]:
    """Does one cuMemcpyAsync across two adjacent imported VMM chunks work (then the
    pull could merge copies across chunks)? Tried once, its outcome recorded."""
    import torch

    from modelexpress.local import LocalSession
    from modelexpress.local.cuda import memcpy_async, on_device
    with LocalSession(endpoint, device=d) as s, on_device(d):
        where = s.cuda_map._where  # (src_addr, src_end, local_addr), sorted; bench-only peek
        for (a0, e0, l0), (a1, e1, l1) in zip(where, where[1:]):
            if e0 == a1 and l1 == l0 + (a1 - a0):
                n = (e0 - a0) + (e1 - a1)
                buf = torch.empty(n, dtype=torch.uint8, device=f"cuda:{d}")
                try:
                    memcpy_async(buf.data_ptr(), l0, n, torch.cuda.current_stream(d).cuda_stream)
                    torch.cuda.synchronize(d)
                    return {"ok": True, "bytes": n}
                except Exception as exc:  # noqa: BLE001 - the outcome is the measurement
                    return {"ok": False, "bytes": n, "error": str(exc)}
    return {"ok": None, "why": "no two adjacent chunks"}


def run_case(args: argparse.Namespace, arena_mode: str, dst: str, tmp: str) -> dict[str, Any]:
    import torch

    from modelexpress.local import LocalEndpoint, pull
    from modelexpress.transfer.manifest import Manifest
    from modelexpress.vmm import maybe_enter_vmm_arena

    info_path = os.path.join(tmp, f"info-{arena_mode}-{dst.replace(':', '')}.json")
    src_dev = "cuda:0"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", "--info", info_path,
                             "--layers", str(args.layers), "--arena", arena_mode,
                             "--device", src_dev, "--ipc-dir", os.path.join(tmp, "ipc")],
                            stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(info_path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"source failed (exit {proc.poll()})")
            time.sleep(0.1)
        info = json.load(open(info_path))
        endpoint = LocalEndpoint.from_json(info["endpoint"])
        manifest = Manifest.from_json(info["manifest"])
        d = torch.device(dst).index or 0
        torch.cuda.set_device(d)
        shapes = _shapes(args.layers)
        my_arena = None
        if arena_mode == "on":
            with maybe_enter_vmm_arena(True, d) as my_arena:
                local = _allocate(shapes, dst)
        else:
            local = _allocate(shapes, dst)
        total = manifest.total_bytes
        # ceilings, same run, same process
        a = torch.empty(2 * GIB, dtype=torch.uint8, device=src_dev)
        b = torch.empty(2 * GIB, dtype=torch.uint8, device=dst)
        copy_one = 2 * GIB / _time_copy(lambda: b.copy_(a, non_blocking=True), [0, d], 5) / 1e9
        a = b = None  # free the 2 x 2 GiB before the pulls
        # The set copy goes between plain allocations: a peer copy into VMM memory that
        # only its own device may access (the target's arena) is refused by the runtime.
        here = _allocate(shapes, src_dev)
        there = _allocate(shapes, dst) if arena_mode == "on" else local
        copy_set = total / _time_copy(
            lambda: [there[k].copy_(here[k], non_blocking=True) for k in here], [0, d], 3) / 1e9
        here = there = None
        torch.cuda.empty_cache()
        pulls = []
        for _ in range(args.repeat):
            res = pull(endpoint, manifest, local, verify=False)
            pulls.append(res)
        verified = pull(endpoint, manifest, local, verify=True)
        span_probe = _probe_span(endpoint, d) if arena_mode == "on" else None
        best = max(pulls, key=lambda r: r.gbps)
        out = {
            "arena": arena_mode, "src": src_dev, "dst": dst, "bytes": total,
            "tensors": len(manifest.tensors), "segments": best.segments, "copies": best.copies,
            "copy_one_gbps": round(copy_one, 1), "copy_set_gbps": round(copy_set, 1),
            "pull_copy_gbps": [round(r.gbps, 1) for r in pulls],
            "pull_whole_s": [round(r.seconds, 4) for r in pulls],
            "pull_phases_best": {k: round(v, 4) for k, v in best.phases.items()},
            "ratio_copy_one": round(best.gbps / copy_one, 3),
            "ratio_copy_set": round(best.gbps / copy_set, 3),
            "ratio_whole_copy_one": round(total / min(r.seconds for r in pulls) / 1e9 / copy_one, 3),
            "verified_pull_s": round(verified.seconds, 4), "verified": verified.verified,
            "verified_phases": {k: round(v, 4) for k, v in verified.phases.items()},
            "source_local_register_s": round(info["local_register_s"], 4),
            "source_segments": info["segments"], "nixl": info["nixl"],
            "copy_across_vmm_chunks": span_probe,
        }
        del local
        if my_arena is not None:
            my_arena.close()
        torch.cuda.empty_cache()
        return out
    finally:
        if proc.poll() is None:
            proc.stdin.close()  # type: ignore[union-attr]
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--arena", default="off,on")
    p.add_argument("--dst", default="", help="destination devices (default cuda:0 and cuda:1 if present)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--info", default="", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda:0", help=argparse.SUPPRESS)
    p.add_argument("--ipc-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args)
        return
    import torch
    dsts = args.dst.split(",") if args.dst else (
        ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cuda:0"])
    results = []
    with tempfile.TemporaryDirectory(prefix="mxl-") as tmp:
        for dst in dsts:
            for mode in args.arena.split(","):
                r = run_case(args, mode, dst, tmp)
                print(f"arena={mode} cuda:0->{dst}: {r['bytes'] / 1e9:.2f} GB {r['tensors']} tensors "
                      f"{r['segments']} {r['copies']} copies | pull {r['pull_copy_gbps']} GB/s "
                      f"(whole {r['pull_whole_s']} s) | copy_one {r['copy_one_gbps']} "
                      f"copy_set {r['copy_set_gbps']} GB/s | ratio {r['ratio_copy_one']} / "
                      f"{r['ratio_copy_set']} (whole pull {r['ratio_whole_copy_one']}) | "
                      f"phases {r['pull_phases_best']} | verified pull {r['verified_pull_s']} s | "
                      f"nixl {r['nixl']}", flush=True)
                results.append(r)
    print(json.dumps({"bench": "local", "layers": args.layers, "gpu": torch.cuda.get_device_name(0),
                      "results": results}))


if __name__ == "__main__":
    main()
