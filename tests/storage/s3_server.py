"""A real S3-compatible server for the tests and benches: moto's server, counted and faultable.

Runs moto's own WSGI application (``moto.moto_server``, what ``moto_server`` serves) under
werkzeug's threaded server, in its own process. Clients (boto3, ``modelexpress``) talk
real S3 over HTTP to it; nothing in the client is patched. Around moto sits a small WSGI
layer that the test setup drives over HTTP:

* ``GET /_mx/stats``: what the server sent: ``{"gets": n, "body_bytes": n, "by_key":
  {"bucket/key": [gets, bytes]}}`` counting the bodies of object GETs (a ranged GET
  counts its range). This is how a test counts "the checkpoint was read once";
* ``POST /_mx/faults`` with JSON ``{"delay_s": s, "deny": ["bucket/prefix", ...],
  "truncate": {"bucket/key": nbytes}}``: each later request sleeps ``delay_s`` first (a
  slow endpoint); keys under a ``deny`` prefix answer S3's 403 AccessDenied; a
  ``truncate``-d key's GET bodies stop after that many bytes of the object (a
  connection cut mid-object: the client sees a short body). ``{}`` clears them;
* ``POST /_mx/reset``: zero the counters.

Usage::

    python tests/storage/s3_server.py --host 127.0.0.1 --port 0 --port-file PATH

prints ``listening on HOST:PORT`` and writes the port to ``--port-file`` once it accepts
connections; SIGTERM stops it. :class:`S3Server` runs it for a test (``start``/``stop``
with bounded waits) and offers ``stats()``, ``faults()``, ``upload_dir()``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterable

__all__ = ["S3Server", "CREDENTIALS", "s3_env"]

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "mx-test-key", "AWS_SECRET_ACCESS_KEY": "mx-test-secret",
               "AWS_REGION": "us-east-1"}
_START_DEADLINE_S = 60.0


def s3_env(endpoint: str) -> dict[str, str]:
    """The AWS variables a client of this server needs (endpoint and credentials)."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint,
            # (some clients read the region from the older name only)
            "AWS_DEFAULT_REGION": CREDENTIALS["AWS_REGION"]}


