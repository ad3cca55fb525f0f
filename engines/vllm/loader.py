"""``MxModelLoader``: vLLM loads its weights from a peer, or from disk and then serves them.

vLLM 0.33.0 ships ``--load-format modelexpress``: its ``ModelExpressModelLoader``
imports this module and wraps ``MxModelLoader(load_config)``, forwarding
``download_model``, ``load_weights`` and ``load_model`` (then calling ``.eval()``). Our
plugin also registers the class itself as ``--load-format mx``. Both take the same path:

::

    load_model(vllm_config, model_config)
      identity <- vLLM config (model, revision, dtype, quantization, TP/PP/EP, rank, ...)
      with maybe_enter_vmm_arena(MX_VMM_ARENA):          # one registered region per rank
        model <- create_model()                           # vLLM's own construction
        if a READY source has this identity:               # target
          placeholder weights (vLLM's dummy loader) + process_weights_after_loading
                                   # the layout now equals a serving peer's, bytes aside
          pull(identity, every tensor the model holds)    # see tensors.py
          on any failure: log why; re-create the model (it was post-processed)
        else / after a failure:                            # disk
          fallback loader (vLLM's default) .load_weights + process_weights_after_loading
      serve_source(identity, tensors, arena)              # source (and fan-out target)

Why post-process first and pull after: ``process_weights_after_loading`` repacks and
re-quantizes for the local kernels, which costs time and peak memory and is what a
peer already did. Pulling the post-processed tensors skips it (only its cheap run on
placeholders remains, to make the layout), at the price that the peer must have run
the same vLLM version on the same device kind, which the identity guarantees.

Known limit: state that ``process_weights_after_loading`` derives from the weight
*values* and keeps as plain Python numbers (not tensors) is not transferred; no vLLM
0.33.0 method does this for weights (scales stay tensors), and the tests pin the ones
that keep tensors on kernel objects.

The vLLM loader API is imported here at module import: only vLLM (and our plugin)
import this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig, replace
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader, register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
from vllm.model_executor.model_loader.reload import finalize_layerwise_processing
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from modelexpress.errors import MxError
from modelexpress.identity import ModelIdentity
from modelexpress.settings import MxSettings

from modelexpress.engines.vllm.identity import identity_from_vllm
from modelexpress.engines.vllm.options import LoaderOptions, split_extra_config
from modelexpress.engines.vllm.tensors import collect_model_tensors

if TYPE_CHECKING:
    from modelexpress.client import MxClient

__all__ = ["MxModelLoader", "LoadReport", "register_load_format", "stop_serving"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadReport:
    """How the last :meth:`MxModelLoader.load_model` went (also logged).

    Attributes:
        identity: the identity this rank loaded.
        source: ``"peer"`` (pulled) or ``"disk"`` (the fallback loader).
        pull_result: the :class:`~modelexpress.p2p.PullResult` of a pull, else None.
        fallback_reason: why the disk was used (no source, pull disabled, an error).
        recreated: the model was built a second time because a failed pull attempt
            had already post-processed (or partly overwritten) the first one.
        serving: the weights were published as a source after the load.
        vmm_arena: the load ran inside a VMM arena (requested and available).
        seconds: wall time of the whole load.
    """

    identity: ModelIdentity
    source: str = "disk"
    pull_result: Any = None
    fallback_reason: str | None = None
    recreated: bool = False
    serving: bool = False
    vmm_arena: bool = False
    seconds: float = 0.0


class MxModelLoader(BaseModelLoader):
    """vLLM model loader: peer-to-peer first, vLLM's default loader as the fallback.

    Args:
        load_config: vLLM's load config. Its ``model_loader_extra_config`` may carry
            our ``mx_*`` keys (see :mod:`modelexpress.engines.vllm.options`); they are
            removed before the rest goes to the fallback loader, which rejects
            unknown keys.

    Raises:
        ConfigError: an unknown ``mx_*`` key, a wrong value type, or ``mx``/
            ``modelexpress`` as the fallback format.
        ValueError: vLLM's fallback loader rejected the remaining extra config.
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        own, rest = split_extra_config(load_config.model_loader_extra_config)
        self.options = LoaderOptions.from_extra_config(own)
        # The fallback sees a config without our keys and with a disk format; build it
        # now so a bad remaining key fails at startup, not after a failed pull.
        self._fallback_config = replace(load_config,
                                        load_format=self.options.fallback_load_format,
                                        model_loader_extra_config=rest)
        self._fallback = get_model_loader(self._fallback_config)
        self.last_report: LoadReport | None = None

    # --- BaseModelLoader ----------------------------------------------------------------
    def download_model(self, model_config: ModelConfig) -> None:
        """Download the checkpoint with the fallback loader (an explicit request)."""
        self._fallback.download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """In-place reload of ``model`` from disk (vLLM's reload / weight-update paths).

        The weights change under any source this model serves, so that source is
        marked STALE first.
        """
        if stop_serving(model):
            logger.info("modelexpress: in-place weight reload; stopped serving the old "
                        "weights of %s", model_config.model)
        self._fallback.load_weights(model, model_config)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig,
                   prefix: str = "") -> nn.Module:
        """Build the model and fill it from a peer, or from disk; then serve it.

        Args:
            vllm_config: the engine config.
            model_config: the model to load (the draft model has its own).
            prefix: module-name prefix vLLM passes for nested models.

        Returns:
            The loaded model in eval mode.

        Raises:
            Whatever the fallback loader raises: a failed pull never fails the load,
            a failed disk load does.
        """
        from modelexpress.vmm import maybe_enter_vmm_arena

        start = time.perf_counter()
        device = _load_device(vllm_config)
        identity = identity_from_vllm(vllm_config, model_config,
                                      extra=self.options.identity_extra)
        report = LoadReport(identity=identity)
        with _vllm_config_context(vllm_config), set_default_torch_dtype(model_config.dtype), \
                maybe_enter_vmm_arena(self._arena_wanted(device), device=device.index or 0,
                                      total_bytes=self.options.vmm_arena_bytes) as arena:
            # The arena (if any) outlives this block: the weights live in it, and a
            # source registers its range as one NIXL region.
            report.vmm_arena = arena is not None
            model, tensors = self._load(vllm_config, model_config, prefix, device, report)
        report.seconds = time.perf_counter() - start
        report.serving = self._maybe_serve(model, identity, report, tensors, arena)
        self.last_report = report
        logger.info("modelexpress: %s rank %d loaded from %s in %.2f s%s%s",
                    model_config.model, identity.rank, report.source, report.seconds,
                    f" ({report.fallback_reason})" if report.fallback_reason else "",
                    "; serving it" if report.serving else "")
        return model.eval()

    # --- the two paths ----------------------------------------------------------------
    def _load(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
              device: torch.device,
              report: LoadReport) -> tuple[nn.Module, dict[str, torch.Tensor] | None]:
        registrations = _LayerRegistrations(vllm_config)
        model = self._create(vllm_config, model_config, prefix, device)
        if not self.options.pull:
            report.fallback_reason = "pull disabled (mx_pull=false)"
        else:
            attempt = _PullAttempt()
            tensors = self._try_pull(model, model_config, device, report, attempt)
            if tensors is not None:
                return model, tensors
            if attempt.touched:
                # The failed attempt post-processed the model (and may have written
                # part of a pull into it); the disk loader needs a fresh one. Drop the
                # old one first so the device never holds two.
                logger.info("modelexpress: re-creating %s for the %s loader: the failed "
                            "pull attempt had post-processed it", model_config.model,
                            self.options.fallback_load_format)
                registrations.forget_since_snapshot()
                del model
                _release_cached_memory()
                model = self._create(vllm_config, model_config, prefix, device)
                report.recreated = True
        logger.info("modelexpress: loading %s from disk with the %s loader (%s)",
                    model_config.model, self.options.fallback_load_format,
                    report.fallback_reason)
        self._fallback.load_weights(model, model_config)
        _post_process(model, model_config, device)
        return model, None

    def _try_pull(self, model: nn.Module, model_config: ModelConfig, device: torch.device,
                  report: LoadReport, attempt: "_PullAttempt") -> dict[str, torch.Tensor] | None:
        """Pull into ``model``; the tensors on success, None (reason in ``report``) on failure."""
        identity = report.identity
        try:
            with self._client() as client:
                ready = client.list_sources(identity=identity, state="READY")
                if not ready:
                    report.fallback_reason = f"no READY source for identity {identity.id}"
                    return None
                from modelexpress.p2p import pull

                # Placeholder values: post-processing needs finite numbers, not these
                # particular ones; the pull overwrites every byte it produced.
                attempt.touched = True
                self._placeholder_loader().load_weights(model, model_config)
                _post_process(model, model_config, device)
                tensors = collect_model_tensors(model)
                settings = self._settings
                result = pull(identity, tensors, client=client,
                              timeout_s=self.options.pull_timeout_s, verify=self.options.verify,
                              policy=settings.source_policy,
                              max_attempts=settings.max_source_attempts,
                              chunk_bytes=settings.transfer_chunk_bytes,
                              refuse_slow_transport=settings.refuse_slow_transport)
        except MxError as exc:
            report.fallback_reason = f"pull failed: {type(exc).__name__}: {exc}"
            logger.warning("modelexpress: pull of %s (identity %s) failed, falling back to "
                           "the %s loader: %s", model_config.model, identity.id,
                           self.options.fallback_load_format, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - any failure falls back; traceback logged
            report.fallback_reason = f"pull failed: {type(exc).__name__}: {exc}"
            logger.warning("modelexpress: pull of %s (identity %s) failed unexpectedly, "
                           "falling back to the %s loader", model_config.model, identity.id,
                           self.options.fallback_load_format, exc_info=True)
            return None
        report.source = "peer"
        report.pull_result = result
        logger.info("modelexpress: pulled %s rank %d from %s: %d tensors, %.3f GB in %.3f s "
                    "(%.2f GB/s, %s, digests %s)", model_config.model, identity.rank,
                    ",".join(result.source_ids), result.tensors, result.bytes / 1e9,
                    result.seconds, result.gbps, result.transport,
                    "verified" if result.verified else "not checked")
        return tensors

    def _maybe_serve(self, model: nn.Module, identity: ModelIdentity, report: LoadReport,
                     tensors: dict[str, torch.Tensor] | None, arena: Any) -> bool:
        wanted = self.options.serve if report.source == "disk" else self.options.serve_after_pull
        if not wanted:
            return False
        client = None
        try:
            from modelexpress.p2p import serve_source

            client = self._client()
            if tensors is None:
                tensors = collect_model_tensors(model)
            handle = serve_source(identity, tensors, client=client, arena=arena,
                                  heartbeat_interval_s=self._settings.heartbeat_interval_s,
                                  single_region=self._settings.arena_single_mr)
        except Exception as exc:  # noqa: BLE001 - serving is an extra; the engine runs without it
            # Our own errors say what went wrong; anything else is a bug: show where.
            logger.warning("modelexpress: could not publish %s rank %d as a source (%s: %s); "
                           "the engine runs, peers will not pull from it", identity.model,
                           identity.rank, type(exc).__name__, exc,
                           exc_info=not isinstance(exc, MxError))
            if client is not None:
                client.close()
            return False
        _track_source(model, handle, client)
        return True

    # --- helpers --------------------------------------------------------------------------
    def _create(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
                device: torch.device) -> nn.Module:
        with device:
            return self.create_model(vllm_config=vllm_config, model_config=model_config,
                                     prefix=prefix)

    @property
    def _settings(self) -> MxSettings:
        assert self.options.settings is not None  # from_extra_config always sets it
        return self.options.settings

    def _arena_wanted(self, device: torch.device) -> bool:
        if self.options.vmm_arena and device.type != "cuda":
            # The arena routes CUDA allocations; a CPU load on a GPU host must not
            # send them (the caching allocator of device 0) into an arena.
            logger.warning("modelexpress: MX_VMM_ARENA=1 ignored: the weights load onto %s, "
                           "the VMM arena serves CUDA devices only", device)
            return False
        return self.options.vmm_arena

    def _placeholder_loader(self) -> BaseModelLoader:
        # vLLM's dummy loader also materialises online-quantized (meta-device) layers.
        return DummyModelLoader(replace(self._fallback_config, load_format="dummy",
                                        model_loader_extra_config={}))

    def _client(self) -> "MxClient":
        from modelexpress.client import MxClient

        return MxClient(self.options.server_url, token=self.options.server_token,
                        timeout_s=self.options.client_timeout_s,
                        retries=self.options.client_retries)


@dataclasses.dataclass
class _PullAttempt:
    touched: bool = False  # the model was written to; the disk path needs a new one


class _LayerRegistrations:
    """What model construction registered in the vLLM config, to undo it for a rebuild.

    vLLM's attention, Mamba and MoE layers register themselves by name in
    ``compilation_config.static_forward_context`` (MoE also in
    ``static_all_moe_layers``) and refuse a second layer of the same name ("Duplicate
    layer name"). A discarded model's entries would also keep it alive. So the loader
    snapshots both before building and, before building again, drops what was added.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        self._compilation = vllm_config.compilation_config
        self._context_keys = set(self._compilation.static_forward_context)
        self._moe_count = len(getattr(self._compilation, "static_all_moe_layers", ()))

    def forget_since_snapshot(self) -> None:
        context = self._compilation.static_forward_context
        for name in [k for k in context if k not in self._context_keys]:
            del context[name]
        moe = getattr(self._compilation, "static_all_moe_layers", None)
        if moe is not None:
            del moe[self._moe_count:]


def _post_process(model: nn.Module, model_config: ModelConfig, device: torch.device) -> None:
    """vLLM's post-load steps, in the order its base loader runs them."""
    _release_cached_memory()
    if any(getattr(getattr(m, "quant_method", None), "uses_meta_device", False)
           for m in model.modules()):
        finalize_layerwise_processing(model, model_config)
    process_weights_after_loading(model, model_config, device)
    _release_cached_memory()


def _release_cached_memory() -> None:
    gc.collect()
    # torch.accelerator.empty_cache() raises on a host without an accelerator.
    if torch.accelerator.is_available():
        torch.accelerator.empty_cache()


def _load_device(vllm_config: VllmConfig) -> torch.device:
    load_device = vllm_config.load_config.device or vllm_config.device_config.device
    return torch.device(load_device)


@contextlib.contextmanager
def _vllm_config_context(vllm_config: VllmConfig) -> Iterator[None]:
    """vLLM's loaders read the *current* config (EP filters); a worker sets it, a bare
    call (tests, scripts) may not."""
    from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config

    if get_current_vllm_config_or_none() is not None:
        yield
        return
    with set_current_vllm_config(vllm_config):
        yield


# --- sources this process serves ---------------------------------------------------------
# model -> finalizer that closes its SourceHandle (marks it STALE) and its client. The
# finalizer runs when the model is collected, at interpreter exit (weakref.finalize's
# atexit), or from stop_serving() before an in-place reload.
_serving: "weakref.WeakKeyDictionary[nn.Module, weakref.finalize]" = weakref.WeakKeyDictionary()
_serving_lock = threading.Lock()


def _track_source(model: nn.Module, handle: Any, client: Any) -> None:
    finalizer = weakref.finalize(model, _close_source, handle, client)
    with _serving_lock:
        old = _serving.pop(model, None)
        _serving[model] = finalizer
    if old is not None:
        old()


def _close_source(handle: Any, client: Any) -> None:
    try:
        handle.close()
    except Exception:  # noqa: BLE001 - runs in finalizers and at exit; must not raise
        logger.warning("modelexpress: closing a source failed", exc_info=True)
    finally:
        try:
            client.close()
        except Exception:  # noqa: BLE001
            logger.debug("modelexpress: closing a client failed", exc_info=True)


def stop_serving(model: nn.Module) -> bool:
    """Stop serving ``model``'s weights (marks its source STALE). Idempotent.

    Returns:
        True when ``model`` was being served.
    """
    with _serving_lock:
        finalizer = _serving.pop(model, None)
    if finalizer is None:
        return False
    finalizer()
    return True


# --- --load-format mx -----------------------------------------------------------------------
def register_load_format(name: str = "mx") -> None:
    """Register :class:`MxModelLoader` with vLLM as ``--load-format NAME``. Idempotent.

    Args:
        name: the load format; ``modelexpress`` is vLLM's own and already reaches this
            class through its wrapper, so only other names make sense.

    Raises:
        ValueError: ``name`` is ``modelexpress`` (it would replace vLLM's wrapper).
    """
    if name == "modelexpress":
        raise ValueError("'modelexpress' is vLLM's built-in format (it wraps MxModelLoader); "
                         "register another name, e.g. 'mx'")
    from vllm.model_executor import model_loader as vllm_model_loader

    # vLLM's registry is a module-level dict; registering twice logs a warning, so
    # look before registering (the plugin runs once per vLLM process, and again in
    # every worker process).
    registry = getattr(vllm_model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
    if registry.get(name) is MxModelLoader:
        return
    register_model_loader(name)(MxModelLoader)
