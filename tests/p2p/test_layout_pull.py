"""Pulls across tensor-parallel layouts from real source processes (library level).

Three source processes (``layout_source.py``) serve ranks of a tiny GQA Llama with tied
embeddings, each loaded by vLLM's real model class and disk loader, with the layout
vLLM's own weight loaders give: both ranks of TP=2, and a TP=1 rank whose published
layout lies (it swaps where layer 0's k and v lie; its bytes are right). A real server
ranks them; the target assembles its rank in this process with
:func:`~modelexpress.p2p.layout_pull.pull_across_layouts` and must equal vLLM's own disk
load of that rank, every block checked against the checkpoint's digests:

* a TP=4 rank, over the local transport: the lying TP=1 source is ranked first (a whole
  layout in one source), caught by its blocks' digests, dropped, and the rank is
  assembled from the TP=2 rank that holds it instead;
* the TP=1 rank, over NIXL (the local transport off), with short strided runs read as
  covering spans and gathered here, and as one descriptor per run.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "engines"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from layout_source import identity  # noqa: E402
from layout_world import layout_sources  # noqa: E402
from mx_server_procs import ServerProc  # noqa: E402

from modelexpress._subproc import clean_env  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

FAMILY = "library"
_HERE = pathlib.Path(__file__).resolve().parent


class World:
    def __init__(self, ckpt: pathlib.Path, server: ServerProc, ipc: str,
                 sources: dict[str, str]) -> None:
        self.ckpt, self.server, self.ipc, self.sources = ckpt, server, ipc, sources

    def client(self):  # noqa: ANN201
        from modelexpress.client import MxClient

        return MxClient(self.server.url, token=self.server.token, timeout_s=30.0)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from vllm_engines import make_tiny_llama

    tmp = tmp_path_factory.mktemp("layout-pull")
    ckpt = make_tiny_llama(tmp / "llama", num_heads=4, num_kv_heads=1, tie_word_embeddings=True)
    commands = {name: ["layout_source", str(ckpt), *args, FAMILY, name,
                       *(["--lie"] if name == "liar" else [])]
                for name, args in (("r0", ["2", "0"]), ("r1", ["2", "1"]), ("liar", ["1", "0"]))}
    with layout_sources(tmp, commands, pythonpath=f"{_HERE}:{_HERE.parent / 'engines'}",
                        ready_s=300) as (server, ipc, ids):
        yield World(ckpt, server, ipc, ids)


def _pull(world: World, tp: int, rank: int, *, local: bool, covering_below=None,  # noqa: ANN001, ANN202
          readers=None):  # noqa: ANN001
    from vllm_layouts import load_rank

    from modelexpress.local import LocalOptions
    from modelexpress.p2p import PullOptions
    from modelexpress.p2p.layout_pull import pull_across_layouts

    reference, _ = load_rank(world.ckpt, tp, rank)
    dest, target = load_rank(world.ckpt, tp, rank, fill=False)
    for t in dest.values():
        if t.is_floating_point():
            t.fill_(float("nan"))
    options = PullOptions(local=LocalOptions(ipc_dir=world.ipc if local else "off"),
                          worker_id=f"target-{tp}-{rank}-{local}", stall_s=60.0)
    if callable(readers):
        readers = readers(options)
    with world.client() as client:
        out = pull_across_layouts(identity(tp, rank, FAMILY), target, dest, client=client,
                                  options=options, covering_below=covering_below,
                                  readers=readers)
        record = client.get_transfer(out.result.transfer_id)
    for name in target.tensors:
        assert torch.equal(dest[name], reference[name]), name
    return out, record


def test_a_tp4_rank_drops_the_source_whose_layout_lies_and_reads_the_tp2_ranks(world) -> None:
    out, record = _pull(world, 4, 1, local=True)
    ids = world.sources
    assert record.candidates[0] == ids["liar"]  # a whole model in one source: tried first
    assert record.layouts == "any" and record.state == "SUCCEEDED"
    (dropped,) = [s for s in out.result.skipped if s.source_id == ids["liar"]]
    assert "do not match the checkpoint digests" in dropped.reason
    assert "self_attn.k_proj.weight" in dropped.reason or "v_proj" in dropped.reason
    # TP=4 rank 1 (the second quarter of heads, columns, vocabulary) lies wholly in the
    # first half TP=2 rank 0 holds: that rank alone is read
    assert out.result.source_ids == (ids["r0"],)
    assert out.result.transport == "local" and out.result.verified
    # the local transport's copy loop hashed the blocks it landed whole as they landed
    assert 0 < out.checked_as_landed <= sum(len(v) for v in out.blocks.digests.values())
    # the rank's blocks, checked, are what it would publish as a source of TP=4
    assert out.blocks.digests and out.layout.tp_size == 4
    # opening the source (mapping its memory) and closing it are timed apart from the
    # data plane, as in a same-layout pull; the phases add up to the call
    phases = out.result.phases
    assert 0 < phases["connect"] == pytest.approx(out.result.connect_seconds, abs=1e-6)
    assert phases["close"] > 0
    assert phases["data_plane"] == pytest.approx(out.result.seconds, abs=1e-6)
    assert sum(phases.values()) == pytest.approx(out.result.total_seconds, abs=1e-4)


class _Recorded:
    """A real reader whose opening, reading and closing are recorded (event, source,
    thread) in the order they happened."""

    def __init__(self, reader, key: str, events: list) -> None:  # noqa: ANN001
        self._reader, self._key, self._events = reader, key, events

    def _say(self, what: str) -> None:
        import threading

        self._events.append((what, self._key, threading.get_ident()))

    def open(self) -> None:
        self._say("open")
        self._reader.open()
        self._say("opened")

    def close(self) -> None:
        self._say("close")
        self._reader.close()

    def read_copies(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        later = kwargs.get("close_later")
        if later is not None:  # the real reader hands over its close: record ours
            kwargs["close_later"] = lambda _close: later(self.close)
        self._say("read")
        try:
            return self._reader.read_copies(*args, **kwargs)
        finally:
            self._say("read done")


def test_the_next_source_is_opened_while_one_is_read_and_closed_off_the_path(world) -> None:
    """A TP=1 rank from both TP=2 ranks over the local transport (after the lying
    whole-model source is dropped): the second rank's memory is mapped while the
    first rank's copies run, and every source is unmapped on another thread than the
    pull's, each once, the lying one included."""
    import threading

    import torch as _torch

    from modelexpress.p2p.layout_pull import layout_readers

    events: list = []

    def readers(options):  # noqa: ANN001, ANN202
        real = layout_readers(options, lambda: None, _torch.device("cpu"))
        return lambda source: _Recorded(real(source), source.info.id, events)

    out, _record = _pull(world, 1, 0, local=True, readers=readers)
    ids = world.sources
    assert set(out.result.source_ids) == {ids["r0"], ids["r1"]}
    first, second = out.result.source_ids
    order = [(what, key) for what, key, _ in events]
    assert order.index(("open", second)) < order.index(("read done", first))
    me = threading.get_ident()
    closes = [(key, thread) for what, key, thread in events if what == "close"]
    assert sorted(k for k, _ in closes) == sorted({k for w, k, _ in events if w == "opened"})
    assert all(thread != me for _, thread in closes)
    phases = out.result.phases
    assert phases["data_plane"] == pytest.approx(out.result.seconds, abs=1e-6)
    assert sum(phases.values()) == pytest.approx(out.result.total_seconds, abs=1e-4)


