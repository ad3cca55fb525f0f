"""The block checks of a pull across layouts, against hashing the same bytes whole.

A TP=1 target filled from both ranks of a TP=2 source checks every checkpoint block it
received (:func:`modelexpress.layout.readers.check_blocks`): the blocks of the
row-parallel weights (``o``, ``down``) are column strips of the target's tensors, not
contiguous. This times, on the hand-written layouts of ``tests/p2p/synthetic_layout.py``
(``--dims``, ``--layers``: ``--dims 4096,1024,14336,128256 --layers 32`` is a real 8B
model's size, 15.0 GB float32) with no transfer at all (the destination is assembled
from the checkpoint on ``--device``):

* ``whole``: the destination's tensors hashed whole, in one call (the baseline: the
  same bytes, contiguous; what a same-layout pull's verification hashes);
* ``checks``: ``check_blocks`` of the plan's checks (on a GPU the shipped kernel hashes
  a column strip where it lies);
* ``checks_split``: the same in its two steps, timed apart (``views_s``, ``hash_s``; on
  a GPU also ``table_s``, the kernel's table built alone: the host's part of hashing);
* ``checks_copied``: the strips copied out first, side by side strips together (how a
  GPU's checks ran before the kernel hashed rows in place), then hashed;

Every case's digests must match the source's (the plan's) or the run fails. Reported:
medians over ``--rounds`` (after one untimed round) of each case's seconds, the checks'
time split into building the views and hashing, and ``ratio_checks_vs_whole``.

Usage: python bench/block_checks.py [--device cuda:0] [--dims H,KV,INTER,VOCAB]
       [--layers L] [--rounds N]
Prints progress lines, then ONE JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "p2p"))


def _log(msg: str) -> None:
    print(f"[bench/block_checks] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["LAYOUT_SYNTHETIC_DIMS"] = args.dims  # before the import: they size them
    os.environ["LAYOUT_SYNTHETIC_LAYERS"] = str(args.layers)
    os.environ["LAYOUT_SYNTHETIC_SEED_DEVICE"] = args.device
    import torch
    import synthetic_layout as syn

    from modelexpress.layout import plan_layout
    from modelexpress.layout.readers import block_views, check_blocks
    from modelexpress.transfer import digest as _digest

    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    ckpt = syn.checkpoint()
    sources = [(f"r{r}", syn.with_blocks(syn.layout(2, r), ckpt, args.device)) for r in (0, 1)]
    target = syn.layout(1, 0)
    plan = plan_layout(target, sources)
    dest = {n: torch.empty(s, dtype=d, device=device) for n, s, d in syn.specs(target)}
    syn.assemble(target, ckpt, dest)
    sync()
    algorithm = plan.algorithm
    nbytes = sum(t.numel() * t.element_size() for t in dest.values())
    strided = sum(not v.is_contiguous() for v in block_views(plan.checks, dest, False))
    _log(f"{args.dims}, {args.layers} layer(s): {nbytes / 1e9:.2f} GB on {device}, "
         f"{len(plan.checks)} block checks ({strided} strided), {algorithm}")

    def whole() -> dict[str, float]:
        sync()
        t0 = time.perf_counter()
        _digest.digest_many(list(dest.values()), algorithm)
        sync()
        return {"s": time.perf_counter() - t0}

    def checks() -> dict[str, float]:
        sync()
        t0 = time.perf_counter()
        bad = check_blocks(plan.checks, dest, algorithm)
        sync()
        if bad:
            raise AssertionError(f"{len(bad)} block(s) do not match, first {bad[0]}")
        return {"s": time.perf_counter() - t0}

    def checks_split() -> dict[str, float]:
        """check_blocks' two steps timed apart (the views, then their digests), and on a
        GPU the launch's table built alone (the host's part of the digests)."""
        sync()
        t0 = time.perf_counter()
        views = block_views(plan.checks, dest, side_by_side=False)
        t1 = time.perf_counter()
        got = _digest.digest_many(views, algorithm)
        sync()
        t2 = time.perf_counter()
        if got != [c.digest for c in plan.checks]:
            raise AssertionError("the blocks' digests do not match")
        out = {"s": t2 - t0, "views_s": t1 - t0, "hash_s": t2 - t1}
        if device.type == "cuda":
            from modelexpress.transfer import _wsum_cuda

            t3 = time.perf_counter()
            _wsum_cuda.table(_wsum_cuda.items_of(views)[0], 1056)
            out["table_s"] = time.perf_counter() - t3
        return out

    def copied() -> dict[str, float]:
        sync()
        t0 = time.perf_counter()
        views = block_views(plan.checks, dest, side_by_side=device.type == "cuda")
        views = [v if v.is_contiguous() else v.contiguous() for v in views]
        sync()
        t1 = time.perf_counter()
        got = _digest.digest_many(views, algorithm)
        sync()
        t2 = time.perf_counter()
        if got != [c.digest for c in plan.checks]:
            raise AssertionError("the copied-out blocks' digests do not match")
        return {"s": t2 - t0, "views_s": t1 - t0, "hash_s": t2 - t1}

    cases = {"whole": whole, "checks": checks, "checks_split": checks_split,
             "checks_copied": copied}
    for case in cases.values():  # untimed: kernel loads, allocator warm
        case()
    rows: dict[str, list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for name, case in cases.items():
            rows.setdefault(name, []).append(case())
        _log(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {rows[n][-1]['s'] * 1e3:.1f} ms" for n in cases))
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
           for name, runs in rows.items()}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"bench": "block-checks", "device": str(device), "gpu": gpu, "dims": args.dims,
            "layers": args.layers, "bytes": nbytes, "checks": len(plan.checks),
            "strided_checks": strided, "algorithm": algorithm,
            "kernel_form": _digest.kernel_form(device) if device.type == "cuda" else "cpu",
            "rounds": args.rounds, "median": med, "each_round": rows,
            "ratio_checks_vs_whole": med["checks"]["s"] / med["whole"]["s"],
            "ratio_copied_vs_whole": med["checks_copied"]["s"] / med["whole"]["s"],
            "host": os.uname().nodename, "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dims", default="4096,1024,14336,32000")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()
