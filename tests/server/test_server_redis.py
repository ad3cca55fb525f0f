"""Two server replicas on one real Redis: races between them resolve to exactly one winner."""

from __future__ import annotations

import pathlib
import threading
from typing import Callable, Iterator

import pytest

from conftest import make_identity, manifest
from modelexpress.client import MxClient, TransferInfo
from modelexpress.errors import ConflictError, ServerUnavailableError
from mx_server_procs import TOKEN, RedisProc, ServerProc

pytestmark = pytest.mark.redis

_RACES = 25


@pytest.fixture()
def replicas(redis_proc: RedisProc, tmp_path: pathlib.Path) -> Iterator[tuple[str, str]]:
    a = ServerProc(redis_proc.url, tmp_path).start()
    try:
        b = ServerProc(redis_proc.url, tmp_path).start()
    except BaseException:
        a.stop()
        raise
    yield a.url, b.url
    a.stop()
    b.stop()


def _race(*calls: Callable[[], object]) -> list[object]:
    """Run the calls at the same moment; return each result or the exception it raised."""
    barrier = threading.Barrier(len(calls))
    results: list[object] = [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait(timeout=60)
        try:
            results[i] = calls[i]()
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return results


def test_stop_vs_finish_from_two_replicas_exactly_one_wins(replicas: tuple[str, str]) -> None:
    url_a, url_b = replicas
    ident = make_identity("redis/model")
    with MxClient(url_a, token=TOKEN, timeout_s=30.0) as a, \
            MxClient(url_b, token=TOKEN, timeout_s=30.0) as b:
        a.publish_source(ident, "src", manifest=manifest())
        b.register_agent("agent")
        wins = {"stop": 0, "finish": 0}
        for i in range(_RACES):
            t = a.start_transfer(ident, "agent")
            assert [x.id for x in b.poll_assignments("agent", wait_s=10)] == [t.id]
            b.report_progress(t.id, 50, 100)
            stop_r, finish_r = _race(lambda: a.stop_transfer(t.id),
                                     lambda: b.finish_transfer(t.id, "SUCCEEDED"))
            ok = [r for r in (stop_r, finish_r) if isinstance(r, TransferInfo)]
            lost = [r for r in (stop_r, finish_r) if isinstance(r, ConflictError)]
            assert len(ok) == 1 and len(lost) == 1, (i, stop_r, finish_r)
            final_a, final_b = a.get_transfer(t.id), b.get_transfer(t.id)
            assert final_a == final_b
            if isinstance(stop_r, TransferInfo):
                wins["stop"] += 1
                assert final_a.state == "STOPPING" and final_a.stop_requested
                assert b.finish_transfer(t.id, "STOPPED").state == "STOPPED"
            else:
                wins["finish"] += 1
                assert final_a.state == "SUCCEEDED" and not final_a.stop_requested
        assert sum(wins.values()) == _RACES


def test_two_replicas_never_hand_one_assignment_out_twice(replicas: tuple[str, str]) -> None:
    url_a, url_b = replicas
    ident = make_identity("redis/claims")
    with MxClient(url_a, token=TOKEN, timeout_s=30.0) as a, \
            MxClient(url_b, token=TOKEN, timeout_s=30.0) as b:
        a.publish_source(ident, "src", manifest=manifest())
        a.register_agent("agent")
        created = {a.start_transfer(ident, "agent").id for _ in range(30)}
        got_a, got_b = _race(lambda: a.poll_assignments("agent", wait_s=0),
                             lambda: b.poll_assignments("agent", wait_s=0))
        ids_a = {t.id for t in got_a}  # type: ignore[union-attr]
        ids_b = {t.id for t in got_b}  # type: ignore[union-attr]
        assert not ids_a & ids_b
        rest = {t.id for t in a.poll_assignments("agent", wait_s=0)}
        assert ids_a | ids_b | rest == created

        # A transfer started on replica A wakes a long poll held by replica B
        # (through its periodic re-read: events do not cross processes).
        holder: list = []
        poll = threading.Thread(target=lambda: holder.extend(
            b.poll_assignments("agent", wait_s=20)))
        poll.start()
        t = a.start_transfer(ident, "agent")
        poll.join(timeout=60)
        assert [x.id for x in holder] == [t.id]


def test_store_outage_is_503_not_500(redis_proc: RedisProc, tmp_path: pathlib.Path) -> None:
    srv = ServerProc(redis_proc.url, tmp_path).start()
    try:
        with MxClient(srv.url, token=TOKEN, timeout_s=30.0, retries=1) as c:
            src = c.publish_source(make_identity("redis/outage"), "w", manifest=manifest())
            redis_proc.stop()
            with pytest.raises(ServerUnavailableError, match="503"):
                c.heartbeat(src.id)
            with pytest.raises(ServerUnavailableError, match="503"):
                c.health()
            with pytest.raises(ServerUnavailableError, match="store unavailable"):
                c.list_transfers()
        assert "Traceback" not in srv.log()
    finally:
        srv.stop()
