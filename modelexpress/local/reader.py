"""The local transport as a pull path's reader: :class:`LocalReader` and its factory.

``modelexpress.p2p.target.pull`` takes ``readers``, a factory that may return a reader
for a source (:class:`~modelexpress.p2p.readers.SourceReader`); for the others it
reads over NIXL. :func:`local_reader_factory` returns a :class:`LocalReader` for a
source that published a local endpoint (:data:`ATTRIBUTE` in its manifest's
attributes, :func:`publish_attributes`) from this host, so peers on one node copy
through mapped memory and every other source still goes over NIXL.

The endpoint carries the source's credential. It travels in the manifest, which only
the control plane hands out (with a bearer token when the server has one).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from modelexpress.errors import ConfigError
from modelexpress.local.client import TRANSPORT, pull
from modelexpress.local.protocol import LocalEndpoint

if TYPE_CHECKING:
    import torch

    from modelexpress.local.options import LocalOptions
    from modelexpress.local.server import LocalSource
    from modelexpress.transfer import Manifest, TransferResult

__all__ = ["ATTRIBUTE", "LocalReader", "endpoint_of", "local_reader_factory",
           "publish_attributes"]

log = logging.getLogger(__name__)

ATTRIBUTE = "local_transport"
"""Key of the local endpoint in a manifest's ``attributes``."""


def publish_attributes(source: "LocalSource") -> dict[str, Any]:
    """What a publisher adds to its manifest's attributes so that same-host peers use
    the local transport (``build_manifest(..., attributes=...)``)."""
    return {ATTRIBUTE: source.endpoint.to_json()}


def endpoint_of(manifest: "Manifest") -> LocalEndpoint | None:
    """The local endpoint a manifest publishes, or None (none, or malformed: logged)."""
    raw = manifest.attributes.get(ATTRIBUTE) if manifest.attributes else None
    if raw is None:
        return None
    try:
        return LocalEndpoint.from_json(raw)
    except (ConfigError, AttributeError) as exc:
        log.warning("source %s publishes a local endpoint this build cannot use: %s",
                    manifest.agent_name or "?", exc)
        return None


class LocalReader:
    """Reads one same-host source through the local transport.

    Args:
        endpoint: the source's endpoint.
        manifest: its manifest.
        chunk_bytes, verify: as :class:`~modelexpress.p2p.options.PullOptions`.
        connect_timeout_s: bound on connecting and the handshake.
        huge_pages: as :func:`modelexpress.local.pull` (``MX_LOCAL_HUGE_PAGES``).
    """

    def __init__(self, endpoint: LocalEndpoint, manifest: "Manifest", *, chunk_bytes: int,
                 verify: bool, connect_timeout_s: float = 10.0, huge_pages: str = "auto"
                 ) -> None:
        self.endpoint = endpoint
        self.huge_pages = huge_pages
        self.manifest = manifest
        self.chunk_bytes = chunk_bytes
        self.verify = verify
        self.connect_timeout_s = connect_timeout_s
        self.copied = 0
        self.listening = True

    @property
    def transport(self) -> str:
        """``"local"``: what this reader moves bytes over."""
        return TRANSPORT

    def nixl_may_retry(self) -> bool:
        """After a failed :meth:`read_into`: whether reading the same source over NIXL
        is worth it. Yes when nothing was copied and the source still listened (it
        refused, was busy, or its memory could not be mapped here); no when it is gone
        or died mid-copy (its NIXL side went with it: the next source is the better bet).
        """
        return self.copied == 0 and self.listening

    def read_into(self, dest: Mapping[str, "torch.Tensor"], *, allow_partial: bool,
                  progress: Callable[[int, int], None], stop: Any,
                  deadline_s: float) -> "TransferResult":
        """Copy ``dest``'s tensors from the source (see :func:`modelexpress.local.pull`).

        Raises:
            TransferError subclasses: as :func:`modelexpress.local.pull`.
        """
        from modelexpress.transfer import TransferResult
        from modelexpress.transfer.transport import TransportVerdict
        from modelexpress.errors import PeerError
        t0 = time.perf_counter()
        self.copied = 0

        def counted(done: int, total: int) -> None:
            self.copied = done
            progress(done, total)

        try:
            res = pull(self.endpoint, self.manifest, dest, verify=self.verify, stop=stop,
                       deadline_s=deadline_s, progress=counted, chunk_bytes=self.chunk_bytes,
                       connect_timeout_s=self.connect_timeout_s, allow_partial=allow_partial,
                       huge_pages=self.huge_pages)
        except PeerError as exc:
            # The socket is gone or refuses connections: the source process exited.
            self.listening = not isinstance(exc.__cause__,
                                            (FileNotFoundError, ConnectionRefusedError))
            raise
        copy_s = res.phases.get("copy", 0.0)
        verdict = TransportVerdict(
            ok=True, expected=TRANSPORT, observed=(TRANSPORT,), gbps=res.gbps, floor_gbps=0.0,
            message="same-host source: copied from mapped memory by modelexpress.local",
            transports=(TRANSPORT,))
        return TransferResult(
            bytes=res.nbytes, seconds=copy_s, gbps=res.gbps, descriptors=res.copies,
            chunks=0, tensors=res.tensors, transport=TRANSPORT, verdict=verdict, warnings=(),
            verified=self.verify and res.verified == res.tensors,
            verify_seconds=res.phases.get("verify", 0.0), peer=self.endpoint.source_id,
            connect_seconds=res.phases.get("connect+map", 0.0), expected_transport=TRANSPORT,
            transport_detail=(f"modelexpress.local over {self.endpoint.path}: segments "
                              f"{res.segments}, {res.copies} copies, "
                              f"{'huge' if res.huge_pages else 'small'} pages, "
                              f"{time.perf_counter() - t0:.3f} s in all"))


def local_reader_factory(options: "LocalOptions", *, chunk_bytes: int, verify: bool
                         ) -> Callable[[Any, "Manifest"], LocalReader | None]:
    """A ``readers`` factory for ``pull``: a :class:`LocalReader` for sources on this host.

    A source qualifies when its manifest publishes a local endpoint whose host id is
    this process's (boot id or ``MX_NODE_NAME``) and whose socket exists here (same
    node but another ``MX_IPC_DIR`` mount: NIXL instead). None for the others.
    """
    if not options.enabled:
        return lambda info, manifest: None
    here = options.host_id

    def factory(info: Any, manifest: "Manifest") -> LocalReader | None:
        ep = endpoint_of(manifest)
        if ep is None or ep.host_id != here:
            return None
        if not os.path.exists(ep.path):
            log.info("source %s is on this host but its socket %s is not visible here "
                     "(mount MX_IPC_DIR in both); reading over NIXL", ep.source_id, ep.path)
            return None
        return LocalReader(ep, manifest, chunk_bytes=chunk_bytes, verify=verify,
                           huge_pages=options.huge_pages)

    return factory
