"""Engines of one tensor-parallel size pull from engines of another (real vLLM engines).

Every engine is vLLM's OpenAI server (CPU build). Two tiny checkpoints: a Llama with
grouped-query attention (4 heads, 1 KV head: replicated on both ranks at TP=2) and tied
embeddings, and a Qwen2 (biases on q, k, v; 1 KV head). Targets start with the
checkpoint's weights moved away and must answer greedy completions exactly as an engine
of their own layout that loaded from disk.

Llama (one module-scoped family, four engines):

* ``S2``: TP=2, from disk, eager; publishes each rank with its layout. It is also the
  TP=2 reference.
* ``R1``: TP=1, plain ``--load-format auto``, vLLM's default compilation: the TP=1
  reference.
* ``T1``: TP=1 with vLLM's default compilation, pulls its whole model from S2's two
  ranks (2 -> 1) and serves it with its own layout.
* ``T2``: TP=2, eager, started after S2 stopped: each rank pulls its half from T1, a
  target that was itself resharded (1 -> 2).

Qwen2 (eager, three engines): ``S2`` from disk, ``T1`` pulls across, ``R1`` the
reference.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
from collections.abc import Iterator

import pytest

from checkpoint_moves import weights_away
from vllm_engines import Engine, make_tiny_llama

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

PROMPTS = ("hello world", "the capital of france is", "1 2 3 4 5", "once upon a time")
MAX_TOKENS = 12
READY_S = 300.0


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("layout-engine-logs")


@pytest.fixture(scope="module")
def server(logs: pathlib.Path) -> Iterator[ServerProc]:
    srv = ServerProc(f"sqlite:///{logs}/mx.db", logs, env={"MX_STALE_AFTER_S": "600"}).start()
    yield srv
    srv.stop()


def _env(server: ServerProc, **more: str) -> dict[str, str]:
    return {"MX_SERVER_URL": server.url, "MX_SERVER_TOKEN": TOKEN,
            "MX_HEARTBEAT_INTERVAL_S": "1", "MX_CLIENT_RETRIES": "1", **more}


def _extra(family: str, **options: object) -> list[str]:
    return ["--model-loader-extra-config",
            json.dumps({"mx_identity_extra": {"test": family}, **options})]


def _answers(engine: Engine) -> list[str]:
    return [engine.complete(prompt, max_tokens=MAX_TOKENS) for prompt in PROMPTS]


def _assert_across(engine: Engine, ranks: int) -> list[str]:
    """Every rank pulled across layouts (never from disk); returns the sources read."""
    log = engine.log_text()
    pulled = re.findall(r"pulled \S+ rank (\d+) across layouts from (\S+):", log)
    assert sorted(int(r) for r, _ in pulled) == list(range(ranks)), engine.log_tail()
    assert "from disk with the" not in log, engine.log_tail()
    assert len(re.findall(r"rank \d+ loaded from peer", log)) == ranks, engine.log_tail()
    return [s for _, sources in pulled for s in sources.split(",")]


def _serving_with_layout(engine: Engine, ranks: int) -> list[str]:
    """The engine's sources (one per rank), each published with a layout."""
    from modelexpress.client import MxClient

    ids = re.findall(r"(?<!local )source (\S+) serving ", engine.log_text())
    assert len(ids) == ranks, engine.log_tail()
    with MxClient(engine.env["MX_SERVER_URL"], token=TOKEN, timeout_s=30.0) as client:
        for source_id in ids:
            info = client.get_source(source_id)
            assert info.layout is not None and info.layout_bytes > 0, source_id
            assert info.layout["blocks"]["digests"], source_id
    return ids


