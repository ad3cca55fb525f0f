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

Two more modes:

``--host`` (CPU): a source process loads a generated Llama-shaped checkpoint into a
memfd-backed buffer (``load_checkpoint_shared``, what ``modelexpress publish`` does)
and serves it; this process pulls it over the local transport with digests verified
(``modelexpress.local.pull``) and measures, interleaved in each round so that a busy
machine moves them together: ``memcpy_warm`` (``copy_`` between two touched buffers
of the same size, bench/p2p.py's memcpy), ``memcpy_fresh`` (into a new allocation:
the page faults every load into new memory pays; ``_populated``: its pages populated
first, ``_huge``: in transparent huge pages), the pull into a new destination
(``allocate_like``, as ``modelexpress pull`` does) and into a touched one, loading the
same checkpoint from a warm page cache (``time_disk_load``), and the copy strategies
one by one (each a whole pull: connect, map, copy, digests, close): copies from the
mapping with torch (the transport's first design), ``pread`` on one thread then on
N threads with digests after the copy, and with digests alongside; ``pull_*`` rows
read the checkpoint file's page cache (what ``pull`` does from a source that
``modelexpress publish`` loaded), ``*_memfd`` rows pull the same from a second
source that serves the memfd alone (``--memfd-only``, the transport before the
page-cache path); then, in fresh processes (``process_disk`` / ``process_pull``: a warm
page-cache load, a verified pull into ``allocate_like``'s memory, each timed alone in
a new process, as a user's command or a new engine meets them: nothing in the heap
to reuse). ``*_pyloop`` rows are the same pulls with the copy's pieces run in Python
threads (``hostcopy.NATIVE`` off: the loop before the C one, and where it is not
built); ``c_loop_vs_python_loop`` compares them. ``process_pull_hugeon`` /
``_hugeoff`` are the fresh-process pull with ``MX_LOCAL_HUGE_PAGES`` forced on / off
(``process_pull`` is the default, ``auto``: ``huge_pages_default_used`` says what it
chose; ``huge_on_vs_off`` compares the two). ``pull_warm_otherblocks`` is the pull
into touched memory against the same source with its digests recomputed in the other
block size (``xxh3-128-b8m`` where the source published ``xxh3-128-b1m``, and the
reverse; ``blocks_default_vs_other`` > 1: the default is faster), in alternating order
with ``pull_warm``; ``pull_warm_unverified`` the same pull with ``verify=False`` (what
hashing costs). Ratios are per round (same moment),
medians reported, and from each
measurement's best round (``best_ratios``: what the machine does when nothing else
runs, on a shared CI machine the steadier figure). Cases ``1gib``
(1.07 GB, 57 tensors) and ``70mb`` (70.5 MB, 33 tensors).

``--gpu-first`` (GPU): first vs later verified pull in fresh processes. A source
process serves ``--layers`` layers of the 70B TP=8 rank on cuda:0; each target is a
fresh process that pulls three times onto cuda:0 (``modelexpress.local.pull``,
digests verified), in three modes: ``auto`` (the code as shipped: the pull loads the
shipped digest kernel through the driver as it starts), ``triton-bg`` (what runs where
the driver refuses the shipped kernel: the Triton kernel builds on a background thread
and digests use the torch form until it is ready) and ``inline`` (no warm-up at all:
the first verification waits for the Triton kernel, ``impl="triton"``); each with
empty caches (``TRITON_CACHE_DIR`` and the driver's PTX cache ``CUDA_CACHE_PATH``
fresh: a machine's first engine) and with warm ones. The later pulls start once any
build is done (the target waits for it, untimed, as a pull a few seconds later finds
it). Reported per target: each pull's seconds, every phase of ``pull()``, the time
outside them, the digest form that verified it (``verified_by``), the kernel's state
and build time; ``first_over_later`` is the first pull's seconds over the median of
the later ones (``first_verify_over_later`` the same for verification), and
``first_verify_within`` checks the bound (first verification within max(2 x
data plane, 50 ms)). Before the targets, a probe times first-call costs one by one in
fresh processes (CUDA context, cuda-python import, device UUIDs, stream creation, the
shipped kernel's load and first call): as loaded (the fatbin), and its PTX alone with
an empty and with a warm driver cache.

Prints one line per result and ONE JSON object on the last line.
Usage: python bench/local.py [--layers 80] [--repeat 3] [--arena off,on] [--dst cuda:0,cuda:1]
       python bench/local.py --host [--cases 1gib,70mb] [--rounds 5]
       python bench/local.py --gpu-first [--layers 28] [--trials 2]
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


# -- --host: host pulls against memcpy and a warm page-cache load ---------------------------
HOST_CASES = {  # name -> checkpoint LlamaShape arguments (bf16)
    "1gib": dict(hidden=2048, intermediate=5632, heads=16, kv_heads=4, vocab=32000, layers=9),
    "70mb": dict(hidden=384, intermediate=1536, heads=6, kv_heads=6, vocab=30522, layers=5),
}


def serve_host(args: argparse.Namespace) -> None:
    """Source process of --host: the checkpoint in a memfd-backed buffer, served locally
    (with the checkpoint file's page cache, as ``modelexpress publish`` does; with
    ``--memfd-only`` the memfd alone, the transport before the page-cache path)."""
    from modelexpress.checkpoint import load_checkpoint, load_checkpoint_shared
    from modelexpress.local import LocalSource, host_buffer_like, host_id, publish_attributes
    from modelexpress.transfer.manifest import build_manifest
    if args.memfd_only:
        buf, tensors = host_buffer_like(load_checkpoint(args.serve_host))
    else:
        buf, tensors = load_checkpoint_shared(args.serve_host)
    src = LocalSource(args.ipc_dir, host_id=host_id())
    src.add_host_buffer(buf)
    manifest = build_manifest(tensors, agent_name="bench-local-host",
                              attributes=publish_attributes(src),
                              digest_algorithm=args.digest or None)
    src.start()
    tmp = args.info + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"endpoint": src.endpoint.to_json(), "manifest": manifest.to_json()}, f)
    os.rename(tmp, args.info)
    sys.stdin.read()
    src.close()
    buf.close()


