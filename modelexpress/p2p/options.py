"""How a pull runs: :class:`PullOptions`, built once from :class:`~modelexpress.settings.MxSettings`.

Every entry point that pulls (``modelexpress pull``, the agent's REST transfers, the
vLLM loader, a library caller) builds one ``PullOptions.from_settings(settings,
**its own flags)`` and passes it to :func:`~modelexpress.p2p.pull`; no entry point
translates settings into pull arguments by hand, so a setting cannot reach one
entry point and miss another (tests/p2p/test_pull_options.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from modelexpress.errors import ConfigError
from modelexpress.local.options import LocalOptions
from modelexpress.p2p.selection import POLICIES
from modelexpress.storage.base import StorageOptions

if TYPE_CHECKING:
    from modelexpress.settings import MxSettings

__all__ = ["PullOptions"]


@dataclasses.dataclass(frozen=True)
class PullOptions:
    """What one pull does besides moving bytes; build it with :meth:`from_settings`.

    Attributes:
        device: where destination tensors are allocated when the caller gives none.
        timeout_s: deadline of the whole pull, all attempts included
            (``MX_TRANSFER_TIMEOUT_S``).
        verify: check each tensor's digest (``MX_VERIFY_DIGESTS``).
        allow_partial: tensors present on one side only are skipped instead of an error.
        policy: the server's source order, ``random`` or ``spread`` (``MX_SOURCE_POLICY``).
        max_attempts: sources tried at most (``MX_MAX_SOURCE_ATTEMPTS``).
        stripe: read from up to this many sources at once, each a contiguous share of
            the tensors (fewer when fewer are READY).
        prefer: source ids to try first, in order (e.g. the one the server assigned).
        exclude_workers: worker ids never chosen (e.g. the puller's own sources).
        chunk_bytes: bytes per READ request: the granularity of progress and stop
            (``MX_TRANSFER_CHUNK_BYTES``).
        stall_s: a NIXL READ that lands no chunk for this long gives its source up and
            the next one is tried (``MX_TRANSFER_STALL_S``); 0 waits until ``timeout_s``.
        refuse_slow_transport: fail on a detected transport fallback instead of warning
            (``MX_REFUSE_SLOW_TRANSPORT``).
        max_gbps: cap on the receive rate, enforced between chunks; 0 is none
            (``MX_TRANSFER_MAX_GBPS``).
        track: the pull creates, reports on and finishes its own transfer record on the
            control plane (False: a caller that holds a record passes it to ``pull``).
        worker_id: this process's worker id in that record (default
            ``pull-<host>-<pid>-<random>``).
        progress_interval_s: at most one progress report per this many seconds.
        backend: NIXL backend of an agent the pull creates (``MX_NIXL_BACKEND``).
        local: the local transport (``MX_IPC_DIR``, ``MX_NODE_NAME``): sources on this
            host that publish a local endpoint are read through it, without NIXL;
            ``MX_IPC_DIR=off`` reads every source over NIXL.
        relay_read: a tracked pull asks the server to plan it as a fleet-relay reader:
            it may read each chunk from a relaying agent's live transfer as soon as that
            agent verified it (:mod:`~modelexpress.p2p.relay`); it relays to nobody. The
            CLI's ``pull`` sets it from ``MX_RELAY``; off by default elsewhere.
        relay_serve: with ``relay_read``, the pull is also a holder: its destination
            is published as a relay source before the first byte lands and serves each
            verified piece to later pulls while it receives; after it succeeded it serves
            the pulls still reading from it for at most ``relay_linger_s``, then
            withdraws, so nothing is served once the pull returned (the vLLM loader sets
            it from ``MX_RELAY``: engines that start together; its post-processing then
            runs on memory nobody reads).
        relay_chunk_bytes: most bytes per relayed READ (``MX_RELAY_CHUNK_BYTES``; the
            pieces follow the model's size: :func:`~.relay_plan.piece_bytes`).
        relay_link_mbit: this host's link for the relayed pieces' size
            (``MX_RELAY_LINK_MBIT``; 0: unknown).
        relay_linger_s: see ``relay_serve`` (``MX_RELAY_LINGER_S``).
        heartbeat_interval_s: heartbeat of a relay source (``MX_HEARTBEAT_INTERVAL_S``).
        model_storage: where the checkpoint is stored, for a fetch that may start from
            zero (``MX_MODEL_STORAGE``; ``modelexpress pull --from``; the vLLM loader's
            ``mx_model_storage``): :func:`~modelexpress.p2p.zero.fetch`. Empty: peers only.
        storage: how storage is read (``MX_STORAGE_CONCURRENCY``, ``MX_STORAGE_RANGE_BYTES``,
            ``MX_STORAGE_TIMEOUT_S``).
        origin_lease_s: the origin lease's time to live (``MX_ORIGIN_LEASE_S``).

    Raises:
        ConfigError: a value out of range; the message names the allowed ones.
    """

    device: str = "cpu"
    timeout_s: float = 600.0
    verify: bool = True
    allow_partial: bool = False
    policy: str = "random"
    max_attempts: int = 3
    stripe: int = 1
    prefer: tuple[str, ...] = ()
    exclude_workers: tuple[str, ...] = ()
    chunk_bytes: int = 1 << 30
    stall_s: float = 120.0
    refuse_slow_transport: bool = False
    max_gbps: float = 0.0
    track: bool = True
    worker_id: str | None = None
    progress_interval_s: float = 0.5
    backend: str = "UCX"
    local: LocalOptions = LocalOptions()
    relay_read: bool = False
    relay_serve: bool = False
    relay_chunk_bytes: int = 4 << 20
    relay_link_mbit: float = 0.0
    relay_linger_s: float = 10.0
    heartbeat_interval_s: float = 5.0
    model_storage: str = ""
    storage: StorageOptions = StorageOptions()
    origin_lease_s: float = 10.0

    def __post_init__(self) -> None:
        # Sequences given as lists stay hashable and immutable.
        object.__setattr__(self, "prefer", tuple(self.prefer))
        object.__setattr__(self, "exclude_workers", tuple(self.exclude_workers))
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown source policy {self.policy!r}; allowed: "
                              f"{', '.join(POLICIES)}")
        bad = [f"{name} must be {rule} (got {value!r})" for name, value, ok, rule in (
            ("max_attempts", self.max_attempts, self.max_attempts >= 1, ">= 1"),
            ("stripe", self.stripe, self.stripe >= 1, ">= 1"),
            ("timeout_s", self.timeout_s, self.timeout_s > 0, "> 0"),
            ("chunk_bytes", self.chunk_bytes, self.chunk_bytes > 0, "> 0"),
            ("relay_chunk_bytes", self.relay_chunk_bytes, self.relay_chunk_bytes > 0, "> 0"),
            ("relay_link_mbit", self.relay_link_mbit, self.relay_link_mbit >= 0,
             ">= 0 (0: unknown)"),
            ("relay_linger_s", self.relay_linger_s, self.relay_linger_s >= 0, ">= 0"),
            ("heartbeat_interval_s", self.heartbeat_interval_s,
             self.heartbeat_interval_s > 0, "> 0"),
            ("origin_lease_s", self.origin_lease_s, 0 < self.origin_lease_s <= 3600,
             "> 0 and <= 3600"),
            ("stall_s", self.stall_s, self.stall_s >= 0, ">= 0 (0: only the deadline)"),
            ("max_gbps", self.max_gbps, self.max_gbps >= 0, ">= 0 (0: no cap)"),
            ("progress_interval_s", self.progress_interval_s, self.progress_interval_s >= 0,
             ">= 0"),
        ) if not ok]
        if bad:
            raise ConfigError("; ".join(bad))

    @classmethod
    def from_settings(cls, settings: "MxSettings", **overrides: Any) -> "PullOptions":
        """The options ``settings`` give; ``overrides`` (an entry point's flags) win.

        An override of None is an unset flag and leaves the setting's value.

        Raises:
            TypeError: an override names no field.
            ConfigError: a value out of range.
        """
        values: dict[str, Any] = {
            "timeout_s": settings.transfer_timeout_s,
            "verify": settings.verify_digests,
            "policy": settings.source_policy,
            "max_attempts": settings.max_source_attempts,
            "chunk_bytes": settings.transfer_chunk_bytes,
            "stall_s": settings.transfer_stall_s,
            "refuse_slow_transport": settings.refuse_slow_transport,
            "max_gbps": settings.transfer_max_gbps,
            "backend": settings.nixl_backend,
            "local": LocalOptions.from_settings(settings),
            "relay_chunk_bytes": settings.relay_chunk_bytes,
            "relay_link_mbit": settings.relay_link_mbit,
            "relay_linger_s": settings.relay_linger_s,
            "heartbeat_interval_s": settings.heartbeat_interval_s,
            "model_storage": settings.model_storage,
            "storage": StorageOptions.from_settings(settings),
            "origin_lease_s": settings.origin_lease_s,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes: Any) -> "PullOptions":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)
