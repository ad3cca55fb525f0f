"""A source process for the transfer tests: registers layouts and serves them.

Protocol (stdin/stdout, one JSON line each way):
    in : {"kinds": [...], "arena": bool, "corrupt": "name" | null, "strategy": "spans"}
    out: {"pid": int, "metadata": base64, "manifests": {kind: manifest_json},
          "registration": {kind: strategy}}
Then it serves (progressing its NIXL worker) until stdin says "stop" or closes.
"""

from __future__ import annotations

import base64
import json
import logging
import select
import sys

import os

# NIXL and UCX print to fd 1; keep the protocol channel clean by moving fd 1 to
# stderr and answering on a private duplicate of the original stdout.
_PROTO = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import layouts  # noqa: E402

from modelexpress.transfer import NixlTransferManager  # noqa: E402


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.loads(sys.stdin.readline())
    mgr = NixlTransferManager()
    keep, manifests, registration = [], {}, {}
    for kind in spec.get("kinds", []):
        buf, tensors = layouts.carve(kind, filled=True, device=spec.get("device", "cpu"))
        keep.append(buf)
        info = mgr.register_tensors(tensors, spec.get("strategy", "spans"))
        registration[kind] = f"{info.strategy}:{info.regions}"
        manifests[kind] = mgr.build_manifest(tensors)
        if spec.get("corrupt") in tensors:
            t = tensors[spec["corrupt"]]
            t.view(-1).view(torch.uint8)[t.numel()].add_(1)  # one byte in the middle
    if spec.get("arena"):
        from modelexpress.vmm import HostVmmBackend, VmmArena
        arena = VmmArena(total_bytes=1 << 30, device=0, backend=HostVmmBackend())
        keep.append(arena)
        tensors = layouts.arena_tensors(arena, filled=True)
        keep.append(tensors)
        info = mgr.register_arena(arena, tensors)
        registration["arena"] = f"{info.strategy}:{info.regions}:{len(arena.live_allocations())}"
        manifests["arena"] = mgr.build_manifest(tensors)
    if spec.get("cuda_arena"):
        # CUDA VMM arena filled through use_arena: the memory UCX cuda_ipc cannot open
        # (GPU.md); the test checks that the verdict reports what the rate shows.
        from modelexpress.vmm import CudaVmmBackend, VmmArena, use_arena
        arena = VmmArena(total_bytes=1 << 36, device=0, backend=CudaVmmBackend(0))
        keep.append(arena)
        with use_arena(arena, 0):
            tensors = {f"vmm.{i}": torch.empty((64 << 20,), dtype=torch.bfloat16, device="cuda:0")
                       for i in range(2)}
        for name, t in tensors.items():
            layouts.fill_cuda(name, t)
        keep.append(tensors)
        info = mgr.register_arena(arena, tensors)
        registration["cuda_arena"] = f"{info.strategy}:{info.regions}:{len(arena.live_allocations())}"
        manifests["cuda_arena"] = mgr.build_manifest(tensors)
    out = {"pid": os.getpid(),
           "metadata": base64.b64encode(mgr.get_agent_metadata()).decode(),
           "manifests": {k: m.to_json() for k, m in manifests.items()},
           "registration": registration}
    _PROTO.write(json.dumps(out) + "\n")
    _PROTO.flush()
    mgr.start_progress_thread()
    # Bounded: the test kills us if it forgets to say stop.
    for _ in range(600 * 10):
        ready, _, _ = select.select([sys.stdin], [], [], 0.1)
        if ready:
            line = sys.stdin.readline()
            if not line or line.strip() == "stop":
                break
    mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