class _Counted:
    """WSGI middleware: counts object GET bodies, injects faults, answers /_mx/*."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.gets = 0
        self.body_bytes = 0
        self.by_key: dict[str, list[int]] = {}
        self.delay_s = 0.0
        self.deny: list[str] = []
        self.truncate: dict[str, int] = {}

    def _json(self, start_response: Any, status: str, obj: Any) -> list[bytes]:
        body = json.dumps(obj).encode()
        start_response(status, [("Content-Type", "application/json"),
                                ("Content-Length", str(len(body)))])
        return [body]

    def __call__(self, environ: dict, start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        method = environ.get("REQUEST_METHOD", "GET")
        if path.startswith("/_mx/"):
            return self._control(path, method, environ, start_response)
        with self.lock:
            delay, deny, truncate = self.delay_s, list(self.deny), dict(self.truncate)
        if delay > 0:
            time.sleep(delay)
        key = path.lstrip("/")
        if any(key.startswith(p) for p in deny):
            body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                    b"<Message>Access Denied</Message></Error>")
            start_response("403 Forbidden", [("Content-Type", "application/xml"),
                                              ("Content-Length", str(len(body)))])
            return [body]
        if method != "GET" or key.count("/") < 1 or "list-type" in environ.get("QUERY_STRING", ""):
            return self.app(environ, start_response)
        cut = truncate.get(key)
        return self._counted(key, cut, environ, start_response)

    def _counted(self, key: str, cut: int | None, environ: dict,
                 start_response: Any) -> Iterable[bytes]:
        status_line: list[str] = []

        def start(status: str, headers: list, exc_info: Any = None) -> Any:
            status_line.append(status)
            return start_response(status, headers, exc_info) if exc_info else \
                start_response(status, headers)

        out = self.app(environ, start)
        ok = bool(status_line) and status_line[0][:3] in ("200", "206")
        begin = _range_start(environ.get("HTTP_RANGE", ""))
        sent = 0
        try:
            for chunk in out:
                if cut is not None and ok:
                    room = cut - begin - sent
                    if room <= 0:
                        break  # the connection "drops": the client gets a short body
                    chunk = chunk[:room]
                sent += len(chunk)
                yield chunk
        finally:
            if hasattr(out, "close"):
                out.close()
            if ok:
                with self.lock:
                    self.gets += 1
                    self.body_bytes += sent
                    row = self.by_key.setdefault(key, [0, 0])
                    row[0] += 1
                    row[1] += sent

    def _control(self, path: str, method: str, environ: dict,
                 start_response: Any) -> list[bytes]:
        if path == "/_mx/stats" and method == "GET":
            with self.lock:
                return self._json(start_response, "200 OK", {
                    "gets": self.gets, "body_bytes": self.body_bytes,
                    "by_key": {k: list(v) for k, v in self.by_key.items()}})
        if path == "/_mx/reset" and method == "POST":
            with self.lock:
                self.gets, self.body_bytes, self.by_key = 0, 0, {}
            return self._json(start_response, "200 OK", {"ok": True})
        if path == "/_mx/faults" and method == "POST":
            size = int(environ.get("CONTENT_LENGTH") or 0)
            spec = json.loads(environ["wsgi.input"].read(size) or b"{}")
            with self.lock:
                self.delay_s = float(spec.get("delay_s", 0.0))
                self.deny = [str(p) for p in spec.get("deny", [])]
                self.truncate = {str(k): int(v) for k, v in spec.get("truncate", {}).items()}
            return self._json(start_response, "200 OK", {"ok": True})
        return self._json(start_response, "404 Not Found", {"detail": f"no route {path}"})


def _range_start(header: str) -> int:
    """The first byte of a ``Range: bytes=A-B`` request (0 for none or a suffix range)."""
    if not header.startswith("bytes="):
        return 0
    first = header[len("bytes="):].split("-", 1)[0]
    return int(first) if first.isdigit() else 0


def _serve(host: str, port: int, port_file: pathlib.Path | None) -> None:
    from werkzeug.serving import make_server

    from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                               create_backend_app)

    app = _Counted(DomainDispatcherApplication(create_backend_app))
    server = make_server(host, port, app, threaded=True, request_handler=MotoRequestHandler)
    real = server.server_address[1]
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"listening on {host}:{real}", flush=True)
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(real))
        os.replace(tmp, port_file)
    server.serve_forever()


class S3Server:
    """The server above in a subprocess on ``host`` (a free port).

    Args:
        workdir: where its log and port file go.
        host: address to bind.
    """

    def __init__(self, workdir: pathlib.Path, host: str = "127.0.0.1") -> None:
        self.workdir = workdir
        self.host = host
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "s3-server.log"

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "S3Server":
        port_file = self.workdir / "s3-server.port"
        port_file.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--host", self.host, "--port", "0", "--port-file",
                 str(port_file)], stdout=log, stderr=subprocess.STDOUT, env=env)
        end = time.monotonic() + _START_DEADLINE_S
        while not port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the S3 server exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            if time.monotonic() > end:
                self.stop()
                raise TimeoutError(f"the S3 server did not listen within {_START_DEADLINE_S} s")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        return self

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        import httpx

        resp = httpx.request(method, self.endpoint + path, json=body, timeout=30.0)
        resp.raise_for_status()
        return resp.json()

    def stats(self) -> dict[str, Any]:
        """Object GETs served and their body bytes (see the module docstring)."""
        return self._call("GET", "/_mx/stats")

    def reset(self) -> None:
        self._call("POST", "/_mx/reset")

    def faults(self, **spec: Any) -> None:
        """Set the faults of later requests (``delay_s``, ``deny``, ``truncate``)."""
        self._call("POST", "/_mx/faults", spec)

    def client(self):  # noqa: ANN201
        """A boto3 S3 client of this server (for the test setup)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint,
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                            region_name=CREDENTIALS["AWS_REGION"])

    def upload_dir(self, directory: pathlib.Path, bucket: str, prefix: str) -> list[str]:
        """Upload every file of ``directory`` (not recursive) under ``s3://bucket/prefix/``;
        creates the bucket. Returns the keys."""
        s3 = self.client()
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        keys = []
        for f in sorted(p for p in directory.iterdir() if p.is_file()):
            key = f"{prefix.strip('/')}/{f.name}" if prefix.strip("/") else f.name
            s3.upload_file(str(f), bucket, key)
            keys.append(key)
        return keys

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", type=pathlib.Path, default=None)
    args = parser.parse_args()
    _serve(args.host, args.port, args.port_file)


if __name__ == "__main__":
    main()
