"""The trainer engine against engine clients that really pull (a real control plane,
real NIXL), without vLLM engines: what ``send_weights`` sends, who it finishes, and
what it says when an engine fails. Whole engines: ``tests/engines/test_vllm_rl.py``.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]


class PullingEngine:
    """A ``VLLMWeightSyncClient`` that does what an mx engine does with the bytes: pull
    the named version (digests checked) and keep it; ``refuse`` makes its update fail."""

    def __init__(self, url: str, refuse: str | None = None) -> None:
        self.url, self.refuse = url, refuse
        self.calls: list[str] = []
        self.weights: dict[str, Any] = {}
        self.version: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(f"init:{init_info['model']}")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: Any) -> None:
        from modelexpress.client import MxClient
        from modelexpress.identity import ModelIdentity
        from modelexpress.p2p.options import PullOptions
        from modelexpress.p2p.target import pull

        self.calls.append(f"update:{update_info['version']}")
        if self.refuse:
            raise RuntimeError(self.refuse)
        got: dict[str, Any] = {}
        with MxClient(self.url, token=TOKEN, timeout_s=30, retries=1) as client:
            for raw in update_info["identities"]:
                result = pull(ModelIdentity.from_dict(raw), None, client=client,
                              options=PullOptions(timeout_s=60, track=False),
                              on_destination=got.update)
                assert result.verified
        self.weights = got

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish:{weight_version}")
        self.version = weight_version


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[ServerProc]:
    srv = ServerProc(f"sqlite:///{tmp_path}/mx.db", tmp_path,
                     env={"MX_STALE_AFTER_S": "600"}).start()
    yield srv
    srv.stop()


@pytest.fixture
def mx_env(server: ServerProc, monkeypatch: pytest.MonkeyPatch) -> ServerProc:
    # The trainer is an entry point here: it reads MX_* like any trainer process.
    monkeypatch.setenv("MX_SERVER_URL", server.url)
    monkeypatch.setenv("MX_SERVER_TOKEN", TOKEN)
    monkeypatch.setenv("MX_HEARTBEAT_INTERVAL_S", "1")
    return server


def _policy(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"model.layers.0.mlp.up_proj.weight": torch.randn(24, 16, generator=g),
            "lm_head.weight": torch.randn(40, 16, generator=g)}


def test_send_weights_switches_every_engine_to_each_version_in_turn(mx_env) -> None:  # noqa: ANN001
    import torch
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from modelexpress.engines.vllm.plugin import register_weight_transfer
    from modelexpress.rl import FanOutClient, MxTrainerInitInfo, StateDictSource

    register_weight_transfer()
    engines = [PullingEngine(mx_env.url), PullingEngine(mx_env.url)]
    policy = _policy(0)
    sync = WeightTransferTrainerFactory.trainer_init(
        MxTrainerInitInfo(model="run-t", rank=0), client=FanOutClient(engines),
        source=StateDictSource(policy))
    try:
        for step in (1, 2, 3):
            with torch.no_grad():
                for name, t in _policy(step).items():
                    policy[name].copy_(t)  # the trainer's step changes its tensors in place
            report = sync.send_weights()
            assert report.version == str(step) and len(report.engine_seconds) == 2
            for e in engines:
                assert e.version == str(step)
                assert all(torch.equal(e.weights[n], t) for n, t in _policy(step).items())
        assert sync.pool.versions() == ["2", "3"]  # version 1 withdrawn, its slot reused
    finally:
        sync.shutdown()
    assert engines[0].calls == ["init:run-t", "start", "update:1", "finish:1", "start",
                                "update:2", "finish:2", "start", "update:3", "finish:3"]


def test_an_engine_that_fails_is_named_and_the_others_still_finish(mx_env) -> None:  # noqa: ANN001
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from modelexpress.engines.vllm.plugin import register_weight_transfer
    from modelexpress.errors import WeightUpdateError
    from modelexpress.rl import FanOutClient, MxTrainerInitInfo, StateDictSource

    register_weight_transfer()
    good, bad = PullingEngine(mx_env.url), PullingEngine(mx_env.url, refuse="disk on fire")
    sync = WeightTransferTrainerFactory.trainer_init(
        MxTrainerInitInfo(model="run-f", rank=0), client=FanOutClient([good, bad]),
        source=StateDictSource(_policy(5)))
    try:
        with pytest.raises(WeightUpdateError,
                           match=r"1 of 2 engines .* version 7 .*engine 1: RuntimeError: "
                                 r"disk on fire"):
            sync.send_weights(7)
        assert good.version == "7" and "finish:7" in good.calls
        assert bad.version is None and not any(c.startswith("finish") for c in bad.calls)
        # The count goes on after a numeric name; the broken engine still fails.
        with pytest.raises(WeightUpdateError, match="version 8"):
            sync.send_weights()
    finally:
        sync.shutdown()


def test_two_trainer_shards_publish_their_halves_and_engines_pull_both(mx_env) -> None:  # noqa: ANN001
    """Ranks that each hold part of the model publish what they hold; rank 0 sends the
    engines both shards' identities. (vLLM 0.32's source shape: ``None`` for a name
    another rank holds.)"""
    import torch
    from vllm.distributed.weight_transfer.base import WeightSource

    from modelexpress.engines.vllm.plugin import register_weight_transfer
    from modelexpress.rl import MxTrainerInitInfo, StateDictSource
    from modelexpress.rl.trainer import MxTrainerWeightTransferEngine

    if hasattr(WeightSource, "iter_full"):
        pytest.skip("this test builds vLLM 0.32's held_names source; 0.33 has owned_names")
    register_weight_transfer()
    policy = _policy(9)
    halves = [{"model.layers.0.mlp.up_proj.weight"}, {"lm_head.weight"}]

    class Half(StateDictSource):
        def __init__(self, held: set[str]) -> None:
            super().__init__(policy)
            self.held = held

        def held_names(self) -> set[str]:
            return self.held

        def __iter__(self):  # noqa: ANN204
            for name, t in policy.items():
                yield name, (t if name in self.held else None)

    engine = PullingEngine(mx_env.url)
    ranks = [MxTrainerWeightTransferEngine.trainer_init(
        MxTrainerInitInfo(model="run-s", rank=r, shards=2), client=engine,
        source=Half(halves[r])) for r in (1, 0)]
    try:
        ranks[0].send_weights(1)  # rank 1: publishes its half, drives nothing
        assert engine.calls == ["init:run-s"]
        ranks[1].send_weights(1)  # rank 0: its half, then the engines
        assert engine.version == "1"
        assert set(engine.weights) == set(policy)
        assert all(torch.equal(engine.weights[n], t) for n, t in policy.items())
    finally:
        for r in ranks:
            r.shutdown()
