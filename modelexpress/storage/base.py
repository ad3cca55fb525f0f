"""Where a checkpoint is stored: the :class:`Storage` interface and its options.

A storage is read in byte ranges of its ``*.safetensors`` files, many at once, each
range straight into the caller's memory (:class:`~.reader.StorageReader` decides which
ranges and in what order). Two backends, chosen by the URL (:func:`~.open.open_storage`):

==========================  ==============================================================
``/path/to/checkpoint``     :class:`~.directory.DirectoryStorage`: ``pread`` of local files
``s3://bucket/prefix``      :class:`~.s3.S3Storage`: ranged GETs (boto3) from S3 or any
                            S3-compatible store; endpoint and credentials from the usual
                            AWS variables (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``,
                            ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``)
==========================  ==============================================================

Every failure is a :class:`~modelexpress.errors.StorageReadError` (or a
:class:`~modelexpress.errors.CheckpointError` for a file that is not what its header
says) with one line that names the URL and what to do.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from modelexpress.errors import ConfigError

if TYPE_CHECKING:
    from modelexpress.settings import MxSettings

__all__ = ["Storage", "StoredFile", "StorageOptions", "redact"]


@dataclasses.dataclass(frozen=True)
class StoredFile:
    """One ``*.safetensors`` file of a stored checkpoint.

    Attributes:
        name: its name relative to the checkpoint (what :meth:`Storage.read` takes).
        size: its size in bytes.
    """

    name: str
    size: int


@dataclasses.dataclass(frozen=True)
class StorageOptions:
    """How a checkpoint is read from storage (``MX_STORAGE_*``).

    Attributes:
        concurrency: ranges read at once (``MX_STORAGE_CONCURRENCY``).
        range_bytes: the largest range, one request each (``MX_STORAGE_RANGE_BYTES``;
            a small model's ranges are smaller, so that its served prefix grows
            smoothly: :func:`~.reader.range_bytes_for`).
        timeout_s: one request's connect and read timeout (``MX_STORAGE_TIMEOUT_S``): a
            slow endpoint that sends nothing for this long fails the read.

    Raises:
        ConfigError: a value out of range.
    """

    concurrency: int = 8
    range_bytes: int = 8 << 20
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        bad = [f"{name} must be {rule} (got {value!r})" for name, value, ok, rule in (
            ("concurrency", self.concurrency, 1 <= self.concurrency <= 256, "1..256"),
            ("range_bytes", self.range_bytes, self.range_bytes >= 4096, ">= 4096"),
            ("timeout_s", self.timeout_s, self.timeout_s > 0, "> 0"),
        ) if not ok]
        if bad:
            raise ConfigError("; ".join(bad))

    @classmethod
    def from_settings(cls, settings: "MxSettings") -> "StorageOptions":
        """``MX_STORAGE_CONCURRENCY``, ``MX_STORAGE_RANGE_BYTES``, ``MX_STORAGE_TIMEOUT_S``."""
        return cls(concurrency=settings.storage_concurrency,
                   range_bytes=settings.storage_range_bytes,
                   timeout_s=settings.storage_timeout_s)


@runtime_checkable
class Storage(Protocol):
    """A stored checkpoint, read in byte ranges. Thread-safe: ranges are read at once.

    Attributes:
        url: where it is, without credentials (logs, messages, the origin lease).
        bytes_read: body bytes read so far (every :meth:`read`).
    """

    url: str
    bytes_read: int

    def files(self) -> list[StoredFile]:
        """The checkpoint's ``*.safetensors`` files, sorted by name.

        Raises:
            StorageReadError: the listing failed; ConfigError: it holds none.
        """

    def read(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of file ``name`` from ``offset``.

        Raises:
            StorageReadError: fewer bytes than asked, a missing file, denied, timed out.
        """

    def close(self) -> None:
        """Release connections and file descriptors; idempotent."""


def redact(url: str) -> str:
    """``url`` without credentials (``scheme://user:secret@host`` -> ``scheme://***@host``)."""
    return re.sub(r"//[^@/]*@", "//***@", url)
