"""Time to ready of a vLLM engine with vLLM's default compilation: cold, warm, pulled.

What runs (all real, on loopback): ``python -m modelexpress.server`` (SQLite) and vLLM
OpenAI servers of vLLM's CPU build (``tests/engines/vllm_engines.py``), compilation
ON (no ``--enforce-eager``), one generated Llama checkpoint. Source A starts first
(``--load-format mx``, ``MX_ARTIFACT_KEY`` set, its own empty ``VLLM_CACHE_ROOT``):
it loads from disk, compiles, and serves its weights and its compile cache. Then,
``--repeats`` times, one engine per case, one at a time, A serving throughout:

* ``cold``: plain vLLM (``--load-format auto``), an empty cache root: weights from
  disk, everything compiled;
* ``warm``: plain vLLM with a copy of A's cache root (the same engine started again
  on a host that compiled it before: vLLM's own best case, the goal's baseline);
* ``weights``: ``--load-format mx`` with the weights moved away, no key: weights
  pulled, compiled from scratch (what a pull gave before artifacts moved);
* ``artifacts``: ``--load-format mx``, weights moved away, the key set, an empty cache
  root: weights and compiled artifacts pulled.

Per engine, from its log: time to ready (process start to ``/health`` and
``/v1/models``), process start and imports (to vLLM's "Initializing a V1 LLM engine"
line of the engine core), weights (vLLM's "Loading weights took", or our loader's
weight phase), artifacts (our install line), compile (vLLM's warm-up, from "Warming
up model for the compilation" to "Warming up done", 1-s log resolution), init engine
(profile, KV cache, warm-up: vLLM's own figure), and the artifact outcome (``hit``
needed for the ``artifacts`` case to count).

Reported: medians, and ratios artifacts/warm (goal <= 1.10), artifacts/cold,
weights/cold.

Usage: python bench/time_to_ready.py [--quick] [--repeats N] [--layers N] [--hidden N]
Prints progress on stderr, then ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "engines"))
sys.path.insert(0, str(ROOT / "tests" / "server"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402
from checkpoint_moves import weights_away  # noqa: E402
from vllm_engines import Engine, make_tiny_llama  # noqa: E402

CASES = ("cold", "warm", "weights", "artifacts")
KEY = "bench-time-to-ready-key-0123456789"
PROMPT = "the capital of france is"
READY_TIMEOUT_S = 600.0
_TS = re.compile(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)")


def _say(msg: str) -> None:
    print(f"[time_to_ready] {msg}", file=sys.stderr, flush=True)


def _stamp(line: str) -> float | None:
    m = _TS.search(line)
    if not m:
        return None
    mo, d, h, mi, s = map(int, m.groups())
    return datetime.datetime(2000, mo, d, h, mi, s).timestamp()


def _first(log: str, pattern: str) -> str | None:
    m = re.search(rf"^.*{pattern}.*$", log, re.M)
    return m.group(0) if m else None


def parse_log(case: str, ready_s: float, log: str, started_wall: float) -> dict[str, Any]:
    """The phases of one engine's start, from its log."""
    out: dict[str, Any] = {"case": case, "ready_s": round(ready_s, 2)}
    init = _first(log, r"Initializing a V1 LLM engine")
    t_init = _stamp(init) if init else None
    if t_init is not None:  # log stamps have 1-s resolution and no year
        start = datetime.datetime.fromtimestamp(started_wall)
        out["start_imports_s"] = round(t_init - start.replace(year=2000, microsecond=0)
                                       .timestamp(), 1)
    m = re.search(r"Loading weights took ([\d.]+) seconds", log)
    ours = re.search(r"loaded from (peer|disk) in [\d.]+ s \(weights ([\d.]+) s", log)
    out["weights_s"] = float(ours.group(2)) if ours else (float(m.group(1)) if m else None)
    out["weights_from"] = ours.group(1) if ours else "disk"
    m = re.search(r"installed \d+ compiled-artifact files \(([\d.]+) MB\).* in ([\d.]+) s", log)
    out["artifacts_s"] = float(m.group(2)) if m else None
    out["artifacts_mb"] = float(m.group(1)) if m else None
    m = re.search(r"compiled artifacts (hit|miss|refused|present)", log)
    out["artifact_outcome"] = m.group(1) if m else ("off" if case != "artifacts" else None)
    w0, w1 = _first(log, "Warming up model for the compilation"), _first(log, "Warming up done")
    out["compile_s"] = (_stamp(w1) - _stamp(w0)) if w0 and w1 else None
    m = re.search(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)", log)
    out["init_engine_s"] = float(m.group(1)) if m else None
    return out


