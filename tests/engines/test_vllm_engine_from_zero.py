"""Real vLLM engines that start together when no peer holds their model: storage read once.

Three ``python -m vllm.entrypoints.openai.api_server --load-format mx`` engines of vLLM's
CPU build start at once with ``MX_MODEL_STORAGE=s3://...``: the tiny Llama's checkpoint
is in moto's S3 server (``tests/storage/s3_server.py`` on 127.0.0.1, which counts the
bytes it sends), and the engines' model directories hold config and tokenizer only (a
fallback to vLLM's own loader would fail). One engine takes the origin lease and reads
the checkpoint from S3; the others read it from that engine and from each other; all
load it with vLLM's ``load_weights`` and answer greedy completions exactly as a plain
``--load-format auto`` engine does. An engine slow enough to start after the first one
was READY pulls that engine's loaded form instead (still no storage read).
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

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1] / "server"))
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1] / "storage"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402
from s3_server import S3Server, s3_env  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.s3, pytest.mark.slow]

PROMPTS = ("hello world", "the capital of france is", "1 2 3 4 5")
MAX_TOKENS = 12
BUCKET = "mx-engines"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("zero-engine-logs")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture(scope="module")
def server(logs: pathlib.Path) -> Iterator[ServerProc]:
    srv = ServerProc(f"sqlite:///{logs}/mx.db", logs, env={"MX_STALE_AFTER_S": "600"}).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def s3(logs: pathlib.Path, ckpt: pathlib.Path) -> Iterator[S3Server]:
    server = S3Server(logs).start()
    server.upload_dir(ckpt, BUCKET, "tiny-llama")
    server.reset()
    yield server
    server.stop()


def _answers(engine: Engine) -> list[str]:
    return [engine.complete(prompt, max_tokens=MAX_TOKENS) for prompt in PROMPTS]


def test_engines_started_together_read_the_checkpoint_from_s3_once_and_answer_as_plain_vllm(
        ckpt: pathlib.Path, logs: pathlib.Path, server: ServerProc, s3: S3Server) -> None:
    with Engine(ckpt, name="plain", log_dir=logs, load_format="auto").start() as plain:
        plain.wait_ready()
        reference = _answers(plain)
    env = {**s3_env(s3.endpoint), "MX_SERVER_URL": server.url, "MX_SERVER_TOKEN": TOKEN,
           "MX_HEARTBEAT_INTERVAL_S": "1", "MX_MODEL_STORAGE": f"s3://{BUCKET}/tiny-llama",
           "MX_STORAGE_CONCURRENCY": "2", "MX_RELAY_LINGER_S": "20"}
    extra = ["--model-loader-extra-config", json.dumps({"mx_identity_extra": {"test": "zero"}})]
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    header = _headers(ckpt)
    with weights_away(ckpt):
        engines = [Engine(ckpt, name=f"Z{i}", log_dir=logs, load_format="mx", env=env,
                          extra_args=extra) for i in range(3)]
        try:
            for engine in engines:
                engine.start()
            for engine in engines:
                engine.wait_ready(timeout=420.0)
            sources = []
            for engine in engines:
                found = re.findall(r"rank 0 loaded from (\w+)", engine.log_text())
                assert len(found) == 1, engine.log_tail()
                sources.append(found[0])
                assert _answers(engine) == reference, engine.log_tail()
            assert sources.count("storage") == 1, sources  # one origin
            assert set(sources) <= {"storage", "fleet", "peer"}, sources
            for engine, source in zip(engines, sources):
                if source != "peer":  # fetched from zero: says who it was and verified it
                    role = "origin" if source == "storage" else "follower"
                    assert f"the checkpoint was fetched as the {role}" in engine.log_text()
            # each engine that went for the checkpoint read its header from S3 first
            fetched = sum("fetching its checkpoint" in e.log_text() for e in engines)
        finally:
            for engine in engines:
                engine.stop()
    # what S3 sent: the checkpoint's data once, and each fetching engine its header
    stats = s3.stats()["by_key"]
    data = [v for k, v in stats.items() if k.startswith(f"{BUCKET}/tiny-llama/")
            and k.endswith(".safetensors")]
    assert sum(v[1] for v in data) == size + (fetched - 1) * header, (stats, sources)


def _headers(ckpt: pathlib.Path) -> int:
    """Bytes of the safetensors headers (8 + the JSON) of the checkpoint's files."""
    import struct

    total = 0
    for f in ckpt.glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += 8 + struct.unpack("<Q", fh.read(8))[0]
    return total
