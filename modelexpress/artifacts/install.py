"""Install a received artifact set: verified, staged, then renamed into place; never over a cache.

::

    check   every path safe (manifest.check_relative_path), every digest right,
            every prefix known      -> else ArtifactRefusedError, nothing written
    map     source prefixes -> this engine's own directories (symbolic names)
    guard   an exclusive unit (vLLM's rank directory) already exists
            -> "present": the engine has its own cache; nothing written
    stage   every file written under <root>/.mx-artifacts-staging-<id>/, then all
            fsynced together (_durable.fsync_all: they share journal commits)
    place   loose files: os.link (fails if the name exists: never overwrites)
            non-exclusive units: one rename each, skipped if present
            exclusive units LAST, one rename each
    clean   the staging directory goes, whatever happened

ORDER: exclusive units go last because their existence is what the engine (and the
guard above) reads as "a cache is here": the engine sees either no cache, or one whose
content-addressed files are already all in place. A crash in between leaves only a
staging directory (removed by the next install) and content-addressed files that are
correct wherever they are.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import os
import pathlib
import shutil
import time
import uuid
from collections.abc import Mapping

from modelexpress._durable import fsync_all
from modelexpress.artifacts.manifest import ArtifactFile, ArtifactSet, check_relative_path
from modelexpress.errors import ArtifactRefusedError, OutputError

__all__ = ["InstallResult", "install_set", "verify_blob", "STAGING_PREFIX"]

log = logging.getLogger(__name__)

STAGING_PREFIX = ".mx-artifacts-staging-"
_STALE_STAGING_S = 3600.0


@dataclasses.dataclass
class InstallResult:
    """What :func:`install_set` did.

    Attributes:
        outcome: ``installed`` or ``present`` (the engine had its own cache; untouched).
        files: files written into place.
        bytes: their size.
        kept: files (or units) left as they were because they already existed.
        skipped_kinds: kinds this target has no root for (their files were not written).
        seconds: wall time.
        reason: for ``present``, which directory was there.
    """

    outcome: str
    files: int = 0
    bytes: int = 0
    kept: int = 0
    skipped_kinds: tuple[str, ...] = ()
    seconds: float = 0.0
    reason: str = ""


def verify_blob(aset: ArtifactSet, blob: memoryview) -> None:
    """Every file's bytes in ``blob`` match its sha256 (the signed digests).

    Raises:
        ArtifactRefusedError: the blob is short or a digest differs (names the file).
    """
    if len(blob) < aset.total_bytes:
        raise ArtifactRefusedError(f"artifact blob has {len(blob)} bytes, the set needs "
                                   f"{aset.total_bytes}")
    for f in aset.files:
        digest = hashlib.sha256(blob[f.offset:f.offset + f.size]).hexdigest()
        if digest != f.sha256:
            raise ArtifactRefusedError(
                f"digest mismatch for artifact {f.kind}:{f.path} ({f.size} bytes): "
                f"the set says {f.sha256[:16]}..., the bytes are {digest[:16]}...")


def _map_path(path: str, prefixes: Mapping[str, str], mapping: Mapping[str, str]) -> str | None:
    """``path`` with its source prefix replaced by this target's; None if unmapped."""
    for prefix, symbol in prefixes.items():
        if path == prefix or path.startswith(prefix + "/"):
            mine = mapping.get(symbol)
            if mine is None:
                return None
            return check_relative_path(mine + path[len(prefix):], "mapped artifact path")
    return path


def _inside(root: pathlib.Path, rel: str) -> pathlib.Path:
    full = pathlib.Path(os.path.normpath(root / rel))
    if os.path.commonpath([str(root), str(full)]) != str(root):
        raise ArtifactRefusedError(f"artifact path {rel!r} leaves its root {root}")
    return full


def _clean_stale_staging(root: pathlib.Path) -> None:
    try:
        entries = list(root.glob(STAGING_PREFIX + "*"))
    except OSError:
        return
    now = time.time()
    for entry in entries:
        try:
            if now - entry.stat().st_mtime > _STALE_STAGING_S:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


