"""Compiled artifacts from every replica, with real vLLM CPU engines (compilation on).

One identity, four engines, each with an empty ``VLLM_CACHE_ROOT`` of its own:

* A loads from disk, compiles, serves its weights and its artifact set;
* D compiles for itself too (``mx_pull: false``) and serves its own set beside A's:
  the control plane no longer refuses the second replica (409);
* B, weights moved away, pulls weights and artifacts from a source, uses them
  (``hit``) and serves the set it installed byte for byte: the same content as the
  set it pulled (a repack would differ by the index entries vLLM wrote);
* A exits cleanly (no ERROR line: the two sources it served through one NIXL agent
  withdraw one after the other), D too; C then gets both from B, the only replica
  left, and answers as A did.

What is asserted is what the engines logged and what the control plane lists, never
a time.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import time

import pytest

from checkpoint_moves import weights_away as _weights_away
from vllm_engines import Engine, make_tiny_llama

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

PROMPTS = ("hello world", "the capital of france is")
MAX_TOKENS = 8
KEY = "replica-artifact-key-0123456789abcdef"
READY_S = 420.0
_SERVING = r"serving compiled artifacts of rank 0 \(\d+ files, [\d.]+ MB, ([^)]+)\) as source (\S+)"


def _engine(ckpt: pathlib.Path, name: str, logs: pathlib.Path, server: ServerProc,
            cache: pathlib.Path, **config: object) -> Engine:
    env = {"MX_SERVER_URL": server.url, "MX_SERVER_TOKEN": TOKEN,
           "MX_HEARTBEAT_INTERVAL_S": "1", "MX_CLIENT_RETRIES": "1",
           "MX_ARTIFACT_KEY": KEY, "MX_ARTIFACT_SETTLE_S": "1",
           "VLLM_CACHE_ROOT": str(cache)}
    extra = ["--model-loader-extra-config",
             json.dumps({"mx_identity_extra": {"test": "replicas"}, **config})]
    return Engine(ckpt, name=name, log_dir=logs, load_format="mx", env=env, extra_args=extra,
                  enforce_eager=False)


def _serving(engine: Engine, timeout: float = 180.0) -> tuple[str, str]:
    """(how the engine serves its set, its artifact source id), once it logged it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(_SERVING, engine.log_text())
        if found:
            return found.group(1), found.group(2)
        assert "not serving compiled artifacts" not in engine.log_text(), engine.log_tail()
        time.sleep(0.25)
    raise AssertionError(f"{engine.name} never served its artifacts\n{engine.log_tail()}")


def _answers(engine: Engine) -> list[str]:
    return [engine.complete(p, max_tokens=MAX_TOKENS) for p in PROMPTS]


def _artifact_sources(client, source_id: str) -> list:  # noqa: ANN001
    """READY sources of the artifact identity that ``source_id`` serves."""
    identity = client.get_source(source_id).model_identity
    return client.list_sources(identity=identity, state="READY")


def _errors(engine: Engine) -> list[str]:
    return [line for line in engine.log_text().splitlines()
            if re.match(r"ERROR\b", line) and "modelexpress" in line]


def test_every_replica_serves_artifacts_and_the_last_one_serves_the_next(tmp_path) -> None:
    from modelexpress.client import MxClient

    logs = tmp_path / "logs"
    logs.mkdir()
    ckpt = make_tiny_llama(tmp_path / "ckpt" / "tiny-llama")
    server = ServerProc(f"sqlite:///{logs}/mx.db", logs, env={"MX_STALE_AFTER_S": "600"}).start()
    client = MxClient(server.url, token=TOKEN, timeout_s=30.0)
    a = _engine(ckpt, "A-source", logs, server, tmp_path / "cache-a").start()
    d = None
    try:
        a.wait_ready(READY_S)
        how_a, a_art = _serving(a)
        assert how_a == "packed from its caches", a.log_tail()
        expected = _answers(a)

        # D compiles for itself and serves its own set beside A's: no 409
        d = _engine(ckpt, "D-own-compile", logs, server, tmp_path / "cache-d",
                    mx_pull=False).start()
        d.wait_ready(READY_S)
        how_d, d_art = _serving(d)
        assert how_d == "packed from its caches"
        ready = {s.id for s in _artifact_sources(client, a_art)}
        assert {a_art, d_art} <= ready, ready
        assert _answers(d) == expected

        # B pulls weights and a set, uses it, and serves that set byte for byte
        with _weights_away(ckpt), _engine(ckpt, "B-pulled", logs, server,
                                           tmp_path / "cache-b").start() as b:
            b.wait_ready(READY_S)
            how_b, b_art = _serving(b)
            log = b.log_text()
            assert "loaded from peer" in log and "compiled artifacts hit" in log, b.log_tail()
            assert how_b == "the pulled set as installed", b.log_tail()
            pulled_from = re.search(r"compiled-artifact files \([\d.]+ MB\) for rank 0 from "
                                    r"source (\S+)", log).group(1)
            fingerprints = {s.id: s.fingerprint for s in _artifact_sources(client, b_art)}
            assert fingerprints[b_art] == fingerprints[pulled_from], fingerprints
            assert _answers(b) == expected

            # A and D exit cleanly; C gets weights and artifacts from B alone
            a.stop()
            assert _errors(a) == [], "\n".join(_errors(a))
            d.stop()
            assert _errors(d) == [], "\n".join(_errors(d))
            # withdrawn at exit, or by its guardian once the engine process is gone
            deadline = time.monotonic() + 60
            while [s.id for s in _artifact_sources(client, b_art)] != [b_art]:
                assert time.monotonic() < deadline, _artifact_sources(client, b_art)
                time.sleep(0.5)
            with _engine(ckpt, "C-from-B", logs, server, tmp_path / "cache-c").start() as c:
                c.wait_ready(READY_S)
                _serving(c)
                log = c.log_text()
                assert "loaded from peer" in log and "compiled artifacts hit" in log, \
                    c.log_tail()
                assert re.search(rf"for rank 0 from source {re.escape(b_art)}", log), \
                    c.log_tail()
                assert _answers(c) == expected
    finally:
        for engine in (a, d):
            if engine is not None:
                engine.stop()
        client.close()
        server.stop()