def _start_source(cmd: list[str], info_path: str) -> tuple[subprocess.Popen, dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, __file__, *cmd, "--info", info_path],
                            stdin=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not os.path.exists(info_path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"source failed (exit {proc.poll()})")
        time.sleep(0.1)
    return proc, json.load(open(info_path))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _variant(endpoint: Any, manifest: Any, dest: dict[str, Any], how: str) -> float:
    """One whole pull done a given way (connect, map, copy, digests, close); seconds."""
    import torch

    from modelexpress.local import LocalSession
    from modelexpress.local.hostcopy import HostCopier
    from modelexpress.transfer.digest import digest_many
    t0 = time.perf_counter()
    with LocalSession(endpoint) as s:
        order = sorted(manifest.tensors, key=lambda t: t.addr)
        if how == "mapped_torch":  # the first design: torch copy_ out of the mapping
            import ctypes
            for t in order:
                if t.nbytes:
                    src = (ctypes.c_uint8 * t.nbytes).from_address(
                        s.local_addr(t.addr, t.nbytes, host=True))
                    dest[t.name].view(-1).view(torch.uint8).copy_(
                        torch.frombuffer(src, dtype=torch.uint8))
        else:
            copier = HostCopier(s.host_map, threads=1 if how == "pread_1" else None)
            copier.copy([(*s.host_segment(t.addr, t.nbytes), dest[t.name].data_ptr(), t.nbytes)
                         for t in order if t.nbytes])
            copier.close()
        got = digest_many([dest[t.name] for t in order], manifest.digest_algorithm)
        assert got == [t.digest for t in order], f"{how}: digests differ"
    return time.perf_counter() - t0


def _other_blocks(manifest: Any, ckpt: str) -> Any:
    """``manifest`` with its digests in the other block size of the block-wise xxh3
    digest (computed from the checkpoint's bytes: what the source serves); None where
    the manifest's digest has no blocks."""
    import dataclasses

    from modelexpress.checkpoint import load_checkpoint
    from modelexpress.transfer import digest
    other = {digest.XXH3_BLOCKS: digest.XXH3_BLOCKS_1M,
             digest.XXH3_BLOCKS_1M: digest.XXH3_BLOCKS}.get(manifest.digest_algorithm)
    if other is None:
        return None
    ref = load_checkpoint(ckpt)
    values = digest.digest_many([ref[t.name] for t in manifest.tensors], other)
    return dataclasses.replace(manifest, digest_algorithm=other, tensors=tuple(
        dataclasses.replace(t, digest=v) for t, v in zip(manifest.tensors, values)))


