"""Artifact sets as sources: packed into one blob, served and pulled like weights.

A set's files are read into one memfd-backed ``uint8`` tensor (``artifacts``) and
published with :func:`~modelexpress.p2p.serve_source` under the set's own identity:
peers on this host map it over the local transport, others READ it over NIXL, the
server keeps only metadata (the set and its signature ride in the manifest's
attributes). A target:

1. lists READY sources of the artifact identity (none: ``miss``);
2. groups them by content (the control plane's manifest fingerprint): engines that
   compiled for themselves serve sets of other bytes under one identity, published as
   content variants (``mx_variants: by-content``), which the control plane lets
   coexist; the group most replicas serve comes first;
3. checks a source's set and signature *before* any byte moves (bad, unsigned,
   another key: that source is passed over; all bad: ``refused``);
4. pulls the blob with :func:`~modelexpress.p2p.pull` from the sources that serve
   exactly the verified set (the verified one first, digests checked by the data plane);
5. checks every file against the signed sha256 and installs (``install.py``):
   ``installed``, ``present`` (its own cache is there; untouched) or ``refused``.

Outcomes are strings (:data:`OUTCOMES`) because they end up in logs, load reports and
Prometheus labels alike; whether the engine then used the files (``hit``) is for the
engine's adapter to observe.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from modelexpress.artifacts.install import InstallResult, install_set
from modelexpress.artifacts.manifest import ArtifactSet, InstallUnit, collect_files
from modelexpress.errors import ArtifactRefusedError, MxError
from modelexpress.signing import ArtifactKey

if TYPE_CHECKING:
    from modelexpress.client import MxClient
    from modelexpress.identity import ModelIdentity
    from modelexpress.local import HostBuffer, LocalOptions
    from modelexpress.p2p import PullOptions, SourceHandle

__all__ = ["ATTR_SET", "ATTR_SIGNATURE", "ATTR_VARIANTS", "BLOB", "OUTCOMES", "ArtifactPull",
           "PulledSet", "blob_bytes", "buffer_from", "fetch_artifacts", "pack_files",
           "pull_artifacts",
           "serve_packed", "signed_payload"]

log = logging.getLogger(__name__)

ATTR_SET = "mx_artifacts"
ATTR_SIGNATURE = "mx_artifacts_signature"
ATTR_VARIANTS = "mx_variants"
"""Manifest attribute: ``by-content`` declares that sources of this identity may serve
different contents side by side (``server/content.py``); a reader picks one content."""
BLOB = "artifacts"
# Sources whose sets are checked (one get_source each) before one is chosen.
_MAX_CANDIDATES = 16
OUTCOMES = ("installed", "present", "miss", "refused", "off", "error")
"""``installed``: written into this engine's cache roots; ``present``: the engine had a
cache of its own (left alone); ``miss``: no source serves this artifact identity;
``refused``: signature, digest or path checks failed (nothing installed); ``off``: no
key configured; ``error``: the pull or the write failed (the engine compiles)."""


@dataclasses.dataclass
class ArtifactPull:
    """How one artifact pull went (also logged by the caller).

    Attributes:
        outcome: one of :data:`OUTCOMES`.
        reason: why, in one line (for everything but ``installed``).
        source_id: the source whose signed set was installed or refused.
        files, bytes: what was installed.
        kinds: the artifact kinds in the set.
        pull_seconds: the data plane (the pull call).
        install_seconds: verification and writing.
        transport: the transport the blob came over (``local``, ``cma``, ``rc_mlx5``...).
        install: the :class:`~modelexpress.artifacts.install.InstallResult`, if any.
        aset, blob: the verified set and its bytes (a ``uint8`` tensor) once installed,
            for an engine that serves what it installed (:func:`buffer_from`).
        variants: how many distinct contents READY sources served.
    """

    outcome: str
    reason: str = ""
    source_id: str | None = None
    files: int = 0
    bytes: int = 0
    kinds: tuple[str, ...] = ()
    pull_seconds: float = 0.0
    install_seconds: float = 0.0
    transport: str = ""
    install: InstallResult | None = None
    aset: ArtifactSet | None = None
    blob: Any = None
    variants: int = 0


def pack_files(roots: Mapping[str, pathlib.Path], dirs: Sequence[tuple[str, str]], *,
               units: Sequence[InstallUnit] = (), prefixes: Mapping[str, str] | None = None,
               facts: Mapping[str, str] | None = None,
               name: str = "mx-artifacts") -> tuple[ArtifactSet, "HostBuffer"]:
    """Read the files under ``dirs`` into one new host buffer and describe them.

    Each file's sha256 is taken from the bytes copied into the buffer (not from the
    file again), so what is signed is exactly what is served.

    Returns:
        ``(set, buffer)``; serve them with :func:`serve_packed`.

    Raises:
        ConfigError: nothing to pack, or a kind without a root.
    """
    import hashlib

    from modelexpress.artifacts.manifest import ArtifactFile
    from modelexpress.errors import ConfigError
    from modelexpress.local import HostBuffer

    found = collect_files(roots, dirs)
    if not found:
        raise ConfigError(f"no artifact files under {[f'{k}:{d}' for k, d in dirs]}")
    total = sum(size for *_, size, _mode in found)
    buf = HostBuffer(max(total, 1), name=name)
    view = memoryview(buf.tensor(0, (max(total, 1),), _uint8()).numpy()).cast("B")
    files, offset = [], 0
    for kind, rel, full, size, mode in found:
        with open(full, "rb") as fh:
            got = fh.readinto(view[offset:offset + size])
        if got != size:
            buf.close()
            raise ConfigError(f"artifact file {full} changed size while it was read")
        digest = hashlib.sha256(view[offset:offset + size]).hexdigest()
        files.append(ArtifactFile(kind, rel, size, mode, digest, offset))
        offset += size
    view.release()
    aset = ArtifactSet(tuple(files), tuple(units), dict(prefixes or {}), dict(facts or {}))
    return aset, buf


def blob_bytes(blob: Any) -> memoryview:
    """The bytes of a pulled set's blob (its ``uint8`` tensor), without a copy when it
    is in host memory."""
    import numpy as np

    return memoryview(np.ascontiguousarray(blob.cpu().numpy())).cast("B")


def buffer_from(raw: bytes | memoryview, *, name: str = "mx-artifacts") -> "HostBuffer":
    """A new host buffer holding ``raw`` (a pulled blob, to serve it again as it came)."""
    from modelexpress.local import HostBuffer

    size = len(raw)
    buf = HostBuffer(max(size, 1), name=name)
    view = memoryview(buf.tensor(0, (max(size, 1),), _uint8()).numpy()).cast("B")
    view[:size] = raw
    view.release()
    return buf


def serve_packed(identity: "ModelIdentity", aset: ArtifactSet, buf: "HostBuffer", *,
                 key: ArtifactKey, client: "MxClient", local: "LocalOptions | None" = None,
                 manager: Any = None, backend: str = "UCX", heartbeat_interval_s: float = 5.0,
                 guardian: bool = False) -> "SourceHandle":
    """Publish a packed set as a READY source of ``identity`` (signed with ``key``).

    The handle owns ``buf``: closing it withdraws the source and frees the buffer. The
    set is published as a content variant: a replica that compiled for itself serves
    other bytes beside it, and the control plane keeps both.
    """
    from modelexpress.p2p import serve_source

    blob = buf.tensor(0, (max(aset.total_bytes, 1),), _uint8())
    attributes = {ATTR_SET: aset.to_json(),
                  ATTR_SIGNATURE: key.sign(signed_payload(identity.id, aset)),
                  ATTR_VARIANTS: "by-content"}
    try:
        handle = serve_source(identity, {BLOB: blob}, client=client, manager=manager,
                              backend=backend, heartbeat_interval_s=heartbeat_interval_s,
                              attributes=attributes, guardian=guardian, local=local,
                              host_buffers=(buf,))
    except BaseException:
        del blob
        buf.close()
        raise
    log.info("artifacts: serving %d files (%.1f MB, kinds %s) as source %s (identity %s)",
             len(aset.files), aset.total_bytes / 1e6, ",".join(aset.kinds), handle.source_id,
             identity.id)
    return handle


def _uint8() -> Any:
    import torch

    return torch.uint8


def signed_payload(identity_id: str, aset: ArtifactSet) -> bytes:
    """What a signature covers: the artifact identity and the whole set. The identity is
    in it so that a set signed for one configuration cannot be republished (by anyone
    who can write to the control plane) under another's identity."""
    return identity_id.encode() + b"\n" + aset.canonical_bytes()


