"""vLLM's compile cache, as the artifact exchange needs it: where it is, what must match,
and whether the engine used it.

Where vLLM keeps what it compiled (vLLM 0.32, torch >= 2.10: AOT compilation on by
default)::

    $VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<H>/
        inductor_cache/...        inductor's generated C++/Triton and built .so files,
                                  content-addressed, shared by the ranks of a node
        rank_<r>_<dp>/model       the AOT-compiled forward of rank r

``H`` is sha256 over vLLM's ``aot_compile_hash_factors`` (environment, the whole
``VllmConfig.compute_hash()``) and the compiled class's ``forward`` (vLLM version,
qualname, first line). ``VllmConfig.compute_hash()`` covers the model config's fields
except the tokenizer and served name, and so the checkpoint's *path* (``model``) but
not the architecture it describes: two engines that load one checkpoint from two
paths compile the same code into two directories, and two checkpoints with different
architectures at one path would share one. So artifacts are not matched by ``H``:
:func:`compile_key` is the same hash with the path left out and the architecture
(``hf_config``) put in, and each side names its own ``<H>`` directory by the compiled
class (``aot:LlamaModel.forward``); the target installs the source's files under its
own ``<H>`` (``ArtifactSet.prefixes``).

Without AOT (``VLLM_USE_AOT_COMPILE=0``) vLLM's directory hash covers the traced source
files' paths and contents, known only once Dynamo has traced; there both sides set
``compilation_config.cache_dir`` to ``torch_compile_cache/mx-<compile key>`` before
compiling (vLLM uses a preset ``cache_dir`` as it is), unless the operator set one.

Triton's kernels go where ``TRITON_CACHE_DIR`` points when they are built, else to
Triton's own directory (``~/.triton/cache``). vLLM's own Triton ops (its V2 model
runner's, the Triton attention backend's), JIT-compiled during the warm-up after CUDA
graph capture, land there; inductor's generated kernels go under inductor's cache
(``TORCHINDUCTOR_CACHE_DIR``, which vLLM sets to ``<H>/inductor_cache``: packed with
it). vLLM's older inductor adapter (``VLLM_USE_STANDALONE_COMPILE=0``) instead points
``TRITON_CACHE_DIR`` at ``torch_compile_cache/<config hash>/rank_<r>_<dp>/triton_cache``
as it starts compiling (the hash covers the checkpoint's path). Triton's cache is
content-addressed (one directory per kernel key), so its entries travel as two kinds
without prefixes: :data:`TRITON_KIND` (the process's own directory: what this process
wrote there) and :data:`VLLM_TRITON_KIND` (the one that adapter set). A target
installs both into its own directory, and links them into that adapter's the moment
vLLM names it (its "Using cache directory" record, logged just before).

Without vLLM's "mega" AOT artifact (vLLM 0.26 on torch < 2.12, or
``VLLM_USE_MEGA_AOT_ARTIFACT=0``) the AOT-compiled model holds the graph, not its
compiled pieces: loading it runs vLLM's backend again, which looks each piece up in
``torch_compile_cache/<config hash>/rank_<r>_<dp>/<prefix>/vllm_compile_cache.py`` (the
compiled-graph index: ``(compile range, piece, compiler) -> (name, absolute path)``) and
loads the standalone-compiled artifact it names, else compiles the piece again through
inductor's cache (1.2-2.4 s at 8B on an H100). That config hash covers the checkpoint's
path and the host's directories, so a target cannot compute it before vLLM names it.
The index and the artifacts it names travel as :data:`VLLM_BACKEND_KIND`; a target
installs them when vLLM names that directory (:func:`install_graph_index`), the index's
paths pointing there, and never over an index the engine has of its own.

Whether the engine used the files is observed, not assumed: :class:`CompileObserver`
reads vLLM's own compilation log records (AOT loaded, AOT load failed and compiled
again, compiled and saved, and the directory each names), and the target compares
the cache directory before and after: a kernel file the engine wrote is a kernel it
did not find in the pulled cache. The observer also sees the engine become fully
warm (vLLM's "init engine ... took" or, in a worker of its own, "Kernel JIT monitor
activated"): a source publishes only then, with every kernel its warm-up built.

Every vLLM name this feature touches is in this module.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import platform
import pprint
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from modelexpress.artifacts import ArtifactSet, InstallUnit
from modelexpress.identity import ModelIdentity

if TYPE_CHECKING:
    from torch import nn
    from vllm.config import VllmConfig

__all__ = ["KIND", "TRITON_KIND", "VLLM_BACKEND_KIND", "VLLM_TRITON_KIND", "CompileLayout",
           "CompileObserver", "GRAPH_INDEX", "backend_source_files", "install_graph_index",
           "rewrite_graph_index",
           "artifact_identity", "MODELINFOS", "compile_disabled_reason", "config_drift",
           "config_snapshot", "inductor_triton_files", "layout_of", "link_entries",
           "modelinfos_identity", "platform_facts", "process_start_time", "software_facts",
           "triton_entries", "vllm_triton_dir"]

log = logging.getLogger(__name__)

KIND = "vllm_compile"
"""Artifact kind of files under ``VLLM_CACHE_ROOT``."""
TRITON_KIND = "triton"
"""Artifact kind of Triton cache entries from the process's own Triton directory
(``TRITON_CACHE_DIR`` at load time, or ``~/.triton/cache``)."""
VLLM_TRITON_KIND = "triton_vllm"
"""Artifact kind of Triton cache entries from the directory vLLM points Triton at while
it compiles and warms up (:func:`vllm_triton_dir`): inductor's kernels and vLLM's own
Triton ops."""
VLLM_BACKEND_KIND = "vllm_backend"
"""Artifact kind of vLLM's compiled-graph index and the artifacts it names, relative to
``VLLM_CACHE_ROOT`` (``torch_compile_cache/<config hash>/rank_<r>_<dp>/<prefix>/...``);
installed where the target's vLLM names its own directory (:func:`install_graph_index`)."""
GRAPH_INDEX = "vllm_compile_cache.py"
"""vLLM's compiled-graph index in a backend directory (a Python literal)."""
_COMPILE_LOGGER = "vllm.compilation"
# Loggers of the records that say the engine is fully warm (each raised to INFO if
# needed, as the compilation logger is: our markers are INFO records).
_WARM_LOGGERS = ("vllm.v1.engine.core", "vllm.utils.jit_monitor")


