"""Server replicas: clients configured with several server URLs fail over between
them. Two real uvicorn replicas on one real Redis, workers talking real HTTP through
MxClient: kill a replica (SIGKILL) mid-traffic, restart Redis mid-traffic.

The workers stand in for the real ones at the control plane's level: sources
heartbeat (as ``p2p.source`` does), targets run pulls they report themselves
(``run_by_target``: start, progress, finish with an outcome, as ``p2p.pull`` does), and
an agent long-polls for REST-started transfers (as ``p2p.agent`` does).
"""

from __future__ import annotations

import pathlib
import threading
import time
import uuid
from typing import Callable, Iterator, TypeVar

import pytest

from conftest import make_identity, manifest
from modelexpress.client import MxClient
from modelexpress.errors import ControlPlaneError, MxError, ServerUnavailableError
from modelexpress.server.service import CLAIM_REDELIVERY_S, ControlPlane
from modelexpress.server.store import open_store
from mx_server_procs import TOKEN, RedisProc, ServerProc

_STALE_S = 4.0   # MX_STALE_AFTER_S of the replicas: a source silent this long is STALE
_BEAT_S = 0.3    # heartbeat period of the sources
_T = TypeVar("_T")


@pytest.fixture()
def cluster(tmp_path: pathlib.Path) -> Iterator[tuple[RedisProc, ServerProc, ServerProc]]:
    redis = RedisProc(tmp_path, persist=True)
    env = {"MX_STALE_AFTER_S": str(_STALE_S)}
    servers: list[ServerProc] = []
    try:
        servers.append(ServerProc(redis.url, tmp_path, env=env).start())
        servers.append(ServerProc(redis.url, tmp_path, env=env).start())
        yield redis, servers[0], servers[1]
    finally:
        for s in servers:
            s.stop()
        redis.stop()


class _Worker(threading.Thread):
    """A thread that records what went wrong instead of dying silently."""

    def __init__(self, urls: list[str], name: str, patient: bool) -> None:
        super().__init__(name=name, daemon=True)
        self.client = MxClient(urls, token=TOKEN, timeout_s=10.0, retries=3)
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.patient = patient  # wait out an outage (Redis restart) instead of failing

    def call(self, fn: Callable[[], _T]) -> _T:
        """``fn()``; while ``patient``, an unavailable control plane is retried for 30 s."""
        deadline = time.monotonic() + 30.0
        while True:
            try:
                return fn()
            except ServerUnavailableError:
                if not self.patient or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def run(self) -> None:
        try:
            self.work()
        except Exception as exc:  # noqa: BLE001 - the test asserts there were none
            self.errors.append(f"{self.name}: {type(exc).__name__}: {exc}")
        finally:
            self.client.close()

    def work(self) -> None:
        raise NotImplementedError


class Sources(_Worker):
    """Publishes ``n`` sources of one identity and heartbeats them every ``_BEAT_S``."""

    def __init__(self, urls: list[str], patient: bool, ident: object, n: int = 4) -> None:
        super().__init__(urls, "sources", patient)
        self.identity, self.n = ident, n
        self.ids: list[str] = []
        self.failed_beats: list[str] = []

    def work(self) -> None:
        for k in range(self.n):
            self.ids.append(self.client.publish_source(self.identity, f"src-{k}",
                                                       manifest=manifest()).id)
        while not self.stop.wait(_BEAT_S):
            for sid in self.ids:
                try:
                    beat = self.client.heartbeat(sid)
                    if beat.state != "READY":
                        self.errors.append(f"heartbeat of {sid} answered {beat.state}")
                except ServerUnavailableError as exc:
                    if not self.patient:
                        raise
                    self.failed_beats.append(str(exc))


class Puller(_Worker):
    """A target that runs pulls itself: start (run_by_target), progress, finish."""

    def __init__(self, urls: list[str], patient: bool, ident: object, name: str) -> None:
        super().__init__(urls, name, patient)
        self.identity = ident
        self.done: list[str] = []

    def _start(self) -> str:
        try:
            return self.client.start_transfer(self.identity, self.name, run_by_target=True).id
        except ServerUnavailableError:
            # Not repeated by the client (it may have reached a server): look first, as
            # MxClient.start_transfer's docstring says, then start one if none exists.
            mine = self.call(lambda: self.client.list_transfers(target_worker=self.name,
                                                                state="PENDING"))
            if mine:
                return mine[0].id
            return self.call(lambda: self.client.start_transfer(
                self.identity, self.name, run_by_target=True).id)

    def work(self) -> None:
        while not self.stop.is_set():
            tid = self._start()
            for step in range(1, 11):
                self.call(lambda: self.client.report_progress(tid, step * 100, 1000, 1e9))
                time.sleep(0.03)
            self.call(lambda: self.client.finish_transfer(
                tid, "SUCCEEDED", bytes_done=1000,
                outcome={"transport": "tcp", "rate_bps": 1e9, "verdict": "ok",
                         "data_plane_s": 0.3, "total_s": 0.4}))
            self.done.append(tid)


