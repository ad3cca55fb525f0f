"""modelexpress.engines.vllm: the vLLM plugin, model loader and shm-arena switch.

Importing this package does not import vLLM; each entry point imports it inside.
"""

__all__: list[str] = []
