"""Shared helpers of the VMM tests: both bookkeeping cores, leak counters."""

from __future__ import annotations

import os

import pytest

from modelexpress.vmm import ARENA_AVAILABLE


@pytest.fixture(params=["c", "py"])
def use_extension(request: pytest.FixtureRequest) -> bool:
    """Run a test on the C core (``_alloc_ext``) and on the pure-Python core."""
    if request.param == "c" and not ARENA_AVAILABLE:
        if os.environ.get("MX_REQUIRE_DEPS") == "1":
            pytest.fail("MX_REQUIRE_DEPS=1 but the _alloc_ext extension is not built")
        pytest.skip("_alloc_ext is not built")
    return request.param == "c"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def memfd_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "mx-vmm-" in line)


def map_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)
