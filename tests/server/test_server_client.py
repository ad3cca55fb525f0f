"""MxClient's retry policy and error mapping against a scripted real HTTP server.

The server is the stdlib ``ThreadingHTTPServer`` on 127.0.0.1 answering from a
script, so the tests can produce what the real control plane rarely does on cue
(503 bursts, replies slower than the client's timeout) and count what arrived.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from modelexpress.client import MxClient
from modelexpress.errors import (
    AuthError, ConflictError, ControlPlaneError, NotFoundError, ServerUnavailableError,
    ValidationError,
)

_TRANSFER = {"id": "t1", "identity_id": "0" * 32, "target_worker": "a", "source_id": "s",
             "source_worker": "w", "source_endpoint": "", "state": "RUNNING",
             "bytes_done": 1, "bytes_total": 2, "rate_bps": 0.0, "error": None,
             "stop_requested": False, "claimed": True, "restarts": 0, "created_at": 0.0,
             "updated_at": 0.0, "started_at": 0.0, "finished_at": None,
             "field_from_a_newer_server": 1}


class Scripted:
    """Replies per path: a list of (status, body, delay_s); the last one repeats."""

    def __init__(self) -> None:
        self.script: dict[str, list[tuple[int, object, float]]] = {}
        self.seen: list[tuple[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                path = self.path.split("?")[0]
                outer.seen.append((self.command, path))
                steps = outer.script.get(path, [(404, {"detail": "no script"}, 0.0)])
                status, body, delay = steps.pop(0) if len(steps) > 1 else steps[0]
                time.sleep(delay)
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (timeout) and closed the socket

            do_GET = do_POST = do_PUT = do_DELETE = _reply

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


@pytest.fixture()
def scripted() -> Iterator[Scripted]:
    s = Scripted()
    yield s
    s.close()


def test_idempotent_calls_retry_through_503(scripted: Scripted) -> None:
    scripted.script["/v1/health"] = [(503, {"detail": "store down"}, 0.0),
                                     (503, {"detail": "store down"}, 0.0),
                                     (200, {"status": "ok", "store": "x"}, 0.0)]
    with MxClient(scripted.url, timeout_s=5.0, retries=2) as c:
        assert c.health()["status"] == "ok"
    assert len(scripted.seen) == 3


def test_retries_run_out_into_server_unavailable(scripted: Scripted) -> None:
    scripted.script["/v1/health"] = [(503, {"detail": "store down"}, 0.0)]
    with MxClient(scripted.url, timeout_s=5.0, retries=1) as c:
        with pytest.raises(ServerUnavailableError, match="store down"):
            c.health()
    assert len(scripted.seen) == 2


def test_start_transfer_is_never_repeated(scripted: Scripted) -> None:
    scripted.script["/v1/transfers"] = [(503, {"detail": "busy"}, 0.0)]
    with MxClient(scripted.url, timeout_s=0.5, retries=3) as c:
        with pytest.raises(ServerUnavailableError):
            c.start_transfer("0" * 32, "agent")
        assert len(scripted.seen) == 1
        scripted.script["/v1/transfers"] = [(201, _TRANSFER, 2.0)]  # slower than the timeout
        with pytest.raises(ServerUnavailableError, match="ReadTimeout"):
            c.start_transfer("0" * 32, "agent")
    assert len(scripted.seen) == 2


def test_a_version_check_that_times_out_is_retried_and_the_start_sent_once(
        scripted: Scripted) -> None:
    """A start whose body depends on the server's API version (relay fields) asks it
    first (GET /v1/health); that GET timing out sent nothing of the start, so it is
    retried like any GET and the start goes out once."""
    scripted.script["/v1/health"] = [(200, {"status": "ok", "store": "x"}, 2.0),
                                     (200, {"status": "ok", "store": "x"}, 0.0)]
    scripted.script["/v1/transfers"] = [(201, _TRANSFER, 0.0)]
    with MxClient(scripted.url, timeout_s=0.5, retries=2) as c:
        t = c.start_transfer("0" * 32, "agent", run_by_target=True, relay_read=True)
    assert t.id == "t1"
    assert scripted.seen.count(("GET", "/v1/health")) == 2
    assert scripted.seen.count(("POST", "/v1/transfers")) == 1


def test_progress_retries_after_a_read_timeout(scripted: Scripted) -> None:
    path = "/v1/transfers/t1/progress"
    scripted.script[path] = [(200, {"transfer": _TRANSFER, "stop": False}, 2.0),
                             (200, {"transfer": _TRANSFER, "stop": True}, 0.0)]
    with MxClient(scripted.url, timeout_s=0.5, retries=2) as c:
        reply = c.report_progress("t1", 1, 2)
    assert reply.stop and reply.transfer.state == "RUNNING"
    assert scripted.seen.count(("POST", path)) == 2


@pytest.mark.parametrize("status,error", [
    (404, NotFoundError), (409, ConflictError), (401, AuthError), (403, AuthError),
    (400, ValidationError), (413, ValidationError), (422, ValidationError),
])
def test_status_codes_map_into_the_error_tree(scripted: Scripted, status: int,
                                              error: type) -> None:
    scripted.script["/v1/transfers/t1"] = [(status, {"detail": "the reason"}, 0.0)]
    with MxClient(scripted.url, timeout_s=5.0, retries=3) as c:
        with pytest.raises(error, match=f"HTTP {status}: the reason"):
            c.get_transfer("t1")
    assert len(scripted.seen) == 1  # 4xx is never retried


def test_closed_client_refuses_and_close_is_idempotent(scripted: Scripted) -> None:
    c = MxClient(scripted.url)
    c.close()
    c.close()
    with pytest.raises(ControlPlaneError, match="closed"):
        c.health()
