"""Pulls across tensor-parallel layouts into each kind of memory, from sources in that kind.

Three source processes (``synthetic_source.py``) serve ranks of a hand-written layout
(``synthetic_layout.py``: merged qkv with one KV head on every rank, row-parallel
weights, a padded vocabulary, a replicated norm; no vLLM): both ranks of TP=2 and the
TP=1 rank, their tensors in one allocation on the device under test, their block
digests hashed there. A real server ranks them; this process assembles a rank with
:func:`~modelexpress.p2p.layout_pull.pull_across_layouts` into tensors on that device,
over the local transport and over NIXL, in a VMM arena and not, and compares every byte
with the checkpoint's slices.

``host``: host memory (every run). ``gpu``: cuda:0, which needs a GPU (the ``gpu``
marker: CI has none).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys
from collections.abc import Iterator

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
import synthetic_layout as syn  # noqa: E402
from layout_world import layout_sources  # noqa: E402
from mx_server_procs import ServerProc  # noqa: E402

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

_HERE = pathlib.Path(__file__).resolve().parent
_ARENA_BYTES = 256 << 20


@dataclasses.dataclass
class World:
    device: str
    server: ServerProc
    ipc: str
    sources: dict[str, str]

    def client(self):  # noqa: ANN201
        from modelexpress.client import MxClient

        return MxClient(self.server.url, token=self.server.token, timeout_s=30.0)


@pytest.fixture(scope="module", params=[
    pytest.param("cpu", id="host"),
    pytest.param("cuda:0", id="gpu", marks=pytest.mark.gpu),
])
def world(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    device = request.param
    tmp = tmp_path_factory.mktemp(f"layout-{device.replace(':', '')}")
    commands = {name: ["synthetic_source", str(tp), str(rank), device, name]
                for name, tp, rank in (("r0", 2, 0), ("r1", 2, 1), ("whole", 1, 0))}
    with layout_sources(tmp, commands, pythonpath=str(_HERE), ready_s=120) as (server, ipc, ids):
        yield World(device, server, ipc, ids)


@pytest.fixture
def arena_for(world: World) -> Iterator:
    """``arena_for(True)``: a VMM arena on the world's device (host: memfd chunks; GPU:
    CUDA VMM); ``arena_for(False)``: None."""
    from modelexpress.vmm import HostVmmBackend, VmmArena, maybe_enter_vmm_arena

    routings, arenas = [], []

    def make(wanted: bool):  # noqa: ANN202
        if not wanted:
            return None
        if world.device == "cpu":
            arena = VmmArena(_ARENA_BYTES, 0, HostVmmBackend())
        else:
            # as the vLLM loader does: this thread's CUDA allocations go to the arena
            # until the block ends; the arena itself stays open until closed
            routing = maybe_enter_vmm_arena(True, torch.device(world.device).index or 0,
                                            _ARENA_BYTES)
            arena = routing.__enter__()
            assert arena is not None, "no CUDA VMM arena on this GPU"
            routings.append(routing)
        arenas.append(arena)
        return arena

    yield make
    for routing in routings:  # the routing ends before its arena closes
        routing.__exit__(None, None, None)
    if routings:
        torch.cuda.synchronize()
    for arena in arenas:
        arena.close()


def _pull(world: World, tp: int, rank: int, *, local: bool, arena=None,  # noqa: ANN001, ANN202
          progress=None, covering_below: int | None = None,  # noqa: ANN001
          client_class=None, readers=None):  # noqa: ANN001
    """Pull rank ``rank`` of ``tp`` and compare every byte with the checkpoint's slices.
    ``client_class``: an MxClient subclass to talk through; ``readers(options)``: the
    reader factory to pull with."""
    from modelexpress.client import MxClient
    from modelexpress.local import LocalOptions
    from modelexpress.p2p import PullOptions
    from modelexpress.p2p.layout_pull import pull_across_layouts

    target = syn.layout(tp, rank)
    if arena is not None and world.device == "cpu":
        dest = {name: arena.empty(shape, dtype) for name, shape, dtype in syn.specs(target)}
    else:  # a CUDA arena: this thread's allocations are routed to it (arena_for)
        dest = {name: torch.empty(shape, dtype=dtype, device=world.device)
                for name, shape, dtype in syn.specs(target)}
    if arena is not None:
        base, size = arena.registered_range()
        assert all(base <= t.data_ptr() < base + size for t in dest.values()), \
            "a destination outside the arena"
    for t in dest.values():
        t.fill_(float("nan"))
    options = PullOptions(local=LocalOptions(ipc_dir=world.ipc if local else "off"),
                          worker_id=f"target-{tp}-{rank}-{local}-{arena is not None}",
                          stall_s=60.0, timeout_s=120.0)
    with (client_class or MxClient)(world.server.url, token=world.server.token,
                                    timeout_s=30.0) as client:
        out = pull_across_layouts(syn.identity(tp, rank), target, dest, client=client,
                                  options=options, progress=progress,
                                  covering_below=covering_below,
                                  readers=readers(options) if readers else None)
    expected = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in syn.specs(target)}
    syn.assemble(target, syn.checkpoint(), expected)
    for name, want in expected.items():
        assert dest[name].device == torch.device(world.device), name
        assert torch.equal(dest[name].cpu(), want), name
    return out


@pytest.mark.parametrize("arena", [False, True], ids=["plain", "arena"])
@pytest.mark.parametrize("local", [True, False], ids=["local", "nixl"])
def test_the_tp1_rank_from_both_tp2_ranks(world: World, arena_for, local: bool,  # noqa: ANN001
                                          arena: bool) -> None:
    out = _pull(world, 1, 0, local=local, arena=arena_for(arena))
    ids = world.sources
    # its own identity's source is for a same-layout pull, not this one
    assert set(out.result.source_ids) == {ids["r0"], ids["r1"]}
    assert out.result.verified and out.layout.tp_size == 1
    assert (out.result.transport == "local") == local, out.result.transport
    assert out.blocks.digests  # every block it assembled, checked


@pytest.mark.parametrize("covering_below", [0, 1 << 40], ids=["runs", "covering"])
def test_the_rows_of_row_parallel_weights_are_read_one_by_one_or_covered(
        world: World, covering_below: int) -> None:
    """The TP=2 ranks' ``o`` and ``down`` land in column halves of the TP=1 rank, a run
    per row: over the local transport each row is read on its own (``0``) or the shard
    as its covering span, gathered here; either way every byte equals the checkpoint's.
    Into a GPU such rows are one pitched copy whatever the threshold."""
    from modelexpress.layout.readers import (COVERING_BELOW, HOST_COVERING_BELOW,
                                             LocalLayoutReader)

    out = _pull(world, 1, 0, local=True, covering_below=covering_below)
    detail = out.result.transport_detail
    assert out.result.transport == "local" and out.result.verified
    if world.device == "cpu":
        covered = [int(n) for n in re.findall(r"(\d+) covering span\(s\)", detail)]
        assert len(covered) == 2, detail  # one line per source
        assert (sum(covered) == 0) == (covering_below == 0), detail
    else:
        assert "0 pitched" not in detail, detail
    # the default: covering into host memory only below 8 KiB, into a GPU below 64 KiB
    into_host = LocalLayoutReader(None, None)  # type: ignore[arg-type]
    into_gpu = LocalLayoutReader(None, None, 0)  # type: ignore[arg-type]
    assert into_host.covering_below == HOST_COVERING_BELOW == 8 << 10
    assert into_gpu.covering_below == COVERING_BELOW


@pytest.mark.parametrize("local", [True, False], ids=["local", "nixl"])
def test_a_tp2_rank_from_the_tp1_source(world: World, local: bool) -> None:
    """Its ``o`` and ``down`` are column halves of the source's rows: short runs, read as
    covering spans (more bytes than the plan's) and gathered here. Progress stays in the
    plan's bytes: a report past the total is refused by the control plane (HTTP 422)."""
    reports: list[tuple[int, int]] = []
    out = _pull(world, 2, 1, local=local, progress=lambda done, total: reports.append((done, total)))
    assert out.result.source_ids == (world.sources["whole"],)
    assert (out.result.transport == "local") == local, out.result.transport
    total = reports[-1][1]
    assert all(t == total for _, t in reports) and all(d <= total for d, _ in reports), reports
    assert reports[-1][0] == total, reports
    assert [d for d, _ in reports] == sorted(d for d, _ in reports), reports


def test_the_final_report_and_the_finish_count_as_control_plane(world: World) -> None:
    """The finish counts in the ``control_plane`` phase, as a same-layout pull's does: a
    finish slowed by 0.3 s shows there, and the phases still add up to the call. It is
    the pull's last request (API version 6): it carries the totals, the rate and the
    source read last; the one progress report is the first (RUNNING, with the total)."""
    import time

    from modelexpress.client import MxClient

    reports: list[tuple[int, int]] = []

    class Client(MxClient):
        def finish_transfer(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            time.sleep(0.3)
            return super().finish_transfer(*args, **kwargs)

        def report_progress(self, transfer_id, done, total, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
            reports.append((done, total))
            return super().report_progress(transfer_id, done, total, *args, **kwargs)

    out = _pull(world, 1, 0, local=True, client_class=Client)
    with world.client() as client:
        record = client.get_transfer(out.result.transfer_id)
    assert record.state == "SUCCEEDED"
    assert set(out.result.source_ids) == {world.sources["r0"], world.sources["r1"]}
    assert reports == [(0, out.result.bytes)]
    assert record.bytes_done == record.bytes_total == out.result.bytes
    assert record.source_id == out.result.source_ids[-1]  # the source read last
    assert record.rate_bps == pytest.approx(out.result.gbps * 1e9)
    phases = out.result.phases
    assert phases["control_plane"] >= 0.3, phases
    assert sum(phases.values()) == pytest.approx(out.result.total_seconds, abs=1e-4)


def test_only_the_records_of_the_sources_a_rank_needs_are_fetched(world: World) -> None:
    """The candidates' records are fetched in the server's order until they hold a whole
    layout, the first of them with the transfer's record (API version 6). A TP=2 rank 1
    fetches the TP=1 source's record alone (its own identity's source, TP=2 rank 1, is
    for a same-layout pull; TP=2 rank 0 is not needed). A TP=4 rank 1 fetches the TP=1
    source's; when that one cannot be opened it is dropped, no plan covers the rank,
    and the next whole layout's records are fetched: both TP=2 ranks, of which rank 0
    holds all of TP=4 rank 1."""
    from modelexpress.client import MxClient
    from modelexpress.errors import PeerError
    from modelexpress.p2p.layout_pull import layout_readers

    fetched: list[tuple[str, str]] = []  # (how: with the transfer or asked for, source)

    class Client(MxClient):
        def start_transfer(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            record = super().start_transfer(*args, **kwargs)
            fetched.extend(("with the transfer", r.id) for r in record.records)
            return record

        def get_source(self, source_id: str):  # noqa: ANN201
            fetched.append(("asked for", source_id))
            return super().get_source(source_id)

    class Refuses:
        def __init__(self, key: str) -> None:
            self.key = key

        def open(self) -> None:
            raise PeerError(f"{self.key}: refused the connection (test)")

        def read_copies(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            raise AssertionError("a source that could not be opened was read")

    def pull(tp: int, rank: int, refused: str | None = None):  # noqa: ANN202
        def readers(options):  # noqa: ANN001, ANN202
            real = layout_readers(options, lambda: None, torch.device(world.device))
            return lambda source: (Refuses(source.info.id) if source.info.id == refused
                                   else real(source))

        fetched.clear()
        return _pull(world, tp, rank, local=True, client_class=Client, readers=readers)

    ids = world.sources
    out = pull(2, 1)
    assert fetched == [("with the transfer", ids["whole"])], fetched
    assert out.result.source_ids == (ids["whole"],)
    out = pull(4, 1, refused=ids["whole"])
    assert fetched == [("with the transfer", ids["whole"]), ("asked for", ids["r0"]),
                       ("asked for", ids["r1"])], fetched
    assert out.result.source_ids == (ids["r0"],)
    assert any(s.source_id == ids["whole"] and "refused the connection (test)" in s.reason
               for s in out.result.skipped), out.result.skipped
