"""Client and server exchange an API version, and each works with the previous release.

The previous release is a real one: a git worktree of :data:`OLD_RELEASE` (the last
commit before versions were exchanged) at a temp path, its server started with
``python -m modelexpress.server`` from there with ``PYTHONPATH`` on that tree (its
``server/`` and ``engines/`` linked under its ``modelexpress/``, as the installed
package maps them, so that no module of this checkout is imported). Its client runs
the same way against this checkout's server.

- a new client against the old server: every call of the previous release works, a
  whole publish + pull included; what version 1 has no place for (a source's GPUs)
  is left out; a request the old server refuses anyway is one line naming both
  versions and "upgrade the server".
- the old client against the new server: everything it does works.
- a client older than the server serves is refused with a 426 naming both versions.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import httpx
import pytest

from modelexpress.client import MxClient
from modelexpress.errors import ControlPlaneError, NotFoundError, ValidationError
from modelexpress.identity import ModelIdentity
from modelexpress.wire import API_HEADER, API_VERSION, MIN_API_VERSION
from mx_server_procs import TOKEN, ServerProc, free_port

OLD_RELEASE = "fb298dc5482ba6fb5f075bbdc9c01b59acee0b1f"
"""The last commit whose server and client exchange no API version (API version 1)."""

OLDER_RELEASE = "3fa33f5267d7e80bd90b06603583b4e73a641269"
"""A server from before tracked pulls (no ``run_by_target``, no candidates route): the
HTTP 422 such a server answers; also version 1, and this client cannot work with it."""

REPO = pathlib.Path(__file__).resolve().parents[2]
_DEADLINE_S = 60.0
GPU = "GPU-8c3a5e4f-1b2c-4d5e-8f90-0123456789ab"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          check=True, timeout=120).stdout


@contextlib.contextmanager
def _release_tree(commit: str, parent: pathlib.Path) -> Iterator[pathlib.Path]:
    """A worktree of ``commit``, removed (worktree and its metadata) at the end."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and this repository's history")
    tree = parent / "tree"
    _git("worktree", "add", "--detach", str(tree), commit)
    try:
        # The installed package maps modelexpress.server -> server/ with a finder that
        # would resolve to THIS checkout; links make the old tree self-contained.
        for name in ("server", "engines"):
            (tree / "modelexpress" / name).symlink_to(f"../{name}")
        yield tree
    finally:
        _git("worktree", "remove", "--force", str(tree))
        _git("worktree", "prune")


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pathlib.Path]:
    """The previous release's tree."""
    with _release_tree(OLD_RELEASE, tmp_path_factory.mktemp("old-release")) as tree:
        yield tree


