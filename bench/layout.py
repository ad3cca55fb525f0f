"""A pull across tensor-parallel layouts against a same-layout pull of the same model.

What runs (all real, on loopback, host memory): ``python -m modelexpress.server``
(SQLite); three source processes (``tests/p2p/layout_source.py``) serving a generated
Llama checkpoint (GQA, bf16; ``--hidden``/``--layers``) loaded by vLLM's real model class
and disk loader: TP=1 rank 0 and both ranks of TP=2, each with the layout vLLM's own
weight loaders give and the checkpoint's block digests; and this process as the TP=1
target, whose destination is vLLM's own TP=1 model (its loaded form).

Per round, alternating, each into a fresh destination:

* ``same``: :func:`modelexpress.p2p.pull` from the TP=1 source (today's path: identity
  match, coalesced tensors, per-tensor digests);
* ``across``: :func:`~modelexpress.p2p.layout_pull.pull_across_layouts` from the two
  TP=2 ranks (plan, box copies, block digests);

over the local transport (``local``) and over NIXL (``nixl``, ``MX_IPC_DIR=off``); the
short strided runs (rows of 1 and 2.75 KiB) are read as covering spans and gathered
here (the readers' default), and ``across_runs`` reads them one run each instead (over
NIXL one descriptor per run);
``local_across_after`` is ``local_across`` with every block hashed after the copies
rather than as its bytes land (the readers are offered no checks). ``tp2`` pulls a
TP=2 rank from the TP=1 source (its row-parallel weights are column halves of the
source's rows: ``tp2_covering`` reads whole rows and gathers, ``tp2_runs`` one run per
row). Reported: each pull's ``total_s`` (the call), ``data_s`` (its data plane; the
opening of its sources, ``connect_s`` or ``phase_connect_s``, apart from it, and for
a pull across layouts their closing, ``close_s`` or ``phase_close_s``), the
median over rounds (``each_round``: every timed round's), and ``ratio_across_vs_same``
(medians of ``total_s``; goal <= 1.3).

``--synthetic DEVICE`` (``cpu`` or ``cuda:N``) runs the same comparison without vLLM, on
the hand-written layouts of ``tests/p2p/synthetic_layout.py`` (a merged qkv, row-parallel
``o`` and ``down``, a padded vocabulary, a replicated norm; float32) at ``--dims``
(default Llama-3-8B's widths with a 32000 vocabulary) and ``--layers`` (default one:
0.93 GB at TP=1; ``--dims 4096,1024,14336,128256 --layers 32``, 15.0 GB, is a real 8B
model's size in 193 checkpoint tensors, 129 tensors a rank):
three source processes (``synthetic_source.py``: TP=1 and both TP=2 ranks, each in one
allocation on DEVICE, block digests hashed there) and this process as the target,
its destination on DEVICE. Cases ``{local,nixl}_same``, ``{local,nixl}_across``
(TP=2 -> TP=1), ``local_across_covering`` (the same with the rows of ``o`` and ``down``,
8 and 28 KiB, read as covering spans and gathered, as the NIXL reader does: into host
memory the local reader reads runs of 8 KiB and more one by one) and
``{local,nixl}_tp2`` (TP=1 -> a TP=2 rank); on a GPU also
``row_copies``: the row-parallel weights' column halves copied on their own by
``cuMemcpy2DAsync``, against one contiguous copy of the same bytes. A pull across layouts
also reports ``hashing_s`` (its block checks' hashing, beside later reads and after the
last), and ``readers_last_round`` each case's reader lines of the last round (per
source: runs planned, copies issued, and, into a GPU, how long after issuing they were
done). This is the GPU machine's
run (one GPU: the sources are processes, not TP=2 engines); every case's first, untimed
pull is compared byte for byte with the checkpoint's slices.

``--plan-only`` derives the layouts of Llama-3.1-8B's shapes (meta tensors: no weights)
at TP 1, 2, 4, 8 and plans every target rank from every other layout: derivation and
planning time, layout JSON size, bytes read against bytes needed.

Usage: python bench/layout.py [--rounds N] [--hidden H --layers L] | --plan-only
       | --synthetic DEVICE [--dims H,KV,INTER,VOCAB] [--layers L] [--rounds N]
Prints progress lines, then ONE JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "engines"))
sys.path.insert(0, str(ROOT / "tests" / "server"))
sys.path.insert(0, str(ROOT / "tests" / "p2p"))

FAMILY = "bench"


def _log(msg: str) -> None:
    print(f"[bench/layout] {msg}", file=sys.stderr, flush=True)


def make_checkpoint(path: pathlib.Path, hidden: int, layers: int) -> pathlib.Path:
    from vllm_engines import make_tiny_llama

    if (path / "model.safetensors").exists():
        return path
    heads = hidden // 128
    return make_tiny_llama(path, hidden_size=hidden, num_layers=layers,
                           intermediate_size=int(hidden * 2.75) // 256 * 256,
                           num_heads=heads, num_kv_heads=max(heads // 4, 1), dtype="bfloat16")


def _fresh(ckpt: pathlib.Path, tp: int, rank: int):  # noqa: ANN202
    from vllm_layouts import load_rank

    dest, layout = load_rank(ckpt, tp, rank, fill=False, dtype="bfloat16")
    for name in layout.tensors:
        dest[name].zero_()  # touched: the pulls write into memory that is there, as in an
        # engine; buffers built with the model (rotary cache, KV scales) keep their values
    return dest, layout


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from layout_source import identity
    from layout_world import layout_sources
    from vllm_layouts import load_rank

    from modelexpress.client import MxClient
    from modelexpress.layout.readers import COVERING_BELOW
    from modelexpress.local import LocalOptions
    from modelexpress.p2p import PullOptions, pull
    from modelexpress.p2p.layout_pull import layout_readers, pull_across_layouts

    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="mx-bench-layout-"))
    ckpt = make_checkpoint(work / f"llama-h{args.hidden}-l{args.layers}", args.hidden, args.layers)
    nbytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    _log(f"checkpoint {ckpt} ({nbytes / 1e6:.0f} MB)")
    commands = {f"{tp}-{rank}": ["layout_source", str(ckpt), str(tp), str(rank), FAMILY,
                                 f"bench-{tp}-{rank}", "--dtype", "bfloat16"]
                for tp, rank in ((1, 0), (2, 0), (2, 1))}
    rows: dict[str, list[dict[str, float]]] = {}
    try:
        with layout_sources(work, commands, ready_s=600, pythonpath=os.pathsep.join(
                (str(ROOT / "tests" / "p2p"), str(ROOT / "tests" / "engines")))) as (server, ipc, _):
            _log("sources ready")
            reference, _ = load_rank(ckpt, 1, 0, dtype="bfloat16")
            client = MxClient(server.url, token=server.token, timeout_s=60.0)

            def same(local: bool) -> dict[str, float]:
                dest, _ = _fresh(ckpt, 1, 0)
                opts = PullOptions(local=LocalOptions(ipc_dir=ipc if local else "off"),
                                   worker_id="bench-target", stall_s=120.0)
                t0 = time.perf_counter()
                result = pull(identity(1, 0, FAMILY, "bfloat16"), dest, client=client, options=opts)
                total = time.perf_counter() - t0
                _check(dest, reference)
                return {"total_s": total, "data_s": result.seconds, "bytes": result.bytes,
                        "descriptors": result.descriptors,
                        **{f"phase_{k}_s": v for k, v in result.phases.items() if v}}

            def across(local: bool, tp: int = 1, rank: int = 0,
                       covering: int | None = None, as_landed: bool = True) -> dict[str, float]:
                dest, target = _fresh(ckpt, tp, rank)
                opts = PullOptions(local=LocalOptions(ipc_dir=ipc if local else "off"),
                                   worker_id="bench-target", stall_s=120.0)
                readers = None
                if not as_landed:  # every block hashed after the copies (the readers offered none)
                    default = layout_readers(opts, _no_nixl, torch.device("cpu"), covering)
                    readers = lambda source: _AfterCopies(default(source))  # noqa: E731
                t0 = time.perf_counter()
                out = pull_across_layouts(identity(tp, rank, FAMILY, "bfloat16"), target, dest,
                                          client=client, readers=readers,
                                          options=opts, covering_below=covering)
                total = time.perf_counter() - t0
                if tp == 1:
                    _check(dest, reference)
                return {"total_s": total, "data_s": out.result.seconds, "bytes": out.result.bytes,
                        "descriptors": out.result.descriptors,
                        "verify_s": out.result.verify_seconds,
                        "blocks": sum(len(v) for v in out.blocks.digests.values()),
                        "blocks_checked_as_landed": out.checked_as_landed,
                        **{f"phase_{k}_s": v for k, v in out.result.phases.items() if v}}

            cases = {
                "local_same": lambda: same(True),
                "local_across": lambda: across(True),
                "local_across_after": lambda: across(True, as_landed=False),
                "local_across_runs": lambda: across(True, covering=0),
                "nixl_same": lambda: same(False),
                "nixl_across": lambda: across(False, covering=COVERING_BELOW),
                "nixl_across_runs": lambda: across(False, covering=0),
                "local_tp2": lambda: across(True, 2, 0),
                "nixl_tp2_covering": lambda: across(False, 2, 0, covering=1 << 40),
                "nixl_tp2_runs": lambda: across(False, 2, 0, covering=0),
            }
            rows = _time_cases(cases, args)
            client.close()
    finally:
        if not args.workdir:  # a checkpoint of its own (305 MB by default): not kept
            shutil.rmtree(work, ignore_errors=True)
    out = {"bench": "layout", "checkpoint_bytes": nbytes, "hidden": args.hidden,
           "layers": args.layers, "rounds": args.rounds, **_summary(rows)}
    med = out["median"]
    out["ratio_across_after_vs_same"] = (
        med["local_across_after"]["total_s"] / med["local_same"]["total_s"]
        if "local_across_after" in med and "local_same" in med else None)
    return out


def _time_cases(cases: dict[str, Any], args: argparse.Namespace
                ) -> dict[str, list[dict[str, float]]]:
    """``--only``'s cases: one untimed round (imports, first connections, checks), then
    ``--rounds`` rounds, each case once a round in turn; every case's rows."""
    if args.only:
        cases = {k: v for k, v in cases.items() if k in args.only.split(",")}
    for case in cases.values():
        case()
    rows: dict[str, list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for name, case in cases.items():
            rows.setdefault(name, []).append(case())
        _log(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {rows[n][-1]['total_s']:.3f} s" for n in cases))
    return rows


def _summary(rows: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Medians over the rounds, the across/same ratios (of totals and of data planes)
    for each transport that ran both, and the host."""
    import torch

    med = {name: {k: statistics.median(r.get(k, 0.0) for r in runs)
                  for k in sorted({k for r in runs for k in r})}
           for name, runs in rows.items()}
    both = [t for t in ("local", "nixl") if f"{t}_across" in med and f"{t}_same" in med]
    return {"median": med, "each_round": rows,
            "ratio_across_vs_same": {t: med[f"{t}_across"]["total_s"] / med[f"{t}_same"]["total_s"]
                                     for t in both},
            "ratio_data_plane": {t: med[f"{t}_across"]["data_s"] / med[f"{t}_same"]["data_s"]
                                 for t in both},
            "host": os.uname().nodename, "cpus": os.cpu_count(), "torch": torch.__version__,
            "load_average_after": os.getloadavg()}


class _AfterCopies:
    """A layout reader that hashes no block as it lands (the caller hashes them all
    after the copies): ``local_across_after``, the baseline of hashing as they land."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def read_copies(self, copies, buffers, **kw):  # noqa: ANN001, ANN003, ANN201
        kw["checks"] = ()
        return self.reader.read_copies(copies, buffers, **kw)


def _no_nixl():  # noqa: ANN202
    raise AssertionError("local_across_after reads over the local transport only")


def _check(dest: dict, reference: dict) -> None:
    """Every tensor equals vLLM's own disk load of the rank (what the loaders write and
    what construction built)."""
    import torch

    bad = [n for n, t in reference.items() if n in dest and not torch.equal(dest[n], t)]
    if bad:
        raise AssertionError(f"pulled tensors differ from vLLM's disk load: {bad[:3]}")


def run_synthetic(args: argparse.Namespace) -> dict[str, Any]:
    """``--synthetic DEVICE``: the module docstring's comparison on hand-written layouts."""
    os.environ["LAYOUT_SYNTHETIC_DIMS"] = args.dims  # before the import: they size them
    os.environ["LAYOUT_SYNTHETIC_LAYERS"] = str(args.layers)
    os.environ["LAYOUT_SYNTHETIC_SEED_DEVICE"] = args.synthetic  # the sources' too
    import torch
    import synthetic_layout as syn
    from layout_world import layout_sources

    from modelexpress.layout.readers import COVERING_BELOW
    from modelexpress.local import LocalOptions
    from modelexpress.p2p import PullOptions, pull
    from modelexpress.p2p.layout_pull import pull_across_layouts

    device = torch.device(args.synthetic)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    work = pathlib.Path(tempfile.mkdtemp(prefix="mx-bench-layout-syn-"))
    commands = {name: ["synthetic_source", str(tp), str(rank), str(device), f"bench-{name}"]
                for name, tp, rank in (("r0", 2, 0), ("r1", 2, 1), ("whole", 1, 0))}
    ckpt = syn.checkpoint()
    nbytes = syn.checkpoint_bytes()
    _log(f"synthetic checkpoint {args.dims}, {args.layers} layer(s) ({nbytes / 1e9:.2f} GB "
         f"float32) on {device}")
    rows: dict[str, list[dict[str, float]]] = {}
    try:
        with layout_sources(work, commands, pythonpath=str(ROOT / "tests" / "p2p"),
                            ready_s=600) as (server, ipc, ids):
            _log("sources ready")
            from modelexpress.client import MxClient

            client = MxClient(server.url, token=server.token, timeout_s=60.0)
            checked: set[tuple[int, int]] = set()

            def fresh(tp: int, rank: int):  # noqa: ANN202
                target = syn.layout(tp, rank)
                dest = {name: torch.zeros(shape, dtype=dtype, device=device)
                        for name, shape, dtype in syn.specs(target)}
                sync()
                return target, dest

            def check(tp: int, rank: int, target, dest) -> None:  # noqa: ANN001
                if (tp, rank) in checked:
                    return
                want = {n: torch.empty(s, dtype=d) for n, s, d in syn.specs(target)}
                syn.assemble(target, ckpt, want)
                bad = [n for n, t in want.items() if not torch.equal(dest[n].cpu(), t)]
                if bad:
                    raise AssertionError(f"tp={tp} rank={rank}: pulled tensors differ: {bad}")
                checked.add((tp, rank))

            details: dict[str, str] = {}  # each pull across layouts' readers, last round

            def options(local: bool) -> PullOptions:
                return PullOptions(local=LocalOptions(ipc_dir=ipc if local else "off"),
                                   worker_id="bench-target", stall_s=120.0)

            def same(local: bool) -> dict[str, float]:
                target, dest = fresh(1, 0)
                t0 = time.perf_counter()
                result = pull(syn.identity(1, 0), dest, client=client, options=options(local))
                sync()
                total = time.perf_counter() - t0
                check(1, 0, target, dest)
                if not result.verified:
                    raise AssertionError("the same-layout pull checked no digests")
                return {"total_s": total, "data_s": result.seconds, "bytes": result.bytes,
                        "descriptors": result.descriptors, "verify_s": result.verify_seconds,
                        "connect_s": result.connect_seconds,
                        **{f"phase_{k}_s": v for k, v in result.phases.items() if v}}

            def across(local: bool, tp: int, rank: int,
                       covering_below: int | None = None) -> dict[str, float]:
                target, dest = fresh(tp, rank)
                t0 = time.perf_counter()
                out = pull_across_layouts(syn.identity(tp, rank), target, dest, client=client,
                                          options=options(local),
                                          covering_below=covering_below)
                sync()
                total = time.perf_counter() - t0
                check(tp, rank, target, dest)
                want = {ids["whole"]} if tp == 2 else {ids["r0"], ids["r1"]}
                if set(out.result.source_ids) != want:
                    raise AssertionError(f"read {out.result.source_ids}, not {want}")
                details[f"{'local' if local else 'nixl'}_tp{tp}"] = out.result.transport_detail
                return {"total_s": total, "data_s": out.result.seconds,
                        "bytes": out.result.bytes, "descriptors": out.result.descriptors,
                        "verify_s": out.result.verify_seconds,
                        "hashing_s": out.hashing_seconds,
                        "connect_s": out.result.connect_seconds,
                        "close_s": out.result.phases.get("close", 0.0),
                        "blocks_checked_as_landed": out.checked_as_landed,
                        **{f"phase_{k}_s": v for k, v in out.result.phases.items() if v}}

            cases = {"local_same": lambda: same(True),
                     "local_across": lambda: across(True, 1, 0),
                     "local_across_covering": lambda: across(True, 1, 0, COVERING_BELOW),
                     "local_tp2": lambda: across(True, 2, 1),
                     "nixl_same": lambda: same(False),
                     "nixl_across": lambda: across(False, 1, 0),
                     "nixl_tp2": lambda: across(False, 2, 1)}
            rows = _time_cases(cases, args)  # the untimed round makes the byte checks
            client.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    out = {"bench": "layout-synthetic", "device": str(device), "gpu": gpu,
           "dims": args.dims, "layers": args.layers, "checkpoint_bytes": nbytes,
           "rounds": args.rounds,
           **_summary(rows), "readers_last_round": details}
    if device.type == "cuda":
        out["row_copies"] = row_copies(
            device, {n: syn.SHAPES[syn.layer_name(0, n)] for n in ("o", "down")}, args.rounds)
    return out


def row_copies(device: Any, shapes: dict[str, tuple[int, ...]], rounds: int
               ) -> dict[str, dict[str, float]]:
    """The row-parallel weights' copies on their own, in this process: a TP=2 shard
    (``rows x cols/2``, contiguous) into its column half of the TP=1 tensor by one
    ``cuMemcpy2DAsync`` (``2d``, what the local reader does), against one contiguous
    copy of the same bytes (``whole``, ``cuMemcpyAsync``); CUDA events, the median of
    ``rounds`` x 5."""
    import torch

    from modelexpress.local.cuda import memcpy2d_async, memcpy_async

    stream = torch.cuda.Stream(device=device)
    out: dict[str, dict[str, float]] = {}
    for name in ("o", "down"):
        rows, cols = shapes[name]
        dst = torch.zeros(rows, cols, device=device)
        shard = torch.randn(rows, cols // 2, device=device)
        flat = torch.empty_like(shard)
        run, d0 = shard.shape[1] * 4, dst.data_ptr() + shard.shape[1] * 4
        ways = {"whole": lambda: memcpy_async(flat.data_ptr(), shard.data_ptr(), shard.nbytes,
                                               stream.cuda_stream),
                "2d": lambda: memcpy2d_async(d0, cols * 4, shard.data_ptr(), run, run, rows,
                                             stream.cuda_stream)}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(max(rounds, 1) * 5 + 1):  # the first of each: untimed
            for way, fn in ways.items():
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                fn()
                end.record(stream)
                end.synchronize()
                times[way].append(start.elapsed_time(end) / 1e3)
        if not torch.equal(dst[:, cols // 2:], shard):
            raise AssertionError(f"{name}: the row copies did not land")
        med = {way: statistics.median(t[1:]) for way, t in times.items()}
        out[name] = {"bytes": shard.nbytes, "row_bytes": run,
                     **{f"{way}_s": v for way, v in med.items()},
                     **{f"{way}_gb_s": shard.nbytes / v / 1e9 for way, v in med.items()}}
        _log(f"row copies of {name} ({rows} rows of {run} B): " + ", ".join(
            f"{way} {v * 1e3:.3f} ms ({shard.nbytes / v / 1e9:.0f} GB/s)"
            for way, v in med.items()))
    return out


def plan_only() -> dict[str, Any]:
    """Layouts of Llama-3.1-8B's shapes at TP 1-8, planned against each other."""
    import torch
    import transformers
    from vllm_layouts import vllm_config

    from modelexpress.engines.vllm.layout import derive_layout, simulated_tensor_parallel
    from modelexpress.layout import CheckpointTensor, plan_layout

    with tempfile.TemporaryDirectory() as tmp:
        cfg = transformers.LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336,
            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
            max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
            torch_dtype="bfloat16")
        cfg.save_pretrained(tmp)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        table = tuple(CheckpointTensor(n, tuple(t.shape), "bfloat16")
                      for n, t in sorted(model.state_dict().items()))
        del model
        from vllm.model_executor.model_loader import get_model_loader

        layouts: dict[int, list] = {}
        derive_s: dict[int, float] = {}
        for tp in (1, 2, 4, 8):
            vc = vllm_config(pathlib.Path(tmp), tp, "bfloat16")
            loader = get_model_loader(vc.load_config)
            t0 = time.perf_counter()
            for rank in range(tp):
                with simulated_tensor_parallel(tp, rank):
                    layouts.setdefault(tp, []).append(
                        derive_layout(vc, vc.model_config, table, loader, tp_size=tp, rank=rank))
            derive_s[tp] = (time.perf_counter() - t0) / tp
            _log(f"TP={tp}: {derive_s[tp]:.3f} s per rank")
    from modelexpress.engines.vllm.layout_blocks import BlockHasher
    from modelexpress.layout import BlockTable

    def with_all_blocks(layout, sliced):  # noqa: ANN001, ANN202
        hasher = BlockHasher(layout, sliced, torch.device("cpu"))
        return layout.with_blocks(BlockTable(hasher.algorithm, hasher.units, hasher.dtypes, {
            c: {i: f"{c}/{i}" for i in idx} for c, idx in hasher.wanted.items()}))

    published = {tp: [with_all_blocks(*lr) for lr in ranks] for tp, ranks in layouts.items()}
    plans = {}
    for src_tp, sources in published.items():
        for dst_tp, targets in layouts.items():
            if src_tp == dst_tp:
                continue
            t0 = time.perf_counter()
            read = needed = 0
            for target, _ in targets:
                plan = plan_layout(target, [(f"r{i}", s) for i, s in enumerate(sources)])
                read += plan.read_bytes
                needed += plan.needed_bytes
            plans[f"{src_tp}->{dst_tp}"] = {
                "plan_s_per_rank": (time.perf_counter() - t0) / dst_tp,
                "read_over_needed": read / needed}
    return {"bench": "layout-plan", "model": "Llama-3.1-8B shapes (bf16, meta)",
            "derive_s_per_rank": derive_s,
            "layout_json_bytes": {tp: len(ranks[0].dumps()) for tp, ranks in published.items()},
            "plans": plans}


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # this process and the sources
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int,
                        help="layers of the checkpoint (default 8; --synthetic: 1)")
    parser.add_argument("--workdir")
    parser.add_argument("--only", help="comma-separated cases (default: all)")
    parser.add_argument("--plan-only", action="store_true")
    parser.add_argument("--synthetic", metavar="DEVICE",
                        help="hand-written layouts, no vLLM, destinations on DEVICE")
    parser.add_argument("--dims", default="4096,1024,14336,32000",
                        help="--synthetic's H,KV,INTER,VOCAB")
    args = parser.parse_args()
    if args.layers is None:
        args.layers = 1 if args.synthetic else 8
    out = (plan_only() if args.plan_only else
           run_synthetic(args) if args.synthetic else run(args))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
