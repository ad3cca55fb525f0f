"""The one error tree of modelexpress.

Every exception the package raises on purpose derives from :class:`MxError`.
Foreign exceptions (NIXL statuses, cuda-python results, OS errors, HTTP errors)
are translated at the adapter boundary with ``raise OurError(...) from exc`` so
callers catch our names only.

::

    MxError
    ├── ConfigError (ValueError)           bad argument or setting; says the allowed values
    │   ├── CheckpointError                a checkpoint file is unreadable / not safetensors
    │   └── LayoutError                    a layout is malformed or does not combine; names the tensor
    │       └── CoverageError              the candidate sources do not hold a region a target needs
    ├── DependencyError (ImportError)      an optional extra is missing; says what to install
    ├── MxTimeoutError (TimeoutError)      a bounded wait ran out; says what it waited for
    ├── ArenaError                         VMM arena (modelexpress.vmm)
    │   ├── ArenaClosedError               use after close()
    │   ├── ArenaExhaustedError            the reserved VA range is used up
    │   └── InvalidFreeError               free of an unknown or already freed address
    ├── BackendError                       a driver / OS call failed (rolled back): a VMM
    │                                      backend, a host read, the digest kernel's driver
    ├── TransferError                      NIXL data plane (modelexpress.transfer)
    │   ├── RegistrationError              memory registration failed
    │   ├── PeerError                      a peer is unreachable, vanished or refused
    │   ├── TransferTimeoutError (+MxTimeoutError)
    │   ├── TransferCancelledError         a stop was honoured
    │   ├── ManifestMismatchError          names/dtypes/shapes differ; raised before any byte moves
    │   ├── IntegrityError                 a digest did not match; names the tensor
    │   └── TransportError                 the transport is wrong or far below its expected rate
    ├── ControlPlaneError                  server / client (modelexpress.server, modelexpress.client)
    │   ├── NotFoundError
    │   ├── ConflictError                  illegal state transition, concurrent update lost
    │   ├── AuthError
    │   ├── ValidationError                the server rejected the request body
    │   └── ServerUnavailableError         connection refused / retries exhausted
    ├── StoreError                         a store backend (SQLite, Redis) failed
    ├── StorageReadError                   reading a checkpoint from storage (a directory, S3)
    │                                      failed: missing, denied, short, timed out; names the URL
    ├── OutputError                        writing an output failed (disk full, read-only)
    │   └── OutputExistsError              the output exists; no --overwrite
    ├── ShmArenaError                      shared-memory tensor arena (modelexpress.shm_arena)
    │   └── ShmSpaceError                  /dev/shm too small; says how much is free and needed
    ├── NoSourceError                      no READY source could serve a pull
    ├── ServedElsewhereError               a fetch from zero stopped: the model turned READY in
    │                                      another form (an engine's loaded form); pull that
    ├── LayoutUnavailableError             a model's layout cannot be derived; names the tensor and why
    ├── ArtifactRefusedError               a compiled-artifact set failed its signature, digests or paths
    └── WeightUpdateError                  an RL weight update failed; the engine kept its weights
"""

from __future__ import annotations

__all__ = [
    "MxError",
    "ConfigError",
    "CheckpointError",
    "LayoutError",
    "CoverageError",
    "DependencyError",
    "MxTimeoutError",
    "ArenaError",
    "ArenaClosedError",
    "ArenaExhaustedError",
    "InvalidFreeError",
    "BackendError",
    "TransferError",
    "RegistrationError",
    "PeerError",
    "TransferTimeoutError",
    "TransferCancelledError",
    "ManifestMismatchError",
    "IntegrityError",
    "TransportError",
    "ControlPlaneError",
    "NotFoundError",
    "ConflictError",
    "AuthError",
    "ValidationError",
    "ServerUnavailableError",
    "StoreError",
    "StorageReadError",
    "OutputError",
    "OutputExistsError",
    "ShmArenaError",
    "ShmSpaceError",
    "NoSourceError",
    "ServedElsewhereError",
    "LayoutUnavailableError",
    "ArtifactRefusedError",
    "WeightUpdateError",
]


class MxError(Exception):
    """Base class of every error modelexpress raises on purpose."""


class ConfigError(MxError, ValueError):
    """A bad argument or setting. The message states the allowed values."""


