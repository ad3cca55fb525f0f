"""The small benchmark scripts run end to end (--quick) and print their JSON line.

Timings are not asserted (benchmarks measure; tests check behaviour): only that the
scripts run, report every routine they name, and that the numbers are positive.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_host_copy_reports_every_routine_into_both_memories() -> None:
    out = _run("host_copy.py", "--quick")
    assert out["bytes"] == 64 << 20
    n = out["stream_threads"]
    for routine in ("torch", "memcpy", "stream1", f"stream{n}"):
        for where in ("private", "shared"):
            assert out[f"{routine}_{where}_ms"] > 0, (routine, where)


def test_digest_bench_reports_each_cpu_algorithm() -> None:
    out = _run("digest.py", "--quick", "--mib", "8")
    assert out["gbps_memcpy_cpu"] > 0
    for key in ("xxh3", "blake2b", "wsum"):
        assert out[f"gbps_{key}_cpu"] > 0, key
        assert out[f"ratio_{key}_vs_memcpy_cpu"] > 0, key
