"""The transport a pull expects follows the hardware, between namespaced hosts.

The hosts have no RDMA devices, so between them a pull expects ``tcp``: a TCP pull is
neither reported slow nor refused under ``MX_REFUSE_SLOW_TRANSPORT=1``. A target whose
kernel lists an RDMA device (faked in its own mount namespace: ``/sys/class/infiniband``
with an entry UCX cannot use) expects ``rdma``, so the same TCP pull is a fallback:
warned, and refused when asked. NIXL over TCP between two processes of one host (the
local transport off, UCX limited to TCP) is a fallback from ``cma``: warned.

Behaviour only; rates are bench/cluster.py's.
"""

from __future__ import annotations

import pathlib

import pytest

from mx_fleet import Fleet
from netns_cluster import NetnsCluster

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

_DEADLINE_S = 240.0  # a pull's process start (torch + NIXL imports) on a loaded machine
_REFUSE = {"MX_REFUSE_SLOW_TRANSPORT": "1"}


def _published(fleet: Fleet, host, env=None) -> dict:  # noqa: ANN001
    out = fleet.publish(host, env=env).json_line(_DEADLINE_S)
    assert out["ok"], out
    return out


def test_hosts_without_rdma_expect_tcp_and_a_tcp_pull_is_neither_slow_nor_refused(
        netns: NetnsCluster, tmp_path: pathlib.Path) -> None:
    server, src, tgt = (netns.add_host(n) for n in ("server", "src", "tgt"))
    fleet = Fleet(netns, server)
    _published(fleet, src)
    pull = fleet.pull(tgt, tmp_path / "out", env=_REFUSE)
    result = pull.json_line(_DEADLINE_S)
    assert result["ok"], f"{result}\n{pull.tail()}"
    assert pull.wait(30) == 0
    assert result["transport"] == "tcp", result["transport_detail"]
    assert result["expected_transport"] == "tcp"
    assert result["verdict"] != "slow" and not result["warnings"], result
    assert "slow transport" not in pull.tail(20000)


def test_rdma_present_but_tcp_used_warns_and_is_refused_when_asked(
        netns: NetnsCluster, tmp_path: pathlib.Path) -> None:
    server, src, tgt = (netns.add_host(n) for n in ("server", "src", "tgt"))
    tgt.fake_rdma_devices(["mlx5_0"])
    assert tgt.run(["ls", "/sys/class/infiniband"], "ls").proc.communicate(timeout=30)[0] \
        .split() == [b"mlx5_0"]
    fleet = Fleet(netns, server)
    _published(fleet, src)

    warned = fleet.pull(tgt, tmp_path / "warned")
    result = warned.json_line(_DEADLINE_S)
    assert result["ok"], f"{result}\n{warned.tail()}"
    assert result["transport"] == "tcp" and result["expected_transport"] == "rdma"
    assert result["verdict"] == "slow"
    assert any("over tcp where rdma was expected" in w and "mlx5_0" in w
               for w in result["warnings"]), result["warnings"]

    refused = fleet.pull(tgt, tmp_path / "refused", env=_REFUSE)
    result = refused.json_line(_DEADLINE_S)
    assert not result["ok"], result
    assert "refused" in result["error"] and "where rdma was expected" in result["error"], result
    assert refused.wait(30) != 0
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())


def test_nixl_over_tcp_between_processes_of_one_host_still_warns(
        netns: NetnsCluster, tmp_path: pathlib.Path) -> None:
    server, host = (netns.add_host(n) for n in ("server", "one"))
    fleet = Fleet(netns, server)
    nixl_only = {"MX_IPC_DIR": "off"}  # the local transport would not use NIXL at all
    _published(fleet, host, env=nixl_only)
    pull = fleet.pull(host, tmp_path / "out", env={**nixl_only, "UCX_TLS": "tcp"})
    result = pull.json_line(_DEADLINE_S)
    assert result["ok"], f"{result}\n{pull.tail()}"
    assert result["transport"] == "tcp" and result["expected_transport"] == "cma"
    assert result["verdict"] == "slow"
    assert any("over tcp where cma was expected" in w for w in result["warnings"]), result
