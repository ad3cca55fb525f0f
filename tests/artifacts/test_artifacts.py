"""Artifact sets: paths, signatures, installation, and real pulls between processes.

The exchange tests run a real control plane (uvicorn, SQLite), a real source process
(``artifact_source.py``: pack, sign, publish, serve) and pull in this process, over the
local transport and over NIXL.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import stat
import sys
import tempfile

import pytest

from modelexpress.artifacts import (ArtifactFile, ArtifactKey, ArtifactSet, InstallUnit,
                                    check_relative_path, install_set, pull_artifacts)
from modelexpress.errors import ArtifactRefusedError, ConfigError

_HERE = pathlib.Path(__file__).resolve().parent
KEY = "artifact-test-key-0123456789"


# --- paths and sets ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["/etc/passwd", "a/../../b", "..", "a//b", "./a", "a/./b", "",
                                 "a\\b", "a\x00b", "x" * 2000])
def test_unsafe_paths_are_refused(bad: str) -> None:
    with pytest.raises(ArtifactRefusedError):
        check_relative_path(bad)


def test_safe_paths_pass() -> None:
    assert check_relative_path("torch_compile_cache/ab/c.so") == "torch_compile_cache/ab/c.so"


def _set(files: list[tuple[str, bytes]], **kw) -> tuple[ArtifactSet, memoryview]:
    blob, rows, off = b"", [], 0
    for path, data in files:
        rows.append(ArtifactFile("k", path, len(data), 0o644, hashlib.sha256(data).hexdigest(),
                                 off))
        blob += data
        off += len(data)
    return ArtifactSet(tuple(rows), **kw), memoryview(blob)


def test_a_set_round_trips_through_json_and_rejects_overlaps_and_duplicates() -> None:
    aset, _ = _set([("a/x", b"1"), ("a/y", b"22")], units=(InstallUnit("k", "a"),),
                   prefixes={"a": "sym"}, facts={"torch": "2"})
    assert ArtifactSet.from_json(aset.to_json()) == aset
    data = aset.to_json()
    data["files"][1][5] = 0  # overlaps the first file
    with pytest.raises(ArtifactRefusedError, match="overlaps"):
        ArtifactSet.from_json(data)
    data = aset.to_json()
    data["files"][1][1] = "a/x"
    with pytest.raises(ArtifactRefusedError, match="twice"):
        ArtifactSet.from_json(data)
    data = aset.to_json()
    data["files"][0][1] = "../escape"
    with pytest.raises(ArtifactRefusedError):
        ArtifactSet.from_json(data)
    with pytest.raises(ArtifactRefusedError, match="format"):
        ArtifactSet.from_json({"format": "other"})


# --- signatures --------------------------------------------------------------------------------
def test_signatures_name_the_key_and_catch_any_change(tmp_path: pathlib.Path) -> None:
    key, other = ArtifactKey(KEY.encode()), ArtifactKey(b"another-key-0123456789")
    payload = b'{"files":[]}'
    sig = key.sign(payload)
    key.verify(payload, sig)
    with pytest.raises(ArtifactRefusedError, match="another key"):
        other.verify(payload, sig)
    with pytest.raises(ArtifactRefusedError, match="changed after"):
        key.verify(payload + b" ", sig)
    with pytest.raises(ArtifactRefusedError, match="not signed"):
        key.verify(payload, None)
    keyfile = tmp_path / "key"
    keyfile.write_text(KEY + "\n")
    assert ArtifactKey.from_setting(f"file:{keyfile}").key_id == key.key_id
    assert ArtifactKey.from_setting(None) is None
    with pytest.raises(ConfigError, match="at least 16"):
        ArtifactKey.from_setting("short")
    with pytest.raises(ConfigError, match="cannot read"):
        ArtifactKey.from_setting(f"file:{tmp_path / 'missing'}")
    assert KEY not in repr(key)


# --- installation ------------------------------------------------------------------------------
def test_install_maps_prefixes_keeps_modes_and_leaves_no_staging(tmp_path: pathlib.Path) -> None:
    aset, blob = _set([("src/shared/k1.so", b"kernel"), ("src/rank_0_0/model", b"aot")],
                      units=(InstallUnit("k", "src/rank_0_0"),), prefixes={"src": "sym"})
    files = list(aset.files)
    files[0] = ArtifactFile(*[getattr(files[0], f) for f in ("kind", "path", "size")], 0o755,
                            files[0].sha256, files[0].offset)
    aset = ArtifactSet(tuple(files), aset.units, aset.prefixes)
    result = install_set(aset, blob, {"k": tmp_path}, {"sym": "mine/H2"})
    assert result.outcome == "installed" and result.files == 2, result
    assert (tmp_path / "mine/H2/shared/k1.so").read_bytes() == b"kernel"
    assert (tmp_path / "mine/H2/rank_0_0/model").read_bytes() == b"aot"
    assert stat.S_IMODE(os.stat(tmp_path / "mine/H2/shared/k1.so").st_mode) == 0o755
    assert not list(tmp_path.glob(".mx-artifacts-staging-*"))
    # a prefix this target has no mapping for is not installed at all
    other = tmp_path / "other"
    assert install_set(aset, blob, {"k": other}, {}).files == 0


def test_every_staged_file_is_fsynced_before_anything_is_placed(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A power loss after the install leaves either no cache or a whole one: the files
    are made durable in staging (fsynced from several threads) before the first link or
    rename puts any of them where vLLM reads."""
    files = [(f"c/shared/k{i}.so", bytes([i]) * (100 + i)) for i in range(40)]
    aset, blob = _set(files + [("c/rank_0_0/model", b"aot")],
                      units=(InstallUnit("k", "c/rank_0_0"),))
    events: list[tuple[str, str]] = []
    real_fsync, real_link, real_rename = os.fsync, os.link, os.rename

    def fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def link(src, dst, *a, **kw) -> None:
        events.append(("place", str(dst)))
        real_link(src, dst, *a, **kw)

    def rename(src, dst, *a, **kw) -> None:
        events.append(("place", str(dst)))
        real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "rename", rename)
    result = install_set(aset, blob, {"k": tmp_path})
    assert result.outcome == "installed" and result.files == 41, result
    kinds = [kind for kind, _ in events]
    first_place = kinds.index("place")
    synced = {pathlib.PurePath(path).name for kind, path in events[:first_place]
              if kind == "fsync"}
    assert synced == {pathlib.PurePath(f.path).name for f in aset.files}, synced
    assert "fsync" not in kinds[first_place:]


