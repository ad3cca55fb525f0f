"""Fleet relay across namespace hosts: targets started together read through each other.

Every host's link is capped (``tc tbf``, both directions), UCX moves bytes over TCP on
the hosts' NICs, and the origin's NIC counter says how many copies it sent. Targets
are ``modelexpress agent`` processes (MX_RELAY on, the default) running REST
transfers created at the same moment; the server's planner chains them at claim time
(``relay_path``). The checkpoint is a generated one of 64 equal fp32 tensors (32 MB),
so it splits into 16 relay chunks of 2 MiB.

Behaviour only; times are bench/cluster.py's (``relay``).
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest
import torch

from modelexpress.checkpoint import load_checkpoint
from mx_fleet import START_DEADLINE_S, Fleet
from netns_cluster import Host, NetnsCluster

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

_MODEL = "tests/relay-uniform-64"
_FINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# A stall bound well above a chunk's time on the slowest link here (2 MiB at 40 Mbit/s:
# 0.4 s) and the CI machine's scheduling hiccups; a killed relay is noticed sooner (its
# READ fails, its guardian marks it STALE).
_RELAY_ENV = {"MX_RELAY_CHUNK_BYTES": str(2 << 20), "MX_TRANSFER_STALL_S": "10",
              "MX_TRANSFER_TIMEOUT_S": "180"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("relay-ckpt")
    gen = torch.Generator().manual_seed(22)
    save_file({f"layer.{i}.weight": torch.rand(128 * 1024, generator=gen) for i in range(64)},
              str(d / "model.safetensors"))
    return d


def _nbytes(ckpt: pathlib.Path) -> int:
    return sum(t.numel() * t.element_size() for t in load_checkpoint(ckpt).values())


def _assert_same(out: pathlib.Path, ckpt: pathlib.Path) -> None:
    ref, got = load_checkpoint(ckpt), load_checkpoint(out)
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


def _start(netns: NetnsCluster, tmp_path: pathlib.Path, checkpoint: pathlib.Path, n: int,
           cap_mbit: float) -> tuple[Fleet, Host, list[Host], list[Any], Any]:
    server = netns.add_host("server")
    origin = netns.add_host("origin")
    targets = [netns.add_host(f"t{i}") for i in range(n)]
    for h in [origin, *targets]:
        h.shape(cap_mbit)
    fleet = Fleet(netns, server)
    pub = fleet.publish(origin, checkpoint=checkpoint, model=_MODEL)
    assert pub.json_line(START_DEADLINE_S)["ok"]
    agents = [fleet.agent(h, f"agent-{h.name}", tmp_path / h.name, env=_RELAY_ENV)
              for h in targets]
    fleet.wait_agents([f"agent-{h.name}" for h in targets])
    with fleet.client() as c:
        (ident,) = {s.model_identity.id: s.model_identity
                    for s in c.list_sources(model=_MODEL, state="READY")}.values()
    return fleet, origin, targets, agents, ident


def _create(fleet: Fleet, ident: Any, targets: list[Host]) -> list[Any]:
    with fleet.client() as c:  # all at once, as an autoscaler would
        return [c.start_transfer(ident, f"agent-{h.name}") for h in targets]


def _wait(fleet: Fleet, ids: list[str], deadline_s: float = 180.0) -> dict[str, Any]:
    end = time.monotonic() + deadline_s
    with fleet.client() as c:
        while True:
            got = {t: c.get_transfer(t) for t in ids}
            if all(x.state in _FINAL for x in got.values()):
                return got
            assert time.monotonic() < end, {t: (x.state, x.bytes_done) for t, x in got.items()}
            time.sleep(0.2)


def test_four_targets_started_together_get_every_byte_while_the_origin_sends_about_one_copy(
        netns: NetnsCluster, tmp_path: pathlib.Path, checkpoint: pathlib.Path) -> None:
    fleet, origin, targets, _, ident = _start(netns, tmp_path, checkpoint, 4, 200)
    tx0 = origin.nic_bytes()[1]
    made = _create(fleet, ident, targets)
    done = _wait(fleet, [t.id for t in made])
    sent = origin.nic_bytes()[1] - tx0
    assert all(x.state == "SUCCEEDED" for x in done.values()), {
        t: x.error for t, x in done.items()}
    for h, t in zip(targets, made):
        _assert_same(tmp_path / h.name / t.id, checkpoint)
    model = _nbytes(checkpoint)
    # about one copy (TCP/UCX framing and the control plane on top), not four
    assert model <= sent < 1.5 * model, (sent, model)
    paths = [done[t.id].relay_path for t in made]
    relayed = [p for p in paths if p and p[0].startswith("t:")]
    assert len(relayed) == 3, paths  # a chain: one target reads the origin, three a peer


def test_a_relay_sigkilled_mid_transfer_does_not_fail_its_downstream(
        netns: NetnsCluster, tmp_path: pathlib.Path, checkpoint: pathlib.Path) -> None:
    fleet, _, targets, agents, ident = _start(netns, tmp_path, checkpoint, 3, 60)
    made = _create(fleet, ident, targets)
    by_id = {t.id: (h, a) for t, h, a in zip(made, targets, agents)}
    model = _nbytes(checkpoint)
    end = time.monotonic() + START_DEADLINE_S
    victim = None
    with fleet.client() as c:
        while victim is None:
            assert time.monotonic() < end, "the middle relay never got a third of the model"
            recs = {t.id: c.get_transfer(t.id) for t in made}
            # the middle of the chain: reads a peer, and a peer reads it
            middle = [x for x in recs.values() if x.relay_path and x.relay_path[0].startswith("t:")
                      and any(y.relay_path[:1] == (f"t:{x.id}",) for y in recs.values())]
            if middle and middle[0].bytes_done > model // 3:
                victim = middle[0]
            time.sleep(0.05)
    host, agent = by_id[victim.id]
    agent.kill()  # SIGKILL mid-transfer: no withdrawal, only its guardian reports it
    rest = [t.id for t in made if t.id != victim.id]
    done = _wait(fleet, rest)
    downstream = next(t for t in rest if done[t].relay_path[0] == f"t:{victim.id}")
    assert all(done[t].state == "SUCCEEDED" for t in rest), {t: done[t].error for t in rest}
    h, a = by_id[downstream]
    _assert_same(tmp_path / h.name / downstream, checkpoint)
    assert "leaving holder t:" + victim.id in a.tail(200_000), a.tail()


def test_a_stop_through_the_rest_api_ends_a_relayed_transfer(
        netns: NetnsCluster, tmp_path: pathlib.Path, checkpoint: pathlib.Path) -> None:
    fleet, _, targets, _, ident = _start(netns, tmp_path, checkpoint, 2, 40)
    made = _create(fleet, ident, targets)
    host = {t.id: h for t, h in zip(made, targets)}
    end = time.monotonic() + START_DEADLINE_S
    with fleet.client() as c:
        # Which one reads the origin is whichever agent claims first; the other reads it.
        while True:
            recs = [c.get_transfer(t.id) for t in made]
            down = [x for x in recs
                    if x.bytes_done and x.relay_path and x.relay_path[0].startswith("t:")]
            if down:
                break
            assert time.monotonic() < end, "no transfer started reading its peer: " + str(
                [(x.id, x.state, x.relay_path, x.bytes_done) for x in recs])
            time.sleep(0.05)
        second = down[0]
        (first,) = [t for t in made if t.id != second.id]
        assert second.relay_path[0] == f"t:{first.id}"  # it reads its peer, not the origin
        c.stop_transfer(second.id)
    done = _wait(fleet, [first.id, second.id])
    assert done[second.id].state == "STOPPED"
    assert done[second.id].bytes_done < _nbytes(checkpoint)
    assert not (tmp_path / host[second.id].name / second.id).exists()  # nothing half-written
    assert done[first.id].state == "SUCCEEDED"  # its upstream is not disturbed
    _assert_same(tmp_path / host[first.id].name / first.id, checkpoint)
