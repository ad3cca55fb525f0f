"""``MxWeightTransferEngine``: the engine side of vLLM's weight-transfer API, backend ``mx``.

Registered by our ``vllm.general_plugins`` entry point (``plugin.register``) in every
vLLM process, so ``--weight-transfer-config '{"backend": "mx"}'`` selects it. The
trainer side is :mod:`modelexpress.rl.trainer`.

One update, in the order that keeps a failed update harmless:

::

    start_weight_update      nothing: the engine keeps serving its current weights
    update_weights({"version": v, "identities": [shard identities]})
      1. pull every shard of v into STAGING (host tensors kept from the last update;
         allocated from the manifest when the layout is new), digests checked
      2. only when all of v arrived and verified:
         initialize_layerwise_reload(model)             vLLM's own reload lifecycle
         model.load_weights(staged (name, tensor) ...)  names as the trainer holds them
         finalize_layerwise_reload(model, model_config) post-processing, as from disk
    finish_weight_update     nothing left to do

A failure in step 1 (the trainer crashed, a digest mismatch, a timeout) raises before
the model is touched: the engine keeps its previous weights and the error names the
version and the reason. Why staging rather than loading as bytes arrive: a layerwise
load started on partial data cannot be undone, and the staged copy is what lets an
update be all-or-nothing. Its memory is one copy of the trainer's tensors, reused.

Serving: an RL engine serves nothing. Its staging is never published (``pull`` into
it publishes no source), and a model that ``--load-format mx`` published after its
load from disk is withdrawn (marked STALE) when the engine initializes and again
before every load: the weights change under that source with each update, so a
peer that pulled it would get a weight version under the base model's identity (its
digests would fail, or worse, a probe would not catch a version that happens to
pass). Engines that need version ``v`` pull it from the trainer's version pool
(``modelexpress.rl``), which serves it under ``v``'s own identity.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from modelexpress.errors import ConfigError, ManifestMismatchError, MxError, WeightUpdateError
from modelexpress.identity import ModelIdentity
from modelexpress.rl.versions import RL_EXTRA

if TYPE_CHECKING:
    from modelexpress.client import MxClient

__all__ = ["BACKEND", "MxInitInfo", "MxUpdateInfo", "MxWeightTransferEngine"]

log = logging.getLogger(__name__)

BACKEND = "mx"


@dataclasses.dataclass
class MxInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine`` info of the ``mx`` backend.

    Attributes:
        model: the run's name (the trainer's ``MxTrainerInitInfo.model``).
        server_url: control plane to pull through; None: the engine's ``MX_SERVER_URL``.
    """

    model: str = "mx-rl"
    server_url: str | None = None


