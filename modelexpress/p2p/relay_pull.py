"""A pull on a fleet-relay path: its reader and, when the pull relays, its holder side.

A tracked pull that asks for it (``PullOptions.relay_read``) is planned by the server
at creation as an agent's claim is (``POST /v1/transfers`` with ``relay_read``): its
record's ``relay_path`` lists the holders to read from, its upstream first and a READY
source last. :func:`relay_factory` turns that into the reader of the path's origin, a
:class:`RelayedPull` around :class:`~modelexpress.p2p.relay.RelayReader`.

Two kinds of relayed pull::

    reader only (relay_read; modelexpress pull)   reads through relays, serves nobody
    holder (relay_serve too; the vLLM loader)      also a holder from its first byte:

      read_into:  RelayServer(dest) published INITIALIZING ─> RelayReader reads pieces,
                  each verified prefix advanced to the relay's watermark word and
                  reported as the record's bytes_done
      pull():     record SUCCEEDED ─> release(): serve the transfers still reading from
                  us (their relay_path starts at t:<our transfer>) for at most
                  relay_linger_s ─> withdraw (the word says so, the source is deleted)
      failure:    withdraw at once (close)

A pull whose origin is on its own host (its local endpoint, ``MX_IPC_DIR``) reads it
through the local transport even when the planner put a relay first on its path, and
relays to nobody: a relay spares the origin's uplink, and a same-host copy uses none
(nor does it pay for a relay source of its own on the critical path: an engine's
load). A reader the planner put behind it leaves it at once (it is receiving without a
relay source: :class:`~modelexpress.p2p.relay.RelayReader`).

Why a holder withdraws before :func:`~modelexpress.p2p.pull` returns, where an agent's
relay may become its READY fan-out source: a pull's caller owns the destination
afterwards and may change it (an engine post-processes its weights in place), and a
relay must serve only the origin's bytes. Nothing but the READs writes the memory
while the relay serves it, and a reader still short of the end when the linger runs
out reads the rest from the next holder on its path (the origin last), keeping every
tensor it verified.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Mapping

from modelexpress.errors import MxError
from modelexpress.p2p.relay import RelayReader, RelayServer, relay_worker_id
from modelexpress.p2p.relay_plan import source_ref

if TYPE_CHECKING:
    import torch

    from modelexpress.client import MxClient, SourceInfo, TransferInfo
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p.options import PullOptions
    from modelexpress.p2p.readers import ReaderFactory
    from modelexpress.transfer import Manifest, NixlTransferManager, StopSignal, TransferResult

__all__ = ["RelayedPull", "relay_factory", "wait_unread"]

log = logging.getLogger(__name__)

_LIVE = ("PENDING", "RUNNING", "STOPPING")
# An engine waits on this before it post-processes: first polls quick, then fewer (each
# lists the model's transfers on the server).
_UNREAD_POLL_S = 0.05
_UNREAD_POLL_MAX_S = 0.5
_STILL_WAITING_EVERY_S = 10.0


def wait_unread(client: "MxClient", transfer_id: str, identity_id: str, *,
                timeout_s: float, closed: Callable[[], bool] = lambda: False) -> bool:
    """Wait until no live transfer reads from ``transfer_id``'s relay (none has
    ``t:<transfer_id>`` first on its ``relay_path``), at most ``timeout_s``.

    Returns:
        True when none is left; False on the deadline or when ``closed()``.

    Raises:
        MxError: the control plane could not list the transfers.
    """
    ref = f"t:{transfer_id}"
    start = time.monotonic()
    end, said, nap = start + timeout_s, start, _UNREAD_POLL_S
    while True:
        readers = [t.id for t in client.list_transfers(identity=identity_id)
                   if t.relay_path[:1] == (ref,) and t.state in _LIVE]
        if not readers:
            return True
        now = time.monotonic()
        if closed() or now >= end:
            log.info("relay of transfer %s: %d transfers still read from it after %.1f s "
                     "(%s); withdrawing (they read the rest from the next holder)",
                     transfer_id, len(readers), now - start, ", ".join(readers[:4]))
            return False
        if now - said >= _STILL_WAITING_EVERY_S:
            said = now
            log.info("relay of transfer %s: still serving %d transfers after %.0f s (at most "
                     "%.0f s)", transfer_id, len(readers), now - start, timeout_s)
        time.sleep(min(nap, max(end - now, 0.0)))
        nap = min(nap * 2, _UNREAD_POLL_MAX_S)


class RelayedPull:
    """The reader of a pull on a relay path (a :class:`~modelexpress.p2p.readers.HeldReader`
    of the path's origin), and with ``serve_as`` its relay source (module docstring).

    Args:
        client: control-plane client.
        info, manifest: the origin (last on ``path``).
        path: the record's ``relay_path``.
        identity: what is pulled.
        opts: the pull's options.
        manager: the pull's NIXL manager for ``dest`` (called when the read starts: the
            manager may still be starting).
        serve_as: ``(target_worker, transfer_id)`` of the pull's record when it is a
            holder; None: it reads only.
        advertise: ``advertise(done, total)``: the record's progress report (a holder's
            readers fall back to it).
        local: the local transport's reader factory for holders on this host.
    """

    uses_pull_agent = True  # ``manager`` is the pull's (a HeldReader)

    def __init__(self, client: "MxClient", info: "SourceInfo", manifest: "Manifest",
                 path: tuple[str, ...], identity: "ModelIdentity", opts: "PullOptions",
                 manager: Callable[[Mapping[str, "torch.Tensor"]], "NixlTransferManager"],
                 *, serve_as: tuple[str, str] | None = None,
                 advertise: Callable[[int, int], None] | None = None,
                 local: "ReaderFactory | None" = None) -> None:
        self.client, self.info, self.manifest, self.path = client, info, manifest, path
        self.identity, self.opts, self.manager = identity, opts, manager
        self.serve_as, self.advertise, self.local = serve_as, advertise, local
        self.server: "RelayServer | None" = None

    def read_into(self, dest: Mapping[str, "torch.Tensor"], *, allow_partial: bool,
                  progress: Callable[[int, int], None], stop: "StopSignal | None",
                  deadline_s: float) -> "TransferResult":
        if self.serve_as is not None and self.server is None:
            worker, transfer_id = self.serve_as
            try:
                # ORDER: published before the first byte lands, so a pull the server
                # already planned behind us finds it; it advertises nothing until then.
                self.server = RelayServer(self.client, self.identity, dest, self.manifest,
                                          worker_id=relay_worker_id(worker, transfer_id),
                                          heartbeat_interval_s=self.opts.heartbeat_interval_s,
                                          backend=self.opts.backend)
            except MxError as exc:
                log.warning("transfer %s: not relaying (reading only): %s", transfer_id, exc)
        server = self.server
        reader = RelayReader(self.client, self.manager(dest), self.info, self.manifest,
                             self.path, identity_id=self.identity.id,
                             chunk_bytes=self.opts.relay_chunk_bytes,
                             link_mbit=self.opts.relay_link_mbit,
                             stall_s=self.opts.stall_s, verify=self.opts.verify,
                             refuse_slow_transport=self.opts.refuse_slow_transport,
                             advertise=self.advertise if server is not None else None,
                             publish=server.advance if server is not None else None,
                             local=self.local, local_group_bytes=self.opts.chunk_bytes)
        try:
            result = reader.read_into(dest, allow_partial=allow_partial, progress=progress,
                                      stop=stop, deadline_s=deadline_s)
        except BaseException:
            self.close()  # a failed or stopped pull serves nothing
            raise
        log.info("pull of %s read through %s%s", self.identity.model,
                 ", ".join(reader.read_from), "; relaying" if server is not None else "")
        return result

    def release(self) -> None:
        """After the pull's record is SUCCEEDED: serve the transfers still reading from
        this one for at most ``relay_linger_s``, then withdraw. Returns at once for a
        pull that reads only."""
        server = self.server
        if server is None or self.serve_as is None:
            return
        t0 = time.perf_counter()
        try:
            wait_unread(self.client, self.serve_as[1], self.identity.id,
                        timeout_s=self.opts.relay_linger_s)
        except MxError as exc:
            log.warning("transfer %s: could not list the readers of its relay (%s); "
                        "withdrawing it", self.serve_as[1], exc)
        finally:
            self.close()
        log.info("relay of transfer %s withdrawn %.3f s after its pull ended",
                 self.serve_as[1], time.perf_counter() - t0)

    def close(self) -> None:
        """Withdraw the relay source now (idempotent)."""
        server, self.server = self.server, None
        if server is not None:
            server.close()


def relay_factory(client: "MxClient", record: "TransferInfo | None",
                  identity: "ModelIdentity", opts: "PullOptions",
                  manager: Callable[[Mapping[str, "torch.Tensor"]], "NixlTransferManager"],
                  *, advertise: Callable[[int, int], None] | None = None,
                  local: "ReaderFactory | None" = None) -> "ReaderFactory | None":
    """The reader factory of a pull the server planned on a relay path: a
    :class:`RelayedPull` for the path's origin. A holder (``opts.relay_serve``) always
    reads through it, even straight from the origin, since its readers follow its
    watermark; a reader-only pull only when a relaying transfer is first on its path.
    None when the record has no relay path (no relay asked, or an older server)."""
    path = tuple(record.relay_path) if record is not None else ()
    if not path:
        return None
    holder = opts.relay_serve
    if not holder and not path[0].startswith("t:"):
        return None
    assert record is not None
    serve_as = (record.target_worker, record.id) if holder else None

    def factory(info: "SourceInfo", manifest: "Manifest") -> "RelayedPull | None":
        if source_ref(info.id) != path[-1]:
            return None
        if local is not None and local(info, manifest) is not None:
            # The origin is on this host: read it as any same-host source (module
            # docstring), and serve nobody: a reader planned behind this pull sees it
            # receiving without a relay source and leaves it at once.
            log.info("pull of %s: the origin is on this host; reading it through the "
                     "local transport%s", identity.model,
                     f", not through {path[0]}" if len(path) > 1 else " (not relaying)")
            return None
        return RelayedPull(client, info, manifest, path, identity, opts, manager,
                           serve_as=serve_as, advertise=advertise, local=local)

    return factory
