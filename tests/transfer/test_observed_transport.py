"""A READ result names the transport UCX reported for it, never one inferred.

Unit tests read UCX's table format (as the UCX bundled with nixl 1.5.1 writes it)
and the attribution rules of ``observer.py`` over a log file the test writes; the
``nixl`` tests run real READs between two processes, each target in a fresh process
so that its UCX starts with the environment the test gives it.
"""

from __future__ import annotations

import glob
import os
import pathlib
import tempfile

import pytest
import torch

from modelexpress.errors import ConfigError
from modelexpress.transfer import NixlTransferManager, assess
from modelexpress.transfer.observer import TransportObserver
from modelexpress.transfer.ucx_report import (
    PROTO_INFO_READS,
    ReportReader,
    _decide,
    _pattern,
    parse_tables,
    parse_ucx_log,
)

UCX_VARS = ("UCX_LOG_FILE", "UCX_PROTO_INFO", "UCX_TLS")
# NIXL refuses UCX_TLS without a CUDA transport where GPUs are present (config.cpp:
# "does not enable CUDA memory support"); cuda_copy moves no host-to-host bytes.
TCP_ONLY = "tcp,cuda_copy" if torch.cuda.is_available() else "tcp"
OUR_DIR = pathlib.Path(tempfile.gettempdir()) / f"mx-ucx-{os.geteuid()}"
READ_HOST = "remote memory read by ucp_get*(multi) into host memory from host"
READ_CUDA = "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda"


def table(context: str, operation: str, rows: list[tuple[str, str, str]], stamp: str,
          pid: int | None = None, endpoint: str = "intra-node cfg#1") -> str:
    """A table in the layout UCX writes (widths do not matter to the parser)."""
    sep = "+--------+-------------+-------------------------------------------+"
    lines = [sep, f"| {context} {endpoint} |", f"| {operation} |", sep,
             "| Range  | Description |                  Config                   |", sep,
             *(f"| {r} | {d} | {c} |" for r, d, c in rows), sep]
    pid = os.getpid() if pid is None else pid
    return "".join(f"[{stamp}] [vm:{pid:<5}:0]   {line}\n" for line in lines)


CMA = [("0..inf", "zero-copy", "cma/memory")]
TCP = [("0..inf", "software emulation", "tcp/lo")]


# -- the format -------------------------------------------------------------------------
def test_tables_are_read_as_ucx_writes_them() -> None:
    # Recorded here (2-core CPU machine, nixl-cu12 1.5.1): a DRAM READ between two
    # local processes, then one with UCX_TLS=tcp on both sides; between them an
    # active-message table and a UCX warning.
    text = (table("mx-47436ea13a834ff78e70527b65f0", READ_HOST, CMA, "1796110150.578108")
            + table("mx-47436ea13a834ff78e70527b65f0",
                    "active message by ucp_am_send* from host memory",
                    [("0", "short", "tcp/lo"), ("1..16515", "zero-copy", "tcp/lo")],
                    "1796110150.609548")
            + f"[1796110150.7] [vm:{os.getpid()}:0]     ucp_worker.c:1234 UCX  WARN  "
              "something UCX wants said\n"
            + table("mx-b684424fc3c3467a9daa990c1aa5", READ_HOST, TCP, "1796110246.337559"))
    tables, messages = parse_tables(text)
    reads = [t for t in tables if t.is_read]
    assert [(t.context, t.endpoint, t.transports()) for t in reads] == [
        ("mx-47436ea13a834ff78e70527b65f0", "intra-node cfg#1", ("cma",)),
        ("mx-b684424fc3c3467a9daa990c1aa5", "intra-node cfg#1", ("tcp",))]
    assert (reads[0].local_mem, reads[0].remote_mem) == ("DRAM", "DRAM")
    assert len(tables) == 3 and any("UCX  WARN" in m for m in messages)
    assert parse_ucx_log(text).read_transports == ("cma", "tcp")


def test_a_same_gpu_read_reads_as_tcp() -> None:
    # Recorded on one H200 (nixl-cu13 1.5.1): a VRAM READ between two processes on
    # the same GPU, which the inferred transport had reported as cuda_ipc.
    text = table("mx-d9f42f91ea35415889a274844c2f",
                 "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1]",
                 [("0..inf", "software emulation", "tcp/lo")], "1796111616.616279")
    (t,), _ = parse_tables(text)
    assert (t.local_mem, t.remote_mem, t.transports()) == ("VRAM", "VRAM", ("tcp",))
    verdict = assess("cuda_ipc", 1 << 30, 2.0, facts=parse_ucx_log(text))
    assert verdict.transport == "tcp" and not verdict.ok


