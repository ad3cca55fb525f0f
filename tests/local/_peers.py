"""Source and target processes of the local-transport tests (run as scripts).

source: ``python _peers.py source OUT.json --layout buffer|arena|buffers|checkpoint|
    checkpoint_stale --seed S --mib N [--digest ALGO]``
    builds seeded tensors in shareable host memory, starts a LocalSource, writes
    {"endpoint", "manifest", "pid"} to OUT.json (atomically), then serves until stdin
    closes or it is killed. ``checkpoint``: the tensors saved as a safetensors file next
    to OUT.json ("checkpoint" in OUT.json) and loaded back as ``modelexpress publish``
    does (``load_checkpoint_shared``: the file's page cache served too);
    ``checkpoint_stale``: the same, but the buffer's file origin is a second file whose
    first tensor differs (a file changed in a way no fstat shows).
target: ``python _peers.py target IN.json [--token T] [--python-loop]`` pulls everything
    and prints one JSON line: {"ok", "pid", "nbytes", "copies", "error", "fds_before",
    "fds_after"}. ``--python-loop``: host copies in Python threads, not the C loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from modelexpress.local import LocalEndpoint, LocalSource, host_buffer_like, pull
from modelexpress.local.client import fd_count
from modelexpress.transfer.manifest import Manifest, build_manifest


def make_tensors(seed: int, mib: int) -> dict[str, torch.Tensor]:
    """Seeded tensors of mixed sizes and dtypes, ``mib`` MiB in all (the same for both sides)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    total, i = mib << 20, 0
    sizes = [1 << 20, 3 << 20, 12345, 4 << 20, 77, 2 << 20]
    while total > 0:
        n = min(sizes[i % len(sizes)], total)
        dtype = (torch.bfloat16, torch.float32, torch.uint8)[i % 3]
        numel = max(1, n // dtype.itemsize)
        t = torch.randint(0, 255, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
        out[f"layer.{i}.w"] = t.view(dtype)
        total -= numel * dtype.itemsize
        i += 1
    return out


def run_source(args: argparse.Namespace) -> None:
    from modelexpress.local import host_id
    tensors = make_tensors(args.seed, args.mib)
    keep: list[object] = []
    src = LocalSource(args.ipc_dir, host_id=host_id())
    checkpoint = ""
    if args.layout in ("checkpoint", "checkpoint_stale"):
        from modelexpress.checkpoint import load_checkpoint_shared, save_checkpoint
        from modelexpress.local.origin import FileOrigin
        checkpoint = str(save_checkpoint(tensors, args.out + ".ckpt")[0])
        buf, shared = load_checkpoint_shared(checkpoint)
        if args.layout == "checkpoint_stale":
            other = dict(tensors)
            first = next(iter(other))
            other[first] = other[first].clone()
            other[first].view(torch.uint8)[0] ^= 0xFF
            stale = str(save_checkpoint(other, args.out + ".stale")[0])
            buf.close()
            from modelexpress.checkpoint import load_checkpoint
            buf, shared = host_buffer_like(load_checkpoint(checkpoint))  # no origin yet
            assert buf.add_origins([FileOrigin(stale)], shared) > 0
        keep.append(buf)
        src.add_host_buffer(buf)
    elif args.layout == "buffer":
        buf, shared = host_buffer_like(tensors)
        keep.append(buf)
        src.add_host_buffer(buf)
    elif args.layout == "buffers":  # one buffer per tensor: many segments
        shared = {}
        for name, t in tensors.items():
            b, one = host_buffer_like({name: t})
            keep.append(b)
            src.add_host_buffer(b)
            shared.update(one)
    elif args.layout == "cuda":  # PyTorch's caching allocator: CUDA IPC handles
        shared = {k: v.to(args.device) for k, v in tensors.items()}
    elif args.layout == "vmm":  # the CUDA VMM arena: POSIX-fd handles per chunk
        from modelexpress.vmm import maybe_enter_vmm_arena
        dev = torch.device(args.device).index or 0
        with maybe_enter_vmm_arena(True, dev) as arena:
            if arena is None:
                raise SystemExit("the VMM arena is unavailable here (see the warning above)")
            shared = {k: v.to(args.device) for k, v in tensors.items()}
        torch.cuda.synchronize(dev)
        keep.append(arena)
        src.add_vmm_arena(arena)
    else:  # a host VMM arena, one chunk per tensor, laid out contiguously
        from modelexpress.vmm import HostVmmBackend, VmmArena
        arena = VmmArena(1 << 34, backend=HostVmmBackend())
        keep.append(arena)
        shared = {}
        for name, t in tensors.items():
            view = arena.empty(tuple(t.shape), t.dtype)
            view.copy_(t)
            shared[name] = view
        src.add_vmm_arena(arena)
    src.add_tensors(shared)  # CUDA tensors become segments; others are covered already
    from modelexpress.local import publish_attributes
    manifest = build_manifest(shared, agent_name=f"src-{os.getpid()}",
                              attributes=publish_attributes(src),
                              digest_algorithm=args.digest or None)
    src.start()
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"endpoint": src.endpoint.to_json(), "manifest": manifest.to_json(),
                   "pid": os.getpid(), "checkpoint": checkpoint}, f)
    os.rename(tmp, args.out)
    sys.stdin.read()  # serve until the test closes our stdin
    src.close()
    for k in keep:
        k.close()  # type: ignore[attr-defined]


