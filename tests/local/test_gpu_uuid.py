"""GPUs by UUID across processes, on a real GPU (GPU hosts only).

Source and target run as separate processes, each with ``CUDA_VISIBLE_DEVICES`` set
to the GPU's UUID (what engines pinned to GPUs and containers see): the source
publishes its segments under that UUID, the target maps it to its own ordinal and
copies every byte. A target that cannot see the GPU (``CUDA_VISIBLE_DEVICES=""``)
refuses the local transport before mapping anything, naming the GPU. (The two-GPU
permutation, ordinal 0 here being ordinal 1 there, needs two GPUs: tests/local/test_gpu.py.)
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from .conftest import PEERS, ROOT

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_uuid() -> str:
    import torch

    from modelexpress.local.devices import CudaDevices, gpu_uuid
    uuid = gpu_uuid(torch.cuda.get_device_properties(0).uuid)
    assert CudaDevices().uuids()[0] == uuid
    if shutil.which("nvidia-smi"):  # the spelling operators copy from nvidia-smi -L
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=60).stdout
        assert uuid in listing, listing
    return uuid


def _env(visible: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MX_")},
            "CUDA_VISIBLE_DEVICES": visible}


def _source(tmp: pathlib.Path, layout: str, visible: str) -> tuple[subprocess.Popen, dict,
                                                                   pathlib.Path]:
    info = tmp / f"source-{layout}.json"
    proc = subprocess.Popen([sys.executable, str(PEERS), "source", str(info), "--layout",
                             layout, "--seed", "7", "--mib", "32", "--ipc-dir", str(tmp / "ipc")],
                            stdin=subprocess.PIPE, cwd=ROOT, env=_env(visible))
    deadline = time.monotonic() + 120
    while not info.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"source ({layout}) did not publish (exit {proc.poll()})")
        time.sleep(0.05)
    return proc, json.loads(info.read_text()), info


def _target(info: pathlib.Path, visible: str, dst_device: str) -> dict:
    p = subprocess.run([sys.executable, str(PEERS), "target", str(info), "--seed", "7",
                        "--mib", "32", "--dst-device", dst_device],
                       stdout=subprocess.PIPE, cwd=ROOT, text=True, timeout=180,
                       env=_env(visible))
    assert p.returncode == 0, p.stdout
    return json.loads(p.stdout.strip().splitlines()[-1])


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("layout,kind", [("cuda", "cuda_ipc"), ("vmm", "vmm_fd")])
def test_gpu_source_and_target_pinned_by_uuid_pull_over_the_local_transport(
        tmp_path: pathlib.Path, gpu_uuid: str, layout: str, kind: str) -> None:
    proc, info, path = _source(tmp_path, layout, gpu_uuid)
    try:
        assert info["endpoint"]["gpus"] == [gpu_uuid]
        r = _target(path, gpu_uuid, "cuda:0")
        assert r["ok"] and r["equal"] and r["context_ok"], r
        assert set(r["segments"]) == {kind}, r
    finally:
        _stop(proc)


def test_gpu_a_target_that_cannot_see_the_source_gpu_does_not_read_it_locally(
        tmp_path: pathlib.Path, gpu_uuid: str) -> None:
    proc, _, path = _source(tmp_path, "cuda", gpu_uuid)
    try:
        r = _target(path, "", "cpu")
        assert not r["ok"], r
        assert "which this process does not see" in r["error"] and gpu_uuid in r["error"], r
        assert r["fds_after"] == r["fds_before"], r
    finally:
        _stop(proc)
