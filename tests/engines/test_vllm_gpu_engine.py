"""Whole vLLM GPU engines loading through modelexpress, on one GPU.

Each engine is an offline ``vllm.LLM`` in its own process (``vllm_gpu_llm.py``), with a
real control-plane server (``python -m modelexpress.server``, SQLite) on 127.0.0.1.
On an H200 host vLLM is 0.26.0, staged from its parts
(``scripts/gpu_run.sh vllm-stage``). A engines load a random bf16 Llama from disk with
``load_format="modelexpress"`` (vLLM's built-in wrapper of our loader) and serve it;
B engines start with the checkpoint's weights moved away and must pull from A over
the local transport (same GPU: A's memory handed over as POSIX fds of its VMM arena
chunks, or as CUDA IPC handles without the arena). Greedy tokens are compared as
lists: a pulled engine answers exactly as its source and as a plain
``load_format="auto"`` engine.

Figures (time to ready, weight phase, pull) go to ``summary.json`` in the log
directory (``MX_GPU_ENGINE_LOGS``, else a temp dir); nothing here asserts a time.
Each test has its own ``mx_identity_extra`` so one server serves the module.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from checkpoint_moves import weights_away as _weights_away
from vllm_gpu_engines import LlmEngine, engine_env, write_tiny_llama

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402

pytestmark = [
    pytest.mark.gpu, pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("MX_GPU_ENGINE_TESTS") != "1",
                       reason="whole GPU engines: run on a GPU host with "
                              "`scripts/gpu_run.sh vllm-stage vllm-engine`, which sets "
                              "MX_GPU_ENGINE_TESTS=1 (CI has no GPU)"),
]

READY_S = 420.0  # the bound of one engine's start (a cold compile takes ~50 s there)
_SUMMARY: dict[str, Any] = {}


# --- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pathlib.Path]:
    configured = os.environ.get("MX_GPU_ENGINE_LOGS")
    path = pathlib.Path(configured) if configured else tmp_path_factory.mktemp("gpu-engines")
    path.mkdir(parents=True, exist_ok=True)
    yield path
    (path / "summary.json").write_text(json.dumps(_SUMMARY, indent=1, sort_keys=True))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama")
    _SUMMARY["checkpoint_bytes"] = (path / "model.safetensors").stat().st_size
    return path


@pytest.fixture(scope="module")
def server(logs: pathlib.Path) -> Iterator[ServerProc]:
    srv = ServerProc(f"sqlite:///{logs}/mx.db", logs, env={"MX_STALE_AFTER_S": "600"}).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(ckpt: pathlib.Path, logs: pathlib.Path) -> list[list[int]]:
    """What a plain vLLM engine (``load_format="auto"``, eager) answers, and its times."""
    with LlmEngine("plain-eager", ckpt, logs, load_format="auto", env=engine_env()).start() as d:
        d.wait_answered(READY_S)
        _SUMMARY["plain-eager"] = d.figures()
        return d.result["tokens"]


def _mx_env(server: ServerProc, arena: bool, **more: str) -> dict[str, str]:
    return engine_env(MX_SERVER_URL=server.url, MX_SERVER_TOKEN=TOKEN,
                      MX_HEARTBEAT_INTERVAL_S="1", MX_CLIENT_RETRIES="1",
                      MX_VMM_ARENA="1" if arena else "0", **more)


def _extra(case: str, **options: object) -> dict[str, object]:
    return {"mx_identity_extra": {"test": case}, **options}


def _assert_served(a: LlmEngine, arena: bool) -> None:
    log = a.log_text()
    assert re.search(r"loaded from disk in .*; serving it", log), a.log_tail()
    assert re.search(r"local source \S+ serving \d+ segments", log), a.log_tail()
    _assert_no_layout_on_the_gpu(a)
    kinds = a.result["served_segments"]
    if arena:
        # the weights live in the arena: its chunks go to peers as POSIX fds
        assert re.search(r"VMM arena load done on device 0", log), a.log_tail()
        assert kinds.get("vmm_fd", 0) > 0, kinds
    else:
        assert "VMM arena" not in log, a.log_tail()
        assert kinds.get("cuda_ipc", 0) > 0 and "vmm_fd" not in kinds, kinds


def _assert_no_layout_on_the_gpu(engine: LlmEngine) -> None:
    """GPU engines take no part in pulls across parallel layouts yet
    (``layout_step.GPU_ENGINES``): a GPU rank says so in one line and derives, hashes and
    publishes no layout; its own layout's pulls are unchanged."""
    log = engine.log_text()
    refusals = re.findall(r"is not eligible for pulls across parallel layouts: its load "
                          r"device is cuda\S*: GPU engines take no part", log)
    assert len(refusals) == 1, engine.log_tail()
    assert "block digests hashed" not in log, engine.log_tail()


def _assert_pulled_locally(b: LlmEngine) -> None:
    log = b.log_text()
    _assert_no_layout_on_the_gpu(b)
    assert re.search(r"rank 0 loaded from peer", log), b.log_tail()
    assert re.search(r"pulled .* GB/s, local, digests verified, probe match\)", log), b.log_tail()
    assert "from disk with the" not in log, b.log_tail()


