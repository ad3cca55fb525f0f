"""The REST API end to end: real uvicorn on 127.0.0.1 (SQLite store), driven through MxClient."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from conftest import make_identity, manifest
from modelexpress.client import MxClient
from modelexpress.errors import (
    AuthError, ConflictError, NotFoundError, ServerUnavailableError, ValidationError,
)
from mx_server_procs import ServerProc, free_port


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_health_needs_no_token_but_everything_else_does(server: ServerProc) -> None:
    with MxClient(server.url, timeout_s=30.0) as anon:
        assert anon.health()["status"] == "ok"
        with pytest.raises(AuthError, match="401"):
            anon.list_sources()
        with pytest.raises(AuthError):
            anon.metrics_text()
    with MxClient(server.url, token="wrong", timeout_s=30.0) as bad:
        with pytest.raises(AuthError):
            bad.list_transfers()
    assert httpx.get(f"{server.url}/openapi.json").status_code == 401
    assert httpx.get(f"{server.url}/openapi.json",
                     headers={"Authorization": f"Bearer {server.token}"}).status_code == 200


def test_publish_get_and_list_filters(client: MxClient) -> None:
    model = _uid("model")
    ids = [make_identity(model, rank=r, tp_size=2) for r in (0, 1)]
    other_rev = make_identity(model, revision="v2")
    meta = bytes(range(256)) * 4
    published = [client.publish_source(ids[0], _uid("w"), manifest=manifest(), agent_metadata=meta,
                                       endpoint="10.0.0.1:5555"),
                 client.publish_source(ids[1], _uid("w"), manifest=manifest(),
                                       state="INITIALIZING"),
                 client.publish_source(other_rev, _uid("w"), manifest=manifest(5))]
    got = client.get_source(published[0].id)
    assert got.agent_metadata == meta
    assert got.manifest == manifest()
    assert got.model_identity == ids[0]
    assert got.state == "READY" and got.endpoint == "10.0.0.1:5555"

    assert {s.id for s in client.list_sources(model=model)} == {p.id for p in published}
    assert [s.id for s in client.list_sources(model=model, rank=1)] == [published[1].id]
    assert [s.id for s in client.list_sources(model=model, revision="v2")] == [published[2].id]
    assert {s.id for s in client.list_sources(model=model, state="READY")} == {
        published[0].id, published[2].id}
    assert [s.id for s in client.list_sources(identity=ids[1])] == [published[1].id]
    assert [s.id for s in client.list_sources(worker_id=published[2].worker_id)] == [
        published[2].id]
    assert all(s.manifest is None for s in client.list_sources(model=model))


def test_heartbeat_moves_and_illegal_moves(client: MxClient) -> None:
    src = client.publish_source(make_identity(_uid("m")), _uid("w"), manifest=manifest(),
                                state="INITIALIZING")
    beat = client.heartbeat(src.id)
    assert beat.state == "INITIALIZING" and beat.last_heartbeat >= src.last_heartbeat
    assert client.heartbeat(src.id, "READY").state == "READY"
    with pytest.raises(ConflictError, match="READY -> INITIALIZING"):
        client.heartbeat(src.id, "INITIALIZING")
    assert client.mark_stale(src.id).state == "STALE"
    assert client.heartbeat(src.id).state == "READY"  # a heartbeat revives a STALE source
    with pytest.raises(NotFoundError):
        client.heartbeat(f"{'0' * 32}:nobody")
    client.delete_source(src.id)
    with pytest.raises(NotFoundError):
        client.get_source(src.id)
    with pytest.raises(NotFoundError):
        client.delete_source(src.id)


def test_transfer_lifecycle_with_agent_stop_and_restart(client: MxClient) -> None:
    ident = make_identity(_uid("m"))
    src = client.publish_source(ident, _uid("src"), manifest=manifest(), endpoint="h:1")
    agent = _uid("agent")
    client.register_agent(agent, endpoint="h:2", labels={"zone": "a"})
    assert agent in {a.id for a in client.list_agents()}

    t = client.start_transfer(ident, agent)
    assert (t.state, t.source_id, t.source_endpoint) == ("PENDING", src.id, "h:1")
    [claimed] = client.poll_assignments(agent, wait_s=5)
    assert claimed.id == t.id and claimed.claimed
    assert client.poll_assignments(agent, wait_s=0) == []  # claimed once only

    reply = client.report_progress(t.id, 100, 1000, rate_bps=1e9)
    assert not reply.stop and reply.transfer.state == "RUNNING"
    assert client.get_transfer(t.id).bytes_done == 100
    with pytest.raises(ConflictError, match="RUNNING -> STOPPED"):
        client.finish_transfer(t.id, "STOPPED")

    assert client.stop_transfer(t.id).state == "STOPPING"
    assert client.stop_transfer(t.id).state == "STOPPING"  # idempotent
    reply = client.report_progress(t.id, 200, 1000)
    assert reply.stop and reply.transfer.state == "STOPPING"
    with pytest.raises(ConflictError, match="STOPPING -> SUCCEEDED"):
        client.finish_transfer(t.id, "SUCCEEDED")
    assert client.finish_transfer(t.id, "STOPPED").state == "STOPPED"
    with pytest.raises(ConflictError):
        client.report_progress(t.id, 300, 1000)

    again = client.restart_transfer(t.id)
    assert (again.id, again.state, again.bytes_done, again.restarts) == (t.id, "PENDING", 0, 1)
    [claimed] = client.poll_assignments(agent, wait_s=5)
    assert claimed.id == t.id
    client.report_progress(t.id, 1000, 1000)
    done = client.finish_transfer(t.id, "SUCCEEDED")
    assert done.state == "SUCCEEDED" and done.finished_at is not None
    assert client.finish_transfer(t.id, "SUCCEEDED").state == "SUCCEEDED"  # retry-safe
    with pytest.raises(ConflictError, match="none"):
        client.stop_transfer(t.id)
    with pytest.raises(ConflictError):
        client.restart_transfer(t.id)
    assert [x.id for x in client.list_transfers(target_worker=agent, state="SUCCEEDED")] == [t.id]


def test_failed_transfer_keeps_its_error_and_can_restart(client: MxClient) -> None:
    ident = make_identity(_uid("m"))
    client.publish_source(ident, _uid("src"), manifest=manifest())
    t = client.start_transfer(ident, _uid("agent"))
    failed = client.finish_transfer(t.id, "FAILED", error="digest mismatch in layer.0")
    assert failed.state == "FAILED" and failed.error == "digest mismatch in layer.0"
    assert client.restart_transfer(t.id).state == "PENDING"


def test_stop_of_unclaimed_pending_transfer_is_immediate(client: MxClient) -> None:
    ident = make_identity(_uid("m"))
    client.publish_source(ident, _uid("src"), manifest=manifest())
    t = client.start_transfer(ident, _uid("agent"))
    assert client.stop_transfer(t.id).state == "STOPPED"


def test_source_selection_and_its_errors(client: MxClient) -> None:
    ident = make_identity(_uid("m"))
    with pytest.raises(ConflictError, match="no READY source"):
        client.start_transfer(ident, "agent-x")
    a = client.publish_source(ident, _uid("a"), manifest=manifest())
    b = client.publish_source(ident, _uid("b"), manifest=manifest())
    client.publish_source(ident, "agent-x", manifest=manifest())  # the target itself
    spread = {client.start_transfer(ident, "agent-x", policy="spread").source_id
              for _ in range(2)}
    assert spread == {a.id, b.id}  # least busy first: one each
    with pytest.raises(NotFoundError):
        client.start_transfer(ident, "agent-x", source_id=f"{ident.id}:ghost")
    other = client.publish_source(make_identity(_uid("m")), _uid("c"), manifest=manifest())
    with pytest.raises(ConflictError, match="serves identity"):
        client.start_transfer(ident, "agent-x", source_id=other.id)
    client.mark_stale(a.id)
    with pytest.raises(ConflictError, match="STALE"):
        client.start_transfer(ident, "agent-x", source_id=a.id)
    assert client.start_transfer(ident, "agent-x", policy="random").source_id == b.id


def test_long_poll_waits_and_wakes(client: MxClient, server: ServerProc) -> None:
    ident = make_identity(_uid("m"))
    client.publish_source(ident, _uid("src"), manifest=manifest())
    agent = _uid("agent")
    with pytest.raises(NotFoundError, match="register"):
        client.poll_assignments(agent, wait_s=0)
    client.register_agent(agent)
    start = time.monotonic()
    assert client.poll_assignments(agent, wait_s=1.0) == []
    assert time.monotonic() - start >= 0.9

    result: list = []
    with MxClient(server.url, token=server.token, timeout_s=30.0) as other:
        poller = threading.Thread(target=lambda: result.extend(
            other.poll_assignments(agent, wait_s=30.0)))
        poller.start()
        time.sleep(0.5)
        t = client.start_transfer(ident, agent)
        poller.join(timeout=60)
    assert not poller.is_alive()
    assert [x.id for x in result] == [t.id]

    # A restarted agent re-registers and gets back what it claimed but never started.
    t2 = client.start_transfer(ident, agent)
    assert [x.id for x in client.poll_assignments(agent, wait_s=5)] == [t2.id]
    client.report_progress(t.id, 1, 10)  # t started: it stays with the old process
    client.register_agent(agent)
    assert [x.id for x in client.poll_assignments(agent, wait_s=5)] == [t2.id]


def test_bad_input_is_4xx_and_changes_nothing(client: MxClient, server: ServerProc) -> None:
    ident = make_identity(_uid("m"))
    src = client.publish_source(ident, _uid("w"), manifest=manifest(), agent_metadata=b"meta")
    hdr = {"Authorization": f"Bearer {server.token}"}
    good = {"identity": ident.to_dict(), "worker_id": src.worker_id, "manifest": {"x": 1}}
    cases = [
        ("PUT", "/v1/sources", {**good, "surprise": 1}, 422),           # unknown field
        ("PUT", "/v1/sources", {**good, "manifest": [1, 2]}, 422),      # not an object
        ("PUT", "/v1/sources", {**good, "worker_id": "a/b"}, 422),      # bad id
        ("PUT", "/v1/sources", {**good, "agent_metadata": "!!"}, 422),  # not base64
        ("PUT", "/v1/sources", {**good, "identity": {**ident.to_dict(), "rank": 3}}, 422),
        ("PUT", "/v1/sources", {**good, "manifest": {"blob": "x" * 70000}}, 413),
        ("PUT", "/v1/sources", {**good, "state": "STALE"}, 422),
        ("POST", f"/v1/sources/{src.id}/heartbeat", {"state": "ZOMBIE"}, 422),
        ("POST", "/v1/transfers", {"identity_id": "nothex", "target_worker": "a"}, 422),
        ("POST", "/v1/transfers/abc/progress", {"bytes_done": "many", "bytes_total": 1}, 422),
        ("POST", "/v1/transfers/abc/progress", {"bytes_done": 5, "bytes_total": 1}, 422),
        ("POST", "/v1/transfers/abc/progress", {"bytes_done": 0, "bytes_total": 1}, 404),
        ("POST", "/v1/transfers/abc/finish", {"state": "PENDING"}, 422),
        ("GET", "/v1/agents/x/assignments?wait=-1", None, 422),
        ("GET", "/v1/sources?rank=minus", None, 422),
    ]
    for method, path, body, status in cases:
        resp = httpx.request(method, server.url + path, json=body, headers=hdr, timeout=30)
        assert resp.status_code == status, (method, path, resp.text)
        assert resp.json()["detail"], (method, path)
    raw = httpx.put(server.url + "/v1/sources", content=b"{not json", headers={
        **hdr, "Content-Type": "application/json"}, timeout=30)
    assert raw.status_code == 422
    huge = httpx.put(server.url + "/v1/sources", content=b"x" * (40 << 20), headers=hdr,
                     timeout=60)
    assert huge.status_code == 413
    with pytest.raises(ValidationError, match="413"):
        client.publish_source(ident, src.worker_id, manifest={"blob": "y" * 70000})
    after = client.get_source(src.id)
    assert after.manifest == manifest() and after.agent_metadata == b"meta"


def test_metrics_and_openapi(client: MxClient, server: ServerProc) -> None:
    client.publish_source(make_identity(_uid("m")), _uid("w"), manifest=manifest())
    text = client.metrics_text()
    ready = [line for line in text.splitlines() if line.startswith('mx_sources{state="READY"}')]
    assert ready and float(ready[0].split()[-1]) >= 1
    assert 'mx_transfers{state="PENDING"}' in text
    assert 'mx_http_request_seconds_bucket{' in text and 'route="/v1/sources"' in text
    spec = httpx.get(f"{server.url}/openapi.json",
                     headers={"Authorization": f"Bearer {server.token}"}).json()
    assert {"/v1/sources", "/v1/transfers/{transfer_id}/stop",
            "/v1/agents/{agent_id}/assignments"} <= set(spec["paths"])


def test_client_maps_connection_errors_after_retries() -> None:
    with MxClient(f"http://127.0.0.1:{free_port()}", timeout_s=2.0, retries=2) as dead:
        start = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="3 attempt"):
            dead.health()
        assert time.monotonic() - start < 30