def compile_disabled_reason(vllm_config: "VllmConfig") -> str | None:
    """Why this engine has no compile cache to share or use; None when it has one."""
    from vllm import envs
    from vllm.config import CompilationMode

    # NONE is eager; every other mode (VLLM_COMPILE on GPUs, DYNAMO_TRACE_ONCE on the
    # CPU build) runs inductor and writes the cache.
    mode = vllm_config.compilation_config.mode
    if mode == CompilationMode.NONE:
        return "compilation mode is NONE (enforce_eager or -O0)"
    if envs.VLLM_DISABLE_COMPILE_CACHE:
        return "VLLM_DISABLE_COMPILE_CACHE=1"
    return None


@dataclasses.dataclass
class CompileLayout:
    """Where this engine's compile cache is and what names it.

    Attributes:
        cache_root: ``VLLM_CACHE_ROOT``.
        aot: vLLM compiles ahead of time (``VLLM_USE_AOT_COMPILE``).
        rank_dir: ``rank_<r>_<dp>``: this rank's part inside each directory.
        key: :func:`compile_key` (path-independent).
        snapshot: the config's simple fields at load time (see :func:`config_drift`).
        modules: ``(qualname, forward key)`` of each module vLLM compiles.
        backend_prefix: without AOT, the ``cache_dir`` both sides compile into.
        triton_dir: this process's own Triton cache directory at load time
            (``TRITON_CACHE_DIR`` or ``~/.triton/cache``); None without Triton or CUDA.
    """

    cache_root: pathlib.Path
    aot: bool
    rank_dir: str
    key: str
    snapshot: dict[str, Any]
    modules: tuple[tuple[str, str], ...] = ()
    backend_prefix: str = ""
    triton_dir: pathlib.Path | None = None

    @property
    def roots(self) -> dict[str, pathlib.Path]:
        """Kind -> where a target installs it: both Triton kinds go to its own Triton
        directory (linked into vLLM's once vLLM names it, :func:`link_entries`)."""
        roots = {KIND: self.cache_root}
        if self.triton_dir is not None:
            roots[TRITON_KIND] = self.triton_dir
            roots[VLLM_TRITON_KIND] = self.triton_dir
        return roots

    def prefixes(self, vllm_config: "VllmConfig",
                 drift: dict[str, Any] | None = None) -> dict[str, str]:
        """Symbolic name -> the directory (relative to the root) vLLM compiles into, with
        ``drift`` (a source's :func:`config_drift`) applied to the config for the hash."""
        if not self.aot:
            return {"backend": self.backend_prefix}
        with _config_values(vllm_config, drift or {}):
            factors = _aot_factors(vllm_config)
        out = {}
        for qualname, forward_key in self.modules:
            h = hashlib.sha256(str(factors + [forward_key]).encode()).hexdigest()
            out[f"aot:{qualname}"] = f"torch_compile_cache/torch_aot_compile/{h}"
        return out

    def source_dirs(self, prefixes: dict[str, str]) -> list[tuple[str, str]]:
        """The directories a source packs: each prefix's shared part and this rank's
        (Triton's entries are added by the caller: :func:`triton_entries`)."""
        dirs = []
        for prefix in prefixes.values():
            dirs.append((KIND, f"{prefix}/{self.rank_dir}"))
            if self.aot:
                dirs.append((KIND, f"{prefix}/inductor_cache"))
        return dirs

    def units(self, prefixes: dict[str, str]) -> list[InstallUnit]:
        """The rank directories: installed whole, and a present one means "own cache"."""
        return [InstallUnit(KIND, f"{p}/{self.rank_dir}", exclusive=True)
                for p in prefixes.values()]

    def rank_paths(self, prefixes: dict[str, str]) -> list[pathlib.Path]:
        return [self.cache_root / p / self.rank_dir for p in prefixes.values()]


