"""``bench/vllm_engine.py --quick`` end to end: real engines, a real pull, one JSON line.

Timings are not asserted (benchmarks measure; tests check behaviour): only that every
case ran, that the pulled engine really pulled (from its loader's log line) and
answered as its source, and that the numbers are positive.
"""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys

import psutil
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A source engine and three engine starts, each 20-100 s on a loaded 2-core machine.
TIMEOUT_S = 1200

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]


def _run_bench(*args: str) -> tuple[dict, str]:
    """Run the script; on timeout SIGTERM it first, so that it stops its engines."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "vllm_engine.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        pytest.fail(f"bench/vllm_engine.py ran past {TIMEOUT_S} s\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1]), stderr


# Above the suite's 600 s: pytest-timeout must not end the test before _run_bench has
# stopped the script (and with it the engines it started).
@pytest.mark.timeout(TIMEOUT_S + 300)
def test_quick_run_pulls_from_the_source_engine_and_reports_every_case(tmp_path) -> None:
    out, stderr = _run_bench("--quick", "--workdir", str(tmp_path))
    assert out["bench"] == "vllm_engine" and out["quick"] is True and out["repeats"] == 1
    model = out["model"]
    assert model["params"] > 0 and model["bytes"] >= 4 * model["params"]  # fp32

    # The source loaded from disk and served; the pulled engine pulled (its loader's line),
    # over a checked transfer, and the disk engines were plain vLLM loads.
    assert out["source"]["loaded_from"] == "disk" and out["source"]["serving"] is True
    assert out["pulled"] is True, stderr[-3000:]
    assert out["pulled_digests"] == ["verified"] and out["pulled_probe"] == ["match"]
    assert out["disk_cases_loaded_by_vllm"] is True
    assert out["answers_match_source"] is True

    for case in ("warm", "cold", "pulled"):
        assert out[f"ready_s_{case}"] > 0, case
        assert out[f"weights_s_{case}"] > 0, case
        assert len(out[f"ready_s_{case}_runs"]) == 1, case
    assert out["post_processing_s_pulled"] > 0 and out["gbps_pulled"] > 0
    assert out["read_s_pulled"] > 0  # the data plane's line was found and parsed
    for key in ("ratio_ready_pulled_vs_warm", "ratio_ready_pulled_vs_cold",
                "ratio_weights_pulled_vs_warm", "ratio_weights_pulled_vs_cold"):
        assert out[key] > 0, key
    assert {"weights_saved_vs_warm_s", "weights_saved_vs_cold_s"} <= out.keys()

    # The cold case ran on a dropped page cache, the warm one on a filled one.
    assert out["cold_method"].startswith("posix_fadvise")
    (cold_resident,) = out["cold_resident_bytes_runs"]
    (warm_resident,) = out["warm_resident_bytes_runs"]
    if cold_resident is not None:  # None: fincore (util-linux) missing
        assert cold_resident <= 0.01 * model["bytes"]
        assert warm_resident >= model["bytes"]
    # Every engine was stopped: none of them (their command line names the checkpoint) is left.
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if any(str(tmp_path) in arg for arg in p.info["cmdline"] or ())]
    assert left == [], left
