"""bench/time_to_ready.py reads the phases out of real engine logs (the committed run's).

The bench itself starts five compiled vLLM engines (minutes); CI checks its log parsing
against the logs that run wrote, so a change of log format or regex shows here.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOGS = ROOT / "bench" / "results" / "2026-12-01-cpu2" / "time_to_ready"


def _bench():  # noqa: ANN202 - the module
    pytest.importorskip("httpx")
    spec = importlib.util.spec_from_file_location("bench_ttr", ROOT / "bench" / "time_to_ready.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _log(prefix: str) -> str:
    return next(LOGS.glob(f"vllm-{prefix}-*.log")).read_text()


def test_the_phases_of_each_case_come_out_of_its_log() -> None:
    bench = _bench()
    pulled = bench.parse_log("artifacts", 31.5, _log("artifacts-0"), 0.0)
    assert pulled["weights_from"] == "peer" and pulled["weights_s"] > 0
    assert pulled["artifact_outcome"] == "hit"
    assert pulled["artifacts_s"] > 0 and pulled["artifacts_mb"] > 0
    assert pulled["compile_s"] is not None and pulled["init_engine_s"] > 0
    cold = bench.parse_log("cold", 51.0, _log("cold-0"), 0.0)
    assert cold["weights_from"] == "disk" and cold["weights_s"] is not None
    assert cold["artifact_outcome"] == "off" and cold["artifacts_s"] is None
    assert cold["init_engine_s"] > pulled["init_engine_s"]
    weights = bench.parse_log("weights", 51.0, _log("weights-0"), 0.0)
    assert weights["weights_from"] == "peer" and weights["artifact_outcome"] == "off"
