"""VMM arena vs the stock allocator: load time and memory overhead for one tensor list.

The tensor list is Llama-3-8B's (bf16; embed, N decoder layers, norm, lm_head),
optionally scaled down. A "load" allocates every tensor and copies its bytes in from
a pinned host buffer (on CUDA) or a host buffer (CPU), then synchronises.

* cuda (default when a GPU is present): stock caching allocator vs ``use_arena``
  (pluggable allocator + MemPool + CudaVmmBackend). Reserved memory: the stock
  allocator's ``memory_reserved()`` growth vs the arena's ``mapped_bytes``.
* host (``--backend host``, or no GPU): ``torch.empty`` vs ``VmmArena.empty`` on the
  host backend (memfd pages).

Targets: arena overhead (reserved - tensor bytes) <= 2% of tensor bytes;
arena load time <= 1.05 x stock. Runs alternate stock/arena, medians reported. The
last output line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import time
from typing import Any

_LAYER = [(4096,), (4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (4096,),
          (14336, 4096), (14336, 4096), (4096, 14336)]


def shapes(layers: int, scale: int) -> list[tuple[int, ...]]:
    def s(shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(max(1, d // scale) for d in shape)
    out = [s((128256, 4096))]
    for _ in range(layers):
        out += [s(shape) for shape in _LAYER]
    return out + [s((4096,)), s((128256, 4096))]


def load_cuda(torch: Any, shape_list: list[tuple[int, ...]], src: Any, use: bool) -> dict:
    from modelexpress.vmm import CudaVmmBackend, VmmArena, use_arena
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved0 = torch.cuda.memory_reserved(0)
    t0 = time.perf_counter()
    arena = VmmArena(device=0, backend=CudaVmmBackend(0), use_extension=True) if use else None
    ctx = use_arena(arena, 0) if arena is not None else contextlib.nullcontext()
    tensors = []
    with ctx:
        for shape in shape_list:
            t = torch.empty(shape, dtype=torch.bfloat16, device="cuda:0")
            t.view(-1).copy_(src[: t.numel()], non_blocking=True)
            tensors.append(t)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors)
    if arena is not None:
        reserved = arena.mapped_bytes
        chunks = arena.live_allocation_count
    else:
        reserved = torch.cuda.memory_reserved(0) - reserved0
        chunks = len([s for s in torch.cuda.memory_snapshot() if s.get("device") == 0])
    del tensors, t
    if arena is not None:
        arena.close()
    torch.cuda.empty_cache()
    return {"load_s": elapsed, "reserved_bytes": reserved, "tensor_bytes": tensor_bytes,
            "segments": chunks}


def load_host(torch: Any, shape_list: list[tuple[int, ...]], src: Any, use: bool,
              granularity: int | None) -> dict:
    from modelexpress.vmm import HostVmmBackend, VmmArena
    gc.collect()
    t0 = time.perf_counter()
    arena = VmmArena(1 << 40, backend=HostVmmBackend(granularity)) if use else None
    tensors = []
    for shape in shape_list:
        if arena is not None:
            t = arena.empty(shape, torch.bfloat16)
        else:
            t = torch.empty(shape, dtype=torch.bfloat16)
        t.view(-1).copy_(src[: t.numel()])
        tensors.append(t)
    elapsed = time.perf_counter() - t0
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors)
    reserved = arena.mapped_bytes if arena is not None else None
    chunks = arena.live_allocation_count if arena is not None else None
    del tensors, t
    gc.collect()
    if arena is not None:
        arena.close()
    return {"load_s": elapsed, "reserved_bytes": reserved, "tensor_bytes": tensor_bytes,
            "segments": chunks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small list, 3 runs each")
    parser.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto")
    parser.add_argument("--layers", type=int, help="decoder layers (default 32; quick: 2)")
    parser.add_argument("--scale", type=int,
                        help="divide every dimension by this (default 1 on cuda; host 4, quick 8)")
    parser.add_argument("--reps", type=int, help="runs per variant (default 5; quick 3)")
    parser.add_argument("--host-granularity", type=int, default=None,
                        help="host backend granularity in bytes (default: page size)")
    args = parser.parse_args(argv)

    import torch
    backend = args.backend
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "host"
    layers = args.layers if args.layers is not None else (2 if args.quick else 32)
    default_scale = 1 if backend == "cuda" else (8 if args.quick else 4)
    scale = args.scale if args.scale is not None else default_scale
    reps = args.reps if args.reps is not None else (3 if args.quick else 5)
    shape_list = shapes(layers, scale)
    max_numel = max(int(torch.tensor(s).prod()) for s in shape_list)

    if backend == "cuda":
        torch.cuda.init()
        src = torch.randn(max_numel, dtype=torch.bfloat16).pin_memory()
        run = lambda use: load_cuda(torch, shape_list, src, use)  # noqa: E731
        machine = torch.cuda.get_device_name(0)
    else:
        src = torch.randn(max_numel, dtype=torch.bfloat16)
        run = lambda use: load_host(torch, shape_list, src, use, args.host_granularity)  # noqa: E731
        machine = f"{platform.machine()} cpu x{torch.get_num_threads()} threads"

    run(False)  # warm-up: CUDA context, pinned pages, first-touch of the allocator
    run(True)
    results: dict[str, list[dict]] = {"stock": [], "arena": []}
    for i in range(reps):
        order = ("stock", "arena") if i % 2 == 0 else ("arena", "stock")
        for name in order:
            results[name].append(run(name == "arena"))
            print(f"run {i} {name}: {results[name][-1]}", file=sys.stderr)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    tensor_bytes = results["arena"][0]["tensor_bytes"]
    arena_reserved = results["arena"][0]["reserved_bytes"]
    stock_reserved = results["stock"][0]["reserved_bytes"]
    summary = {
        "bench": "vmm_arena",
        "backend": backend,
        "machine": machine,
        "torch": torch.__version__,
        "layers": layers,
        "scale": scale,
        "tensors": len(shape_list),
        "reps": reps,
        "tensor_bytes": tensor_bytes,
        "stock_load_s": round(med("stock", "load_s"), 4),
        "arena_load_s": round(med("arena", "load_s"), 4),
        "load_time_ratio": round(med("arena", "load_s") / med("stock", "load_s"), 4),
        "arena_reserved_bytes": arena_reserved,
        "arena_chunks": results["arena"][0]["segments"],
        "arena_overhead_ratio": round((arena_reserved - tensor_bytes) / tensor_bytes, 5),
        "stock_reserved_bytes": stock_reserved,
        "stock_overhead_ratio": (round((stock_reserved - tensor_bytes) / tensor_bytes, 5)
                                 if stock_reserved is not None else None),
    }
    summary["meets_overhead_target"] = summary["arena_overhead_ratio"] <= 0.02
    summary["meets_load_time_target"] = summary["load_time_ratio"] <= 1.05
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
