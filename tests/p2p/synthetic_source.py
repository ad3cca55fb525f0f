"""A source process serving one rank of the hand-written layouts of ``synthetic_layout``.

``python -m synthetic_source TP RANK DEVICE WORKER`` (``tests/p2p`` on ``PYTHONPATH``):
assembles rank ``RANK`` of ``TP`` from the seeded checkpoint in one allocation on
``DEVICE`` (``cpu``: a memfd-backed buffer the local transport shares; ``cuda:N``: one
slab, one CUDA IPC handle), hashes the checkpoint blocks it holds on that device,
serves the tensors over NIXL and the local transport (``MX_IPC_DIR``) with the layout
beside the manifest, prints one JSON line (``source_id``) and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tp", type=int)
    parser.add_argument("rank", type=int)
    parser.add_argument("device")
    parser.add_argument("worker")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import synthetic_layout as syn

    from modelexpress.checkpoint import allocate_shared, allocate_slab
    from modelexpress.client import MxClient
    from modelexpress.local import LocalOptions
    from modelexpress.p2p import serve_source
    from modelexpress.settings import MxSettings

    ckpt = syn.checkpoint()
    lay = syn.layout(args.tp, args.rank)
    buffers = ()
    if args.device == "cpu":
        buf, tensors = allocate_shared(syn.specs(lay))
        buffers = (buf,)
    else:
        tensors = allocate_slab(syn.specs(lay), args.device)
    syn.assemble(lay, ckpt, tensors)
    lay = syn.with_blocks(lay, ckpt, args.device)
    settings = MxSettings.load()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with MxClient.from_settings(settings) as client, serve_source(
            syn.identity(args.tp, args.rank), tensors, client=client, worker_id=args.worker,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            local=LocalOptions.from_settings(settings), host_buffers=buffers,
            layout=lay.to_json()) as handle:
        print(json.dumps({"source_id": handle.source_id}), flush=True)
        stop.wait(600)


if __name__ == "__main__":
    main()
