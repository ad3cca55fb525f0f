"""Every pull is a transfer the server knows: created, progressed, stoppable, finished.

Real server, real sources (``modelexpress publish`` processes), real NIXL; the pull
runs in this process through :func:`modelexpress.p2p.pull`, as the CLI and the vLLM
loader run it.
"""

from __future__ import annotations

import pathlib
import threading

import pytest
import torch

from conftest import MODEL, Cluster
from modelexpress.checkpoint import load_checkpoint, real_model_checkpoint
from modelexpress.errors import TransferCancelledError, TransferTimeoutError
from modelexpress.identity import ModelIdentity
from modelexpress.local import LocalOptions
from modelexpress.p2p import PullOptions, pull

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

IDENTITY = ModelIdentity(model=MODEL, dtype="float32")


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_checkpoint(real_model_checkpoint())


def _empty_like(ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.empty_like(t) for name, t in ref.items()}


def _record_of(cluster: Cluster, worker: str, deadline_s: float = 60.0):  # noqa: ANN202
    return cluster.wait_for(lambda: next(iter(cluster.client.list_transfers(
        target_worker=worker)), None), f"the transfer record of {worker}", deadline_s)


def test_a_library_pull_is_recorded_from_start_to_finish(cluster: Cluster, reference,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _, published = cluster.source()
    reports: list[tuple[int, int]] = []
    real_report = cluster.client.report_progress

    def report_progress(transfer_id, done, total, *args, **kwargs):  # noqa: ANN001, ANN202
        reports.append((done, total))
        return real_report(transfer_id, done, total, *args, **kwargs)

    monkeypatch.setattr(cluster.client, "report_progress", report_progress)
    asked: list[str] = []
    real_get = cluster.client.get_source
    monkeypatch.setattr(cluster.client, "get_source",
                        lambda source_id: asked.append(source_id) or real_get(source_id))
    result = pull(IDENTITY, _empty_like(reference), client=cluster.client,
                  options=PullOptions(timeout_s=120, worker_id="lib-pull-1"))
    assert result.transfer_id is not None
    record = cluster.client.get_transfer(result.transfer_id)
    assert record.state == "SUCCEEDED" and record.run_by_target and record.claimed
    assert record.target_worker == "lib-pull-1"
    assert record.source_id == published["source_id"] == result.source_ids[0]
    assert record.candidates == (published["source_id"],)
    assert record.bytes_done == record.bytes_total == result.bytes > 0
    # one progress report, RUNNING with the total before any byte moved; the finish
    # carried the last one's totals and rate (API version 6)
    assert reports == [(0, result.bytes)]
    assert record.rate_bps == pytest.approx(result.gbps * 1e9)
    assert asked == []  # the source's record came with the transfer's (API version 6)
    # the outcome the server exports: the transport (one host: the local transport,
    # observed by our own copies), the verdict, both times
    assert record.outcome is not None
    assert record.outcome.transport == result.transport == "local"
    assert record.outcome.verdict == result.verdict
    assert record.outcome.data_plane_s == pytest.approx(result.seconds)
    assert 0 < record.outcome.total_s <= result.total_seconds


def test_a_library_pull_stops_when_its_transfer_is_stopped_through_the_api(
        cluster: Cluster, reference) -> None:
    cluster.source()
    outcome: dict[str, BaseException | object] = {}

    def run() -> None:
        try:
            # ~90 MB at 0.01 GB/s in 1 MiB chunks: seconds to stop it in.
            outcome["result"] = pull(IDENTITY, _empty_like(reference), client=cluster.client,
                                     options=PullOptions(
                                         timeout_s=120, worker_id="lib-pull-2", max_gbps=0.01,
                                         chunk_bytes=1 << 20, progress_interval_s=0.1))
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    try:
        record = _record_of(cluster, "lib-pull-2")
        cluster.wait_for(lambda: cluster.client.get_transfer(record.id).state == "RUNNING",
                         "the pull to report progress")
        cluster.client.stop_transfer(record.id)
    finally:
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), TransferCancelledError), outcome
    final = cluster.client.get_transfer(record.id)
    assert final.state == "STOPPED" and 0 < final.bytes_done < final.bytes_total


def test_a_failed_pull_is_recorded_failed_with_its_reason(cluster: Cluster, reference) -> None:
    cluster.source()
    with pytest.raises(TransferTimeoutError):
        pull(IDENTITY, _empty_like(reference), client=cluster.client,
             options=PullOptions(timeout_s=2.0, worker_id="lib-pull-3", max_gbps=0.005,
                                 chunk_bytes=1 << 20))
    record = _record_of(cluster, "lib-pull-3")
    assert record.state == "FAILED" and "TransferTimeoutError" in (record.error or "")


def test_a_source_of_another_checkpoint_under_the_same_identity_never_serves_a_pull(
        cluster: Cluster, reference, tmp_path: pathlib.Path) -> None:
    """A second checkpoint published under the same identity is refused by the server
    (one layout per identity), so every pull reads the one that fits its destination.
    (``pull`` also skips, with the reason, a candidate whose tensors do not fit.)"""
    from safetensors.torch import save_file

    other = dict(reference)
    dropped = sorted(other)[-1]
    del other[dropped]
    odd = tmp_path / "other-ckpt"
    odd.mkdir()
    save_file(other, str(odd / "model.safetensors"))
    _, good = cluster.source("good")
    _, bad = cluster.source("bad", checkpoint=odd)
    assert bad.get("ok") is False and "ConflictError" in bad.get("error", ""), bad
    assert dropped in bad["error"]
    for i in range(2):
        result = pull(IDENTITY, _empty_like(reference), client=cluster.client,
                      options=PullOptions(timeout_s=120, worker_id=f"lib-pull-4-{i}"))
        assert result.source_ids == (good["source_id"],) and result.verified
        assert result.skipped == ()


def test_a_rate_capped_pull_is_not_reported_as_a_slow_transport(cluster: Cluster,
                                                                reference) -> None:
    """The cap sleeps between chunks; that time is the caller's, not the link's.
    (Over NIXL, whose rate is judged: the local transport is off for this pull.)"""
    cluster.source()
    result = pull(IDENTITY, _empty_like(reference), client=cluster.client,
                  options=PullOptions(timeout_s=120, worker_id="lib-pull-5", max_gbps=0.05,
                                      chunk_bytes=4 << 20, refuse_slow_transport=True,
                                      local=LocalOptions(ipc_dir="off")))
    assert result.warnings == () and result.gbps < 0.2
    assert result.transport == "cma"  # what UCX reported for this peer
