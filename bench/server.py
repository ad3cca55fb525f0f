"""Control-plane throughput and latency: heartbeat + progress on SQLite and on Redis.

For each store a real server (``python -m modelexpress.server``) runs on 127.0.0.1
(Redis: Debian's ``redis-server`` started here on a free port). Phases per store:

1. baseline: ``GET /v1/health`` (no store write) at the target rate, open loop;
2. load: heartbeats and progress reports, alternating over 50 sources / 50
   transfers, at the target rate, open loop (requests are sent on a fixed schedule
   whatever the replies do, so a slow server shows as latency, not as a lower rate);
3. saturation: 32 clients in a closed loop, for the maximum request rate.

Goal: p99 under 10 ms at 500 requests/s on a 2-core CPU machine. The
ratio printed is load p99 over baseline p99 (the cost of the store on top of HTTP).
Latency is measured from the moment a request is sent; ``p99_sched`` is measured
from its scheduled time (it also counts the load generator's own lag).
The last output line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

_TOKEN = "bench-token"
_HDR = {"Authorization": f"Bearer {_TOKEN}"}
_SOURCES = 50


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, what: str, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not up after {deadline_s} s")
        time.sleep(0.1)


def _start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                             workdir, "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise TimeoutError("redis-server did not come up in 20 s") from None
            time.sleep(0.05)


def _start_server(store: str, workdir: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
    env.update(MX_SERVER_TOKEN=_TOKEN, MX_LOG_LEVEL="WARNING")
    log = open(os.path.join(workdir, f"server-{port}.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "modelexpress.server", "--host",
                             "127.0.0.1", "--port", str(port), "--store", store],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}/v1/health", proc, "server")
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def _setup(url: str) -> tuple[list[str], list[str]]:
    from modelexpress.client import MxClient
    from modelexpress.identity import ModelIdentity

    ident = ModelIdentity(model="bench/model")
    with MxClient(url, token=_TOKEN, timeout_s=30) as c:
        sources = [c.publish_source(ident, f"w{i}", manifest={"tensors": []}).id
                   for i in range(_SOURCES)]
        transfers = [c.start_transfer(ident, f"agent-{i}").id for i in range(_SOURCES)]
    return sources, transfers


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def _requests(kind: str, sources: list[str], transfers: list[str]):
    """Infinite generator of (method, path, json)."""
    i = 0
    while True:
        j = i % len(sources)
        if kind == "health":
            yield "GET", "/v1/health", None
        elif i % 2 == 0:
            yield "POST", f"/v1/sources/{sources[j]}/heartbeat", {}
        else:
            yield "POST", f"/v1/transfers/{transfers[j]}/progress", {
                "bytes_done": i, "bytes_total": 1 << 50, "rate_bps": 1e9}
        i += 1


class _Conn:
    """A minimal HTTP/1.1 keep-alive connection on asyncio streams.

    The load generator runs on the same 2 cores as the server; httpx's AsyncClient
    costs ~1 ms of CPU per request there, which throttled the generator, not the
    server, and starved it under 128 concurrent requests. This speaks just enough
    HTTP for our JSON requests and costs a few tens of microseconds.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: Any) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        payload = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Authorization: Bearer {_TOKEN}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        self.writer.write(head + payload)
        assert self.reader is not None
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def _pool(url: str, size: int) -> asyncio.Queue:
    host, port = url.rsplit("//", 1)[1].split(":")
    pool: asyncio.Queue = asyncio.Queue()
    for _ in range(size):
        pool.put_nowait(_Conn(host, int(port)))
    return pool


async def _call(pool: asyncio.Queue, method: str, path: str, body: Any) -> bool:
    conn = await pool.get()
    try:
        status = await asyncio.wait_for(conn.request(method, path, body), 30)
        return status < 400
    except (OSError, asyncio.TimeoutError, ValueError, IndexError,
            asyncio.IncompleteReadError):
        conn.close()  # a broken connection is reopened on its next use
        return False
    finally:
        pool.put_nowait(conn)


