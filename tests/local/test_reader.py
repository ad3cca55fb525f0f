"""The local transport behind the pull path's reader seam (modelexpress.p2p.readers)."""

from __future__ import annotations

import threading

import pytest
import torch

from modelexpress.local import (
    LocalOptions,
    LocalReader,
    endpoint_of,
    host_id,
    local_reader_factory,
)
from modelexpress.transfer.manifest import Manifest

from ._peers import make_tensors


def test_a_same_host_source_gets_a_local_reader_and_reports_transport_local(make_source):
    src = make_source(mib=8)
    manifest = Manifest.from_json(src.info["manifest"])
    assert endpoint_of(manifest) is not None
    factory = local_reader_factory(LocalOptions(), chunk_bytes=1 << 20, verify=True)
    reader = factory(object(), manifest)
    assert isinstance(reader, LocalReader)
    dest = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for t in manifest.tensors}
    seen: list[int] = []
    res = reader.read_into(dest, allow_partial=False, progress=lambda d, t: seen.append(d),
                           stop=threading.Event(), deadline_s=30)
    assert res.transport == "local" and res.verdict.ok and res.verified
    assert res.bytes == manifest.total_bytes and seen[-1] == manifest.total_bytes
    want = make_tensors(src.seed, src.mib)
    assert all(torch.equal(want[k].view(torch.uint8), dest[k].view(torch.uint8)) for k in want)
    # a callable stop signal (transfer.StopSignal) is honoured too
    from modelexpress.errors import TransferCancelledError
    try:
        reader.read_into(dest, allow_partial=False, progress=lambda d, t: None,
                         stop=lambda: True, deadline_s=30)
    except TransferCancelledError:
        pass
    else:
        raise AssertionError("a callable stop returning True did not cancel")


def test_another_node_or_an_invisible_socket_or_off_reads_over_nixl(make_source, tmp_path):
    src = make_source(mib=2)
    manifest = Manifest.from_json(src.info["manifest"])
    other = local_reader_factory(LocalOptions(node_name="another-node"), chunk_bytes=1 << 20,
                                 verify=True)
    assert other(object(), manifest) is None
    off = local_reader_factory(LocalOptions(ipc_dir="off"), chunk_bytes=1 << 20, verify=True)
    assert off(object(), manifest) is None
    src.close()  # the socket goes with the source
    here = local_reader_factory(LocalOptions(), chunk_bytes=1 << 20, verify=True)
    assert here(object(), manifest) is None


def test_options_come_from_mx_settings(monkeypatch):
    pytest.importorskip("pydantic_settings", reason="the settings need pydantic-settings "
                        "(CI has it; the H200 host does not)")
    from modelexpress.settings import MxSettings
    monkeypatch.setenv("MX_NODE_NAME", "node-a")
    monkeypatch.setenv("MX_IPC_DIR", "/run/mx")
    opts = LocalOptions.from_settings(MxSettings())
    assert opts == LocalOptions(ipc_dir="/run/mx", node_name="node-a")
    assert opts.host_id == "node:node-a" == host_id("node-a")
    assert host_id().startswith("boot:")