def _checked_set(info: Any, key: ArtifactKey, identity_id: str) -> ArtifactSet:
    attributes = (info.manifest or {}).get("attributes") or {}
    if ATTR_SET not in attributes:
        raise ArtifactRefusedError("the source publishes no artifact set")
    aset = ArtifactSet.from_json(attributes[ATTR_SET])
    key.verify(signed_payload(identity_id, aset), attributes.get(ATTR_SIGNATURE))
    return aset


PrefixMapping = Mapping[str, str] | Callable[[ArtifactSet], Mapping[str, str]]
"""Symbolic prefix name -> a target's directory, or a function of the verified set giving it."""


def pull_artifacts(identity: "ModelIdentity", *, key: ArtifactKey | None,
                   client: "MxClient", options: "PullOptions",
                   roots: Mapping[str, pathlib.Path],
                   mapping: PrefixMapping | None = None,
                   manager: Any = None, check_facts: Mapping[str, str] | None = None
                   ) -> ArtifactPull:
    """Pull, verify and install the artifact set of ``identity``; never raises on a refusal.

    Args:
        identity: the artifact identity (everything that must match is in it).
        key: the operator's key; None: ``off`` (nothing is pulled).
        client, options, manager: as for :func:`~modelexpress.p2p.pull`.
        roots: kind -> this engine's cache root for it.
        mapping: symbolic prefix name -> this engine's directory (see ``manifest.py``), or
            a function of the (verified) set that returns it.
        check_facts: facts the set must state with these exact values (defence in
            depth: they are in the identity already).

    Returns:
        An :class:`ArtifactPull`.
    """
    got = fetch_artifacts(identity, key=key, client=client, options=options,
                          manager=manager, check_facts=check_facts)
    return got.install(roots, mapping) if isinstance(got, PulledSet) else got


