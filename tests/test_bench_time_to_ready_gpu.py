"""bench/time_to_ready_gpu.py reads where an engine's start went out of vLLM's log records.

The bench runs whole 8B engines on a GPU (minutes each); CI checks the parts that decide
its figures against the event log of a real run (a pulled 8B engine on an H100, vLLM
0.26.0, committed under bench/results/2026-12-06-h100): the phases, the table and the
goals computed from them, the token comparison.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "results" / "2026-12-06-h100"


def _bench():  # noqa: ANN202 - the module
    spec = importlib.util.spec_from_file_location("bench_ttr_gpu",
                                                  ROOT / "bench" / "time_to_ready_gpu.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


TOKENS = [[1, 2, 3]]


def _results(**cases: dict) -> dict:
    """A run's results as the report reads them: a cold start (100 s), a warm restart
    (60 s), a pulled engine with artifacts (40 s, a hit), then ``cases`` (a case's
    fields updated, or a case added)."""
    rows = {"cold": {"ready_s": 100.0, "tokens": TOKENS, "model_loading_s": 6.0},
            "warm": {"ready_s": 60.0, "tokens": TOKENS, "model_loading_s": 4.0},
            "mx-artifacts": {"ready_s": 40.0, "tokens": TOKENS, "model_loading_s": 1.5,
                             "warmup_after_graphs_s": 1.0, "copy_gbps": 950.0,
                             "vllm_model_loading_gib": 14.96,
                             "load_max_allocated_gib": 15.1, "artifacts": "hit"}}
    for name, fields in cases.items():
        rows[name] = {**rows.get(name, {}), **fields}
    return {"device": "cuda", "d2d_gbps": 1000.0, "checkpoint": {"bytes": 16_060_000_000},
            "cases": rows}


def test_the_phases_of_a_real_8b_engine_add_up_to_its_time_to_ready() -> None:
    bench = _bench()
    events = bench.read_events(RUN / "run1-logs" / "mx-artifacts.events.jsonl")
    row = json.loads((RUN / "run1-results.json").read_text())["cases"]["mx-artifacts"]
    t_llm = events[0]["t"] - 0.5  # LLM() began just before vLLM's first record
    t0 = t_llm - row["imports_s"]
    t_ready = t_llm + row["llm_s"]
    out = bench.phases(events, t0, t_llm, t_ready)
    parts = ("config_s", "worker_start_s", "model_loading_s", "compile_s", "profiling_s",
             "kv_cache_s", "cuda_graphs_s", "warmup_after_graphs_s", "rest_s")
    assert all(out[p] is not None for p in parts), out
    # from LLM() to ready the phases are consecutive: they add up
    assert abs(sum(out[p] for p in parts) - out["llm_s"]) < 0.02, out
    for key in ("model_loading_s", "compile_s", "cuda_graphs_s", "warmup_after_graphs_s"):
        assert out[key] == row[key], key
    assert out["vllm_model_loading_s"] == 2.007649 and out["vllm_model_loading_gib"] == 14.99
    assert out["mx_loaded_from"] == "peer" and out["copy_gbps"] == 1455.5
    assert out["mx_phases"]["agent"] == 0.0 and out["mx_phases"]["post_processing"] == 0.009


def test_the_report_computes_the_goals_and_flags_different_tokens() -> None:
    bench = _bench()
    results = _results(runai_streamer={"skipped": "runai_model_streamer is not installed"})
    table, summary = bench.report(results)
    assert "| runai_streamer | skipped: runai_model_streamer is not installed |" in table
    assert summary["tokens_match"] is True
    assert summary["artifacts_over_warm"] == 0.667 and summary["artifacts_over_cold"] == 0.4
    assert summary["goals"] == {"warmup_after_graphs_le_3s": True,
                                "loading_le_0.5x_warm_page_cache": True,
                                "ready_le_0.85x_warm_restart": True, "ready_le_0.4x_cold": True,
                                "copy_ge_0.9x_d2d": True, "no_second_copy": True}
    results["cases"]["warm"]["tokens"] = [[1, 2, 4]]
    table, summary = bench.report(results)
    assert summary["tokens_match"] is False and "DIFFER" in table


def test_an_engines_error_lines_leave_out_the_known_harmless_ones() -> None:
    bench = _bench()
    log = ("ERROR 12-06 10:00:00 [modelexpress.p2p.source] source x: the NIXL progress thread "
           "stopped\nWARNING 12-06 10:00:00 [import_utils.py:408] Traceback (most recent call "
           "last):\nERROR 12-06 10:00:01 [import_utils.py:1] deep_gemm failed\nINFO fine\n"
           "2026-12-06 10:00:02 NIXL ERROR    _api.py:1 broken\n")
    assert len(bench.error_lines(log)) == 2


def test_tokens_that_part_at_a_near_tie_are_told_from_tokens_that_differ() -> None:
    bench = _bench()
    ref = {"tokens": [[1, 2, 3, 4]], "logprob_gaps": [[1.2, 0.8, 0.0, 0.5]]}
    tie = {"tokens": [[1, 2, 9, 7]], "logprob_gaps": [[1.2, 0.8, 0.0, 0.4]]}
    assert bench.compare_tokens(tie, ref) == ("near-tie", ["prompt 1 token 3: gaps [0.0, 0.0]"])
    wrong = {"tokens": [[1, 5, 3, 4]], "logprob_gaps": [[1.2, 0.9, 0.0, 0.5]]}
    assert bench.compare_tokens(wrong, ref)[0] == "DIFFER"
    assert bench.compare_tokens(ref, ref) == ("same", [])


def test_the_copy_rate_is_the_weights_pull_not_the_small_pulls_before_it() -> None:
    """An artifact target pulls vLLM's model-info cache (748 bytes) and its compiled set
    before the weights, over the same transport: the copy rate is the 16 GB pull's."""
    bench = _bench()
    text = (RUN / "run4-logs" / "mx-artifacts.log").read_text()
    out = bench._ours(text)
    assert out["copy_bytes"] == 16062620160 and out["copy_gbps"] == 1458.7, out


