"""RL weight sync: the trainer side of the ``mx`` backend of vLLM's weight-transfer API.

:mod:`~modelexpress.rl.versions` (weight versions as sources in a fixed pool of host
buffers) needs no vLLM; :mod:`~modelexpress.rl.trainer` (vLLM's
``TrainerWeightTransferEngine`` for ``mx``) imports vLLM and is loaded on first use of
its names. The engine side is ``modelexpress.engines.vllm.weight_transfer``; the
``vllm.general_plugins`` entry point registers both under the backend name ``mx``.
"""

from __future__ import annotations

from typing import Any

from modelexpress.rl.versions import (
    RL_EXTRA,
    PublishedVersion,
    VersionBusyError,
    VersionPool,
    version_identity,
)

__all__ = ["RL_EXTRA", "PublishedVersion", "VersionBusyError", "VersionPool", "version_identity",
           "FanOutClient", "MxTrainerInitInfo", "MxTrainerWeightTransferEngine", "SendReport",
           "StateDictSource"]

_TRAINER = {"FanOutClient", "MxTrainerInitInfo", "MxTrainerWeightTransferEngine", "SendReport",
            "StateDictSource"}


def __getattr__(name: str) -> Any:
    # The trainer engine subclasses vLLM's classes: import vLLM only when it is asked for.
    if name in _TRAINER:
        from modelexpress.rl import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
