"""Fleet relay on the agent: serve a transfer's chunks while receiving, read from peers.

Two halves, both per REST transfer whose claim carried a ``relay_path`` (the
server's planner, :mod:`~modelexpress.p2p.relay_plan`):

* :class:`RelayServer` publishes the transfer's destination as a source **before the
  first byte lands**: registered with its own NIXL agent (progressed by its own
  thread), INITIALIZING (so no ordinary pull ranks it), with the origin's manifest
  digests (``known_digests``: its bytes are not there yet, and what a reader verifies
  against must be the origin's, not the relay's). Its worker id is
  :func:`relay_worker_id` of the agent and the transfer, so a reader finds it from
  the transfer record alone.
* :class:`RelayReader` is the :class:`~modelexpress.p2p.readers.SourceReader` of the
  pull: it reads the tensors, in manifest order, from the first live holder on the
  path, each only once that holder advertises it, and advertises its own progress.

What a holder advertises is a **watermark**: a byte offset into the manifest-order
concatenation of the tensors, below which it holds every byte. A reader cuts the
destination into pieces of at most ``MX_RELAY_CHUNK_BYTES`` (a large tensor is several
pieces: an embedding that is half of a model must not stall a chain for half a model)
and streams them (:class:`~modelexpress.transfer.piece_stream.PieceStream`): each piece
below its holder's watermark is posted as its own READ, at most two pieces' bytes in
flight, and the reader keeps asking for the watermark while they move. A loop that read
everything advertised and only then asked again kept each hop's lag from ever shrinking
(a chain's links run at one rate) and added a round trip per batch. What remains per hop
is about the window: the word's answer queues behind the pieces in flight on the
holder's uplink, so a hop lags two pieces' time (0.1 s for 512 KiB at 100 Mbit/s).

How the watermark travels: **peer to peer, one-sided**. A relay keeps it in a 16-byte
word of host memory registered with its own NIXL agent (``mark``, ``mark ^ key``), whose
address it publishes in its manifest's attributes (``relay_watermark``); a reader that
loaded the relay's agent metadata to read its pieces prepares one READ of that word
(:class:`~modelexpress.transfer.remote_word.RemoteWord`) and re-posts it while it waits,
polling tightly after the holder advanced and backing off (up to a few ms) while it is
starved. A word READ that catches the relay mid-write sees the two halves disagree and
keeps the mark it had; a relay that withdraws writes a withdrawn mark before its memory
goes. The control plane stays the fallback and the record: the watermark is also pushed
as the transfer's ``bytes_done`` (a background thread, coalesced; progress and REST see
it), a reader polls that record once a second for the holder's state, and follows it
alone for a holder that publishes no word. Rejected: NIXL notifications
(``send_notif``/``get_new_notifs``) pushed by the relay at each advance. They would
make the passive side active (the relay would have to load every reader's metadata, a
second exchange through the server, and send N notifications per piece), they arrive
through the receiving agent's progress loop, which the agent's pulls and fan-out
sources share (routing them to the right reader is one more protocol), and a lost or
late one must still be covered by polling. A READ of the word costs the relay no CPU,
works for any number of readers it does not know, and its failure is the same signal as
a failed piece READ: the holder is gone.

A tensor is checked against the origin's digest when its last piece lands, and the watermark passes a tensor's end only once it is
verified: the only unverified bytes a relay ever advertises are the landed pieces of
the tensor it is receiving, which its readers verify themselves when they have it all.
A relay's destination is one slab in manifest order and it reads in that order, so
its watermark grows piece by piece.

Faults. A holder is left for the next one on the path when its READ (of pieces or of
its word) fails or stalls (``MX_TRANSFER_STALL_S``), when its word says it withdrew, when its transfer ended FAILED or STOPPED, when its relay
source is STALE or gone (a killed relay's guardian marks it STALE at once), or when
its watermark has not advanced for twice the stall time (its own upstream may have
died: it gets one stall time to move on itself first, so one death does not cascade
down a chain). Tensors already verified are kept; only the rest is read again. The
path ends at a READY source, the origin, which holds everything. Every tensor is
checked against the origin's digest (a holder whose manifest disagrees with the
origin's is never read); an unverified tensor is never counted, and the agent drops
the destination of a transfer that did not succeed.

From zero (:mod:`~modelexpress.p2p.zero`). The path may instead end at an origin still
reading the model from storage: a source published INITIALIZING with a watermark word
(a :class:`RelayServer` its storage reader advances). It is followed as a relay is, by
its word, with its source record's state for the rest (READY: it holds everything;
STALE or gone: it died). It knows no digest before storage's bytes arrive, so such a
pull reads without digests (``verify`` off) and its caller checks every tensor
against the digests the origin recorded; ``have`` resumes a pull that holds a prefix.

Modified weights. A relay serves only while its agent holds the transfer's
destination, which nothing writes but the READs. When the pull succeeded the relay
digests every tensor again and only if all match the origin's does it become READY
(the agent's fan-out source, ``MX_SERVE_AFTER_PULL``); otherwise, and when the agent
does not serve after a pull, it withdraws when the transfer ends. Engines (the vLLM
loader) do not relay: their weights are post-processed after the load.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from modelexpress.errors import (ConfigError, IntegrityError, MxError, NotFoundError, PeerError,
                                 ServerUnavailableError, TransferCancelledError, TransferError,
                                 TransferTimeoutError, TransportError)
from modelexpress.p2p.manifests import manifest_of
from modelexpress.p2p.relay_plan import parse_ref, piece_bytes, tensor_chunks
from modelexpress.p2p.source import serve_source

if TYPE_CHECKING:
    import torch

    from modelexpress.client import MxClient, SourceInfo
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p.readers import ReaderFactory
    from modelexpress.p2p.source import SourceHandle
    from modelexpress.transfer import Manifest, NixlTransferManager, StopSignal, TransferResult
    from modelexpress.transfer.remote_word import RemoteWord

__all__ = ["RelayServer", "RelayReader", "relay_worker_id", "relay_source_id"]

log = logging.getLogger(__name__)

_POLL_S = 0.01           # re-read a starved upstream's watermark this often
_STATE_EVERY_S = 1.0     # ...and its relay source's state this often
_STILL_WAITING_EVERY_S = 10.0
_ORIGIN_RETRIES = 2      # READs of the origin (last on every path) that may fail and be retried
_WORD_POLL_MIN_S = 0.0002   # watermark word: first wait after a poll that found nothing new
_WORD_POLL_MAX_S = 0.005    # ...doubling to this while the upstream has nothing new
_WORD_DEADLINE_S = 5.0      # one watermark READ (or MX_TRANSFER_STALL_S when shorter)
_ADVERT_EVERY_S = 0.1       # the least time between two pushes of bytes_done
_WINDOW_PIECES = 2          # relayed pieces in flight: MX_RELAY_CHUNK_BYTES times this
_NAP_MIN_S = 0.0001         # the reader's sleep when nothing landed or moved...
_NAP_MAX_S = 0.001          # ...doubling to this, or to an eighth of a piece's time
_NAP_CAP_S = 0.02           # ...but never more

WATERMARK_ATTRIBUTE = "relay_watermark"  # manifest attribute: {"addr": int, "bytes": 16}
_WORD_BYTES = 16
_WITHDRAWN = (1 << 64) - 1  # the mark of a relay that withdrew
_CHECK_KEY = 0x6D782D72656C6179  # "mx-relay": the check word is mark ^ key


def _check(mark: int) -> int:
    return mark ^ _CHECK_KEY


def relay_worker_id(target_worker: str, transfer_id: str) -> str:
    """The worker id of the relay source of ``transfer_id`` run by ``target_worker``."""
    return f"{target_worker}-relay-{transfer_id[:12]}"


def relay_source_id(identity_id: str, worker_id: str) -> str:
    """The source id the server gives ``worker_id``'s source of ``identity_id``: the
    rule of ``modelexpress.server.service.source_id_for`` (a test keeps them equal;
    the server imports us, never the reverse)."""
    return f"{identity_id}:{worker_id}"


def _stopped(stop: "StopSignal | None") -> bool:
    if stop is None:
        return False
    return stop.is_set() if isinstance(stop, threading.Event) else bool(stop())


def _word_value(word: tuple[int, ...], total: int) -> int | None:
    """The mark a watermark word says; None when it was read mid-write (its halves
    disagree: the next READ sees it whole). Raises PeerError when it says the relay
    withdrew, or more than the model's bytes."""
    mark, check = word[0], word[1]
    if check != _check(mark):
        return None
    if mark == _WITHDRAWN:
        raise PeerError("it withdrew its relay source (its watermark word says so)")
    if mark > total:
        raise PeerError(f"its watermark word says {mark} of {total} bytes")
    return mark


