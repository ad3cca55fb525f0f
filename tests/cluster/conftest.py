"""Fixtures of the cluster tests: hosts in network namespaces (root only).

The harness is :mod:`netns_cluster` (namespaces, bridges, ``tc``) and :mod:`mx_fleet`
(the modelexpress server and commands in those hosts); ``bench/cluster.py`` uses both.
CI runs as root; elsewhere these tests skip, saying why (with ``MX_REQUIRE_DEPS=1``
they fail instead, like every other missing dependency).
"""

from __future__ import annotations

import pathlib
import sys
from typing import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from netns_cluster import NetnsCluster, require_netns  # noqa: E402


@pytest.fixture
def netns(tmp_path: pathlib.Path) -> Iterator[NetnsCluster]:
    """One bridge; add hosts with ``add_host``. Torn down (and checked) at the end."""
    require_netns()
    with NetnsCluster(tmp_path / "cluster") as cluster:
        yield cluster
    assert cluster.leftovers() == []


@pytest.fixture
def netns2(tmp_path: pathlib.Path) -> Iterator[NetnsCluster]:
    """Two bridges: hosts may have ``eth0`` and ``eth1`` on separate networks."""
    require_netns()
    with NetnsCluster(tmp_path / "cluster", bridges=2) as cluster:
        yield cluster
    assert cluster.leftovers() == []
