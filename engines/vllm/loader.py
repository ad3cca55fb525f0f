"""``MxModelLoader``: vLLM loads its weights from a peer, or from disk and then serves them.

vLLM ships ``--load-format modelexpress`` (0.32 and 0.33): its
``ModelExpressModelLoader`` imports this module and wraps ``MxModelLoader(load_config)``,
forwarding ``download_model``, ``load_weights`` and ``load_model`` (then calling
``.eval()``). Our plugin also registers the class itself as ``--load-format mx``. Both
take the same path:

::

    load_model(vllm_config, model_config)
      identity <- vLLM config (model, revision, dtype, quantization, TP/PP/EP, rank, ...)
      with maybe_enter_vmm_arena(MX_VMM_ARENA):           # one registered region per rank
        model <- create_model()                            # vLLM's own construction
        if a READY source has this identity:                # target
          pull(identity, the model's parameters and buffers)  # the LOADED form
        else if sources of another TP layout cover this rank: # target, across layouts
          pull_across_layouts(this rank's layout, ...)        # layout_step.py
        else / after a failure:                             # disk
          fallback loader (vLLM's default) .load_weights    # + block digests (layout_step)
        loaded <- views of the parameters and buffers       # kept only to serve them
        compiled artifacts: set pulled, installed on a thread  # artifacts.py
        process_weights_after_loading                       # vLLM's own, on every rank
        probe <- the model's output on a fixed input        # probe.py
        (the artifacts' install waited for)
        target: probe != the source's -> log, count, re-create, load from disk
      serve_source(identity, loaded, probe, layout)         # source (and fan-out target)

Why peers exchange the loaded form (what ``load_weights`` produces) and not the
post-processed one: post-processing may keep what the forward pass reads where no
tensor walk can reach it. On CPU, vLLM packs every linear weight into a oneDNN handle
or a packed tensor captured by a closure and empties ``layer.weight``; GPU kernels can
do the same. A pull into a post-processed model then leaves the engine computing with
placeholder state, with every moved byte correct. Moving the loaded form and running
vLLM's own post-processing on the target is correct by construction for every layer
whose post-processing is a function of its loaded weights, which is what vLLM's disk
path assumes too. The price is running post-processing on the target (its time is in
:class:`LoadReport`, and ``bench/vllm_engine.py`` measures it) and, on a source, the
memory of loaded tensors that post-processing replaced (on CPU: every linear weight).
A source whose post-processing changed a loaded tensor in place cannot serve the
loaded form any more; it detects that (digests before and after) and does not serve.

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
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig, replace
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader, register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.reload import finalize_layerwise_processing
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from modelexpress.errors import (LayoutUnavailableError, MxError, ServedElsewhereError,
                                 ServerUnavailableError)
from modelexpress.identity import ModelIdentity
from modelexpress.p2p.readers import AgentStart
from modelexpress.settings import MxSettings

from modelexpress.engines.vllm import compat as _compat
from modelexpress.engines.vllm import probe as _probe
from modelexpress.engines.vllm.artifacts import ArtifactStep
from modelexpress.engines.vllm.identity import identity_from_vllm
from modelexpress.engines.vllm.layout_step import LayoutStep
from modelexpress.engines.vllm.options import LoaderOptions, split_extra_config
from modelexpress.engines.vllm.tensors import collect_loaded_tensors

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
        fallback_reason: why the disk was used (no source, pull disabled, an error, a
            probe mismatch).
        recreated: the model was built a second time because a failed pull attempt
            had already written into (or post-processed) the first one.
        serving: the weights were published as a source after the load.
        not_serving_reason: why they were not, when serving was wanted.
        vmm_arena: the load ran inside a VMM arena (requested and available).
        probe: the :class:`~modelexpress.engines.vllm.probe.ProbeVerdict` of a pull
            (None for a disk load or with ``mx_probe`` off).
        weights_seconds: filling the loaded form (the pull, or the disk loader).
        post_process_seconds: vLLM's ``process_weights_after_loading``.
        probe_seconds: computing the probe.
        seconds: wall time of the whole load, serving excluded.
        artifacts: the :class:`~modelexpress.engines.vllm.artifacts.ArtifactReport` of
            this rank's compiled artifacts (its outcome is final once vLLM compiled:
            ``artifacts.done`` is set).
        phases: where ``load_model``'s wall time went, in seconds (``agent``, ``model``
            (vLLM's model construction), ``weights``, ``post_processing``, ``probe``,
            ``serve``, ``artifacts``, ``other``); logged as one line. ``artifacts`` is
            what the compiled artifacts added to it: choosing and pulling the set, and
            waiting for its install where that outlasted post-processing and the probe
            (``artifacts.seconds`` is the whole of it).
        zero: how the checkpoint was fetched when no peer held the model
            (``MX_MODEL_STORAGE``; :mod:`~modelexpress.engines.vllm.from_zero`): the
            ``ZeroResult`` summary (``role`` origin, follower or peer); ``source`` is then
            ``storage`` for the origin, ``fleet`` for a follower.
    """

    identity: ModelIdentity
    source: str = "disk"
    pull_result: Any = None
    fallback_reason: str | None = None
    recreated: bool = False
    serving: bool = False
    not_serving_reason: str | None = None
    vmm_arena: bool = False
    probe: Any = None
    weights_seconds: float = 0.0
    post_process_seconds: float = 0.0
    probe_seconds: float = 0.0
    seconds: float = 0.0
    artifacts: Any = None
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    zero: Any = None