def test_two_kinds_installed_under_one_root_merge_without_replacing(tmp_path: pathlib.Path) -> None:
    """Triton's entries from a source's two Triton directories (two kinds) go to one
    directory on the target: both install, a file both carry is kept once."""
    data = {("triton", "e1/k.cubin"): b"one", ("triton_vllm", "e2/k.cubin"): b"two",
            ("triton_vllm", "e1/k.cubin"): b"one"}
    blob, rows, off = b"", [], 0
    for (kind, path), content in data.items():
        rows.append(ArtifactFile(kind, path, len(content), 0o644,
                                 hashlib.sha256(content).hexdigest(), off))
        blob += content
        off += len(content)
    root = tmp_path / "triton"
    result = install_set(ArtifactSet(tuple(rows)), memoryview(blob),
                         {"triton": root, "triton_vllm": root})
    assert result.outcome == "installed" and result.files == 2 and result.kept == 1, result
    assert (root / "e1/k.cubin").read_bytes() == b"one"
    assert (root / "e2/k.cubin").read_bytes() == b"two"
    assert not list(root.glob(".mx-artifacts-staging-*"))


def test_an_engines_own_cache_is_never_touched(tmp_path: pathlib.Path) -> None:
    aset, blob = _set([("c/shared/k1.so", b"new"), ("c/rank_0_0/model", b"new")],
                      units=(InstallUnit("k", "c/rank_0_0"),))
    (tmp_path / "c/rank_0_0").mkdir(parents=True)
    (tmp_path / "c/rank_0_0/model").write_bytes(b"own")
    result = install_set(aset, blob, {"k": tmp_path})
    assert result.outcome == "present" and "already exists" in result.reason
    assert (tmp_path / "c/rank_0_0/model").read_bytes() == b"own"
    assert not (tmp_path / "c/shared/k1.so").exists()
    # a content-addressed file already there is kept, never overwritten
    (tmp_path / "d/shared").mkdir(parents=True)
    (tmp_path / "d/shared/k1.so").write_bytes(b"theirs")
    aset2, blob2 = _set([("d/shared/k1.so", b"new"), ("d/rank_0_0/model", b"m")],
                        units=(InstallUnit("k", "d/rank_0_0"),))
    result = install_set(aset2, blob2, {"k": tmp_path})
    assert result.outcome == "installed" and result.kept == 1
    assert (tmp_path / "d/shared/k1.so").read_bytes() == b"theirs"


