"""The ``vllm.general_plugins`` entry point: ``modelexpress.engines.vllm.plugin:register``.

vLLM calls every general plugin in the engine process and again in each worker
(``init_worker`` loads them before the worker's queues are created from their
handles), so :func:`register` is idempotent and cheap, and imports vLLM only
inside the function (``import modelexpress`` stays light).
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelexpress.settings import MxSettings

__all__ = ["register", "register_weight_transfer"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Hook modelexpress into vLLM according to ``MxSettings`` (``MX_*`` environment).

    * always: ``--load-format mx`` selects
      :class:`~modelexpress.engines.vllm.loader.MxModelLoader` (as does vLLM's own
      ``--load-format modelexpress``).
    * always: the weight-transfer backend ``mx`` (``--weight-transfer-config
      '{"backend": "mx"}'``; trainer side ``MxTrainerInitInfo``), see
      :func:`register_weight_transfer`.
    * ``MX_SHM_TENSOR_ARENA=1``: every ``MessageQueue`` created afterwards routes
      large CPU tensors through the modelexpress shm tensor arena.

    Raises:
        ConfigError: an ``MX_*`` value is invalid (one line naming the variable).
        ShmArenaError: the arena was requested on an unsupported vLLM version
            (a request the user made explicitly must not be ignored silently).
    """
    global _registered
    with _lock:
        if _registered:
            return
        from modelexpress.settings import MxSettings
        settings = MxSettings.load()  # a bad MX_* value is one line, not pydantic's block
        _configure_logging(settings.log_level)

        # --- model loader -----------------------------------------------------
        # `--load-format mx`. vLLM's built-in `modelexpress` format reaches the
        # same MxModelLoader through its own wrapper and needs nothing here.
        from modelexpress.engines.vllm.loader import register_load_format
        register_load_format("mx")

        # --- weight-transfer backend `mx` (RL weight sync) ----------------------
        register_weight_transfer()

        # --- shm tensor arena --------------------------------------------------
        if settings.shm_tensor_arena:
            from modelexpress.engines.vllm.shm import install_shm_tensor_arena
            install_shm_tensor_arena(
                arena_bytes=settings.shm_arena_bytes,
                min_tensor_bytes=settings.shm_min_tensor_bytes,
                min_readers=settings.shm_arena_min_readers,
                prefault=settings.shm_arena_prefault,
            )
        _registered = True
    # --- vLLM's model-info cache (compiled artifacts) ----------------------------
    # ORDER: vLLM loads plugins before it configures the engine, and configuring it
    # inspects the architecture (in a subprocess, seconds) unless this cache has it.
    _prefetch_modelinfos(settings)
    log.debug("modelexpress vLLM plugin registered (shm tensor arena: %s)", settings.shm_tensor_arena)


def _prefetch_modelinfos(settings: "MxSettings") -> None:
    if not settings.artifact_key:
        return
    if not settings.server_configured:
        # Every vLLM process loads the plugin, engines that never use modelexpress
        # included: with no MX_SERVER_URL there is no control plane to ask, and trying
        # the default address would only log connection errors.
        log.debug("modelexpress: no MX_SERVER_URL; vLLM's model-info cache is not fetched")
        return
    try:
        from modelexpress.engines.vllm.artifacts import prefetch_modelinfos
        prefetch_modelinfos(settings)
    except Exception as exc:  # noqa: BLE001 - an extra: vLLM inspects the model itself
        log.warning("modelexpress: fetching vLLM's model-info cache failed (%s: %s); vLLM "
                    "inspects the model itself", type(exc).__name__, exc)


def register_weight_transfer() -> None:
    """Register ``mx`` with vLLM's weight-transfer factories (engine and trainer side).

    Lazily, by module path, as vLLM registers its own backends: neither module is
    imported until a config selects ``mx``. A name already taken (a second call, or
    another plugin that claimed ``mx``) is left as it is.
    """
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, module, cls in (
            (WeightTransferEngineFactory, "modelexpress.engines.vllm.weight_transfer",
             "MxWeightTransferEngine"),
            (WeightTransferTrainerFactory, "modelexpress.rl.trainer",
             "MxTrainerWeightTransferEngine")):
        try:
            factory.register_engine("mx", module, cls)
        except ValueError:  # the name is taken; vLLM's registries have no lookup to ask first
            log.debug("%s already has a backend named mx; left as it is", factory.__name__)


def _configure_logging(level: str) -> None:
    """Send our log lines where vLLM's go (stdout), at ``MX_LOG_LEVEL``.

    The plugin is modelexpress's entry point in every vLLM process, and vLLM configures
    only its own ``vllm`` logger: without a handler here the loader's INFO lines
    (pulled from which source, probe verdict, why it fell back) would be lost and its
    warnings printed bare by logging's last-resort handler. An application that
    configured the ``modelexpress`` logger itself keeps its handlers.
    """
    ours = logging.getLogger("modelexpress")
    if ours.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(
        "%(levelname)s %(asctime)s [%(name)s] %(message)s", datefmt="%m-%d %H:%M:%S"))
    ours.addHandler(handler)
    ours.setLevel(level)
    ours.propagate = False
