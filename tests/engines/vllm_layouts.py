"""Load a tiny checkpoint as one tensor-parallel rank, in this process, with its layout.

``load_rank`` builds vLLM's real model class for rank ``rank`` of ``tp`` under
:func:`~modelexpress.engines.vllm.layout.simulated_tensor_parallel` (no process group:
vLLM's weight loaders only narrow and copy), derives the rank's layout with vLLM's
own loaders and, unless ``fill`` is False, loads the checkpoint with vLLM's disk
loader through a :class:`~modelexpress.engines.vllm.layout.BlockHasher`, so the layout
carries the block digests a source would publish. Used by ``test_vllm_layout.py`` and
``bench/layout.py``.
"""

from __future__ import annotations

import pathlib

import torch

__all__ = ["load_rank", "vllm_config"]


def vllm_config(model_dir: pathlib.Path, tp: int, dtype: str = "float32"):  # noqa: ANN201
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    mc = ModelConfig(model=str(model_dir), dtype=dtype, skip_tokenizer_init=True,
                     enforce_eager=True)
    return VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                      load_config=LoadConfig(load_format="auto"),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp))


def load_rank(model_dir: pathlib.Path, tp: int, rank: int, *, fill: bool = True,
              dtype: str = "float32"):  # noqa: ANN201
    """``(loaded tensors by name, layout)`` of rank ``rank`` of ``tp``.

    With ``fill`` False the tensors are as construction left them (a target before its
    pull) and the layout has no block digests.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    from modelexpress.engines.vllm.compat import create_model
    from modelexpress.engines.vllm.layout import derive_layout, simulated_tensor_parallel
    from modelexpress.engines.vllm.layout_blocks import BlockHasher, checkpoint_table
    from modelexpress.engines.vllm.tensors import collect_loaded_tensors

    vc = vllm_config(model_dir, tp, dtype)
    mc = vc.model_config
    loader = get_model_loader(vc.load_config)
    with simulated_tensor_parallel(tp, rank):
        layout, sliced = derive_layout(vc, mc, checkpoint_table(model_dir), loader,
                                       tp_size=tp, rank=rank)
        with set_current_vllm_config(vc), set_default_torch_dtype(mc.dtype), \
                torch.device("cpu"):
            model = create_model(loader, vc, mc)
        if fill:
            hasher = BlockHasher(layout, sliced, torch.device("cpu"))
            with set_current_vllm_config(vc):
                model.load_weights(hasher.wrap(loader.get_all_weights(mc, model)))
            layout = layout.with_blocks(hasher.table())
    # the compilation registry must not keep this model's layers for the next build
    vc.compilation_config.static_forward_context.clear()
    return collect_loaded_tensors(model), layout