class Agent(_Worker):
    """Long-polls for REST-started transfers and runs them (progress, finish)."""

    def __init__(self, urls: list[str], patient: bool, name: str) -> None:
        super().__init__(urls, name, patient)
        self.ran: list[str] = []

    def work(self) -> None:
        self.call(lambda: self.client.register_agent(self.name))
        while not self.stop.is_set():
            try:
                assignments = self.client.poll_assignments(self.name, wait_s=1.0)
            except ControlPlaneError:
                # A poll is not repeated by the client (a lost reply would lose its
                # claims; the server hands such claims out again later): poll again.
                time.sleep(0.2)
                continue
            for t in assignments:
                self.call(lambda: self.client.report_progress(t.id, 500, 1000))
                self.call(lambda: self.client.finish_transfer(t.id, "SUCCEEDED",
                                                              bytes_done=1000))
                self.ran.append(t.id)


class Controller(_Worker):
    """Starts REST transfers for the agent every 0.2 s (an operator or a scheduler)."""

    def __init__(self, urls: list[str], patient: bool, ident: object, agent: str) -> None:
        super().__init__(urls, "controller", patient)
        self.identity, self.agent = ident, agent
        self.started: list[str] = []

    def work(self) -> None:
        while not self.stop.wait(0.2):
            try:
                self.started.append(self.client.start_transfer(self.identity, self.agent).id)
            except ServerUnavailableError:
                if not self.patient:
                    # Ambiguous (it may have been created): adopt what the server has.
                    known = set(self.started)
                    self.started.extend(
                        t.id for t in self.client.list_transfers(target_worker=self.agent)
                        if t.id not in known)


class Watcher(_Worker):
    """Lists the sources every 0.2 s and records every STALE it sees."""

    def __init__(self, urls: list[str], patient: bool, ident: object) -> None:
        super().__init__(urls, "watcher", patient)
        self.identity = ident
        self.stale_seen: list[str] = []

    def work(self) -> None:
        while not self.stop.wait(0.2):
            try:
                rows = self.client.list_sources(identity=self.identity)
            except ServerUnavailableError:
                if not self.patient:
                    raise
                continue
            self.stale_seen.extend(s.id for s in rows if s.state == "STALE")


def _run_fleet(urls_a_first: list[str], urls_b_first: list[str], patient: bool,
               disturb: Callable[[], None]) -> dict[str, _Worker]:
    ident = make_identity(f"failover-{uuid.uuid4().hex[:6]}")
    agent_name = f"agent-{uuid.uuid4().hex[:6]}"
    sources = Sources(urls_a_first, patient, ident)
    sources.start()
    deadline = time.monotonic() + 30
    while len(sources.ids) < sources.n and not sources.errors:
        assert time.monotonic() < deadline, "sources not published in 30 s"
        time.sleep(0.05)
    fleet: dict[str, _Worker] = {
        "sources": sources,
        "watcher": Watcher(urls_b_first, patient, ident),
        "p1": Puller(urls_a_first, patient, ident, "puller-1"),
        "p2": Puller(urls_b_first, patient, ident, "puller-2"),
        "p3": Puller(urls_a_first, patient, ident, "puller-3"),
        "agent": Agent(urls_a_first, patient, agent_name),
        "controller": Controller(urls_a_first, patient, ident, agent_name),
    }
    for name, w in fleet.items():
        if name != "sources":
            w.start()
    time.sleep(1.5)
    disturb()
    # Longer than MX_STALE_AFTER_S: a source whose heartbeats were lost would go STALE.
    time.sleep(_STALE_S + 2.0)
    fleet["controller"].stop.set()
    fleet["controller"].join(timeout=60)
    # The agent runs until every started transfer ran (a claim lost with the killed
    # replica's reply is handed out again after CLAIM_REDELIVERY_S).
    agent = fleet["agent"]
    controller = fleet["controller"]
    deadline = time.monotonic() + CLAIM_REDELIVERY_S + 30
    while not set(controller.started) <= set(agent.ran):  # type: ignore[attr-defined]
        if time.monotonic() > deadline or agent.errors:
            break
        time.sleep(0.2)
    for w in fleet.values():
        w.stop.set()
    for w in fleet.values():
        w.join(timeout=60)
        assert not w.is_alive(), f"{w.name} did not stop"
    return fleet


