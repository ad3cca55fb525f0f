"""Transfer outcomes: a worker's finish carries how the transfer went; the record keeps it
and the server's /metrics exports it (real uvicorn, SQLite and Redis)."""

from __future__ import annotations

import pathlib
import re
import time
import uuid

import pytest

from conftest import make_identity, manifest
from modelexpress.client import MxClient, TransferOutcome
from modelexpress.server.service import source_id_for
from modelexpress.server.store import open_store
from mx_server_procs import TOKEN, RedisProc, ServerProc


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the exposition text, 0.0 when absent."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.partition("}")[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _running_transfer(client: MxClient, model: str) -> str:
    ident = make_identity(model)
    client.publish_source(ident, _uid("src"), manifest=manifest())
    t = client.start_transfer(ident, _uid("tgt"), run_by_target=True)
    client.report_progress(t.id, 100, 1000)
    return t.id


def test_finish_with_outcome_is_stored_returned_and_exported(client: MxClient) -> None:
    transport = f"t{uuid.uuid4().hex[:6]}"  # a label no other test uses
    before = client.metrics_text()
    tid = _running_transfer(client, _uid("outcome"))
    assert client.get_transfer(tid).outcome is None

    done = client.finish_transfer(tid, "SUCCEEDED", bytes_done=1000, outcome={
        "transport": transport, "rate_bps": 2.5e9, "verdict": "ok",
        "data_plane_s": 0.4, "total_s": 1.3})
    want = TransferOutcome(transport=transport, rate_bps=2.5e9, verdict="ok",
                           data_plane_s=0.4, total_s=1.3)
    assert done.outcome == want
    assert client.get_transfer(tid).outcome == want
    assert [t.outcome for t in client.list_transfers() if t.id == tid] == [want]

    # A retried finish (its reply lost) is a no-op and is not counted twice.
    again = client.finish_transfer(tid, "SUCCEEDED", outcome={"transport": "tcp"})
    assert again.outcome == want

    text = client.metrics_text()
    assert _sample(text, "mx_transfers_finished_total", state="SUCCEEDED",
                   transport=transport) == 1
    assert _sample(text, "mx_transfer_bytes_total", transport=transport) == 1000
    assert _sample(text, "mx_transfer_verdicts_total", transport=transport,
                   verdict="ok") == 1
    assert _sample(text, "mx_transfer_data_plane_seconds_count", transport=transport) == 1
    assert _sample(text, "mx_transfer_data_plane_seconds_sum", transport=transport) == 0.4
    assert _sample(text, "mx_transfer_total_seconds_bucket", transport=transport,
                   le="2.5") == 1
    assert _sample(text, "mx_transfer_total_seconds_bucket", transport=transport,
                   le="1.0") == 0
    assert _sample(before, "mx_transfers_finished_total", transport=transport) == 0


def test_a_succeeded_finish_sets_the_totals_and_rate_a_last_report_would_have(
        client: MxClient) -> None:
    """API version 6: a pull sends no last progress report; its finish says it."""
    ok = _running_transfer(client, _uid("folded"))  # reported 100 of 1000
    record = client.finish_transfer(ok, "SUCCEEDED", bytes_done=4096,
                                    outcome={"transport": "cma", "rate_bps": 3e9})
    assert (record.bytes_done, record.bytes_total, record.rate_bps) == (4096, 4096, 3e9)
    assert client.get_transfer(ok).bytes_total == 4096
    # a failure keeps what the last report said: its total was not reached
    failed = _running_transfer(client, _uid("failed"))
    client.report_progress(failed, 300, 1000, rate_bps=1e8)
    record = client.finish_transfer(failed, "FAILED", error="boom", bytes_done=300,
                                    outcome={"transport": "cma", "rate_bps": 9e9})
    assert (record.bytes_done, record.bytes_total, record.rate_bps) == (300, 1000, 1e8)
    # a finish without a byte count changes neither
    bare = _running_transfer(client, _uid("bare-ok"))
    record = client.finish_transfer(bare, "SUCCEEDED")
    assert (record.bytes_done, record.bytes_total) == (100, 1000)


def test_a_succeeded_finish_names_the_source_read_last_and_passes_over_one_gone(
        client: MxClient) -> None:
    model = _uid("moved")
    tid = _running_transfer(client, model)
    other = client.publish_source(make_identity(model), _uid("src2"), manifest=manifest())
    record = client.finish_transfer(tid, "SUCCEEDED", bytes_done=1000, source_id=other.id)
    assert (record.source_id, record.source_worker) == (other.id, other.worker_id)
    gone = _running_transfer(client, _uid("gone"))
    named = client.get_transfer(gone).source_id
    record = client.finish_transfer(gone, "SUCCEEDED", bytes_done=1000,
                                    source_id="no-such-source:w")
    assert record.state == "SUCCEEDED" and record.source_id == named


