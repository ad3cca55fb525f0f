"""A trainer process for the RL weight-sync tests: one weight version from a checkpoint.

``python rl_trainer_proc.py --weights FILE --engine URL [--engine URL] --model RUN
--version V [--crash-after-publish]``. The control plane comes from ``MX_SERVER_URL`` /
``MX_SERVER_TOKEN``, as for any trainer. It holds the checkpoint's tensors under their
checkpoint names (what a Hugging Face trainer holds), goes through vLLM's trainer
factory (``WeightTransferTrainerFactory.trainer_init``, backend ``mx``) and vLLM's HTTP
client, and prints one ``RESULT {json}`` line. ``--crash-after-publish`` publishes the
version, prints ``PUBLISHED {update_info json}`` and waits to be killed: a trainer that
dies between publishing and the engines' pull.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", required=True)
    parser.add_argument("--engine", action="append", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--crash-after-publish", action="store_true")
    args = parser.parse_args()

    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from modelexpress.engines.vllm.plugin import register
    from modelexpress.errors import WeightUpdateError
    from modelexpress.rl import FanOutClient, MxTrainerInitInfo, StateDictSource
    from modelexpress.rl.trainer import held_items

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    register()  # a trainer process loads vLLM's plugins itself (vLLM does so only in engines)
    weights = load_file(args.weights)
    client = FanOutClient([HTTPVLLMWeightSyncClient(url, timeout=120) for url in args.engine])
    engine = WeightTransferTrainerFactory.trainer_init(
        MxTrainerInitInfo(model=args.model, rank=0, update_timeout_s=240),
        client=client, source=StateDictSource(weights))
    if args.crash_after_publish:
        published = engine.pool.publish(args.version, held_items(engine.source, 0))
        print("PUBLISHED " + json.dumps({"version": args.version,
                                         "identities": [published.identity.to_dict()]}),
              flush=True)
        time.sleep(600)
        return 1
    try:
        report = engine.send_weights(args.version)
    except WeightUpdateError as exc:
        print("RESULT " + json.dumps({"ok": False, "error": str(exc)}), flush=True)
        return 2
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps({"ok": True, "version": report.version,
                                  "engine_seconds": report.engine_seconds,
                                  "seconds": report.seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
