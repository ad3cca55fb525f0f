"""Load: 50 concurrent clients send heartbeats and progress for 30 s; zero errors, p99 reported.

Latency is reported, never asserted (the machine is shared); errors are asserted.
"""

from __future__ import annotations

import pathlib
import threading
import time
from typing import Iterator

import pytest

from conftest import make_identity, manifest
from modelexpress.client import MxClient
from mx_server_procs import TOKEN, ServerProc

pytestmark = pytest.mark.slow

_CLIENTS = 50
_SECONDS = 30.0


@pytest.fixture()
def load_server(tmp_path: pathlib.Path) -> Iterator[ServerProc]:
    srv = ServerProc(f"sqlite:///{tmp_path}/mx.db", tmp_path).start()
    yield srv
    srv.stop()


def test_50_clients_heartbeat_and_progress(load_server: ServerProc,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    ident = make_identity("load/model")
    with MxClient(load_server.url, token=TOKEN, timeout_s=30.0) as c:
        c.publish_source(ident, "load-source", manifest=manifest())
        transfers = [c.start_transfer(ident, f"agent-{i}").id for i in range(_CLIENTS)]

    latencies: list[list[float]] = [[] for _ in range(_CLIENTS)]
    last_bytes = [0] * _CLIENTS
    errors: list[str] = []
    start_gate = threading.Barrier(_CLIENTS)
    deadline_box: list[float] = []

    def run(i: int) -> None:
        # retries=0 so that any failure is counted, not hidden by a retry.
        with MxClient(load_server.url, token=TOKEN, timeout_s=30.0, retries=0) as c:
            try:
                src = c.publish_source(ident, f"w{i}", manifest=manifest())
                start_gate.wait(timeout=120)
                if not deadline_box:
                    deadline_box.append(time.monotonic() + _SECONDS)
                n = 0
                while time.monotonic() < deadline_box[0]:
                    t0 = time.perf_counter()
                    c.heartbeat(src.id)
                    t1 = time.perf_counter()
                    n += 1
                    c.report_progress(transfers[i], n, 1 << 40, rate_bps=1e9)
                    t2 = time.perf_counter()
                    last_bytes[i] = n
                    latencies[i] += (t1 - t0, t2 - t1)
            except Exception as exc:  # noqa: BLE001 - every error counts
                errors.append(f"client {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(i,), name=f"load-{i}")
               for i in range(_CLIENTS)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=_SECONDS + 180)
    elapsed = time.monotonic() - began
    assert not any(t.is_alive() for t in threads), "a load client hung"
    assert not errors, errors[:5]

    lat = sorted(x for per in latencies for x in per)
    assert lat, "no request completed"
    p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    with capsys.disabled():
        print(f"\n[load] {_CLIENTS} clients, {len(lat)} requests in {elapsed:.1f} s "
              f"({len(lat) / _SECONDS:.0f} req/s), p50 {p50 * 1e3:.1f} ms, "
              f"p99 {p99 * 1e3:.1f} ms, errors 0")

    # Every acknowledged progress report is what the server holds.
    with MxClient(load_server.url, token=TOKEN, timeout_s=30.0) as c:
        held = {t.id: t.bytes_done for t in c.list_transfers()}
        assert [held[t] for t in transfers] == last_bytes
        workers = {f"w{i}" for i in range(_CLIENTS)}
        states = {s.worker_id: s.state for s in c.list_sources(model="load/model")
                  if s.worker_id in workers}
        assert states == dict.fromkeys(workers, "READY")
