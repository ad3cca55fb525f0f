"""An agent's REST transfer, run in this process against a real server and source.

It fetches the assigned source (identity, manifest, agent metadata) once, and
finishes the record with the outcome the server exports: the transport UCX reported,
the rate verdict and both times.
"""

from __future__ import annotations

import pytest

from conftest import CLIENT_TIMEOUT_S, MODEL, Cluster
from modelexpress.client import MxClient
from modelexpress.identity import ModelIdentity
from modelexpress.p2p.agent import Agent, AgentOptions
from modelexpress.settings import MxSettings

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


class _CountingClient(MxClient):
    """The real client, counting the source fetches it makes."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002,ANN003
        super().__init__(*args, **kwargs)
        self.fetched: list[str] = []

    def get_source(self, source_id: str):  # noqa: ANN201
        self.fetched.append(source_id)
        return super().get_source(source_id)


def test_an_agent_transfer_fetches_its_source_once_and_records_the_outcome(
        cluster: Cluster) -> None:
    _, published = cluster.source()
    client = _CountingClient(cluster.server.url, token=cluster.server.token,
                             timeout_s=CLIENT_TIMEOUT_S)
    options = AgentOptions.from_settings(MxSettings(), serve_after_pull=False)
    with client, Agent(client, "in-process-agent", options) as agent:
        agent.warm_up()  # as run() does: its NIXL agent then reads every transfer
        agent.register()
        ids = []
        for _ in range(2):  # the second reads through the same NIXL agent
            started = client.start_transfer(ModelIdentity(model=MODEL, dtype="float32"),
                                            agent.agent_id)
            claimed = cluster.claim(client, agent.agent_id)
            assert [t.id for t in claimed] == [started.id]
            assert agent.execute(claimed[0]) == "SUCCEEDED"
            ids.append(started.id)
    # once per transfer, not once more by the pull
    assert client.fetched == [published["source_id"]] * 2
    record = cluster.client.get_transfer(ids[-1])
    assert record.state == "SUCCEEDED" and record.bytes_done == record.bytes_total > 0
    assert record.outcome is not None
    # source and agent share this host: the local transport (docs/DEPLOYMENT.md)
    assert record.outcome.transport == "local"
    assert record.outcome.verdict in ("ok", "unknown")
    assert 0 < record.outcome.data_plane_s <= record.outcome.total_s