def _populate(addr: int, nbytes: int, huge: bool) -> None:
    from modelexpress.local import pages
    if huge:
        lo, hi = -(-addr // (2 << 20)) * (2 << 20), (addr + nbytes) // (2 << 20) * (2 << 20)
        pages.madvise(lo, max(0, hi - lo), pages.MADV_HUGEPAGE)
    start = addr & ~4095
    pages.madvise(start, (addr + nbytes - start + 4095) & ~4095, pages.MADV_POPULATE_WRITE)


def _settle() -> None:
    """Let torch's intra-op (OpenMP) threads go idle before the next timed row: after a
    parallel copy they spin for a few milliseconds (libgomp's spin-wait), and a pull
    timed in that window shares the cores with them (the 16-core host, a 70 MB pull
    into touched memory: 7.6 ms as the first pull after a memcpy, 3.0-3.5 ms later in
    the same round). Every row waits alike, the baselines too."""
    time.sleep(0.05)


def _median(xs: list[float]) -> float:
    import statistics
    return statistics.median(xs)


def host_target(args: argparse.Namespace) -> None:
    """A fresh process of --host: one warm page-cache load or one verified pull (into
    ``allocate_like``'s new memory), timed alone; one JSON line (a pull's with its
    phases and the allocation's seconds)."""
    what, ckpt = args.host_target.split(":", 1)
    # Imports first, untimed: both a loader and a pull pay them, and they are not the
    # weights' time (bench/p2p.py --small measures a command's whole time).
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import xxhash  # noqa: F401

    import modelexpress.checkpoint  # noqa: F401
    import modelexpress.local.client  # noqa: F401
    import modelexpress.local.hostcopy  # noqa: F401
    import modelexpress.local.hugepages  # noqa: F401
    import modelexpress.local.memory  # noqa: F401
    import modelexpress.p2p.target  # noqa: F401
    import modelexpress.transfer.digest  # noqa: F401
    import modelexpress.transfer.planner  # noqa: F401
    if what == "disk":
        from modelexpress.checkpoint import time_disk_load
        print(json.dumps({"seconds": time_disk_load(ckpt, cold=False)}))
        return
    from modelexpress.local import LocalEndpoint, hostcopy, pull
    from modelexpress.p2p.manifests import allocate_like
    from modelexpress.transfer.manifest import Manifest
    hostcopy.NATIVE = what != "pull-pyloop"  # the C piece loop, or the Python one
    # MX_LOCAL_HUGE_PAGES of the pull: the default (auto), or forced on / off
    huge = {"pull-hugeon": "on", "pull-hugeoff": "off"}.get(what, "auto")
    info = json.load(open(args.info))
    manifest = Manifest.from_json(info["manifest"])
    endpoint = LocalEndpoint.from_json(info["endpoint"])
    t0 = time.perf_counter()
    dest = allocate_like(manifest)
    t1 = time.perf_counter()
    r = pull(endpoint, manifest, dest, verify=True, huge_pages=huge)
    assert r.verified == len(manifest.tensors), r
    print(json.dumps({"seconds": time.perf_counter() - t0, "allocate": t1 - t0,
                      "phases": r.phases, "page_cache_bytes": r.page_cache_bytes,
                      "huge_pages": r.huge_pages}))


def _host_target(what: str, info_path: str, ckpt: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--host-target", f"{what}:{ckpt}",
                           "--info", info_path], stdout=subprocess.PIPE, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"--host-target {what} exited {proc.returncode}")
    return json.loads(lines[-1])


