"""Peer-to-peer weight serving: sources publish, targets pull, agents run REST transfers.

Importing this package does not import torch or NIXL; they load on first use.
"""

from __future__ import annotations

from modelexpress.p2p.manifests import allocate_like, manifest_of
from modelexpress.p2p.options import PullOptions
from modelexpress.p2p.readers import (AgentStart, HeldReader, NixlReader, ReaderFactory,
                                      SourceReader)
from modelexpress.p2p.result import PHASES, PullResult, SkippedSource
from modelexpress.p2p.selection import POLICIES
from modelexpress.p2p.source import SourceHandle, default_worker_id, serve_source
from modelexpress.p2p.target import pull
from modelexpress.p2p.tracking import RateCap, TransferTracker, outcome_of

__all__ = [
    "AgentStart",
    "HeldReader",
    "NixlReader",
    "PHASES",
    "POLICIES",
    "PullOptions",
    "PullResult",
    "ReaderFactory",
    "RateCap",
    "SkippedSource",
    "SourceHandle",
    "SourceReader",
    "TransferTracker",
    "allocate_like",
    "default_worker_id",
    "manifest_of",
    "outcome_of",
    "pull",
    "serve_source",
]
