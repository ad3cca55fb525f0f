"""Checkpoints in storage (a directory, an S3-compatible store), read in ranges into memory.

The last link of a model's journey to a worker, and the first of a fleet that scales
from zero (DESIGN.md, "From zero"): :func:`open_storage` picks the backend from a URL,
:func:`read_layout` learns every tensor from the safetensors headers, and
:class:`StorageReader` fills destination tensors in order while advancing a watermark,
so a loading origin can serve each piece as it lands.
"""

from modelexpress.storage.base import Storage, StorageOptions, StoredFile, redact
from modelexpress.storage.open import open_storage
from modelexpress.storage.layout import CheckpointLayout, TensorSpan, read_layout
from modelexpress.storage.reader import StorageReader, range_bytes_for, read_checkpoint

__all__ = ["Storage", "StorageOptions", "StoredFile", "open_storage", "redact",
           "CheckpointLayout", "TensorSpan", "read_layout", "StorageReader",
           "range_bytes_for", "read_checkpoint"]