class _FailsToOpen(_Recorded):
    """A real reader whose source cannot be opened (as a source gone away)."""

    def open(self) -> None:
        from modelexpress.errors import PeerError

        self._say("open")
        raise PeerError(f"{self._key}: refused the connection (test)")


def test_a_source_that_cannot_be_opened_ahead_is_dropped_and_every_opened_one_closed(
        world) -> None:
    """The second TP=2 rank fails as it is opened ahead, while the first one's copies
    run: the pull drops it with its reason, no plan covers the rank without it, the
    call ends with NoSourceError naming it, and every source that was opened was closed
    (off the pull's thread)."""
    import threading

    import torch as _torch

    from vllm_layouts import load_rank

    from modelexpress.errors import NoSourceError
    from modelexpress.local import LocalOptions
    from modelexpress.p2p import PullOptions
    from modelexpress.p2p.layout_pull import layout_readers, pull_across_layouts

    events: list = []
    options = PullOptions(local=LocalOptions(ipc_dir=world.ipc), worker_id="target-open-fails",
                          stall_s=60.0)
    real = layout_readers(options, lambda: None, _torch.device("cpu"))

    def readers(source):  # noqa: ANN001, ANN202
        kind = _FailsToOpen if source.info.id == world.sources["r1"] else _Recorded
        return kind(real(source), source.info.id, events)

    dest, target = load_rank(world.ckpt, 1, 0, fill=False)
    with world.client() as client, pytest.raises(NoSourceError) as caught:
        pull_across_layouts(identity(1, 0, FAMILY), target, dest, client=client,
                            options=options, readers=readers)
    assert "refused the connection (test)" in str(caught.value)
    assert world.sources["r1"] in str(caught.value)
    opened = {key for what, key, _ in events if what == "opened"}
    closes = [(key, thread) for what, key, thread in events if what == "close"]
    assert opened and sorted(k for k, _ in closes) == sorted(opened)
    assert all(thread != threading.get_ident() for _, thread in closes)


