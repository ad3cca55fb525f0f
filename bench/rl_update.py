"""RL weight sync: switching running vLLM engines to a new weight version.

What runs (all real, on loopback): ``python -m modelexpress.server`` (SQLite) and N
vLLM OpenAI servers of vLLM's CPU build (``tests/engines/vllm_engines.py``) started
from checkpoint A with ``--weight-transfer-config '{"backend": "mx"}'`` and
``VLLM_SERVER_DEV_MODE=1``. This process is the trainer: it holds checkpoint B's
tensors (a generated Llama, same shapes, other seed) under their checkpoint names and
drives the engines through vLLM's trainer factory and vLLM's HTTP client
(``HTTPVLLMWeightSyncClient``), all engines at once (``FanOutClient``).

Cases, per engine count, ``--repeats`` times each, versions alternating B, A, B...
so every round really changes the weights:

* ``mx``: ``send_weights()`` from the call to its return, which is when the last
  engine's ``finish_weight_update`` answered: the version published (copy into a
  pool slot, manifest with digests, control plane), every engine's pull into staging
  with digests checked, vLLM's layerwise reload (``load_weights`` + post-processing).
  The first round also registers the pool's slots (reported apart, ``mx_first_s``).
* ``disk``: the same switch done by reloading the checkpoint directory from disk in
  every engine at once: ``POST /collective_rpc {"method": "reload_weights",
  "kwargs": {"weights_path": DIR}}`` (vLLM's own reload; the page cache is warm:
  the files were just written or read).
* ``save``: what the disk route costs the trainer before that reload: writing the
  version's tensors as safetensors and ``fsync`` (``save_median_s``; to local disk,
  not a shared file system); ``mx_over_save_and_disk`` compares mx with save + reload.
* engine side (from the engines' logs): ``engine_pull_median_s`` (pull into staging,
  digests checked) and ``engine_load_median_s`` (vLLM's layerwise reload), all rounds
  but the first.
* ``copy``: a raw copy of the same bytes in this process (``torch`` ``copy_`` into
  preallocated tensors): the floor no transfer can beat, one engine's worth.

Each mx and disk round is checked: every engine's greedy completion of one prompt
must equal the version's answer (A's from the engines as started, B's from the first
switch to B; the disk reloads of A and B must then answer the same).

Four engines do not fit 2 cores well (each engine's worker wants a core); the
default is ``--engines 1,2``; pass ``--engines 1,2,4`` where there are cores.

Usage: python bench/rl_update.py [--engines 1,2] [--repeats 3] [--layers 4] [--hidden 512]
Prints progress lines on stderr, then ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engines"))
sys.path.insert(0, str(ROOT / "tests" / "server"))

from mx_server_procs import TOKEN, ServerProc  # noqa: E402
from vllm_engines import Engine, make_tiny_llama  # noqa: E402

PROMPT = "the capital of france is"


def _say(msg: str) -> None:
    print(f"[rl_update {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _answer(engine: Engine) -> str:
    return engine.complete(PROMPT, max_tokens=8)


def _disk_reload(engines: list[Engine], ckpt: pathlib.Path) -> float:
    def one(engine: Engine) -> None:
        r = httpx.post(f"{engine.url}/collective_rpc", timeout=300,
                       json={"method": "reload_weights",
                             "kwargs": {"weights_path": str(ckpt)}})
        r.raise_for_status()

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
        for f in [pool.submit(one, e) for e in engines]:
            f.result()
    return time.perf_counter() - t0


def _save(tensors: dict, ckpt: pathlib.Path, scratch: pathlib.Path) -> float:
    """What the trainer pays to put a version on disk first: write the checkpoint's
    tensors (safetensors) and fsync. Written beside, not over, the engines' checkpoint."""
    from safetensors.torch import save_file

    scratch.mkdir(exist_ok=True)
    path = scratch / f"{ckpt.name}.safetensors"
    t0 = time.perf_counter()
    save_file(tensors, str(path))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def _raw_copy(tensors: dict, repeats: int) -> float:
    import torch

    dest = {n: torch.empty_like(t) for n, t in tensors.items()}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for n, t in tensors.items():
            dest[n].copy_(t)
        best = min(best, time.perf_counter() - t0)
    return best


