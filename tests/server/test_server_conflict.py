"""Conflicting sources: a publish whose manifest serves other weights than a READY
source of the same identity is a 409 naming the first differing tensor (real servers)."""

from __future__ import annotations

import copy
import pathlib
import threading
import uuid
from typing import Any

import pytest

from conftest import make_identity
from modelexpress.client import MxClient
from modelexpress.errors import ConflictError
from mx_server_procs import TOKEN, RedisProc, ServerProc


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def real_manifest(host: str = "h1", base: int = 1 << 32, algo: str | None = "xxh3-64",
                  seed: int = 0, n: int = 4) -> dict[str, Any]:
    """Shaped like modelexpress.transfer.manifest.Manifest.to_json(): addresses, host and
    agent differ per source, the content (names, dtypes, shapes, digests) per weights."""
    return {"format": "modelexpress.manifest", "version": 1, "agent_name": _uid("agent"),
            "host": host, "digest_algorithm": algo,
            "tensors": [{"name": f"layers.{i}.weight", "dtype": "bfloat16", "shape": [64, 64],
                         "nbytes": 8192, "addr": base + 8192 * i, "device": "cpu",
                         "digest": None if algo is None else f"{seed + i:016x}"}
                        for i in range(n)],
            "regions": [[base, 8192 * n, 0]], "attributes": {"probe": host}}


def test_same_weights_elsewhere_publish_fine_other_weights_are_refused(client: MxClient) -> None:
    ident = make_identity(_uid("conflict"))
    first = client.publish_source(ident, "w1", manifest=real_manifest("h1"))
    # Same content from another host, other addresses, another probe: fine.
    second = client.publish_source(ident, "w2", manifest=real_manifest("h2", base=1 << 40))
    assert second.fingerprint == first.fingerprint != ""

    changed = real_manifest("h3")
    changed["tensors"][2]["digest"] = "f" * 16
    with pytest.raises(ConflictError, match=r"409.*layers\.2\.weight.*digest") as err:
        client.publish_source(ident, "w3", manifest=changed)
    assert first.id in str(err.value) or second.id in str(err.value)
    assert [s.worker_id for s in client.list_sources(identity=ident)] == ["w1", "w2"]

    reshaped = real_manifest("h3")
    reshaped["tensors"][0]["shape"] = [64, 32]
    with pytest.raises(ConflictError, match=r"layers\.0\.weight.*shape \[64, 32\] here, \[64, 64\] there"):
        client.publish_source(ident, "w3", manifest=reshaped, state="INITIALIZING")
    with pytest.raises(ConflictError, match=r"layers\.4\.weight.*here but not there"):
        client.publish_source(ident, "w3", manifest=real_manifest("h3", n=5))
    with pytest.raises(ConflictError, match=r"layers\.3\.weight.*there but not here"):
        client.publish_source(ident, "w3", manifest=real_manifest("h3", n=3))

    # Another revision is another identity: no conflict.
    other_rev = make_identity(ident.model, revision="v2")
    client.publish_source(other_rev, "w3", manifest=changed)


def test_a_source_may_republish_itself_and_digests_of_other_algorithms_do_not_conflict(
        client: MxClient) -> None:
    ident = make_identity(_uid("conflict"))
    client.publish_source(ident, "w1", manifest=real_manifest(seed=0))
    # A GPU target hashes with another algorithm: its digests are not comparable.
    wsum = client.publish_source(ident, "gpu", manifest=real_manifest(algo="wsum-i32-v1",
                                                                      seed=99))
    assert wsum.state == "READY"
    client.publish_source(ident, "nodigest", manifest=real_manifest(algo=None))

    lone = make_identity(_uid("lone"))
    client.publish_source(lone, "w1", manifest=real_manifest(seed=0))
    # The only READY source of its identity may replace its own content.
    assert client.publish_source(lone, "w1", manifest=real_manifest(seed=5)).state == "READY"


def _variant(seed: int, host: str = "h1") -> dict[str, Any]:
    manifest = real_manifest(host, seed=seed)
    manifest["attributes"] = {"mx_variants": "by-content"}
    return manifest


