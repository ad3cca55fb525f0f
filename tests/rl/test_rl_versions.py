"""Weight versions as sources: a real control-plane server, real NIXL, a puller process.

The trainer's side (:class:`VersionPool`) runs in this process; a target that pulls a
version runs in its own process, as an engine would (``pull`` with digests checked).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402

from modelexpress.errors import ConfigError  # noqa: E402
from modelexpress.local import LocalOptions  # noqa: E402
from modelexpress.rl import VersionBusyError, VersionPool, version_identity  # noqa: E402

pytestmark = [pytest.mark.nixl]

_PULL = """
import hashlib, json, sys, torch
from modelexpress.client import MxClient
from modelexpress.identity import ModelIdentity
from modelexpress.p2p.options import PullOptions
from modelexpress.p2p.target import pull
url, token, ident = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
got = {}
with MxClient(url, token=token, timeout_s=30, retries=1) as client:
    r = pull(ModelIdentity.from_dict(ident), None, client=client, on_destination=got.update,
             options=PullOptions(timeout_s=60, track=False))
print(json.dumps({"verified": r.verified, "transport": r.transport, "sums": {n: float(t.double().sum()) for n, t in got.items()}}))
"""


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[ServerProc]:
    srv = ServerProc(f"sqlite:///{tmp_path}/mx.db", tmp_path,
                     env={"MX_STALE_AFTER_S": "600"}).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ServerProc):  # noqa: ANN201
    from modelexpress.client import MxClient

    with MxClient(server.url, token=TOKEN, timeout_s=30.0, retries=1) as c:
        yield c


def _weights(seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(64, 32, generator=g),
            "model.layers.0.mlp.down_proj.weight": torch.randn(32, 48, generator=g),
            "model.norm.weight": torch.randn(32, generator=g).to(torch.bfloat16)}


def test_version_identities_differ_by_version_and_name_the_shard() -> None:
    one, two = version_identity("run", "1"), version_identity("run", "2")
    assert one.id != two.id and one.revision == "1" and two.revision == "2"
    assert ("mx_rl_shard", "0/1") in one.extra
    assert version_identity("run", "1", shard=1, shards=2).id != one.id
    with pytest.raises(ConfigError, match=r"\[0, 2\)"):
        version_identity("run", "1", shard=2, shards=2)


@pytest.mark.parametrize("local", [LocalOptions(ipc_dir="off"), LocalOptions()],
                         ids=["nixl-only", "local-transport"])
def test_versions_reuse_the_pools_buffers_and_withdraw_the_oldest(client, local) -> None:  # noqa: ANN001
    with VersionPool(client, "run-a", slots=2, heartbeat_interval_s=1.0, guardian=False,
                     local=local) as pool:
        first = pool.publish("1", _weights(1).items())
        second = pool.publish("2", _weights(2).items())
        addresses, nbytes = sorted(pool.buffer_addresses()), pool.buffer_bytes()
        third = pool.publish("3", _weights(3).items())
        fourth = pool.publish("4", _weights(4).items())
        # Memory is reused, not grown: the same buffers hold versions 3 and 4.
        assert sorted(pool.buffer_addresses()) == addresses
        assert pool.buffer_bytes() == nbytes
        assert (third.withdrew, fourth.withdrew) == ("1", "2")
        assert pool.versions() == ["3", "4"]
        states = {v.version: client.get_source(v.source_id).state
                  for v in (first, second, third, fourth)}
        assert states == {"1": "STALE", "2": "STALE", "3": "READY", "4": "READY"}
    assert client.get_source(fourth.source_id).state == "STALE"  # close withdraws everything


def test_a_version_with_an_update_in_flight_is_never_overwritten(client) -> None:  # noqa: ANN001
    with VersionPool(client, "run-b", slots=1, heartbeat_interval_s=1.0, guardian=False) as pool:
        pool.publish("1", _weights(1).items())
        with pool.lease("1"), pytest.raises(VersionBusyError, match="in flight"):
            pool.publish("2", _weights(2).items())
        assert pool.versions() == ["1"]
        pool.publish("2", _weights(2).items())  # the lease ended: the slot is reused
        assert pool.versions() == ["2"]
        with pytest.raises(ConfigError, match="not published"):
            with pool.lease("1"):
                pass
        with pytest.raises(ConfigError, match="already published"):
            pool.publish("2", _weights(2).items())


@pytest.mark.parametrize("local, transport", [(LocalOptions(ipc_dir="off"), "cma"),
                                              (LocalOptions(), "local")],
                         ids=["nixl", "local-transport"])
def test_a_puller_process_gets_the_newest_version_verified(server, client, local,  # noqa: ANN001
                                                           transport: str) -> None:
    """An engine on this host reads the version over the local transport when the pool
    serves it (memfd-backed slots), over NIXL otherwise."""
    with VersionPool(client, "run-c", slots=2, heartbeat_interval_s=1.0, guardian=False,
                     local=local) as pool:
        pool.publish("1", _weights(1).items())
        newest = pool.publish("2", _weights(2).items())
        run = subprocess.run([sys.executable, "-c", _PULL, server.url, TOKEN,
                              json.dumps(newest.identity.to_dict())],
                             capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-3000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["verified"] is True
    assert out["transport"] == transport
    expected = {n: float(t.double().sum()) for n, t in _weights(2).items()}
    assert out["sums"] == pytest.approx(expected, rel=0, abs=0)
