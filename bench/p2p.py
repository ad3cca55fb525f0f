"""End-to-end P2P pull through the control plane, against memcpy and disk in the same run.

What runs (all real, on loopback): ``python -m modelexpress.server`` (SQLite), one
or two ``modelexpress publish`` source processes serving a generated checkpoint with
Llama-3-8B-shaped tensors (random bf16 values), and this process as the target,
which calls ``modelexpress.p2p.pull`` (source lookup, manifest validation, NIXL READ,
digest verification) and then compares every byte with the checkpoint on disk.

Baselines, measured in this run on the same bytes:
  * ``gbps_memcpy``: one copy of a buffer of the checkpoint's size (CPU: host memcpy
    between two touched buffers; ``--gpu``: GPU0 -> GPU1 peer copy);
  * ``gbps_disk_warm`` / ``gbps_disk_cold``: loading the same safetensors into memory
    (``--gpu``: onto the target GPU) with the page cache warm, and after dropping it
    with POSIX_FADV_DONTNEED (as cold as the kernel allows without root).

``gbps_p2p`` is the data-plane rate (first chunk posted to last byte landed) of a
pull by a fresh NIXL agent, as a new worker does it (best of several), after the
4 KiB READ that opens the source's memory (``connect_seconds_first``: the peer
copy baseline likewise runs once untimed before it is measured);
``gbps_p2p_first`` the very first such pull; ``gbps_p2p_warm_agent`` the same pull
through one long-lived agent whose UCX context already mapped the peer's memory;
``gbps_p2p_end_to_end`` adds source lookup, manifest fetch, registration and
validation; digest verification is reported separately. With ``--sources 2`` a
striped pull from both sources is measured too (``gbps_p2p_striped``).

``--small`` measures instead the fixed cost of a small pull (the all-MiniLM-L6-v2
checkpoint the demo serves, 90.9 MB): ``--runs`` ``modelexpress pull`` commands,
each a fresh process as a user runs it (``small_command_s``: the command's wall time;
``small_pull_s`` the ``pull()`` call inside it, with ``small_phases``: imports,
control plane, agent, registration, peer metadata, connect READ, data plane, close;
see ``PullResult.phases``), the same pull from a process that pulled before
(``small_warm_pull_s``, ``small_warm_phases``: the per-pull cost once torch and UCX
are loaded), and a REST transfer run by a ``modelexpress agent`` started beforehand
(``small_rest_transfer_s``: start to SUCCEEDED, as ``./dev demo`` shows it;
``small_rest_first_s`` the agent's first);
``small_disk_warm_s`` loads the same checkpoint from a warm page cache. Medians.

Usage: python bench/p2p.py [--quick] [--gpu] [--layers N] [--sources 1|2]
       python bench/p2p.py --small [--runs N]
Prints progress lines, then ONE JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modelexpress.client import MxClient

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _start_server(procs: list, work: pathlib.Path, port: int, env: dict[str, str],
                  db: str) -> MxClient:
    """Start the control-plane server (SQLite) into ``procs``; its client once it answers."""
    from modelexpress._subproc import ModuleProcess
    from modelexpress.client import MxClient
    procs.append(ModuleProcess(["modelexpress.server", "--host", "127.0.0.1", "--port",
                                str(port), "--store", f"sqlite:///{work / db}"],
                               work / "server.log", env, cwd=ROOT))
    client = MxClient(f"http://127.0.0.1:{port}", timeout_s=30.0)
    deadline = time.monotonic() + 120
    while True:
        try:
            client.health()
            return client
        except Exception:  # noqa: BLE001 - still starting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memcpy_gbps(nbytes: int, gpu: bool, repeat: int = 3) -> float:
    import torch
    if gpu:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        src.fill_(1)
        dst.copy_(src)
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(1)
            torch.cuda.synchronize(0)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _verify(dest: dict[str, Any], checkpoint: pathlib.Path) -> bool:
    """Every tensor byte-equal to the checkpoint (read lazily, one tensor at a time)."""
    import torch
    from safetensors import safe_open

    from modelexpress.checkpoint import checkpoint_files
    seen = set()
    for file in checkpoint_files(checkpoint):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                ref = f.get_tensor(name)
                got = dest[name]
                if got.device.type != "cpu":
                    ref = ref.to(got.device)
                if got.shape != ref.shape or not torch.equal(got.view(torch.uint8),
                                                             ref.view(torch.uint8)):
                    _say(f"MISMATCH in {name}")
                    return False
                seen.add(name)
    return seen == set(dest)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _median_phases(phases: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(_median([p.get(k, 0.0) for p in phases]), 4) for k in phases[0]}


def _small(runs: int, work: pathlib.Path) -> dict[str, Any]:
    """The fixed cost of a small pull (see the module docstring, ``--small``)."""
    import subprocess

    from modelexpress._subproc import ModuleProcess, clean_env
    from modelexpress.checkpoint import real_model_checkpoint, time_disk_load
    from modelexpress.p2p import PullOptions, pull

    ckpt = real_model_checkpoint()
    model = "sentence-transformers/all-MiniLM-L6-v2"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = clean_env(MX_SERVER_URL=url, MX_LOG_LEVEL="WARNING", PYTHONPATH=pythonpath)
    procs: list[ModuleProcess] = []
    out: dict[str, Any] = {"mode": "small", "model": model, "runs": runs}
    try:
        client = _start_server(procs, work, port, env, "small.db")
        procs.append(ModuleProcess(["modelexpress", "publish", str(ckpt), "--model", model,
                                    "--json", "--worker-id", "small-src"],
                                   work / "source.log", env, cwd=ROOT))
        published = procs[-1].json_line(300)
        out["bytes"] = published["bytes"]
        commands, pulls, phases, commands_json = [], [], [], []
        for i in range(runs):
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "modelexpress", "pull", "--model", model, "--out",
                 str(work / f"out-{i}"), "--json"], env=env, cwd=ROOT, capture_output=True,
                timeout=300, check=True)
            commands.append(time.perf_counter() - t0)
            result = json.loads(done.stdout.decode().strip().splitlines()[-1])
            pulls.append(result["total_seconds"])
            phases.append(result["phases"])
            commands_json.append(result.get("command", {}))
            _say(f"pull command {i}: {commands[-1]:.3f} s, pull() {pulls[-1]:.3f} s, "
                 f"data plane {result['seconds']:.4f} s; phases {result['phases']}")
        out["small_command_s"] = round(_median(commands), 4)
        out["small_pull_s"] = round(_median(pulls), 4)
        out["small_phases"] = _median_phases(phases)
        if commands_json[0]:
            out["small_command"] = _median_phases(commands_json)
        # The same pull from this process, after one pull loaded torch and UCX.
        options = PullOptions(timeout_s=120)
        identity = client.list_sources(state="READY")[0].model_identity
        pull(identity, None, client=client, options=options)
        warm = [pull(identity, None, client=client, options=options) for _ in range(runs)]
        out["small_warm_pull_s"] = round(_median([r.total_seconds for r in warm]), 4)
        out["small_warm_phases"] = _median_phases([dict(r.phases) for r in warm])
        out["small_data_plane_s"] = round(_median([r.seconds for r in warm]), 4)
        _say(f"warm process: pull() {out['small_warm_pull_s']:.3f} s; "
             f"phases {out['small_warm_phases']}")
        # A REST transfer to an agent that is already running (the demo's number).
        procs.append(ModuleProcess(["modelexpress", "agent", "--id", "small-agent",
                                    "--no-serve"], work / "agent.log", env, cwd=ROOT))
        deadline = time.monotonic() + 180
        while "small-agent" not in {a.id for a in client.list_agents()}:
            if time.monotonic() > deadline:
                raise TimeoutError("the agent did not register within 180 s")
            time.sleep(0.2)
        rest = []
        for _ in range(runs):
            t0 = time.perf_counter()
            record = client.start_transfer(identity, "small-agent")
            deadline = time.monotonic() + 120
            while (record := client.get_transfer(record.id)).state not in (
                    "SUCCEEDED", "FAILED", "STOPPED"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"transfer {record.id} still {record.state} after 120 s")
                time.sleep(0.005)
            rest.append(time.perf_counter() - t0)
            if record.state != "SUCCEEDED":
                raise RuntimeError(f"REST transfer {record.id} ended {record.state}: "
                                   f"{record.error}")
        out["small_rest_first_s"] = round(rest[0], 4)  # the agent's first transfer
        out["small_rest_transfer_s"] = round(_median(rest), 4)
        out["small_rest_transfers_s"] = [round(r, 4) for r in rest]
        _say(f"REST transfers (start to SUCCEEDED, polled every 5 ms): {out['small_rest_transfers_s']}")
        out["small_disk_warm_s"] = round(min(time_disk_load(ckpt, cold=False)
                                             for _ in range(3)), 4)
    finally:
        for p in reversed(procs):
            p.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 layer (~0.9 GB) instead of 5")
    parser.add_argument("--layers", type=int, default=None, help="Llama-3-8B layers to generate")
    parser.add_argument("--gpu", action="store_true", help="source on cuda:0, target on cuda:1")
    parser.add_argument("--sources", type=int, default=1, choices=(1, 2))
    parser.add_argument("--workdir", type=pathlib.Path, default=None)
    parser.add_argument("--no-digests", action="store_true",
                        help="pull without per-tensor digest checks (bytes are still "
                             "compared with the checkpoint afterwards)")
    parser.add_argument("--small", action="store_true",
                        help="the fixed cost of a small pull (all-MiniLM-L6-v2), not the rate")
    parser.add_argument("--runs", type=int, default=5, help="--small: runs of each kind")
    args = parser.parse_args()
    if args.small:
        work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="mx-bench-small-"))
        work.mkdir(parents=True, exist_ok=True)
        try:
            print(json.dumps(_small(args.runs, work)))
        finally:
            if args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
        return
    layers = args.layers or (1 if args.quick else 5)

    import torch

    from modelexpress.checkpoint import (LlamaShape, generate_llama_checkpoint,
                                         time_disk_load)
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p import PullOptions, allocate_like, manifest_of, pull

    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="mx-bench-p2p-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "checkpoint"
    if not ckpt.exists():
        _say(f"generating {layers} Llama-3-8B-shaped layers in {ckpt}")
        generate_llama_checkpoint(ckpt, LlamaShape(layers=layers, vocab=32000))
    nbytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    from modelexpress._subproc import ModuleProcess, clean_env
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = clean_env(MX_SERVER_URL=url, MX_LOG_LEVEL="WARNING", PYTHONPATH=pythonpath)
    procs: list[ModuleProcess] = []
    model = f"bench/llama-3-8b-shaped-{layers}"
    out: dict[str, Any] = {"machine": "gpu" if args.gpu else "cpu", "layers": layers}
    try:
        client = _start_server(procs, work, port, env, "bench.db")
        published = []
        for i in range(args.sources):
            device = "cuda:0" if args.gpu else "cpu"
            procs.append(ModuleProcess(["modelexpress", "publish", str(ckpt), "--model", model,
                                        "--device", device, "--json", "--worker-id",
                                        f"bench-src-{i}"], work / f"source-{i}.log", env,
                                       cwd=ROOT))
            published.append(procs[-1].json_line(600))
            _say(f"source {i}: {published[-1]['bytes'] / 1e9:.2f} GB on {device}, "
                 f"loaded in {published[-1]['load_seconds']} s")
        identity = ModelIdentity.from_dict(published[0]["identity"])
        target = "cuda:1" if args.gpu else "cpu"
        info = client.get_source(published[0]["source_id"])
        dest = allocate_like(manifest_of(info), target)
        tensor_bytes = sum(t.numel() * t.element_size() for t in dest.values())

        out["gbps_memcpy"] = _memcpy_gbps(tensor_bytes, args.gpu)
        _say(f"baseline {'peer copy GPU0->GPU1' if args.gpu else 'memcpy'}: "
             f"{out['gbps_memcpy']:.2f} GB/s")

        runs = []
        for _ in range(2 if args.quick else 3):
            result = pull(identity, dest, client=client, options=PullOptions(
                timeout_s=600, prefer=[published[0]["source_id"]], verify=not args.no_digests))
            runs.append(result)
            _say(f"pull: {result.gbps:.2f} GB/s data plane over {result.transport}, "
                 f"{result.bytes / result.total_seconds / 1e9:.2f} GB/s end to end, "
                 f"{result.descriptors} descriptors, digests {result.verify_seconds:.3f} s, "
                 f"connecting {result.connect_seconds * 1e3:.2f} ms")
        # The same pulls through one long-lived NIXL agent: its UCX context keeps the
        # peer's CUDA IPC mappings, so this is the data plane without the per-agent
        # setup a brand-new worker pays once (opening and mapping the peer's memory).
        from modelexpress.transfer import NixlTransferManager
        with NixlTransferManager() as mgr:
            mgr.register_tensors(dest)
            warm = [pull(identity, dest, client=client, manager=mgr, options=PullOptions(
                timeout_s=600, prefer=[published[0]["source_id"]], verify=not args.no_digests))
                    for _ in range(3)]
        out["gbps_p2p_warm_agent"] = max(r.gbps for r in warm)
        out["ratio_p2p_warm_agent_vs_memcpy"] = out["gbps_p2p_warm_agent"] / out["gbps_memcpy"]
        _say(f"pull through one long-lived agent: {[round(r.gbps, 1) for r in warm]} GB/s")
        best = max(runs, key=lambda r: r.gbps)
        out["gbps_p2p_first"] = runs[0].gbps  # cold: peer connection, IPC handles opened
        out["digests_checked"] = best.verified
        out["verified"] = bool((best.verified or args.no_digests) and _verify(dest, ckpt))
        out.update(bytes=best.bytes, tensors=best.tensors, gbps_p2p=best.gbps,
                   verify_seconds=best.verify_seconds,
                   connect_seconds_first=runs[0].connect_seconds,
                   gbps_p2p_end_to_end=best.bytes / best.total_seconds / 1e9,
                   transport=best.transport, descriptors=best.descriptors,
                   ratio_p2p_vs_memcpy=best.gbps / out["gbps_memcpy"])
        if args.sources == 2:
            striped = [pull(identity, dest, client=client,
                            options=PullOptions(timeout_s=600, stripe=2)) for _ in range(2)]
            s_best = max(striped, key=lambda r: r.gbps)
            out["gbps_p2p_striped"] = s_best.gbps
            out["striped_sources"] = len(s_best.source_ids)
            out["verified"] = out["verified"] and _verify(dest, ckpt)
            _say(f"striped over {len(s_best.source_ids)} sources: {s_best.gbps:.2f} GB/s")
        del dest
        if args.gpu:
            torch.cuda.empty_cache()
        disk_device = target
        warm = min(time_disk_load(ckpt, cold=False, device=disk_device) for _ in range(2))
        cold = time_disk_load(ckpt, cold=True, device=disk_device)
        out["gbps_disk_warm"] = nbytes / warm / 1e9
        out["gbps_disk_cold"] = nbytes / cold / 1e9
        out["ratio_p2p_vs_disk_warm"] = out["gbps_p2p"] / out["gbps_disk_warm"]
        _say(f"disk into {disk_device}: warm {out['gbps_disk_warm']:.2f} GB/s, "
             f"cold {out['gbps_disk_cold']:.2f} GB/s")
    finally:
        for p in reversed(procs):
            p.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
