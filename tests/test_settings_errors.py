"""A bad MX_* value is one line naming the variable and what it accepts, wherever the
environment is read: the CLI, the agent, the server, the vLLM plugin and weight-transfer
engine, the RL trainer."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pydantic
import pytest

from modelexpress.errors import ConfigError
from modelexpress.settings import MxSettings, settings_error_line


@pytest.mark.parametrize(("env", "value", "line"), [
    ("MX_STORE", "mysql://x",
     "MX_STORE: unsupported store URL 'mysql://x'; use sqlite:///PATH or redis://HOST:PORT/DB"),
    ("MX_STORE", "redis://", "MX_STORE: unsupported store URL 'redis://'"),
    ("MX_ARTIFACT_KEY", "short", "MX_ARTIFACT_KEY: must be at least 16 bytes (got 5)"),
    ("MX_ARTIFACT_KEY", "file:/nonexistent/mx-key",
     "MX_ARTIFACT_KEY: file:/nonexistent/mx-key: cannot read the key file"),
    ("MX_LOG_LEVEL", "LOUD",
     "MX_LOG_LEVEL: 'LOUD' is not allowed; use one of DEBUG, INFO, WARNING, ERROR"),
    ("MX_SOURCE_POLICY", "fastest",
     "MX_SOURCE_POLICY: 'fastest' is not allowed; use one of random, spread"),
    ("MX_STALE_AFTER_S", "soon", "MX_STALE_AFTER_S: 'soon' is not a number"),
    ("MX_STALE_AFTER_S", "0", "MX_STALE_AFTER_S: '0' is out of range; it must be > 0"),
    ("MX_SERVER_PORT", "70000", "MX_SERVER_PORT: '70000' is out of range; it must be <= 65535"),
    ("MX_CLIENT_RETRIES", "1.5", "MX_CLIENT_RETRIES: '1.5' is not a whole number"),
    ("MX_VMM_ARENA", "maybe",
     "MX_VMM_ARENA: 'maybe' is not a boolean; use true/false, 1/0, yes/no, on/off"),
    ("MX_SERVER_URL", "127.0.0.1:8001",
     "MX_SERVER_URL: '127.0.0.1:8001' is not a server URL; use http://HOST:PORT"),
    ("MX_SERVER_URL", "http://a:1,,http://b:2", "MX_SERVER_URL: '' is not a server URL"),
])
def test_a_bad_value_is_one_line_naming_the_variable_and_the_accepted_values(
        monkeypatch: pytest.MonkeyPatch, env: str, value: str, line: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError) as err:
        MxSettings.load()
    message = str(err.value)
    assert message.startswith(line), message
    assert "\n" not in message
    # pydantic's error is kept for a debugger, not chained: a traceback shows one line
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert isinstance(err.value.__context__, pydantic.ValidationError)
    assert settings_error_line(err.value.__context__) == message


def test_several_bad_values_and_flag_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MX_LOG_LEVEL", "LOUD")
    with pytest.raises(ConfigError) as err:
        MxSettings.load(names={"store": "--store", "server_port": "--port"},
                        store="mysql://x", server_port=None)
    message = str(err.value)
    assert "MX_LOG_LEVEL: 'LOUD' is not allowed" in message
    assert "--store: unsupported store URL 'mysql://x'" in message
    assert "\n" not in message


def test_good_values_load_and_are_normalised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MX_LOG_LEVEL", "debug")
    monkeypatch.setenv("MX_SERVER_URL", " http://a:8001/ , https://b:8002")
    settings = MxSettings.load(store="redis://r:6379/0", server_port=None)
    assert settings.log_level == "DEBUG"
    assert settings.server_urls == ("http://a:8001", "https://b:8002")
    assert settings.store == "redis://r:6379/0"
    assert MxSettings.load().server_port == 8001  # None override: not given


def test_a_renamed_variable_still_works_with_a_warning_and_the_new_name_wins(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MX_ARENA_SINGLE_MR", "1")
    with caplog.at_level("WARNING", logger="modelexpress.settings"):
        assert MxSettings().vmm_arena_single_mr is True
    assert "MX_ARENA_SINGLE_MR is deprecated: set MX_VMM_ARENA_SINGLE_MR" in caplog.text
    monkeypatch.setenv("MX_VMM_ARENA_SINGLE_MR", "0")
    assert MxSettings().vmm_arena_single_mr is False
    monkeypatch.delenv("MX_VMM_ARENA_SINGLE_MR")
    monkeypatch.setenv("MX_ARENA_SINGLE_MR", "maybe")
    with pytest.raises(ConfigError, match=r"MX_ARENA_SINGLE_MR \(now MX_VMM_ARENA_SINGLE_MR\)"):
        MxSettings.load()


def test_the_vllm_plugin_stops_on_a_bad_value_with_one_line() -> None:
    """vLLM's plugin entry point reads the environment through ``MxSettings.load()``
    before it imports anything of vLLM, so a bad value is one line naming it. A fresh
    process: the plugin registers once per process."""
    import os
    import subprocess
    import sys

    script = ("from modelexpress.errors import ConfigError\n"
              "from modelexpress.engines.vllm.plugin import register\n"
              "try:\n    register()\nexcept ConfigError as exc:\n    print(exc)\n"
              "else:\n    print('registered')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, MX_LOG_LEVEL="LOUD"))
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip()
    assert line.startswith("MX_LOG_LEVEL: 'LOUD' is not allowed; use one of DEBUG, INFO, "
                           "WARNING, ERROR") and "\n" not in line, out.stdout


# Every entry point that reads the environment, run as a user runs it, in a fresh
# process, with nothing catching the error for it.
_TRAINER = """
import torch
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from modelexpress.engines.vllm.plugin import register_weight_transfer
from modelexpress.rl import FanOutClient, MxTrainerInitInfo, StateDictSource
register_weight_transfer()
WeightTransferTrainerFactory.trainer_init(
    MxTrainerInitInfo(model="run", rank=0), client=FanOutClient([object()]),
    source=StateDictSource({"w": torch.zeros(4)}))
