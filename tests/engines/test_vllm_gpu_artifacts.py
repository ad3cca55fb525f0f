"""Compiled artifacts between whole vLLM GPU engines (vLLM's default compilation, CUDA graphs).

On an H200 host (vLLM 0.26.0 staged by ``scripts/gpu_run.sh vllm-stage``), one GPU,
offline ``vllm.LLM`` engines in their own processes (``vllm_gpu_engines.LlmEngine``),
a real control plane on 127.0.0.1, each engine with its own ``VLLM_CACHE_ROOT``:

* A: loads from disk, compiles cold, serves its weights and its compile cache
  (inductor's generated Triton kernels and cubins, the AOT-compiled model) signed with
  ``MX_ARTIFACT_KEY``;
* W: plain vLLM (``load_format="auto"``) with a copy of A's cache root: vLLM's own warm
  start, the baseline of the time-to-ready goal;
* B: weights moved away, empty cache root: pulls weights and artifacts from A, and its
  compile step must report a cache load (``hit``);
* C: the same checkpoint at another path (vLLM's own cache key differs), empty cache
  root: gets the artifacts (``hit``).

Where A's vLLM keeps a compiled-graph index (no mega AOT artifact: vLLM 0.26 on torch
2.11), B and C install it where their vLLM names its directory and load every graph
from it, compiling none again.

Tokens are compared among compiled engines. Times to ready go to ``summary.json`` in
the log directory; nothing here asserts a time.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import sys

import pytest

from checkpoint_moves import weights_away as _weights_away
from vllm_gpu_engines import LlmEngine, engine_env, write_tiny_llama

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402

pytestmark = [
    pytest.mark.gpu, pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("MX_GPU_ENGINE_TESTS") != "1",
                       reason="whole GPU engines: run on a GPU host with "
                              "`scripts/gpu_run.sh vllm-stage vllm-pytest`, which sets "
                              "MX_GPU_ENGINE_TESTS=1 (CI has no GPU)"),
]

READY_S = 420.0
KEY = "gpu-artifact-test-key-0123456789"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    env = os.environ.get("MX_GPU_ENGINE_LOGS")
    path = pathlib.Path(env) if env else tmp_path_factory.mktemp("gpu-artifact-logs")
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_a_pulled_gpu_engine_loads_its_compiled_graph_from_the_pulled_cache(logs, tmp_path) -> None:
    ckpt = write_tiny_llama(tmp_path / "llama")
    server = ServerProc(f"sqlite:///{logs}/mx-artifacts.db", logs,
                        env={"MX_STALE_AFTER_S": "600"}).start()
    summary: dict[str, object] = {}
    try:
        mx = engine_env(MX_SERVER_URL=server.url, MX_SERVER_TOKEN=TOKEN,
                        MX_HEARTBEAT_INTERVAL_S="1", MX_CLIENT_RETRIES="1",
                        MX_ARTIFACT_KEY=KEY, MX_ARTIFACT_SETTLE_S="1")
        extra = {"mx_identity_extra": {"test": "gpu-artifacts"}}
        with LlmEngine("A-art", ckpt, logs, load_format="modelexpress",
                       env={**mx, "VLLM_CACHE_ROOT": str(tmp_path / "cache-a")},
                       extra_config=extra, enforce_eager=False, serve=True).start() as a:
            a.wait_answered(READY_S)
            a.wait_for_log(r"serving compiled artifacts of rank 0", 120)
            summary["A-cold"] = a.figures()
            indexed = "Cache the graph of compile range" in a.log_text()
            if indexed:
                assert "carry vLLM's compiled-graph index" in a.log_text(), a.log_tail()
            shutil.copytree(tmp_path / "cache-a", tmp_path / "cache-w", symlinks=True)
            with LlmEngine("W-warm", ckpt, logs, load_format="auto",
                           env=engine_env(VLLM_CACHE_ROOT=str(tmp_path / "cache-w")),
                           enforce_eager=False).start() as w:
                w.wait_answered(READY_S)
                summary["W-warm-local"] = w.figures()
                assert w.result["tokens"] == a.result["tokens"]
            with _weights_away(ckpt):
                with LlmEngine("B-art", ckpt, logs, load_format="modelexpress",
                               env={**mx, "VLLM_CACHE_ROOT": str(tmp_path / "cache-b")},
                               extra_config={**extra, "mx_serve_after_pull": False},
                               enforce_eager=False).start() as b:
                    b.wait_answered(READY_S)
                    b.wait_for_log(r"compiled artifacts (hit|miss)", 60)
                    summary["B-pulled-artifacts"] = b.figures()
                    log = b.log_text()
                    assert re.search(r"rank 0 loaded from peer", log), b.log_tail()
                    assert re.search(r"installed \d+ compiled-artifact files", log), b.log_tail()
                    assert "compiled artifacts hit" in log, b.log_tail()
                    _graphs_from_the_index(b, indexed)
                    assert b.result["tokens"] == a.result["tokens"]
            other = tmp_path / "elsewhere" / "llama"
            shutil.copytree(ckpt, other)
            with LlmEngine("C-art-other-path", other, logs, load_format="modelexpress",
                           env={**mx, "VLLM_CACHE_ROOT": str(tmp_path / "cache-c")},
                           extra_config={**extra, "mx_serve_after_pull": False},
                           enforce_eager=False).start() as c:
                c.wait_answered(READY_S)
                c.wait_for_log(r"compiled artifacts (hit|miss)", 60)
                summary["C-other-path-artifacts"] = c.figures()
                assert "compiled artifacts hit" in c.log_text(), c.log_tail()
                _graphs_from_the_index(c, indexed)
                assert c.result["tokens"] == a.result["tokens"]
    finally:
        server.stop()
        (logs / "summary-artifacts.json").write_text(json.dumps(summary, indent=1, default=str))
        print(json.dumps(summary, default=str))


def _graphs_from_the_index(engine: LlmEngine, indexed: bool) -> None:
    """With a compiled-graph index at the source, the engine installed it and vLLM
    loaded every graph from it (its own log lines), compiling none again."""
    log = engine.log_text()
    if not indexed:
        assert "installed vLLM's compiled-graph index" not in log, engine.log_tail()
        return
    assert "installed vLLM's compiled-graph index" in log, engine.log_tail()
    assert "Directly load the compiled graph(s)" in log, engine.log_tail()
    assert "Compiling a graph for compile range" not in log, engine.log_tail()
