"""Digest throughput per algorithm, against a memcpy of the same bytes in the same run.

A pull checks every tensor's digest where the tensor lives, so a digest slower than
the link bounds the pull. This prints GB/s for each algorithm that can run here
(``xxh3-128-b8m``, ``xxh3-128`` and ``blake2b-128`` on CPU tensors (the block-wise
``xxh3-128-b8m`` on every CPU this process may use), ``wsum-i32-v1`` on CPU and, with
``--gpu``, on cuda:0, in each of its forms: the shipped kernel loaded through the
driver, the one-pass Triton kernel and torch ops, plus a batch of 248 mixed-size
tensors as one chunk of a pull digests them, with the shipped and the Triton kernel)
and its ratio to a copy of the same buffer on the same device.

Usage: python bench/digest.py [--quick] [--gpu] [--mib N]
Prints one line per measurement, then ONE JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _best(fn, repeat: int, sync=lambda: None) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, 2 repeats")
    parser.add_argument("--gpu", action="store_true", help="also on cuda:0")
    parser.add_argument("--mib", type=int, default=None, help="buffer size (default 512)")
    args = parser.parse_args()
    mib = args.mib or (64 if args.quick else 512)
    repeat = 2 if args.quick else 3

    import torch

    from modelexpress.transfer import digest

    nbytes = mib << 20
    out: dict[str, float | int] = {"bytes": nbytes}
    devices = ["cpu"] + (["cuda:0"] if args.gpu else [])
    for device in devices:
        sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
        buf = torch.randint(-128, 127, (nbytes,), dtype=torch.int8, device=device)
        dst = torch.empty_like(buf)
        tag = "gpu" if device != "cpu" else "cpu"
        copy_s = _best(lambda: dst.copy_(buf), repeat, sync)
        out[f"gbps_memcpy_{tag}"] = nbytes / copy_s / 1e9
        print(f"{device}: memcpy {out[f'gbps_memcpy_{tag}']:.2f} GB/s", file=sys.stderr)
        for algo in digest.ALGORITHMS:
            if not digest.can_compute(algo, buf):
                continue
            # On a GPU, wsum's forms (shipped kernel, one-pass Triton kernel, torch
            # ops) are measured apart; "auto" is what a pull uses.
            impls = ["auto", "cuda", "torch", "triton"] \
                if algo == digest.WSUM and tag == "gpu" else ["auto"]
            for impl in impls:
                if impl == "triton":  # first call in this process: kernel load/compile
                    t0 = time.perf_counter()
                    try:
                        digest.digest_many([buf], algo, impl="triton")
                    except Exception:  # noqa: BLE001 - reported below as cannot run
                        pass
                    finally:
                        out["triton_first_call_s"] = time.perf_counter() - t0
                    print(f"{device}: first Triton call (load or compile) "
                          f"{out['triton_first_call_s']:.3f} s", file=sys.stderr)
                try:
                    seconds = _best(lambda: digest.digest_many([buf], algo, impl=impl),
                                    repeat, sync)
                except Exception as exc:  # noqa: BLE001 - report a form that cannot run
                    print(f"{device}: {algo} ({impl}) cannot run: {exc}", file=sys.stderr)
                    continue
                name = {digest.XXH3_BLOCKS: "xxh3b8m"}.get(algo, algo.split("-")[0])
                key = name + ("" if impl == "auto" else f"_{impl}")
                out[f"gbps_{key}_{tag}"] = nbytes / seconds / 1e9
                out[f"ratio_{key}_vs_memcpy_{tag}"] = copy_s / seconds
                print(f"{device}: {algo} ({impl}) {out[f'gbps_{key}_{tag}']:.2f} GB/s "
                      f"({copy_s / seconds:.2f} of memcpy)", file=sys.stderr)
        if tag == "gpu":
            # A chunk of a pull: many tensors of mixed sizes digested in one batch
            # (one synchronisation), as the read loop does it.
            sizes = ([(nbytes // 64) + 2 * (i % 3) for i in range(48)]
                     + [4096 + i for i in range(200)])
            parts = [torch.randint(-128, 127, (n,), dtype=torch.int8, device=device)
                     for n in sizes]
            total = sum(sizes)
            out["batch_tensors"] = len(parts)
            for impl, key in (("auto", "gbps_wsum_batch_gpu"),
                              ("triton", "gbps_wsum_batch_triton_gpu")):
                try:
                    seconds = _best(lambda: digest.digest_many(parts, digest.WSUM, impl=impl),
                                    repeat, sync)
                except Exception as exc:  # noqa: BLE001 - report a form that cannot run
                    print(f"{device}: batch ({impl}) cannot run: {exc}", file=sys.stderr)
                    continue
                out[key] = total / seconds / 1e9
                print(f"{device}: {digest.WSUM} ({impl}) batch of {len(parts)} tensors "
                      f"({total / 2**20:.0f} MiB): {out[key]:.2f} GB/s", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