def run(args: argparse.Namespace, work: pathlib.Path) -> dict:
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from modelexpress.engines.vllm.plugin import register
    from modelexpress.rl import FanOutClient, MxTrainerInitInfo, StateDictSource
    from modelexpress.rl.trainer import MxTrainerWeightTransferEngine

    register()
    ckpt = {"A": make_tiny_llama(work / "A", hidden_size=args.hidden, num_layers=args.layers,
                                 intermediate_size=args.hidden * 2, seed=0),
            "B": make_tiny_llama(work / "B", hidden_size=args.hidden, num_layers=args.layers,
                                 intermediate_size=args.hidden * 2, seed=1)}
    weights = {v: load_file(str(p / "model.safetensors")) for v, p in ckpt.items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights["A"].values())
    # What the trainer holds (its own tensors): each round copies a version into them.
    current = {n: t.clone() for n, t in weights["A"].items()}
    _say(f"checkpoints: {nbytes / 1e6:.1f} MB, {len(current)} tensors")
    copy_s = _raw_copy(weights["B"], 5)

    server = ServerProc(f"sqlite:///{work}/mx.db", work, env={"MX_STALE_AFTER_S": "600"}).start()
    env = {"MX_SERVER_URL": server.url, "MX_SERVER_TOKEN": TOKEN, "VLLM_SERVER_DEV_MODE": "1",
           "MX_HEARTBEAT_INTERVAL_S": "2"}
    os.environ.update({"MX_SERVER_URL": server.url, "MX_SERVER_TOKEN": TOKEN})
    results: dict = {"bytes": nbytes, "tensors": len(current), "copy_s": copy_s, "by_engines": {}}
    try:
        for n in args.engines:
            engines = [Engine(ckpt["A"], name=f"rl{n}-{i}", log_dir=work, env=env,
                              extra_args=["--weight-transfer-config",
                                          json.dumps({"backend": "mx"})]) for i in range(n)]
            try:
                for e in engines:
                    e.start()
                for e in engines:
                    e.wait_ready(timeout=600)
                _say(f"{n} engine(s) ready")
                answers = {"A": _answer(engines[0])}
                client = FanOutClient([HTTPVLLMWeightSyncClient(e.url) for e in engines])
                trainer = WeightTransferTrainerFactory.trainer_init(
                    MxTrainerInitInfo(model=f"bench-rl-{n}", rank=0),
                    client=client, source=StateDictSource(current))
                assert isinstance(trainer, MxTrainerWeightTransferEngine)
                try:
                    mx_s, disk_s, save_s, first_s = [], [], [], None
                    for r in range(args.repeats * 2 + 1):
                        version = "B" if r % 2 == 0 else "A"
                        for name, t in weights[version].items():
                            current[name].copy_(t)
                        report = trainer.send_weights()
                        got = [_answer(e) for e in engines]
                        if version not in answers:
                            answers[version] = got[0]
                        assert got == [answers[version]] * n, (version, got, answers)
                        if first_s is None:
                            first_s = report.seconds
                        else:
                            mx_s.append(report.seconds)
                        _say(f"{n} engine(s) mx round {r} -> {version}: {report.seconds:.3f} s "
                             f"(engines {', '.join(f'{s:.3f}' for s in report.engine_seconds)})")
                    for r in range(args.repeats):
                        version = "A" if r % 2 == 0 else "B"
                        save_s.append(_save(weights[version], ckpt[version], work / "saved"))
                        secs = _disk_reload(engines, ckpt[version])
                        got = [_answer(e) for e in engines]
                        assert got == [answers[version]] * n, ("disk", version, got, answers)
                        disk_s.append(secs)
                        _say(f"{n} engine(s) disk reload -> {version}: {secs:.3f} s")
                finally:
                    trainer.shutdown()
                # The engines' own account of each update (all rounds but the first).
                lines = [re.findall(r"pulled and verified in ([0-9.]+) s .*?loaded in ([0-9.]+) s",
                                    e.log_text())[1:] for e in engines]
                pulls = [float(p) for per in lines for p, _ in per]
                loads = [float(ld) for per in lines for _, ld in per]
                results["by_engines"][str(n)] = {
                    "engine_pull_median_s": statistics.median(pulls),
                    "engine_load_median_s": statistics.median(loads),
                    "mx_first_s": first_s, "mx_s": mx_s, "disk_s": disk_s,
                    "mx_median_s": statistics.median(mx_s),
                    "disk_median_s": statistics.median(disk_s),
                    "save_median_s": statistics.median(save_s),
                    "mx_over_save_and_disk": statistics.median(mx_s) / (
                        statistics.median(save_s) + statistics.median(disk_s)),
                    "mx_over_disk": statistics.median(mx_s) / statistics.median(disk_s),
                    "mx_over_copy": statistics.median(mx_s) / copy_s}
            finally:
                for e in engines:
                    e.stop()
    finally:
        server.stop()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="1,2",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="mx-rl-bench-") as tmp:
        out = run(args, pathlib.Path(tmp))
    out["args"] = vars(args)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
