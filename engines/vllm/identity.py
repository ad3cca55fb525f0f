"""The :class:`~modelexpress.identity.ModelIdentity` of one vLLM worker rank.

Two vLLM workers can exchange post-processed weights only when every fact that changes
the bytes or their layout agrees: the checkpoint (model, revision), the dtype, the
quantization method, the parallel layout and the rank within it, and, because
``process_weights_after_loading`` picks kernels (and so repacked layouts) by vLLM
version and device generation, those too. The manifest check of a pull catches
differing names, dtypes and shapes before any byte moves, but a same-shape different
layout (e.g. two repack orders) only the identity can keep apart, so it carries them.

This module reads vLLM's config objects and, when the distributed state is up, its
parallel ranks; it imports vLLM inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from modelexpress.identity import ModelIdentity

from modelexpress.engines.vllm.tensors import LAYOUT_VERSION

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

__all__ = ["identity_from_vllm", "vllm_ranks"]

logger = logging.getLogger(__name__)


def identity_from_vllm(vllm_config: "VllmConfig", model_config: "ModelConfig | None" = None,
                       *, extra: Mapping[str, Any] | None = None,
                       ranks: tuple[int, int, int] | None = None) -> ModelIdentity:
    """Build the identity of the weights this worker rank holds after a vLLM load.

    Args:
        vllm_config: the engine config the loader was called with.
        model_config: the model being loaded (a draft model has its own); defaults to
            ``vllm_config.model_config``.
        extra: user facts to keep pools apart (``mx_identity_extra``), e.g. a
            fine-tune id when two checkpoints share a path.
        ranks: ``(tp_rank, pp_rank, dp_rank)``; by default read from vLLM's
            distributed state (all 0 when it is not initialised, as in a
            single-process load).

    Returns:
        The identity; its ``extra`` holds the vLLM version, device kind, our layout
        version and any non-default setting that changes the post-processed bytes.

    Raises:
        ConfigError: the config gives an impossible layout (rank outside it).
    """
    import vllm

    model_config = model_config or vllm_config.model_config
    parallel = vllm_config.parallel_config
    tp_size = parallel.tensor_parallel_size
    pp_size = parallel.pipeline_parallel_size
    tp_rank, pp_rank, dp_rank = ranks if ranks is not None else vllm_ranks(
        data_parallel=parallel.data_parallel_size > 1)

    facts: dict[str, Any] = {
        "vllm": vllm.__version__,
        "device": _device_kind(vllm_config),
        "mx_layout": LAYOUT_VERSION,
    }
    ep_size = 1
    if parallel.enable_expert_parallel:
        # vLLM flattens DP x PCP x TP into the EP group, so ranks of different DP
        # replicas hold different experts: the DP rank is part of what this rank holds.
        ep_size = tp_size * parallel.data_parallel_size * parallel.prefill_context_parallel_size
        facts["dp_rank"] = dp_rank
        facts["ep_placement"] = getattr(parallel, "expert_placement_strategy", "")
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype != "auto":
        facts["kv_cache_dtype"] = cache_dtype  # attention k/v scales depend on it
    model_impl = str(getattr(model_config, "model_impl", "auto"))
    if model_impl not in ("auto", "ModelImpl.AUTO"):
        facts["model_impl"] = model_impl  # another implementation, other module tree
    hf_overrides = getattr(model_config, "hf_overrides", None)
    if hf_overrides:
        facts["hf_overrides"] = _digest(hf_overrides)
    for key, value in (extra or {}).items():
        facts[f"user.{key}"] = value

    return ModelIdentity(
        model=str(model_config.model),
        revision=model_config.revision or "main",
        dtype=str(model_config.dtype).removeprefix("torch."),
        quantization=str(model_config.quantization or "none"),
        tp_size=tp_size,
        pp_size=pp_size,
        ep_size=ep_size,
        rank=pp_rank * tp_size + tp_rank,
        extra=tuple((k, str(v)) for k, v in facts.items()),
    )


def vllm_ranks(*, data_parallel: bool = False) -> tuple[int, int, int]:
    """``(tp_rank, pp_rank, dp_rank)`` from vLLM's distributed state, or zeros.

    Args:
        data_parallel: the engine runs with DP > 1 (only then does vLLM build a DP
            group worth asking; its loaders use the same rule).

    Returns:
        The ranks of this process; zeros when vLLM's model-parallel groups are not
        initialised (a single-process load builds no groups).
    """
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 0, 0
    tp_rank = ps.get_tensor_model_parallel_rank()
    pp_rank = ps.get_pp_group().rank_in_group
    dp_rank = ps.get_dp_group().rank_in_group if data_parallel else 0
    return tp_rank, pp_rank, dp_rank


def _device_kind(vllm_config: "VllmConfig") -> str:
    """``cuda:sm90``-style: post-processing picks kernels by device generation."""
    from vllm.platforms import current_platform

    device_type = current_platform.device_type or vllm_config.device_config.device_type
    capability = current_platform.get_device_capability()
    if capability is None:
        return str(device_type or "cpu")
    return f"{device_type}:sm{capability.major}{capability.minor}"


def _digest(value: Any) -> str:
    blob = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
