"""Fixtures of the cluster tests: hosts in network namespaces (root only).

The harness is :mod:`netns_cluster` (namespaces, bridges, ``tc``) and :mod:`mx_fleet`
(the modelexpress server and commands in those hosts); ``bench/cluster.py`` uses both.
CI runs as root; elsewhere these tests skip, saying why (with ``MX_REQUIRE_DEPS=1``
they fail instead, like every other missing dependency).
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from netns_cluster import NetnsCluster, netns_available  # noqa: E402


def _require_netns() -> None:
    reason = netns_available()
    if reason is None:
        return
    if os.environ.get("MX_REQUIRE_DEPS") == "1":
        pytest.fail(f"MX_REQUIRE_DEPS=1 but the cluster harness {reason}", pytrace=False)
    pytest.skip(f"the cluster harness {reason}")


@pytest.fixture
def netns(tmp_path: pathlib.Path) -> Iterator[NetnsCluster]:
    """One bridge; add hosts with ``add_host``. Torn down (and checked) at the end."""
    _require_netns()
    with NetnsCluster(tmp_path / "cluster") as cluster:
        yield cluster
    assert cluster.leftovers() == []


@pytest.fixture
def netns2(tmp_path: pathlib.Path) -> Iterator[NetnsCluster]:
    """Two bridges: hosts may have ``eth0`` and ``eth1`` on separate networks."""
    _require_netns()
    with NetnsCluster(tmp_path / "cluster", bridges=2) as cluster:
        yield cluster
    assert cluster.leftovers() == []
