"""MxModelLoader against the real vLLM 0.33.0 package (torch CPU), a real server, real NIXL.

The model is ``MxTinyForCausalLM`` from ``test_vllm_loader_model.py``: a real vLLM
model class built from vLLM's parallel layers, loaded by vLLM's ``DefaultModelLoader``
from a safetensors checkpoint, with a layer that keeps its post-processed weights on a
kernel object (see that module for why vLLM's Llama cannot be built here). The loader
is always reached the way vLLM reaches it: ``get_model_loader(LoadConfig(load_format=
"modelexpress"))`` (vLLM's wrapper) or ``"mx"`` (our plugin), then ``load_model``.

Peer-to-peer tests run a source *process* (``source_main``) that loads from disk and
serves through a real control-plane server (``python -m modelexpress.server`` on
127.0.0.1) over NIXL; the target is this process.

What cannot run here (a whole vLLM engine needs vLLM's GPU build) is listed, with the
commands for a GPU host, in docs/DEPLOYMENT.md ("vLLM").
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from modelexpress.errors import ConfigError

from test_vllm_loader_model import (
    SOURCE_LINE_PREFIX, build_model, init_vllm_distributed, logits, make_vllm_config,
    tensor_checksums, write_checkpoint,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "server"))
from mx_server_procs import TOKEN, ServerProc, free_port  # noqa: E402

pytestmark = pytest.mark.vllm

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parents[1]


# --- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as every vLLM process does: registers `mx`
    path = tmp_path_factory.mktemp("tiny-ckpt")
    write_checkpoint(path)
    init_vllm_distributed(make_vllm_config(path))
    return path


@pytest.fixture(scope="module")
def reference(model_dir: pathlib.Path) -> torch.Tensor:
    """Logits of the model loaded by vLLM's own default loader."""
    return logits(build_model(make_vllm_config(model_dir), "auto"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("mx-server")
    srv = ServerProc(f"sqlite:///{tmp}/mx.db", tmp).start()
    yield srv
    srv.stop()


@pytest.fixture()
def mx_env(server: ServerProc, monkeypatch: pytest.MonkeyPatch) -> ServerProc:
    """The loader reads the server address and token from the environment, as in a pod."""
    monkeypatch.setenv("MX_SERVER_URL", server.url)
    monkeypatch.setenv("MX_SERVER_TOKEN", TOKEN)
    monkeypatch.setenv("MX_HEARTBEAT_INTERVAL_S", "1")
    monkeypatch.setenv("MX_CLIENT_RETRIES", "1")
    return server


def _loader(vllm_config):
    from vllm.model_executor.model_loader import get_model_loader

    return get_model_loader(vllm_config.load_config)


def _load(vllm_config):
    """Load exactly as a vLLM worker does; returns (model, our loader)."""
    from vllm.model_executor.model_loader import ModelExpressModelLoader

    loader = _loader(vllm_config)
    model = loader.load_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
    ours = loader._loader if isinstance(loader, ModelExpressModelLoader) else loader
    return model, ours


def _client(server: ServerProc):
    from modelexpress.client import MxClient

    return MxClient(server.url, token=TOKEN, timeout_s=30.0, retries=1)


# --- resolution, plugin ----------------------------------------------------------------------
def test_builtin_modelexpress_format_wraps_mx_loader() -> None:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import ModelExpressModelLoader, get_model_loader

    from modelexpress.engines.vllm.loader import MxModelLoader

    loader = get_model_loader(LoadConfig(load_format="modelexpress"))
    assert isinstance(loader, ModelExpressModelLoader)
    assert isinstance(loader._loader, MxModelLoader)


def test_plugin_entry_point_registers_mx_idempotently() -> None:
    """In a fresh process: found via importlib.metadata, run by vLLM, run again."""
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.value == "modelexpress.engines.vllm.plugin:register"]
    assert len(ours) == 1, list(eps)
    script = """
import importlib.metadata, json, logging
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
import vllm.model_executor.model_loader as ml
vllm_log = logging.getLogger("vllm.model_executor.model_loader")
vllm_log.addHandler(Keep())
vllm_log.setLevel(logging.INFO)  # its "Registered ..." line is INFO
from vllm.config.load import LoadConfig
try:
    ml.get_model_loader(LoadConfig(load_format="mx"))
    before = "resolved"
except ValueError:
    before = "unknown"
from vllm.plugins import load_general_plugins
load_general_plugins()                       # vLLM's own discovery
ep = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins")
      if e.name == %r][0]
register = ep.load()
register(); register()                       # again, as every worker process does
from modelexpress.engines.vllm import loader
loader.register_load_format("mx")            # and the function itself, twice
loader.register_load_format("mx")
got = type(ml.get_model_loader(LoadConfig(load_format="mx"))).__name__
print(json.dumps({"before": before, "after": got,
                  "registered": sum("with load format `mx`" in r for r in records),
                  "overwritten": sum("already registered" in r for r in records)}))
""" % ours[0].name
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=_REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"before": "unknown", "after": "MxModelLoader", "registered": 1,
                      "overwritten": 0}