def host_case(name: str, rounds: int, tmp: str, fresh_rounds: int = 3,
              digest_algorithm: str = "") -> dict[str, Any]:
    import torch

    from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint, time_disk_load
    from modelexpress.local import LocalEndpoint, hostcopy, pull
    from modelexpress.local.hostcopy import copy_threads
    from modelexpress.p2p.manifests import allocate_like
    from modelexpress.transfer.manifest import Manifest
    ckpt = os.path.join(tmp, f"ckpt-{name}")
    generate_llama_checkpoint(ckpt, LlamaShape(**HOST_CASES[name]))
    info_path = os.path.join(tmp, f"info-{name}.json")
    info_memfd = os.path.join(tmp, f"info-{name}-memfd.json")
    forced = ["--digest", digest_algorithm] if digest_algorithm else []
    proc, info = _start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc"),
                                *forced], info_path)
    proc_m, info_m = _start_source(["--serve-host", ckpt, "--ipc-dir", os.path.join(tmp, "ipc"),
                                    "--memfd-only", *forced], info_memfd)
    try:
        endpoint = LocalEndpoint.from_json(info["endpoint"])
        endpoint_m = LocalEndpoint.from_json(info_m["endpoint"])
        manifest = Manifest.from_json(info["manifest"])
        manifest_m = Manifest.from_json(info_m["manifest"])
        total = manifest.total_bytes
        src = torch.ones(total, dtype=torch.uint8)
        dst = torch.zeros(total, dtype=torch.uint8)
        warm_dest = allocate_like(manifest)
        for t in warm_dest.values():
            t.view(-1).view(torch.uint8).fill_(0)
        time_disk_load(ckpt, cold=False)  # the page cache holds the checkpoint from here on
        native = hostcopy.NATIVE
        manifest_other = _other_blocks(manifest, ckpt)
        keys = ("memcpy_warm", "memcpy_fresh", "memcpy_fresh_populated", "memcpy_fresh_huge",
                "pull_fresh", "pull_warm", "pull_fresh_memfd", "pull_warm_memfd", "disk_warm",
                "mapped_torch", "pread_1", "pread_n", "process_disk", "process_pull",
                "process_pull_memfd", "pull_fresh_pyloop", "pull_warm_pyloop",
                "process_pull_pyloop", "process_pull_hugeon", "process_pull_hugeoff",
                "pull_warm_otherblocks", "pull_warm_unverified")
        times: dict[str, list[float]] = {k: [] for k in keys}
        phases_fresh: list[dict[str, float]] = []
        phases_warm: list[dict[str, float]] = []
        phases_process: list[dict[str, float]] = []
        huge_used: list[bool] = []  # whether each default fresh-process pull used huge pages
        page_cache: list[float] = []  # fraction of the pull's bytes read from the page cache
        for rnd in range(rounds):
            _settle()
            t0 = time.perf_counter()
            dst.copy_(src)
            times["memcpy_warm"].append(time.perf_counter() - t0)
            fresh = torch.empty(total, dtype=torch.uint8)
            _settle()
            t0 = time.perf_counter()
            fresh.copy_(src)
            times["memcpy_fresh"].append(time.perf_counter() - t0)
            del fresh
            # The same into new memory populated first, in small pages and in huge pages
            # (what hostcopy._prefault does, and the huge-page variant it does not).
            for key, huge in (("memcpy_fresh_populated", False), ("memcpy_fresh_huge", True)):
                fresh = torch.empty(total, dtype=torch.uint8)
                _settle()
                t0 = time.perf_counter()
                _populate(fresh.data_ptr(), total, huge)
                fresh.copy_(src)
                times[key].append(time.perf_counter() - t0)
                del fresh
            dest = allocate_like(manifest)  # new memory, as `modelexpress pull` gets it
            _settle()
            r = pull(endpoint, manifest, dest, verify=True)
            assert r.verified == len(manifest.tensors), r
            times["pull_fresh"].append(r.seconds)
            phases_fresh.append(r.phases)
            del dest
            # Into touched memory: as published, and (alternating which goes first) the
            # digests in the other block size, then unverified.
            rows = [("pull_warm", manifest), ("pull_warm_otherblocks", manifest_other)]
            for key, m in rows if rnd % 2 == 0 or manifest_other is None else rows[::-1]:
                if m is None:
                    continue
                _settle()
                r = pull(endpoint, m, warm_dest, verify=True)
                assert r.verified == len(manifest.tensors), r
                times[key].append(r.seconds)
                if key == "pull_warm":
                    phases_warm.append(r.phases)
                    page_cache.append(r.page_cache_bytes / total)
            _settle()
            times["pull_warm_unverified"].append(
                pull(endpoint, manifest, warm_dest, verify=False).seconds)
            # The same two pulls with the pieces in Python threads (hostcopy.NATIVE off:
            # the loop before the C one, and where it is not built).
            hostcopy.NATIVE = False
            try:
                dest = allocate_like(manifest)
                _settle()
                times["pull_fresh_pyloop"].append(pull(endpoint, manifest, dest).seconds)
                del dest
                _settle()
                times["pull_warm_pyloop"].append(pull(endpoint, manifest, warm_dest).seconds)
            finally:
                hostcopy.NATIVE = native
            # The memfd alone (the transport before the page-cache path), same round.
            dest = allocate_like(manifest_m)
            _settle()
            r = pull(endpoint_m, manifest_m, dest, verify=True)
            assert r.verified == len(manifest.tensors) and r.page_cache_bytes == 0, r
            times["pull_fresh_memfd"].append(r.seconds)
            del dest
            _settle()
            r = pull(endpoint_m, manifest_m, warm_dest, verify=True)
            times["pull_warm_memfd"].append(r.seconds)
            _settle()
            times["disk_warm"].append(time_disk_load(ckpt, cold=False))
            for how in ("mapped_torch", "pread_1", "pread_n"):
                _settle()
                times[how].append(_variant(endpoint_m, manifest_m, warm_dest, how))

        # A fresh process each, as a user's `modelexpress pull` or a new engine's load:
        # nothing in its heap to reuse, so both pay the new memory's page faults.
        for _ in range(fresh_rounds):
            for what, where in (("disk", info_path), ("pull", info_path),
                                ("pull_memfd", info_memfd), ("pull_pyloop", info_path),
                                ("pull_hugeon", info_path), ("pull_hugeoff", info_path)):
                got = _host_target(what.replace("_", "-") if what != "pull_memfd" else "pull",
                                   where, ckpt)
                times[f"process_{what}"].append(got["seconds"])
                if what == "pull":
                    phases_process.append({"allocate": got["allocate"], **got["phases"]})
                    huge_used.append(got["huge_pages"])

        def ratio(num: str, den: str) -> float | None:  # den / num time, per round: GB/s ratio
            if not times[num] or not times[den]:
                return None  # a row not run (no other block size for this digest)
            return round(_median([b / a for a, b in zip(times[num], times[den])]), 3)

        def best_ratio(num: str, den: str) -> float:  # the same from each one's best round
            return round(min(times[den]) / min(times[num]), 3)

        out: dict[str, Any] = {
            "case": name, "bytes": total, "tensors": len(manifest.tensors), "rounds": rounds,
            "fresh_rounds": fresh_rounds,
            "loadavg": os.getloadavg(),
            "copy_threads": copy_threads(), "digest": manifest.digest_algorithm,
            "median_s": {k: round(_median(v), 4) for k, v in times.items() if v},
            "gbps": {k: round(total / _median(v) / 1e9, 2) for k, v in times.items() if v},
            "pull_warm_vs_memcpy_warm": ratio("pull_warm", "memcpy_warm"),
            "pull_fresh_vs_memcpy_fresh": ratio("pull_fresh", "memcpy_fresh"),
            "pull_fresh_vs_memcpy_warm": ratio("pull_fresh", "memcpy_warm"),
            "pull_fresh_vs_disk_warm": ratio("pull_fresh", "disk_warm"),
            "process_pull_vs_process_disk": ratio("process_pull", "process_disk"),
            "pull_warm_memfd_vs_memcpy_warm": ratio("pull_warm_memfd", "memcpy_warm"),
            "pull_fresh_memfd_vs_memcpy_fresh": ratio("pull_fresh_memfd", "memcpy_fresh"),
            "process_pull_memfd_vs_process_disk": ratio("process_pull_memfd", "process_disk"),
            # MX_LOCAL_HUGE_PAGES: what the default chose, and each forced mode's pull
            # against the load (and huge against small pages: >1, huge pages faster)
            "huge_pages_default_used": huge_used,
            "process_pull_hugeon_vs_process_disk": ratio("process_pull_hugeon", "process_disk"),
            "process_pull_hugeoff_vs_process_disk": ratio("process_pull_hugeoff",
                                                          "process_disk"),
            "huge_on_vs_off": ratio("process_pull_hugeon", "process_pull_hugeoff"),
            # The digest's block size (>1: the published one is faster) and no digests.
            "digest_other_blocks": manifest_other and manifest_other.digest_algorithm,
            "blocks_default_vs_other": ratio("pull_warm", "pull_warm_otherblocks"),
            "pull_warm_otherblocks_vs_memcpy_warm": ratio("pull_warm_otherblocks",
                                                          "memcpy_warm"),
            "pull_warm_unverified_vs_memcpy_warm": ratio("pull_warm_unverified",
                                                         "memcpy_warm"),
            # The C piece loop against the Python one (>1: the C loop is faster).
            "c_loop_vs_python_loop": {
                "pull_fresh": ratio("pull_fresh", "pull_fresh_pyloop"),
                "pull_warm": ratio("pull_warm", "pull_warm_pyloop"),
                "process_pull": ratio("process_pull", "process_pull_pyloop")},
            "page_cache_fraction_median": round(_median(page_cache), 3),
            "strategies_vs_memcpy_warm": {k: ratio(k, "memcpy_warm") for k in
                                          ("mapped_torch", "pread_1", "pread_n",
                                           "pull_warm_memfd", "pull_warm")},
            "best_s": {k: round(min(v), 4) for k, v in times.items() if v},
            "best_ratios": {
                "pull_warm_vs_memcpy_warm": best_ratio("pull_warm", "memcpy_warm"),
                "pull_fresh_vs_memcpy_fresh": best_ratio("pull_fresh", "memcpy_fresh"),
                "pull_fresh_vs_memcpy_warm": best_ratio("pull_fresh", "memcpy_warm"),
                "pull_fresh_vs_disk_warm": best_ratio("pull_fresh", "disk_warm"),
                "process_pull_vs_process_disk": best_ratio("process_pull", "process_disk"),
                "process_pull_memfd_vs_process_disk": best_ratio("process_pull_memfd",
                                                                 "process_disk"),
                **{f"{k}_vs_memcpy_warm": best_ratio(k, "memcpy_warm")
                   for k in ("mapped_torch", "pread_1", "pread_n", "pull_warm_memfd")}},
            "phases_fresh_median": {k: round(_median([p[k] for p in phases_fresh]), 4)
                                    for k in phases_fresh[0]},
            "phases_warm_median": {k: round(_median([p[k] for p in phases_warm]), 4)
                                   for k in phases_warm[0]},
            "phases_process_pull_median": {k: round(_median([p[k] for p in phases_process]), 4)
                                           for k in phases_process[0]},
        }
        return out
    finally:
        _stop(proc)
        _stop(proc_m)


