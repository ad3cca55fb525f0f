"""Offline vLLM engines in their own processes, for the GPU engine tests.

:func:`write_tiny_llama` writes a random Llama checkpoint (config.json +
model.safetensors) with torch and safetensors only: the H200 host has no
``transformers`` models or tokenizer packages to make one with, and the engines run
with ``skip_tokenizer_init`` and token-id prompts. :class:`LlmEngine` runs
``vllm_gpu_llm.py`` (one ``vllm.LLM``) in its own process group with its log in a
file; ``stop()`` and ``kill()`` always end the group, and every wait is bounded.

Usage::

    ckpt = write_tiny_llama(tmp / "llama")
    with LlmEngine("A", ckpt, log_dir, load_format="modelexpress", env=env,
                   serve=True).start() as a:
        a.wait_answered(timeout=300)
        a.result["tokens"]
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["LlmEngine", "PROMPTS", "write_tiny_llama", "engine_env"]

HARNESS = pathlib.Path(__file__).resolve().parent / "vllm_gpu_llm.py"
# Fixed token-id prompts (no tokenizer): ids below the checkpoint's vocabulary.
PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 15043, 3186, 29889), (1, 450, 7483, 310, 3444, 338), (1, 29871, 29896, 29871, 29906),
    (1, 9038, 2501, 263, 931))
_POLL_S = 0.2


def write_tiny_llama(path: pathlib.Path, *, hidden_size: int = 1024, num_layers: int = 4,
                     intermediate_size: int = 2816, num_heads: int = 16, num_kv_heads: int = 8,
                     vocab_size: int = 32000, seed: int = 0) -> pathlib.Path:
    """Write a random bf16 Llama (config.json, model.safetensors) to ``path``.

    The same arguments give the same bytes (a seeded CPU generator).

    Returns:
        ``path``.
    """
    import torch
    from safetensors.torch import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    head_dim = hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "vocab_size": vocab_size,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "bfloat16", "dtype": "bfloat16",
        "attention_bias": False, "mlp_bias": False,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> "torch.Tensor":
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": randn(vocab_size, hidden_size),
               "model.norm.weight": torch.ones(hidden_size, dtype=torch.bfloat16),
               "lm_head.weight": randn(vocab_size, hidden_size)}
    kv = num_kv_heads * head_dim
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(hidden_size, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden_size, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": randn(hidden_size, hidden_size),
            p + "self_attn.k_proj.weight": randn(kv, hidden_size),
            p + "self_attn.v_proj.weight": randn(kv, hidden_size),
            p + "self_attn.o_proj.weight": randn(hidden_size, hidden_size),
            p + "mlp.gate_proj.weight": randn(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": randn(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": randn(hidden_size, intermediate_size),
        })
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def engine_env(**more: str) -> dict[str, str]:
    """The environment every engine gets (GPU_VLLM.md's settings), plus ``more``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
    env.update({"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
    env.update(more)
    return env


class LlmEngine:
    """One ``vllm_gpu_llm.py`` process.

    Args:
        name: names the log (``<name>.log``) and the result (``<name>.json``).
        model: checkpoint directory.
        log_dir: where logs, specs and results go.
        load_format: vLLM load format (``modelexpress``, ``mx``, ``auto``).
        env: the process environment (see :func:`engine_env`).
        extra_config: ``model_loader_extra_config``.
        enforce_eager: False: vLLM's default compilation (and CUDA graphs).
        serve: stay alive after answering until :meth:`stop`.
        prompts, max_tokens: what to answer greedily.
        kv_cache_memory_bytes: a fixed KV cache (vLLM skips its memory profiling).
        spec: more keys of the harness's spec (``vllm_gpu_llm.py``: ``events``,
            ``logprobs``, ``gpu_memory_utilization``...).
    """

    def __init__(self, name: str, model: pathlib.Path, log_dir: pathlib.Path, *,
                 load_format: str, env: Mapping[str, str],
                 extra_config: Mapping[str, Any] | None = None, enforce_eager: bool = True,
                 serve: bool = False, prompts: Sequence[Sequence[int]] = PROMPTS,
                 max_tokens: int = 16, kv_cache_memory_bytes: int | None = None,
                 spec: Mapping[str, Any] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.out = log_dir / f"{name}.json"
        self._stop_file = log_dir / f"{name}.stop"
        self._spec_path = log_dir / f"{name}.spec.json"
        self._spec = {"model": str(model), "out": str(self.out), "load_format": load_format,
                      "extra_config": dict(extra_config or {}), "enforce_eager": enforce_eager,
                      "prompts": [list(p) for p in prompts], "max_tokens": max_tokens,
                      "serve_until": str(self._stop_file) if serve else None,
                      "kv_cache_memory_bytes": kv_cache_memory_bytes, **(spec or {})}
        self._env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.result: dict[str, Any] | None = None

    def start(self) -> "LlmEngine":
        for p in (self.out, self._stop_file):
            p.unlink(missing_ok=True)
        self._spec["t0"] = time.time()
        self._spec_path.write_text(json.dumps(self._spec))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, str(HARNESS), str(self._spec_path)],
                                         stdout=log, stderr=subprocess.STDOUT, env=self._env,
                                         start_new_session=True)
        return self

    def wait_answered(self, timeout: float) -> dict[str, Any]:
        """Wait until the engine has built and answered; its result.

        Raises:
            RuntimeError: it exited first. TimeoutError: not within ``timeout`` s.
        """
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        next_note = time.monotonic() + 60.0
        while not self.out.exists():
            if self.proc.poll() is not None and not self.out.exists():
                raise RuntimeError(f"engine {self.name} exited with {self.proc.returncode} "
                                   f"before answering:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.name} did not answer in {timeout:.0f} s:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > next_note:
                print(f"still waiting for engine {self.name} after "
                      f"{timeout - (deadline - time.monotonic()):.0f} s", flush=True)
                next_note += 60.0
            time.sleep(_POLL_S)
        self.result = json.loads(self.out.read_text())
        return self.result

    def wait_for_log(self, pattern: str, timeout: float) -> re.Match[str]:
        """Wait for a line matching ``pattern`` in the log.

        Raises:
            RuntimeError: the process exited first. TimeoutError: not within ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            found = regex.search(self.log_text())
            if found:
                return found
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited before logging {pattern!r}:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.name} did not log {pattern!r} in "
                                   f"{timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(_POLL_S)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the engine's process group (no shutdown code runs)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 60.0) -> None:
        """Let a serving engine exit (its source withdraws), SIGKILL after ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            self.kill()  # a group member may outlive the leader
            return
        self._stop_file.touch()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def __enter__(self) -> "LlmEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what the log says -------------------------------------------------------------
    def figures(self) -> dict[str, Any]:
        """Phases this engine logged: the loader's line, the pull, vLLM's own timings."""
        log = self.log_text()
        out: dict[str, Any] = dict(self.result or {})
        out.pop("tokens", None)
        m = re.search(r"loaded from (peer|disk) in ([\d.]+) s \(weights ([\d.]+) s, "
                      r"post-processing ([\d.]+) s, probe ([\d.]+) s\)", log)
        if m:
            out.update(mx_source=m.group(1), mx_load_s=float(m.group(2)),
                       mx_weights_s=float(m.group(3)), mx_post_process_s=float(m.group(4)),
                       mx_probe_s=float(m.group(5)))
        m = re.search(r"pulled .*?: \d+ tensors, ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s, "
                      r"(\S+), digests (\S+ ?\S*), probe (\w+)\); the pull took ([\d.]+) s", log)
        if m:
            out.update(pull_gb=float(m.group(1)), pull_s=float(m.group(2)),
                       pull_gbps=float(m.group(3)), pull_transport=m.group(4),
                       pull_digests=m.group(5), pull_probe=m.group(6),
                       pull_total_s=float(m.group(7)))
        for key, pattern in (("vllm_model_loading_s", r"Model loading took \S+ GiB (?:memory )?"
                                                      r"and ([\d.]+) seconds"),
                             ("vllm_loading_weights_s", r"Loading weights took ([\d.]+) seconds"),
                             ("vllm_init_engine_s", r"init engine .*? took ([\d.]+) s"),
                             ("vllm_compilation_s", r"init engine .*? \(compilation: ([\d.]+) s"),
                             ("vllm_compile_s", r"torch\.compile took ([\d.]+) s in total"),
                             ("vllm_graph_capture_s", r"Graph capturing finished in ([\d.]+) secs")):
            found = re.search(pattern, log)
            if found:
                out[key] = float(found.group(1))
        out["compiled_graph_loaded_from_cache"] = "Directly load the compiled graph" in log
        out["aot_loaded_from_cache"] = "Directly load AOT compilation" in log
        m = re.search(r"compiled artifacts (hit|miss|refused|present)", log)
        out["artifacts"] = m.group(1) if m else None
        m = re.search(r"installed (\d+) compiled-artifact files \(([\d.]+) MB\).* over (\S+) in "
                      r"([\d.]+) s", log)
        if m:
            out.update(artifact_files=int(m.group(1)), artifact_mb=float(m.group(2)),
                       artifact_transport=m.group(3), artifact_s=float(m.group(4)))
        return out
