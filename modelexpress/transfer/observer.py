"""Which peer a UCX protocol table belongs to, and which transport one READ used.

UCX prints a "remote memory read" table (:mod:`~modelexpress.transfer.ucx_report`)
when a worker first selects protocols for an (endpoint configuration, remote key
configuration, operation). The table names the UCP context (our agent), never the
peer, and UCX prints nothing when a selection is reused: on a second READ from the
same peer, or on the first READ from a peer whose configurations match an earlier
peer's. So, per agent:

- **Windows.** ``add_peer`` and the small connect READ every READ starts with (it
  triggers the selection) run inside a window; an agent's windows run one at a
  time. Tables of this agent (and CUDA VMM key errors) that appear during a window
  belong to its peer, unless something with another peer was in flight then: a
  READ moving bytes, or a window that could not wait its turn. Such tables stay
  unattributed.
- **After a READ.** Tables that appeared during its bulk phase and no window
  claimed belong to its peer when nothing with another peer overlapped it.
- **A READ's transport.** The rows of its peer's tables (for its memory kinds) that
  cover its descriptor sizes. A peer with no table of its own reused a selection UCX
  printed earlier for this agent: when every such table (for those memory kinds)
  names the same transports, those are the transports; otherwise, or when there is
  no table at all, the transport is unknown and ``detail`` says why.

Agents are told apart by the first 31 characters of their names (all UCX keeps);
two live agents of one process that share them get no transport.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import TypeVar

from modelexpress.transfer import ucx_report
from modelexpress.transfer.transport import UcxLogFacts
from modelexpress.transfer.ucx_report import CONTEXT_NAME_MAX, ProtoTable

log = logging.getLogger(__name__)

__all__ = ["ReadWatch", "TransportObserver"]

T = TypeVar("T")

# How long a window waits for the agent's previous window (a connect READ to a hung
# peer can hold it until its deadline); after that it runs unattributed.
_WINDOW_WAIT_S = 2.0

_contexts_lock = threading.Lock()
_contexts: collections.Counter[str] = collections.Counter()


@dataclasses.dataclass(eq=False)
class _Activity:
    peer: str | None        # None: not known yet (add_peer before NIXL names the peer)
    dirty: bool = False     # overlapped something with another peer
    bulk_from: int = 0      # event number at the end of its connect window


class ReadWatch:
    """One READ as the observer sees it: its connect window and its facts."""

    def __init__(self, observer: TransportObserver, peer: str, local_mem: str,
                 remote_mem: str, sizes: Sequence[int]) -> None:
        self._observer = observer
        self._activity = _Activity(peer)
        self.peer = peer
        self.local_mem, self.remote_mem = local_mem, remote_mem
        self.sizes = tuple(sorted(set(int(s) for s in sizes)))

    def window(self) -> contextlib.AbstractContextManager[_Activity]:
        """Wrap the READ that opens the connection (UCX selects protocols there)."""
        return self._observer._window(self.peer, self._activity)

    def facts(self) -> UcxLogFacts:
        """What UCX's report says about this READ so far."""
        return self._observer.facts(self.peer, self.local_mem, self.remote_mem, self.sizes)


