"""A target process for the transport tests: it needs its own UCX environment
(``UCX_PROTO_INFO``, ``UCX_LOG_FILE``, ``UCX_TLS``), read when its agent starts.

stdin: JSON {"metadata": base64, "manifest": json, "refuse": bool, "ucx_log": path}
Answers one JSON line on the original stdout.
"""

from __future__ import annotations

import base64
import json
import os
import sys

_PROTO = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # NIXL/UCX print to fd 1

sys.path.insert(0, os.path.dirname(__file__))
import layouts  # noqa: E402

from modelexpress.errors import TransferError  # noqa: E402
from modelexpress.transfer import Manifest, NixlTransferManager  # noqa: E402


def main() -> int:
    spec = json.loads(sys.stdin.read())
    manifest = Manifest.from_json(spec["manifest"])
    _, local = layouts.carve("", filled=False, specs=layouts.specs_of(manifest))
    out: dict = {}
    with NixlTransferManager(ucx_log_file=spec.get("ucx_log")) as mgr:
        mgr.add_peer(base64.b64decode(spec["metadata"]))
        try:
            r = mgr.read(manifest, local, refuse_slow_transport=spec.get("refuse", False),
                         deadline_s=120)
            out = {"transport": r.transport, "ok": r.verdict.ok, "message": r.verdict.message,
                   "observed": list(r.verdict.observed), "expected": r.verdict.expected,
                   "warnings": list(r.warnings), "gbps": r.gbps}
        except TransferError as exc:
            out = {"error": type(exc).__name__, "message": str(exc)}
    _PROTO.write(json.dumps(out) + "\n")
    _PROTO.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
