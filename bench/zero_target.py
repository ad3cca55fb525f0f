"""One target of ``bench/cluster.py``'s scale-from-zero case, run inside a namespaced host.

It gets ready first (imports, the control-plane client, the checkpoint's layout from
storage's headers, the destination and the NIXL agent: ``ZeroFetch.prepare``), prints
``{"ready": ...}``, waits for the go file, then fetches the model from zero
(``ZeroFetch.run``: from storage as the origin, or from the origin's fleet) and prints
one JSON line with its role, the wall-clock times of the go and of the end, the bytes it
read from storage and a digest of every byte it holds. So what the bench times is the
fetch of targets started together, not N interpreters importing torch on two cores.

Settings come from the environment (``MX_*`` and the AWS variables), as for any entry
point. Usage: python bench/zero_target.py --model NAME --from URL --go FILE --worker ID
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--from", dest="url", required=True)
    parser.add_argument("--go", type=pathlib.Path, required=True)
    parser.add_argument("--worker", required=True)
    parser.add_argument("--linger-s", type=float, default=30.0)
    args = parser.parse_args()

    import logging

    import torch

    from modelexpress.client import MxClient
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p.options import PullOptions
    from modelexpress.p2p.zero import ZeroFetch
    from modelexpress.settings import MxSettings
    from modelexpress.storage import open_storage, read_layout

    settings = MxSettings.load()
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = PullOptions.from_settings(settings, relay_read=True, relay_serve=True)
    client = MxClient.from_settings(settings)
    storage = open_storage(args.url, options.storage)
    layout = read_layout(storage)
    identity = ModelIdentity(model=args.model, dtype=layout.tensors[0].dtype)
    samples: list[tuple[float, int]] = []

    def progress(done: int, _total: int) -> None:  # a sample every 0.5 s: where time went
        now = time.time()
        if not samples or now - samples[-1][0] >= 0.5:
            samples.append((now, done))

    fetch = ZeroFetch(identity, storage, layout, client, options, args.worker,
                      progress=progress).prepare()
    print(json.dumps({"ready": True, "pid": os.getpid(), "worker": args.worker}), flush=True)
    end = time.monotonic() + 600
    while not args.go.exists():
        if time.monotonic() > end:
            raise SystemExit("no go file after 600 s")
        time.sleep(0.005)
    go = time.time()
    result = fetch.run()
    done = time.time()
    digest = hashlib.sha256()
    for t in result.tensors.values():
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    print(json.dumps({"ok": True, "worker": args.worker, "role": result.role, "go": go,
                      "end": done, "seconds": round(done - go, 3),
                      "storage_bytes": result.storage_bytes, "took_over": result.took_over,
                      "rounds": result.rounds, "verified": result.verified,
                      "sha256": digest.hexdigest(),
                      "progress": [(round(t - go, 2), n) for t, n in samples]}), flush=True)
    result.release(args.linger_s)
    storage.close()
    client.close()


if __name__ == "__main__":
    main()
