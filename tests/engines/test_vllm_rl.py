"""RL weight sync through real vLLM engines: the ``mx`` weight-transfer backend.

Engines are vLLM CPU OpenAI servers started with ``--weight-transfer-config
'{"backend": "mx"}'`` and ``VLLM_SERVER_DEV_MODE=1`` (which exposes vLLM's RL routes:
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/weight_info``). Trainers are separate processes
(``tests/rl/rl_trainer_proc.py``) that go through vLLM's trainer factory and HTTP
client, as an RL framework would. Version 1 is a tiny Llama (seed 0), version 2 another
(seed 1); "answers" are greedy completions of fixed prompts.

One module fixture starts the three engines at once (E1 and E2 serve version 1; R2
serves version 2 loaded from disk, the reference), and the scenarios run in order on
them: a crashed trainer's update leaves E1 on version 1, then one trainer switches E1
and E2 to version 2 concurrently and both answer as R2.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from vllm_engines import Engine, make_tiny_llama

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

PROMPTS = ("hello world", "the capital of france is", "1 2 3 4 5", "once upon a time")
MAX_TOKENS = 12
RUN = "tiny-rl-run"
TRAINER = pathlib.Path(__file__).resolve().parents[1] / "rl" / "rl_trainer_proc.py"


def _mx_env(server: ServerProc) -> dict[str, str]:
    return {"MX_SERVER_URL": server.url, "MX_SERVER_TOKEN": TOKEN,
            "MX_HEARTBEAT_INTERVAL_S": "1", "MX_CLIENT_RETRIES": "1",
            "MX_TRANSFER_TIMEOUT_S": "60"}


def _answers(engine: Engine) -> list[str]:
    return [engine.complete(prompt, max_tokens=MAX_TOKENS) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("rl-logs")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return (make_tiny_llama(root / "v1", seed=0), make_tiny_llama(root / "v2", seed=1))


@pytest.fixture(scope="module")
def server(logs: pathlib.Path) -> Iterator[ServerProc]:
    srv = ServerProc(f"sqlite:///{logs}/mx.db", logs, env={"MX_STALE_AFTER_S": "600"}).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engines(ckpts, logs, server) -> Iterator[dict[str, Engine]]:  # noqa: ANN001
    v1, v2 = ckpts
    rl = {**_mx_env(server), "VLLM_SERVER_DEV_MODE": "1"}
    args = ["--weight-transfer-config", json.dumps({"backend": "mx"})]
    started = {
        "E1": Engine(v1, name="E1", log_dir=logs, env=rl, extra_args=args),
        "E2": Engine(v1, name="E2", log_dir=logs, env=rl, extra_args=args),
        "R2": Engine(v2, name="R2", log_dir=logs),
    }
    try:
        for engine in started.values():
            engine.start()
        for engine in started.values():
            engine.wait_ready(timeout=400)
        yield started
    finally:
        for engine in started.values():
            engine.stop()


def _trainer(server: ServerProc, logs: pathlib.Path, weights: pathlib.Path,
             engines: list[Engine], version: str, *more: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
    env.update(_mx_env(server))
    cmd = [sys.executable, str(TRAINER), "--weights", str(weights), "--model", RUN,
           "--version", version, *more]
    for engine in engines:
        cmd += ["--engine", engine.url]
    log = open(logs / f"trainer-{version}-{time.monotonic_ns()}.log", "w")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                            start_new_session=True)


def _line(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The first stdout line starting with ``prefix`` (bounded by ``timeout``); each
    test reads one such line of its trainer, so what follows it is not kept.

    Reads the pipe's descriptor itself: a ``readline()`` on the text wrapper may pull
    the next line into the wrapper's buffer too, where ``select`` never sees it (the
    trainer then printed PUBLISHED, but the test waited for the pipe until it timed out).
    """
    import selectors

    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen: list[str] = []
    pending = b""
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while True:
            while b"\n" in pending:
                raw, pending = pending.split(b"\n", 1)
                line = raw.decode(errors="replace")
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
                seen.append(line)
            if time.monotonic() >= deadline:
                break
            if sel.select(timeout=1.0):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break  # end of the pipe: the trainer exited
                pending += chunk
    finally:
        sel.close()
    proc.kill()
    raise AssertionError(f"trainer printed no {prefix!r} line within {timeout:.0f} s "
                         f"(exit {proc.poll()}; other lines: {seen[-5:]})")