def test_register_load_format_refuses_vllms_own_name() -> None:
    from modelexpress.engines.vllm.loader import register_load_format

    with pytest.raises(ValueError, match="built-in"):
        register_load_format("modelexpress")


# --- model_loader_extra_config -------------------------------------------------------------
def test_own_keys_are_stripped_before_the_default_loader() -> None:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import DefaultModelLoader

    from modelexpress.engines.vllm.loader import MxModelLoader

    extra = {"mx_pull": False, "mx_serve": False, "mx_pull_timeout_s": 5,
             "mx_identity_extra": {"finetune": "v2"},
             "enable_multithread_load": True, "num_threads": 2}
    # vLLM's default loader refuses our keys: stripping them is required, not cosmetic
    with pytest.raises(ValueError, match="Unexpected extra config keys"):
        DefaultModelLoader(LoadConfig(load_format="auto", model_loader_extra_config=extra))
    loader = MxModelLoader(LoadConfig(load_format="mx", model_loader_extra_config=extra))
    assert (loader.options.pull, loader.options.serve) == (False, False)
    assert loader.options.pull_timeout_s == 5.0
    assert loader.options.identity_extra == {"finetune": "v2"}
    assert isinstance(loader._fallback, DefaultModelLoader)
    assert loader._fallback.load_config.load_format == "auto"
    assert loader._fallback.load_config.model_loader_extra_config == {
        "enable_multithread_load": True, "num_threads": 2}
    # the caller's config is not modified
    assert "mx_pull" in extra


@pytest.mark.parametrize("extra, message", [
    ({"mx_pul": False}, "allowed: .*mx_pull"),
    ({"mx_pull": "yes"}, "mx_pull must be a bool"),
    ({"mx_pull_timeout_s": True}, "mx_pull_timeout_s must be a number"),
    ({"mx_pull_timeout_s": 0}, "must be > 0"),
    ({"mx_fallback_load_format": "mx"}, "would call this loader again"),
])
def test_bad_own_keys_are_rejected_with_the_allowed_values(extra: dict, message: str) -> None:
    from vllm.config.load import LoadConfig

    from modelexpress.engines.vllm.loader import MxModelLoader

    with pytest.raises(ConfigError, match=message):
        MxModelLoader(LoadConfig(load_format="mx", model_loader_extra_config=extra))


def test_other_keys_still_reach_vllms_validation() -> None:
    from vllm.config.load import LoadConfig

    from modelexpress.engines.vllm.loader import MxModelLoader

    with pytest.raises(ValueError, match="Unexpected extra config keys"):
        MxModelLoader(LoadConfig(load_format="mx", model_loader_extra_config={"bogus": 1}))