async def _open_loop(url: str, kind: str, rate: float, seconds: float,
                     sources: list[str], transfers: list[str]) -> dict[str, Any]:
    lat: list[float] = []
    sched_lat: list[float] = []
    errors = 0
    pool = await _pool(url, 64)
    gen = _requests(kind, sources, transfers)
    n = int(rate * seconds)
    tasks = []

    async def one(method: str, path: str, body: Any, scheduled: float) -> None:
        nonlocal errors
        t0 = time.perf_counter()
        ok = await _call(pool, method, path, body)
        t1 = time.perf_counter()
        if ok:
            lat.append(t1 - t0)
            sched_lat.append(t1 - scheduled)
        else:
            errors += 1

    start = time.perf_counter()
    for k in range(n):
        due = start + k / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        method, path, body = next(gen)
        tasks.append(asyncio.create_task(one(method, path, body, due)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    while not pool.empty():
        pool.get_nowait().close()
    return {"rps": len(lat) / elapsed, "p50_ms": _pct(lat, 0.5) * 1e3,
            "p99_ms": _pct(lat, 0.99) * 1e3, "p99_sched_ms": _pct(sched_lat, 0.99) * 1e3,
            "errors": errors, "requests": n}


async def _closed_loop(url: str, clients: int, seconds: float, sources: list[str],
                       transfers: list[str]) -> dict[str, Any]:
    done = 0
    errors = 0
    pool = await _pool(url, clients)
    gen = _requests("mix", sources, transfers)
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            method, path, body = next(gen)
            if await _call(pool, method, path, body):
                done += 1
            else:
                errors += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - start
    while not pool.empty():
        pool.get_nowait().close()
    return {"max_rps": done / elapsed, "errors": errors}


def bench_store(name: str, store: str, workdir: str, rate: float, seconds: float
                ) -> dict[str, Any]:
    server, url = _start_server(store, workdir)
    try:
        sources, transfers = _setup(url)
        asyncio.run(_open_loop(url, "mix", rate, 1.0, sources, transfers))  # warm-up
        base = asyncio.run(_open_loop(url, "health", rate, seconds / 2, sources, transfers))
        load = asyncio.run(_open_loop(url, "mix", rate, seconds, sources, transfers))
        sat = asyncio.run(_closed_loop(url, 32, seconds / 2, sources, transfers))
    finally:
        _stop(server)
    out = {
        f"rps_{name}": round(load["rps"], 1),
        f"p50_ms_{name}": round(load["p50_ms"], 2),
        f"p99_ms_{name}": round(load["p99_ms"], 2),
        f"p99_sched_ms_{name}": round(load["p99_sched_ms"], 2),
        f"baseline_health_p99_ms_{name}": round(base["p99_ms"], 2),
        f"ratio_p99_vs_health_{name}": round(load["p99_ms"] / base["p99_ms"], 2),
        f"max_rps_{name}": round(sat["max_rps"], 1),
        f"errors_{name}": load["errors"] + base["errors"] + sat["errors"],
    }
    print(f"[{name}] {rate:.0f} req/s target: achieved {load['rps']:.0f} req/s, "
          f"p50 {load['p50_ms']:.2f} ms, p99 {load['p99_ms']:.2f} ms "
          f"(from schedule {load['p99_sched_ms']:.2f} ms); health baseline p99 "
          f"{base['p99_ms']:.2f} ms; saturation {sat['max_rps']:.0f} req/s; "
          f"errors {out[f'errors_{name}']}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 s per phase instead of 20 s")
    parser.add_argument("--rate", type=float, default=500.0, help="target requests/s")
    parser.add_argument("--seconds", type=float, help="load phase length (default 20; quick 5)")
    parser.add_argument("--stores", default="sqlite,redis", help="comma list: sqlite,redis")
    args = parser.parse_args()
    seconds = args.seconds or (5.0 if args.quick else 20.0)
    summary: dict[str, Any] = {"bench": "server", "target_rps": args.rate,
                               "seconds": seconds, "machine": f"{platform.machine()} "
                               f"{os.cpu_count()} cpu", "python": platform.python_version()}
    # The machine is shared: record how busy it was, or the numbers mean little.
    summary["loadavg_1m_start"] = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="mx-bench-server-") as tmp:
        for name in args.stores.split(","):
            if name == "sqlite":
                summary.update(bench_store("sqlite", f"sqlite:///{tmp}/mx.db", tmp,
                                           args.rate, seconds))
            elif name == "redis":
                redis, url = _start_redis(tmp)
                try:
                    summary.update(bench_store("redis", url, tmp, args.rate, seconds))
                finally:
                    _stop(redis)
            else:
                parser.error(f"unknown store {name!r}; allowed: sqlite, redis")
    summary["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    summary["errors"] = sum(v for k, v in summary.items() if k.startswith("errors_"))
    summary["goal_p99_under_10ms"] = all(
        summary[k] < 10.0 for k in summary if k.startswith("p99_ms_"))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