def test_a_digest_mismatch_installs_nothing(tmp_path: pathlib.Path) -> None:
    aset, blob = _set([("c/a", b"aaaa"), ("c/rank_0_0/model", b"bbbb")],
                      units=(InstallUnit("k", "c/rank_0_0"),))
    bad = bytearray(blob)
    bad[5] ^= 1
    with pytest.raises(ArtifactRefusedError, match="digest mismatch for artifact k:c/rank_0_0"):
        install_set(aset, memoryview(bytes(bad)), {"k": tmp_path})
    assert list(tmp_path.iterdir()) == []


def test_a_mapped_path_cannot_leave_its_root(tmp_path: pathlib.Path) -> None:
    aset, blob = _set([("c/a", b"x")], prefixes={"c": "sym"})
    with pytest.raises(ArtifactRefusedError):
        install_set(aset, blob, {"k": tmp_path}, {"sym": "../outside"})
    assert not (tmp_path.parent / "outside").exists()


# --- real pulls between processes --------------------------------------------------------------
@pytest.fixture
def server(tmp_path: pathlib.Path):  # noqa: ANN201
    sys.path.insert(0, str(_HERE.parent / "server"))
    from mx_server_procs import ServerProc

    srv = ServerProc(f"sqlite:///{tmp_path}/mx.db", tmp_path).start()
    yield srv
    srv.stop()


def _cache_dir(root: pathlib.Path) -> pathlib.Path:
    """A small cache: shared content-addressed files and one rank directory."""
    files = {"cache/shared/ab/cabc.so": os.urandom(70_000), "cache/shared/ab/cabc.cpp": b"int f;",
             "cache/rank_0_0/model": os.urandom(5_000), "cache/locks/x.lock": b""}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    os.chmod(root / "cache/shared/ab/cabc.so", 0o755)
    return root


def _source(server, root: pathlib.Path, log: pathlib.Path, *args: str, key: str = KEY,  # noqa: ANN001
            ipc_dir: str = "off"):
    from modelexpress._subproc import ModuleProcess, clean_env

    proc = ModuleProcess(["artifact_source", "--server", server.url, "--token", server.token,
                          "--root", str(root), "--key", key, "--ipc-dir", ipc_dir, *args],
                         log, clean_env(PYTHONPATH=os.pathsep.join(
                             [str(_HERE), os.environ.get("PYTHONPATH", "")])), cwd=_HERE)
    return proc, proc.json_line(120.0)


def _pull(server, target: pathlib.Path, *, key: str | None = KEY, ipc_dir: str = "off",  # noqa: ANN001
          facts: dict[str, str] | None = None):
    from modelexpress.client import MxClient
    from modelexpress.identity import ModelIdentity
    from modelexpress.local import LocalOptions
    from modelexpress.p2p import PullOptions

    identity = ModelIdentity(model="artifact-test", extra=(("kind", "artifacts-test"),))
    with MxClient(server.url, token=server.token, timeout_s=10.0) as client:
        return pull_artifacts(identity, key=ArtifactKey(key.encode()) if key else None,
                              client=client, roots={"k": target}, mapping={"sym:cache": "mine"},
                              options=PullOptions(timeout_s=60, local=LocalOptions(ipc_dir)),
                              check_facts=facts)


@pytest.mark.nixl
@pytest.mark.parametrize("transport", ["local", "nixl"])
def test_a_signed_set_is_pulled_verified_and_installed(server, tmp_path, transport) -> None:  # noqa: ANN001
    ipc = tempfile.mkdtemp(prefix="mx-ipc-") if transport == "local" else "off"
    src = _cache_dir(tmp_path / "src")
    proc, info = _source(server, src, tmp_path / "source.log", ipc_dir=ipc)
    try:
        result = _pull(server, tmp_path / "dst", ipc_dir=ipc)
        assert result.outcome == "installed", result
        assert result.source_id == info["source_id"] and result.files == 3
        assert (result.transport == "local") == (transport == "local"), result.transport
        for rel in ("shared/ab/cabc.so", "shared/ab/cabc.cpp", "rank_0_0/model"):
            assert (tmp_path / "dst/mine" / rel).read_bytes() == (src / "cache" / rel).read_bytes()
        assert os.stat(tmp_path / "dst/mine/shared/ab/cabc.so").st_mode & 0o100
        assert not (tmp_path / "dst/mine/locks").exists()  # lock files never travel
        # pulled again: the rank directory is there now, so nothing is touched
        again = _pull(server, tmp_path / "dst", ipc_dir=ipc)
        assert again.outcome == "present", again
    finally:
        proc.stop()
        if ipc != "off":
            shutil.rmtree(ipc, ignore_errors=True)