def test_environment_gives_defaults_and_extra_config_overrides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config.load import LoadConfig

    from modelexpress.engines.vllm.loader import MxModelLoader

    monkeypatch.setenv("MX_SERVER_URL", "http://10.0.0.1:8001")
    monkeypatch.setenv("MX_VMM_ARENA", "1")
    monkeypatch.setenv("MX_SERVE_AFTER_PULL", "0")
    loader = MxModelLoader(LoadConfig(load_format="mx"))
    assert loader.options.server_url == "http://10.0.0.1:8001"
    assert loader.options.vmm_arena and not loader.options.serve_after_pull
    loader = MxModelLoader(LoadConfig(load_format="mx", model_loader_extra_config={
        "mx_server_url": "http://mx:9000", "mx_vmm_arena": False}))
    assert loader.options.server_url == "http://mx:9000" and not loader.options.vmm_arena


# --- identity ------------------------------------------------------------------------------------
def test_identity_from_vllm_config(model_dir: pathlib.Path) -> None:
    import vllm

    from modelexpress.engines.vllm.identity import identity_from_vllm

    vc = make_vllm_config(model_dir)
    ident = identity_from_vllm(vc)
    assert (ident.model, ident.revision, ident.dtype, ident.quantization) == (
        str(model_dir), "main", "float32", "none")
    assert (ident.tp_size, ident.pp_size, ident.ep_size, ident.rank) == (1, 1, 1, 0)
    extra = dict(ident.extra)
    assert extra["vllm"] == vllm.__version__ and extra["device"] == "cpu"
    assert "mx_layout" in extra
    # stable: the same config in another process gives the same id
    assert identity_from_vllm(make_vllm_config(model_dir)).id == ident.id

    # each fact that changes the bytes changes the id
    f16 = make_vllm_config(model_dir)
    f16.model_config.dtype = torch.float16
    assert identity_from_vllm(f16).dtype == "float16"
    assert identity_from_vllm(vc, extra={"finetune": "v2"}).id != ident.id

    # set after validation: VllmConfig refuses TP/PP > 1 for a model without PP
    # support, and the identity only reads the numbers
    layout = make_vllm_config(model_dir)
    layout.parallel_config.tensor_parallel_size = 2
    layout.parallel_config.pipeline_parallel_size = 2
    ranked = identity_from_vllm(layout, ranks=(1, 1, 0))
    assert (ranked.tp_size, ranked.pp_size, ranked.rank) == (2, 2, 3)
    other_rank = identity_from_vllm(layout, ranks=(0, 1, 0))
    assert other_rank.rank == 2 and other_rank.id != ranked.id


def test_identity_with_expert_parallelism_keeps_dp_replicas_apart(model_dir) -> None:
    from modelexpress.engines.vllm.identity import identity_from_vllm

    vc = make_vllm_config(model_dir)
    vc.parallel_config.tensor_parallel_size = 2
    vc.parallel_config.data_parallel_size = 2
    vc.parallel_config.enable_expert_parallel = True
    a = identity_from_vllm(vc, ranks=(1, 0, 0))
    b = identity_from_vllm(vc, ranks=(1, 0, 1))
    assert a.ep_size == 4 and a.rank == b.rank == 1
    assert dict(b.extra)["dp_rank"] == "1" and a.id != b.id


# --- loading without a peer ---------------------------------------------------------------------
def test_pull_disabled_loads_from_disk_like_vllm(model_dir, reference) -> None:
    vc = make_vllm_config(model_dir, "modelexpress", {"mx_pull": False, "mx_serve": False})
    model, ours = _load(vc)
    assert not model.training
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=0)
    report = ours.last_report
    assert report.source == "disk" and "mx_pull=false" in report.fallback_reason
    assert not report.recreated and not report.serving


def test_unreachable_server_falls_back_without_recreating(
        model_dir, reference, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MX_CLIENT_RETRIES", "0")
    vc = make_vllm_config(model_dir, "mx", {
        "mx_server_url": f"http://127.0.0.1:{free_port()}", "mx_serve": False})
    with caplog.at_level(logging.INFO, logger="modelexpress.engines.vllm.loader"):
        model, ours = _load(vc)
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=0)
    report = ours.last_report
    assert report.source == "disk" and not report.recreated
    assert "ServerUnavailableError" in report.fallback_reason
    assert any("falling back to the auto loader" in r.getMessage() for r in caplog.records)