def _go_on(stop: "StopSignal | None", end: float, verified: int, total: int) -> None:
    """Raise when the relayed READ was stopped or ran past its deadline (``end``)."""
    if _stopped(stop):
        raise TransferCancelledError(
            f"relayed READ stopped on request after {verified} of {total} bytes; tensors "
            "not reported done are incomplete")
    if time.monotonic() > end:
        raise TransferTimeoutError(
            f"relayed READ did not finish within its deadline (MX_TRANSFER_TIMEOUT_S): "
            f"{verified} of {total} bytes verified")


class RelayServer:
    """The relay source of one transfer: its destination, served from the first chunk.

    Args:
        client: control-plane client.
        identity: what is pulled.
        dest: the destination tensors (allocated, still empty).
        origin: the origin's manifest (digests and algorithm are published as is).
        worker_id: :func:`relay_worker_id` of this agent and transfer.
        heartbeat_interval_s, backend: as the agent's fan-out sources.
        manager: a NIXL manager made ahead for this relay (it is then the relay's own, and
            closed with it): creating an agent costs ~0.1-1 s of CPU, which a from-zero
            target pays before its fleet starts (:mod:`~modelexpress.p2p.zero`).
    """

    def __init__(self, client: "MxClient", identity: "ModelIdentity",
                 dest: Mapping[str, "torch.Tensor"], origin: "Manifest", *, worker_id: str,
                 heartbeat_interval_s: float, backend: str,
                 manager: "NixlTransferManager | None" = None) -> None:
        import numpy as np
        import torch

        from modelexpress.transfer import NixlTransferManager

        self.dest = dest
        self.origin = origin
        self.identity = identity
        self.total = sum(e.nbytes for e in origin.tensors if e.name in dest)
        self._lock = threading.Lock()
        digests = {e.name: e.digest for e in origin.tensors
                   if e.digest is not None and e.name in dest}
        t0 = time.perf_counter()
        # The watermark word (module docstring): registered with the relay's own agent
        # before its metadata is published, so a reader that loaded the metadata can
        # READ it; its address travels in the manifest's attributes.
        self._word = np.zeros(_WORD_BYTES // 8, dtype=np.uint64)
        self._word[:] = (0, _check(0))
        manager = manager or NixlTransferManager(backend=backend)
        try:
            manager.register_tensors({"mx-relay-watermark": torch.from_numpy(self._word)})
        except BaseException:
            manager.close()
            raise
        self._attributes = {WATERMARK_ATTRIBUTE: {"addr": int(self._word.ctypes.data),
                                                  "bytes": _WORD_BYTES}}
        known = origin.digest_algorithm is not None and len(digests) == len(dest)
        self.handle: "SourceHandle | None" = serve_source(
            identity, dest, client=client, manager=manager, own_manager=True,
            worker_id=worker_id,
            heartbeat_interval_s=heartbeat_interval_s, guardian=True, backend=backend,
            # (an origin still reading storage knows no digest yet: modelexpress.p2p.zero)
            digests=known, digest_algorithm=origin.digest_algorithm if known else None,
            known_digests=digests if known else None, attributes=self._attributes,
            state="INITIALIZING")
        log.info("relay source %s serving the chunks of %s as they arrive (published in "
                 "%.3f s)", self.handle.source_id, identity.model, time.perf_counter() - t0)

    def advance(self, mark: int) -> None:
        """Advertise that every byte below ``mark`` (manifest order) landed and is
        verified, to readers polling the watermark word. Called by the read loop only
        after that is true (:class:`RelayReader`'s ``publish``)."""
        # One 16-byte copy: the mark and its check; a reader that catches the copy half
        # done sees them disagree and keeps the mark it had.
        self._word[:] = (mark, _check(mark))

    def _withdraw_word(self) -> None:
        # ORDER: before the memory is deregistered: a reader polling now learns the relay
        # withdrew from the word itself, before its READs start failing.
        self._word[:] = (_WITHDRAWN, _check(_WITHDRAWN))

    @property
    def source_id(self) -> str:
        assert self.handle is not None
        return self.handle.source_id

    def promote(self) -> "SourceHandle | None":
        """After a successful pull: digest every tensor again and, if all match the
        origin, move the relay source to READY and hand its handle over (the caller
        closes it). Otherwise withdraw it and return None."""
        from modelexpress.transfer import digest as _digest

        with self._lock:
            handle, self.handle = self.handle, None
        if handle is None:
            return None
        algo = self.origin.digest_algorithm
        names = [e.name for e in self.origin.tensors if e.name in self.dest]
        want = {e.name: e.digest for e in self.origin.tensors}
        if algo is not None:
            got = _digest.digest_many([self.dest[n] for n in names], algo)
            bad = [n for n, g in zip(names, got) if g != want[n]]
            if bad:
                log.error("relay source %s: %d tensors no longer match the origin's digests "
                          "(e.g. %s); withdrawn", handle.source_id, len(bad), bad[:3])
                self._withdraw_word()
                handle.close()
                return None
        try:
            handle.client.heartbeat(handle.source_id, "READY")
        except MxError as exc:
            log.warning("relay source %s could not become READY: %s; withdrawn",
                        handle.source_id, exc)
            self._withdraw_word()
            handle.close()
            return None
        return handle

    def complete(self, algorithm: str, digests: Mapping[str, str]) -> None:
        """Every byte landed and ``digests`` are those of storage's bytes (a from-zero
        origin, :mod:`~modelexpress.p2p.zero`): publish the source again, READY, with them
        in its manifest, so that later pulls read and verify it as any source. Same
        worker, memory and agent: readers still on it are not disturbed.

        Raises:
            ConflictError: a READY source of the identity serves other bytes.
            MxError: the relay source was withdrawn, or publishing failed.
        """
        import json
        import socket

        handle = self.handle
        if handle is None:
            raise MxError("the relay source was withdrawn; nothing to complete")
        self.advance(self.total)
        manifest = handle.manager.build_manifest(
            self.dest, digests=True, digest_algorithm=algorithm,
            known_digests={name: digests[name] for name in self.dest},
            attributes=self._attributes)
        handle.client.publish_source(
            self.identity, handle.worker_id, manifest=json.loads(manifest.to_json()),
            agent_metadata=handle.manager.get_agent_metadata(),
            endpoint=f"{socket.gethostname()}:{handle.manager.name}", state="READY")
        log.info("source %s complete and READY (%d tensors, %s digests)", handle.source_id,
                 len(self.dest), algorithm)

    def close(self) -> None:
        """Stop serving and delete the relay source's record (a relay that ended is no
        source: readers still on it see it gone and move on). Idempotent."""
        with self._lock:  # the agent's close and a lingering relay's thread may race
            handle, self.handle = self.handle, None
        if handle is not None:
            self._withdraw_word()
            handle.close()  # STALE first: a reader polling now leaves it
            try:
                handle.client.delete_source(handle.source_id)
            except MxError as exc:  # STALE is enough; the server collects it later
                log.warning("could not delete relay source %s: %s", handle.source_id, exc)


class _Advertiser:
    """Pushes the latest watermark to the control plane from its own thread (coalesced:
    the read loop only sets a number)."""

    def __init__(self, report: Callable[[int, int], None], total: int) -> None:
        self._report = report
        self._total = total
        self._value = 0
        self._sent = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mx-relay-advert", daemon=True)
        self._thread.start()

    def set(self, value: int) -> None:
        with self._cond:
            if value > self._value:
                self._value = value
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._value == self._sent and not self._closed:
                    self._cond.wait(1.0)
                if self._value == self._sent:
                    return
                value = self._value
            self._report(value, self._total)
            self._sent = value
            if not self._closed:
                # Readers follow the watermark word; this record is their fallback and
                # the REST view: a few pushes a second spare the server (and the CPU a
                # fleet on one host shares) one request per piece per target.
                until = time.monotonic() + _ADVERT_EVERY_S
                with self._cond:
                    while not self._closed and time.monotonic() < until:
                        self._cond.wait(max(until - time.monotonic(), 0.0))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(10.0)


class _Pieces:
    """The destination cut into pieces of at most ``chunk_bytes`` (a tensor larger than
    that is several pieces, smaller ones one each), in manifest order, and which landed.

    A holder's watermark is a byte offset into the manifest-order concatenation of the
    tensors, so pieces below it can be read whatever the holder's own piece size. A
    tensor is verified (against the origin's digest) when its last piece lands; only
    then does the advertised prefix pass that tensor's end, so a relay advertises
    unverified bytes only of the one tensor it is receiving (a reader checks that
    tensor's digest itself when it has all of it).
    """

    def __init__(self, origin: "Manifest", dest: Mapping[str, "torch.Tensor"],
                 chunk_bytes: int, verify: bool, have: int = 0) -> None:
        import torch

        self.algo = origin.digest_algorithm if verify else None
        self.want = {e.name: e.digest for e in origin.tensors}
        self.order = [e for e in origin.tensors if e.name in dest]
        self.tensors = len(self.order)
        self.dest = dest
        self.keys: list[str] = []          # piece keys in order
        self.ends: list[int] = []          # global end offset of each piece
        self.spans: dict[str, tuple[str, int, int]] = {}   # key -> (tensor, offset, bytes)
        self.views: dict[str, "torch.Tensor"] = {}
        self.of_tensor: dict[str, list[str]] = {}
        acc = 0
        for e in self.order:
            flat = dest[e.name].reshape(-1).view(torch.uint8)
            keys = self.of_tensor.setdefault(e.name, [])
            for off in range(0, e.nbytes, chunk_bytes):
                n = min(chunk_bytes, e.nbytes - off)
                key = f"{e.name}@{off}"
                acc += n
                self.keys.append(key)
                self.ends.append(acc)
                self.spans[key] = (e.name, off, n)
                self.views[key] = flat[off:off + n]
                keys.append(key)
        self.total = acc
        self.got: set[str] = set()
        self.good: set[str] = {e.name for e in self.order if e.nbytes == 0}
        self.checked = self.algo is not None
        self._next = 0  # first piece not yet in the advertised prefix
        self._lock = threading.Lock()
        if have > 0:
            # A prefix the destination holds already (a from-zero target's earlier round,
            # whose caller verifies it: modelexpress.p2p.zero): its pieces count as landed
            # and its whole tensors as done; a piece across its end is read again.
            self.got.update(k for k, end in zip(self.keys, self.ends) if end <= have)
            self.good.update(e.name for e in self.order
                             if all(k in self.got for k in self.of_tensor[e.name]))
            self._advance()

    @property
    def prefix(self) -> int:
        """Bytes of the advertised prefix (every piece below it landed)."""
        return self.ends[self._next - 1] if self._next else 0

    @property
    def complete(self) -> bool:
        return len(self.good) == self.tensors

    def below(self, mark: int) -> dict[str, "torch.Tensor"]:
        """Pieces not landed that lie wholly below ``mark`` (name -> destination view)."""
        with self._lock:
            return {k: self.views[k] for k, e in zip(self.keys, self.ends)
                    if e <= mark and k not in self.got}

    def whole_tensors(self, todo: Mapping[str, object]) -> list[str]:
        """Tensors every piece of which is in ``todo``, in order."""
        return [e.name for e in self.order
                if self.of_tensor[e.name] and all(k in todo for k in self.of_tensor[e.name])]

    def manifest_of(self, holder: "Manifest") -> "Manifest":
        """``holder``'s manifest with one uint8 entry per piece (no digests: the pieces are
        checked here, per tensor, against the origin)."""
        import dataclasses

        from modelexpress.transfer.manifest import TensorEntry

        by_name = {e.name: e for e in holder.tensors}
        entries = tuple(TensorEntry(k, "uint8", (n,), n, by_name[t].addr + off,
                                    by_name[t].device)
                        for k, (t, off, n) in self.spans.items())
        return dataclasses.replace(holder, tensors=entries, digest_algorithm=None)

    def landed(self, key: str) -> int | None:
        """A piece landed: verify its tensor if complete; returns the new advertised
        prefix, or None when it did not move.

        Raises:
            IntegrityError: the tensor this piece completed does not match the origin's
                digest (its pieces are forgotten, to be read again elsewhere).
        """
        name = self.spans[key][0]
        with self._lock:
            self.got.add(key)
            complete = all(k in self.got for k in self.of_tensor[name])
        if complete and self.algo is not None:
            from modelexpress.transfer import digest as _digest

            (got,) = _digest.digest_many([self.dest[name]], self.algo)
            if got != self.want[name]:
                with self._lock:
                    self.got.difference_update(self.of_tensor[name])
                raise IntegrityError(
                    f"tensor {name!r} ({self.dest[name].numel() * self.dest[name].element_size()}"
                    f" bytes) failed its {self.algo} digest check against the origin's (origin "
                    f"{self.want[name]}, received {got}); reading it again from another holder")
        if complete:
            return self.verified(name)
        return self._advance()

    def verified(self, name: str) -> int | None:
        """Tensor ``name`` is whole and verified; returns the new prefix (or None)."""
        with self._lock:
            self.got.update(self.of_tensor[name])
            self.good.add(name)
        return self._advance()

    def forget_unverified(self) -> None:
        """Drop landed pieces of tensors not verified: a failed READ may have landed some
        of a tensor's pieces and not others; they are read again whole."""
        with self._lock:
            for e in self.order:
                if e.name not in self.good:
                    self.got.difference_update(self.of_tensor[e.name])
            # the advertised prefix stays: it only ever covered landed pieces of the
            # tensor in progress, which a reader verifies itself

    def _advance(self) -> int | None:
        with self._lock:
            i = self._next
            while i < len(self.keys):
                key = self.keys[i]
                name = self.spans[key][0]
                last = key == self.of_tensor[name][-1]
                if key not in self.got or (last and name not in self.good):
                    break
                i += 1
            if i == self._next:
                return None
            self._next = i
            return self.ends[i - 1]


class _Holder:
    """One holder on the path, as the reader sees it."""

    def __init__(self, ref: str) -> None:
        self.ref = ref
        self.kind, self.ident = parse_ref(ref)
        self.info: "SourceInfo | None" = None
        self.manifest: "Manifest | None" = None
        self.peer: str | None = None
        self.mark = 0
        self.advanced = time.monotonic()
        self.state_checked = 0.0
        self.polled = 0.0  # when its transfer record was last read
        self.pieces: "Manifest | None" = None  # its manifest cut into _Pieces
        self.word: "RemoteWord | None" = None  # its watermark word, once connected
        self.wait_s = _WORD_POLL_MIN_S  # next sleep while it has nothing new
        self.word_at = 0.0  # monotonic time of its next word READ (the stream's polls)
        self.opened = False  # a READ of its pieces completed on the current connection
        # a source still loading (a from-zero origin, INITIALIZING with a watermark word):
        # followed like a relay until it is READY
        self.loading = False


class RelayReader:
    """Reads a destination chunk by chunk from the holders on a relay path.

    Args:
        client: control-plane client.
        manager: the NIXL manager of the pull (the destination is registered with it).
        origin_info, origin: the source at the end of the path and its manifest: READY,
            or a from-zero origin still loading (INITIALIZING; followed by its watermark
            word and its record's state until it is READY).
        path: holder refs, the upstream first (``TransferInfo.relay_path``).
        identity_id: the model's identity id (relay sources are named from it).
        chunk_bytes: most bytes per posted READ request (``MX_RELAY_CHUNK_BYTES``); the
            pieces are :func:`~.relay_plan.piece_bytes` of the model, this and ``link_mbit``.
        link_mbit: this reader's link when known (``MX_RELAY_LINK_MBIT``; 0: unknown).
        stall_s: ``MX_TRANSFER_STALL_S`` (0: only the deadline).
        verify: check digests (always against the origin's).
        refuse_slow_transport: as :class:`~.options.PullOptions` (a holder whose READ
            fell back is left, like a failed one).
        advertise: ``advertise(watermark, total)``, called from a background thread
            whenever the verified prefix grows (the agent forces a progress report).
        publish: ``publish(watermark)``, called from the read loop itself whenever the
            verified prefix grows (:meth:`RelayServer.advance`: the watermark word).
        local: the local transport's reader factory: a complete holder on this host is
            copied through it instead of a NIXL READ, ``local_group_bytes`` of whole
            tensors per copy (``MX_TRANSFER_CHUNK_BYTES``), each advertised when verified.
        have: bytes of the prefix ``dest`` holds already (a from-zero target's earlier
            round, which its caller verifies): not read again.

    Attributes:
        mark: the prefix held so far (also after a failure: what a next round keeps).
    """

    def __init__(self, client: "MxClient", manager: "NixlTransferManager",
                 origin_info: "SourceInfo", origin: "Manifest", path: Sequence[str], *,
                 identity_id: str, chunk_bytes: int, stall_s: float, verify: bool,
                 link_mbit: float = 0.0, refuse_slow_transport: bool = False,
                 advertise: Callable[[int, int], None] | None = None,
                 publish: Callable[[int], None] | None = None,
                 local: "ReaderFactory | None" = None, local_group_bytes: int = 1 << 30,
                 have: int = 0) -> None:
        self.client = client
        self.manager = manager
        self.origin_info = origin_info
        self.origin = origin
        self.identity_id = identity_id
        self.chunk_bytes = piece_bytes(origin.total_bytes, chunk_bytes, link_mbit)
        self.stall_s = stall_s
        self.verify = verify
        self.refuse_slow_transport = refuse_slow_transport
        self.advertise = advertise
        self.publish = publish
        self.local = local
        self.local_group_bytes = local_group_bytes
        self.path = [_Holder(ref) for ref in path]
        last = self.path[-1] if self.path else None
        if last is None or last.kind != "source" or last.ident != origin_info.id:
            self.path.append(_Holder(f"s:{origin_info.id}"))
        self.path[-1].info, self.path[-1].manifest = origin_info, origin
        self.path[-1].loading = origin_info.state == "INITIALIZING"
        self.have = have
        self.mark = have
        self.gave_up: list[str] = []  # "ref: why", in order
        self.read_from: list[str] = []  # refs that delivered bytes

    # -- holders ------------------------------------------------------------------
    def _watermark(self, h: _Holder, total: int) -> int:
        """Bytes of the prefix ``h`` advertises; raises PeerError when it is gone.

        Its watermark word (one-sided READ) when it has one; its transfer record on the
        control plane once a second then (for its state: ended, STALE, gone), and at
        every call before (the fallback: a relay without a word, or not yet connected).
        """
        if h.kind == "source" and not h.loading:
            return total
        now = time.monotonic()
        self._follow_record(h, total, now)
        if h.word is not None and h.mark < total:
            mark = self._word_mark(h, total)
            if mark > h.mark:
                h.mark, h.advanced = mark, now
        return h.mark

    def _follow_record(self, h: _Holder, total: int, now: float) -> None:
        """Read ``h``'s transfer record at every call while it has no word, once a second
        after (its state: ended, STALE, gone); raises PeerError when it is gone."""
        if h.word is not None and now - h.polled <= _STATE_EVERY_S:
            return
        try:
            mark = (self._source_mark(h, total, now) if h.kind == "source"
                    else self._record_mark(h, total, now))
        except ServerUnavailableError as exc:
            if h.word is None:
                raise
            # The word is the watermark; the record is only its state: a control
            # plane that does not answer now is no reason to leave a live relay.
            log.warning("relay: %s's record unreadable (%s); following its word", h.ref, exc)
            return
        if mark > h.mark:
            h.mark, h.advanced = mark, now

    def _source_mark(self, h: _Holder, total: int, now: float) -> int:
        """A loading origin's watermark as its source record says: all of it once READY,
        PeerError once it is STALE or gone (it died or withdrew), else what it had."""
        h.polled = now
        try:
            info = self.client.get_source(h.ident)
        except NotFoundError:
            raise PeerError(f"its source {h.ident} is gone (the origin withdrew)") from None
        if info.state == "STALE":
            raise PeerError(f"its source {h.ident} is STALE (the origin died or withdrew)")
        if info.state == "READY":
            h.loading = False
            return total
        return h.mark

    def _record_mark(self, h: _Holder, total: int, now: float) -> int:
        """``h``'s watermark as its transfer record says (its ``bytes_done``)."""
        h.polled = now
        t = self.client.get_transfer(h.ident)
        if t.state in ("FAILED", "STOPPED"):
            raise PeerError(f"its transfer ended {t.state}")
        if h.info is None or now - h.state_checked > _STATE_EVERY_S:
            h.state_checked = now
            sid = relay_source_id(self.identity_id, relay_worker_id(t.target_worker, t.id))
            try:
                info = self.client.get_source(sid)
            except NotFoundError:
                if t.state == "SUCCEEDED" or h.info is not None:
                    raise PeerError(f"its relay source {sid} is gone") from None
                if t.bytes_done > 0:
                    # A relay is published before its first byte lands: one receiving
                    # without it failed to start serving (it reads only).
                    raise PeerError(f"it is receiving but published no relay source {sid}"
                                    ) from None
                return 0  # not published yet
            if info.state == "STALE":
                raise PeerError(f"its relay source {sid} is STALE (the agent died or withdrew)")
            if h.info is None:
                self._check_manifest(h, info)
                self._connect(h)  # now, not when its first piece is advertised: off the pipeline
                self._watch(h)
        return total if t.state == "SUCCEEDED" else min(int(t.bytes_done), total)

    def _watch(self, h: _Holder) -> None:
        """Prepare the READ of ``h``'s watermark word, when its relay publishes one."""
        assert h.manifest is not None and h.peer is not None
        spec = h.manifest.attributes.get(WATERMARK_ATTRIBUTE)
        if not isinstance(spec, dict) or spec.get("bytes") != _WORD_BYTES:
            log.info("relay: %s publishes no watermark word; following its transfer record",
                     h.ref)
            return
        try:
            h.word = self.manager.watch_word(h.peer, int(spec["addr"]), _WORD_BYTES)
        except MxError as exc:
            log.warning("relay: cannot read %s's watermark word (%s); following its transfer "
                        "record", h.ref, exc)

    def _word_mark(self, h: _Holder, total: int) -> int:
        """``h``'s watermark as its word says (PeerError: it withdrew, or the READ failed)."""
        assert h.word is not None
        limit = min(_WORD_DEADLINE_S, self.stall_s) if self.stall_s > 0 else _WORD_DEADLINE_S
        mark = _word_value(h.word.read(limit), total)
        return h.mark if mark is None else mark

    def _mark_now(self, h: _Holder, total: int, gap_s: float = 0.0) -> int:
        """``h``'s watermark without waiting on its word: the word's READ is posted and
        picked up by later calls (again after ``gap_s`` while the holder advances,
        backing off while it has nothing new); its record is read once a second, as in
        :meth:`_watermark`."""
        if h.kind == "source" and not h.loading:
            return total
        now = time.monotonic()
        self._follow_record(h, total, now)
        word = h.word
        if word is None or h.mark >= total:
            return h.mark
        if word.posted:
            got = word.poll()  # PeerError: the READ failed or hung
            if got is None:
                return h.mark
            mark = _word_value(got, total)
            if mark is not None and mark > h.mark:
                h.mark, h.advanced = mark, now
                h.wait_s = _WORD_POLL_MIN_S
                h.word_at = now + gap_s  # it moves: ask again soon
            else:
                h.word_at = now + max(h.wait_s, gap_s)
                h.wait_s = min(2 * h.wait_s, _WORD_POLL_MAX_S)
        if not word.posted and now >= h.word_at:
            word.post(min(_WORD_DEADLINE_S, self.stall_s) if self.stall_s > 0
                      else _WORD_DEADLINE_S)
        return h.mark

    def _stream(self, h: _Holder, pieces: _Pieces, stop: "StopSignal | None", end: float,
                piece_done: Callable[[str], None], results: list["TransferResult"],
                state: dict[str, int]) -> None:
        """Read every piece still missing from holder ``h``, each posted as soon as ``h``
        advertises it, at most a window of them in flight: the reader learns that its
        holder advanced while earlier pieces still move, so its link does not idle
        between batches. Returns when every tensor is verified; raises when ``h`` fails,
        stalls, withdraws or stops advancing (the caller moves on to the next holder).
        """
        from modelexpress.transfer import TransferResult

        total = pieces.total
        # A relay is published (and connected to, off the pipeline) before it holds
        # anything; until then only its record says where it is.
        while h.peer is None:
            if _stopped(stop):
                raise TransferCancelledError("relayed READ stopped on request")
            now = time.monotonic()
            if now > end:
                raise TransferTimeoutError(
                    f"relayed READ ran out of time waiting for {h.ref} to publish its relay "
                    f"source ({state['mark']} of {total} bytes verified)")
            if h.kind == "source":
                self._connect(h)
                if h.loading:
                    self._watch(h)  # its watermark word, as a relay's
                break
            self._watermark(h, total)  # connects once its relay source is published
            if h.peer is None:
                if self.stall_s > 0 and now - h.advanced > 2 * self.stall_s:
                    raise PeerError(f"it published no relay source for {2 * self.stall_s:g} s")
                time.sleep(_POLL_S)  # each poll is an HTTP request to the server
        assert h.manifest is not None and h.peer is not None
        if h.pieces is None:
            h.pieces = pieces.manifest_of(h.manifest)
        window = _WINDOW_PIECES * self.chunk_bytes
        last_log = time.monotonic()
        with self.manager.open_stream(h.pieces, pieces.views, peer=h.peer,
                                      refuse_slow_transport=self.refuse_slow_transport
                                      ) as stream:
            if not h.opened:  # one connect READ per connection, into a piece read again
                first = next(k for k in pieces.keys if k not in pieces.got)
                stream.connect(first, max(end - time.monotonic(), 1.0))
                h.opened = True
            log.info("relay: reading from %s (connected in %.3f s; it advertises %d of %d "
                     "bytes; pieces of %d bytes)", h.ref, stream.connect_s, h.mark, total,
                     self.chunk_bytes)
            mark, landed_at, nap, full = -1, time.monotonic(), _NAP_MIN_S, False
            # How long a piece takes to land while the link is busy (an average): the
            # reader wakes a few times per piece, not every millisecond, and asks for
            # the holder's word a few times per piece while pieces are in flight (each
            # wake-up and READ costs CPU the host may share with its engine).
            piece_s = 0.0
            while not pieces.complete:
                _go_on(stop, end, state["mark"], total)
                now = time.monotonic()
                moved = False
                done = stream.poll()  # PeerError: the holder vanished
                if done:
                    # since the last landing, or since the post onto an idle link
                    took = (now - landed_at) / len(done)
                    piece_s = took if not piece_s else 0.8 * piece_s + 0.2 * took
                for key in done:
                    moved, landed_at = True, now
                    if h.ref not in self.read_from:
                        self.read_from.append(h.ref)
                    piece_done(key)  # IntegrityError: its tensor is read again elsewhere
                new = self._mark_now(h, total, piece_s / 4 if stream.inflight else 0.0)
                if new > mark or (moved and full):
                    mark, full = max(mark, new), False
                    for key in pieces.below(mark):
                        if key in stream.inflight:
                            continue
                        if stream.inflight_bytes >= window:
                            full = True
                            break
                        if not stream.inflight:
                            landed_at = now  # the stall clock runs while pieces are in flight
                        stream.post(key)
                        moved = True
                if stream.inflight:
                    if self.stall_s > 0 and now - landed_at > self.stall_s:
                        raise PeerError(
                            f"no piece landed for {self.stall_s:g} s (MX_TRANSFER_STALL_S): "
                            "the link may be down or the holder hung")
                elif (h.kind == "transfer" or h.loading) and self.stall_s > 0 and (
                        now - h.advanced > 2 * self.stall_s):
                    raise PeerError(f"it advertised nothing new for {2 * self.stall_s:g} s")
                elif now - last_log > _STILL_WAITING_EVERY_S:
                    log.info("relay: still waiting for %s to advertise more than %d of %d "
                             "bytes", h.ref, mark, total)
                    last_log = now
                if moved:
                    nap = _NAP_MIN_S
                else:
                    time.sleep(nap)
                    top = (min(max(piece_s / 8, _NAP_MAX_S), _NAP_CAP_S) if stream.inflight
                           else 2 * _NAP_MAX_S)  # starved: its word is asked after a while
                    nap = min(2 * nap, top)
            seconds, verdict, warnings = stream.finish()
            results.append(TransferResult(
                bytes=stream.bytes, seconds=seconds, gbps=stream.bytes / seconds / 1e9,
                descriptors=stream.pieces, chunks=stream.pieces, tensors=stream.pieces,
                transport=verdict.transport, verdict=verdict, warnings=tuple(warnings),
                verified=pieces.checked, verify_seconds=0.0, peer=h.peer,
                connect_seconds=stream.connect_s, expected_transport=stream.expected,
                transport_detail=stream.watch.facts().detail))

    def _check_manifest(self, h: _Holder, info: "SourceInfo") -> None:
        manifest = manifest_of(info)
        theirs = {e.name: (e.digest, e.nbytes) for e in manifest.tensors}
        for e in self.origin.tensors:
            digest, nbytes = theirs.get(e.name, (None, None))
            # A holder that publishes no digest (a from-zero follower: it received the
            # pieces before any digest was known) serves the same bytes; what it serves
            # is checked against the origin's digests here, as any holder's.
            if nbytes != e.nbytes or (digest is not None and digest != e.digest):
                raise PeerError(f"its manifest differs from the origin's at {e.name!r}")
        if manifest.digest_algorithm not in (None, self.origin.digest_algorithm):
            raise PeerError("its manifest uses another digest algorithm than the origin's")
        h.info, h.manifest = info, manifest

    def _connect(self, h: _Holder) -> str:
        if h.peer is None:
            assert h.info is not None and h.info.agent_metadata is not None
            h.peer = self.manager.add_peer(h.info.agent_metadata)
        return h.peer

    def _disconnect(self) -> None:
        for h in self.path:
            h.word = None  # closed with its peer
            if h.peer is not None:
                self.manager.remove_peer(h.peer)
                h.peer = None

    # -- reading ------------------------------------------------------------------
    def read_into(self, dest: Mapping[str, "torch.Tensor"], *, allow_partial: bool,
                  progress: Callable[[int, int], None], stop: "StopSignal | None",
                  deadline_s: float) -> "TransferResult":
        """READ ``dest`` from the path's holders (see the module docstring).

        Raises:
            TransferError: the origin, last on the path, failed too (as the NIXL READ;
                a stalled or dropped READ of it is tried again twice first).
            TransferCancelledError: ``stop`` was set.
            TransferTimeoutError: ``deadline_s`` ran out.
        """
        pieces = _Pieces(self.origin, dest, self.chunk_bytes, self.verify, have=self.have)
        total = pieces.total
        self.manager.register_tensors(dict(dest))  # once, whole: reads take subsets
        adv = _Advertiser(self.advertise, total) if self.advertise is not None else None
        state = {"mark": pieces.prefix}
        self.mark = pieces.prefix

        def advanced(mark: int) -> None:
            state["mark"] = mark
            self.mark = mark
            # ORDER: ``mark`` comes from _Pieces only after every piece below it landed
            # (its READ completed) and every tensor that ends below it was verified (of
            # the tensor in progress, only landed pieces, which readers verify themselves
            # once whole); the word is written after that, never before. Below it only a
            # failed tensor's pieces are written again, with the origin's bytes.
            if self.publish is not None:
                self.publish(mark)
            if adv is not None:
                adv.set(mark)
            progress(mark, total)

        def piece_done(key: str) -> None:
            mark = pieces.landed(key)  # raises IntegrityError when a tensor completes bad
            if mark is not None:
                advanced(mark)

        def tensor_done(name: str) -> None:  # copied and verified whole (local transport)
            mark = pieces.verified(name)
            if mark is not None:
                advanced(mark)

        t0 = time.perf_counter()
        end = time.monotonic() + deadline_s
        results: list["TransferResult"] = []
        at = 0
        origin_retries = _ORIGIN_RETRIES
        try:
            while not pieces.complete:
                _go_on(stop, end, state["mark"], total)
                h = self.path[at]
                try:
                    if h.kind == "source" and not h.loading and self.local is not None:
                        whole = pieces.whole_tensors(pieces.below(total))
                        copied = (self._read_locally(h, {n_: dest[n_] for n_ in whole}, stop,
                                                     end, tensor_done) if whole else None)
                        if copied is not None:
                            results.append(copied)
                            continue
                    self._stream(h, pieces, stop, end, piece_done, results, state)
                except TransferCancelledError:
                    raise
                except (TransferError, MxError) as exc:
                    pieces.forget_unverified()  # a tensor whose pieces did not all land
                    if at == len(self.path) - 1:
                        # The origin, last: a stalled or dropped READ is tried again (the
                        # deadline bounds it); a digest or transport refusal, or one
                        # this side cannot do (a digest it cannot compute), is final.
                        if (origin_retries <= 0
                                or isinstance(exc, (IntegrityError, TransportError,
                                                    ConfigError))):
                            raise
                        origin_retries -= 1
                        log.warning("relay: reading the origin %s again (%d of %d bytes "
                                    "verified so far): %s", h.ref, state["mark"], total, exc)
                        if h.peer is not None:
                            self.manager.remove_peer(h.peer)
                            h.peer, h.opened = None, False
                        continue
                    if isinstance(exc, TransferTimeoutError) and time.monotonic() > end:
                        raise
                    why = f"{h.ref}: {type(exc).__name__}: {exc}"
                    log.warning("relay: leaving holder %s (%d of %d bytes verified so far): "
                                "%s", h.ref, state["mark"], total, why)
                    self.gave_up.append(why)
                    h.word = None  # closed with its peer
                    if h.peer is not None:
                        self.manager.remove_peer(h.peer)
                        h.peer = None
                    at += 1
        finally:
            if adv is not None:
                adv.close()
            self._disconnect()
        return self._result(results, total, pieces.tensors, time.perf_counter() - t0,
                            pieces.checked)

    def _read_locally(self, h: _Holder, todo: Mapping[str, "torch.Tensor"],
                      stop: "StopSignal | None", end: float,
                      tensor_done: Callable[[str], None]) -> "TransferResult | None":
        """Copy ``todo`` from a complete holder on this host over the local transport;
        None when it is not local or the copy failed (then NIXL reads it)."""
        if self.local is None or h.kind != "source":
            return None
        assert h.info is not None and h.manifest is not None
        reader = self.local(h.info, h.manifest)
        if reader is None:
            return None
        names = [e.name for e in self.origin.tensors if e.name in todo]
        groups = tensor_chunks([todo[n].numel() * todo[n].element_size() for n in names],
                               self.local_group_bytes)
        results = []
        for first, last, _ in groups:
            # One copy per group, each group advertised once it is verified: the prefix
            # grows, and a stop or a rate cap acts between groups (a same-host copy of a
            # whole model would otherwise land before either could).
            group = {n: todo[n] for n in names[first:last]}
            try:
                results.append(reader.read_into(
                    group, allow_partial=True, progress=lambda d, t: None, stop=stop,
                    deadline_s=max(end - time.monotonic(), 1.0)))
            except TransferCancelledError:
                raise
            except TransferError as exc:
                log.warning("relay: the local transport from %s failed (%s); reading the rest "
                            "over NIXL", h.ref, exc)
                self.local = None
                break
            for n in group:
                tensor_done(n)
            if _stopped(stop):
                raise TransferCancelledError("relayed copy stopped on request")
        if not results:
            return None
        if h.ref not in self.read_from:
            self.read_from.append(h.ref)
        return self._result(results, sum(r.bytes for r in results),
                            sum(r.tensors for r in results), sum(r.seconds for r in results))

    def _result(self, results: list["TransferResult"], total: int, tensors: int,
                seconds: float, verified: bool | None = None) -> "TransferResult":
        from modelexpress.transfer import TransferResult
        from modelexpress.transfer.transport import TransportVerdict

        if not results:  # nothing to read (every tensor zero bytes)
            verdict = TransportVerdict(ok=True, expected="", observed=(), gbps=None,
                                       floor_gbps=0.0, message="nothing read",
                                       transports=())
            return TransferResult(bytes=0, seconds=1e-9, gbps=0.0, descriptors=0, chunks=0,
                                  tensors=tensors, transport="unknown", verdict=verdict,
                                  warnings=(), verified=self.verify, verify_seconds=0.0,
                                  peer="relay")
        transports = sorted({r.transport for r in results})
        bad = [r.verdict for r in results if not r.verdict.ok]
        warnings = tuple(dict.fromkeys(w for r in results for w in r.warnings))
        if self.gave_up:
            warnings += tuple(f"relay: left holder {g}" for g in self.gave_up)
        return TransferResult(
            bytes=total, seconds=max(seconds, 1e-9), gbps=total / max(seconds, 1e-9) / 1e9,
            descriptors=sum(r.descriptors for r in results),
            chunks=sum(r.chunks for r in results), tensors=tensors,
            transport="+".join(transports) if len(transports) > 1 else transports[0],
            verdict=bad[0] if bad else results[-1].verdict, warnings=warnings,
            verified=all(r.verified for r in results) if verified is None else verified,
            verify_seconds=sum(r.verify_seconds for r in results),
            peer="relay:" + ",".join(self.read_from),
            connect_seconds=sum(r.connect_seconds for r in results),
            expected_transport=results[0].expected_transport,
            transport_detail="; ".join(dict.fromkeys(r.transport_detail for r in results)))