@dataclasses.dataclass
class PulledSet:
    """A set whose signature and facts were checked and whose blob is here, not yet
    checked file by file nor installed (:func:`fetch_artifacts`)."""

    aset: ArtifactSet
    blob: Any
    pull: ArtifactPull  # how the pull went (outcome ``installed`` until install says else)

    def install(self, roots: Mapping[str, pathlib.Path],
                mapping: PrefixMapping | None = None) -> ArtifactPull:
        """Check every file against the signed sha256 and write them (``install.py``);
        never raises on a refusal. ``roots``, ``mapping``: as for :func:`pull_artifacts`.
        No NIXL, no control plane: file I/O and hashing only, so it may run on a thread
        of its own beside other work."""
        out, aset, blob = dataclasses.replace(self.pull), self.aset, self.blob
        try:
            if blob is None:
                raise ArtifactRefusedError(f"the source's manifest has no {BLOB!r} tensor")
            raw = blob_bytes(blob)
            mine = mapping(aset) if callable(mapping) else mapping
            installed = install_set(aset, raw, roots, mine)
        except ArtifactRefusedError as exc:
            out.outcome, out.reason = "refused", str(exc)
            log.warning("artifacts: refused the set of source %s: %s", out.source_id, exc)
            return out
        except MxError as exc:
            out.outcome, out.reason = "error", str(exc)
            return out
        out.install = installed
        out.install_seconds = installed.seconds
        out.files, out.bytes = installed.files, installed.bytes
        if installed.outcome == "present":
            out.outcome, out.reason = "present", installed.reason
        else:
            out.aset, out.blob = aset, blob
        return out