def test_arena_request_on_a_cpu_load_is_ignored_with_a_warning(
        model_dir, reference, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MX_VMM_ARENA", "1")
    vc = make_vllm_config(model_dir, "mx", {"mx_pull": False, "mx_serve": False})
    with caplog.at_level(logging.WARNING, logger="modelexpress.engines.vllm.loader"):
        model, ours = _load(vc)
    assert ours.options.vmm_arena and not ours.last_report.vmm_arena
    assert any("MX_VMM_ARENA=1 ignored" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=0)


def test_the_loader_does_not_keep_vllms_config_after_the_load(
        model_dir) -> None:
    """vLLM's config holds layers of the model (``static_forward_context``). A loader that
    kept the config after ``load_model`` kept those layers, and on a GPU the tensors of
    a model loaded in the VMM arena then outlived the arena: freeing them at exit
    aborted the process (one H100, vLLM 0.26: ``invalid device pointer``)."""
    import gc
    import weakref

    vc = make_vllm_config(model_dir, "mx", {"mx_pull": False, "mx_serve": False})
    model, ours = _load(vc)
    config = weakref.ref(vc)
    gc.collect()
    gc.disable()  # the config must go with its last reference, not in a collection later
    try:
        del vc, model
        assert ours.last_report.source == "disk"  # the loader itself is still here
        assert config() is None, [type(r).__name__ for r in gc.get_referrers(config())]
    finally:
        gc.enable()


def test_an_arena_stays_open_while_any_layer_of_its_model_lives() -> None:
    """A layer that outlives its model (kept in vLLM's forward context or rotary cache)
    keeps the arena its tensors live in; the last one gone closes it."""
    import gc
    import weakref

    from modelexpress.engines.vllm.loader import keep_arena_with
    from modelexpress.vmm import HostVmmBackend, VmmArena

    arena = VmmArena(1 << 30, backend=HostVmmBackend())
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    keep_arena_with(model, arena)
    kept, ref = model[1], weakref.ref(arena)
    gc.disable()
    try:
        del arena, model
        assert ref() is not None and not ref().closed
        del kept
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.nixl
def test_no_ready_source_loads_from_disk_then_serves(mx_env, model_dir, reference) -> None:
    from modelexpress.engines.vllm.loader import stop_serving

    model, ours = _load(make_vllm_config(model_dir, "modelexpress"))
    report = ours.last_report
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=0)
    assert report.source == "disk" and not report.recreated
    assert report.fallback_reason.startswith("no READY source")
    assert report.serving
    with _client(mx_env) as client:
        ready = client.list_sources(identity=report.identity, state="READY")
        assert len(ready) == 1
        # an in-place reload changes the weights: the source is withdrawn first
        from vllm.config import set_current_vllm_config

        vc = make_vllm_config(model_dir)
        with set_current_vllm_config(vc):  # a worker has it set; vLLM's loader reads it
            # On vLLM's CPU build post-processing emptied the linear weights (they live in
            # oneDNN handles now) and vLLM's own loader cannot reload into them; what is
            # tested here is that the source is withdrawn before the weights change.
            with contextlib.suppress(AssertionError):
                ours.load_weights(model, vc.model_config)
        assert client.list_sources(identity=report.identity, state="READY") == []
        assert client.get_source(ready[0].id).state == "STALE"
    assert not stop_serving(model)  # already withdrawn: idempotent


