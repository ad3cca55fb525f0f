"""``python -m modelexpress.engines.vllm.derive``: a rank's layout, for a pull outside vLLM.

``modelexpress pull --layout FILE`` assembles a tensor-parallel rank's loaded form from
sources of other layouts without running vLLM (a CLI pull to disk); the layout it
needs is vLLM's, derived here with vLLM's own weight loaders for the rank asked
(:func:`~modelexpress.engines.vllm.layout.simulated_tensor_parallel`: no process group,
no weights)::

    python -m modelexpress.engines.vllm.derive MODEL_DIR --tp 1 --rank 0 --out layout.json
    modelexpress pull --model MODEL_DIR --tp 1 --rank 0 --layout layout.json --out OUT

``MODEL_DIR`` is what the engines were started with (``--model``; its ``config.json``
is read). The checkpoint's table comes from its safetensors headers when they are
there, else from a READY source of ``MODEL_DIR`` that published a layout
(``--server``, default ``MX_SERVER_URL``). The vLLM installed here must be the
sources' (their identity says which; the pull checks it).

Exit codes: 0 written; 1 the layout cannot be derived (one line: the tensor and why);
2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys

__all__ = ["main"]


def _checkpoint(model: str, server: str | None):  # noqa: ANN202
    from modelexpress.errors import LayoutUnavailableError
    from modelexpress.layout import Layout

    from modelexpress.engines.vllm.layout_blocks import checkpoint_table

    try:
        return checkpoint_table(model)
    except LayoutUnavailableError as headers:
        if not server:
            raise
        from modelexpress.client import MxClient
        from modelexpress.settings import MxSettings

        settings = MxSettings.load().model_copy(update={"server_url": server})
        with MxClient.from_settings(settings) as client:
            for s in client.list_sources(model=model, state="READY"):
                if s.layout_bytes:
                    return Layout.from_json(client.get_source(s.id).layout).checkpoint
        raise LayoutUnavailableError(f"{headers}; and no READY source of {model} on {server} "
                                     "published a layout") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m modelexpress.engines.vllm.derive",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the model directory the engines were started with")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the target")
    parser.add_argument("--rank", type=int, default=0, help="its rank")
    parser.add_argument("--dtype", default="auto", help="vLLM's --dtype of the sources")
    parser.add_argument("--server", help="control plane for the checkpoint table "
                                         "(default MX_SERVER_URL)")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="layout JSON to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not 0 <= args.rank < args.tp:
        parser.error(f"--rank {args.rank} is not in [0, {args.tp})")

    from modelexpress.errors import MxError
    from modelexpress.settings import MxSettings

    server = args.server or MxSettings.load().server_url
    try:
        from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig
        from vllm.model_executor.model_loader import get_model_loader

        from modelexpress.engines.vllm.layout import derive_layout, simulated_tensor_parallel

        checkpoint = _checkpoint(args.model, server)
        mc = ModelConfig(model=args.model, dtype=args.dtype, skip_tokenizer_init=True,
                         enforce_eager=True)
        vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                        load_config=LoadConfig(load_format="auto"),
                        parallel_config=ParallelConfig(tensor_parallel_size=args.tp))
        with simulated_tensor_parallel(args.tp, args.rank):
            layout, _ = derive_layout(vc, mc, checkpoint, get_model_loader(vc.load_config),
                                      tp_size=args.tp, rank=args.rank)
    except MxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    args.out.write_text(json.dumps(layout.to_json()))
    print(json.dumps({"ok": True, "out": str(args.out), "tp_size": args.tp, "rank": args.rank,
                      "tensors": len(layout.tensors), "pieces": len(layout.pieces)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
