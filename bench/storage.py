"""Reading a checkpoint from an S3-compatible store: which library, measured.

The origin of a model no peer holds reads it from storage and serves each piece as it
lands (DESIGN.md, "From zero"), so the reader must put byte ranges of the checkpoint's
objects straight into the origin's memory, many at once, and say when each landed.
Candidates, each driven that way here, the S3 server the same for all (moto's server,
``tests/storage/s3_server.py``, in its own process on 127.0.0.1):

* ``boto3_ranged``: boto3 (1.44) ``get_object`` with ``Range``, one request per range
  from a pool of ``--concurrency`` threads, each body read with ``readinto`` straight
  into the destination (what :mod:`modelexpress.storage.s3` does);
* ``boto3_transfer``: boto3's transfer manager (``s3transfer``,
  ``TransferManager.download``) over a file object that writes into the destination;
  its own parallel ranged GETs (``multipart_chunksize`` = the range, ``max_concurrency``);
* ``runai``: runai-model-streamer 0.17 (the library vLLM's ``--load-format
  runai_streamer`` uses), its C++ reader through ``libstreamer.runai_request``: the
  ranges with their destination addresses, one response per range that landed,
  ``RUNAI_STREAMER_CONCURRENCY`` workers.

Each reads the same objects (``--mib`` in ``--shards`` objects, ranges of
``--range-mib``), ``--rounds`` times in turn; reported per reader: the median wall
time and GB/s, the first range's latency, and the CPU seconds of this process (the
reader's own cost; the server runs elsewhere). The bytes are checked against the
uploaded ones.

moto answers a ranged GET by copying the whole object first (``FakeKey.value``), so on
this server a read costs O(object size) per range; ``--shards`` keeps objects small so
the clients, not that copy, set the pace. What the numbers can say is each client's
cost and overhead against the same server, not S3's throughput.

Usage: python bench/storage.py [--mib 256] [--shards 8] [--range-mib 8] [--concurrency 8]
       [--rounds 3] [--only boto3_ranged,runai]
Prints progress on stderr and ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import pathlib
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "storage"))

from s3_server import CREDENTIALS, S3Server, s3_env  # noqa: E402

BUCKET = "mx-bench"
Ranges = list[tuple[str, int, int, int]]  # (key, object offset, nbytes, destination offset)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _ranges(keys: list[str], size: int, range_bytes: int) -> Ranges:
    out: Ranges = []
    dest = 0
    for key in keys:
        for off in range(0, size, range_bytes):
            n = min(range_bytes, size - off)
            out.append((key, off, n, dest))
            dest += n
    return out


def read_boto3_ranged(endpoint: str, ranges: Ranges, buf: np.ndarray, concurrency: int,
                      landed: Callable[[int], None]) -> None:
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=endpoint,
                      config=Config(max_pool_connections=concurrency,
                                    retries={"max_attempts": 2, "mode": "standard"}))
    view = memoryview(buf)

    def one(i: int) -> int:
        key, off, n, dest = ranges[i]
        body = s3.get_object(Bucket=BUCKET, Key=key,
                             Range=f"bytes={off}-{off + n - 1}")["Body"]
        got = 0
        while got < n:
            k = body.readinto(view[dest + got:dest + n])
            if not k:
                raise IOError(f"{key}: short body ({got} of {n} bytes)")
            got += k
        return i

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for fut in concurrent.futures.as_completed([pool.submit(one, i)
                                                    for i in range(len(ranges))]):
            landed(fut.result())


class _Writer:
    """A seekable file object over ``buf[base:base + size]`` (what s3transfer writes)."""

    def __init__(self, buf: np.ndarray, base: int, size: int,
                 landed: Callable[[int], None]) -> None:
        self.view = memoryview(buf)[base:base + size]
        self.pos = 0
        self.landed = landed

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data: bytes) -> int:
        n = len(data)
        self.view[self.pos:self.pos + n] = data
        self.pos += n
        self.landed(n)
        return n

    def seekable(self) -> bool:
        return True


def read_boto3_transfer(endpoint: str, keys: list[str], size: int, buf: np.ndarray,
                        range_bytes: int, concurrency: int,
                        landed: Callable[[int], None]) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    from s3transfer.manager import TransferManager

    s3 = boto3.client("s3", endpoint_url=endpoint,
                      config=Config(max_pool_connections=concurrency))
    config = TransferConfig(multipart_threshold=range_bytes, multipart_chunksize=range_bytes,
                            max_concurrency=concurrency, use_threads=True)
    with TransferManager(s3, config) as manager:
        futures = [manager.download(BUCKET, key, _Writer(buf, i * size, size, landed))
                   for i, key in enumerate(keys)]
        for fut in futures:
            fut.result()


def read_runai(endpoint: str, ranges: Ranges, buf: np.ndarray, concurrency: int,
               landed: Callable[[int], None]) -> None:
    os.environ["RUNAI_STREAMER_CONCURRENCY"] = str(concurrency)
    from runai_model_streamer.libstreamer.libstreamer import (
        SUCCESS_ERROR_CODE, runai_end, runai_request, runai_response, runai_response_str,
        runai_start)

    base = int(buf.ctypes.data)
    by_key: dict[str, list[int]] = {}
    for i, (key, *_rest) in enumerate(ranges):
        by_key.setdefault(key, []).append(i)
    order = [i for key in by_key for i in by_key[key]]
    streamer = runai_start()
    try:
        runai_request(streamer, [f"s3://{BUCKET}/{key}" for key in by_key],
                      [len(v) for v in by_key.values()],
                      [ranges[i][1] for i in order], [ranges[i][2] for i in order],
                      [base + ranges[i][3] for i in order])
        starts = np.cumsum([0] + [len(v) for v in by_key.values()])
        for _ in range(len(ranges)):
            got = runai_response(streamer, 60_000)
            assert got is not None, "runai: teardown before the last range"
            ret, _sub, file_index, range_index, _done = got
            if ret != SUCCESS_ERROR_CODE:
                raise IOError(f"runai: {runai_response_str(ret)}")
            landed(order[int(starts[file_index]) + range_index])
    finally:
        runai_end(streamer)


def _measure(name: str, run: Callable[[np.ndarray, Callable[[int], None]], None],
             want: str, total: int, rounds: int) -> dict[str, Any]:
    walls, firsts, cpus = [], [], []
    for r in range(rounds):
        buf = np.zeros(total, dtype=np.uint8)
        first: list[float] = []
        t0 = time.perf_counter()
        c0 = _cpu_s()

        def landed(_i: int) -> None:
            if not first:
                first.append(time.perf_counter() - t0)

        run(buf, landed)
        wall = time.perf_counter() - t0
        cpus.append(_cpu_s() - c0)
        walls.append(wall)
        firsts.append(first[0] if first else wall)
        ok = hashlib.sha256(buf.tobytes()).hexdigest() == want
        _say(f"{name} round {r}: {wall:.3f} s, {total / wall / 1e9:.3f} GB/s, first range "
             f"{firsts[-1] * 1e3:.1f} ms, cpu {cpus[-1]:.2f} s, bytes {'ok' if ok else 'WRONG'}")
        if not ok:
            raise RuntimeError(f"{name}: the bytes read differ from the object's")
    wall = statistics.median(walls)
    return {"seconds": round(wall, 3), "gbps": round(total / wall / 1e9, 3),
            "first_range_ms": round(statistics.median(firsts) * 1e3, 1),
            "cpu_s": round(statistics.median(cpus), 3),
            "cpu_s_per_gb": round(statistics.median(cpus) / (total / 1e9), 3),
            "rounds_s": [round(w, 3) for w in walls]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes read per round, in MiB")
    parser.add_argument("--shards", type=int, default=8, help="objects they are split over")
    parser.add_argument("--range-mib", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="boto3_ranged,boto3_transfer,runai")
    args = parser.parse_args()
    total = args.mib << 20
    size = total // args.shards
    total = size * args.shards
    range_bytes = int(args.range_mib * (1 << 20))
    work = pathlib.Path(tempfile.mkdtemp(prefix="mx-bench-storage-"))
    server = S3Server(work).start()
    try:
        os.environ.update(s3_env(server.endpoint))
        s3 = server.client()
        s3.create_bucket(Bucket=BUCKET)
        rng = np.random.default_rng(7)
        data = rng.integers(0, 256, total, dtype=np.uint8)
        keys = [f"model/shard-{i:03d}.bin" for i in range(args.shards)]
        for i, key in enumerate(keys):
            s3.put_object(Bucket=BUCKET, Key=key, Body=data[i * size:(i + 1) * size].tobytes())
        want = hashlib.sha256(data.tobytes()).hexdigest()
        del data
        ranges = _ranges(keys, size, range_bytes)
        readers = {
            "boto3_ranged": lambda buf, landed: read_boto3_ranged(
                server.endpoint, ranges, buf, args.concurrency, landed),
            "boto3_transfer": lambda buf, landed: read_boto3_transfer(
                server.endpoint, keys, size, buf, range_bytes, args.concurrency, landed),
            "runai": lambda buf, landed: read_runai(
                server.endpoint, ranges, buf, args.concurrency, landed),
        }
        out: dict[str, Any] = {"mib": args.mib, "shards": args.shards,
                               "range_mib": args.range_mib, "concurrency": args.concurrency,
                               "rounds": args.rounds, "server": "moto 5.2.5 (werkzeug, threaded)",
                               "credentials": sorted(CREDENTIALS)}
        for name in args.only.split(","):
            out[name] = _measure(name, readers[name], want, total, args.rounds)
        out["served"] = server.stats()["body_bytes"]
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