# --- loading from a peer -------------------------------------------------------------------------
class SourceProc:
    """``source_main`` in a subprocess: loads from disk via vLLM's loader API and serves."""

    def __init__(self, model_dir: pathlib.Path, server: ServerProc, log_dir: pathlib.Path,
                 corrupt: bool = False, device: str = "cpu",
                 env: dict[str, str] | None = None) -> None:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
        full_env.update(MX_SERVER_URL=server.url, MX_SERVER_TOKEN=TOKEN,
                        MX_HEARTBEAT_INTERVAL_S="1",
                        PYTHONPATH=os.pathsep.join([str(_HERE), full_env.get("PYTHONPATH", "")]))
        full_env.update(env or {})
        self.log_path = log_dir / f"source-{'corrupt' if corrupt else 'ok'}.log"
        code = (f"import test_vllm_loader_model as m; "
                f"m.source_main({str(model_dir)!r}, corrupt={corrupt}, device={device!r})")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=full_env,
                                         cwd=_REPO)
        self.info = self._first_line(timeout_s=300.0)

    def _first_line(self, timeout_s: float) -> dict:
        box: list[dict] = []

        def read() -> None:
            for raw in self.proc.stdout:  # ends at EOF, when the process exits
                line = raw.decode(errors="replace")
                if line.startswith(SOURCE_LINE_PREFIX) and not box:
                    box.append(json.loads(line[len(SOURCE_LINE_PREFIX):]))
                # keep draining: a full pipe would block the source's logging

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        while not box and reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not box:
            self.kill()
            raise AssertionError(f"source did not report within {timeout_s} s:\n"
                                 f"{self.log_path.read_text(errors='replace')[-4000:]}")
        return box[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"stop\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        assert self.proc.returncode == 0, self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.mark.nixl
@pytest.mark.slow
def test_target_pulls_from_a_source_process(mx_env, model_dir, reference, tmp_path) -> None:
    """Same weights, same post-processed layout, bytes from the peer (not the disk)."""
    from modelexpress.engines.vllm.loader import stop_serving

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, seed=99)  # its own path: its own identity, its own pool
    source = SourceProc(ckpt, mx_env, tmp_path)
    try:
        assert source.info["serving"] and source.info["source"] == "disk"
        src_logits = torch.tensor(source.info["logits"])
        model, ours = _load(make_vllm_config(ckpt, "modelexpress"))
        report = ours.last_report
        assert report.identity.id == source.info["identity"]
        assert report.source == "peer", report.fallback_reason
        assert not report.recreated and report.fallback_reason is None
        result = report.pull_result
        assert result.verified and result.bytes > 0 and len(result.source_ids) == 1
        # every byte the source holds, kernel-object tensors included, came across,
        # and the outputs are identical
        assert tensor_checksums(model) == source.info["checksums"]
        torch.testing.assert_close(logits(model), src_logits, rtol=0, atol=0)
        assert not torch.equal(src_logits, reference)  # another checkpoint, not a fluke
        # fan-out: the target now serves as well
        assert report.serving
        with _client(mx_env) as client:
            assert len(client.list_sources(identity=report.identity, state="READY")) == 2
        assert stop_serving(model)
    finally:
        if "model" in locals():
            stop_serving(model)
        source.stop()


