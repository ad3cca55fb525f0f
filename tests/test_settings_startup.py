"""Settings that cannot work are refused at start-up, not at first use.

``MX_NIXL_BACKEND`` is checked against the installed NIXL's plugins (its plugin
directory; no agent is created), or NIXL's known names where NIXL is absent;
``MX_IPC_DIR`` against the Unix socket path limit; an empty ``MX_SERVER_TOKEN`` is no
token; combinations that do nothing are said once. Every refusal is one line naming
the variable and the accepted values, from the CLI and the server alike.
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys

import pytest

from modelexpress.errors import ConfigError
from modelexpress.settings import NIXL_BACKENDS, MxSettings, nixl_plugins

_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("MX_", "NIXL_"))}


def test_nixl_backend_names_the_installed_plugins_when_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MX_NIXL_BACKEND", "NOPE")
    with pytest.raises(ConfigError) as err:
        MxSettings.load()
    line = str(err.value)
    plugins, where = nixl_plugins()
    assert line.startswith("MX_NIXL_BACKEND: 'NOPE' is not a NIXL backend plugin "), line
    assert line.endswith(f"use one of {', '.join(plugins)}") and "\n" not in line
    assert where in line


@pytest.mark.nixl
def test_with_nixl_installed_the_plugins_come_from_its_plugin_directory() -> None:
    plugins, where = nixl_plugins()
    assert "UCX" in plugins and where.startswith("installed in ")
    assert pathlib.Path(where.removeprefix("installed in ")).is_dir()


def test_nixl_backend_is_case_insensitive_and_spelled_as_nixl_spells_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MX_NIXL_BACKEND", " ucx ")
    assert MxSettings.load().nixl_backend == "UCX"


def test_without_nixl_the_known_names_are_accepted_and_listed() -> None:
    plugins, where = nixl_plugins(modules=("no_such_nixl_module",))
    assert plugins == NIXL_BACKENDS and "known to NIXL" in where


def test_nixl_plugin_dir_is_what_is_checked_against(tmp_path: pathlib.Path) -> None:
    """NIXL_PLUGIN_DIR (NIXL's own variable) decides the plugins, in a fresh process."""
    (tmp_path / "libplugin_MINE.so").write_bytes(b"")
    env = {**_ENV, "NIXL_PLUGIN_DIR": str(tmp_path)}
    code = ("from modelexpress.settings import MxSettings\n"
            "print(MxSettings(nixl_backend='mine').nixl_backend)\n"
            "try:\n    MxSettings.load(nixl_backend='UCX')\n"
            "except Exception as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    assert first == "MINE"
    assert second == (f"MX_NIXL_BACKEND: 'UCX' is not a NIXL backend plugin installed in "
                      f"{tmp_path}; use one of MINE")


def test_an_ipc_dir_too_long_for_a_socket_is_refused_with_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MX_IPC_DIR", "/" + "d" * 90)
    with pytest.raises(ConfigError) as err:
        MxSettings.load()
    assert str(err.value).startswith("MX_IPC_DIR: '/ddd"), err.value
    assert "at most 82 bytes, or off" in str(err.value)
    monkeypatch.setenv("MX_IPC_DIR", "/" + "d" * 81)  # 82 bytes: the longest that fits
    assert MxSettings.load().ipc_dir.endswith("d")
    monkeypatch.setenv("MX_IPC_DIR", "off")
    assert MxSettings.load().ipc_dir == "off"


def test_the_longest_accepted_ipc_dir_holds_a_source_socket(tmp_path: pathlib.Path) -> None:
    from modelexpress.local import protocol
    longest = str(tmp_path) + "/" + "d" * (82 - len(str(tmp_path)) - 1)
    assert MxSettings(ipc_dir=longest).ipc_dir == longest
    protocol.socket_path(longest, "0123456789abcdef")  # raises when it does not fit


def test_an_empty_server_token_is_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MX_SERVER_TOKEN", "  ")
    assert MxSettings.load().server_token is None


def test_settings_that_do_nothing_are_said_at_start(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="modelexpress.settings"):
        MxSettings(transfer_stall_s=700, transfer_timeout_s=600, vmm_arena_single_mr=True)
    text = caplog.text
    assert "MX_TRANSFER_STALL_S=700 is not below MX_TRANSFER_TIMEOUT_S=600" in text
    assert "MX_VMM_ARENA_SINGLE_MR=1 has no effect without MX_VMM_ARENA=1" in text


@pytest.mark.parametrize("argv", [
    ["-m", "modelexpress", "pull", "--model", "m", "--out", "/tmp/never-written"],
    ["-m", "modelexpress.server", "--port", "0"],
], ids=["cli-pull", "server"])
def test_entry_points_refuse_a_bad_backend_before_doing_anything(argv: list[str]) -> None:
    out = subprocess.run([sys.executable, *argv], env={**_ENV, "MX_NIXL_BACKEND": "NOPE"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if "MX_NIXL_BACKEND" in ln]
    assert len(lines) == 1, out.stderr[-2000:]
    assert "'NOPE' is not a NIXL backend plugin" in lines[0] and "UCX" in lines[0]
    assert "Traceback" not in out.stderr