def _median(values: list[Any]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return round(statistics.median(vals), 2) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, 1 repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.layers, args.hidden = 1, 2, 128
    work = pathlib.Path(tempfile.mkdtemp(prefix="mx-ttr-"))
    logs = work / "logs"
    logs.mkdir()
    ckpt = make_tiny_llama(work / "llama", num_layers=args.layers, hidden_size=args.hidden,
                           intermediate_size=args.hidden * 2)
    server = ServerProc(f"sqlite:///{work}/mx.db", logs, env={"MX_STALE_AFTER_S": "600"}).start()
    mx = {"MX_SERVER_URL": server.url, "MX_SERVER_TOKEN": TOKEN, "MX_HEARTBEAT_INTERVAL_S": "1",
          "MX_CLIENT_RETRIES": "1", "MX_ARTIFACT_SETTLE_S": "1"}
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CASES}
    try:
        source = Engine(ckpt, name="A-source", log_dir=logs, load_format="mx",
                        enforce_eager=False,
                        env={**mx, "MX_ARTIFACT_KEY": KEY, "VLLM_CACHE_ROOT": str(work / "cache-a")})
        t_wall = time.time()
        source.start()
        a_ready = source.wait_ready(READY_TIMEOUT_S)
        deadline = time.monotonic() + 300
        while "serving compiled artifacts" not in source.log_text():
            if time.monotonic() > deadline:
                raise RuntimeError("source A never served its compiled artifacts:\n"
                                   + source.log_tail())
            time.sleep(0.5)
        a_run = parse_log("source", a_ready, source.log_text(), t_wall)
        expected = source.complete(PROMPT, max_tokens=8)
        _say(f"source A ready in {a_ready:.1f} s and serving weights + artifacts")
        for rep in range(args.repeats):
            order = CASES[rep % len(CASES):] + CASES[:rep % len(CASES)]
            for case in order:
                cache = work / f"cache-{case}-{rep}"
                if case == "warm":
                    shutil.copytree(work / "cache-a", cache, symlinks=True)
                env = {"VLLM_CACHE_ROOT": str(cache)}
                load_format = "auto"
                if case in ("weights", "artifacts"):
                    load_format = "mx"
                    env.update(mx, MX_SERVE_AFTER_PULL="0")
                    if case == "artifacts":
                        env["MX_ARTIFACT_KEY"] = KEY
                away = weights_away(ckpt) if load_format == "mx" else contextlib.nullcontext()
                with away:
                    engine = Engine(ckpt, name=f"{case}-{rep}", log_dir=logs,
                                    load_format=load_format, enforce_eager=False, env=env)
                    t_wall = time.time()
                    engine.start()
                    try:
                        ready = engine.wait_ready(READY_TIMEOUT_S)
                        if case == "artifacts":
                            end = time.monotonic() + 120
                            while not re.search(r"compiled artifacts (hit|miss)",
                                                engine.log_text()):
                                if time.monotonic() > end:
                                    break
                                time.sleep(0.25)
                        same = engine.complete(PROMPT, max_tokens=8) == expected
                        run = parse_log(case, ready, engine.log_text(), t_wall)
                        run["answer_matches_source"] = same
                    finally:
                        engine.stop()
                runs[case].append(run)
                _say(f"repeat {rep} {case}: ready {run['ready_s']} s, weights "
                     f"{run['weights_s']} s ({run['weights_from']}), artifacts "
                     f"{run['artifact_outcome']}, init engine {run['init_engine_s']} s")
        source.stop()
    finally:
        server.stop()
    med = {c: {k: _median([r.get(k) for r in runs[c]])
               for k in ("ready_s", "start_imports_s", "weights_s", "artifacts_s",
                         "compile_s", "init_engine_s")} for c in CASES}

    def ratio(a: str, b: str) -> float | None:
        x, y = med[a]["ready_s"], med[b]["ready_s"]
        return round(x / y, 3) if x and y else None

    hits = [r["artifact_outcome"] == "hit" for r in runs["artifacts"]]
    result = {
        "bench": "time_to_ready", "layers": args.layers, "hidden": args.hidden,
        "repeats": args.repeats, "source": a_run, "median": med,
        "artifacts_over_warm": ratio("artifacts", "warm"),
        "artifacts_over_cold": ratio("artifacts", "cold"),
        "weights_over_cold": ratio("weights", "cold"),
        "artifact_hits": f"{sum(hits)}/{len(hits)}",
        "answers_match": all(r.get("answer_matches_source") for c in CASES for r in runs[c]),
        "runs": runs, "logs": str(logs),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