class TransportObserver:
    """Attributes UCX protocol tables to one agent's peers (rules in the module docstring).

    Args:
        agent_name: the NIXL agent's name (UCX names its context after it).
        backend: the NIXL backend; only UCX has a report to read.
        reader: the report to read; this process's UCX log (:func:`ucx_report.reader`)
            when None. Tests pass one over a file they write.
    """

    def __init__(self, agent_name: str, backend: str, *,
                 reader: ucx_report.ReportReader | None = None) -> None:
        self.context = agent_name[:CONTEXT_NAME_MAX]
        self._reason = ""
        self._reader: ucx_report.ReportReader | None = None
        if backend != "UCX":
            self._reason = (f"NIXL backend {backend}: modelexpress reads the transport only "
                            "from UCX's protocol report")
        elif reader is not None:
            self._reader = reader
        else:
            setup = ucx_report.configure()
            self._reader = ucx_report.reader()
            self._reason = setup.reason
        self._window_lock = threading.Lock()
        self._state = threading.Lock()
        self._seen = self._reader.poll() if self._reader is not None else 0
        self._tables: list[tuple[int, ProtoTable]] = []
        self._vmm: list[tuple[int, str]] = []
        self._owner: dict[int, str | None] = {}
        self._active: set[_Activity] = set()
        self._closed = False
        with _contexts_lock:
            _contexts[self.context] += 1

    # -- the event stream ----------------------------------------------------------------
    def _pull(self) -> int:
        """Take this agent's new events from the process reader (``_state`` held)."""
        if self._reader is None:
            return 0
        seq = self._reader.poll()
        self._tables.extend((s, t) for s, t in _since(self._reader.tables, self._seen)
                            if t.context == self.context)
        self._vmm.extend(_since(self._reader.vmm_lines, self._seen))
        self._seen = seq
        return seq

    def poll(self) -> None:
        """Read UCX's log now (relays its messages when modelexpress owns the file)."""
        with self._state:
            self._pull()

    def _claim(self, start: int, end: int, owner: str | None) -> None:
        for seq, _ in (*self._tables, *self._vmm):
            if start < seq <= end and seq not in self._owner:
                self._owner[seq] = owner

    def _begin(self, act: _Activity) -> None:
        for other in self._active:
            if other.peer is None or act.peer is None or other.peer != act.peer:
                other.dirty = act.dirty = True
        self._active.add(act)

    # -- windows and READs ---------------------------------------------------------------
    @contextlib.contextmanager
    def _window(self, peer: str | None, read: _Activity | None = None) -> Iterator[_Activity]:
        act = _Activity(peer)
        if self._reader is None:
            yield act
            return
        got = self._window_lock.acquire(timeout=_WINDOW_WAIT_S)
        try:
            with self._state:
                start = self._pull()
                if not got:
                    log.debug("agent %s: a window for %s ran beside another (waited %.0f s); "
                              "UCX tables printed meanwhile stay unattributed", self.context,
                              peer or "a new peer", _WINDOW_WAIT_S)
                    act.dirty = True
                self._begin(act)
                if read is not None and read not in self._active:
                    self._begin(read)
            try:
                yield act
            finally:
                with self._state:
                    end = self._pull()
                    self._active.discard(act)
                    owner = act.peer if not act.dirty else None
                    self._claim(start, end, owner)
                    if read is not None:
                        read.bulk_from = end
                        read.dirty = read.dirty or act.dirty
        finally:
            if got:
                self._window_lock.release()

    def peer_window(self) -> contextlib.AbstractContextManager[_Activity]:
        """Wrap ``add_peer``; set the yielded activity's ``peer`` once NIXL named it."""
        return self._window(None)

    @contextlib.contextmanager
    def reading(self, peer: str, local_mem: str, remote_mem: str,
                sizes: Sequence[int]) -> Iterator[ReadWatch]:
        """Wrap one READ; tables from its bulk phase are attributed when it ends."""
        watch = ReadWatch(self, peer, local_mem, remote_mem, sizes)
        try:
            yield watch
        finally:
            if self._reader is not None:
                with self._state:
                    end = self._pull()
                    act = watch._activity
                    if act in self._active:
                        self._active.discard(act)
                        self._claim(act.bulk_from, end, None if act.dirty else peer)

    def forget(self, peer: str) -> None:
        """A removed peer's tables stay, unattributed (a re-added peer starts afresh)."""
        with self._state:
            for seq, owner in self._owner.items():
                if owner == peer:
                    self._owner[seq] = None

    # -- the answer ------------------------------------------------------------------------
    def facts(self, peer: str, local_mem: str, remote_mem: str,
              sizes: Sequence[int]) -> UcxLogFacts:
        """The transports UCX's report shows for READs of ``sizes`` (sorted) from ``peer``.

        Returns:
            Facts with ``read_transports`` empty and ``detail`` saying why when the
            transport could not be observed.
        """
        if self._reader is None:
            return UcxLogFacts(detail=f"not observed: {self._reason}")
        with _contexts_lock:
            clash = _contexts[self.context] > 1
        if clash:
            return UcxLogFacts(detail=(
                f"not observed: another NIXL agent of this process shares the first "
                f"{CONTEXT_NAME_MAX} characters of this agent's name ({self.context!r}), all "
                "UCX's report names; give agents distinct names"))
        path = self._reader.path
        with self._state:
            self._pull()
            tables = [(s, t) for s, t in self._tables
                      if t.local_mem in (None, local_mem) and t.remote_mem in (None, remote_mem)]
            own = [t for s, t in tables if self._owner.get(s) == peer]
            vmm = [line for s, line in self._vmm if self._owner.get(s) == peer]
            error = self._reader.error
        sizes = tuple(sizes) or None
        if own:
            tls = tuple(dict.fromkeys(tl for t in own for tl in t.transports(sizes)))
            evidence = tuple(t.describe() for t in own[:3]) + tuple(vmm[:2])
            return UcxLogFacts(tls, bool(vmm), evidence,
                               f"UCX protocol report for peer {peer} in {path}")
        choices = {t.transports(sizes): t for _, t in tables}
        kinds = f"{local_mem} <- {remote_mem}"
        if len(choices) == 1:
            # The peer's selection is one UCX printed for this agent (it prints every
            # new one), and all of those agree.
            tls, table = next(iter(choices.items()))
            return UcxLogFacts(tls, bool(vmm), (table.describe(), *vmm[:2]), (
                f"UCX's report has no table of peer {peer}'s own (UCX reused a selection, "
                f"or printed it while another peer was read); every {kinds} read selection "
                f"it printed for this agent in {path} uses {'+'.join(tls)}"))
        if not choices:
            return UcxLogFacts((), bool(vmm), tuple(vmm[:2]), (
                f"not observed: no UCX protocol report of a {kinds} remote memory read by "
                f"this agent in {path}" + (f" ({error})" if error else "")))
        names = "; ".join(sorted("+".join(c) for c in choices))
        return UcxLogFacts((), bool(vmm), tuple(vmm[:2]), (
            f"not observed: UCX reused one of the protocol selections it printed for this "
            f"agent ({names}) and its report does not say which one peer {peer} got"))

    def close(self) -> None:
        """Final read of UCX's log (relays its last messages); idempotent."""
        if self._closed:
            return
        self._closed = True
        with _contexts_lock:
            _contexts[self.context] -= 1
            if _contexts[self.context] <= 0:
                del _contexts[self.context]
        with contextlib.suppress(OSError):
            self.poll()


def _since(events: list[tuple[int, T]], seen: int) -> list[tuple[int, T]]:
    """The events (ascending by number) numbered above ``seen``."""
    return events[bisect.bisect_right(events, seen, key=lambda e: e[0]):]
