"""Compiled artifacts (time to ready): an engine's JIT caches travel with its weights.

An engine that has compiled (vLLM's ``torch_compile_cache``, inductor's generated code
and ``.so`` files, Triton kernels) serves those files as a signed *artifact set* beside
its weights; a new engine with the same software, device and configuration pulls,
verifies and installs them before it compiles, and compiles nothing or little.

* ``manifest.py``: :class:`ArtifactSet` (files, install units, prefixes, facts), path rules.
* :class:`ArtifactKey` (``MX_ARTIFACT_KEY``, HMAC-SHA256) lives in :mod:`modelexpress.signing`,
  below the settings that check the key at start-up.
* ``install.py``: :func:`install_set`: verified, staged, renamed; never over a cache.
* ``exchange.py``: :func:`pack_files`, :func:`buffer_from`, :func:`serve_packed`,
  :func:`pull_artifacts` (or its two halves, :func:`fetch_artifacts` and
  :meth:`PulledSet.install`, for a caller that installs beside other work).

Engine-specific knowledge (where vLLM keeps its cache, what must match, whether the
engine used the files) lives in the engine adapter
(``modelexpress.engines.vllm.compile_cache``). Importing this package imports neither
torch nor NIXL.
"""

from modelexpress.artifacts.exchange import (ATTR_SET, ATTR_SIGNATURE, ATTR_VARIANTS, BLOB,
                                             OUTCOMES, ArtifactPull, PulledSet, blob_bytes,
                                             buffer_from,
                                             fetch_artifacts, pack_files, pull_artifacts,
                                             serve_packed, signed_payload)
from modelexpress.artifacts.install import InstallResult, install_set, verify_blob
from modelexpress.artifacts.manifest import (ArtifactFile, ArtifactSet, InstallUnit,
                                             check_relative_path, collect_files)
from modelexpress.signing import ArtifactKey

__all__ = [
    "ATTR_SET",
    "ATTR_SIGNATURE",
    "ATTR_VARIANTS",
    "ArtifactFile",
    "ArtifactKey",
    "ArtifactPull",
    "ArtifactSet",
    "BLOB",
    "blob_bytes",
    "buffer_from",
    "InstallResult",
    "InstallUnit",
    "OUTCOMES",
    "PulledSet",
    "check_relative_path",
    "collect_files",
    "fetch_artifacts",
    "install_set",
    "pack_files",
    "pull_artifacts",
    "serve_packed",
    "signed_payload",
    "verify_blob",
]
