"""Peer-to-peer weight serving: sources publish, targets pull, agents run REST transfers.

Importing this package does not import torch or NIXL; they load on first use.
"""

from __future__ import annotations

from modelexpress.p2p.selection import POLICIES
from modelexpress.p2p.source import SourceHandle, default_worker_id, serve_source
from modelexpress.p2p.target import PullResult, SkippedSource, allocate_like, manifest_of, pull

__all__ = [
    "POLICIES",
    "PullResult",
    "SkippedSource",
    "SourceHandle",
    "allocate_like",
    "default_worker_id",
    "manifest_of",
    "pull",
    "serve_source",
]
