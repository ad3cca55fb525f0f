"""modelexpress.engines.vllm: the vLLM plugin, model loader and shm-arena switch.

Importing this package does not import vLLM; each entry point imports it inside.
"""

from modelexpress.engines.vllm.shm import install_shm_tensor_arena, uninstall_shm_tensor_arena

__all__: list[str] = ["install_shm_tensor_arena", "uninstall_shm_tensor_arena"]