def host_main(args: argparse.Namespace) -> None:
    import torch
    results = []
    with tempfile.TemporaryDirectory(prefix="mxl-host-") as tmp:
        for name in args.cases.split(","):
            if name not in HOST_CASES:
                raise SystemExit(f"unknown case {name!r}; allowed: {', '.join(HOST_CASES)}")
            r = host_case(name, args.rounds, tmp, args.fresh_rounds, args.digest)
            m, g = r["median_s"], r["gbps"]
            print(f"{name}: {r['bytes'] / 1e6:.1f} MB {r['tensors']} tensors, {r['rounds']} rounds, "
                  f"{r['copy_threads']} copy threads, digests {r['digest']} | memcpy warm {g['memcpy_warm']} GB/s, "
                  f"into fresh pages {g['memcpy_fresh']} GB/s | pull (verified) into fresh "
                  f"{m['pull_fresh']} s, into touched {m['pull_warm']} s | warm page-cache load "
                  f"{m['disk_warm']} s | ratios: pull touched / memcpy warm "
                  f"{r['pull_warm_vs_memcpy_warm']}, pull fresh / memcpy fresh "
                  f"{r['pull_fresh_vs_memcpy_fresh']}, pull fresh / memcpy warm "
                  f"{r['pull_fresh_vs_memcpy_warm']}, pull fresh / disk warm "
                  f"{r['pull_fresh_vs_disk_warm']}, fresh process: disk load "
                  f"{m['process_disk']} s / pull {m['process_pull']} s "
                  f"{r['process_pull_vs_process_disk']} (memfd only: "
                  f"{m['process_pull_memfd']} s {r['process_pull_memfd_vs_process_disk']}; "
                  f"huge pages on {m['process_pull_hugeon']} s "
                  f"{r['process_pull_hugeon_vs_process_disk']}, off {m['process_pull_hugeoff']} s "
                  f"{r['process_pull_hugeoff_vs_process_disk']}, default used "
                  f"{r['huge_pages_default_used']}) | "
                  f"page cache share {r['page_cache_fraction_median']} | "
                  f"fresh-process pull phases {r['phases_process_pull_median']} | "
                  f"C loop / Python loop {r['c_loop_vs_python_loop']} | "
                  f"into touched: {r['digest']} / {r['digest_other_blocks']} "
                  f"{r['blocks_default_vs_other']}, unverified / memcpy warm "
                  f"{r['pull_warm_unverified_vs_memcpy_warm']} | "
                  f"strategies / memcpy warm "
                  f"{r['strategies_vs_memcpy_warm']} | best-round ratios {r['best_ratios']} | "
                  f"phases fresh {r['phases_fresh_median']}",
                  flush=True)
            results.append(r)
    print(json.dumps({"bench": "local", "mode": "host", "cpus": os.cpu_count(),
                      "torch_threads": torch.get_num_threads(), "results": results}))