def fetch_artifacts(identity: "ModelIdentity", *, key: ArtifactKey | None,
                    client: "MxClient", options: "PullOptions", manager: Any = None,
                    check_facts: Mapping[str, str] | None = None
                    ) -> "ArtifactPull | PulledSet":
    """Steps 1-4 of :func:`pull_artifacts`: choose a source whose signed set checks out
    and pull its blob. Returns the :class:`PulledSet` to install, or the
    :class:`ArtifactPull` that ends it here (``off``, ``miss``, ``refused``, ``error``).
    Arguments as for :func:`pull_artifacts`."""
    if key is None:
        return ArtifactPull("off", "no MX_ARTIFACT_KEY: compiled artifacts are not pulled")
    try:
        ready = client.list_sources(identity=identity, state="READY")
    except MxError as exc:
        return ArtifactPull("error", f"listing artifact sources failed: {exc}")
    if not ready:
        return ArtifactPull("miss", f"no READY source serves artifact identity {identity.id}")
    groups = _by_content(ready)
    refusals: list[str] = []
    chosen = None
    checked = 0
    for group in groups:
        for summary in group:
            if checked >= _MAX_CANDIDATES:
                break
            checked += 1
            try:
                info = client.get_source(summary.id)
                aset = _checked_set(info, key, identity.id)
                for name, want in (check_facts or {}).items():
                    if aset.facts.get(name) != want:
                        raise ArtifactRefusedError(
                            f"the set's {name} is {aset.facts.get(name)!r}, this engine has "
                            f"{want!r}")
            except ArtifactRefusedError as exc:
                refusals.append(f"source {summary.id}: {exc}")
                log.warning("artifacts: refusing source %s: %s", summary.id, exc)
                continue
            except MxError as exc:
                refusals.append(f"source {summary.id}: {exc}")
                continue
            chosen = (info, aset, group)
            break
        if chosen is not None:
            break
    if chosen is None:
        return ArtifactPull("refused", "; ".join(refusals), variants=len(groups))
    info, aset, group = chosen
    from modelexpress.p2p import pull

    # Only the sources that serve this very set: a candidate of another content would
    # pass the data plane's digests (its own) and fail the set's sha256 after the pull.
    same = {s.worker_id for s in group}
    others = tuple(sorted({s.worker_id for s in ready} - same))
    got: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        result = pull(identity, None, client=client, manager=manager, fetched=[info],
                      options=options.replace(prefer=(info.id,), stripe=1,
                                              exclude_workers=(*options.exclude_workers,
                                                               *others)),
                      on_destination=got.update)
    except MxError as exc:
        return ArtifactPull("error", f"pulling the artifact blob failed: {exc}",
                            source_id=info.id, kinds=tuple(aset.kinds), variants=len(groups))
    pull_seconds = time.perf_counter() - t0
    blob = got.get(BLOB)
    out = ArtifactPull("installed", source_id=info.id, kinds=tuple(aset.kinds),
                       pull_seconds=pull_seconds, transport=result.transport,
                       variants=len(groups))
    return PulledSet(aset, blob, out)


def _by_content(ready: Sequence[Any]) -> list[list[Any]]:
    """READY sources grouped by the content they serve (the control plane's fingerprint;
    a record without one is a group of its own), the group most sources serve first,
    then in the control plane's order."""
    groups: dict[str, list[Any]] = {}
    for i, summary in enumerate(ready):
        groups.setdefault(getattr(summary, "fingerprint", "") or f"#{i}", []).append(summary)
    ordered = list(groups.values())  # dicts keep first-seen order: the server's
    return sorted(ordered, key=lambda group: -len(group))  # stable: ties keep that order
