"""A few bytes of a peer's registered memory, read again and again with one READ request.

A fleet relay's reader polls its upstream's *watermark* (how far the upstream holds
verified bytes, :mod:`modelexpress.p2p.relay`) many times a second. A full
:meth:`~.manager.NixlTransferManager.read` per poll would plan, prepare two
descriptor lists and open the connection each time; a :class:`RemoteWord` prepares
its one-descriptor READ once (a registered local buffer, the peer's region) and
re-posts the same request, which NIXL allows once the previous post completed
(posting it while still active is ``nixlRepostActiveError``). The peer stays
passive: it only keeps the word in memory it registered and writes it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from modelexpress.errors import ConfigError, PeerError, TransferError

if TYPE_CHECKING:
    from modelexpress.transfer.nixl_adapter import MemKind, NixlAgent

__all__ = ["RemoteWord"]

log = logging.getLogger(__name__)

_SPIN_POLLS = 200        # polls of a posted word READ before sleeping between them
_POLL_SLEEP_S = 0.0001


class RemoteWord:
    """A prepared one-sided READ of ``nbytes`` (a multiple of 8) at ``addr`` on ``peer``.

    Made by :meth:`~.manager.NixlTransferManager.watch_word` (the peer must be added);
    closed by it when the peer is removed or the manager closes.

    Raises:
        ConfigError: ``nbytes`` is not a positive multiple of 8.
        TransferError: NIXL refused the registration or the request.
    """

    def __init__(self, agent: "NixlAgent", peer: str, addr: int, nbytes: int, *,
                 mem: "MemKind" = "DRAM", device: int = 0) -> None:
        if nbytes <= 0 or nbytes % 8:
            raise ConfigError(f"a remote word is a positive multiple of 8 bytes (got {nbytes})")
        self.peer = peer
        self.nbytes = nbytes
        self.closed = False
        self._agent = agent
        self._buf = np.zeros(nbytes // 8, dtype=np.uint64)  # lives as long as we do
        region = (int(self._buf.ctypes.data), nbytes, 0)
        self._handles: list[Any] = []
        self._req: Any = None
        self._due: float | None = None   # monotonic deadline of the READ in flight
        self._deadline_s = 0.0
        self._state = "DONE"
        self._reg: Any = agent.register([region], "DRAM")
        try:
            self._handles.append(agent.prep(None, np.array([region], dtype=np.uint64), "DRAM"))
            self._handles.append(agent.prep(
                peer, np.array([(int(addr), nbytes, int(device))], dtype=np.uint64), mem))
            idx = np.zeros(1, dtype=np.int32)
            self._req = agent.make_read(self._handles[0], idx, self._handles[1], idx, peer)
        except BaseException:
            self.close()
            raise

    def read(self, deadline_s: float) -> tuple[int, ...]:
        """Post the READ and wait for it: the words as they were in the peer's memory.

        Raises:
            PeerError: the READ failed (the peer exited or deregistered the word), or
                did not complete within ``deadline_s`` (the peer or its link is hung).
        """
        self.post(deadline_s)
        polls = 0
        while True:
            got = self.poll()
            if got is not None:
                return got
            polls += 1
            if polls > _SPIN_POLLS:
                time.sleep(_POLL_SLEEP_S)

    @property
    def posted(self) -> bool:
        """A READ is in flight (:meth:`post` called, :meth:`poll` has not returned it)."""
        return self._due is not None

    def post(self, deadline_s: float) -> None:
        """Post the READ without waiting; :meth:`poll` returns the words once it landed.
        Posting while one is in flight does nothing (NIXL refuses a repost of an active
        request).

        Raises:
            PeerError: the READ is closed or NIXL refused the post.
        """
        if self._req is None:
            raise PeerError(f"the watermark READ of peer {self.peer} is closed")
        if self._due is not None:
            return
        try:
            self._state = self._agent.post(self._req, self.peer, self.nbytes)
        except TransferError as exc:
            raise PeerError(f"the watermark READ of peer {self.peer} failed: {exc}") from exc
        self._due = time.monotonic() + deadline_s
        self._deadline_s = deadline_s

    def poll(self) -> tuple[int, ...] | None:
        """The words of the posted READ once it landed, else None (still in flight).

        Raises:
            PeerError: nothing is posted, the READ failed, or it did not complete
                within the ``deadline_s`` it was posted with.
        """
        if self._due is None or self._req is None:
            raise PeerError(f"no watermark READ of peer {self.peer} is posted")
        try:
            if self._state == "PROC":
                self._state = self._agent.state(self._req, self.peer, self.nbytes)
        except TransferError as exc:
            self._due = None
            raise PeerError(f"the watermark READ of peer {self.peer} failed: {exc}") from exc
        if self._state == "PROC":
            if time.monotonic() > self._due:
                self._due = None
                raise PeerError(f"a {self.nbytes}-byte READ of peer {self.peer}'s watermark "
                                f"did not complete within {self._deadline_s:g} s: the peer or "
                                "its link is hung")
            return None
        self._due = None
        if self._state == "ERR":
            raise PeerError(f"the watermark READ of peer {self.peer} failed: the peer exited "
                            "or withdrew its memory")
        return tuple(int(v) for v in self._buf)

    def close(self) -> None:
        """Release the request (aborting a post still active) and the buffer. Idempotent."""
        self.closed = True
        self._due = None
        req, self._req = self._req, None
        if req is not None:
            self._agent.release(req)
        while self._handles:
            self._agent.release(self._handles.pop())
        reg, self._reg = getattr(self, "_reg", None), None
        if reg is not None and not self._agent.closed:
            try:
                self._agent.deregister(reg)
            except TransferError as exc:  # on a teardown path: the original error matters
                log.warning("could not deregister the watermark buffer of peer %s: %s",
                            self.peer, exc)