class CheckpointError(ConfigError):
    """A checkpoint file is missing, unreadable, truncated or not safetensors.

    The message names the file and what is wrong with it.
    """


class LayoutError(ConfigError):
    """A layout (``modelexpress.layout``) is malformed, or two layouts cannot be combined;
    the message names the tensor."""


class CoverageError(LayoutError):
    """The candidate sources of other layouts do not hold every region a target needs
    (the message names the first checkpoint block none holds)."""


class DependencyError(MxError, ImportError):
    """An optional dependency is missing. The message names the extra to install."""


class MxTimeoutError(MxError, TimeoutError):
    """A bounded wait ran out. The message says what was awaited and for how long."""


class ArenaError(MxError):
    """VMM arena failure."""


class ArenaClosedError(ArenaError):
    """The arena was used after ``close()``."""


class ArenaExhaustedError(ArenaError):
    """The reserved virtual address range has no room for the request."""


class InvalidFreeError(ArenaError):
    """``free`` of an address the arena does not hold (unknown or already freed)."""


class BackendError(MxError):
    """A driver or OS call failed (a VMM backend's, a local host read, the digest
    kernel's CUDA driver calls); partial work was rolled back. Not an
    :class:`ArenaError`: most of these calls are not the arena's."""


class TransferError(MxError):
    """NIXL data-plane failure."""


class RegistrationError(TransferError):
    """Memory registration with NIXL failed."""


class PeerError(TransferError):
    """A peer is unreachable, vanished mid-transfer, or refused the request."""


class TransferTimeoutError(TransferError, MxTimeoutError):
    """A transfer did not complete within its deadline."""


class TransferCancelledError(TransferError):
    """The transfer was stopped on request at a chunk boundary."""


class ManifestMismatchError(TransferError):
    """Source and target tensors differ (names, dtypes, shapes, sizes)."""


class IntegrityError(TransferError):
    """A received tensor's digest differs from the source's."""


class TransportError(TransferError):
    """The transport in use is wrong for the memory, or far below its expected rate."""


class ControlPlaneError(MxError):
    """Control-plane (server or client) failure."""


class NotFoundError(ControlPlaneError):
    """The requested source or transfer does not exist."""


class ConflictError(ControlPlaneError):
    """An illegal state transition, or a concurrent update that lost."""


class AuthError(ControlPlaneError):
    """Missing or wrong bearer token."""


class ValidationError(ControlPlaneError):
    """The server rejected the request body."""


class ServerUnavailableError(ControlPlaneError):
    """The server could not be reached (after retries)."""


class StoreError(MxError):
    """A store backend (SQLite or Redis) failed."""


class StorageReadError(MxError):
    """Reading a checkpoint from storage (a directory, an S3-compatible store) failed: a
    missing object, access denied, a short read, a timeout. The message names the URL,
    the object and what to do; nothing read before the failure is kept as loaded."""


class OutputError(MxError):
    """Writing an output (a pulled checkpoint) failed; nothing was left under its name.

    Attributes:
        errno: the OS error number behind it (``errno.ENOSPC`` for a full disk), or None.
    """

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class OutputExistsError(OutputError):
    """The output already exists; pass ``overwrite`` (``--overwrite``) to replace it."""


class ShmArenaError(MxError):
    """Shared-memory tensor arena failure."""


class ShmSpaceError(ShmArenaError):
    """``/dev/shm`` has too little free space for the requested arena."""


class NoSourceError(MxError):
    """No READY source could serve a pull; the message lists why each was skipped."""


class ServedElsewhereError(MxError):
    """A fetch from zero gave its origin lease back without reading storage: the model
    turned READY in another form meanwhile (``fetch(elsewhere=...)``); the caller pulls
    that form instead."""


class LayoutUnavailableError(MxError):
    """A model's layout cannot be derived or trusted (a quantized or expert layer, a
    loader that computes from checkpoint values); the message names the tensor and why.
    The model then pulls only from sources of its own layout."""


class ArtifactRefusedError(MxError):
    """A compiled-artifact set was refused: unsigned, a bad signature, a digest mismatch or
    a path outside its root. Nothing of it was installed (modelexpress.artifacts)."""


class WeightUpdateError(MxError):
    """An RL weight update (``mx`` weight-transfer backend) failed; the engines named in the
    message kept their previous weights."""
