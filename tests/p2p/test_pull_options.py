"""``PullOptions``: built once from the settings, the only way an entry point configures a pull.

The command line, the agent and the vLLM loader each build their options with
``PullOptions.from_settings``; a scan of their source keeps it that way, and
``from_settings`` is checked against the environment for every pull setting.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from modelexpress.errors import ConfigError
from modelexpress.p2p import PullOptions
from modelexpress.settings import MxSettings

ROOT = pathlib.Path(__file__).resolve().parents[2]

# environment variable -> (value, PullOptions field, expected value)
PULL_SETTINGS = {
    "MX_TRANSFER_TIMEOUT_S": ("12.5", "timeout_s", 12.5),
    "MX_VERIFY_DIGESTS": ("0", "verify", False),
    "MX_SOURCE_POLICY": ("spread", "policy", "spread"),
    "MX_MAX_SOURCE_ATTEMPTS": ("7", "max_attempts", 7),
    "MX_TRANSFER_CHUNK_BYTES": (str(8 << 20), "chunk_bytes", 8 << 20),
    "MX_TRANSFER_STALL_S": ("7.5", "stall_s", 7.5),
    "MX_REFUSE_SLOW_TRANSPORT": ("1", "refuse_slow_transport", True),
    "MX_TRANSFER_MAX_GBPS": ("3.5", "max_gbps", 3.5),
    "MX_NIXL_BACKEND": ("LIBFABRIC", "backend", "LIBFABRIC"),
    "MX_RELAY_CHUNK_BYTES": (str(1 << 20), "relay_chunk_bytes", 1 << 20),
    "MX_RELAY_LINGER_S": ("2.5", "relay_linger_s", 2.5),
    "MX_HEARTBEAT_INTERVAL_S": ("1.5", "heartbeat_interval_s", 1.5),
    "MX_MODEL_STORAGE": ("s3://bucket/m", "model_storage", "s3://bucket/m"),
    "MX_ORIGIN_LEASE_S": ("4.5", "origin_lease_s", 4.5),
}
# environment variable -> (value, StorageOptions field, expected value)
STORAGE_SETTINGS = {
    "MX_STORAGE_CONCURRENCY": ("3", "concurrency", 3),
    "MX_STORAGE_RANGE_BYTES": (str(1 << 20), "range_bytes", 1 << 20),
    "MX_STORAGE_TIMEOUT_S": ("2.5", "timeout_s", 2.5),
}


def test_every_pull_setting_reaches_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = PullOptions.from_settings(MxSettings())
    for env, (value, field, expected) in PULL_SETTINGS.items():
        monkeypatch.setenv(env, value)
        assert getattr(defaults, field) != expected, f"pick a non-default value for {env}"
    options = PullOptions.from_settings(MxSettings())
    for env, (_, field, expected) in PULL_SETTINGS.items():
        assert getattr(options, field) == expected, env


def test_every_storage_setting_reaches_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = PullOptions.from_settings(MxSettings()).storage
    for env, (value, field, expected) in STORAGE_SETTINGS.items():
        monkeypatch.setenv(env, value)
        assert getattr(defaults, field) != expected, f"pick a non-default value for {env}"
    options = PullOptions.from_settings(MxSettings()).storage
    for env, (_, field, expected) in STORAGE_SETTINGS.items():
        assert getattr(options, field) == expected, env


def test_flags_win_and_an_unset_flag_keeps_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MX_SOURCE_POLICY", "spread")
    settings = MxSettings()
    assert PullOptions.from_settings(settings, policy=None).policy == "spread"
    assert PullOptions.from_settings(settings, policy="random", stripe=2).stripe == 2
    with pytest.raises(TypeError, match="stripes"):
        PullOptions.from_settings(settings, stripes=2)


@pytest.mark.parametrize("changes, message", [
    ({"policy": "fastest"}, "allowed: random, spread"),
    ({"max_attempts": 0}, "max_attempts must be >= 1"),
    ({"stripe": 0}, "stripe must be >= 1"),
    ({"timeout_s": 0}, "timeout_s must be > 0"),
    ({"max_gbps": -1}, "max_gbps must be >= 0"),
    ({"chunk_bytes": 0}, "chunk_bytes must be > 0"),
    ({"stall_s": -1}, "stall_s must be >= 0"),
])
def test_bad_values_are_refused_with_the_allowed_ones(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PullOptions(**changes)
    with pytest.raises(ConfigError, match=message):
        PullOptions().replace(**changes)


def test_sequences_are_stored_as_tuples() -> None:
    options = PullOptions(prefer=["a", "b"], exclude_workers=["w"])
    assert options.prefer == ("a", "b") and options.exclude_workers == ("w",)
    hash(options)


def _calls_from_settings(path: pathlib.Path, *qualname: str) -> bool:
    node: ast.AST = ast.parse(path.read_text())
    for name in qualname:
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr == "from_settings" and isinstance(n.func.value, ast.Name)
               and n.func.value.id == "PullOptions" for n in ast.walk(node))


@pytest.mark.parametrize("path, qualname", [
    ("modelexpress/p2p/cli.py", ("pull",)),
    ("modelexpress/p2p/agent.py", ("AgentOptions", "from_settings")),
    ("engines/vllm/options.py", ("LoaderOptions",)),
])
def test_every_entry_point_builds_its_options_from_the_settings(path: str,
                                                                qualname: tuple) -> None:
    assert _calls_from_settings(ROOT / path, *qualname), (
        f"{path}:{'.'.join(qualname)} configures a pull without PullOptions.from_settings")


def test_the_loader_options_carry_the_settings_and_their_own_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from modelexpress.engines.vllm.options import LoaderOptions

    monkeypatch.setenv("MX_REFUSE_SLOW_TRANSPORT", "1")
    monkeypatch.setenv("MX_TRANSFER_CHUNK_BYTES", str(8 << 20))
    options = LoaderOptions.from_extra_config({"mx_pull_timeout_s": 42, "mx_verify": False},
                                              MxSettings(server_url="http://127.0.0.1:1"))
    pull = options.pull_options
    assert pull is not None
    assert (pull.timeout_s, pull.verify) == (42.0, False)
    assert pull.refuse_slow_transport is True and pull.chunk_bytes == 8 << 20


def test_engines_relay_as_mx_relay_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vLLM loader's pull reads through and serves as a fleet relay by default
    (engines that start together), and neither with ``MX_RELAY=0``."""
    from modelexpress.engines.vllm.options import LoaderOptions

    on = LoaderOptions.from_extra_config({}, MxSettings(server_url="http://127.0.0.1:1"))
    assert on.pull_options is not None
    assert (on.pull_options.relay_read, on.pull_options.relay_serve) == (True, True)
    monkeypatch.setenv("MX_RELAY", "0")
    off = LoaderOptions.from_extra_config({}, MxSettings(server_url="http://127.0.0.1:1"))
    assert off.pull_options is not None
    assert (off.pull_options.relay_read, off.pull_options.relay_serve) == (False, False)
