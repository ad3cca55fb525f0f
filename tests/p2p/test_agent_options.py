"""The agent (REST transfers) pulls with the same settings as ``modelexpress pull``.

``AgentOptions.from_settings`` is where an agent's options come from; these tests keep
it reading every setting the pull command reads, and check with real processes that
one of them, ``MX_REFUSE_SLOW_TRANSPORT``, changes what the agent's pull does.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from conftest import MODEL, Cluster
from modelexpress.identity import ModelIdentity
from modelexpress.p2p.agent import AgentOptions
from modelexpress.settings import MxSettings

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _settings_read_in(path: pathlib.Path, *qualname: str) -> set[str]:
    """Fields read as ``settings.<field>`` inside the function ``qualname`` of ``path``."""
    node: ast.AST = ast.parse(path.read_text())
    for name in qualname:
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
    return {n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "settings" and n.attr in MxSettings.model_fields}


def test_agent_options_read_every_setting_the_pull_command_reads() -> None:
    by_pull = _settings_read_in(ROOT / "modelexpress" / "p2p" / "cli.py", "pull")
    by_agent = _settings_read_in(ROOT / "modelexpress" / "p2p" / "agent.py",
                                 "AgentOptions", "from_settings")
    assert "refuse_slow_transport" in by_pull  # the scan sees what it should
    assert by_pull - by_agent == set(), (
        "modelexpress pull reads settings that an agent's REST transfers ignore")


def test_refuse_slow_transport_from_the_environment_reaches_agent_options(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert AgentOptions.from_settings(MxSettings()).refuse_slow_transport is False
    monkeypatch.setenv("MX_REFUSE_SLOW_TRANSPORT", "1")
    monkeypatch.setenv("MX_TRANSFER_CHUNK_BYTES", str(4 << 20))
    options = AgentOptions.from_settings(MxSettings())
    assert options.refuse_slow_transport is True
    assert options.chunk_bytes == 4 << 20


def test_flags_override_settings_and_unknown_ones_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MX_TRANSFER_MAX_GBPS", "2.5")
    settings = MxSettings()
    assert AgentOptions.from_settings(settings).max_gbps == 2.5
    assert AgentOptions.from_settings(settings, max_gbps=0.5, device="cpu").max_gbps == 0.5
    with pytest.raises(TypeError, match="refuse_slow"):
        AgentOptions.from_settings(settings, refuse_slow=True)


@pytest.mark.nixl
@pytest.mark.slow
def test_an_agent_with_refuse_slow_transport_fails_a_transfer_that_fell_back(
        cluster: Cluster) -> None:
    # Same-host DRAM should move over cma; UCX_TLS=tcp on both sides makes UCX use TCP,
    # and its own protocol report says so, which is a fallback whatever the rate
    # (modelexpress/transfer/transport.py). Only the environment differs between the
    # agents: the one with MX_REFUSE_SLOW_TRANSPORT=1 must fail its transfer, the other
    # only warns.
    from modelexpress.checkpoint import real_model_checkpoint

    tcp = {"UCX_TLS": "tcp"}
    publisher = cluster.start(["publish", str(real_model_checkpoint()), "--model", MODEL,
                               "--json", "--worker-id", "tcp-source"], "tcp-source", env=tcp)
    publisher.json_line()
    c = cluster.client
    args = ["--no-serve", "--chunk-bytes", str(2 << 20)]
    cluster.start(["agent", "--id", "refusing", *args], "refusing",
                  env={"MX_REFUSE_SLOW_TRANSPORT": "1", **tcp})
    warning = cluster.start(["agent", "--id", "warning", *args], "warning", env=tcp)
    cluster.wait_for(lambda: {"refusing", "warning"} <= {a.id for a in c.list_agents()},
                     "both agents", deadline_s=180)
    identity = ModelIdentity(model=MODEL, dtype="float32")
    refused = c.start_transfer(identity, "refusing")
    warned = c.start_transfer(identity, "warning")

    def finished(transfer_id: str):  # noqa: ANN202
        t = c.get_transfer(transfer_id)
        return t if t.state in ("SUCCEEDED", "FAILED", "STOPPED") else None

    refused = cluster.wait_for(lambda: finished(refused.id), "the refusing agent's transfer",
                               deadline_s=180)
    warned = cluster.wait_for(lambda: finished(warned.id), "the warning agent's transfer",
                              deadline_s=180)
    assert refused.state == "FAILED", refused
    assert "TransportError" in (refused.error or "") and "refused" in (refused.error or "")
    assert warned.state == "SUCCEEDED", warned.error
    assert "slow transport from peer" in warning.log_path.read_text()
