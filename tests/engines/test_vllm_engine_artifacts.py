"""Compiled artifacts in real vLLM engines, with vLLM's default compilation (no --enforce-eager).

A loads from disk, compiles (inductor), and serves its weights and its compile cache
(signed with ``MX_ARTIFACT_KEY``). Engines started after it, each with an empty
``VLLM_CACHE_ROOT`` of its own:

* B, weights moved away: pulls both; vLLM's compilation takes every kernel from the
  pulled cache (``hit``); B answers exactly as A. Its plugin fetched vLLM's model-info
  cache before vLLM configured the engine.
* C, the checkpoint at another path: vLLM's own cache key differs (it covers the path),
  the artifacts are the same and C gets them (``hit``); its weights come from disk (the
  weights identity names the path).
* D, another key: refuses the set (``refused``, nothing installed), compiles as usual and
  answers right.
* TP=2: each rank pulls and uses its own rank's artifacts.

What is asserted is the outcome the engine observed (vLLM's log records and inductor's
cache counters through our observer), never a time; the times to ready are printed.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from checkpoint_moves import weights_away as _weights_away
from vllm_engines import Engine, make_tiny_llama

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

PROMPTS = ("hello world", "the capital of france is", "1 2 3 4 5")
MAX_TOKENS = 10
KEY = "test-artifact-key-0123456789abcdef"
OTHER_KEY = "another-artifact-key-fedcba9876543210"
READY_S = 420.0


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("artifact-engine-logs")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture(scope="module")
def server(logs: pathlib.Path) -> Iterator[ServerProc]:
    srv = ServerProc(f"sqlite:///{logs}/mx.db", logs, env={"MX_STALE_AFTER_S": "600"}).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def source(ckpt: pathlib.Path, logs: pathlib.Path, server: ServerProc,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """A: loads from disk, compiles, serves its weights and its artifacts (signed with
    ``KEY``). One A for the tests below that need a compiled single-rank source: a
    compiled engine's start is most of their time (CI's budget, see README)."""
    cache = tmp_path_factory.mktemp("source") / "cache-a"
    with _engine(ckpt, "A-compiled", logs, server, cache, case="ttr").start() as a:
        ready = a.wait_ready(READY_S)
        _wait_for(a, _SERVING)
        yield SimpleNamespace(engine=a, cache=cache, ready=ready, expected=_answers(a))


def _engine(ckpt: pathlib.Path, name: str, logs: pathlib.Path, server: ServerProc,
            cache: pathlib.Path, *, key: str = KEY, case: str, tp: int = 1) -> Engine:
    env = {"MX_SERVER_URL": server.url, "MX_SERVER_TOKEN": TOKEN,
           "MX_HEARTBEAT_INTERVAL_S": "1", "MX_CLIENT_RETRIES": "1",
           "MX_ARTIFACT_KEY": key, "MX_ARTIFACT_SETTLE_S": "1",
           "VLLM_CACHE_ROOT": str(cache)}
    extra = ["--model-loader-extra-config", json.dumps({"mx_identity_extra": {"test": case}})]
    return Engine(ckpt, name=name, log_dir=logs, load_format="mx", env=env, extra_args=extra,
                  tensor_parallel_size=tp, enforce_eager=False)


def _answers(engine: Engine) -> list[str]:
    return [engine.complete(p, max_tokens=MAX_TOKENS) for p in PROMPTS]


def _wait_for(engine: Engine, pattern: str, count: int = 1, timeout: float = 120.0) -> None:
    """Bounded wait for ``count`` log lines matching ``pattern`` (the source's artifacts
    are published after its warm-up, shortly after /health answers)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(re.findall(pattern, engine.log_text())) >= count:
            return
        time.sleep(0.25)
    raise AssertionError(f"{engine.name}: no {count}x {pattern!r} in {timeout:.0f} s\n"
                         f"{engine.log_tail()}")


def _artifact_metric(server: ServerProc, outcome: str) -> float:
    """``mx_artifacts_total{kind="vllm_compile",outcome=...}`` of the control plane."""
    text = httpx.get(f"{server.url}/metrics", timeout=30.0,
                     headers={"Authorization": f"Bearer {TOKEN}"}).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("mx_artifacts_total{") and f'outcome="{outcome}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


_SERVING = r"serving compiled artifacts of rank \d+"
_HIT = r"compiled artifacts hit for"