def _weight_version(engine: Engine) -> str | None:
    return httpx.get(f"{engine.url}/weight_info", timeout=10).json()["weight_version"]


def test_a_trainer_crash_before_the_pull_leaves_version_1_serving(engines, ckpts, server,
                                                                   logs) -> None:  # noqa: ANN001
    e1 = engines["E1"]
    v1_answers = _answers(e1)
    trainer = _trainer(server, logs, ckpts[1] / "model.safetensors", [e1], "2",
                       "--crash-after-publish")
    # 300 s, like RESULT below: the trainer imports vLLM, and under ./dev test another
    # engine test shares the machine's two cores (120 s ran out once there)
    update = json.loads(_line(trainer, "PUBLISHED ", timeout=300))
    os.killpg(trainer.pid, signal.SIGKILL)  # the trainer dies; its version 2 goes with it
    trainer.wait(timeout=30)
    # What the trainer would have sent next, through vLLM's own routes.
    with httpx.Client(base_url=e1.url, timeout=120) as http:
        assert http.post("/start_weight_update").status_code == 200
        failed = http.post("/update_weights", json={"update_info": update})
    assert failed.status_code >= 400, failed.text
    # The caller is told why (vLLM's error body carries the worker's message).
    assert "version 2 of tiny-rl-run not loaded" in failed.text, failed.text
    assert "version 2 of tiny-rl-run not loaded" in e1.log_text(), e1.log_tail()
    assert _answers(e1) == v1_answers  # still version 1, not half of version 2
    assert _weight_version(e1) != "2"


def test_two_engines_switch_concurrently_and_answer_as_version_2_from_disk(
        engines, ckpts, server, logs) -> None:  # noqa: ANN001
    e1, e2, r2 = engines["E1"], engines["E2"], engines["R2"]
    reference = _answers(r2)
    before = _answers(e1)
    assert before == _answers(e2)
    assert before != reference, "versions 1 and 2 must answer differently for this test"
    trainer = _trainer(server, logs, ckpts[1] / "model.safetensors", [e1, e2], "2")
    result = json.loads(_line(trainer, "RESULT ", timeout=300))
    assert trainer.wait(timeout=60) == 0, result
    assert result["ok"] and len(result["engine_seconds"]) == 2, result
    assert _answers(e1) == reference
    assert _answers(e2) == reference
    assert _weight_version(e1) == _weight_version(e2) == "2"
    for engine in (e1, e2):
        assert "version 2: " in engine.log_text() and "pulled and verified" in engine.log_text()


def test_a_bad_mx_value_stops_the_trainer_backend_with_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``mx`` trainer backend reads the environment through ``MxSettings.load()``:
    a bad value is one line naming it (vLLM's 0.32+ weight-transfer API; no engine)."""
    from modelexpress.errors import ConfigError
    from modelexpress.rl.trainer import (FanOutClient, MxTrainerInitInfo,
                                         MxTrainerWeightTransferEngine)

    monkeypatch.setenv("MX_LOG_LEVEL", "LOUD")
    with pytest.raises(ConfigError) as err:
        MxTrainerWeightTransferEngine.trainer_init(
            MxTrainerInitInfo(rank=0), client=FanOutClient([object()]), source=object())
    message = str(err.value)
    assert message.startswith("MX_LOG_LEVEL: 'LOUD' is not allowed; use one of DEBUG, INFO, "
                              "WARNING, ERROR") and "\n" not in message, message