def _pull_case(ckpt: pathlib.Path, logs: pathlib.Path, server: ServerProc,
               reference: list[list[int]], *, case: str, arena: bool, eager: bool) -> None:
    env = _mx_env(server, arena)
    with LlmEngine(f"A-{case}", ckpt, logs, load_format="modelexpress", env=env,
                   extra_config=_extra(case), enforce_eager=eager, serve=True).start() as a:
        a.wait_answered(READY_S)
        _assert_served(a, arena)
        assert a.result["tokens"] == reference
        _SUMMARY[f"A-{case}"] = a.figures()
        with _weights_away(ckpt):
            with LlmEngine(f"B-{case}", ckpt, logs, load_format="modelexpress", env=env,
                           extra_config=_extra(case, mx_serve_after_pull=False),
                           enforce_eager=eager).start() as b:
                b.wait_answered(READY_S)
                _SUMMARY[f"B-{case}"] = b.figures()
                _assert_pulled_locally(b)
                assert b.result["tokens"] == a.result["tokens"]


# --- tests -------------------------------------------------------------------------------------
def test_vmm_arena_source_serves_a_same_gpu_target_that_answers_exactly_as_it(
        ckpt, logs, server, reference) -> None:
    """A: disk, MX_VMM_ARENA=1, serves its arena chunks as POSIX fds; B: no weights on
    disk, pulls them over the local transport, the probe matches, same greedy tokens."""
    _pull_case(ckpt, logs, server, reference, case="arena-eager", arena=True, eager=True)


def test_without_the_arena_the_target_pulls_cuda_ipc_blocks_and_answers_the_same(
        ckpt, logs, server, reference) -> None:
    _pull_case(ckpt, logs, server, reference, case="noarena-eager", arena=False, eager=True)


def test_source_killed_during_the_pull_target_loads_from_disk_and_answers_right(
        ckpt, logs, server, reference) -> None:
    """SIGKILL of A's process group while B's pull is under way (B's rate is capped so
    the pull lasts seconds): B sees the source gone at a chunk boundary, re-creates the
    model, loads it from disk and answers as a plain engine."""
    case = "sigkill"
    with LlmEngine(f"A-{case}", ckpt, logs, load_format="modelexpress",
                   env=_mx_env(server, True), extra_config=_extra(case), serve=True).start() as a:
        a.wait_answered(READY_S)
        _assert_served(a, True)
        slow = _mx_env(server, True, MX_TRANSFER_MAX_GBPS="0.02",
                       MX_TRANSFER_CHUNK_BYTES=str(4 << 20))
        # A's memory is freed while B initialises: vLLM 0.26's memory profiling asserts
        # that no other process on the GPU released memory meanwhile ("Error in memory
        # profiling", seen here); with a fixed KV cache size it does not profile.
        with LlmEngine(f"B-{case}", ckpt, logs, load_format="modelexpress", env=slow,
                       extra_config=_extra(case, mx_serve=False, mx_pull_timeout_s=120),
                       kv_cache_memory_bytes=2 << 30).start() as b:
            b.wait_for_log(r"pulling .* from 1 READY source", timeout=READY_S)
            # A logs when B has mapped its memory; B is then copying, capped to 20 MB/s
            a.wait_for_log(r"local source \S+: peer pid \d+ .*mapped \d+ segments", timeout=60)
            time.sleep(1.0)
            a.kill()
            b.wait_answered(READY_S)
            log = b.log_text()
            _SUMMARY[f"B-{case}"] = {**b.figures(), "recreated": "re-creating" in log}
            assert re.search(r"pull of .* failed, falling back", log), b.log_tail()
            assert "loaded from disk" in log and "loaded from peer" not in log, b.log_tail()
            assert b.result["tokens"] == reference


def test_compiled_engines_pull_and_answer_the_same_with_their_time_to_ready(
        ckpt, logs, server, tmp_path) -> None:
    """vLLM's default compilation and CUDA graphs. Every engine has its own empty
    VLLM_CACHE_ROOT (each compiles cold), so B (pull) and D (plain disk load) differ
    in how their weights arrive, not in what their compile cache held. Tokens are
    compared among compiled engines (compiled kernels may round differently from
    eager ones, and a random model's greedy choice can follow a rounding)."""
    case = "arena-compiled"
    env = _mx_env(server, True)
    with LlmEngine(f"A-{case}", ckpt, logs, load_format="modelexpress",
                   env={**env, "VLLM_CACHE_ROOT": str(tmp_path / "cache-a")},
                   extra_config=_extra(case), enforce_eager=False, serve=True).start() as a:
        a.wait_answered(READY_S)
        _assert_served(a, True)
        _SUMMARY[f"A-{case}"] = a.figures()
        with LlmEngine("D-plain-compiled", ckpt, logs, load_format="auto",
                       env=engine_env(VLLM_CACHE_ROOT=str(tmp_path / "cache-d")),
                       enforce_eager=False).start() as d:
            d.wait_answered(READY_S)
            _SUMMARY["D-plain-compiled"] = d.figures()
            assert d.result["tokens"] == a.result["tokens"]
        with _weights_away(ckpt):
            with LlmEngine(f"B-{case}", ckpt, logs, load_format="modelexpress",
                           env={**env, "VLLM_CACHE_ROOT": str(tmp_path / "cache-b")},
                           extra_config=_extra(case, mx_serve_after_pull=False),
                           enforce_eager=False).start() as b:
                b.wait_answered(READY_S)
                _SUMMARY[f"B-{case}"] = b.figures()
                _assert_pulled_locally(b)
                assert b.result["tokens"] == a.result["tokens"]
