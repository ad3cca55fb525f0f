"""NIXL data plane: registration strategies, coalesced chunked READ, integrity, transports.

Importing this package does not import NIXL or torch; they load on first use.
``nixl_adapter`` is the only module that touches NIXL names.
"""

from __future__ import annotations

from modelexpress.transfer.digest import ALGORITHMS, BLAKE2B, WSUM, XXH3, XXH3_BLOCKS
from modelexpress.transfer.manager import (
    NixlTransferManager,
    ProgressCallback,
    RegistrationInfo,
    StopSignal,
    TransferResult,
)
from modelexpress.transfer.manifest import Manifest, TensorEntry, build_manifest
from modelexpress.transfer.planner import ReadPlan, plan_read
from modelexpress.transfer.registration import Strategy, choose_arena_strategy
from modelexpress.transfer.transport import (
    FLOORS_GBPS,
    UNKNOWN,
    TransportVerdict,
    UcxLogFacts,
    assess,
    expected_transport,
)
from modelexpress.transfer.ucx_report import parse_ucx_log, read_ucx_log, ucx_proto_info_env

__all__ = [
    "ALGORITHMS",
    "BLAKE2B",
    "WSUM",
    "XXH3",
    "XXH3_BLOCKS",
    "FLOORS_GBPS",
    "Manifest",
    "NixlTransferManager",
    "ProgressCallback",
    "ReadPlan",
    "RegistrationInfo",
    "StopSignal",
    "Strategy",
    "TensorEntry",
    "TransferResult",
    "TransportVerdict",
    "UNKNOWN",
    "UcxLogFacts",
    "assess",
    "build_manifest",
    "choose_arena_strategy",
    "expected_transport",
    "parse_ucx_log",
    "plan_read",
    "read_ucx_log",
    "ucx_proto_info_env",
]
