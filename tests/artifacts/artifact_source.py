"""A real artifact source for the tests: pack a directory, sign, publish, serve until SIGTERM.

``python -m artifact_source --server URL --token T --root DIR --key KEY [--tamper]
[--fact k=v ...] [--model NAME]`` prints one JSON line ``{"source_id": ...}`` once
READY. ``--tamper`` flips one byte of the blob *after* the set was signed (a file
changed at the source after its digest was taken); ``--fact`` states other facts in
the signed set than the identity says (a source of another version).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import signal
import sys
import threading

from modelexpress.artifacts import ArtifactKey, InstallUnit, pack_files, serve_packed
from modelexpress.client import MxClient
from modelexpress.identity import ModelIdentity
from modelexpress.local import LocalOptions


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--token", default=None)
    p.add_argument("--root", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--model", default="artifact-test")
    p.add_argument("--tamper", action="store_true")
    p.add_argument("--fact", action="append", default=[])
    p.add_argument("--ipc-dir", default="off")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    facts = dict(f.split("=", 1) for f in a.fact)
    identity = ModelIdentity(model=a.model, extra=(("kind", "artifacts-test"),))
    aset, buf = pack_files({"k": pathlib.Path(a.root)}, [("k", "cache")],
                           units=[InstallUnit("k", "cache/rank_0_0")],
                           prefixes={"cache": "sym:cache"}, facts=facts)
    if a.tamper:
        view = buf.tensor(0, (aset.total_bytes,), __import__("torch").uint8)
        view[aset.files[0].offset] ^= 0xFF
        del view
    client = MxClient(a.server, token=a.token, timeout_s=10.0, retries=1)
    handle = serve_packed(identity, aset, buf, key=ArtifactKey(a.key.encode()), client=client,
                          local=LocalOptions(ipc_dir=a.ipc_dir), heartbeat_interval_s=0.5)
    print(json.dumps({"source_id": handle.source_id, "identity": identity.id,
                      "files": len(aset.files), "bytes": aset.total_bytes}), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait(600)
    handle.close()
    client.close()


if __name__ == "__main__":
    main()