@pytest.mark.nixl
@pytest.mark.slow
def test_pull_failing_midway_falls_back_and_recreates(mx_env, model_dir, tmp_path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The source's bytes stop matching its digests: the READ lands in the model, the
    check fails, the loader re-creates the model and loads it from disk.

    The source changes its model's own weight, so it must serve the model's memory:
    with the local transport on, a CPU source serves a memfd copy of its loaded form
    instead (the real-engine test corrupts that copy through /proc/PID/mem)."""
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, seed=7)
    disk = logits(build_model(make_vllm_config(ckpt), "auto"))
    source = SourceProc(ckpt, mx_env, tmp_path, corrupt=True, env={"MX_IPC_DIR": "off"})
    try:
        with caplog.at_level(logging.INFO, logger="modelexpress.engines.vllm.loader"):
            model, ours = _load(make_vllm_config(ckpt, "mx", {"mx_serve_after_pull": False,
                                                              "mx_serve": False}))
        report = ours.last_report
        assert report.source == "disk" and report.recreated
        assert report.fallback_reason.startswith("pull failed"), report.fallback_reason
        assert "digest" in report.fallback_reason.lower() or "Integrity" in \
            report.fallback_reason, report.fallback_reason
        torch.testing.assert_close(logits(model), disk, rtol=0, atol=0)
        messages = [r.getMessage() for r in caplog.records]
        assert any("falling back to the auto loader" in m for m in messages)
        assert any("re-creating" in m for m in messages)
        assert not report.serving
    finally:
        source.stop()


@pytest.mark.nixl
@pytest.mark.slow
def test_a_target_that_wins_the_origin_lease_as_a_source_turns_ready_pulls_that(
        mx_env, model_dir, tmp_path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """From zero (``mx_model_storage``), the race of engines started together: this
    target looked for a READY source of its loaded form just before one was published
    (its first look is made to miss the source process here: that is the timing), then
    took the origin lease of the checkpoint. Before reading storage it looks again,
    finds the loaded form READY, gives the lease back and pulls that."""
    from modelexpress.engines.vllm import loader as mx_loader
    from modelexpress.engines.vllm.from_zero import checkpoint_identity

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, seed=5)
    source = SourceProc(ckpt, mx_env, tmp_path)
    real = mx_loader.MxModelLoader._try_pull
    looks: list[int] = []

    def first_look_misses(self, model, model_config, device, report, attempt):  # noqa: ANN001, ANN202
        looks.append(1)
        if len(looks) == 1:
            report.fallback_reason = "no READY source (looked just before it was published)"
            return None
        return real(self, model, model_config, device, report, attempt)

    monkeypatch.setattr(mx_loader.MxModelLoader, "_try_pull", first_look_misses)
    try:
        with caplog.at_level(logging.INFO, logger="modelexpress"):
            model, ours = _load(make_vllm_config(ckpt, "mx", {
                "mx_model_storage": str(ckpt), "mx_serve": False,
                "mx_serve_after_pull": False}))
        report = ours.last_report
        assert report.source == "peer" and report.zero is None, report.fallback_reason
        assert len(looks) == 2 and not report.recreated
        assert tensor_checksums(model) == source.info["checksums"]
        messages = [r.getMessage() for r in caplog.records]
        assert any("turned READY in another form" in m and "storage not read" in m
                   for m in messages), messages
        assert not any("reading" in m and "from 0 of" in m for m in messages)  # no origin
        with _client(mx_env) as client:  # the lease it won was given back
            lease = client.get_origin(checkpoint_identity(report.identity, "float32"))
            assert not lease.held and lease.generation == 1, lease
    finally:
        source.stop()


@pytest.mark.gpu
@pytest.mark.nixl
@pytest.mark.slow
def test_gpu_pull_between_vmm_arena_workers(mx_env, model_dir, tmp_path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU host: a source process and this target both load onto CUDA inside the VMM
    arena (``MX_VMM_ARENA=1``, ``UCX_CUDA_COPY_REG_WHOLE_ALLOC=off``); the target pulls
    every tensor byte-exact. With two GPUs the source runs on the second one.

    Compares bytes, not logits: the forward of vLLM's layers on CUDA needs vLLM's GPU
    build (``vllm._C``), which this environment may lack; the manual engine check is
    in docs/DEPLOYMENT.md.
    """
    from modelexpress.engines.vllm.loader import stop_serving
    from modelexpress.vmm import arena_unavailable_reason

    expect_arena = arena_unavailable_reason(0) is None  # else: one warning, normal load

    env = {"MX_VMM_ARENA": "1", "UCX_CUDA_COPY_REG_WHOLE_ALLOC": "off"}
    if torch.cuda.device_count() > 1:
        env["CUDA_VISIBLE_DEVICES"] = "1"
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, seed=5)
    source = SourceProc(ckpt, mx_env, tmp_path, device="cuda", env=env)
    try:
        assert source.info["serving"] and source.info["vmm_arena"] == expect_arena
        monkeypatch.setenv("MX_VMM_ARENA", "1")
        monkeypatch.setenv("UCX_CUDA_COPY_REG_WHOLE_ALLOC", "off")
        model, ours = _load(make_vllm_config(ckpt, "modelexpress",
                                             {"mx_serve_after_pull": False}, device="cuda"))
        report = ours.last_report
        assert report.source == "peer", report.fallback_reason
        assert report.vmm_arena == expect_arena and not report.serving
        assert all(p.is_cuda for p in model.parameters())
        assert tensor_checksums(model) == source.info["checksums"]
        assert not stop_serving(model)
    finally:
        source.stop()
