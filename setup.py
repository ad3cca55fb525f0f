"""Build script: the package mapping and the optional C extension.

pyproject.toml holds the metadata. This file exists for two things setuptools
cannot say declaratively:

* ``server/`` installs as ``modelexpress.server`` and ``engines/`` as
  ``modelexpress.engines`` (a ``package_dir`` mapping, so the checkout keeps the
  fixed top-level layout while everything imports under one namespace);
* ``modelexpress/vmm/_alloc_ext.cpp`` is optional: without a working C++ compiler
  the package still installs (pure Python) and ``ARENA_AVAILABLE`` is False.
"""

from __future__ import annotations

import logging
import os

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

_MAPPED = {"modelexpress": "modelexpress", "modelexpress.server": "server",
           "modelexpress.engines": "engines"}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for name, folder in _MAPPED.items():
        package_dir[name] = folder
        packages.append(name)
        packages.extend(f"{name}.{sub}" for sub in find_packages(folder))
    # find_packages inside modelexpress/ must not re-discover the mapped ones.
    return sorted(set(packages)), package_dir


class OptionalBuildExt(build_ext):
    """build_ext that turns a failed compile into a warning, not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure is optional
            logging.warning("modelexpress: C extension not built (%s); "
                            "the VMM arena fast path is disabled", exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            logging.warning("modelexpress: could not build %s (%s); "
                            "continuing without it", ext.name, exc)


_EXT_SOURCE = os.path.join("modelexpress", "vmm", "_alloc_ext.cpp")
ext_modules = []
if os.path.exists(_EXT_SOURCE) and os.environ.get("MX_BUILD_EXT", "1") != "0":
    ext_modules.append(Extension(
        "modelexpress.vmm._alloc_ext",
        sources=[_EXT_SOURCE],
        language="c++",
        extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden"],
    ))

def _plain_c(name: str, *path: str) -> None:
    """A plain-C extension (no libtorch, pthreads), built where its source exists."""
    source = os.path.join(*path)
    if os.path.exists(source) and os.environ.get("MX_BUILD_EXT", "1") != "0":
        ext_modules.append(Extension(
            name,
            sources=[source],
            extra_compile_args=["-O2", "-fvisibility=hidden", "-pthread"],
            extra_link_args=["-pthread"],
        ))


# Release/acquire atomics for the shm tensor arena. Optional like the VMM extension:
# without it modelexpress.shm_arena falls back to Python fences with weaker ordering
# guarantees (documented in shm_arena/atomics.py).
_plain_c("modelexpress.shm_arena._atomics", "modelexpress", "shm_arena", "_atomics.c")
# The host copier's piece loop without the GIL. Optional: without it
# modelexpress.local.hostcopy runs the same pieces in Python threads.
_plain_c("modelexpress.local._copyloop", "modelexpress", "local", "_copyloop.c")

packages, package_dir = _packages()
setup(
    packages=packages,
    package_dir=package_dir,
    ext_modules=ext_modules,
    cmdclass={"build_ext": OptionalBuildExt},
)
