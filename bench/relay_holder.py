"""What relaying costs a pull that starts alone: a holder pull vs a plain one.

A vLLM engine's pull is a fleet-relay holder (``relay_read`` + ``relay_serve``, from
``MX_RELAY``): it reads through the relay reader and publishes, then withdraws, a
relay source of its own, with its own NIXL agent, on the load's critical path, even
when no other engine starts with it. This measures that price against a plain pull
of the same source in the same run: a real server (uvicorn on 127.0.0.1, SQLite), one
source in this process (``serve_source``), pulls over NIXL (the local transport off:
an origin on another host; a same-host origin is copied and not relayed), rounds
interleaving the two kinds, medians and their ratio.

Usage: python bench/relay_holder.py [--mib 64] [--tensors 16] [--rounds 5] [--quick]
Prints one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "server"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="model size in MiB")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="8 MiB, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.mib, args.rounds = 8, 2

    import torch
    from mx_server_procs import TOKEN, ServerProc

    from modelexpress.client import MxClient
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p import PullOptions, pull, serve_source
    from modelexpress.settings import MxSettings

    work = pathlib.Path(tempfile.mkdtemp(prefix="mx-bench-relay-holder-"))
    server = ServerProc(f"sqlite:///{work / 'mx.db'}", work).start()
    seconds: dict[str, list[float]] = {"plain": [], "holder": []}
    try:
        with MxClient(server.url, token=TOKEN, timeout_s=30) as client:
            ident = ModelIdentity(model="bench-relay-holder", dtype="float32")
            numel = (args.mib << 20) // 4 // args.tensors
            tensors = {f"w{i}": torch.randn(numel) for i in range(args.tensors)}
            handle = serve_source(ident, tensors, client=client, heartbeat_interval_s=1.0)
            try:
                for r in range(args.rounds):
                    # alternate which goes first, so neither always meets a warmer cache
                    kinds = ("plain", "holder") if r % 2 == 0 else ("holder", "plain")
                    for kind in kinds:
                        holder = kind == "holder"
                        opts = PullOptions.from_settings(MxSettings.load(ipc_dir="off"),
                                                         relay_read=holder,
                                                         relay_serve=holder)
                        t0 = time.perf_counter()
                        pull(ident, None, client=client, options=opts)
                        seconds[kind].append(time.perf_counter() - t0)
                        print(f"round {r} {kind}: {seconds[kind][-1]:.3f} s", file=sys.stderr)
            finally:
                handle.close()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    plain, holder = (statistics.median(seconds[k]) for k in ("plain", "holder"))
    print(json.dumps({"bench": "relay_holder", "bytes": args.tensors * numel * 4,
                      "rounds": args.rounds, "plain_s": round(plain, 4),
                      "holder_s": round(holder, 4),
                      "holder_over_plain": round(holder / plain, 3),
                      "holder_extra_s": round(holder - plain, 4),
                      "all_s": {k: [round(x, 4) for x in v] for k, v in seconds.items()}}))


if __name__ == "__main__":
    main()