# -- --gpu-first: first vs later verified pull in fresh processes --------------------------
GPU_MODES = ("auto", "triton-bg", "inline")


def gpu_target(args: argparse.Namespace) -> None:
    """One fresh target process of --gpu-first: three verified pulls, one JSON line."""
    t_start = time.perf_counter()
    import torch

    from modelexpress.local import LocalEndpoint, pull
    from modelexpress.transfer import digest
    from modelexpress.transfer.manifest import Manifest
    if args.gpu_target == "triton-bg":
        # For comparison: no shipped kernel (bench-only: as where the driver refuses
        # it), the Triton build in the background, the torch form until it is ready.
        digest._cuda_refused = "disabled by bench/local.py --gpu-first (mode triton-bg)"
    info = json.load(open(args.info))
    endpoint = LocalEndpoint.from_json(info["endpoint"])
    manifest = Manifest.from_json(info["manifest"])
    torch.cuda.set_device(0)
    dest = _allocate(_shapes(args.layers), "cuda:0")
    torch.cuda.synchronize()
    t_ready = time.perf_counter()
    pulls = []
    build_wait_s = 0.0
    for i in range(3):
        if i == 1:  # later pulls: once the build is done (as a pull seconds later finds it)
            tw = time.perf_counter()
            digest.wait_for_builds()
            build_wait_s = time.perf_counter() - tw
        state = digest.kernel_state("cuda:0")
        used = digest.forms_used()
        t0 = time.perf_counter()
        if args.gpu_target == "inline" and i == 0:
            # Without a warm-up: the first verification waits for the kernel.
            r = pull(endpoint, manifest, dest, verify=False)
            tv = time.perf_counter()
            got = digest.digest_many(list(dest.values()), digest.WSUM, impl="triton")
            verify_s = time.perf_counter() - tv
            want = {t.name: t.digest for t in manifest.tensors}
            assert got == [want[k] for k in dest], "digests differ"
            seconds = time.perf_counter() - t0
        else:
            r = pull(endpoint, manifest, dest, verify=True)
            seconds = time.perf_counter() - t0
            verify_s = r.phases["verify"]
        phases = {k: round(v, 4) for k, v in r.phases.items()}
        phases["verify"] = round(verify_s, 4)
        now = digest.forms_used()
        pulls.append({"seconds": round(seconds, 4), "copy_s": phases.get("copy", 0.0),
                      "verify_s": phases["verify"], "phases": phases,
                      "outside_phases_s": round(seconds - sum(phases.values()), 4),
                      "verified_by": {k: n - used.get(k, 0) for k, n in now.items()
                                      if n != used.get(k, 0)},
                      "kernel_at_start": state,
                      "kernel_at_end": digest.kernel_state("cuda:0")})
    build = digest._builds.get("cuda:0")  # bench-only peek: how long the build took
    from modelexpress.transfer import _wsum_cuda
    print(json.dumps({"mode": args.gpu_target, "kernel_image": _wsum_cuda.image_of(0),
                      "bytes": manifest.total_bytes,
                      "tensors": len(manifest.tensors), "pulls": pulls,
                      "build_s": round(build.seconds, 3) if build else None,
                      "build_wait_after_first_s": round(build_wait_s, 3),
                      "setup_s": round(t_ready - t_start, 3),
                      "process_s": round(time.perf_counter() - t_start, 3)}), flush=True)


