"""The demo's GPU lines quote a recorded run, read from its log: nothing made up."""

from __future__ import annotations

import json
import pathlib

from modelexpress.demo import GPU_LOG, DemoResult, gpu_reference, render_summary

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _result() -> DemoResult:
    return DemoResult(ok=True, model="m", tensors=1, bytes=90_857_216,
                      transfer_state="SUCCEEDED", transfer_seconds=0.3, transfer_gbps=1.5,
                      disk_warm_seconds=0.03, disk_cold_seconds=0.1, mismatched=[],
                      exit_codes={"server": 0}, pull_command_seconds=2.5,
                      pull_total_seconds=1.0, pull_data_plane_seconds=0.06,
                      pull_phases={"imports": 0.9, "data_plane": 0.06, "agent": 0.7},
                      pull_command={"startup_seconds": 0.2, "resolve_seconds": 0.01,
                                    "pull_call_seconds": 1.0, "write_seconds": 0.15,
                                    "seconds_before_exit": 1.6})


def test_gpu_figures_are_the_recorded_logs() -> None:
    log = (ROOT / GPU_LOG).read_text()
    ref = gpu_reference(ROOT)
    assert ref.note == "" and ref.log == GPU_LOG
    assert ref.bytes == json.loads(log.splitlines()[-1])["bytes"]
    assert len(ref.pulls) == log.count("\npull: ")
    for pull in ref.pulls:
        assert f"pull: {pull.data_plane_gbps:.2f} GB/s data plane over {pull.transport}, " \
               f"{pull.end_to_end_gbps:.2f} GB/s end to end" in log
    text = render_summary(_result(), ref)
    assert GPU_LOG in text and "no recorded GPU run has them" in text
    assert "process exit (interpreter teardown)" in text


def test_without_the_logs_the_demo_says_so(tmp_path: pathlib.Path) -> None:
    ref = gpu_reference(tmp_path)
    assert not ref.pulls and "no recorded GPU run here" in ref.note
    text = render_summary(_result(), ref)
    assert "no recorded GPU run here" in text and "GB/s over cuda_ipc" not in text