def test_a_slow_failed_transfer_counts_its_verdict_and_a_bare_finish_counts_unknown(
        client: MxClient) -> None:
    before = client.metrics_text()
    slow = _running_transfer(client, _uid("slow"))
    client.finish_transfer(slow, "FAILED", error="refused: slow transport", outcome=TransferOutcome(
        transport="tcp", rate_bps=4e8, verdict="slow", data_plane_s=2.0))
    bare = _running_transfer(client, _uid("bare"))
    assert client.finish_transfer(bare, "FAILED", error="boom").outcome is None
    text = client.metrics_text()

    def delta(name: str, **labels: str) -> float:
        return _sample(text, name, **labels) - _sample(before, name, **labels)

    assert delta("mx_transfers_finished_total", state="FAILED", transport="tcp") == 1
    assert delta("mx_transfer_verdicts_total", transport="tcp", verdict="slow") == 1
    assert delta("mx_transfers_finished_total", state="FAILED", transport="unknown") == 1
    assert delta("mx_transfer_verdicts_total", transport="unknown", verdict="unknown") == 1
    # No total_s reported: the end-to-end histogram has nothing for it.
    assert delta("mx_transfer_total_seconds_count", transport="tcp") == 0
    assert delta("mx_transfer_data_plane_seconds_count", transport="tcp") == 1


def test_a_restart_clears_the_outcome(client: MxClient) -> None:
    ident = make_identity(_uid("restart"))
    client.publish_source(ident, _uid("src"), manifest=manifest())
    client.register_agent("outcome-agent")
    t = client.start_transfer(ident, "outcome-agent")
    client.report_progress(t.id, 1, 2)
    client.finish_transfer(t.id, "FAILED", error="x", outcome={"transport": "cma",
                                                              "verdict": "ok"})
    assert client.restart_transfer(t.id).outcome is None


@pytest.mark.parametrize("bad", [
    {"transport": "tcp/eth0"},            # a transport name, not a device
    {"transport": "tcp;rm"},
    {"transport": "x" * 40},
    {"transport": ""},
    {"rate_bps": -1.0},
    {"verdict": "fast"},
    {"data_plane_s": -0.1},
    {"total_s": 1e9},
    {"speed": 1.0},                       # unknown key
])
def test_bad_outcomes_are_refused_by_the_server_and_left_out_by_the_client(
        client: MxClient, server: ServerProc, bad: dict, caplog: pytest.LogCaptureFixture) -> None:
    tid = _running_transfer(client, _uid("bad"))
    # The server refuses it (a client that skips our validation): nothing changes.
    import httpx
    resp = httpx.post(f"{server.url}/v1/transfers/{tid}/finish",
                      headers={"Authorization": f"Bearer {TOKEN}"},
                      json={"state": "SUCCEEDED", "outcome": {"transport": "tcp", **bad}},
                      timeout=30.0)
    assert resp.status_code == 422, resp.text
    assert "outcome" in resp.json()["detail"]
    assert client.get_transfer(tid).state == "RUNNING"
    # Our client finishes the transfer anyway, without the outcome, and says why.
    with caplog.at_level("WARNING", logger="modelexpress.client"):
        done = client.finish_transfer(tid, "SUCCEEDED", outcome=bad)
    assert (done.state, done.outcome) == ("SUCCEEDED", None)
    assert any("finishing without its outcome: outcome" in r.getMessage()
               for r in caplog.records)


def test_transport_labels_are_bounded(client: MxClient) -> None:
    from modelexpress.server.metrics import MAX_TRANSPORT_LABELS
    for _ in range(MAX_TRANSPORT_LABELS + 3):
        tid = _running_transfer(client, _uid("labels"))
        client.finish_transfer(tid, "SUCCEEDED", outcome={"transport": f"x{uuid.uuid4().hex[:8]}"})
    text = client.metrics_text()
    labels = set(re.findall(r'mx_transfers_finished_total\{[^}]*transport="([^"]*)"', text))
    assert len(labels) <= MAX_TRANSPORT_LABELS + 1
    assert "other" in labels


def _old_row(ident_model: str, store_url: str) -> str:
    """Write a RUNNING transfer the way a server before outcomes did (no "outcome" key)."""
    ident = make_identity(ident_model)
    now = time.time()
    sid = source_id_for(ident.id, "old-src")
    tid = uuid.uuid4().hex
    store = open_store(store_url)
    try:
        store.put("transfers", {
            "id": tid, "identity_id": ident.id, "target_worker": "old-tgt", "source_id": sid,
            "source_worker": "old-src", "source_endpoint": "", "state": "RUNNING",
            "bytes_done": 5, "bytes_total": 10, "rate_bps": 0.0, "error": None,
            "stop_requested": False, "claimed": True, "restarts": 0, "created_at": now,
            "updated_at": now, "started_at": now, "finished_at": None})
    finally:
        store.close()
    return tid


def _old_rows_read_and_finish(url: str) -> None:
    with MxClient(url, token=TOKEN, timeout_s=30.0) as c:
        old = [t for t in c.list_transfers(target_worker="old-tgt")]
        assert len(old) == 1 and old[0].outcome is None and old[0].candidates == ()
        done = c.finish_transfer(old[0].id, "SUCCEEDED", outcome={"transport": "tcp"})
        assert done.outcome == TransferOutcome(transport="tcp")


def test_rows_written_without_outcome_still_read_sqlite(tmp_path: pathlib.Path) -> None:
    url = f"sqlite:///{tmp_path}/old.db"
    _old_row(_uid("old"), url)
    srv = ServerProc(url, tmp_path).start()
    try:
        _old_rows_read_and_finish(srv.url)
    finally:
        srv.stop()


@pytest.mark.redis
def test_rows_written_without_outcome_still_read_redis(redis_proc: RedisProc,
                                                       tmp_path: pathlib.Path) -> None:
    _old_row(_uid("old"), redis_proc.url)
    srv = ServerProc(redis_proc.url, tmp_path).start()
    try:
        _old_rows_read_and_finish(srv.url)
    finally:
        srv.stop()