@dataclasses.dataclass
class MxUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights`` info: the version and the identity of each trainer shard.

    Attributes:
        version: the weight version to switch to.
        identities: ``ModelIdentity.to_dict()`` of every shard of it (their ids are
            checked against their fields).
    """

    version: str = ""
    identities: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class MxWeightTransferEngine(WeightTransferEngine[MxInitInfo, MxUpdateInfo]):
    """Pulls a weight version into staging, then loads it with vLLM's own loading."""

    init_info_cls = MxInitInfo
    update_info_cls = MxUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._client: MxClient | None = None
        self._model_name: str | None = None
        self._options = None
        self._staging: dict[str, dict[str, torch.Tensor]] = {}  # shard -> name -> tensor
        # One NIXL agent for every update: the staging memory stays registered with it,
        # so an update pays neither an agent's start nor a registration.
        self._manager: Any = None
        self._backend = "UCX"
        self.version: str | None = None
        self.last_error: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def init_transfer_engine(self, init_info: MxInitInfo) -> None:
        """Connect to the control plane (``MX_*`` settings, ``server_url`` overriding).

        Raises:
            ConfigError: an empty run name.
            ControlPlaneError: the control plane does not answer.
        """
        from modelexpress.client import MxClient
        from modelexpress.p2p.options import PullOptions
        from modelexpress.settings import MxSettings

        if not init_info.model:
            raise ConfigError("init_info.model (the run's name) must be non-empty")
        settings = MxSettings.load()  # a bad MX_* value is one line (ConfigError)
        if init_info.server_url:
            settings = settings.model_copy(update={"server_url": init_info.server_url})
        client = MxClient.from_settings(settings)
        client.health()
        if self._client is not None:
            self._client.close()
        self._client = client
        self._model_name = init_info.model
        # track=False: a weight update is not a transfer an operator follows on the
        # control plane, and one record per engine per step would flood it.
        self._options = PullOptions.from_settings(settings, track=False, device="cpu")
        self._backend = settings.nixl_backend
        self._stop_serving()
        log.info("mx weight transfer: run %s via %s", init_info.model, ",".join(client.base_urls))

    def start_weight_update(self) -> None:
        """Nothing: the previous weights serve until a whole version has arrived."""

    def finish_weight_update(self) -> None:
        """Nothing: :meth:`receive_weights` loaded and post-processed the version."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse and receive; vLLM 0.32's default also synchronizes an accelerator,
        which a CPU engine does not have (the load here is synchronous)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: MxUpdateInfo) -> None:
        """Pull ``update_info.version`` into staging, verify, then load it.

        Raises:
            WeightUpdateError: the version could not be pulled or verified; the model
                was not touched and keeps its previous weights.
        """
        if self._client is None or self._model_name is None:
            raise WeightUpdateError("the mx weight transfer engine was not initialized: "
                                    "call init_weight_transfer_engine first")
        version = str(update_info.version)
        t0 = time.perf_counter()
        try:
            staged, nbytes = self._stage(version, update_info.identities)
        except (MxError, ValueError) as exc:
            self.last_error = (f"version {version} of {self._model_name} not loaded; the "
                               f"engine keeps version {self.version or 'as started'}: "
                               f"{type(exc).__name__}: {exc}")
            log.error("%s", self.last_error)
            raise WeightUpdateError(self.last_error) from exc
        t1 = time.perf_counter()
        self._stop_serving()  # the target model may have been changed since init
        self._load(staged)
        t2 = time.perf_counter()
        self.version, self.last_error = version, None
        log.info("mx weight transfer: %s version %s: %d tensors, %d bytes pulled and verified "
                 "in %.3f s (%.2f GB/s), loaded in %.3f s", self._model_name, version,
                 len(staged), nbytes, t1 - t0, nbytes / max(t1 - t0, 1e-9) / 1e9, t2 - t1)

    def _stage(self, version: str, identities: list[dict[str, Any]]
               ) -> tuple[list[tuple[str, torch.Tensor]], int]:
        from modelexpress.p2p.target import pull

        if not identities:
            raise ConfigError(f"update of version {version} names no source identities")
        staged: list[tuple[str, torch.Tensor]] = []
        nbytes = 0
        for raw in identities:
            identity = ModelIdentity.from_dict(raw)
            if (identity.model != self._model_name or identity.revision != version
                    or RL_EXTRA not in identity.extra):
                raise ConfigError(
                    f"identity {identity.id} is {identity.model}@{identity.revision}, not a "
                    f"weight version {version} of run {self._model_name}")
            shard = dict(identity.extra).get("mx_rl_shard", "0/1")
            dest = self._staging.get(shard)
            got: dict[str, torch.Tensor] = {}
            try:
                result = pull(identity, dest, client=self._client, options=self._options,
                              manager=self._agent(), on_destination=got.update)
            except ManifestMismatchError:
                # The trainer's layout changed (a new shape or dtype): allocate anew, on a
                # new agent (the old one's registrations cover the old staging).
                self._drop_agent()
                self._staging.pop(shard, None)
                got.clear()
                result = pull(identity, None, client=self._client, options=self._options,
                              manager=self._agent(), on_destination=got.update)
            if not result.verified:
                raise WeightUpdateError(
                    f"version {version} shard {shard} arrived without verified digests "
                    f"(source {','.join(result.source_ids)}); MX_VERIFY_DIGESTS=0 is not "
                    "allowed for RL updates")
            self._staging[shard] = got
            staged.extend(got.items())
            nbytes += result.bytes
        return staged, nbytes

    def _stop_serving(self) -> None:
        """Withdraw the source the mx loader published for the model (module docstring)."""
        from modelexpress.engines.vllm.loader import stop_serving

        model = getattr(self, "model", None)
        if model is not None and stop_serving(model):
            log.info("mx weight transfer: stopped serving the weights %s loaded at start: an "
                     "RL engine's weights change with every update, so it serves none; "
                     "engines pull versions from the trainer", self._model_name or "the model")

    def _agent(self) -> Any:
        if self._manager is None:
            from modelexpress.transfer import NixlTransferManager

            self._manager = NixlTransferManager(backend=self._backend)
        return self._manager

    def _drop_agent(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.close()

    def _load(self, staged: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's own reload lifecycle, as its NCCL and IPC backends use it."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        self.model.load_weights(iter(staged))
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Drop the control-plane client and the staging copy. Idempotent."""
        if self._client is not None:
            self._client.close()
        self._client = None
        self._drop_agent()
        self._staging = {}
