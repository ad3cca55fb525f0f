"""GPUs cross process boundaries by UUID: the device list is faked at the boundary.

Two processes with different ``CUDA_VISIBLE_DEVICES`` disagree on what ``cuda:0`` is, so
a source publishes each device segment under its GPU's UUID and a target maps that to
its own ordinal (:class:`~modelexpress.local.devices.StaticDevices` stands for the
device list on either side). A segment on a GPU the target cannot see, or one that
names no UUID, is refused before anything is mapped: the pull reads that source over
NIXL instead. The end-to-end cases run a source that speaks the wire protocol in a
thread of the test and hands out a ``cuda_ipc`` segment (an IPC handle, no descriptor):
the target must refuse it without touching CUDA, which this machine does not have.
"""

from __future__ import annotations

import pathlib
import socket
import threading
import uuid
from collections.abc import Iterator

import pytest

from modelexpress.errors import ConfigError, PeerError
from modelexpress.local import LocalEndpoint, LocalSession, LocalSource, Segment
from modelexpress.local import protocol
from modelexpress.local.client import fd_count
from modelexpress.local.cuda import CudaExport
from modelexpress.local.devices import (
    CudaDevices,
    StaticDevices,
    gpu_uuid,
    local_segments,
    ordinal_of,
    uuid_of,
)

GPU_A = f"GPU-{uuid.UUID(int=0xA).hex[:8]}-0000-0000-0000-00000000000a"
GPU_B = f"GPU-{uuid.UUID(int=0xB).hex[:8]}-0000-0000-0000-00000000000b"


def test_uuids_are_spelled_as_cuda_visible_devices_takes_them() -> None:
    raw = uuid.UUID("8c3a5e4f-1b2c-4d5e-8f90-0123456789ab")
    assert gpu_uuid(raw) == "GPU-8c3a5e4f-1b2c-4d5e-8f90-0123456789ab"
    assert gpu_uuid(raw.bytes) == gpu_uuid(raw) == gpu_uuid(str(raw)) == gpu_uuid(gpu_uuid(raw))
    assert gpu_uuid("MIG-1234") == "MIG-1234"


def test_each_process_maps_a_uuid_to_its_own_ordinal() -> None:
    source = StaticDevices([GPU_B])              # CUDA_VISIBLE_DEVICES=GPU-b
    target = StaticDevices([GPU_A, GPU_B])       # CUDA_VISIBLE_DEVICES=GPU-a,GPU-b
    assert uuid_of(source, 0) == GPU_B and uuid_of(source, 1) == ""
    assert ordinal_of(target, GPU_B) == 1 and ordinal_of(StaticDevices(), GPU_B) is None
    segs = [Segment("memfd", 0x1000, 4096, -1),
            Segment("vmm_fd", 0x200000, 2 << 20, 0, gpu=GPU_B),
            Segment("cuda_ipc", 0x800000, 1 << 20, 0, ipc=b"\0" * 64, gpu=GPU_B)]
    mine = local_segments(segs, target, "src")
    assert [s.device for s in mine] == [-1, 1, 1]
    assert [s.gpu for s in mine] == ["", GPU_B, GPU_B]
    assert [(s.kind, s.addr, s.size) for s in mine] == [(s.kind, s.addr, s.size) for s in segs]


def test_a_gpu_the_target_cannot_see_is_refused_naming_it() -> None:
    seg = Segment("vmm_fd", 0x200000, 2 << 20, 3, gpu=GPU_B)
    with pytest.raises(PeerError) as err:
        local_segments([seg], StaticDevices([GPU_A]), "local source s1")
    msg = str(err.value)
    assert GPU_B in msg and "its cuda:3" in msg and GPU_A in msg
    assert "not read over the local transport" in msg and "CUDA_VISIBLE_DEVICES=" in msg


def test_a_device_segment_without_a_uuid_is_refused() -> None:
    with pytest.raises(PeerError, match="names its GPU by ordinal only"):
        local_segments([Segment("cuda_ipc", 0, 64, 0, ipc=b"\0" * 64)],
                       StaticDevices([GPU_A]), "old source")


def test_segments_and_endpoints_carry_uuids_and_read_older_forms() -> None:
    seg = Segment("cuda_ipc", 0x1000, 64, 2, ipc=b"\1" * 64, gpu=GPU_A)
    item = seg.to_item(-1)
    assert item["gpu"] == GPU_A
    assert Segment.from_item(item) == (seg, -1)
    old = {k: v for k, v in item.items() if k != "gpu"}  # a source from before UUIDs
    assert Segment.from_item(old)[0].gpu == ""
    ep = LocalEndpoint("boot:x", "/tmp/mx-a.sock", "a", "t", gpus=(GPU_A,))
    assert ep.to_json()["gpus"] == [GPU_A]
    assert LocalEndpoint.from_json(ep.to_json()) == ep
    legacy = {k: v for k, v in ep.to_json().items() if k != "gpus"}
    assert LocalEndpoint.from_json(legacy).gpus == ()