def test_pulled_engine_gets_compiled_artifacts_with_the_weights(ckpt, logs, server, source,
                                                                tmp_path) -> None:
    a, expected = source.engine, source.expected
    assert "compiled artifacts miss" in a.log_text() or "no READY source serves artifact" \
        in a.log_text(), a.log_tail()

    # B: weights and artifacts from A; empty cache root
    hits_before = _artifact_metric(server, "hit")
    with _weights_away(ckpt), _engine(ckpt, "B-pulled", logs, server, tmp_path / "cache-b",
                                       case="ttr").start() as b:
        b_ready = b.wait_ready(READY_S)
        _wait_for(b, _HIT)
        log = b.log_text()
        assert "loaded from peer" in log, b.log_tail()
        assert re.search(r"installed \d+ compiled-artifact files", log), b.log_tail()
        # the model-info cache came before vLLM configured the engine (the plugin)
        assert "installed vLLM's model-info cache" in log, b.log_tail()
        assert _answers(b) == expected
        assert _artifact_metric(server, "hit") == hits_before + 1
    # the install went under B's own cache root, in vLLM's layout
    assert list((tmp_path / "cache-b").glob("torch_compile_cache/torch_aot_compile/*/rank_0_0"))
    assert not list((tmp_path / "cache-b").rglob(".mx-artifacts-staging-*"))

    # C: the same checkpoint at another path: vLLM's cache key differs, ours does not
    other = tmp_path / "elsewhere" / "tiny-llama"
    shutil.copytree(ckpt, other)
    with _engine(other, "C-other-path", logs, server, tmp_path / "cache-c",
                 case="ttr").start() as c:
        c_ready = c.wait_ready(READY_S)
        _wait_for(c, _HIT)
        assert "loaded from disk" in c.log_text(), c.log_tail()  # weights: path-named
        assert _answers(c) == expected
    a_dirs = {p.name for p in source.cache.glob("torch_compile_cache/torch_aot_compile/*")}
    c_dirs = {p.name for p in (tmp_path / "cache-c").glob("torch_compile_cache/torch_aot_compile/*")}
    assert a_dirs and c_dirs and not a_dirs & c_dirs, (a_dirs, c_dirs)
    print(f"\ntime to ready: A (cold, from disk) {source.ready:.1f} s, B (weights + artifacts "
          f"pulled) {b_ready:.1f} s, C (other path, artifacts pulled) {c_ready:.1f} s")


def test_a_set_signed_with_another_key_is_refused_and_the_engine_compiles(ckpt, logs, server,
                                                                         source,
                                                                         tmp_path) -> None:
    """D: configured with another key than A's, it finds A's set, refuses it (nothing
    installed), compiles as usual and answers right."""
    refused_before = _artifact_metric(server, "refused")
    with _engine(ckpt, "D-other-key", logs, server, tmp_path / "cache-d", key=OTHER_KEY,
                 case="ttr").start() as d:
        d.wait_ready(READY_S)
        log = d.log_text()
        assert re.search(r"compiled artifacts refused: .*signed with another key", log), \
            d.log_tail()
        assert not re.search(r"installed \d+ compiled-artifact files", log), d.log_tail()
        assert _answers(d) == source.expected
        assert _artifact_metric(server, "refused") >= refused_before + 1.0
    assert not list((tmp_path / "cache-d").rglob(".mx-artifacts-staging-*"))


def test_tensor_parallel_2_each_rank_uses_its_own_artifacts(ckpt, logs, server, tmp_path) -> None:
    with _engine(ckpt, "A-tp2", logs, server, tmp_path / "cache-a", case="tp2", tp=2).start() as a:
        a.wait_ready(READY_S)
        _wait_for(a, _SERVING, count=2)
        expected = _answers(a)
        with _weights_away(ckpt), _engine(ckpt, "B-tp2", logs, server, tmp_path / "cache-b",
                                           case="tp2", tp=2).start() as b:
            b.wait_ready(READY_S)
            _wait_for(b, _HIT, count=2)
            ranks = sorted(re.findall(r"compiled-artifact files \([\d.]+ MB\) for rank (\d)",
                                      b.log_text()))
            assert ranks == ["0", "1"], b.log_tail()
            assert _answers(b) == expected
    for rank in (0, 1):
        assert list((tmp_path / "cache-b").glob(
            f"torch_compile_cache/torch_aot_compile/*/rank_{rank}_0"))