@dataclasses.dataclass
class _Loaded:
    """The loaded form of a model, kept after post-processing so it can be served."""

    tensors: dict[str, torch.Tensor]
    digest_algorithm: str | None = None
    digests: dict[str, str] | None = None  # before post-processing
    probe: Any = None
    unservable: str | None = None  # why these tensors no longer hold the loaded form


_SERVED_ELSEWHERE = object()
"""``_try_zero``: the loaded form turned READY as this engine took the origin lease."""


class _ProbeMismatch(MxError):
    """The pulled model computes differently from its source."""


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
        self._nixl: AgentStart | None = None
        self._layouts: LayoutStep | None = None
        # (vllm_config, identity, device) of the load under way, until its artifact
        # step is made (_start_artifacts); then that step.
        self._artifacts_for: tuple[VllmConfig, Any, torch.device] | None = None
        self._artifacts: ArtifactStep | None = None
        # From zero: withdraws the fetched checkpoint once this engine serves its loaded
        # form (from_zero.load_from_zero), or will not.
        self._zero_handoff: Callable[[], None] | None = None

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
        # The NIXL agent (about a second or two to start, UCX included) is made here only
        # when this engine will serve what it loads, where the same agent then serves
        # it. A target that only pulls gets none: a pull from a peer on this host needs
        # none, and one over NIXL makes its own (p2p.pull). A disk load that serves
        # after a failed pull makes it then (_manager).
        self._device = device
        will_serve = self.options.serve_after_pull if self.options.pull else self.options.serve
        t_agent = time.perf_counter()
        self._nixl = (AgentStart(self.options.pull_options.backend, device)
                      if will_serve else None)
        report.phases["agent"] = time.perf_counter() - t_agent
        with _vllm_config_context(vllm_config), set_default_torch_dtype(model_config.dtype), \
                maybe_enter_vmm_arena(self._arena_wanted(device), device=device.index or 0,
                                      total_bytes=self.options.vmm_arena_bytes) as arena:
            # The arena (if any) outlives this block: the weights live in it, and a
            # source registers its range as one NIXL region.
            report.vmm_arena = arena is not None
            # This rank's layout (derived on a meta model when a path needs it).
            self._layouts = LayoutStep(self.options.cross_layout, vllm_config, model_config,
                                       self, device)
            self._artifacts_for, self._artifacts = (vllm_config, identity, device), None
            report.phases["artifacts"] = 0.0
            try:
                model, loaded = self._load(vllm_config, model_config, prefix, device, report)
            except BaseException:
                if self._artifacts is not None:
                    self._artifacts.close()  # its install was waited for (_finish)
                    self._artifacts = None
                self._hand_off_zero()
                raise
            finally:
                self._artifacts_for = None
        if arena is not None:
            # The weights live in the arena's chunks: it lives as long as the model.
            # Collected with this frame, it unmapped them under a serving engine
            # (vLLM 0.26 on one H200: CUBLAS_STATUS_EXECUTION_FAILED in the first forward).
            keep_arena_with(model, arena)
        report.seconds = time.perf_counter() - start
        t_serve = time.perf_counter()
        try:
            report.serving = self._maybe_serve(model, identity, report, loaded, arena)
        finally:
            self._hand_off_zero()  # its loaded form is served now (or will not be)
        report.phases["serve"] = time.perf_counter() - t_serve
        # Its layout is published (or not) now. The step holds vLLM's config, whose
        # forward context holds layers of this model: kept by the loader, they would
        # outlive the model (and the arena their tensors live in).
        self._layouts = None
        if not report.serving and self._nixl is not None:
            self._nixl.close()  # nothing serves: no idle agent for the process's lifetime
            self._nixl = None
        # Compiled artifacts: pulled and installed while the weights were post-processed
        # (vLLM compiles after load_model returns), served once vLLM has compiled; the
        # step lives as long as the model.
        step, self._artifacts = self._artifacts, None
        if step is not None:
            weakref.finalize(model, step.close)
            step.loaded(pulled_weights=report.source == "peer")
            report.artifacts = step.report
        phases = report.phases
        phases.update(weights=report.weights_seconds, post_processing=report.post_process_seconds,
                      probe=report.probe_seconds)
        phases["other"] = max(0.0, time.perf_counter() - start - sum(phases.values()))
        self.last_report = report
        logger.info("modelexpress: %s rank %d loaded from %s in %.2f s (weights %.3f s, "
                    "post-processing %.3f s, probe %.3f s)%s%s", model_config.model,
                    identity.rank, report.source, report.seconds, report.weights_seconds,
                    report.post_process_seconds, report.probe_seconds,
                    f" ({report.fallback_reason})" if report.fallback_reason else "",
                    "; serving it" if report.serving else
                    (f"; not serving: {report.not_serving_reason}"
                     if report.not_serving_reason else ""))
        logger.info("modelexpress: rank %d load_model phases: %s", identity.rank,
                    ", ".join(f"{k} {v:.3f} s" for k, v in report.phases.items()))
        return model.eval()

    # --- the two paths ----------------------------------------------------------------
    def _load(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
              device: torch.device, report: LoadReport) -> tuple[nn.Module, _Loaded]:
        registrations = _LayerRegistrations(vllm_config)
        t0 = time.perf_counter()
        model = self._create(vllm_config, model_config, prefix, device)
        report.phases["model"] = time.perf_counter() - t0
        online = _has_online_quant(model)
        if not self.options.pull:
            report.fallback_reason = "pull disabled (mx_pull=false)"
        elif online:
            report.fallback_reason = ("online quantization quantizes weights while they "
                                      "load; there is no loaded form to pull")
        else:
            attempt = _PullAttempt()

            def fresh(model: nn.Module) -> nn.Module:
                """``model``, or a new one if a failed attempt wrote into it (part of a
                pull, or a whole pull that the probe rejected, then post-processed): the
                next path (vLLM's ``load_weights`` included) needs it as built. The old
                one goes first, so the device never holds two."""
                if not attempt.touched:
                    return model
                attempt.touched = False
                return self._recreate(model, vllm_config, model_config, prefix, device,
                                      report, registrations)

            loaded = self._try_pull(model, model_config, device, report, attempt)
            if loaded is not None:
                return model, loaded
            if self._layouts.eligible and not attempt.unreachable:
                model = fresh(model)
                loaded = self._try_across_layouts(model, model_config, device, report, attempt)
                if loaded is not None:
                    return model, loaded
            if self.options.model_storage:
                model = fresh(model)
                loaded = self._try_zero(model, model_config, device, report, attempt)
                if loaded is _SERVED_ELSEWHERE:
                    # An engine of this identity turned READY while this one took the
                    # origin lease: pull its loaded form; should that fail too, fetch from
                    # zero after all (storage then, rather than a disk that may be empty).
                    loaded = self._try_pull(model, model_config, device, report, attempt)
                    if loaded is None:
                        model = fresh(model)
                        loaded = self._try_zero(model, model_config, device, report, attempt,
                                                ask_elsewhere=False)
                if loaded is not None:
                    return model, loaded
            model = fresh(model)
        logger.info("modelexpress: loading %s from disk with the %s loader (%s)",
                    model_config.model, self.options.fallback_load_format,
                    report.fallback_reason)
        t0 = time.perf_counter()
        with self._layouts.hashing(self._fallback):
            self._fallback.load_weights(model, model_config)
        report.weights_seconds = time.perf_counter() - t0
        serve = self.options.serve and not online
        loaded = self._finish(model, model_config, device, report, keep=serve,
                              probe=serve and self.options.probe)
        if online and self.options.serve:
            loaded.unservable = report.fallback_reason
        return model, loaded

    def _recreate(self, model: nn.Module, vllm_config: VllmConfig, model_config: ModelConfig,
                  prefix: str, device: torch.device, report: LoadReport,
                  registrations: "_LayerRegistrations") -> nn.Module:
        """A fresh model for the next path: the failed attempt wrote into this one (part
        of a pull, or a whole pull that the probe rejected, then post-processed). The old
        one goes first so the device never holds two."""
        logger.info("modelexpress: re-creating %s: the failed pull attempt had written into "
                    "it", model_config.model)
        registrations.forget_since_snapshot()
        if self._nixl is not None:
            # It registered the discarded model's memory; serving makes its own.
            self._nixl.close()
            self._nixl = None
        del model
        _release_cached_memory()
        t0 = time.perf_counter()
        model = self._create(vllm_config, model_config, prefix, device)
        report.phases["model"] += time.perf_counter() - t0
        report.recreated = True
        return model

    def _try_across_layouts(self, model: nn.Module, model_config: ModelConfig,
                            device: torch.device, report: LoadReport,
                            attempt: "_PullAttempt") -> _Loaded | None:
        """Pull this rank's regions from sources of other tensor-parallel layouts and
        post-process; None (reason added to ``report``) when none covers it or it failed.

        The behavioural probe compares only processes of one layout (a sharded layer's
        output differs by layout), so it is not compared here: every block of the
        loaded form was checked against the checkpoint's digests instead, and vLLM's own
        post-processing runs on it as after a disk load. This rank publishes its probe
        for the targets of its layout that pull from it later.
        """
        identity = report.identity
        try:
            with self._client() as client:
                tensors = collect_loaded_tensors(model)
                t0 = time.perf_counter()
                result = self._layouts.pull(identity, tensors, client=client,
                                            options=self.options.pull_options,
                                            manager=self._manager(create=False),
                                            before_writing=attempt.touch)
                report.weights_seconds = time.perf_counter() - t0
                report.pull_result = result
                loaded = self._finish(model, model_config, device, report,
                                      keep=self.options.serve_after_pull,
                                      probe=self.options.probe, tensors=tensors)
        except Exception as exc:  # noqa: BLE001 - any failure falls back; ours say why
            why = f"{type(exc).__name__}: {exc}"
            if getattr(exc, "nothing_tried", False):
                # the ordinary first load: no source of any layout yet
                report.fallback_reason = f"{report.fallback_reason}, nor of another layout"
                logger.debug("modelexpress: no pull across layouts: %s", why)
                return None
            if isinstance(exc, LayoutUnavailableError):
                return None  # the one line saying why was logged where it was found
            report.fallback_reason = f"{report.fallback_reason}; across layouts: {why}"
            logger.warning("modelexpress: pull of %s rank %d across layouts failed: %s",
                           model_config.model, identity.rank, why,
                           exc_info=not isinstance(exc, MxError))
            return None
        report.source = "peer"
        report.fallback_reason = None
        report.probe = _probe.ProbeVerdict(
            "incomparable", "pulled across parallel layouts: probes compare processes of one "
            "layout; every block was checked against the checkpoint's digests")
        logger.info("modelexpress: pulled %s rank %d across layouts from %s: %d bytes in "
                    "%.3f s (%.2f GB/s, %s, blocks verified); the pull took %.3f s",
                    model_config.model, identity.rank, ",".join(result.source_ids),
                    result.bytes, result.seconds, result.gbps, result.transport,
                    result.total_seconds)
        return loaded

    def _try_pull(self, model: nn.Module, model_config: ModelConfig, device: torch.device,
                  report: LoadReport, attempt: "_PullAttempt") -> _Loaded | None:
        """Pull into ``model`` and post-process it; None (reason in ``report``) on failure."""
        identity = report.identity
        try:
            with self._client() as client:
                ready = client.list_sources(identity=identity, state="READY")
                if not ready:
                    report.fallback_reason = f"no READY source for identity {identity.id}"
                    return None
                from modelexpress.p2p import pull

                tensors = collect_loaded_tensors(model)
                logger.info("modelexpress: pulling %s rank %d (%d tensors, %.3f GB) from %d "
                            "READY source(s)", model_config.model, identity.rank, len(tensors),
                            sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9,
                            len(ready))
                attempt.touched = True
                t0 = time.perf_counter()
                result = pull(identity, tensors, client=client,
                              manager=self._manager(create=False),
                              options=self.options.pull_options)
                report.weights_seconds = time.perf_counter() - t0
                report.pull_result = result
                keep = self.options.serve_after_pull
                loaded = self._finish(model, model_config, device, report, keep=keep,
                                      probe=self.options.probe, tensors=tensors,
                                      verified=(result.digest_algorithm, result.digests))
                if self.options.probe:
                    self._check_probe(loaded, result, report)
                if result.source_ids:
                    self._layouts.adopt(client, result.source_ids[0])
        except MxError as exc:
            report.fallback_reason = f"pull failed: {type(exc).__name__}: {exc}"
            attempt.unreachable = isinstance(exc, ServerUnavailableError)
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
        logger.info("modelexpress: pulled %s rank %d from %s: %d tensors, %.3f GB in %.3f s "
                    "(%.2f GB/s, %s, digests %s, probe %s); the pull took %.3f s: %s",
                    model_config.model, identity.rank, ",".join(result.source_ids),
                    result.tensors, result.bytes / 1e9, result.seconds, result.gbps,
                    result.transport, "verified" if result.verified else "not checked",
                    report.probe.outcome if report.probe is not None else "off",
                    result.total_seconds,
                    ", ".join(f"{k} {v:.3f} s" for k, v in result.phases.items()))
        return loaded

    def _try_zero(self, model: nn.Module, model_config: ModelConfig, device: torch.device,
                  report: LoadReport, attempt: "_PullAttempt", *, ask_elsewhere: bool = True
                  ) -> "_Loaded | None | object":
        """Fill ``model`` from the checkpoint fetched from zero (``MX_MODEL_STORAGE``:
        :mod:`~modelexpress.engines.vllm.from_zero`) and post-process it; None (reason in
        ``report``) on failure; ``_SERVED_ELSEWHERE`` when, with ``ask_elsewhere``, a
        source of this engine's identity turned READY just as it would have read storage
        (nothing read: pull that)."""
        from modelexpress.engines.vllm.from_zero import load_from_zero

        def track(built: nn.Module, names: set[str] | None) -> None:
            # vLLM's own check that every parameter was loaded (its default loader runs it
            # for unquantized models that report what they loaded)
            check = getattr(self._fallback, "track_weights_loading", None)
            if check is not None and names is not None and model_config.quantization is None:
                check(built, names)

        assert self.options.pull_options is not None
        attempt.touched = True  # load_weights writes into the model
        t0 = time.perf_counter()
        try:
            result, self._zero_handoff = load_from_zero(
                model, model_config, report.identity, self.options.model_storage,
                self.options.pull_options, self._client, track,
                elsewhere=(lambda: self._ready_now(report.identity)) if ask_elsewhere else None)
        except ServedElsewhereError as exc:
            logger.info("modelexpress: %s; pulling it", exc)
            attempt.touched = False  # nothing was written into the model (fresh before)
            return _SERVED_ELSEWHERE
        except Exception as exc:  # noqa: BLE001 - any failure falls back to vLLM's loader
            report.fallback_reason = f"from zero failed: {type(exc).__name__}: {exc}"
            logger.warning("modelexpress: fetching %s from %s failed, falling back to the %s "
                           "loader: %s", model_config.model, self.options.model_storage,
                           self.options.fallback_load_format, exc,
                           exc_info=not isinstance(exc, MxError))
            return None
        report.weights_seconds = time.perf_counter() - t0
        report.source = {"origin": "storage", "follower": "fleet"}.get(result.role, "peer")
        report.zero = result.to_dict()
        report.fallback_reason = None
        serve = self.options.serve
        return self._finish(model, model_config, device, report, keep=serve,
                            probe=serve and self.options.probe)

    def _finish(self, model: nn.Module, model_config: ModelConfig, device: torch.device,
                report: LoadReport, *, keep: bool, probe: bool,
                tensors: dict[str, torch.Tensor] | None = None,
                verified: tuple[str | None, Any] = (None, {})) -> _Loaded:
        """Post-process the freshly filled model; keep its loaded form if it will be served.
        The compiled artifacts are pulled first and installed beside it (once per load:
        :meth:`_start_artifacts`), and waited for before this returns.

        Args:
            keep: hold views of the loaded form (to serve it) and check, by digests
                before and after, that post-processing left their bytes alone.
            probe: compute the behavioural probe afterwards.
            tensors: the loaded form if already collected (the pull's destination).
            verified: ``(algorithm, name -> digest)`` the pull checked ``tensors``
                against (``PullResult.digests``): reused instead of a second pass.
        """
        self._start_artifacts(model, report)
        try:
            return self._finish_weights(model, model_config, device, report, keep=keep,
                                        probe=probe, tensors=tensors, verified=verified)
        finally:
            # ORDER: before anything that may start a NIXL agent (serving, another path)
            t0 = time.perf_counter()
            if self._artifacts is not None:
                self._artifacts.wait_installed()
            report.phases["artifacts"] += time.perf_counter() - t0

    def _finish_weights(self, model: nn.Module, model_config: ModelConfig,
                        device: torch.device, report: LoadReport, *, keep: bool, probe: bool,
                        tensors: dict[str, torch.Tensor] | None,
                        verified: tuple[str | None, Any]) -> _Loaded:
        """:meth:`_finish` but for the artifacts."""
        from modelexpress.transfer import digest as _digest

        loaded = _Loaded(tensors={})
        if keep:
            loaded.tensors = tensors if tensors is not None else collect_loaded_tensors(model)
            values = list(loaded.tensors.values())
            algo, known = verified
            if algo and known and set(loaded.tensors) <= set(known):
                # The pull verified these very bytes against the source's digests.
                loaded.digest_algorithm = algo
                loaded.digests = {name: known[name] for name in loaded.tensors}
            else:
                loaded.digest_algorithm = _digest.default_algorithm(values)
                loaded.digests = dict(zip(loaded.tensors,
                                          _digest.digest_many(values, loaded.digest_algorithm)))
        tensors = None  # not kept unless serving: post-processing may free what it replaces
        t0 = time.perf_counter()
        _post_process(model, model_config, device)
        report.post_process_seconds = time.perf_counter() - t0
        if keep:
            after = _digest.digest_many(list(loaded.tensors.values()), loaded.digest_algorithm)
            changed = [name for name, value in zip(loaded.tensors, after)
                       if loaded.digests[name] != value]
            if changed:
                loaded.unservable = (
                    f"post-processing changed {len(changed)} loaded tensor(s) in place "
                    f"(e.g. {changed[0]!r}); peers need the loaded form")
        if probe:
            loaded.probe = _probe.compute_probe(model)
            report.probe_seconds = loaded.probe.seconds
        return loaded

    def _start_artifacts(self, model: nn.Module, report: LoadReport) -> None:
        """Make this load's artifact step, once, now that ``model`` holds its weights: the
        set is pulled here and installed on a thread of its own while the weights are
        post-processed and probed (:meth:`_finish` waits for it). A failure costs only
        the artifacts: vLLM compiles as usual."""
        if self._artifacts_for is None:
            return
        vllm_config, identity, device = self._artifacts_for
        self._artifacts_for = None
        t0 = time.perf_counter()
        try:
            self._artifacts = ArtifactStep(self.options, self._client, self._manager,
                                           vllm_config, model, identity, device)
        except Exception as exc:  # noqa: BLE001 - artifacts are an extra; the engine compiles
            logger.warning("modelexpress: compiled artifacts skipped (%s: %s); vLLM compiles "
                           "as usual", type(exc).__name__, exc,
                           exc_info=not isinstance(exc, MxError))
        report.phases["artifacts"] += time.perf_counter() - t0

    def _ready_now(self, identity: Any) -> bool:
        """A READY source of ``identity`` exists (a failed look says no)."""
        try:
            with self._client() as client:
                return bool(client.list_sources(identity=identity, state="READY"))
        except MxError:
            return False

    def _hand_off_zero(self) -> None:
        """Let the checkpoint fetched from zero go (see ``load_from_zero``), if any."""
        handoff, self._zero_handoff = self._zero_handoff, None
        if handoff is not None:
            handoff()

    def _check_probe(self, loaded: _Loaded, result: Any, report: LoadReport) -> None:
        """Compare the pulled model's probe with every serving source's; raise on mismatch."""
        verdicts = []
        for source_id, attributes in result.source_attributes.items():
            published = attributes.get(_probe.ATTRIBUTE)
            try:
                theirs = _probe.Probe.from_json(published) if published is not None else None
            except ValueError as exc:
                logger.warning("modelexpress: source %s published a malformed probe (%s); "
                               "treating it as absent", source_id, exc)
                theirs = None
            verdicts.append(_probe.compare_probes(loaded.probe, theirs, source=source_id))
        bad = next((v for v in verdicts if not v.ok), None)
        report.probe = bad or next((v for v in verdicts if v.outcome != "match"),
                                   verdicts[0] if verdicts else None)
        if bad is not None:
            logger.error("modelexpress: probe mismatch after pulling %s rank %d: %s; "
                         "loading from disk instead", report.identity.model,
                         report.identity.rank, bad.reason)
            raise _ProbeMismatch(f"probe mismatch: {bad.reason}")
        for verdict in verdicts:
            if verdict.outcome != "match":
                logger.warning("modelexpress: probe not checked: %s (the pull stands on its "
                               "digests)", verdict.reason)

    def _maybe_serve(self, model: nn.Module, identity: ModelIdentity, report: LoadReport,
                     loaded: _Loaded, arena: Any) -> bool:
        # (a model fetched from zero was loaded from the checkpoint, as from disk)
        wanted = (self.options.serve if report.source in ("disk", "storage", "fleet")
                  else self.options.serve_after_pull)
        if not wanted:
            return False
        if loaded.unservable or not loaded.tensors:
            report.not_serving_reason = loaded.unservable or "the model holds no tensors"
            logger.warning("modelexpress: not serving %s rank %d: %s", identity.model,
                           identity.rank, report.not_serving_reason)
            return False
        client = None
        try:
            from modelexpress.p2p import serve_source

            from modelexpress.local import LocalOptions

            client = self._client()
            attributes = {"vllm_form": "loaded"}
            if loaded.probe is not None:
                attributes[_probe.ATTRIBUTE] = loaded.probe.to_json()
            local = LocalOptions.from_settings(self._settings)
            tensors, buffers = (_shareable(loaded.tensors) if local.enabled
                                else (loaded.tensors, ()))
            handle = serve_source(identity, tensors, client=client, arena=arena,
                                  manager=self._manager(), backend=self._settings.nixl_backend,
                                  heartbeat_interval_s=self._settings.heartbeat_interval_s,
                                  single_region=self._settings.vmm_arena_single_mr,
                                  digest_algorithm=loaded.digest_algorithm,
                                  known_digests=loaded.digests, attributes=attributes,
                                  guardian=True, local=local, host_buffers=buffers,
                                  layout=self._layouts.published())
        except Exception as exc:  # noqa: BLE001 - serving is an extra; the engine runs without it
            # Our own errors say what went wrong; anything else is a bug: show where.
            report.not_serving_reason = f"{type(exc).__name__}: {exc}"
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
            # vLLM 0.26 has no BaseModelLoader.create_model (compat.py)
            return _compat.create_model(self, vllm_config, model_config, prefix)

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

    def _manager(self, create: bool = True) -> Any:
        """The loader's NIXL manager; started now if there is none and ``create``
        (serving needs one), else None (a pull makes its own when it needs NIXL)."""
        if self._nixl is None:
            if not create:
                return None
            self._nixl = AgentStart(self.options.pull_options.backend,
                                    getattr(self, "_device", None))
        return self._nixl.get()

    def _client(self) -> "MxClient":
        from modelexpress.client import MxClient

        return MxClient(self.options.server_url, token=self.options.server_token,
                        timeout_s=self.options.client_timeout_s,
                        retries=self.options.client_retries)