def install_set(aset: ArtifactSet, blob: memoryview, roots: Mapping[str, pathlib.Path],
                mapping: Mapping[str, str] | None = None) -> InstallResult:
    """Install ``aset`` (bytes in ``blob``) under ``roots``.

    Args:
        aset: the set (already signature-checked by the caller).
        blob: its bytes (the pulled ``uint8`` tensor's memory).
        roots: kind -> this target's root for it; kinds not here are skipped.
        mapping: symbolic prefix name -> this target's directory for it (see
            :class:`~modelexpress.artifacts.manifest.ArtifactSet`). A file under a
            source prefix whose name has no mapping here is skipped.

    Returns:
        An :class:`InstallResult`.

    Raises:
        ArtifactRefusedError: a digest mismatch or an unsafe path; nothing installed.
        OutputError: the file system refused a write (full, read-only); nothing of the
            set is left in place except complete content-addressed files.
    """
    t0 = time.perf_counter()
    mapping = dict(mapping or {})
    verify_blob(aset, blob)
    roots = {k: pathlib.Path(os.path.abspath(v)) for k, v in roots.items()}
    skipped = tuple(sorted({f.kind for f in aset.files if f.kind not in roots}))

    # map every path; refuse anything that would leave its root
    placed: list[tuple[ArtifactFile, pathlib.Path, str]] = []
    for f in aset.files:
        if f.kind not in roots:
            continue
        rel = _map_path(f.path, aset.prefixes, mapping)
        if rel is None:
            continue
        placed.append((f, _inside(roots[f.kind], rel), rel))
    units = []
    for u in aset.units:
        if u.kind not in roots:
            continue
        rel = _map_path(u.path, aset.prefixes, mapping)
        if rel is None:
            continue
        units.append((u, _inside(roots[u.kind], rel), rel))

    for u, full, rel in units:
        if u.exclusive and os.path.lexists(full):
            return InstallResult("present", skipped_kinds=skipped,
                                 seconds=time.perf_counter() - t0,
                                 reason=f"{u.kind}:{rel} already exists (the engine's own cache)")

    def unit_of(full: pathlib.Path):  # noqa: ANN202
        for entry in units:
            if full.is_relative_to(entry[1]):
                return entry
        return None

    stage_id = uuid.uuid4().hex[:12]
    staging: dict[str, pathlib.Path] = {}
    result = InstallResult("installed", skipped_kinds=skipped)
    try:
        # stage: every byte written and fsynced before anything is placed
        written: list[pathlib.Path] = []
        for f, full, rel in placed:
            root = roots[f.kind]
            if f.kind not in staging:
                root.mkdir(parents=True, exist_ok=True)
                _clean_stale_staging(root)
                # one staging directory per kind: two kinds may share a root (Triton's
                # entries from two directories go to one)
                staging[f.kind] = root / f"{STAGING_PREFIX}{stage_id}-{f.kind}"
                staging[f.kind].mkdir()
            dst = staging[f.kind] / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, f.mode & 0o777 or 0o644)
            try:
                view = blob[f.offset:f.offset + f.size]
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            finally:
                os.close(fd)
            os.chmod(dst, f.mode & 0o777 or 0o644)  # the umask must not strip x bits
            written.append(dst)
        fsync_all(written)
        # place loose files (not inside any unit): link, never replace. Triton's group
        # files (__grp__*.json) name a kernel's other files: they go after them.
        for f, full, rel in sorted(placed, key=lambda e: e[1].name.startswith("__grp__")):
            if unit_of(full) is not None:
                continue
            full.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(staging[f.kind] / rel, full)
                result.files += 1
                result.bytes += f.size
            except FileExistsError:
                result.kept += 1
        # units: non-exclusive first, exclusive last (ORDER: module docstring)
        for u, full, rel in sorted(units, key=lambda e: e[0].exclusive):
            src = staging.get(u.kind, pathlib.Path("/nonexistent")) / rel
            if not src.exists():
                continue
            full.parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(full):
                if u.exclusive:  # appeared while we staged: the engine's own now
                    return InstallResult("present", files=result.files, bytes=result.bytes,
                                         skipped_kinds=skipped,
                                         seconds=time.perf_counter() - t0,
                                         reason=f"{u.kind}:{rel} appeared during the install")
                result.kept += 1
                continue
            try:
                os.rename(src, full)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    result.kept += 1
                    continue
                raise
            inside = [f for f, p, _ in placed if p.is_relative_to(full)]
            result.files += len(inside)
            result.bytes += sum(f.size for f in inside)
    except OSError as exc:
        raise OutputError(f"installing artifacts failed: {exc.strerror or exc} "
                          f"({getattr(exc, 'filename', '') or ''})",
                          errno=exc.errno) from exc
    finally:
        for path in staging.values():
            shutil.rmtree(path, ignore_errors=True)
    result.seconds = time.perf_counter() - t0
    return result