_PROBE = r"""
import json, sys, time
t = {}
t0 = time.perf_counter(); import torch; t["import_torch"] = time.perf_counter() - t0
t0 = time.perf_counter(); torch.cuda.init(); torch.zeros(1, device="cuda:0")
torch.cuda.synchronize(); t["cuda_context"] = time.perf_counter() - t0
t0 = time.perf_counter(); import cuda.bindings.driver; t["import_cuda_bindings"] = time.perf_counter() - t0
from modelexpress.local.devices import CudaDevices
t0 = time.perf_counter(); CudaDevices().uuids(); t["device_uuids"] = time.perf_counter() - t0
t0 = time.perf_counter(); s = [torch.cuda.Stream(0) for _ in range(4)]; t["streams_4"] = time.perf_counter() - t0
from modelexpress.transfer import _wsum_cuda
images = tuple(sys.argv[1].split(","))
t0 = time.perf_counter(); _wsum_cuda.load(0, images); t["shipped_kernel_load"] = time.perf_counter() - t0
t["image"] = _wsum_cuda.image_of(0)
x = torch.ones(1 << 20, dtype=torch.uint8, device="cuda:0")
t0 = time.perf_counter(); _wsum_cuda.wsum_batch([x]); t["shipped_kernel_first_call"] = time.perf_counter() - t0
t0 = time.perf_counter(); _wsum_cuda.wsum_batch([x]); t["shipped_kernel_second_call"] = time.perf_counter() - t0
print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in t.items()}))
"""