def run_target(args: argparse.Namespace) -> None:
    with open(args.inp) as f:
        info = json.load(f)
    ep = info["endpoint"]
    if args.token:
        ep = dict(ep, token=args.token)
    endpoint = LocalEndpoint.from_json(ep)
    manifest = Manifest.from_json(info["manifest"])
    if args.python_loop:
        from modelexpress.local import hostcopy
        hostcopy.NATIVE = False
    arena = None
    if args.dst_arena:  # the target loads in its own VMM arena (MX_VMM_ARENA=1)
        from modelexpress.vmm import maybe_enter_vmm_arena
        with maybe_enter_vmm_arena(True, torch.device(args.dst_device).index or 0) as arena:
            assert arena is not None, "the VMM arena is unavailable"
            dst = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype),
                                       device=args.dst_device) for t in manifest.tensors}
    else:
        dst = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=args.dst_device)
               for t in manifest.tensors}
    # ORDER: the device inventory first: asking CUDA which GPUs this process sees opens
    # the driver's descriptors once (even with none visible); they are not the pull's
    from modelexpress.local.devices import CudaDevices
    CudaDevices().uuids()
    before = fd_count()
    out = {"pid": os.getpid(), "fds_before": before}
    progress = None
    if args.kill_source:
        import signal

        def kill_after_first(done: int, total: int) -> None:
            if not out.get("killed"):
                os.kill(args.kill_source, signal.SIGKILL)
                out["killed"] = True

        progress = kill_after_first
    try:
        res = pull(endpoint, manifest, dst, deadline_s=60, progress=progress,
                   chunk_bytes=args.chunk_bytes)
        out.update(ok=True, nbytes=res.nbytes, copies=res.copies, verified=res.verified)
        want = make_tensors(args.seed, args.mib)
        out["equal"] = all(torch.equal(want[k].view(torch.uint8), dst[k].cpu().view(torch.uint8))
                           for k in want)
        out["segments"] = res.segments
        out["page_cache_bytes"] = res.page_cache_bytes
        out["page_cache_misses"] = res.page_cache_misses
    except Exception as exc:  # noqa: BLE001 - reported to the test as JSON
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    if arena is not None:
        dst.clear()
        torch.cuda.synchronize()
        arena.close()
    if args.dst_device != "cpu":
        # Is this process's CUDA context still usable (a fault in a copy is sticky)?
        try:
            torch.cuda.synchronize(args.dst_device)
            out["context_ok"] = float(torch.ones(4, device=args.dst_device).sum().item()) == 4.0
        except Exception as exc:  # noqa: BLE001 - reported to the test as JSON
            out["context_ok"] = False
            out["context_error"] = str(exc)[:300]
    # ORDER: the digest kernel's background build (a pull starts it) holds files and pipes
    # of its own while it runs: count after it ended
    from modelexpress.transfer.digest import wait_for_builds
    wait_for_builds()
    out["fds_after"] = fd_count()
    print(json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["source", "target"])
    p.add_argument("path")
    p.add_argument("--layout", default="buffer",
                   choices=["buffer", "buffers", "arena", "cuda", "vmm", "checkpoint",
                            "checkpoint_stale"])
    p.add_argument("--device", default="cuda:0", help="source device of the cuda/vmm layouts")
    p.add_argument("--dst-device", default="cpu", help="target's destination device")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--ipc-dir", default="")
    p.add_argument("--token", default="")
    p.add_argument("--kill-source", type=int, default=0, help="SIGKILL this pid after chunk 1")
    p.add_argument("--chunk-bytes", type=int, default=1 << 30)
    p.add_argument("--dst-arena", action="store_true", help="destination in a VMM arena")
    p.add_argument("--digest", default="", help="source's digest algorithm (default: its default)")
    p.add_argument("--python-loop", action="store_true",
                   help="target: host copies in Python threads (hostcopy.NATIVE off)")
    args = p.parse_args()
    if args.role == "source":
        args.out = args.path
        run_source(args)
    else:
        args.inp = args.path
        run_target(args)


if __name__ == "__main__":
    main()