def test_a_source_publishes_device_segments_under_its_gpus_uuid(tmp_path: pathlib.Path) -> None:
    src = LocalSource(str(tmp_path / "ipc"), host_id="boot:x",
                      inventory=StaticDevices([GPU_A, GPU_B]))
    try:
        seg = src._device_segment(CudaExport("cuda_ipc", 0x1000, 4096, 1, b"\0" * 64))
        assert seg.gpu == GPU_B and seg.device == 1
        src._add(_shared(seg))
        assert src.endpoint.gpus == (GPU_B,)
        with pytest.raises(ConfigError, match="no UUID"):
            src._device_segment(CudaExport("cuda_ipc", 0x1000, 4096, 5, b"\0" * 64))
    finally:
        src.close()


def _shared(seg: Segment):  # noqa: ANN202
    from modelexpress.local.server import _Shared
    return _Shared(seg)


class _ProtocolSource:
    """A source that speaks the wire protocol and offers one cuda_ipc segment."""

    def __init__(self, tmp: pathlib.Path, gpu: str) -> None:
        self.path = str(tmp / "mx-fake.sock")
        self.endpoint = LocalEndpoint("boot:x", self.path, "fake", "tok", gpus=(gpu,))
        self.gpu = gpu
        self.said: list[str] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind(self.path)
        self._sock.listen(1)
        self._sock.settimeout(30)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._sock.accept()
        with conn:
            conn.settimeout(30)
            hello, _ = protocol.recv(conn, "target")
            self.said.append(hello["op"])
            protocol.send(conn, {"op": "welcome", "v": protocol.VERSION, "segments": 1,
                                 "batches": 1})
            seg = Segment("cuda_ipc", 0x7F0000000000, 1 << 20, 0, ipc=b"\0" * 64, gpu=self.gpu)
            protocol.send(conn, {"op": "segments", "items": [seg.to_item(-1)]})
            msg, _ = protocol.recv(conn, "target")  # bye, or end-of-file (None)
            self.said.append(msg["op"] if msg else "eof")

    def close(self) -> None:
        self._thread.join(30)
        self._sock.close()


@pytest.fixture
def fake_source(tmp_path: pathlib.Path) -> Iterator[_ProtocolSource]:
    src = _ProtocolSource(tmp_path, GPU_B)
    yield src
    src.close()


def test_a_session_refuses_a_gpu_it_cannot_see_before_mapping_and_leaks_nothing(
        fake_source: _ProtocolSource) -> None:
    before = fd_count()
    with pytest.raises(PeerError) as err:
        LocalSession(fake_source.endpoint, inventory=StaticDevices([GPU_A]))
    assert GPU_B in str(err.value) and "not read over the local transport" in str(err.value)
    fake_source.close()  # closes its listening socket, one of ``before``
    assert fake_source.said == ["hello", "eof"]
    assert fd_count() == before - 1


def test_the_reader_falls_back_to_nixl_for_a_gpu_this_process_does_not_see(
        fake_source: _ProtocolSource) -> None:
    """Through the pull path's reader, with this process's real (empty: no CUDA here)
    device list: the read fails before any byte and says NIXL is worth trying."""
    import torch

    from modelexpress.local import LocalReader
    from modelexpress.transfer.manifest import Manifest, TensorEntry

    if CudaDevices().uuids():
        pytest.skip("this process sees a GPU; the case needs one it does not see")
    manifest = Manifest(agent_name="fake", host="h", digest_algorithm=None,
                        tensors=(TensorEntry("w", "uint8", (1 << 20,), 1 << 20,
                                             0x7F0000000000, "cuda:0"),))
    reader = LocalReader(fake_source.endpoint, manifest, chunk_bytes=1 << 20, verify=False)
    with pytest.raises(PeerError, match="which this process does not see"):
        reader.read_into({"w": torch.empty(1 << 20, dtype=torch.uint8)}, allow_partial=False,
                         progress=lambda done, total: None, stop=None, deadline_s=30)
    assert reader.nixl_may_retry()


def test_pull_takes_the_inventory_through_to_its_session(fake_source: _ProtocolSource) -> None:
    import torch

    from modelexpress.local import pull
    from modelexpress.transfer.manifest import Manifest, TensorEntry

    manifest = Manifest(agent_name="fake", host="h", digest_algorithm=None,
                        tensors=(TensorEntry("w", "uint8", (1 << 20,), 1 << 20,
                                             0x7F0000000000, "cuda:0"),))
    with pytest.raises(PeerError, match=f"on GPU {GPU_B}.*GPUs here: {GPU_A}"):
        pull(fake_source.endpoint, manifest, {"w": torch.empty(1 << 20, dtype=torch.uint8)},
             verify=False, inventory=StaticDevices([GPU_A]))


def test_a_source_names_the_gpus_of_its_tensors_by_uuid() -> None:
    """What serve_source publishes beside the manifest's cuda:N (the manifest attribute
    ``gpus`` and the source record's ``devices``); host tensors name none."""
    import types

    import torch

    from modelexpress.local.devices import gpus_of

    def on(kind: str, index: int | None = None) -> object:
        return types.SimpleNamespace(device=types.SimpleNamespace(type=kind, index=index))

    inv = StaticDevices([GPU_A, GPU_B])
    assert gpus_of([on("cuda", 1), on("cuda", 1), on("cpu")], inv) == {"cuda:1": GPU_B}
    assert gpus_of([on("cuda", None)], inv) == {"cuda:0": GPU_A}
    assert gpus_of([torch.zeros(2)], inv) == {}