def test_llama_gqa_tied_two_to_one_compiled_then_one_to_two_from_the_resharded_target(
        tmp_path_factory, logs, server) -> None:
    ckpt = make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "llama-gqa-tied",
                           num_heads=4, num_kv_heads=1, tie_word_embeddings=True)
    family = _extra("llama-layouts")
    compiled = {"VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm-cache"))}
    s2 = Engine(ckpt, name="S2-llama", log_dir=logs, load_format="mx", env=_env(server),
                extra_args=family, tensor_parallel_size=2)
    r1 = Engine(ckpt, name="R1-llama", log_dir=logs, load_format="auto", env=compiled,
                enforce_eager=False)
    with s2, r1:
        s2.start()
        r1.start()
        s2.wait_ready(READY_S)
        r1.wait_ready(READY_S)
        tp2_answers, tp1_answers = _answers(s2), _answers(r1)
        r1.stop()
        s2_sources = _serving_with_layout(s2, 2)
        with weights_away(ckpt):
            # 2 -> 1, vLLM's default compilation (the reference's compile cache: the
            # graph does not depend on where the weights came from)
            t1 = Engine(ckpt, name="T1-llama", log_dir=logs, load_format="mx",
                        env=_env(server, **compiled), extra_args=family, enforce_eager=False)
            with t1:
                t1.start().wait_ready(READY_S)
                assert sorted(_assert_across(t1, 1)) == sorted(s2_sources)
                assert "enforce_eager=False" in t1.log_text(), t1.log_tail()
                assert _answers(t1) == tp1_answers
                (t1_source,) = _serving_with_layout(t1, 1)
                s2.stop()  # from now on only the resharded target holds the model
                # 1 -> 2, eager, from T1 (which pulled across layouts itself)
                t2 = Engine(ckpt, name="T2-llama", log_dir=logs, load_format="mx",
                            env=_env(server), extra_args=family, tensor_parallel_size=2)
                with t2:
                    t2.start().wait_ready(READY_S)
                    assert set(_assert_across(t2, 2)) == {t1_source}
                    assert _answers(t2) == tp2_answers


def test_qwen2_with_qkv_biases_two_to_one(tmp_path_factory, logs, server) -> None:
    ckpt = make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "qwen2", arch="qwen2",
                           num_heads=4, num_kv_heads=1)
    family = _extra("qwen2-layouts")
    s2 = Engine(ckpt, name="S2-qwen2", log_dir=logs, load_format="mx", env=_env(server),
                extra_args=family, tensor_parallel_size=2)
    r1 = Engine(ckpt, name="R1-qwen2", log_dir=logs, load_format="auto")
    with s2, r1:
        s2.start()
        r1.start()
        s2.wait_ready(READY_S)
        r1.wait_ready(READY_S)
        expected = _answers(r1)
        r1.stop()
        s2_sources = _serving_with_layout(s2, 2)
        with weights_away(ckpt):
            t1 = Engine(ckpt, name="T1-qwen2", log_dir=logs, load_format="mx",
                        env=_env(server), extra_args=family)
            with t1:
                t1.start().wait_ready(READY_S)
                assert sorted(_assert_across(t1, 1)) == sorted(s2_sources)
                assert _answers(t1) == expected


def test_an_expert_model_is_refused_in_one_line_and_loads_and_serves_as_before(
        tmp_path_factory, logs, server) -> None:
    """A Mixtral (expert layers): one INFO line says why it is not eligible for pulls
    across layouts; it loads from disk, answers, and serves its own layout (no layout
    published, so no target of another layout ever plans on it)."""
    from modelexpress.client import MxClient

    ckpt = make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "mixtral", arch="mixtral",
                           num_heads=4, num_kv_heads=1, num_layers=1)
    engine = Engine(ckpt, name="moe", log_dir=logs, load_format="mx", env=_env(server),
                    extra_args=_extra("moe-layouts"))
    with engine:
        engine.start().wait_ready(READY_S)
        assert all(isinstance(a, str) for a in _answers(engine))
        log = engine.log_text()
        refusals = re.findall(r"is not eligible for pulls across parallel layouts: (.*)", log)
        assert len(refusals) == 1 and "expert layer" in refusals[0], engine.log_tail()
        assert "rank 0 loaded from disk" in log and "serving it" in log, engine.log_tail()
        (source_id,) = re.findall(r"(?<!local )source (\S+) serving ", log)
        with MxClient(server.url, token=TOKEN, timeout_s=30.0) as client:
            info = client.get_source(source_id)
        assert info.layout is None and info.layout_bytes == 0