def test_no_ratio_is_taken_against_a_warm_restart_that_compiled_again() -> None:
    """In the H100 run at c9ce3f4 the `warm` engine compiled again (vLLM's compile key
    hashed its own HOME's paths): its log says so, and the summary then says the warm
    restart is invalid instead of comparing with it."""
    bench = _bench()
    logs = RUN / "run4-logs"
    assert bench._ours((logs / "warm.log").read_text())["compile_cache"] == "compiled"
    assert bench._ours((logs / "mx-artifacts.log").read_text())["compile_cache"] == "loaded"
    results = _results(warm={"compile_cache": "compiled"},
                       **{"mx-artifacts": {"compile_cache": "loaded"}})
    _table, summary = bench.report(results)
    assert summary["artifacts_over_warm"] is None and "compiled again" in \
        summary["warm_restart_invalid"]
    assert summary["goals"]["ready_le_0.85x_warm_restart"] is None
    assert summary["artifacts_over_cold"] == 0.4
    results["cases"]["warm"]["compile_cache"] = "loaded"
    _table, summary = bench.report(results)
    assert summary["artifacts_over_warm"] == 0.667 and "warm_restart_invalid" not in summary


def test_a_restart_runs_its_copy_of_the_caches_at_the_path_they_were_written_to(
        tmp_path: pathlib.Path) -> None:
    bench = _bench()
    original, copy = tmp_path / "cold" / "vllm-cache", tmp_path / "warm" / "vllm-cache"
    original.mkdir(parents=True)
    (original / "graph").write_text("cold's")
    copy.mkdir(parents=True)
    (copy / "graph").write_text("warm's copy")
    with bench._standing_in(original, copy):
        assert (original / "graph").read_text() == "warm's copy"
        (original / "new").write_text("written by the restart")
    assert (copy / "new").exists() and not (original / "new").exists()
    assert (original / "graph").read_text() == "cold's" and not original.is_symlink()
    assert not (tmp_path / "cold" / "vllm-cache.parked").exists()


def test_the_second_restart_stands_at_the_first_engines_paths_and_sets_the_goal() -> None:
    """vLLM 0.26's first restart after a cold start built its warm-up's Triton kernels
    again (H100 run at d59c220: `warm`'s warm-up after graph capture 14.0 s, cold's 12.2
    s); `warm2` restarts from `warm`'s caches, at `cold`'s paths (vLLM hashes them into
    its compile key), and where it ran the restart goal is taken against it."""
    bench = _bench()
    assert bench._first_of("warm2") == "cold" and bench._first_of("warm") == "cold"
    assert bench._first_of("restart") == "mx-source" and bench._first_of("cold") == "cold"
    results = _results(warm={"compile_cache": "loaded"},
                       warm2={"ready_s": 45.0, "tokens": TOKENS, "model_loading_s": 4.0,
                              "compile_cache": "loaded"},
                       **{"mx-artifacts": {"compile_cache": "loaded"}})
    _table, summary = bench.report(results)
    assert summary["artifacts_over_warm"] == 0.667
    assert summary["artifacts_over_warm2"] == 0.889
    assert summary["goals"]["ready_le_0.85x_warm_restart"] is False
    results["cases"]["warm2"]["compile_cache"] = "compiled"
    _table, summary = bench.report(results)
    assert "artifacts_over_warm2" not in summary and "compiled again" in \
        summary["warm2_restart_invalid"]
    assert summary["goals"]["ready_le_0.85x_warm_restart"] is True


def test_the_graphs_are_told_loaded_from_an_index_or_compiled_again() -> None:
    """Run9 (H100, vLLM 0.26, torch 2.11): the pulled engine had no compiled-graph index
    and compiled its graphs again from inductor's cache; the second restart loaded them
    through its own index."""
    bench = _bench()
    logs = RUN / "run9-logs"
    pulled = bench._ours((logs / "mx-artifacts.log").read_text())
    assert (pulled["graphs"], pulled["graphs_s"], pulled["graph_index"]) == \
        ("compiled", 2.37, None)
    warm2 = bench._ours((logs / "warm2.log").read_text())
    assert (warm2["graphs"], warm2["graphs_s"]) == ("loaded", 1.072)
