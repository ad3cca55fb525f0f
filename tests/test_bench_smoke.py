"""The small benchmark scripts run end to end (--quick) and print their JSON line.

Timings are not asserted (benchmarks measure; tests check behaviour): only that the
scripts run, report every routine they name, and that the numbers are positive.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

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
    for key in ("xxh3b8m", "xxh3", "blake2b", "wsum"):
        assert out[f"gbps_{key}_cpu"] > 0, key
        assert out[f"ratio_{key}_vs_memcpy_cpu"] > 0, key


@pytest.mark.vllm
@pytest.mark.slow
def test_shm_arena_ab_runs_all_three_paths_and_reports_the_control() -> None:
    out = _run("shm_arena.py", "--quick", "--readers", "2", "--messages", "3",
               "--main-mib", "16", "--settle-s", "0")
    for mode in ("default", "vllm_arena", "ours"):
        assert out[f"{mode}_2r_median_ms"] > 0, mode
        assert out[f"{mode}_2r_main_ok"] is True, mode  # readers saw the right bytes
    assert out["ours_2r_large_on_arena"] == 2 and out["ours_2r_reuse_corrupted"] == 0
    assert out["max_single_copy_over_memcpy_2r"] > 0 and out["max_over_memcpy_2r"] > 0
    assert {"ours_over_1_25_2r", "single_copy_over_1_25_2r"} <= out.keys()
    assert len(out["quiet_wait_2r_ms_median_max"]) == 2


@pytest.mark.nixl
def test_relay_holder_bench_times_both_kinds_of_pull() -> None:
    out = _run("relay_holder.py", "--quick")
    assert out["bytes"] == 8 << 20 and out["rounds"] == 2
    assert len(out["all_s"]["plain"]) == len(out["all_s"]["holder"]) == 2
    assert out["plain_s"] > 0 and out["holder_s"] > 0 and out["holder_over_plain"] > 0


@pytest.mark.slow
def test_peers_bench_loads_every_tensor_with_safetensors_and_our_pull_warm_and_cold() -> None:
    out = _run("peers.py", "--sizes", "70mb", "--loaders", "safetensors,mx_pull",
               "--settle", "0")
    (res,) = out["results"]
    assert res["bytes"] == 70483200 and res["tensors"] == 33
    rows = {(r["loader"], r["state"]): r for r in res["rows"]}
    assert set(rows) == {(ld, st) for ld in ("safetensors", "mx_pull") for st in ("warm", "cold")}
    for key, r in rows.items():
        assert "error" not in r, (key, r["error"])
        assert r["check"] == "ok", key  # every tensor's bytes, dtype and shape right
        assert 0 < r["load_s"] < r["from_start_s"], key
        assert r["python_s"] > 0 and r["imports_s"] > 0, key
    assert rows["safetensors", "warm"]["cache_before"] == 1.0
    assert rows["mx_pull", "warm"]["verified"] == 33
    for state in ("warm", "cold"):
        ratios = [v["load_vs_fastest"] for v in res["summary"][state].values()]
        assert min(ratios) == 1.0 and all(x >= 1.0 for x in ratios), state


def test_peers_bench_names_a_loader_that_is_not_installed() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import peers
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert peers._missing("safetensors") is None
    line = peers._missing("mx_no_such_loader_package")
    assert line is not None and line.startswith("not installed (mx_no_such_loader_package;")
