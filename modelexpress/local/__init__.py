"""The local transport: peers on one host share memory through descriptors, not NIXL.

UCX does not use ``cuda_ipc`` for VMM memory nor for a same-GPU peer (it falls back
to TCP), so a source on the same host serves its memory itself: a Unix
socket in ``MX_IPC_DIR`` hands out memfds (host memory), POSIX-fd VMM handles and CUDA
IPC handles to peers that present the source's credential, and the target copies
with the copy engine (GPU) or memcpy (host) straight into its tensors.

* :class:`LocalSource` (``server.py``): register memory, start, publish ``endpoint``.
* :func:`pull` (``client.py``): a target's whole pull from one such source.
* :func:`host_id` (``hostid.py``): decides "same host" (boot id or ``MX_NODE_NAME``).
* :class:`HostBuffer` / :func:`host_buffer_like` (``memory.py``): shareable host memory.
* :class:`LocalOptions`: the settings a pull path needs, built once from MxSettings.
* :func:`local_reader_factory` / :func:`publish_attributes` (``reader.py``): the seam to
  ``modelexpress.p2p`` (a reader per source; the endpoint in the manifest's attributes).

Nothing here imports torch or cuda-python at import time.
"""

from modelexpress.local.client import TRANSPORT, LocalPullResult, LocalSession, fd_count, pull
from modelexpress.local.hostid import host_id, same_host
from modelexpress.local.memory import HostBuffer, HostMapping, host_buffer_like
from modelexpress.local.options import LocalOptions
from modelexpress.local.protocol import LocalEndpoint, Segment
from modelexpress.local.reader import (
    ATTRIBUTE,
    LocalReader,
    endpoint_of,
    local_reader_factory,
    publish_attributes,
)
from modelexpress.local.server import LocalSource

__all__ = [
    "ATTRIBUTE",
    "TRANSPORT",
    "HostBuffer",
    "HostMapping",
    "LocalEndpoint",
    "LocalOptions",
    "LocalPullResult",
    "LocalReader",
    "LocalSession",
    "LocalSource",
    "Segment",
    "endpoint_of",
    "fd_count",
    "host_buffer_like",
    "host_id",
    "local_reader_factory",
    "publish_attributes",
    "pull",
    "same_host",
]
