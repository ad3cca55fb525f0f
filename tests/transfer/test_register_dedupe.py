"""Registering memory that is already registered adds no duplicate region.

A duplicate (addr, len, dev) with a different key makes a peer refuse the whole agent
metadata (NIXL_ERR_NOT_ALLOWED), which the GPU benchmark hit when two tensor sets
shared caching-allocator segments.
"""

from __future__ import annotations

import pytest
import torch

from modelexpress.transfer import NixlTransferManager

pytestmark = pytest.mark.nixl


def test_second_registration_of_the_same_memory_is_skipped_and_peers_load_it() -> None:
    buf = torch.arange(1 << 18, dtype=torch.int32)
    with NixlTransferManager() as src, NixlTransferManager() as dst:
        first = src.register_tensors({"a": buf}, "per_tensor")
        again = src.register_tensors({"a": buf, "b": buf[: 1 << 10]}, "per_tensor")
        assert first.regions == 1 and again.regions == 0
        assert len(src.registered_regions("DRAM")) == 1
        assert dst.add_peer(src.get_agent_metadata()) == src.name