_SIMPLE = (str, int, float, bool, type(None))


def _config_fields(vllm_config: "VllmConfig") -> dict[str, Any]:
    """``sub.field -> value`` of every sub-config that has a hash, all fields."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(vllm_config):
        sub = getattr(vllm_config, f.name, None)
        if sub is None or not hasattr(sub, "compute_hash") or not dataclasses.is_dataclass(sub):
            continue
        for g in dataclasses.fields(sub):
            out[f"{f.name}.{g.name}"] = getattr(sub, g.name, None)
    return out


def config_snapshot(vllm_config: "VllmConfig") -> dict[str, Any]:
    """The config's fields now (shallow copies), to compare with later (:func:`config_drift`)."""
    return {k: (v if isinstance(v, _SIMPLE) else copy.copy(v))
            for k, v in _config_fields(vllm_config).items()}


def config_drift(before: dict[str, Any], vllm_config: "VllmConfig"
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """What vLLM changed in the config between ``before`` and now, as ``(simple, other)``.

    vLLM resolves some fields after the model is loaded and before it compiles (0.32:
    the KV cache layout, agreed by the engine core with every worker), and its compile
    hash covers them. The source sees the drift (its load-time snapshot against the
    config when compiling ended) and publishes the plain-valued part; a target applies
    it while it computes its own directory. ``other``: the changed fields whose values
    are not plain, with their load-time values (a target cannot apply those, so the
    source checks, with them put back, that its directory does not depend on them).
    """
    simple, other = {}, {}
    for key, value in _config_fields(vllm_config).items():
        old = before.get(key)
        try:
            same = old == value
        except Exception:  # noqa: BLE001 - an exotic __eq__; treat as changed
            same = False
        if key in before and not same:
            if isinstance(value, _SIMPLE) and isinstance(old, _SIMPLE):
                simple[key] = value
            else:
                other[key] = old
    return simple, other


@contextlib.contextmanager
def _config_values(vllm_config: "VllmConfig", values: dict[str, Any]) -> Iterator[None]:
    """The config with ``values`` set (``sub.field``) for the duration; restored after.

    ORDER: runs on the loading thread before the engine compiles; restored before
    anything else reads the config."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for key, value in values.items():
            sub_name, _, name = key.partition(".")
            sub = getattr(vllm_config, sub_name, None)
            if sub is None or not hasattr(sub, name):
                continue
            saved.append((sub, name, getattr(sub, name)))
            object.__setattr__(sub, name, value)
        yield
    finally:
        for sub, name, value in reversed(saved):
            object.__setattr__(sub, name, value)


def _compiled_modules(model: "nn.Module") -> list["nn.Module"]:
    """The submodules vLLM compiles (classes under ``@support_torch_compile``)."""
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    return [m for m in model.modules()
            if isinstance(m, TorchCompileWithNoGuardsWrapper)
            and not getattr(m, "do_not_compile", False)]


def _forward_key(module: "nn.Module") -> str:
    # the same three facts vLLM's decorators._model_hash_key hashes
    import vllm

    fn = module.forward
    h = hashlib.sha256()
    h.update(vllm.__version__.encode())
    h.update(fn.__qualname__.encode())
    h.update(str(fn.__code__.co_firstlineno).encode())
    return h.hexdigest()


def _aot_factors(vllm_config: "VllmConfig") -> list[str]:
    from vllm.compilation.caching import aot_compile_hash_factors

    return list(aot_compile_hash_factors(vllm_config))


def _neutral_factors(vllm_config: "VllmConfig") -> list[str]:
    """vLLM's AOT factors computed with the checkpoint's path left out, and with the
    environment's part taken without the host's directories (:func:`_env_factors`)."""
    model_config = vllm_config.model_config
    path = model_config.model
    # compute_hash reads model_config.model; set a constant for the one call. ORDER:
    # restored before anything else can read it (this runs on the loading thread,
    # before the engine compiles or serves).
    object.__setattr__(model_config, "model", "<modelexpress: path-independent>")
    try:
        factors = _aot_factors(vllm_config)
    finally:
        object.__setattr__(model_config, "model", path)
    whole, neutral = _env_factors()
    return [neutral if f == whole else f for f in factors]


def _env_factors() -> tuple[str, str]:
    """vLLM's hash of the environment's compile factors, and ours without the factors
    whose value is a directory of this host (under ``$HOME`` or the temp directory).

    vLLM hashes ``VLLM_CONFIG_ROOT`` (``~/.config/vllm``) into its compile cache key:
    two engines of one image with another ``HOME`` compile the same code under two
    keys (measured: vLLM 0.26 on an H100, engines whose HOME differed). What the
    engine compiles does not depend on where its home is, so the artifact identity
    leaves such values out; vLLM's own directory is still computed by vLLM's key on
    each side (:meth:`CompileLayout.prefixes`).
    """
    import tempfile

    from vllm import envs
    from vllm.config.utils import hash_factors

    factors = envs.compile_factors()
    homes = tuple(p for p in {os.path.expanduser("~"), tempfile.gettempdir()} if p != "/")
    neutral = {k: v for k, v in factors.items()
               if not (isinstance(v, str) and v.startswith(homes))}
    return hash_factors(factors), hash_factors(neutral)


def _architecture(vllm_config: "VllmConfig") -> str:
    """The HF config (the architecture the path stood for), without path-like fields."""
    hf = vllm_config.model_config.hf_config
    data = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    clean = {k: v for k, v in data.items() if not str(k).startswith("_")}
    return json.dumps(clean, sort_keys=True, default=str)


def compile_key(vllm_config: "VllmConfig", model: "nn.Module") -> str:
    """What the compiled code depends on, without where the checkpoint lives."""
    # str() of the list, as vLLM hashes its factors (some are bytes: inductor's).
    parts = [_neutral_factors(vllm_config), _architecture(vllm_config),
             sorted(_forward_key(m) for m in _compiled_modules(model))]
    return hashlib.sha256(str(parts).encode()).hexdigest()


def layout_of(vllm_config: "VllmConfig", model: "nn.Module") -> CompileLayout:
    """This engine's compile-cache layout (computed before vLLM compiles).

    Without AOT this also sets ``compilation_config.cache_dir`` (unless the operator
    did) so that source and target compile into the same, path-independent directory.
    """
    from vllm import envs

    root = pathlib.Path(envs.VLLM_CACHE_ROOT)
    parallel = vllm_config.parallel_config
    rank_dir = f"rank_{parallel.rank}_{getattr(parallel, 'data_parallel_index', 0)}"
    key = compile_key(vllm_config, model)
    backend = ""
    if not envs.VLLM_USE_AOT_COMPILE:
        compilation = vllm_config.compilation_config
        if not compilation.cache_dir:
            compilation.cache_dir = str(root / "torch_compile_cache" / f"mx-{key[:16]}")
        cache_dir = pathlib.Path(compilation.cache_dir)
        if cache_dir.is_relative_to(root):
            backend = cache_dir.relative_to(root).as_posix()
        else:  # the operator's own directory: its parent is the root of this kind
            root, backend = cache_dir.parent, cache_dir.name
    return CompileLayout(cache_root=root, aot=bool(envs.VLLM_USE_AOT_COMPILE),
                         rank_dir=rank_dir, key=key, snapshot=config_snapshot(vllm_config),
                         modules=tuple((m.forward.__qualname__, _forward_key(m))
                                       for m in _compiled_modules(model)),
                         backend_prefix=backend, triton_dir=_own_triton_dir())


def _own_triton_dir() -> pathlib.Path | None:
    """This process's Triton cache now, when Triton is installed and CUDA is there."""
    try:
        importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None  # CPU engines compile C++; Triton's cache is not theirs
    except ImportError:
        return None
    return pathlib.Path(os.environ.get("TRITON_CACHE_DIR")
                        or pathlib.Path.home() / ".triton" / "cache")


def vllm_triton_dir(local_cache_dir: str) -> pathlib.Path | None:
    """The Triton directory vLLM sets for a compile whose cache directory it logged
    ("Using cache directory: <cache_dir>/rank_<r>_<dp>/<prefix>"): its inductor adapter
    points ``TRITON_CACHE_DIR`` at ``<cache_dir>/rank_<r>_<dp>/triton_cache``."""
    found = re.match(r"(.*/rank_\d+_\d+)(?:/.*)?$", local_cache_dir.rstrip("/"))
    return pathlib.Path(found.group(1)) / "triton_cache" if found else None


def process_start_time() -> float:
    """When this process started (wall clock), from ``/proc``; the module's import time
    where ``/proc`` cannot say."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


_IMPORTED = time.time()


def triton_entries(directory: pathlib.Path | None, since: float | None = None) -> list[str]:
    """Triton cache entries (one directory per kernel key) under ``directory``, sorted.

    Args:
        since: only entries with a file written at or after this wall-clock time (a
            directory other processes share, e.g. ``~/.triton/cache``: what this
            process built, not the host's history); None: all.
    """
    if directory is None or not directory.is_dir():
        return []
    out = []
    for entry in sorted(directory.iterdir()):
        if not entry.is_dir() or entry.is_symlink() or entry.name.startswith("."):
            continue
        if since is not None:
            try:
                newest = max((f.stat().st_mtime for f in entry.iterdir()), default=0.0)
            except OSError:
                continue
            if newest < since:
                continue
        out.append(entry.name)
    return out


def inductor_triton_files(dirs: list[pathlib.Path]) -> list[tuple[pathlib.Path, list[str]]]:
    """The Triton cache entries under inductor's caches in ``dirs`` (an installed set's
    directories): ``(triton_dir, files relative to it)`` for each
    ``.../inductor_cache/triton/<device>`` directory found.

    Why: with AOT compilation vLLM 0.26 points ``TORCHINDUCTOR_CACHE_DIR`` into its
    ``torch_aot_compile/<hash>`` directory, and inductor, once it builds a Triton kernel,
    points ``TRITON_CACHE_DIR`` (process-wide) at ``<that>/triton/<device>``: a source
    that compiled JIT-compiles its warm-up's Triton kernels (vLLM's own ops included)
    there, inside the set. A target that loads the AOT-compiled model builds no inductor
    kernel, Triton keeps its default directory, and the warm-up compiled every kernel
    again (56 of them, 22 s, at 8B on an H100): the entries must also stand there.
    """
    out = []
    for root in dirs:
        for triton_dir in sorted(root.glob("**/inductor_cache/triton/*")):
            entries = triton_entries(triton_dir)
            files = [f"{entry}/{f.name}" for entry in entries
                     for f in sorted((triton_dir / entry).iterdir()) if f.is_file()]
            if files:
                out.append((triton_dir, files))
    return out


def link_entries(src: pathlib.Path, dst: pathlib.Path, files: list[str]) -> int:
    """Make the Triton entry files ``files`` (paths relative to ``src``) present under
    ``dst``: hard links (a copy across file systems), never over an existing file;
    group files (``__grp__*``) last, as Triton reads them to find the others.

    Returns:
        How many files were added.
    """
    added = 0
    for rel in sorted(files, key=lambda r: pathlib.PurePosixPath(r).name.startswith("__grp__")):
        target = dst / rel
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src / rel, target)
        except FileExistsError:
            continue
        except OSError:
            try:
                tmp = target.with_name(f".{target.name}.mx-{os.getpid()}")
                shutil.copyfile(src / rel, tmp)
                os.replace(tmp, target)
            except OSError as exc:
                log.debug("modelexpress: could not link %s into %s: %s", rel, dst, exc)
                continue
        added += 1
    return added


# --- vLLM's compiled-graph index (no mega AOT artifact) ------------------------------------
_BACKEND_DIR = re.compile(r"^torch_compile_cache/([^/]+)/(rank_\d+_\d+)/([^/]+)$")
_BACKEND_FILE = re.compile(r"^torch_compile_cache/([^/]+)/(rank_\d+_\d+)/([^/]+)/(.+)$")
_MAX_INDEX_BYTES = 4 << 20


def _graph_index(text: str) -> dict[Any, dict[str, Any]]:
    """vLLM's compiled-graph index, parsed as a literal (never run as code), each entry's
    ``graph_handle`` a ``(name, path)`` pair whose name is one plain file name.

    Raises:
        ValueError: not such an index.
    """
    if len(text) > _MAX_INDEX_BYTES:
        raise ValueError(f"an index of {len(text)} characters")
    try:
        data = ast.literal_eval(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise ValueError(f"not a Python literal: {type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise ValueError(f"a {type(data).__name__}, not a dict")
    for key, value in data.items():
        handle = value.get("graph_handle") if isinstance(value, dict) else None
        if not (isinstance(handle, tuple) and len(handle) == 2
                and all(isinstance(h, str) for h in handle)):
            raise ValueError(f"entry {key!r} has no (name, path) graph handle")
        name = handle[0]
        if not name or "/" in name or name in (".", "..", GRAPH_INDEX):
            raise ValueError(f"entry {key!r}: handle name {name!r} is not a plain file name")
    return data


def backend_source_files(cache_root: pathlib.Path, local_cache_dir: str) -> list[str]:
    """What a source carries of a backend directory vLLM named: its compiled-graph index
    and the artifacts the index names, relative to ``cache_root``, the index first.

    Empty when there is nothing to carry as it is: no index, an index without entries
    (vLLM's mega AOT artifact holds the pieces itself), a directory outside
    ``cache_root``, a handle that does not point into the directory, or an artifact the
    index names that is not there.
    """
    where = pathlib.Path(os.path.normpath(local_cache_dir))
    root = pathlib.Path(os.path.normpath(cache_root))
    if not where.is_relative_to(root):
        return []
    rel = where.relative_to(root).as_posix()
    if not _BACKEND_DIR.match(rel):
        return []
    try:
        entries = _graph_index((where / GRAPH_INDEX).read_text())
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        log.info("modelexpress: vLLM's compiled-graph index in %s is not carried: %s", where, exc)
        return []
    names = set()
    for key, value in entries.items():
        name, path = value["graph_handle"]
        if os.path.normpath(path) != str(where / name) or not os.path.lexists(where / name):
            log.info("modelexpress: vLLM's compiled-graph index in %s is not carried: entry "
                     "%r names %s, not a file of that directory", where, key, path)
            return []
        names.add(name)
    return [f"{rel}/{GRAPH_INDEX}", *(f"{rel}/{n}" for n in sorted(names))] if names else []


def rewrite_graph_index(text: str, where: pathlib.Path, names: set[str]) -> tuple[str, int]:
    """The index ``text`` with every handle pointing into ``where`` (the directory it is
    installed in), written as vLLM writes it; and its number of entries.

    Raises:
        ValueError: not an index, or an entry names an artifact that is not in ``names``.
    """
    out = {}
    for key, value in _graph_index(text).items():
        name = value["graph_handle"][0]
        if name not in names:
            raise ValueError(f"entry {key!r} names {name!r}, which the set does not carry")
        out[key] = {**value, "graph_handle": (name, str(where / name))}
    return pprint.PrettyPrinter(indent=4).pformat(out), len(out)


@dataclasses.dataclass
class GraphIndexInstall:
    """A compiled-graph index installed: its entries, the files written, their bytes."""

    graphs: int
    files: int
    bytes: int
    seconds: float


def install_graph_index(aset: ArtifactSet, raw: memoryview, cache_root: pathlib.Path,
                        local_cache_dir: str, rank_dir: str) -> GraphIndexInstall | str | None:
    """Install the set's compiled-graph index for the backend directory vLLM just named.

    Called on vLLM's thread, from its "Using cache directory" record, before vLLM reads
    the index there. The artifacts go first, the index (its handles pointing into
    ``local_cache_dir``) last, as a new file: an index vLLM can read names only files
    that are there, and an index of the engine's own is never replaced.

    Args:
        aset, raw: the installed set and its verified bytes.
        cache_root: this engine's ``VLLM_CACHE_ROOT``.
        local_cache_dir: the directory vLLM named
            (``<root>/torch_compile_cache/<config hash>/rank_<r>_<dp>/<prefix>``).
        rank_dir: this engine's ``rank_<r>_<dp>``.

    Returns:
        What was installed; a reason (one line) when the set carries an index for this
        prefix that was not installed; None when it carries none.
    """
    t0 = time.perf_counter()
    where = pathlib.Path(os.path.normpath(local_cache_dir))
    root = pathlib.Path(os.path.normpath(cache_root))
    if not where.is_relative_to(root):
        return None
    named = _BACKEND_DIR.match(where.relative_to(root).as_posix())
    if named is None or named.group(2) != rank_dir:
        return None
    prefix = named.group(3)
    by_hash: dict[str, dict[str, Any]] = {}
    for f in aset.files:
        found = _BACKEND_FILE.match(f.path) if f.kind == VLLM_BACKEND_KIND else None
        if found and found.group(2) == rank_dir and found.group(3) == prefix:
            by_hash.setdefault(found.group(1), {})[found.group(4)] = f
    if not by_hash:
        return None
    if len(by_hash) > 1:
        return f"the set carries {len(by_hash)} indexes for {rank_dir}/{prefix}"
    files = dict(next(iter(by_hash.values())))
    index = files.pop(GRAPH_INDEX, None)
    if index is None:
        return f"the set carries artifacts for {rank_dir}/{prefix} but no index"
    if os.path.lexists(where / GRAPH_INDEX):
        return f"vLLM has an index of its own at {where / GRAPH_INDEX}"
    try:
        text = bytes(raw[index.offset:index.offset + index.size]).decode()
        rewritten, graphs = rewrite_graph_index(
            text, where, {inner.split("/", 1)[0] for inner in files})
    except (UnicodeDecodeError, ValueError) as exc:
        return f"the set's index for {rank_dir}/{prefix} is not usable: {exc}"
    written = 0
    for inner, f in sorted(files.items()):
        _write_file(where / inner, raw[f.offset:f.offset + f.size], f.mode, replace=True)
        written += f.size
    data = rewritten.encode()
    if not _write_file(where / GRAPH_INDEX, memoryview(data), index.mode, replace=False):
        return f"vLLM wrote an index of its own at {where / GRAPH_INDEX} meanwhile"
    return GraphIndexInstall(graphs, len(files) + 1, written + len(data),
                             time.perf_counter() - t0)


def _write_file(dst: pathlib.Path, data: memoryview, mode: int, *, replace: bool) -> bool:
    """Write ``data`` to ``dst`` through a temporary file beside it; ``replace=False``
    never over an existing file (False then). The parent is made if needed."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.mx-{os.getpid()}-{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = data
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.chmod(tmp, mode & 0o777 or 0o644)
        if replace:
            os.replace(tmp, dst)
            return True
        try:
            os.link(tmp, dst)
        except FileExistsError:
            return False
        return True
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def platform_facts(device: Any) -> dict[str, str]:
    """Software and device facts a compiled artifact is valid for."""
    import torch
    import vllm

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "none"

    facts = {"vllm": vllm.__version__, "torch": torch.__version__,
             "triton": version("triton"), "python": platform.python_version(),
             "machine": platform.machine()}
    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        facts["device"] = f"cuda:{props.name}:sm_{props.major}{props.minor}"
        facts["cuda"] = str(torch.version.cuda)
    else:
        facts["device"] = f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    return facts


def artifact_identity(weights: ModelIdentity, layout: CompileLayout,
                      facts: dict[str, str]) -> ModelIdentity:
    """The identity an artifact set is published and looked up under.

    Everything that must match is in it (the compile key, software versions, device,
    the layout and rank, the weights identity's engine facts), the checkpoint's path is
    not: engines whose compiled code is the same share artifacts wherever their
    checkpoints live.
    """
    weights_facts = hashlib.sha256(json.dumps(list(weights.extra)).encode()).hexdigest()[:16]
    extra = {"artifacts": "vllm-compile-v1", "compile_key": layout.key,
             "aot": str(layout.aot), "weights_facts": weights_facts, **facts}
    return ModelIdentity(model="mx-artifacts/vllm-compile", revision="-",
                         dtype=weights.dtype, quantization=weights.quantization,
                         tp_size=weights.tp_size, pp_size=weights.pp_size,
                         ep_size=weights.ep_size, rank=weights.rank,
                         extra=tuple(extra.items()))


MODELINFOS = "modelinfos"
"""vLLM's cache of model-class inspections under ``VLLM_CACHE_ROOT`` (one JSON file per
architecture, checked by vLLM against its module's source hash). Without it vLLM
inspects the architecture in a subprocess that imports vLLM again, before the engine
is even configured (9-22 s measured)."""


def modelinfos_identity(facts: dict[str, str]) -> ModelIdentity:
    """The identity the model-info cache is published under: it depends on the vLLM
    release (its module hashes) and the Python that ran it, not on the model."""
    keep = {k: facts[k] for k in ("vllm", "python", "machine") if k in facts}
    return ModelIdentity(model="mx-artifacts/vllm-modelinfos", revision="-",
                         extra=tuple({"artifacts": "vllm-modelinfos-v1", **keep}.items()))


def software_facts() -> dict[str, str]:
    """The facts of :func:`modelinfos_identity`, known before any model is configured."""
    import vllm

    return {"vllm": vllm.__version__, "python": platform.python_version(),
            "machine": platform.machine()}


# --- what the engine did ----------------------------------------------------------------
@dataclasses.dataclass
class CompileEvents:
    """What vLLM logged about its compilation in this process (counts)."""

    aot_loaded: int = 0
    aot_load_failed: int = 0
    aot_saved: int = 0
    compiled: int = 0
    graph_cache_loaded: int = 0
    graphs_compiled: int = 0
    load_failure: str = ""
    dirs: list[str] = dataclasses.field(default_factory=list)
    done_at: float | None = None
    backend_dirs: list[str] = dataclasses.field(default_factory=list)
    warm_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.done_at is not None

    @property
    def compiled_fresh(self) -> bool:
        """vLLM compiled (and saved) rather than loaded. vLLM 0.26 logs "torch.compile
        took" around an AOT load too: that alone is not a compile."""
        return bool(self.aot_saved or (self.compiled and not self.aot_loaded))

    def verdict(self, installed_dirs: list[str], new_kernels: int, new_entries: int
                ) -> tuple[str, bool, str]:
        """``(hit|miss, compiled, detail)`` for a target that installed artifacts.

        Args:
            installed_dirs: where they went (absolute).
            new_kernels: kernel files (generated code, built ``.so``, cubins) the engine
                wrote there while compiling: each is a kernel it did not find in the cache.
            new_entries: other new cache entries (AOT-autograd's index), cheap to rebuild.
        """
        compiled = self.compiled_fresh
        elsewhere = [d for d in self.dirs if d not in installed_dirs]
        if elsewhere:
            return ("miss", compiled, f"vLLM compiled into {elsewhere[0]}, the artifacts went "
                    f"to {installed_dirs[0] if installed_dirs else '(nowhere)'}")
        if self.aot_loaded and not compiled:
            how = ""
            if self.graphs_compiled:  # no index for its graphs: inductor's cache served
                how = (f", compiling {self.graphs_compiled} graph range(s) again from "
                       "inductor's cache")
            elif self.graph_cache_loaded:
                how = ", its graphs from the pulled compiled-graph index"
            return "hit", False, f"vLLM loaded the AOT-compiled model from the pulled cache{how}"
        if self.graph_cache_loaded and not new_kernels and not self.aot_saved:
            return "hit", False, "vLLM loaded every compiled graph from the pulled cache"
        why = (f"vLLM compiled again ({self.load_failure})" if self.load_failure
               else "vLLM compiled")
        if not new_kernels:
            return ("hit", compiled, f"{why}, building no kernel: every one came from the "
                    f"pulled cache ({new_entries} new index entries)")
        return "miss", compiled, f"{why}, building {new_kernels} kernel file(s) itself"


def cache_files(dirs: list[pathlib.Path]) -> set[str]:
    """Every file under ``dirs`` (absolute paths), lock files left out."""
    out = set()
    for top in dirs:
        for dirpath, dirnames, files in os.walk(top):
            dirnames[:] = [d for d in dirnames if d != "locks"]
            out.update(os.path.join(dirpath, f) for f in files)
    return out


def split_new_files(new: set[str]) -> tuple[int, int]:
    """``(kernels, other entries)`` among newly written cache files: a rank directory's
    AOT artifact and AOT-autograd's index entries are not kernels."""
    kernels = sum(1 for f in new if "/aotautograd/" not in f and "/rank_" not in f)
    return kernels, len(new) - kernels


class CompileObserver(logging.Handler):
    """Watches vLLM's log records in this process: compilation, then the engine warm.

    Attach it before vLLM compiles (the loader does, in ``load_model``); ``wait()``
    returns the :class:`CompileEvents` once vLLM logged that its compilation ended (a
    save, a load, or its "torch.compile took" line), or None at the deadline;
    ``wait_warm()`` once the engine is fully warm (after CUDA graph capture and the
    warm-up that follows it). ``on_backend_dir`` is called on vLLM's thread with the
    directory of each "Using cache directory" record, before vLLM compiles into it.
    """

    _MARKERS = (
        ("Directly load AOT compilation", "aot_loaded"),
        ("Compiling model again due to a load failure", "aot_load_failed"),
        ("saved AOT compiled function", "aot_saved"),
        ("torch.compile took", "compiled"),
        ("torch.compile takes", "compiled"),
        ("Directly load the compiled graph", "graph_cache_loaded"),
        ("Compiling a graph for compile range", "graphs_compiled"),
    )
    _ENDS = ("aot_saved", "compiled", "aot_loaded")
    # The engine is warm: the engine core's last start-up line (in the worker's
    # process with one worker), or a worker's last warm-up step (vLLM 0.26+).
    _WARM = ("init engine (profile, create kv cache, warmup model) took",
             "Kernel JIT monitor activated")
    _BACKEND_DIR = re.compile(r"Using cache directory: (\S+) for vLLM's torch\.compile")

    def __init__(self, on_backend_dir: "Any" = None) -> None:
        super().__init__(level=logging.INFO)
        self.events = CompileEvents()
        self._done = threading.Event()
        self._warm = threading.Event()
        self._on_backend_dir = on_backend_dir
        # On the loggers that log our markers (their children propagate to them), not on
        # "vllm" itself: vLLM configures that one again as an engine starts (dictConfig
        # drops the handlers others attached there).
        self._loggers = [logging.getLogger(n) for n in (_COMPILE_LOGGER, *_WARM_LOGGERS)]

    def attach(self) -> "CompileObserver":
        for logger in self._loggers:
            logger.addHandler(self)
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)  # our markers are INFO records
        return self

    def detach(self) -> None:
        for logger in self._loggers:
            logger.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:  # noqa: D401 - logging API
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a handler must never raise into vLLM
            return
        if any(marker in message for marker in self._WARM):
            if self.events.warm_at is None:
                self.events.warm_at = time.time()
            self._warm.set()
            return
        backend = self._BACKEND_DIR.search(message)
        if backend:
            self.events.backend_dirs.append(backend.group(1))
            if self._on_backend_dir is not None:
                try:
                    self._on_backend_dir(backend.group(1))
                except Exception:  # noqa: BLE001 - never into vLLM; the cost is a compile
                    log.warning("modelexpress: preparing vLLM's cache directory %s failed",
                                backend.group(1), exc_info=True)
            return
        found = _AOT_PATH.search(message)
        if found:  # .../torch_aot_compile/<H>/rank_r_dp/model -> .../<H>
            directory = str(pathlib.PurePosixPath(found.group(1)).parent.parent)
            if directory not in self.events.dirs:
                self.events.dirs.append(directory)
        for marker, field in self._MARKERS:
            if marker in message:
                setattr(self.events, field, getattr(self.events, field) + 1)
                if field == "aot_load_failed":
                    self.events.load_failure = message.rsplit("reason:", 1)[-1].strip()[:200]
                if field in self._ENDS:
                    self.events.done_at = time.time()
                    self._done.set()
                return

    def wait(self, timeout_s: float) -> CompileEvents | None:
        return self.events if self._done.wait(timeout_s) else None

    def wait_warm(self, timeout_s: float) -> bool:
        """True once the engine logged that it is fully warm; False at the deadline."""
        return self._warm.wait(timeout_s)


_AOT_PATH = re.compile(r"(?:compiled function to|compilation from path|load failure from) "
                       r"(\S+?/rank_\d+_\d+/\S+?)(?:,|\s|$)")


def quiet_for(paths: list[pathlib.Path], settle_s: float, deadline_s: float) -> bool:
    """Wait until no file under ``paths`` changed for ``settle_s``; False at the deadline."""
    end = time.monotonic() + deadline_s
    last = None
    stable_since = time.monotonic()
    while time.monotonic() < end:
        snap = []
        for top in paths:
            for dirpath, _dirs, files in os.walk(top):
                for name in files:
                    try:
                        st = os.lstat(os.path.join(dirpath, name))
                    except OSError:
                        continue
                    snap.append((dirpath, name, st.st_size, st.st_mtime_ns))
        snap.sort()
        if snap != last:
            last, stable_since = snap, time.monotonic()
        elif time.monotonic() - stable_since >= settle_s:
            return True
        time.sleep(min(0.25, settle_s / 4))
    return False


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"