def test_content_variants_coexist_and_list_their_fingerprints(client: MxClient) -> None:
    """Compiled-artifact sets: replicas that compiled for themselves publish other
    bytes under one identity, declared as content variants; none is refused, and the
    fingerprints tell a reader which sources serve the same content."""
    ident = make_identity(_uid("variants"))
    a = client.publish_source(ident, "a", manifest=_variant(seed=0))
    b = client.publish_source(ident, "b", manifest=_variant(seed=100, host="h2"))
    a2 = client.publish_source(ident, "a2", manifest=_variant(seed=0, host="h3"))
    ready = client.list_sources(identity=ident, state="READY")
    assert sorted(s.worker_id for s in ready) == ["a", "a2", "b"]
    assert a.fingerprint == a2.fingerprint != b.fingerprint
    # A manifest that does not declare variants keeps the rule, against variants too.
    with pytest.raises(ConflictError, match="409"):
        client.publish_source(ident, "plain", manifest=real_manifest(seed=7))
    # A variant revived from STALE is not refused either.
    client.mark_stale(b.id)
    assert client.heartbeat(b.id).state == "READY"


def test_a_refused_republish_keeps_the_previous_record(client: MxClient) -> None:
    ident = make_identity(_uid("keep"))
    client.publish_source(ident, "w1", manifest=real_manifest(seed=0))
    mine = client.publish_source(ident, "w2", manifest=real_manifest(seed=0), endpoint="old:1")
    with pytest.raises(ConflictError):
        client.publish_source(ident, "w2", manifest=real_manifest(seed=7), endpoint="new:1")
    kept = client.get_source(mine.id)
    assert kept.endpoint == "old:1" and kept.manifest == real_manifest(seed=0) | {
        "agent_name": kept.manifest["agent_name"]}


def test_conflicts_count_only_against_ready_sources(client: MxClient) -> None:
    ident = make_identity(_uid("ready"))
    init = client.publish_source(ident, "w1", manifest=real_manifest(seed=0),
                                 state="INITIALIZING")
    stale = client.publish_source(ident, "w2", manifest=real_manifest(seed=1))
    client.mark_stale(stale.id)
    # Neither an INITIALIZING nor a STALE source blocks another content...
    ready = client.publish_source(ident, "w3", manifest=real_manifest(seed=2))
    # ...but neither can then become READY with its own.
    with pytest.raises(ConflictError, match=r"layers\.0\.weight.*digest"):
        client.heartbeat(init.id, "READY")
    assert client.get_source(init.id).state == "INITIALIZING"
    with pytest.raises(ConflictError, match=r"conflicts with READY source " + ready.id):
        client.heartbeat(stale.id)  # a heartbeat would revive it
    assert client.get_source(stale.id).state == "STALE"
    client.delete_source(ready.id)
    assert client.heartbeat(init.id, "READY").state == "READY"


@pytest.mark.redis
def test_racing_conflicting_publishes_on_two_replicas_never_both_stay(
        redis_proc: RedisProc, tmp_path: pathlib.Path) -> None:
    a = ServerProc(redis_proc.url, tmp_path).start()
    b = ServerProc(redis_proc.url, tmp_path).start()
    try:
        with MxClient(a.url, token=TOKEN, timeout_s=30.0) as ca, \
                MxClient(b.url, token=TOKEN, timeout_s=30.0) as cb:
            for i in range(15):
                ident = make_identity(_uid("race"))
                results: list[object] = [None, None]
                barrier = threading.Barrier(2)

                def run(k: int, c: MxClient, seed: int) -> None:
                    barrier.wait(timeout=60)
                    try:
                        results[k] = c.publish_source(ident, f"w{k}",
                                                      manifest=real_manifest(seed=seed))
                    except ConflictError as exc:
                        results[k] = exc

                threads = [threading.Thread(target=run, args=(0, ca, 0)),
                           threading.Thread(target=run, args=(1, cb, 1000))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=120)
                assert not any(t.is_alive() for t in threads)
                kept = ca.list_sources(identity=ident, state="READY")
                assert len(kept) <= 1, (i, results)
                assert sum(not isinstance(r, ConflictError) for r in results) == len(kept)
                assert {s.fingerprint for s in kept} <= {
                    r.fingerprint for r in results if not isinstance(r, ConflictError)}
    finally:
        a.stop()
        b.stop()


def test_a_manifest_without_tensors_conflicts_with_nothing(client: MxClient) -> None:
    ident = make_identity(_uid("opaque"))
    client.publish_source(ident, "w1", manifest={"blob": 1})
    client.publish_source(ident, "w2", manifest={"tensors": "not a list"})
    client.publish_source(ident, "w3", manifest=copy.deepcopy(real_manifest()))
