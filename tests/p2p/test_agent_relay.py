"""Fleet relay in one process: three agents claimed together read through each other.

A real server and source (``modelexpress publish``), three in-process agents over
NIXL (the local transport off, so every byte crosses a NIXL READ). The server's
planner chains them (origin -> first -> second -> third); each agent serves its
destination from its first chunk and ends as a READY fan-out source.
"""

from __future__ import annotations

import pathlib
import threading

import pytest
import torch

from conftest import CLIENT_TIMEOUT_S, MODEL, Cluster
from modelexpress.checkpoint import load_checkpoint, real_model_checkpoint
from modelexpress.client import MxClient
from modelexpress.identity import ModelIdentity
from modelexpress.p2p.agent import Agent, AgentOptions
from modelexpress.p2p.relay import relay_source_id, relay_worker_id
from modelexpress.server.service import source_id_for
from modelexpress.settings import MxSettings
from modelexpress.wire import TransferInfo

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


def test_the_relay_source_id_rule_is_the_servers() -> None:
    assert relay_source_id("a" * 32, "w") == source_id_for("a" * 32, "w")


def test_three_agents_claimed_together_form_a_chain_and_every_byte_is_the_origins(
        patient_cluster: Cluster, tmp_path: pathlib.Path) -> None:
    cluster = patient_cluster
    _, published = cluster.source()
    # Rate-capped (about 7 s each for the 91 MB model): the planner chains a claim only
    # behind transfers live at that moment, and uncapped the first agent once finished
    # (0.14 s) before the third was claimed, which then read the origin directly.
    settings = MxSettings(ipc_dir="off", transfer_max_gbps=0.1)
    clients = [MxClient(cluster.server.url, token=cluster.server.token,
                        timeout_s=CLIENT_TIMEOUT_S) for _ in range(3)]
    agents = [Agent(c, f"relay-agent-{i}", AgentOptions.from_settings(
        settings, out_dir=tmp_path / f"out{i}", relay_chunk_bytes=2 << 20))
        for i, c in enumerate(clients)]
    try:
        for a in agents:
            a.warm_up()  # on this thread: UCX starts here, not in the workers below
            a.register()
        ident = ModelIdentity(model=MODEL, dtype="float32")
        started = [cluster.client.start_transfer(ident, a.agent_id) for a in agents]
        stop = threading.Event()
        died: list[BaseException] = []

        def run(agent: Agent) -> None:
            # the agent's own loop: a poll whose reply is lost (a stalled server) is
            # retried, and the claim it made is handed out again (CLAIM_REDELIVERY_S)
            try:
                agent.run(stop, max_transfers=1)
            except BaseException as exc:
                died.append(exc)
                raise

        def claimed(t: TransferInfo) -> bool:
            assert not died, f"an agent's thread died: {died!r}"
            return cluster.client.get_transfer(t.id).claimed

        # claimed one after the other (as agents polling together would), run together
        threads = []
        try:
            for a, t in zip(agents, started):
                th = threading.Thread(target=run, args=(a,))
                th.start()
                threads.append(th)
                cluster.wait_for(lambda: claimed(t), f"the claim of {a.agent_id}")
        except BaseException:
            stop.set()  # the agents leave their loops (an aborted transfer reads FAILED)
            raise
        finally:
            for th in threads:
                th.join(240)
            stop.set()
        assert not any(th.is_alive() for th in threads) and not died, died
        recs = [cluster.client.get_transfer(t.id) for t in started]
        assert [r.state for r in recs] == ["SUCCEEDED"] * 3, [(r.state, r.error) for r in recs]
        origin = f"s:{published['source_id']}"
        assert recs[0].relay_path == (origin,)
        assert recs[1].relay_path == (f"t:{started[0].id}", origin)
        assert recs[2].relay_path[0] == f"t:{started[1].id}"
        ref = load_checkpoint(real_model_checkpoint())
        for i in range(3):
            got = load_checkpoint(tmp_path / f"out{i}" / started[i].id)
            assert got.keys() == ref.keys()
            for name, t in ref.items():
                assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
        # each relay source became the agent's READY fan-out source
        for a, t in zip(agents, started):
            sid = relay_source_id(t.identity_id, relay_worker_id(a.agent_id, t.id))
            assert cluster.client.get_source(sid).state == "READY"
    finally:
        for a in agents:
            a.close()
        for c in clients:
            c.close()


def test_a_pull_started_while_an_agent_relays_reads_through_it(
        patient_cluster: Cluster, tmp_path: pathlib.Path) -> None:
    """``modelexpress pull`` (here the library pull it runs, with ``relay_read`` as the
    CLI sets it from MX_RELAY) is planned behind a relaying agent's live transfer and
    reads its chunks from it; it relays to nobody itself. The agent is rate-capped so
    that it is still receiving when the pull starts."""
    from modelexpress.p2p.options import PullOptions
    from modelexpress.p2p.target import pull

    cluster = patient_cluster
    _, published = cluster.source()
    settings = MxSettings(ipc_dir="off", transfer_max_gbps=0.03)
    client = MxClient(cluster.server.url, token=cluster.server.token,
                      timeout_s=CLIENT_TIMEOUT_S)
    agent = Agent(client, "relay-agent-slow", AgentOptions.from_settings(
        settings, out_dir=tmp_path / "out", relay_chunk_bytes=2 << 20))
    try:
        agent.warm_up()
        agent.register()
        ident = ModelIdentity(model=MODEL, dtype="float32")
        up = cluster.client.start_transfer(ident, agent.agent_id)
        (claimed,) = cluster.claim(agent.client, agent.agent_id)
        states: dict[str, str] = {}
        th = threading.Thread(target=lambda: states.update(up=agent.execute(claimed)))
        th.start()
        try:
            cluster.wait_for(lambda: cluster.client.get_transfer(up.id).bytes_done > 0,
                             "the agent's first verified chunk")
            got: dict[str, torch.Tensor] = {}
            result = pull(ident, client=cluster.client, on_destination=got.update,
                          options=PullOptions.from_settings(MxSettings(ipc_dir="off"),
                                                            relay_read=True,
                                                            relay_chunk_bytes=2 << 20))
        finally:
            th.join(240)
        assert not th.is_alive() and states == {"up": "SUCCEEDED"}, states
        rec = cluster.client.get_transfer(result.transfer_id)
        assert rec.relay_path == (f"t:{up.id}", f"s:{published['source_id']}")
        assert rec.state == "SUCCEEDED"
        ref = load_checkpoint(real_model_checkpoint())
        assert got.keys() == ref.keys()
        for name, t in ref.items():
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    finally:
        agent.close()
        client.close()
