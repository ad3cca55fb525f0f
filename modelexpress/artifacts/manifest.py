"""What an artifact set is: files under cache roots, packed into one blob, described once.

A compiled-artifact set is the part of an engine's caches that a peer with the same
software, device and model configuration can reuse instead of compiling: vLLM's
``torch_compile_cache`` for one compilation hash and rank (inductor's generated code
and built ``.so`` files inside it), Triton's cache where it lives outside, and other
JIT caches. The files travel as ONE ``uint8`` tensor (the blob) over the same data
plane as weights; this module describes where each file's bytes are in the blob and
where the file goes on a target::

    ArtifactSet
      files    (kind, path, size, mode, sha256, offset)   path: POSIX, relative to the kind's root
      units    (kind, path, exclusive)                   directories installed whole (renamed)
      prefixes {source path prefix -> symbolic name}    e.g. vLLM's hash directory -> "aot:LlamaModel.forward"
      facts    {name -> value}                           what had to match (also in the identity)

``prefixes`` exist because a cache directory's name can encode facts that differ
between peers without changing the compiled code (vLLM's compile hash covers the
checkpoint's path): the source names each such directory symbolically, and the target
maps the name to its own directory (see ``install.py``).

Everything the target acts on is in :meth:`ArtifactSet.canonical_bytes`, which the
source signs (:mod:`modelexpress.signing`): paths, sizes, modes, digests and prefixes.
A path that is absolute, contains ``..``, an empty or ``.`` component, a NUL or a backslash is
refused (:func:`check_relative_path`); symbolic links are never collected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import stat
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from modelexpress.errors import ArtifactRefusedError, ConfigError

__all__ = ["ArtifactFile", "ArtifactSet", "InstallUnit", "check_relative_path",
           "collect_files", "FORMAT"]

log = logging.getLogger(__name__)

FORMAT = "mx-artifacts-v1"
_MAX_FILES = 200_000
_MAX_PATH = 1024


def check_relative_path(path: str, what: str = "artifact path") -> str:
    """``path`` if it is a safe relative POSIX path, else :class:`ArtifactRefusedError`.

    Safe: non-empty, relative, no ``..``/``.``/empty component, no NUL or backslash,
    at most 1024 characters. The target joins it to a root it chose; nothing can
    point outside that root.
    """
    if not isinstance(path, str) or not path or len(path) > _MAX_PATH:
        raise ArtifactRefusedError(f"{what} {path!r}: empty, not a string or too long")
    if "\x00" in path or "\\" in path:
        raise ArtifactRefusedError(f"{what} {path!r}: contains NUL or a backslash")
    if path.startswith("/"):
        raise ArtifactRefusedError(f"{what} {path!r}: absolute")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ArtifactRefusedError(f"{what} {path!r}: has an empty, '.' or '..' component")
    return path


@dataclasses.dataclass(frozen=True)
class ArtifactFile:
    """One file of a set.

    Attributes:
        kind: which cache root it belongs to (``vllm_compile``, ``triton``...).
        path: POSIX path relative to that root.
        size: bytes.
        mode: permission bits (``0o644``, ``0o755``); nothing else is kept.
        sha256: hex digest of the content.
        offset: where its bytes start in the blob.
    """

    kind: str
    path: str
    size: int
    mode: int
    sha256: str
    offset: int

    def to_json(self) -> list[Any]:
        return [self.kind, self.path, self.size, self.mode, self.sha256, self.offset]

    @classmethod
    def from_json(cls, row: Any) -> "ArtifactFile":
        if not isinstance(row, list) or len(row) != 6:
            raise ArtifactRefusedError(f"malformed artifact file entry {row!r}")
        kind, path, size, mode, digest, offset = row
        if not (isinstance(kind, str) and isinstance(size, int) and isinstance(mode, int)
                and isinstance(digest, str) and isinstance(offset, int)):
            raise ArtifactRefusedError(f"malformed artifact file entry {row!r}")
        if size < 0 or offset < 0 or len(digest) != 64:
            raise ArtifactRefusedError(f"artifact file entry {row!r}: bad size/offset/digest")
        return cls(kind, check_relative_path(path), size, mode & 0o777, digest, offset)


@dataclasses.dataclass(frozen=True)
class InstallUnit:
    """A directory installed whole: staged, then renamed into place in one step.

    Attributes:
        kind, path: the directory (relative to the kind's root, before prefix mapping).
        exclusive: its existence on the target means the engine has a cache of its own
            there: the target installs nothing of the set (it never mixes caches).
            Non-exclusive units that exist are left as they are (content-addressed
            directories such as Triton's are the same wherever they exist).
    """

    kind: str
    path: str
    exclusive: bool = True

    def to_json(self) -> list[Any]:
        return [self.kind, self.path, self.exclusive]

    @classmethod
    def from_json(cls, row: Any) -> "InstallUnit":
        if (not isinstance(row, list) or len(row) != 3 or not isinstance(row[0], str)
                or not isinstance(row[2], bool)):
            raise ArtifactRefusedError(f"malformed install unit {row!r}")
        return cls(row[0], check_relative_path(row[1], "install unit"), row[2])


@dataclasses.dataclass(frozen=True)
class ArtifactSet:
    """The description of one artifact set (see the module docstring)."""

    files: tuple[ArtifactFile, ...]
    units: tuple[InstallUnit, ...] = ()
    prefixes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    facts: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return max((f.offset + f.size for f in self.files), default=0)

    @property
    def kinds(self) -> list[str]:
        return sorted({f.kind for f in self.files})

    def canonical_bytes(self) -> bytes:
        """The signed form: every field, sorted keys, no whitespace."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT,
                "files": [f.to_json() for f in self.files],
                "units": [u.to_json() for u in self.units],
                "prefixes": dict(self.prefixes), "facts": dict(self.facts)}

    @classmethod
    def from_json(cls, data: Any) -> "ArtifactSet":
        """Parse and validate (paths, overlaps, bounds); :class:`ArtifactRefusedError` if bad."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ArtifactRefusedError(
                f"not an artifact set of format {FORMAT} "
                f"(format {data.get('format') if isinstance(data, dict) else None!r})")
        rows = data.get("files")
        if not isinstance(rows, list) or len(rows) > _MAX_FILES:
            raise ArtifactRefusedError("artifact set without a valid file list")
        files = tuple(ArtifactFile.from_json(r) for r in rows)
        units = tuple(InstallUnit.from_json(r) for r in data.get("units") or [])
        prefixes = data.get("prefixes") or {}
        facts = data.get("facts") or {}
        if not (isinstance(prefixes, dict) and isinstance(facts, dict)):
            raise ArtifactRefusedError("artifact set prefixes/facts must be objects")
        for prefix, name in prefixes.items():
            check_relative_path(prefix, "artifact prefix")
            if not isinstance(name, str) or not name:
                raise ArtifactRefusedError(f"artifact prefix {prefix!r} has no symbolic name")
        seen: set[tuple[str, str]] = set()
        end = 0
        for f in sorted(files, key=lambda f: f.offset):
            if (f.kind, f.path) in seen:
                raise ArtifactRefusedError(f"artifact path {f.path!r} listed twice")
            seen.add((f.kind, f.path))
            if f.offset < end:
                raise ArtifactRefusedError(f"artifact file {f.path!r} overlaps another in the blob")
            end = f.offset + f.size
        return cls(files, units, {str(k): str(v) for k, v in prefixes.items()},
                   {str(k): str(v) for k, v in facts.items()})


def collect_files(roots: Mapping[str, pathlib.Path], dirs: Iterable[tuple[str, str]], *,
                  skip_dirs: Sequence[str] = ("locks",)) -> list[tuple[str, str, pathlib.Path, int, int]]:
    """The regular files under ``dirs``, sorted, as ``(kind, relpath, abspath, size, mode)``.

    Args:
        roots: kind -> the cache root it lives under.
        dirs: ``(kind, path relative to that root)``: directories to walk, or files.
        skip_dirs: directory names never collected (inductor's empty lock files).

    Symbolic links and special files are skipped (logged at DEBUG): a set only ever
    carries regular files, so it cannot make a target create a link.

    Raises:
        ConfigError: a kind without a root.
    """
    out: list[tuple[str, str, pathlib.Path, int, int]] = []
    for kind, rel in dirs:
        if kind not in roots:
            raise ConfigError(f"artifact kind {kind!r} has no root; known: {sorted(roots)}")
        root = pathlib.Path(roots[kind])
        top = root / rel
        if top.is_symlink():
            continue
        if top.is_file():  # one file named on its own
            st = os.lstat(top)
            out.append((kind, top.relative_to(root).as_posix(), top, st.st_size,
                        st.st_mode & 0o777))
            continue
        if not top.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs
                                 and not os.path.islink(os.path.join(dirpath, d)))
            for name in sorted(filenames):
                full = pathlib.Path(dirpath, name)
                st = os.lstat(full)
                if not stat.S_ISREG(st.st_mode):
                    log.debug("artifacts: skipping %s (not a regular file)", full)
                    continue
                relpath = full.relative_to(root).as_posix()
                out.append((kind, relpath, full, st.st_size, st.st_mode & 0o777))
    return out


def sha256_of(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
