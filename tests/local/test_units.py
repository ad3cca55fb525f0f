"""Host identity, the endpoint's wire form, and the source's refusals and timeouts (in process)."""

from __future__ import annotations

import pathlib
import socket
import time

import pytest
import torch

from modelexpress.errors import ConfigError, PeerError
from modelexpress.local import (
    HostBuffer,
    LocalEndpoint,
    LocalSource,
    fd_count,
    host_buffer_like,
    host_id,
    pull,
    same_host,
)
from modelexpress.local.memory import group_segments
from modelexpress.local.protocol import Segment, socket_path
from modelexpress.transfer.manifest import build_manifest


def test_host_id_is_the_boot_id_unless_a_node_name_is_set(tmp_path: pathlib.Path):
    boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert host_id() == f"boot:{boot}"
    assert host_id("n1") == "node:n1" and same_host("node:n1", "n1")
    assert not same_host("node:n2", "n1") and not same_host(None)
    with pytest.raises(ConfigError, match="MX_NODE_NAME"):
        host_id(boot_id_path=tmp_path / "missing")


def test_endpoint_round_trips_and_hides_its_token():
    ep = LocalEndpoint("boot:x", "/tmp/mx-1.sock", "1", "secret-token")
    assert LocalEndpoint.from_json(ep.to_json()) == ep
    assert "secret-token" not in repr(ep)
    with pytest.raises(ConfigError):
        LocalEndpoint.from_json({"transport": "nixl", "v": 1})
    with pytest.raises(ConfigError, match="shorter"):
        socket_path("/" + "d" * 120, "abc")


def test_segments_group_by_kind_and_device_and_split_on_large_gaps():
    segs = [Segment("vmm_fd", 0x1000, 0x1000, 0), Segment("vmm_fd", 0x3000, 0x1000, 0),
            Segment("vmm_fd", 0x2000, 0x1000, 1), Segment("cuda_ipc", 0x9000, 0x10, 0, b"x" * 64),
            Segment("cuda_ipc", 0x9010, 0x10, 0, b"y" * 64), Segment("memfd", 1 << 50, 4096, -1)]
    groups = sorted(sorted(g) for g in group_segments(segs))
    assert groups == [[0, 1], [2], [3], [4], [5]]
    assert [sorted(g) for g in group_segments(segs[:2], max_gap=0x100)] == [[0], [1]]
    with pytest.raises(PeerError, match="overlap"):
        group_segments([Segment("memfd", 0, 8192, -1), Segment("memfd", 4096, 8192, -1)])


@pytest.fixture
def served(tmp_path):  # type: ignore[no-untyped-def]
    tensors = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(77, dtype=torch.uint8)}
    buf, shared = host_buffer_like(tensors)
    src = LocalSource(str(tmp_path / "ipc"), host_id=host_id(), max_peers=1,
                      handshake_timeout_s=0.5)
    src.add_host_buffer(buf)
    src.add_tensors(shared)
    manifest = build_manifest(shared)
    src.start()
    yield src, manifest, tensors
    src.close()
    del shared
    buf.close()


