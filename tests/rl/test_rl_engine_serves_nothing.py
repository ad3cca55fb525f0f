"""An RL engine serves nothing: the source ``--load-format mx`` published after the load
from disk is withdrawn when the ``mx`` weight-transfer engine initializes (the weights
change under it with every update), and again before a load into a new target model.

The engine runs against a real control plane; the loader's tracked source is a
recording stand-in for the SourceHandle (what the loader registers after serving).
"""

from __future__ import annotations

import pathlib
import sys
import types
from collections.abc import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import TOKEN, ServerProc  # noqa: E402

pytestmark = [pytest.mark.vllm]


class _Closing:
    """Stands in for a SourceHandle / MxClient: records that it was closed."""

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("rl-serving")
    srv = ServerProc(f"sqlite:///{tmp}/mx.db", tmp).start()
    yield srv
    srv.stop()


def _engine(model):  # noqa: ANN001, ANN202
    from modelexpress.engines.vllm.weight_transfer import MxWeightTransferEngine
    vllm_config = types.SimpleNamespace(parallel_config=None, model_config=None)
    return MxWeightTransferEngine(None, vllm_config, "cpu", model)


def test_init_withdraws_the_source_the_loader_published_for_the_model(
        server: ServerProc, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from modelexpress.engines.vllm import loader
    from modelexpress.engines.vllm.weight_transfer import MxInitInfo

    monkeypatch.setenv("MX_SERVER_TOKEN", TOKEN)
    model = torch.nn.Linear(2, 2)
    handle, client = _Closing(), _Closing()
    loader._track_source(model, handle, client)
    engine = _engine(model)
    try:
        engine.init_transfer_engine(MxInitInfo(model="rl-run", server_url=server.url))
        assert handle.closed == 1 and client.closed == 1
        assert loader.stop_serving(model) is False  # nothing left to withdraw
    finally:
        engine.shutdown()


def test_a_new_update_target_is_withdrawn_before_the_load(
        server: ServerProc, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from modelexpress.engines.vllm import loader
    from modelexpress.engines.vllm.weight_transfer import MxInitInfo

    monkeypatch.setenv("MX_SERVER_TOKEN", TOKEN)
    engine = _engine(torch.nn.Linear(2, 2))
    try:
        engine.init_transfer_engine(MxInitInfo(model="rl-run", server_url=server.url))
        other = torch.nn.Linear(2, 2)
        handle = _Closing()
        loader._track_source(other, handle, _Closing())
        engine.set_weight_update_target(other, None)
        engine._stop_serving()  # what receive_weights does right before _load
        assert handle.closed == 1
    finally:
        engine.shutdown()
