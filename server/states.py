"""State machines of sources and transfers, and the one function that checks a move.

Sources::

    INITIALIZING --> READY <--> STALE
         |                        ^
         +------------------------+
    (publish resets any state to the published one; a heartbeat revives STALE)

Transfers::

    PENDING ----> RUNNING ----> SUCCEEDED
      |  |           |   \\
      |  |           |    +---> FAILED <--------+
      |  |           v                          |
      |  +-------> STOPPING ----> STOPPED ------+--> (restart) --> PENDING
      |                 \\
      +--> STOPPED        +-----> FAILED
      +--> SUCCEEDED / FAILED  (a worker may finish before its first progress report)

A stop of a PENDING transfer that no worker has claimed yet goes straight to
STOPPED (nobody is there to confirm it); once claimed it goes to STOPPING and the
worker confirms STOPPED at its next chunk boundary. STOPPING -> SUCCEEDED is
illegal on purpose: when a stop and a finish race, exactly one of them wins and
the other gets 409, so an operator never sees "stopped" for a transfer that in
fact completed, nor the reverse.
"""

from __future__ import annotations

import enum

from modelexpress.errors import ConflictError

__all__ = [
    "SourceState",
    "TransferState",
    "TERMINAL",
    "LIVE",
    "check_source_move",
    "check_transfer_move",
]


class SourceState(str, enum.Enum):
    """Life of one published source (one worker rank holding one identity)."""

    INITIALIZING = "INITIALIZING"
    READY = "READY"
    STALE = "STALE"


class TransferState(str, enum.Enum):
    """Life of one transfer record."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"


TERMINAL = frozenset({TransferState.SUCCEEDED, TransferState.FAILED, TransferState.STOPPED})
"""States in which nothing more happens unless an operator restarts the transfer."""

LIVE = frozenset({TransferState.PENDING, TransferState.RUNNING, TransferState.STOPPING})
"""States that count as load on a source (used by the ``spread`` policy)."""

_S = SourceState
_SOURCE_MOVES: dict[SourceState, frozenset[SourceState]] = {
    _S.INITIALIZING: frozenset({_S.INITIALIZING, _S.READY, _S.STALE}),
    _S.READY: frozenset({_S.READY, _S.STALE}),
    # A STALE source that heartbeats again is alive after all (e.g. a network blip).
    _S.STALE: frozenset({_S.STALE, _S.READY}),
}

_T = TransferState
_TRANSFER_MOVES: dict[TransferState, frozenset[TransferState]] = {
    _T.PENDING: frozenset({_T.RUNNING, _T.SUCCEEDED, _T.FAILED, _T.STOPPING, _T.STOPPED}),
    _T.RUNNING: frozenset({_T.RUNNING, _T.SUCCEEDED, _T.FAILED, _T.STOPPING}),
    _T.STOPPING: frozenset({_T.STOPPING, _T.STOPPED, _T.FAILED}),
    _T.SUCCEEDED: frozenset(),
    _T.FAILED: frozenset({_T.PENDING}),
    _T.STOPPED: frozenset({_T.PENDING}),
}


def check_source_move(source_id: str, old: SourceState, new: SourceState) -> None:
    """Raise :class:`ConflictError` unless a heartbeat may move a source from ``old`` to ``new``.

    Args:
        source_id: for the message.
        old: the stored state.
        new: the requested state.

    Raises:
        ConflictError: the move is illegal; the message lists the legal targets.
    """
    allowed = _SOURCE_MOVES[old]
    if new not in allowed:
        raise ConflictError(
            f"source {source_id}: cannot move {old.value} -> {new.value}; "
            f"allowed from {old.value}: {sorted(s.value for s in allowed)} "
            "(publish again to reset a source)")


def check_transfer_move(transfer_id: str, old: TransferState, new: TransferState) -> None:
    """Raise :class:`ConflictError` unless a transfer may move from ``old`` to ``new``.

    Args:
        transfer_id: for the message.
        old: the stored state.
        new: the requested state.

    Raises:
        ConflictError: the move is illegal; the message lists the legal targets.
    """
    allowed = _TRANSFER_MOVES[old]
    if new not in allowed:
        legal = sorted(s.value for s in allowed) or "none (terminal)"
        raise ConflictError(
            f"transfer {transfer_id}: cannot move {old.value} -> {new.value}; "
            f"allowed from {old.value}: {legal}")