@pytest.mark.parametrize("covering", ["covering-spans", "runs"])
def test_the_tp1_rank_over_nixl_with_short_runs_read_covering_or_one_by_one(world,
                                                                            covering) -> None:
    from modelexpress.layout.readers import COVERING_BELOW

    out, record = _pull(world, 1, 0, local=False,
                        covering_below=COVERING_BELOW if covering == "covering-spans" else 0)
    ids = world.sources
    assert set(out.result.source_ids) == {ids["r0"], ids["r1"]}
    assert out.result.transport not in ("local", "none")
    assert record.state == "SUCCEEDED" and out.checked_as_landed == 0  # all after the READs
    # TP=2 -> TP=1: each rank's row-parallel weights land in column halves of the target,
    # a run per row; read covering, each is one descriptor and a local gather instead
    runs = out.result.descriptors
    if covering == "runs":
        assert runs > 2 * 128  # the rows of o_proj / down_proj, per layer and rank
    else:
        assert runs < 64


def test_the_cli_writes_a_tp1_rank_it_assembled_from_tp2_sources(world, tmp_path) -> None:
    """``python -m modelexpress.engines.vllm.derive`` gives the TP=1 layout, ``modelexpress
    pull --layout`` assembles that rank from the TP=2 sources (the TP=1 source, whose
    layout lies, has this very identity: a pull across layouts does not read it) and
    writes the loaded form, equal to vLLM's own TP=1 disk load."""
    import json
    import subprocess

    from layout_source import LAYOUT_MODEL
    from safetensors.torch import load_file
    from vllm_layouts import load_rank

    env = clean_env(MX_SERVER_URL=world.server.url, MX_SERVER_TOKEN=world.server.token or "",
                    MX_IPC_DIR="off")
    layout = tmp_path / "tp1.json"
    derived = subprocess.run(
        [sys.executable, "-m", "modelexpress.engines.vllm.derive", str(world.ckpt), "--tp", "1",
         "--rank", "0", "--dtype", "float32", "--out", str(layout)],
        capture_output=True, text=True, env=env, timeout=300)
    assert derived.returncode == 0, derived.stderr[-3000:]
    out = tmp_path / "out"
    pulled = subprocess.run(
        [sys.executable, "-m", "modelexpress", "pull", "--model", LAYOUT_MODEL, "--tp", "1",
         "--rank", "0", "--layout", str(layout), "--out", str(out), "--json"],
        capture_output=True, text=True, env=env, timeout=300)
    assert pulled.returncode == 0, pulled.stderr[-3000:]
    summary = json.loads(pulled.stdout.strip().splitlines()[-1])
    assert summary["across_layouts"] and summary["verified"]
    assert set(summary["source_ids"]) == {world.sources["r0"], world.sources["r1"]}
    written = {}
    for f in sorted(out.glob("*.safetensors")):
        written.update(load_file(str(f)))
    reference, _ = load_rank(world.ckpt, 1, 0)
    assert set(written) == set(json.loads(layout.read_text())["tensors"])
    for name, t in written.items():
        assert torch.equal(t, reference[name]), name


def test_derive_takes_the_checkpoint_table_from_a_ready_source_without_local_files(
        world, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the model is no local checkpoint, ``derive`` reads the checkpoint's table from
    a READY source that published a layout, through a client built from the settings
    (token, timeout, retries) with ``--server``'s address."""
    from layout_source import LAYOUT_MODEL

    from modelexpress.engines.vllm import derive
    from modelexpress.engines.vllm.layout_blocks import checkpoint_table
    from modelexpress.errors import LayoutUnavailableError

    monkeypatch.setenv("MX_SERVER_URL", "http://127.0.0.1:1")  # --server overrides it
    monkeypatch.setenv("MX_SERVER_TOKEN", world.server.token or "")
    table = derive._checkpoint(LAYOUT_MODEL, world.server.url)
    assert [t.name for t in table] == [t.name for t in checkpoint_table(world.ckpt)]
    with pytest.raises(LayoutUnavailableError, match="no READY source"):
        derive._checkpoint("layout-tests/no-such-model", world.server.url)
