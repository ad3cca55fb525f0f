"""The agent (REST transfers) pulls with the same settings as ``modelexpress pull``.

Both build their pull options with ``PullOptions.from_settings``
(tests/p2p/test_pull_options.py checks every entry point does); these tests check the
agent's flags land in the right place, and with real processes that one setting,
``MX_REFUSE_SLOW_TRANSPORT``, changes what the agent's pull does.
"""

from __future__ import annotations

import pytest

from conftest import MODEL, Cluster
from modelexpress.identity import ModelIdentity
from modelexpress.p2p.agent import AgentOptions
from modelexpress.settings import MxSettings


def test_refuse_slow_transport_from_the_environment_reaches_agent_options(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert AgentOptions.from_settings(MxSettings()).pull.refuse_slow_transport is False
    monkeypatch.setenv("MX_REFUSE_SLOW_TRANSPORT", "1")
    monkeypatch.setenv("MX_TRANSFER_CHUNK_BYTES", str(4 << 20))
    options = AgentOptions.from_settings(MxSettings())
    assert options.pull.refuse_slow_transport is True
    assert options.pull.chunk_bytes == 4 << 20
    assert options.pull.track is False  # the REST API made the record


def test_flags_override_settings_and_unknown_ones_are_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("MX_TRANSFER_MAX_GBPS", "2.5")
    monkeypatch.setenv("MX_SERVE_AFTER_PULL", "0")
    settings = MxSettings()
    assert AgentOptions.from_settings(settings).pull.max_gbps == 2.5
    options = AgentOptions.from_settings(settings, max_gbps=0.5, device="cpu", out_dir=tmp_path,
                                         serve_after_pull=True)
    assert options.pull.max_gbps == 0.5 and options.device == "cpu"
    assert options.out_dir == tmp_path and options.serve_after_pull is True
    assert AgentOptions.from_settings(settings).serve_after_pull is False
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
    # only warns. (MX_IPC_DIR=off: the local transport would not use UCX at all.)
    from modelexpress.checkpoint import real_model_checkpoint

    tcp = {"UCX_TLS": "tcp", "MX_IPC_DIR": "off"}
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