def test_a_silent_peer_is_dropped_after_the_handshake_timeout(served):
    src, manifest, tensors = served
    fds = fd_count()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(src.path)
    # The failure is counted before the peer's slot is freed (two steps of the
    # peer's thread): wait for both.
    deadline = time.monotonic() + 10
    while ((src.counters["failed"] == 0 or src.active_peers)
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert src.counters["failed"] == 1 and src.active_peers == 0
    s.settimeout(5)
    assert s.recv(100) == b""  # the source closed its side
    s.close()
    assert fd_count() == fds


def test_a_peer_beyond_max_peers_is_refused_as_busy_and_the_first_still_works(served):
    src, manifest, tensors = served
    hold = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    hold.connect(src.path)  # occupies the only slot until the handshake timeout
    deadline = time.monotonic() + 5
    while src.active_peers == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(PeerError, match="busy"):
        pull(src.endpoint, manifest, {k: torch.empty_like(v) for k, v in tensors.items()})
    hold.close()
    deadline = time.monotonic() + 5
    while src.active_peers and time.monotonic() < deadline:
        time.sleep(0.05)
    dst = {k: torch.empty_like(v) for k, v in tensors.items()}
    pull(src.endpoint, manifest, dst)
    assert all(torch.equal(dst[k], tensors[k]) for k in tensors)


def test_a_hello_holds_its_connection_for_one_session_and_keeps_a_failure_for_take(served,
                                                                                  tmp_path):
    """``Hello`` connects and says hello at once; the session made with it reads the
    answer later, and takes the connection (a second session with it is refused, not
    a second connection). A failed connect is raised by ``take``, not by ``Hello``, and
    closing an untaken hello frees its slot on the source."""
    from modelexpress.local import LocalSession
    from modelexpress.local.client import Hello
    src, manifest, tensors = served
    fds = fd_count()  # the source's too: it runs in this process
    hello = Hello(src.endpoint, timeout_s=5)
    with LocalSession(src.endpoint, hello=hello) as session:
        assert session.alive() and session.host_map is not None
        with pytest.raises(ValueError, match="taken"):
            LocalSession(src.endpoint, hello=hello)
    hello.close()  # taken: nothing left to close
    deadline = time.monotonic() + 5  # the session's slot is free once the source read its bye
    while src.active_peers and time.monotonic() < deadline:
        time.sleep(0.01)
    untaken = Hello(src.endpoint, timeout_s=5)
    deadline = time.monotonic() + 5
    while src.active_peers == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert src.active_peers == 1  # max_peers=1: this hello holds the only slot
    untaken.close()
    untaken.close()  # idempotent
    deadline = time.monotonic() + 5
    while src.active_peers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert src.active_peers == 0
    gone = LocalEndpoint.from_json({**src.endpoint.to_json(), "path": str(tmp_path / "no.sock")})
    failed = Hello(gone, timeout_s=5)  # no raise here
    with pytest.raises(PeerError, match="not listening"):
        failed.take()
    with pytest.raises(PeerError, match="not listening"):
        LocalSession(gone, hello=failed)
    dst = {k: torch.empty_like(v) for k, v in tensors.items()}
    pull(src.endpoint, manifest, dst)
    assert all(torch.equal(dst[k], tensors[k]) for k in tensors)
    deadline = time.monotonic() + 5  # the source closes its side once it read the bye
    while (src.active_peers or fd_count() != fds) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fd_count() == fds


def test_peer_threads_serve_one_peer_after_another_and_close_with_the_source(tmp_path):
    """A source keeps the thread that served a peer for the next one (a connection does
    not wait for a thread to start); concurrent peers get a thread each; close ends them."""
    import threading
    tensors = {"a": torch.arange(1000, dtype=torch.float32)}
    buf, shared = host_buffer_like(tensors)
    src = LocalSource(str(tmp_path / "ipc"), host_id=host_id())
    src.add_host_buffer(buf)
    src.add_tensors(shared)
    manifest = build_manifest(shared)
    src.start()
    name = f"mx-local-peer-{src.source_id}"

    def peer_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == name]
    try:
        assert len(peer_threads()) == 1  # started with the source, before any peer
        for _ in range(4):
            dst = {"a": torch.empty(1000)}
            pull(src.endpoint, manifest, dst)
            assert torch.equal(dst["a"], tensors["a"])
            deadline = time.monotonic() + 10  # the thread is free once the peer said bye
            while src.active_peers and time.monotonic() < deadline:
                time.sleep(0.01)
        assert len(peer_threads()) == 1 and src.counters["served"] == 4
        from modelexpress.local import LocalSession
        held = [LocalSession(src.endpoint) for _ in range(3)]  # three at once
        assert len(peer_threads()) == 3 and src.active_peers == 3
        for h in held:
            h.close()
        deadline = time.monotonic() + 10
        while src.active_peers and time.monotonic() < deadline:
            time.sleep(0.01)
        pull(src.endpoint, manifest, {"a": torch.empty(1000)})  # served by a kept thread
        deadline = time.monotonic() + 10  # counted just after the segments are sent
        while src.counters["served"] < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(peer_threads()) == 3 and src.counters["served"] == 8
    finally:
        src.close()
        del shared
        buf.close()
    deadline = time.monotonic() + 10
    while peer_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert peer_threads() == []


def test_cpu_tensors_outside_shared_memory_are_refused(tmp_path):
    src = LocalSource(str(tmp_path / "ipc"), host_id=host_id())
    with pytest.raises(ConfigError, match="HostBuffer"):
        src.add_tensors({"x": torch.zeros(10)})
    src.close()
    buf = HostBuffer(4096)
    view = buf.tensor(0, (4,), torch.int32)
    buf.close()  # a live view keeps the pages mapped
    view.fill_(7)
    assert view.tolist() == [7, 7, 7, 7]


def test_doctor_reports_the_c_copy_loop_built_and_hashing(monkeypatch):
    """CI builds the C extension (the package's own setup): doctor says the host copier
    runs its C loop, with xxh3 digests through the xxhash package's own functions, each
    block fed in order; where the package exports no streaming XXH3 it says the blocks
    are hashed whole (the slower way on many cores)."""
    from modelexpress.local import hostcopy
    from modelexpress.local.diagnostics import doctor_checks
    [check] = doctor_checks()
    result = check.run()
    assert hostcopy.NATIVE and result.status == "ok", result
    assert "without the GIL" in result.detail and "in order" in result.detail, result
    monkeypatch.setattr(hostcopy, "_xxh3_stream_functions", lambda: None)
    result = check.run()
    assert result.status == "ok" and "no streaming XXH3" in result.detail, result
