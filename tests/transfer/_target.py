"""A target process for the transport tests: it needs its own UCX environment
(``UCX_TLS``, ``UCX_PROTO_INFO``, ``UCX_LOG_FILE``), read when its first agent starts.

stdin: JSON {"sources": [{"metadata": base64, "manifest": json}, ...], "repeat": int,
             "refuse": bool, "parallel": bool}
Reads every source ``repeat`` times with one manager, in order, or (``parallel``)
each source once, all at the same time from one thread each. Answers one JSON line
on the original stdout: {"pid": int, "reads": [{...result...} | {"error": ...}]}.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
import threading

_PROTO = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # NIXL/UCX print to fd 1

sys.path.insert(0, os.path.dirname(__file__))
import layouts  # noqa: E402

from modelexpress.errors import TransferError  # noqa: E402
from modelexpress.transfer import Manifest, NixlTransferManager  # noqa: E402


def _read(mgr: NixlTransferManager, manifest: Manifest, local: dict, refuse: bool) -> dict:
    try:
        r = mgr.read(manifest, local, deadline_s=120, refuse_slow_transport=refuse)
    except TransferError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"peer": r.peer, "transport": r.transport,
            "expected_transport": r.expected_transport,
            "transport_detail": r.transport_detail, "ok": r.verdict.ok,
            "message": r.verdict.message, "observed": list(r.verdict.observed),
            "expected": r.verdict.expected, "warnings": list(r.warnings), "gbps": r.gbps,
            "correct": all(layouts.same_bytes(local[n], t)
                           for n, t in layouts.expected(manifest).items())}


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.loads(sys.stdin.read())
    refuse = spec.get("refuse", False)
    reads: list[dict] = []
    with NixlTransferManager() as mgr:
        jobs = []
        for source in spec["sources"]:
            manifest = Manifest.from_json(source["manifest"])
            _, local = layouts.carve("", filled=False, specs=layouts.specs_of(manifest))
            mgr.register_tensors(local)
            mgr.add_peer(base64.b64decode(source["metadata"]))
            jobs.append((manifest, local))
        if spec.get("parallel"):
            reads = [{}] * len(jobs)

            def run(i: int) -> None:
                reads[i] = _read(mgr, *jobs[i], refuse)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
        else:
            for manifest, local in jobs:
                reads.extend(_read(mgr, manifest, local, refuse)
                             for _ in range(spec.get("repeat", 1)))
    _PROTO.write(json.dumps({"pid": os.getpid(), "reads": reads}) + "\n")
    _PROTO.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
