"""From zero: the origin finishing between a target's two looks (READY sources, then the
lease) must not make that target a second origin, nor must the model turning READY in
another form (the origin's engine serving its loaded form) at that moment; nor, when it
withdraws its origin source between a target's plan and its read, fail that target's
fetch.

The end-to-end tests (tests/storage/test_from_zero.py, three real vLLM engines in
tests/engines/test_vllm_engine_from_zero.py) run this loop against the real control
plane, where the interleaving below is a matter of timing: on a loaded 2-core CI machine
the third of three engines once read the checkpoint from S3 again. Here the control
plane is a stand-in that answers in exactly that order, with the real server's
semantics (an origin turns its source READY, then releases the lease; a released lease
is free to take and is released by a renewal with ``release=True``).
"""

from __future__ import annotations

import time
import types

import pytest

from modelexpress.errors import NotFoundError, ServedElsewhereError
from modelexpress.p2p.options import PullOptions
from modelexpress.p2p.zero import ZeroFetch, ZeroResult
from modelexpress.wire import OriginLease


class _ControlPlane:
    """The first origin finishes right after this target's first look for READY sources."""

    def __init__(self) -> None:
        self.ready_looks = 0
        self.acquired: list[int] = []
        self.released: list[int] = []

    def list_sources(self, identity, state):  # noqa: ANN001, ANN201 - MxClient's signature
        assert state == "READY"
        self.ready_looks += 1
        # first look: the origin is still loading; after it: READY (it released the lease)
        return [] if self.ready_looks == 1 else [object()]

    def get_origin(self, identity):  # noqa: ANN001, ANN201
        now = time.time()
        return OriginLease(identity_id="i", acquired_at=now - 5, renewed_at=now,
                           expires_at=now, ttl_s=10.0, holder="", generation=1, held=False)

    def acquire_origin(self, identity, holder, ttl_s):  # noqa: ANN001, ANN201
        now = time.time()
        self.acquired.append(2)
        return OriginLease(identity_id="i", acquired_at=now, renewed_at=now,
                           expires_at=now + ttl_s, ttl_s=ttl_s, holder=holder, generation=2,
                           held=True)

    def renew_origin(self, identity, holder, generation, ttl_s,  # noqa: ANN001, ANN201
                     *, release=False, **_):  # noqa: ANN001, ANN003
        assert release, "a target that reads nothing renews nothing"
        self.released.append(generation)
        raise NotFoundError("released meanwhile")  # either way the lease is not ours


def test_a_lease_won_after_the_origin_turned_ready_is_given_back_and_the_target_reads_the_peer(
        monkeypatch) -> None:
    plane = _ControlPlane()
    identity = types.SimpleNamespace(model="m", id="i")
    fetch = ZeroFetch(identity, storage=None, layout=None, client=plane,  # type: ignore[arg-type]
                      opts=PullOptions(timeout_s=30.0), worker="w3")
    peer = ZeroResult("peer", {}, 0, 0, 0.0, True)

    def originate(lease):  # noqa: ANN001, ANN202
        raise AssertionError("read storage although a READY source served the model")

    monkeypatch.setattr(fetch, "_originate", originate)
    monkeypatch.setattr(fetch, "_peer_pull", lambda: peer)
    assert fetch._loop() is peer
    assert plane.acquired == [2] and plane.released == [2]


class _RootGone:
    """The planned path's root (the origin's source) is withdrawn before the target
    reads it: the origin finished and its engine serves the model now."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, str]] = []

    def start_transfer(self, identity, worker, **_):  # noqa: ANN001, ANN003, ANN201
        return types.SimpleNamespace(id="t1", source_id="i:origin", relay_path=("s:i:origin",))

    def get_source(self, source_id):  # noqa: ANN001, ANN201
        raise NotFoundError(f"GET /v1/sources/{source_id}: HTTP 404: source not found")

    def finish_transfer(self, transfer_id, state, **_):  # noqa: ANN001, ANN003, ANN201
        self.finished.append((transfer_id, state))


def test_a_path_whose_origin_withdrew_meanwhile_is_given_up_and_looked_for_again() -> None:
    plane = _RootGone()
    identity = types.SimpleNamespace(model="m", id="i")
    fetch = ZeroFetch(identity, storage=None, layout=None, client=plane,  # type: ignore[arg-type]
                      opts=PullOptions(timeout_s=30.0), worker="w2")
    fetch.holding = types.SimpleNamespace()  # nothing held yet; never served from here
    assert fetch._follow() is False  # not a NotFoundError out of the fetch: disk had none
    assert plane.finished == [("t1", "FAILED")]


class _NothingReady(_ControlPlane):
    """No READY source of the checkpoint at any look, the lease free: a target would
    read storage, but for ``elsewhere``."""

    def list_sources(self, identity, state):  # noqa: ANN001, ANN201 - MxClient's signature
        assert state == "READY"
        self.ready_looks += 1
        return []

    def renew_origin(self, identity, holder, generation, ttl_s,  # noqa: ANN001, ANN201
                     *, release=False, **_):  # noqa: ANN001, ANN003
        assert release, "a target that reads nothing renews nothing"
        self.released.append(generation)


def test_a_lease_won_after_the_model_turned_ready_in_another_form_is_given_back(
        monkeypatch) -> None:
    """The origin's engine withdrew the checkpoint once it served its loaded form: this
    target saw neither, won the lease, and is told by ``elsewhere`` before it reads."""
    plane = _NothingReady()
    identity = types.SimpleNamespace(model="m", id="i")
    asked: list[int] = []

    def elsewhere() -> bool:
        asked.append(plane.ready_looks)
        return True

    fetch = ZeroFetch(identity, storage=None, layout=None, client=plane,  # type: ignore[arg-type]
                      opts=PullOptions(timeout_s=30.0), worker="w2", elsewhere=elsewhere)

    def originate(lease):  # noqa: ANN001, ANN202
        raise AssertionError("read storage although the loaded form was READY")

    monkeypatch.setattr(fetch, "_originate", originate)
    with pytest.raises(ServedElsewhereError, match="READY in another form"):
        fetch._loop()
    # asked once, after the lease was won and the checkpoint's sources looked at again
    assert asked == [2] and plane.acquired == [2] and plane.released == [2]


def test_without_elsewhere_the_winner_of_a_free_lease_reads_storage(monkeypatch) -> None:
    plane = _NothingReady()
    identity = types.SimpleNamespace(model="m", id="i")
    fetch = ZeroFetch(identity, storage=None, layout=None, client=plane,  # type: ignore[arg-type]
                      opts=PullOptions(timeout_s=30.0), worker="w2")
    origin = ZeroResult("origin", {}, 0, 0, 0.0, True)
    monkeypatch.setattr(fetch, "_originate", lambda lease: origin)
    assert fetch._loop() is origin and plane.released == []