"""
_WEIGHT_TRANSFER_ENGINE = """
import types
import torch
from modelexpress.engines.vllm.weight_transfer import MxInitInfo, MxWeightTransferEngine
config = types.SimpleNamespace(parallel_config=None, model_config=None)
engine = MxWeightTransferEngine(None, config, "cpu", torch.nn.Linear(2, 2))
engine.init_transfer_engine(MxInitInfo(model="run", server_url="http://127.0.0.1:1"))
"""
ENTRY_POINTS = {
    "cli": ["-m", "modelexpress", "sources", "list"],
    "agent": ["-m", "modelexpress", "agent"],
    "server": ["-m", "modelexpress.server"],
    "vllm plugin": ["-c", "from modelexpress.engines.vllm.plugin import register; register()"],
    "vllm weight-transfer engine": ["-c", _WEIGHT_TRANSFER_ENGINE],
    "rl trainer": ["-c", _TRAINER],
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_refuses_a_bad_value_in_one_line_naming_it(entry: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
    env["MX_TRANSFER_TIMEOUT_S"] = "abc"
    ran = subprocess.run([sys.executable, *ENTRY_POINTS[entry]], capture_output=True,
                         text=True, timeout=300, env=env,
                         cwd=pathlib.Path(__file__).resolve().parents[1])
    out = ran.stdout + ran.stderr
    assert ran.returncode != 0, out[-3000:]
    said = [line for line in out.splitlines() if "MX_TRANSFER_TIMEOUT_S" in line]
    assert len(said) == 1 and "MX_TRANSFER_TIMEOUT_S: 'abc' is not a number" in said[0], \
        out[-3000:]
    assert "validation error" not in out and "errors.pydantic.dev" not in out, out[-3000:]
