"""A target process that reads from a source of its own, kills it, and reads again.

It starts a source (``_peer.py``, chunky layout), reads the manifest whole (connecting),
SIGKILLs and reaps the source, then at once posts a READ of every tensor as one
request of one descriptor each. That READ fails; the process prints ``closed`` and
exits 0 once its agent is torn down. A worker torn down with READs still queued
aborts instead (UCX assertion), so the exit status is the verdict. The source is this
process's child because the abort needs the READ posted right after the source is
reaped; a source the test reaps later (a zombie meanwhile) did not show it.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
import layouts  # noqa: E402

from modelexpress.errors import PeerError  # noqa: E402
from modelexpress.transfer import Manifest, NixlTransferManager  # noqa: E402

_BOUND_S = 30.0


def main() -> int:
    src = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "_peer.py")],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        src.stdin.write(json.dumps({"kinds": ["chunky"]}) + "\n")
        src.stdin.flush()
        if not select.select([src.stdout], [], [], 120.0)[0]:
            print("the source did not publish within 120 s", flush=True)
            return 2
        return read_killed(src, json.loads(src.stdout.readline()))
    finally:
        if src.poll() is None:
            src.kill()
        src.wait(_BOUND_S)


def read_killed(src: subprocess.Popen, out: dict) -> int:
    manifest = Manifest.from_json(out["manifests"]["chunky"])
    _, local = layouts.carve("", filled=False, specs=layouts.specs_of(manifest))
    with NixlTransferManager() as mgr:
        mgr.add_peer(base64.b64decode(out["metadata"]))
        mgr.read(manifest, local, coalesce=False, chunk_bytes=4 << 20)
        src.kill()
        src.wait(_BOUND_S)
        try:
            mgr.read(manifest, local, coalesce=False, chunk_bytes=manifest.total_bytes + 1,
                     max_inflight=1, deadline_s=_BOUND_S)
        except PeerError:
            pass
        else:
            print("the READ of a killed source succeeded", flush=True)
            return 3
    print("closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