def _check_nothing_lost(fleet: dict[str, _Worker], url: str) -> None:
    errors = [e for w in fleet.values() for e in w.errors]
    assert not errors, errors
    with MxClient(url, token=TOKEN, timeout_s=30.0) as c:
        sources = fleet["sources"]
        for sid in sources.ids:  # type: ignore[attr-defined]
            assert c.get_source(sid).state == "READY", sid
        assert not fleet["watcher"].stale_seen  # type: ignore[attr-defined]
        pulled = [tid for k in ("p1", "p2", "p3") for tid in fleet[k].done]  # type: ignore[attr-defined]
        assert len(pulled) >= 6, "the pullers barely ran"
        for tid in pulled:
            t = c.get_transfer(tid)
            assert (t.state, t.bytes_done, t.outcome and t.outcome.transport) == (
                "SUCCEEDED", 1000, "tcp"), t
        controller, agent = fleet["controller"], fleet["agent"]
        assert len(controller.started) >= 10  # type: ignore[attr-defined]
        assert set(controller.started) <= set(agent.ran)  # type: ignore[attr-defined]
        for tid in controller.started:  # type: ignore[attr-defined]
            assert c.get_transfer(tid).state == "SUCCEEDED", tid
        # Nothing was run twice: each REST transfer was handed to the agent once, or
        # again only because its claim was lost (then it never ran the first time).
        assert len(agent.ran) == len(set(agent.ran))  # type: ignore[attr-defined]


@pytest.mark.slow
def test_killing_a_replica_mid_traffic_loses_nothing(
        cluster: tuple[RedisProc, ServerProc, ServerProc]) -> None:
    _, a, b = cluster
    fleet = _run_fleet([a.url, b.url], [b.url, a.url], patient=False, disturb=a.kill)
    assert a.proc is not None and a.proc.poll() is not None  # it really died
    _check_nothing_lost(fleet, b.url)
    # No heartbeat failed: the failover happened inside each call.
    assert not fleet["sources"].failed_beats  # type: ignore[attr-defined]
    assert "Traceback" not in b.log()


@pytest.mark.slow
def test_a_redis_restart_mid_traffic_the_replicas_recover(
        cluster: tuple[RedisProc, ServerProc, ServerProc]) -> None:
    redis, a, b = cluster
    fleet = _run_fleet([a.url, b.url], [b.url, a.url], patient=True,
                       disturb=lambda: redis.restart(down_s=1.0))
    _check_nothing_lost(fleet, a.url)
    for url in (a.url, b.url):
        with MxClient(url, token=TOKEN, timeout_s=30.0) as c:
            assert c.health()["status"] == "ok"
    assert "Traceback" not in a.log() + b.log()


def test_a_claim_whose_reply_was_lost_is_handed_out_again(tmp_path: pathlib.Path) -> None:
    now = [1000.0]
    store = open_store(f"sqlite:///{tmp_path}/claims.db")
    try:
        cp = ControlPlane(store, stale_after_s=1e9, gc_after_s=1e9, max_manifest_bytes=1 << 20,
                          clock=lambda: now[0])
        from modelexpress.server.states import SourceState
        ident = make_identity("claims")
        cp.publish_source(ident, "src", endpoint="", agent_metadata="", manifest=manifest(),
                          state=SourceState.READY)
        cp.register_agent("agent", "", {})
        t = cp.create_transfer(ident.id, "agent")
        own = cp.create_transfer(ident.id, "agent", run_by_target=True)
        assert [r["id"] for r in cp.claim_assignments("agent")] == [t["id"]]  # reply "lost"
        now[0] += CLAIM_REDELIVERY_S / 2
        assert cp.claim_assignments("agent") == []  # a concurrent poll gets nothing
        now[0] += CLAIM_REDELIVERY_S
        assert [r["id"] for r in cp.claim_assignments("agent")] == [t["id"]]
        assert cp.claim_assignments("agent") == []
        cp.progress(t["id"], 1, 2, 0.0)  # started: never handed out again
        now[0] += 10 * CLAIM_REDELIVERY_S
        assert cp.claim_assignments("agent") == []
        assert cp.get_transfer(own["id"])["state"] == "PENDING"  # run by its target
    finally:
        store.close()


def test_one_url_or_several_and_which_one_answers(cluster: tuple[RedisProc, ServerProc,
                                                                 ServerProc]) -> None:
    _, a, b = cluster
    with MxClient(f" {a.url}/ ,{b.url}", token=TOKEN) as c:
        assert c.base_urls == (a.url, b.url) and c.base_url == f"{a.url},{b.url}"
        assert c.current_url == a.url
        c.health()
        a.kill()
        start = time.monotonic()
        assert c.health()["status"] == "ok"
        assert c.current_url == b.url
        assert time.monotonic() - start < 5.0  # a refused connection fails over at once
        assert "mx_sources" in c.metrics_text()
        b.kill()
        with pytest.raises(ServerUnavailableError, match="every server"):
            c.health()
    with pytest.raises(MxError, match="needs a server URL"):
        MxClient(" , ")
