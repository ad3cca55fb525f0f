"""The storage a URL names: :func:`open_storage` (the backends: :mod:`.base`)."""

from __future__ import annotations

import re

from modelexpress.errors import ConfigError
from modelexpress.storage.base import Storage, StorageOptions, redact

__all__ = ["open_storage"]


def open_storage(url: str, options: StorageOptions | None = None) -> Storage:
    """The storage ``url`` names: ``s3://bucket/prefix`` or a local path (``file://``
    prefix optional).

    Raises:
        ConfigError: an unknown scheme or a malformed S3 URL.
        DependencyError: boto3 is missing for an S3 URL (the ``s3`` extra).
    """
    opts = options or StorageOptions()
    if url.startswith("s3://"):
        from modelexpress.storage.s3 import S3Storage

        return S3Storage(url, opts)
    if url.startswith("file://"):
        url = url[len("file://"):]
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", url):
        raise ConfigError(f"unsupported storage URL {redact(url)!r}; use s3://BUCKET/PREFIX "
                          "or a local checkpoint directory")
    from modelexpress.storage.directory import DirectoryStorage

    return DirectoryStorage(url, opts)
