"""A source process serving one tensor-parallel rank's loaded form with its layout.

``python -m layout_source MODEL_DIR TP RANK FAMILY WORKER [--lie] [--dtype D]`` (``tests/engines`` and
``tests/p2p`` on ``PYTHONPATH``): loads rank ``RANK`` of ``TP`` with vLLM's real model
class and disk loader in this process (``vllm_layouts.load_rank``: the layout derived by
vLLM's own weight loaders, block digests hashed from the checkpoint as it streamed),
serves the tensors over NIXL and the local transport (``MX_IPC_DIR``) with the layout
beside the manifest, prints one JSON line (``source_id``) and serves until SIGTERM.

``--lie`` publishes a layout that swaps where layer 0's k and v lie in its qkv tensor,
while the bytes stay right: a layout that disagrees with the bytes it describes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import signal
import sys
import threading

LAYOUT_MODEL = "layout-tests/tiny-llama"


def identity(tp: int, rank: int, family: str, dtype: str = "float32"):  # noqa: ANN201
    from modelexpress.identity import ModelIdentity

    return ModelIdentity(model=LAYOUT_MODEL, dtype=dtype, tp_size=tp, rank=rank,
                         extra=(("test", family),))


def lying(layout):  # noqa: ANN001, ANN201
    pieces = list(layout.pieces)
    k = next(i for i, p in enumerate(pieces) if p.ckpt.endswith("0.self_attn.k_proj.weight"))
    v = next(i for i, p in enumerate(pieces) if p.ckpt.endswith("0.self_attn.v_proj.weight"))
    pieces[k], pieces[v] = (dataclasses.replace(pieces[k], dst=pieces[v].dst),
                            dataclasses.replace(pieces[v], dst=pieces[k].dst))
    return dataclasses.replace(layout, pieces=tuple(pieces))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=pathlib.Path)
    parser.add_argument("tp", type=int)
    parser.add_argument("rank", type=int)
    parser.add_argument("family")
    parser.add_argument("worker")
    parser.add_argument("--lie", action="store_true")
    parser.add_argument("--dtype", default="float32", help="vLLM's --dtype")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from vllm_layouts import load_rank

    from modelexpress.client import MxClient
    from modelexpress.local import LocalOptions, host_buffer_like
    from modelexpress.p2p import serve_source
    from modelexpress.settings import MxSettings

    tensors, layout = load_rank(args.model_dir, args.tp, args.rank, dtype=args.dtype)
    if args.lie:
        layout = lying(layout)
    settings = MxSettings.load()
    buf, shared = host_buffer_like(tensors, name="mx-layout-source")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with MxClient.from_settings(settings) as client, serve_source(
            identity(args.tp, args.rank, args.family, args.dtype), shared, client=client,
            worker_id=args.worker, heartbeat_interval_s=settings.heartbeat_interval_s,
            local=LocalOptions.from_settings(settings), host_buffers=(buf,),
            layout=layout.to_json()) as handle:
        print(json.dumps({"source_id": handle.source_id}), flush=True)
        stop.wait(600)


if __name__ == "__main__":
    main()
