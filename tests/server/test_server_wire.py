"""The reply models are defined once (modelexpress.wire), used by the server and the client."""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import sys

import pytest

from conftest import make_identity, manifest
from modelexpress import client as client_mod
from modelexpress import wire
from modelexpress.client import MxClient, SourceInfo, TransferInfo
from modelexpress.errors import ControlPlaneError
from modelexpress.server import models
from modelexpress.server.states import SourceState, TransferState


def test_the_server_replies_with_the_classes_the_client_parses() -> None:
    assert models.SourceOut is wire.SourceSummary
    assert models.SourceDetail is wire.SourceDetail
    assert models.TransferOut is client_mod.TransferInfo is wire.TransferInfo
    assert models.ProgressOut is client_mod.ProgressReply is wire.ProgressReply
    assert models.AgentOut is client_mod.AgentInfo is wire.AgentInfo
    assert issubclass(client_mod.SourceInfo, wire.SourceSummary)
    assert wire.SOURCE_STATES == tuple(s.value for s in SourceState)
    assert wire.TRANSFER_STATES == tuple(s.value for s in TransferState)


def test_the_wire_models_import_without_fastapi() -> None:
    code = ("import sys, modelexpress.wire, modelexpress.client; "
            "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_replies_ignore_unknown_keys_and_keep_dataclass_behaviour() -> None:
    row = {"id": "s", "identity_id": "0" * 32, "identity": {"model": "m"}, "worker_id": "w",
           "endpoint": "", "state": "READY", "created_at": 1.0, "updated_at": 2.0,
           "last_heartbeat": 3.0, "manifest_bytes": 7, "added_by_a_newer_server": 1}
    listed = SourceInfo.from_json(row)
    assert listed.manifest is None and listed.agent_metadata is None
    detail = SourceInfo.from_json({**row, "manifest": {"a": 1},
                                   "agent_metadata": base64.b64encode(b"\0\1").decode()})
    assert detail.agent_metadata == b"\0\1"
    assert dataclasses.asdict(listed)["state"] == "READY"
    with pytest.raises(dataclasses.FrozenInstanceError):
        listed.state = "STALE"  # type: ignore[misc]
    with pytest.raises(Exception, match="base64"):
        SourceInfo.from_json({**row, "agent_metadata": "not base64!"})


def test_client_parses_a_real_server_with_the_shared_models(client: MxClient) -> None:
    ident = make_identity("wire/model")
    meta = bytes(range(256))
    src = client.publish_source(ident, "wire-src", manifest=manifest(), agent_metadata=meta)
    assert isinstance(src, SourceInfo) and src.manifest is None
    got = client.get_source(src.id)
    assert got.agent_metadata == meta and got.manifest == manifest()
    t = client.start_transfer(ident, "wire-tgt", run_by_target=True)
    assert isinstance(t, TransferInfo) and t.candidates == (src.id,)
    # The CLI prints records as JSON through dataclasses.asdict.
    assert json.loads(json.dumps(dataclasses.asdict(t)))["candidates"] == [src.id]
    reply = client.report_progress(t.id, 1, 2)
    assert reply.stop is False and reply.transfer.state == "RUNNING"


def test_a_reply_that_does_not_fit_is_a_control_plane_error() -> None:
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"id": "t", "state": "NOT_A_STATE"})

    with MxClient("http://mx.test", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(ControlPlaneError, match="not a TransferInfo"):
            c.get_transfer("t")
