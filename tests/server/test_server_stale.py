"""Staleness and garbage collection on a real server with short timeouts."""

from __future__ import annotations

import pathlib
import time
from typing import Callable, Iterator

import pytest

from conftest import make_identity, manifest
from modelexpress.client import MxClient
from modelexpress.errors import NotFoundError
from mx_server_procs import TOKEN, ServerProc

_DEADLINE_S = 30.0


def _until(what: str, cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + _DEADLINE_S
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"still waiting for {what} after {_DEADLINE_S} s")
        time.sleep(0.1)


@pytest.fixture()
def fast_client(tmp_path: pathlib.Path) -> Iterator[MxClient]:
    srv = ServerProc(f"sqlite:///{tmp_path}/mx.db", tmp_path,
                     env={"MX_STALE_AFTER_S": "1.0", "MX_GC_AFTER_S": "2.0"}).start()
    with MxClient(srv.url, token=TOKEN, timeout_s=30.0) as c:
        yield c
    srv.stop()


def test_missed_heartbeats_go_stale_then_collected(fast_client: MxClient) -> None:
    c = fast_client
    ident = make_identity("stale/model")
    src = c.publish_source(ident, "w1", manifest=manifest())
    keeper = c.publish_source(ident, "w2", manifest=manifest())
    assert c.get_source(src.id).state == "READY"

    def stale_only_src() -> bool:
        c.heartbeat(keeper.id)  # keeper stays alive
        states = {s.id: s.state for s in c.list_sources(model="stale/model")}
        return states.get(src.id) == "STALE" and states.get(keeper.id) == "READY"
    _until("w1 STALE while w2 heartbeats", stale_only_src)
    assert [s.id for s in c.list_sources(model="stale/model", state="STALE")] == [src.id]

    def collected() -> bool:
        c.heartbeat(keeper.id)
        try:
            c.get_source(src.id)
        except NotFoundError:
            return True
        return False
    _until("the STALE source to be collected", collected)
    with pytest.raises(NotFoundError, match="publish it again"):
        c.heartbeat(src.id)
    assert c.get_source(keeper.id).state == "READY"
    metrics = c.metrics_text()
    assert 'mx_sources{state="READY"} 1.0' in metrics
