"""The shm tensor arena inside a real vLLM engine (vLLM's CPU build), end to end.

A request's ``prompt_embeds`` travel from the API server to the engine core, and
from there to each worker inside the scheduler output that vLLM's executor
broadcasts through its ``MessageQueue`` (``NewRequestData.prompt_embeds``). With
``MX_SHM_TENSOR_ARENA=1`` that tensor (>= ``MX_SHM_MIN_TENSOR_BYTES``, 1 MiB) is
copied into the arena once and read by the workers in place. The proof is read
from the engine itself: with ``PROMETHEUS_MULTIPROC_DIR`` set, vLLM's
``/metrics`` aggregates every engine process's ``prometheus_client`` metrics,
so the engine core's ``mx_shm_arena_*`` counters show on the API server (the
path ``docs/DEPLOYMENT.md`` documents). The generated text must equal that of
an engine without the arena, and no arena segment may outlive the engine
(vLLM force-kills its engine core and workers at shutdown).

TP=1 needs ``MX_SHM_ARENA_MIN_READERS=1`` (its queue has one reader); TP=2 runs
the production default (2), where the one-reader response queues keep vLLM's path.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import pathlib
import time

import httpx
import psutil
import pytest
from vllm_engines import Engine, make_tiny_llama

log = logging.getLogger(__name__)

MIB = 1 << 20
HIDDEN = 512
# 640 tokens x 512 x float32 = 1.25 MiB: above the 1 MiB divert threshold.
EMBED_TOKENS = 640
ENGINE_ARGS = ("--enable-prompt-embeds", "--max-model-len", "1024")


def shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("mx_shm_arena")}


def arena_metrics(engine: Engine) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``mx_shm_arena_*`` samples of the engine's ``/metrics``: name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{engine.url}/metrics", timeout=30.0).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("mx_shm_arena"):
                out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def total(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(value for _, value in metrics.get(name, []))


def encode_embeds(seed: int) -> tuple[str, int]:
    """A random (EMBED_TOKENS, HIDDEN) float32 tensor as the API takes it: base64 of torch.save."""
    import torch
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(EMBED_TOKENS, HIDDEN, generator=g) * 0.02
    buf = io.BytesIO()
    torch.save(embeds, buf)
    return base64.b64encode(buf.getvalue()).decode(), embeds.nbytes


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    # hidden 512 so that a prompt within a 1024-token context exceeds 1 MiB
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "llama", hidden_size=HIDDEN,
                           num_heads=8, num_kv_heads=4, intermediate_size=1024,
                           max_position_embeddings=1024)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_prompt_embeds_cross_the_engine_queue_through_the_arena_with_identical_output(
        model: pathlib.Path, tmp_path: pathlib.Path, tp: int) -> None:
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    arena_env = {"MX_SHM_TENSOR_ARENA": "1", "MX_SHM_ARENA_BYTES": str(64 * MIB),
                 "PROMETHEUS_MULTIPROC_DIR": str(prom_dir)}
    if tp == 1:
        arena_env["MX_SHM_ARENA_MIN_READERS"] = "1"
    arena = Engine(model, name=f"arena-tp{tp}", log_dir=tmp_path, env=arena_env,
                   extra_args=ENGINE_ARGS, tensor_parallel_size=tp)
    plain = Engine(model, name=f"plain-tp{tp}", log_dir=tmp_path, extra_args=ENGINE_ARGS,
                   tensor_parallel_size=tp)
    ours: set[str] = set()
    try:
        arena.start()
        plain.start()
        log.info("ready in %.1f s (arena) and %.1f s (plain)", arena.wait_ready(),
                 plain.wait_ready())
        pids = arena.pids()
        ours = {n for n in shm_entries() if int(n.split("_")[3]) in pids}
        # TP=1: the broadcast queue and the worker's response queue (min readers 1);
        # TP=2: the broadcast queue only.
        assert len(ours) == (2 if tp == 1 else 1), (ours, arena.log_tail())
        assert not {n for n in shm_entries() if int(n.split("_")[3]) in plain.pids()}
        # The broadcast queue's arena has one reader per worker.
        arena.wait_for_log(rf"shm tensor arena mx_shm_arena_\w+: 64 MiB for {tp} readers",
                           timeout=10)

        before = arena_metrics(arena)
        assert total(before, "mx_shm_arena_diverted_tensors_total") == 0, before

        outputs = []
        for seed in (0, 1):
            embeds, nbytes = encode_embeds(seed)
            assert nbytes >= MIB
            got = arena.complete(None, max_tokens=8, prompt_embeds=embeds, ignore_eos=True)
            want = plain.complete(None, max_tokens=8, prompt_embeds=embeds, ignore_eos=True)
            assert got.strip(), f"empty completion {got!r}"
            assert got == want, f"arena {got!r} != plain {want!r} (seed {seed})"
            outputs.append(got)
            after = arena_metrics(arena)
            diverted = total(after, "mx_shm_arena_diverted_tensors_total")
            assert diverted == seed + 1, after
            assert total(after, "mx_shm_arena_diverted_bytes_total") == nbytes * (seed + 1)
        assert outputs[0] != outputs[1], "different embeddings gave the same text"

        # The counting process is vLLM's engine core: the in-use gauge is per pid.
        holders = [int(labels["pid"]) for labels, value in
                   after["mx_shm_arena_bytes_in_use"] if value > 0]
        assert len(holders) == 1, after
        assert psutil.Process(holders[0]).name() == "VLLM::EngineCore", holders

        # A text prompt has no tensor to divert; the output is unchanged too.
        text = arena.complete("the quick brown fox", max_tokens=8, ignore_eos=True)
        assert text == plain.complete("the quick brown fox", max_tokens=8, ignore_eos=True)
        assert total(arena_metrics(arena), "mx_shm_arena_diverted_tensors_total") == 2
    finally:
        arena.stop()
        plain.stop()
    # vLLM force-kills the engine core and workers; their segments must still go.
    deadline = time.monotonic() + 30.0
    while ours & shm_entries() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ours & shm_entries(), f"arena segments outlived the engine: {ours}"
