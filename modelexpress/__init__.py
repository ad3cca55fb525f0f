"""modelexpress: peer-to-peer weight transfer for LLM inference over NIXL.

Importing this package is light on purpose: it imports none of torch, nixl,
fastapi or vllm (a test checks it in a fresh interpreter). The heavy parts live in
subpackages that import their dependencies when used.
"""

from __future__ import annotations

from modelexpress import errors
from modelexpress.errors import MxError

__all__ = ["__version__", "errors", "MxError"]

__version__ = "0.1.0"