@dataclasses.dataclass
class _PullAttempt:
    touched: bool = False  # the model was written to; the disk path needs a new one
    unreachable: bool = False  # the control plane did not answer: no other pull is tried

    def touch(self) -> None:
        self.touched = True


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


def _shareable(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], tuple]:
    """``tensors`` with the CPU ones copied into one memfd-backed buffer, so that engines
    on this host can map them (the local transport); GPU tensors are shared as they are
    (CUDA IPC / VMM handles). The copy costs one more copy of a CPU engine's weights in
    host memory while it serves (``MX_IPC_DIR=off`` avoids it)."""
    cpu = {name: t for name, t in tensors.items() if t.device.type == "cpu"}
    if not cpu:
        return tensors, ()
    from modelexpress.local import host_buffer_like

    buf, copies = host_buffer_like(cpu, name="mx-vllm-weights")
    return {name: copies.get(name, t) for name, t in tensors.items()}, (buf,)


def _has_online_quant(model: nn.Module) -> bool:
    """vLLM's online quantization builds layers on the meta device and quantizes them
    while their weights load (the same test as vLLM's base loader)."""
    return any(getattr(getattr(m, "quant_method", None), "uses_meta_device", False)
               for m in model.modules())


def _post_process(model: nn.Module, model_config: ModelConfig, device: torch.device) -> None:
    """vLLM's post-load steps, in the order its base loader runs them, and nothing more:
    a full ``gc.collect()`` before and after them cost 0.8 s in a vLLM process whatever
    the model's size (the Python heap of vLLM's imports), and vLLM's own loader runs
    neither. (The re-create path still releases the discarded model's memory first.)"""
    if _has_online_quant(model):
        finalize_layerwise_processing(model, model_config)
    process_weights_after_loading(model, model_config, device)


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
# module -> the VMM arena its tensors live in: every module of a model loaded in an
# arena keeps it open (keep_arena_with)
_arenas: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()
_serving_lock = threading.Lock()


def keep_arena_with(model: nn.Module, arena: Any) -> None:
    """Keep ``arena`` open as long as any module of ``model`` lives.

    Not only the model object: vLLM keeps some of its layers elsewhere too (attention
    layers in the config's ``static_forward_context``, rotary embeddings in a cache
    shared by models), and those can outlive the model. Had the arena closed with the
    model, their tensors would point into unmapped memory: a later engine reusing a
    cached layer would read it, and freeing them aborts the process (PyTorch: ``invalid
    device pointer``). The price: such a layer keeps the arena's reservation, and the
    chunks the caching allocator has not given back, until it goes.
    """
    for module in model.modules():
        _arenas[module] = arena


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