def _gpu_probe(env: dict[str, str], images: str) -> dict[str, Any]:
    """First-call costs in a fresh process, one by one (what a first pull may pay)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, images], env=env,
                          stdout=subprocess.PIPE, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"probe exited {proc.returncode}")
    return json.loads(lines[-1])


def gpu_first_main(args: argparse.Namespace) -> None:
    import torch
    out: list[dict[str, Any]] = []
    probes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mxl-gpu1-") as tmp:
        info_path = os.path.join(tmp, "info.json")
        proc = subprocess.Popen([sys.executable, __file__, "--serve", "--info", info_path,
                                 "--layers", str(args.layers), "--arena", "off",
                                 "--device", "cuda:0", "--ipc-dir", os.path.join(tmp, "ipc")],
                                stdin=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 300
            while not os.path.exists(info_path):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"source failed (exit {proc.poll()})")
                time.sleep(0.1)
            # "empty": Triton's cache and the driver's PTX cache both new; "warm": both
            # filled by an earlier process (a machine's later engines)
            warm = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton-warm"),
                        CUDA_CACHE_PATH=os.path.join(tmp, "cuda-warm"))
            # the shipped kernel as loaded (the fatbin where it has this GPU's code), then
            # its PTX alone with an empty driver cache and with the cache that filled
            for name, images, cache in (("auto", "fatbin,ptx", "probe-a"),
                                        ("ptx_cache_empty", "ptx", "probe-p"),
                                        ("ptx_cache_warm", "ptx", "probe-p")):
                env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, f"triton-{cache}"),
                           CUDA_CACHE_PATH=os.path.join(tmp, f"cuda-{cache}"))
                probes[name] = _gpu_probe(env, images)
                print(f"first-call costs ({name}): {probes[name]}", flush=True)
            for trial in range(args.trials):
                for mode in GPU_MODES:
                    for cache in ("empty", "warm"):
                        env = warm if cache == "warm" else dict(
                            os.environ,
                            TRITON_CACHE_DIR=os.path.join(tmp, f"triton-empty-{trial}-{mode}"),
                            CUDA_CACHE_PATH=os.path.join(tmp, f"cuda-empty-{trial}-{mode}"))
                        if cache == "warm" and not os.path.isdir(warm["TRITON_CACHE_DIR"]):
                            _gpu_target_run(args, info_path, env, "triton-bg")  # fills both
                            _gpu_target_run(args, info_path, env, "auto")
                        r = _gpu_target_run(args, info_path, env, mode)
                        first, later = r["pulls"][0], r["pulls"][1:]
                        later_s = _median([p["seconds"] for p in later])
                        r.update(trial=trial, cache=cache,
                                 first_over_later=round(first["seconds"] / later_s, 2),
                                 first_verify_over_later=round(first["verify_s"] / _median(
                                     [p["verify_s"] for p in later]), 2),
                                 first_verify_within=first["verify_s"] <= max(
                                     2 * first["copy_s"], 0.05))
                        print(f"mode={mode} caches={cache} trial {trial}: "
                              f"{r['bytes'] / 1e9:.2f} GB {r['tensors']} tensors | pulls "
                              + ", ".join(f"{p['seconds']} s (copy {p['copy_s']}, verify "
                                          f"{p['verify_s']} by {p['verified_by']}, kernel "
                                          f"{p['kernel_at_start']}->{p['kernel_at_end']})"
                                          for p in r["pulls"])
                              + f" | first/later {r['first_over_later']}, first verify/later "
                              f"{r['first_verify_over_later']} | first verify within max(2x "
                              f"copy, 50 ms): {r['first_verify_within']} | first pull phases "
                              f"{first['phases']} + {first['outside_phases_s']} s outside | "
                              f"later {later[0]['phases']} | build {r['build_s']} s | "
                              f"shipped kernel image {r['kernel_image']}",
                              flush=True)
                        out.append(r)
        finally:
            _stop(proc)
    print(json.dumps({"bench": "local", "mode": "gpu-first", "layers": args.layers,
                      "gpu": torch.cuda.get_device_name(0), "probes": probes,
                      "results": out}))


def _gpu_target_run(args: argparse.Namespace, info_path: str, env: dict[str, str],
                    mode: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--gpu-target", mode, "--info", info_path,
                           "--layers", str(args.layers)], env=env, stdout=subprocess.PIPE,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"target ({mode}) exited {proc.returncode}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="70B TP=8 layers (default 80; "
                   "--gpu-first: 28, about 6.5 GB)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--arena", default="off,on")
    p.add_argument("--dst", default="", help="destination devices (default cuda:0 and cuda:1 if present)")
    p.add_argument("--host", action="store_true", help="CPU: host pulls vs memcpy vs disk")
    p.add_argument("--cases", default="1gib,70mb", help="--host: checkpoints to pull")
    p.add_argument("--rounds", type=int, default=5, help="--host: interleaved rounds")
    p.add_argument("--digest", default="", help="--host: the source's digest algorithm "
                   "(default: the library's, xxh3-128-b1m under 512 MiB, else xxh3-128-b8m; "
                   "xxh3-128 hashes each tensor whole)")
    p.add_argument("--fresh-rounds", type=int, default=3,
                   help="--host: rounds of the fresh-process load and pulls")
    p.add_argument("--gpu-first", action="store_true", help="GPU: first vs later pull")
    p.add_argument("--trials", type=int, default=2, help="--gpu-first: targets per mode/cache")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve-host", default="", help=argparse.SUPPRESS)
    p.add_argument("--memfd-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gpu-target", default="", help=argparse.SUPPRESS)
    p.add_argument("--host-target", default="", help=argparse.SUPPRESS)
    p.add_argument("--info", default="", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda:0", help=argparse.SUPPRESS)
    p.add_argument("--ipc-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_host:
        serve_host(args)
        return
    if args.gpu_target:
        gpu_target(args)
        return
    if args.host_target:
        host_target(args)
        return
    if args.host:
        host_main(args)
        return
    if args.gpu_first:
        args.layers = args.layers or 28
        gpu_first_main(args)
        return
    args.layers = args.layers or 80
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