@pytest.mark.nixl
def test_another_key_a_tampered_blob_and_foreign_facts_are_refused(server, tmp_path) -> None:  # noqa: ANN001
    src = _cache_dir(tmp_path / "src")
    proc, _ = _source(server, src, tmp_path / "s1.log", key="the-other-fleets-key-987654")
    try:
        result = _pull(server, tmp_path / "dst1")
        assert result.outcome == "refused" and "another key" in result.reason, result
        assert not (tmp_path / "dst1").exists() or not list((tmp_path / "dst1").rglob("*"))
    finally:
        proc.stop()
    proc, _ = _source(server, src, tmp_path / "s2.log", "--tamper")
    try:
        result = _pull(server, tmp_path / "dst2")
        assert result.outcome == "refused" and "digest mismatch" in result.reason, result
        assert not list((tmp_path / "dst2").rglob("*.so"))
    finally:
        proc.stop()
    proc, _ = _source(server, src, tmp_path / "s3.log", "--fact", "torch=0.0.1")
    try:
        result = _pull(server, tmp_path / "dst3", facts={"torch": "2.13.0"})
        assert result.outcome == "refused" and "torch" in result.reason, result
    finally:
        proc.stop()


@pytest.mark.nixl
def test_no_source_is_a_miss_and_no_key_is_off(server, tmp_path) -> None:  # noqa: ANN001
    assert _pull(server, tmp_path / "d").outcome == "miss"
    assert _pull(server, tmp_path / "d", key=None).outcome == "off"


def test_a_signature_binds_the_identity_it_was_made_for() -> None:
    from modelexpress.artifacts import signed_payload

    key = ArtifactKey(KEY.encode())
    aset, _ = _set([("a/x", b"1")])
    sig = key.sign(signed_payload("a" * 32, aset))
    key.verify(signed_payload("a" * 32, aset), sig)
    with pytest.raises(ArtifactRefusedError, match="changed after"):
        key.verify(signed_payload("b" * 32, aset), sig)  # republished under another identity


@pytest.mark.nixl
def test_replicas_serve_sets_side_by_side_and_a_target_pulls_one_content(server, tmp_path) -> None:  # noqa: ANN001
    """Replicas that compiled for themselves serve other bytes under one identity: no
    409; a target takes the content most replicas serve, reads only from those, and
    serving what it installed publishes exactly that content again."""
    import numpy as np

    from modelexpress.artifacts import buffer_from, serve_packed
    from modelexpress.client import MxClient
    from modelexpress.identity import ModelIdentity
    from modelexpress.local import LocalOptions

    one, other = _cache_dir(tmp_path / "one"), _cache_dir(tmp_path / "other")
    procs = []
    try:
        for name, root in (("a", one), ("b", other), ("a2", one)):
            proc, info = _source(server, root, tmp_path / f"{name}.log")
            procs.append(proc)
        with MxClient(server.url, token=server.token, timeout_s=10.0) as client:
            ident = ModelIdentity(model="artifact-test", extra=(("kind", "artifacts-test"),))
            ready = client.list_sources(identity=ident, state="READY")
            assert len(ready) == 3 and len({s.fingerprint for s in ready}) == 2
            result = _pull(server, tmp_path / "dst")
            assert result.outcome == "installed" and result.variants == 2, result
            for rel in ("shared/ab/cabc.so", "rank_0_0/model"):
                assert (tmp_path / "dst/mine" / rel).read_bytes() == \
                    (one / "cache" / rel).read_bytes()
            # the target serves the set it installed, byte for byte: the same content
            raw = memoryview(np.ascontiguousarray(result.blob.numpy())).cast("B")
            handle = serve_packed(ident, result.aset, buffer_from(raw[:result.aset.total_bytes]),
                                  key=ArtifactKey(KEY.encode()), client=client,
                                  local=LocalOptions(ipc_dir="off"), heartbeat_interval_s=0.5)
            try:
                mine = client.get_source(handle.source_id)
                theirs = client.get_source(result.source_id)
                assert mine.state == "READY" and mine.fingerprint == theirs.fingerprint
            finally:
                handle.close()
    finally:
        for proc in procs:
            proc.stop()
