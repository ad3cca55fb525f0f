"""Simulated fleet scale-up: the server's relay planner over modelled links, N up to 1000s.

The planner is the product's (:func:`modelexpress.p2p.relay_plan.assign`, called with
the holders a claim would see); what is modelled is the data plane:

* one origin and ``N`` targets, every transfer created at ``t = 0`` and claimed in
  order; each link ``--link`` Mbit/s each way (the origin's ``--origin-link``);
* a model of ``--bytes`` in ``K = bytes / --chunk`` chunks; a target reads its chunks
  in order from its upstream, a chunk only once the upstream holds it and has
  advertised it (``--advert-ms`` after it landed: one hop's lag, whatever it is made
  of; calibrated against bench/cluster.py, docs/benchmarks.md "Fleet relay");
* a holder's uplink is shared equally by the chunks being read from it, and a
  target's downlink caps its read; each chunk read costs ``--chunk-overhead-ms``
  (request, connect, digest) before its bytes flow;
* ``--fail F``: a fraction ``F`` of the targets die at a uniform random time in
  ``[0, T1]``; a reader of a dead holder notices after ``--stall-s`` and reads the
  chunks it misses from the next live holder on its path (the origin last), keeping
  what it has; holders on the path already known dead are skipped at once, and a
  live holder that advertises nothing new for ``2 x --stall-s`` is given up too (the
  agent's rules, ``modelexpress/p2p/relay.py``).

Prints one line per N (time to the last live target, its ratio to ``T1`` (one model
over one link), the fan-out the planner chose, the origin's bytes in models), then
one JSON object on the last line.

With ``--fanout auto`` the fan-out is the server's choice
(:func:`~modelexpress.p2p.relay_plan.choose_fanout`, with the server's hop lag
``relay_plan.HOP_CHUNKS`` unless ``--hop-chunks`` says otherwise).

Usage: python bench/fleet_sim.py [--n 1,2,4,8,16,64,256,1000] [--link 400]
       [--bytes 90.9e6] [--chunk 2097152] [--fanout auto|R] [--hop-chunks H]
       [--fail 0.0] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from typing import Any

from modelexpress.p2p.relay_plan import (HOP_CHUNKS, Holder, assign, choose_fanout,
                                         source_ref, transfer_ref)


class _Target:
    def __init__(self, index: int) -> None:
        self.ref = transfer_ref(str(index))
        self.path: tuple[str, ...] = ()
        self.have = 0            # chunks held (a prefix)
        self.landed: list[float] = []  # time chunk i landed
        self.holder = 0          # index into path being read
        self.left = 0.0          # bytes of the chunk in flight
        self.overhead = 0.0      # seconds before the chunk's bytes flow
        self.waiting_since: float | None = None
        self.dead_at = math.inf
        self.done_at: float | None = None


def simulate(n: int, *, model_bytes: float, chunk_bytes: float, link_mbit: float,
             origin_mbit: float, fanout: int | None, advert_s: float, overhead_s: float,
             fail: float, stall_s: float, seed: int,
             hop_chunks: float = HOP_CHUNKS) -> dict[str, Any]:
    """One scale-up of ``n`` targets; see the module docstring for the model."""
    rng = random.Random(seed)
    chunks = max(1, math.ceil(model_bytes / chunk_bytes))
    per_chunk = model_bytes / chunks
    link = link_mbit * 1e6 / 8
    origin_up = origin_mbit * 1e6 / 8
    t1 = model_bytes / link
    origin = source_ref("origin")
    r = fanout or choose_fanout(n, chunks, hop_chunks=hop_chunks)
    targets = [_Target(i) for i in range(n)]
    readers: dict[str, int] = {origin: 0}
    holders = [Holder(origin, True, uplink_mbit=origin_mbit)]
    for t in targets:  # claims, in order, as the server would see them
        live = [Holder(h.ref, h.complete, readers.get(h.ref, 0), h.path, h.uplink_mbit)
                for h in holders]
        a = assign(live, fanout=r, downlink_mbit=link_mbit)
        t.path = a.path
        readers[a.upstream] = readers.get(a.upstream, 0) + 1
        holders.append(Holder(t.ref, False, path=a.path, uplink_mbit=link_mbit))
    by_ref = {t.ref: t for t in targets}
    if fail > 0:
        for t in rng.sample(targets, int(round(fail * n))):
            t.dead_at = rng.uniform(0, t1)
    sent = {origin: 0.0}
    dt = min(per_chunk / link / 8, 0.01)
    now = 0.0

    def visible(ref: str, at: float) -> int:
        """Chunks ``ref`` has advertised by ``at`` (all for the origin); -1 when dead."""
        if ref == origin:
            return chunks
        h = by_ref[ref]
        if at >= h.dead_at:
            return -1
        return sum(1 for x in h.landed if x + advert_s <= at)

    limit = 1000 * t1 + 100
    while now < limit:
        active = [t for t in targets if t.done_at is None and now < t.dead_at]
        if not active:
            break
        flows: dict[str, list[_Target]] = {}
        for t in active:
            ref = t.path[t.holder]
            seen = visible(ref, now)
            # A dead holder is noticed after stall_s (the READ lands nothing); a live one
            # that advertises nothing new for 2 x stall_s is given up too (it gets its
            # own stall_s to recover from a dead upstream first: no cascade).
            if seen < 0 or (t.waiting_since is not None and ref != origin
                            and now - t.waiting_since > 2 * stall_s):
                if t.waiting_since is None:
                    t.waiting_since = now
                if seen >= 0 or now - t.waiting_since >= stall_s:
                    t.holder += 1
                    while visible(t.path[t.holder], now) < 0:  # known dead: skipped at once
                        t.holder += 1
                    t.waiting_since, t.left, t.overhead = None, 0.0, 0.0
                continue
            if t.left <= 0:
                if seen > t.have:
                    t.left, t.overhead, t.waiting_since = per_chunk, overhead_s, None
                else:
                    if t.waiting_since is None:
                        t.waiting_since = now
                    continue
            if t.overhead > 0:
                t.overhead -= dt
                continue
            flows.setdefault(ref, []).append(t)
        for ref, readers_now in flows.items():
            up = origin_up if ref == origin else link
            rate = min(up / len(readers_now), link)
            for t in readers_now:
                moved = min(rate * dt, t.left)
                t.left -= moved
                sent[ref] = sent.get(ref, 0.0) + moved
                if t.left <= 1e-9:
                    t.left = 0.0
                    t.have += 1
                    t.landed.append(now + dt)
                    if t.have == chunks:
                        t.done_at = now + dt
        now += dt
    finished = [t.done_at for t in targets if t.done_at is not None]
    alive = [t for t in targets if t.dead_at == math.inf]
    last = max(finished) if finished and all(t.done_at is not None for t in alive) else None
    return {"n": n, "chunks": chunks, "fanout": r, "t1_s": round(t1, 3),
            "last_s": None if last is None else round(last, 3),
            "ratio": None if last is None else round(last / t1, 3),
            "origin_models": round(sent[origin] / model_bytes, 3),
            "failed": sum(1 for t in targets if t.dead_at < math.inf)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="1,2,4,8,16,64,256,1000")
    p.add_argument("--link", type=float, default=400.0, help="Mbit/s each way per target")
    p.add_argument("--origin-link", type=float, default=None, help="origin uplink (default --link)")
    p.add_argument("--bytes", type=float, default=90.9e6)
    p.add_argument("--chunk", type=float, default=float(2 << 20))
    p.add_argument("--fanout", default="auto")
    p.add_argument("--hop-chunks", type=float, default=HOP_CHUNKS,
                   help="the planner's idea of a hop's lag in chunks (default: the server's, "
                        "relay_plan.HOP_CHUNKS) for --fanout auto")
    p.add_argument("--advert-ms", type=float, default=20.0)
    p.add_argument("--chunk-overhead-ms", type=float, default=5.0)
    p.add_argument("--fail", type=float, default=0.0)
    p.add_argument("--stall-s", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rows = []
    for n in (int(x) for x in args.n.split(",")):
        row = simulate(n, model_bytes=args.bytes, chunk_bytes=args.chunk, link_mbit=args.link,
                       origin_mbit=args.origin_link or args.link,
                       fanout=None if args.fanout == "auto" else int(args.fanout),
                       advert_s=args.advert_ms / 1e3, overhead_s=args.chunk_overhead_ms / 1e3,
                       fail=args.fail, stall_s=args.stall_s, seed=args.seed,
                       hop_chunks=args.hop_chunks)
        rows.append(row)
        print(f"N={n:5d} fanout={row['fanout']} last={row['last_s']} s "
              f"({row['ratio']} x T1) origin sent {row['origin_models']} models",
              file=sys.stderr, flush=True)
    print(json.dumps({"params": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