def _old_env(tree: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
    env["PYTHONPATH"] = str(tree)
    return env


class OldServer:
    """The previous release's ``python -m modelexpress.server`` (SQLite, token)."""

    def __init__(self, tree: pathlib.Path, tmp: pathlib.Path, token: str | None = TOKEN) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "old-server.log"
        env = {**_old_env(tree), **({"MX_SERVER_TOKEN": token} if token else {})}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "modelexpress.server", "--host", "127.0.0.1", "--port",
                 str(self.port), "--store", f"sqlite:///{tmp}/old.db"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        end = time.monotonic() + _DEADLINE_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"old server exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > end:
                self.stop()
                raise TimeoutError(f"old server not healthy: {self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def old_server(old_tree: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[OldServer]:
    srv = OldServer(old_tree, tmp_path_factory.mktemp("old-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def older_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OldServer]:
    tmp = tmp_path_factory.mktemp("older-release")
    with _release_tree(OLDER_RELEASE, tmp) as tree:
        srv = OldServer(tree, tmp, token=None)  # tokens came later too
        yield srv
        srv.stop()


def _identity(name: str) -> ModelIdentity:
    return ModelIdentity(model=f"versions/{name}", revision="r1", dtype="float32")


def test_the_old_server_is_the_previous_release(old_server: OldServer) -> None:
    """Its code is the old tree's: it declares no version, anywhere."""
    resp = httpx.get(f"{old_server.url}/v1/health", timeout=10)
    assert API_HEADER.lower() not in {k.lower() for k in resp.headers}
    assert "api_version" not in resp.json()
    spec = httpx.get(f"{old_server.url}/openapi.json", timeout=10,
                     headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert "devices" not in spec["components"]["schemas"]["SourcePublish"]["properties"]


def test_the_new_server_declares_its_version_on_every_reply(server: ServerProc) -> None:
    health = httpx.get(f"{server.url}/v1/health", timeout=10)
    assert health.headers[API_HEADER] == str(API_VERSION)
    assert health.json()["api_version"] == API_VERSION
    assert health.json()["min_api_version"] == MIN_API_VERSION
    denied = httpx.get(f"{server.url}/v1/sources", timeout=10)  # no token: 401, still versioned
    assert denied.status_code == 401 and denied.headers[API_HEADER] == str(API_VERSION)


def test_a_new_client_works_with_the_old_server_leaving_out_what_it_lacks(
        old_server: OldServer) -> None:
    with MxClient(old_server.url, token=TOKEN, timeout_s=30, retries=1) as c:
        assert c.health()["status"] == "ok"
        assert c.server_api_version == 1
        ident = _identity("new-client")
        manifest = {"format": "modelexpress.manifest", "version": 1, "tensors": []}
        src = c.publish_source(ident, "w1", manifest=manifest, agent_metadata=b"meta",
                               devices=[GPU])
        assert src.devices == ()  # version 1 keeps no GPUs; the manifest still may
        assert c.get_source(src.id).agent_metadata == b"meta"
        t = c.start_transfer(ident, "target-1", run_by_target=True)
        assert t.run_by_target and t.candidates == (src.id,)
        c.report_progress(t.id, 10, 100)
        done = c.finish_transfer(t.id, "SUCCEEDED", bytes_done=100,
                                 outcome={"transport": "tcp", "rate_bps": 1e6, "verdict": "ok"})
        assert done.state == "SUCCEEDED" and done.outcome is not None
        assert [s.id for s in c.rank_sources(ident)] == [src.id]
        # what a relaying engine's pull asks for (API version 3) is left out: no relay
        relayed = c.start_transfer(ident, "target-2", run_by_target=True, relay_read=True,
                                   relay_serve=True)
        assert relayed.candidates == (src.id,) and relayed.relay_path == ()
        # a layout (API version 5) is left out too: the source serves its own layout only
        laid = c.publish_source(ident, "w2", manifest=manifest, layout={"format": "x"})
        assert laid.layout_bytes == 0 and c.get_source(laid.id).layout is None
        # a pull across layouts cannot be asked of it: one line, naming what to upgrade
        with pytest.raises(ControlPlaneError) as err:
            c.start_transfer(ident, "target-3", run_by_target=True, across_layouts=True)
        assert "\n" not in str(err.value) and "API version 1" in str(err.value)
        assert "across parallel layouts need version 5: upgrade the server" in str(err.value)


def test_a_request_the_old_server_refuses_is_one_line_naming_both_versions(
        old_server: OldServer) -> None:
    with MxClient(old_server.url, token=TOKEN, timeout_s=30, retries=0) as c:
        body = {"identity": _identity("refused").to_dict(), "worker_id": "w", "manifest": {},
                "devices": [GPU]}  # what a version-2 body holds, sent to version 1 as is
        with pytest.raises(ValidationError) as err:
            c._request("PUT", "/v1/sources", json=body)
    line = str(err.value)
    assert "\n" not in line and "HTTP 422" in line and "devices" in line
    assert (f"speaks API version 1, this client version {API_VERSION}: upgrade the server"
            in line), line


@pytest.mark.nixl
def test_a_whole_pull_through_the_old_server(old_server: OldServer) -> None:
    """The library's publish and pull (tracked transfer, ranked candidates, progress,
    finish with its outcome) against the previous release's control plane, over NIXL,
    bytes checked."""
    import torch

    from modelexpress.local import LocalOptions
    from modelexpress.p2p import PullOptions, pull, serve_source

    ident = _identity("pull")
    tensors = {f"w{i}": torch.arange(1000 * (i + 1), dtype=torch.float32) for i in range(3)}
    got: dict[str, torch.Tensor] = {}
    with MxClient(old_server.url, token=TOKEN, timeout_s=30) as c:
        handle = serve_source(ident, tensors, client=c, heartbeat_interval_s=1.0)
        try:
            result = pull(ident, None, client=c, on_destination=got.update,
                          options=PullOptions(local=LocalOptions(ipc_dir="off")))
        finally:
            handle.close()
        assert result.verified and result.transfer_id is not None
        record = c.get_transfer(result.transfer_id)
        assert record.state == "SUCCEEDED" and record.outcome is not None
        assert record.outcome.transport == result.transport
        # the old server's finish sets no totals or rate: the last progress report did
        assert record.bytes_done == record.bytes_total == result.bytes
        assert record.rate_bps == pytest.approx(result.gbps * 1e9)
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def test_what_a_much_older_server_lacks_is_one_line_naming_both_versions(
        older_server: OldServer) -> None:
    """A server from before tracked pulls answers 422 to run_by_target and
    404 to the candidates route; each failure is one line saying whom to upgrade."""
    with MxClient(older_server.url, timeout_s=30, retries=0) as c:
        ident = _identity("older")
        src = c.publish_source(ident, "w", manifest={"tensors": []}, devices=[GPU])
        assert c.server_api_version == 1 and src.state == "READY"
        with pytest.raises(ValidationError) as err:
            c.start_transfer(ident, "target", run_by_target=True)
        refused = c.list_transfers()  # nothing was created
        with pytest.raises(NotFoundError) as missing:
            c.rank_sources(ident)
    for line in (str(err.value), str(missing.value)):
        assert "\n" not in line
        assert (f"speaks API version 1, this client version {API_VERSION}: upgrade the server"
                in line), line
    assert "run_by_target" in str(err.value) and refused == []
    assert "HTTP 404: Not Found" in str(missing.value)


_OLD_CLIENT = textwrap.dedent("""
    import json, sys
    import modelexpress, modelexpress.client as mc
    from modelexpress.client import MxClient
    from modelexpress.identity import ModelIdentity
    assert mc.__file__.startswith(sys.argv[3]), mc.__file__  # the old tree's client
    out = {}
    with MxClient(sys.argv[1], token=sys.argv[2], timeout_s=30) as c:
        out["health"] = c.health()["status"]
        ident = ModelIdentity(model="versions/old-client", revision="r1", dtype="float32")
        src = c.publish_source(ident, "old-w", manifest={"tensors": []}, agent_metadata=b"m")
        c.heartbeat(src.id)
        out["listed"] = [s.id for s in c.list_sources(identity=ident)]
        t = c.start_transfer(ident, "old-target", run_by_target=True)
        c.report_progress(t.id, 1, 2)
        t = c.finish_transfer(t.id, "SUCCEEDED", bytes_done=2,
                              outcome={"transport": "local", "verdict": "ok"})
        out["state"] = t.state
        out["source_id"] = src.id
        out["agent"] = c.register_agent("old-agent").id
        out["assignments"] = len(c.poll_assignments("old-agent", wait_s=0.1))
    print(json.dumps(out))
""")


def test_the_old_client_works_with_the_new_server(old_tree: pathlib.Path,
                                                  server: ServerProc) -> None:
    run = subprocess.run([sys.executable, "-c", _OLD_CLIENT, server.url, TOKEN,
                          str(old_tree)], env=_old_env(old_tree), capture_output=True,
                         text=True, timeout=120, cwd=old_tree.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["health"] == "ok" and out["state"] == "SUCCEEDED"
    assert out["listed"] == [out["source_id"]] and out["agent"] == "old-agent"
    with MxClient(server.url, token=TOKEN) as c:
        assert c.get_source(out["source_id"]).devices == ()


def test_a_new_client_records_its_gpus_on_the_new_server(server: ServerProc) -> None:
    with MxClient(server.url, token=TOKEN) as c:
        src = c.publish_source(_identity("gpus"), "w-gpu", manifest={"tensors": []},
                               devices=[GPU])
        assert c.server_api_version == API_VERSION
        assert src.devices == (GPU,) and c.get_source(src.id).devices == (GPU,)


def test_a_malformed_version_is_refused_and_no_version_is_version_1(
        server: ServerProc) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    resp = httpx.get(f"{server.url}/v1/sources", headers={**auth, API_HEADER: "0"}, timeout=10)
    assert resp.status_code == 400  # not a version at all
    assert "X-MX-API-Version: 0 is not a version" in resp.json()["detail"]
    # a client that declares nothing is version 1, which this server still serves
    assert httpx.get(f"{server.url}/v1/sources", headers=auth, timeout=10).status_code == 200
    assert MIN_API_VERSION == 1


def test_a_426_reaches_the_caller_as_the_servers_one_line() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers[API_HEADER] == str(API_VERSION)
        return httpx.Response(426, headers={API_HEADER: "9"}, json={
            "detail": f"this client speaks control-plane API version {API_VERSION}; this server "
                      "(modelexpress 9.0) speaks version 9 and serves clients of versions 8 to "
                      "9: upgrade the client"})

    with MxClient("http://mx.test", transport=httpx.MockTransport(handler), retries=0) as c:
        with pytest.raises(ControlPlaneError) as err:
            c.list_sources()
    assert str(err.value).endswith("upgrade the client") and "\n" not in str(err.value)


def test_each_replica_gets_the_body_its_own_version_takes() -> None:
    """Replicas of two releases behind one MX_SERVER_URL (mid-upgrade): the version-1
    replica never sees ``devices``; after failing over, the version-2 one gets them."""
    seen: dict[str, list] = {"old": [], "new": []}
    old_down = False

    def handler(request: httpx.Request) -> httpx.Response:
        which = "old" if request.url.host == "old.test" else "new"
        if which == "old" and old_down:
            raise httpx.ConnectError("refused", request=request)
        headers = {} if which == "old" else {API_HEADER: str(API_VERSION)}
        if request.url.path == "/v1/health":
            return httpx.Response(200, headers=headers, json={"status": "ok", "store": "x"})
        body = json.loads(request.content)
        seen[which].append(body)
        if which == "old" and "devices" in body:
            return httpx.Response(422, json={"detail": "body.devices: Extra inputs are not "
                                                       "permitted"})
        return httpx.Response(200, headers=headers, json={
            "id": "i:w", "identity_id": "0" * 32, "identity": {}, "worker_id": "w",
            "endpoint": "", "state": "READY", "created_at": 0, "updated_at": 0,
            "last_heartbeat": 0, "manifest_bytes": 2, "devices": body.get("devices", [])})

    with MxClient(["http://old.test", "http://new.test"], retries=0,
                  transport=httpx.MockTransport(handler)) as c:
        assert c.publish_source(_identity("mixed"), "w", manifest={}, devices=[GPU]).devices == ()
        old_down = True
        assert c.publish_source(_identity("mixed"), "w", manifest={},
                                devices=[GPU]).devices == (GPU,)
    assert [("devices" in b) for b in seen["old"]] == [False]
    assert [b.get("devices") for b in seen["new"]] == [[GPU]]
