"""What differs between the vLLM releases the loader runs on (0.26, 0.32, 0.33).

The loader is tested against three releases: vLLM 0.26.0 (the newest that pins
``torch==2.11.0``, the torch of the H200 host the GPU tests ran on), vLLM's CPU build 0.32.0
(CI's engines) and 0.33.0's Python files. Where their loader API differs the gate
is here, decided by what the module offers (a structural check), not by the
version string: a patched or backported vLLM then takes the right branch too.

Differences found (each one a failure seen with that release):

- ``BaseModelLoader.create_model`` (0.32+) does not exist in 0.26, whose
  ``load_model`` calls ``model_loader.utils.initialize_model`` inline. The loader
  builds the model itself (to pull into it), so it needs one of the two.

The rest of what the loader imports (``model_loader.reload``,
``utils.torch_utils.set_default_torch_dtype``, ``config.replace``,
``config.load.LoadConfig``, ``get_current_vllm_config_or_none``) is the same in all
three; ``tests/engines/test_vllm_026.py`` runs the loader-API tests against 0.26.0's
Python files to keep it so.

Only vLLM (and our loader) import this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from vllm.config import ModelConfig, VllmConfig
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

__all__ = ["create_model"]


def create_model(loader: "BaseModelLoader", vllm_config: "VllmConfig",
                 model_config: "ModelConfig", prefix: str = "") -> "nn.Module":
    """Build ``model_config``'s model the way ``loader``'s vLLM does, weights unloaded.

    Call it inside the target device's context and the model dtype's
    ``set_default_torch_dtype``, as vLLM's own ``load_model`` does.

    Args:
        loader: a vLLM model loader (ours or vLLM's).
        vllm_config: the engine config.
        model_config: the model to build.
        prefix: module-name prefix for nested models.

    Returns:
        The model, with its parameters allocated and not filled.
    """
    create = getattr(loader, "create_model", None)
    if create is not None:  # vLLM 0.32+: the loader's own step (it also logs)
        return create(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
    # vLLM 0.26: BaseModelLoader.load_model builds the model with initialize_model
    # inline; the same call, without the rest of load_model.
    from vllm.model_executor.model_loader.utils import initialize_model

    return initialize_model(vllm_config=vllm_config, model_config=model_config,
                            prefix=prefix)