def test_rows_are_chosen_by_the_sizes_read_and_lanes_by_name() -> None:
    rows = [("0..8K", "short", "tcp/lo"),
            ("8193..inf", "zero-copy", "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1"),
            ]
    (t,), _ = parse_tables(table("a", READ_CUDA, rows, "1.0"))
    assert (t.local_mem, t.remote_mem) == ("VRAM", "VRAM")
    assert t.transports([4096]) == ("tcp",)
    assert t.transports([1 << 20]) == ("rc_mlx5",)
    assert t.transports([4096, 1 << 20]) == ("tcp", "rc_mlx5")
    assert t.transports() == ("tcp", "rc_mlx5")


def test_other_processes_and_unfinished_tables_are_not_read(tmp_path) -> None:
    log = tmp_path / "ucx.log"
    other = table("a", READ_HOST, TCP, "1.0", pid=os.getpid() + 1)
    mine = table("a", READ_HOST, CMA, "2.0")
    half, rest = mine[:len(mine) // 2], mine[len(mine) // 2:]
    log.write_text(other + half)
    reader = ReportReader(glob.escape(str(log)), relay=False)
    assert reader.poll() == 0 and reader.tables == []
    with log.open("a") as f:
        f.write(rest)
    assert reader.poll() == 1 and reader.tables[0][1].transports() == ("cma",)



def test_a_poll_inside_a_poll_on_the_same_thread_returns_at_once(tmp_path, monkeypatch) -> None:
    """A finalizer can run in the middle of a poll (a transfer manager collected while
    this thread polls; its close() polls once more): that inner poll must not wait for
    the lock its own thread holds (it did: a pull hung for good) nor read half way
    through the outer poll's lines."""
    import threading

    from modelexpress.transfer import ucx_report

    log = tmp_path / "ucx.log"
    log.write_text(table("a", READ_HOST, CMA, "2.0"))
    reader = ReportReader(glob.escape(str(log)), relay=False)
    inner: list[int] = []
    flush = ucx_report._flush_c_streams

    def flush_then_poll_again() -> None:
        flush()
        if not inner:
            inner.append(reader.poll())  # what a finalizer's close() does here

    monkeypatch.setattr(ucx_report, "_flush_c_streams", flush_then_poll_again)
    outer: list[int] = []
    poller = threading.Thread(target=lambda: outer.append(reader.poll()), daemon=True)
    poller.start()
    poller.join(10.0)
    assert not poller.is_alive(), "a poll inside a poll waited on its own thread's lock"
    assert inner == [0] and outer == [1] and len(reader.tables) == 1

# -- where UCX writes it ------------------------------------------------------------------
def test_the_report_goes_to_our_file_unless_the_user_configured_ucx() -> None:
    ours = _decide({}, loaded=False)
    assert ours.owned and ours.env["UCX_PROTO_INFO"] == PROTO_INFO_READS
    assert ours.env["UCX_LOG_FILE"].startswith(str(OUR_DIR)) and "%p" in ours.env["UCX_LOG_FILE"]
    assert str(os.getpid()) in (ours.pattern or "")

    users = _decide({"UCX_LOG_FILE": "/var/log/ucx.%p.log"}, loaded=True)
    assert users.pattern == f"/var/log/ucx.{os.getpid()}.log" and not users.owned
    assert users.env == {"UCX_PROTO_INFO": PROTO_INFO_READS}  # only what the user left unset
    assert _decide({"UCX_LOG_FILE": "/l", "UCX_PROTO_INFO": "*get*"}, False).env == {}

    for env, says in [({"UCX_PROTO_INFO": "n"}, "UCX_PROTO_INFO=n"),
                      ({"UCX_PROTO_INFO": "y"}, "UCX_LOG_FILE is not"),
                      ({"UCX_LOG_FILE": "stdout"}, "stdout"),
                      ({"UCX_LOG_FILE": "stderr:2"}, "stderr"),
                      ({}, "already loaded")]:
        setup = _decide(env, loaded=not env)
        assert setup.pattern is None and says in setup.reason and setup.env == {}, env


def test_ucx_file_name_templates_become_patterns() -> None:
    host = os.uname().nodename.split(".")[0]
    assert _pattern("/l/ucx.%h.%p.log") == f"/l/ucx.{host}.{os.getpid()}.log"
    assert _pattern("/l/ucx.%t.log") == "/l/ucx.*.log"
    assert _pattern("/l/100%x[1].log") == "/l/100%x[[]1].log"


# -- whose table it is ------------------------------------------------------------------
class FakeUcx:
    """Appends tables to a log file as UCX would, for an observer reading it."""

    def __init__(self, tmp_path: pathlib.Path) -> None:
        self.path = tmp_path / "ucx.log"
        self.path.write_text("")
        self.stamp = 0

    def reader(self) -> ReportReader:
        return ReportReader(glob.escape(str(self.path)), relay=False)

    def prints(self, context: str, rows: list[tuple[str, str, str]],
               operation: str = READ_HOST) -> None:
        self.stamp += 1
        with self.path.open("a") as f:
            f.write(table(context, operation, rows, f"{self.stamp}.0"))

    def error(self, line: str) -> None:
        with self.path.open("a") as f:
            f.write(f"[9.0] [vm:{os.getpid()}:0]     cuda_ipc_md.c:312 UCX  ERROR {line}\n")


def _read(obs: TransportObserver, peer: str, ucx: FakeUcx, rows=None, mem: str = "DRAM",
          operation: str | None = None):
    """One READ: the connect window (where UCX prints new selections), then its facts."""
    with obs.reading(peer, mem, mem, [1 << 20]) as watch:
        with watch.window():
            if rows is not None:
                ucx.prints(obs.context, rows, operation or (READ_CUDA if mem == "VRAM"
                                                            else READ_HOST))
    return watch.facts()


def test_each_peer_gets_the_table_printed_in_its_window_or_a_reused_one(tmp_path) -> None:
    ucx = FakeUcx(tmp_path)
    obs = TransportObserver("mx-target", "UCX", reader=ucx.reader())
    try:
        first = _read(obs, "src-1", ucx, CMA)
        assert first.read_transports == ("cma",) and "for peer src-1" in first.detail
        # Nothing new on a second READ, or on a new peer with the same configuration.
        assert _read(obs, "src-1", ucx).read_transports == ("cma",)
        reused = _read(obs, "src-2", ucx)
        assert reused.read_transports == ("cma",) and "reused a selection" in reused.detail
        assert _read(obs, "src-3", ucx, TCP).read_transports == ("tcp",)
        # Now a silent new peer could have reused either selection: not observed.
        silent = _read(obs, "src-4", ucx)
        assert silent.read_transports == () and "cma; tcp" in silent.detail
        assert assess("cma", 1 << 30, 1.0, facts=silent).transport == "unknown"
        # Another agent's tables and another memory kind's tables are not ours.
        ucx.prints("mx-someone-else", TCP)
        assert _read(obs, "src-1", ucx).read_transports == ("cma",)
        assert _read(obs, "src-5", ucx, TCP, mem="VRAM", operation=READ_HOST).read_transports == ()
    finally:
        obs.close()


def test_tables_from_overlapping_reads_of_two_peers_stay_unattributed(tmp_path) -> None:
    ucx = FakeUcx(tmp_path)
    obs = TransportObserver("mx-target", "UCX", reader=ucx.reader())
    try:
        with obs.reading("src-a", "DRAM", "DRAM", [1 << 20]) as a:
            with a.window():
                pass
            # src-a moves bytes while src-b connects: what either prints is nobody's.
            with obs.reading("src-b", "DRAM", "DRAM", [1 << 20]) as b:
                with b.window():
                    ucx.prints(obs.context, TCP)
            ucx.prints(obs.context, CMA)
        for watch in (a, b):
            facts = watch.facts()
            assert facts.read_transports == () and "cma; tcp" in facts.detail, facts
    finally:
        obs.close()


def test_the_vmm_key_error_while_adding_a_peer_belongs_to_that_peer(tmp_path) -> None:
    ucx = FakeUcx(tmp_path)
    obs = TransportObserver("mx-target", "UCX", reader=ucx.reader())
    try:
        with obs.peer_window() as window:
            ucx.error("unsupported key handle type: 0")
            window.peer = "vmm-src"
        facts = _read(obs, "vmm-src", ucx, TCP, mem="VRAM")
        assert facts.vmm_key_unsupported and facts.read_transports == ("tcp",)
        verdict = assess("cuda_ipc", 1 << 20, 1.0, facts=facts)
        assert not verdict.ok and "unsupported key handle type" in verdict.message
        assert not _read(obs, "other-src", ucx, CMA).vmm_key_unsupported
    finally:
        obs.close()


def test_agents_are_told_apart_by_the_31_characters_ucx_keeps(tmp_path) -> None:
    ucx = FakeUcx(tmp_path)
    name = "worker-0123456789-0123456789-0123456789"
    obs = TransportObserver(name, "UCX", reader=ucx.reader())
    try:
        assert _read(obs, "src", ucx, CMA).read_transports == ("cma",)
        twin = TransportObserver(name[:31] + "-twin", "UCX", reader=ucx.reader())
        clash = _read(obs, "src", ucx)
        assert clash.read_transports == () and "distinct names" in clash.detail
        twin.close()
        assert _read(obs, "src", ucx).read_transports == ("cma",)
    finally:
        obs.close()


def test_other_backends_report_no_transport() -> None:
    obs = TransportObserver("mx-x", "LIBFABRIC")
    try:
        facts = obs.facts("p", "DRAM", "DRAM", [4096])
        assert facts.read_transports == () and "LIBFABRIC" in facts.detail
    finally:
        obs.close()


# -- real UCX between two processes -----------------------------------------------------
def _our_log_of(pid: int) -> list[str]:
    return glob.glob(str(OUR_DIR / f"ucx.*.{pid}.log"))


@pytest.mark.nixl
def test_dram_read_between_two_local_processes_reports_cma(source_factory,
                                                           target_runner) -> None:
    first, second = source_factory({"kinds": ["chunky"]}), source_factory({"kinds": ["chunky"]})
    out = target_runner([first, second], "chunky", repeat=2, drop_env=UCX_VARS)
    reads = out["reads"]
    assert [r.get("transport") for r in reads] == ["cma"] * 4, reads
    assert all(r["correct"] and r["ok"] and r["expected_transport"] == "cma" for r in reads)
    assert str(OUR_DIR) in reads[0]["transport_detail"]
    assert "for peer" in reads[1]["transport_detail"]   # the same peer again: cached
    assert "reused a selection" in reads[2]["transport_detail"]  # new peer, same config
    assert not _our_log_of(out["pid"]), "the target's UCX log outlived it"
    assert "remote memory read" not in out["stderr"]    # nothing printed to the console


@pytest.mark.nixl
def test_parallel_first_reads_from_two_peers_each_report_cma(source_factory,
                                                             target_runner) -> None:
    sources = [source_factory({"kinds": ["chunky"]}) for _ in range(2)]
    out = target_runner(sources, "chunky", parallel=True, drop_env=UCX_VARS)
    assert [r.get("transport") for r in out["reads"]] == ["cma", "cma"], out["reads"]
    assert all(r["correct"] for r in out["reads"])


@pytest.mark.nixl
def test_tcp_forced_on_both_sides_reports_tcp(source_factory, target_runner) -> None:
    src = source_factory({"kinds": ["chunky"]}, env={"UCX_TLS": TCP_ONLY})
    (read,) = target_runner([src], "chunky", {"UCX_TLS": TCP_ONLY}, drop_env=UCX_VARS)["reads"]
    assert read["transport"] == "tcp" and read["expected_transport"] == "cma", read
    assert read["correct"] and not read["ok"]
    assert "over tcp where cma was expected" in read["message"]


@pytest.mark.nixl
def test_a_users_ucx_log_file_is_read_and_left_alone(source_factory, target_runner,
                                                     tmp_path) -> None:
    src = source_factory({"kinds": ["chunky"]})
    env = {"UCX_LOG_FILE": str(tmp_path / "mine.%p.log")}
    out = target_runner([src], "chunky", env, drop_env=UCX_VARS)
    (read,) = out["reads"]
    theirs = tmp_path / f"mine.{out['pid']}.log"
    assert read["transport"] == "cma" and str(theirs) in read["transport_detail"], read
    assert "remote memory read" in theirs.read_text()   # kept, with our read tables in it
    assert not _our_log_of(out["pid"])


@pytest.mark.nixl
def test_without_a_readable_report_the_transport_is_unknown_not_guessed(source_factory,
                                                                       target_runner) -> None:
    src = source_factory({"kinds": ["chunky"]})
    env = {"UCX_PROTO_INFO": "n"}
    (read,) = target_runner([src], "chunky", env, drop_env=UCX_VARS)["reads"]
    assert read["transport"] == "unknown" and read["expected_transport"] == "cma", read
    assert "UCX_PROTO_INFO=n" in read["transport_detail"] and read["ok"]


@pytest.mark.nixl
def test_an_unknown_backend_is_refused_with_the_ones_nixl_offers() -> None:
    with pytest.raises(ConfigError) as err:
        NixlTransferManager(backend="NOPE")
    assert "'NOPE'" in str(err.value) and "UCX" in str(err.value)
    with NixlTransferManager(backend="ucx") as mgr:
        assert mgr.backend == "UCX"
