"""P2P on GPUs: a source on cuda:0 in one process, the target in this one.

Runs on a GPU host; skipped elsewhere by the ``gpu`` marker. Source and target
share the host, so a default pull goes over the local transport; the NIXL test turns
it off on the target (``MX_IPC_DIR=off``) to check what UCX does with VRAM.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from conftest import Cluster
from modelexpress.checkpoint import LlamaShape, generate_llama_checkpoint, load_checkpoint
from modelexpress.identity import ModelIdentity
from modelexpress.local import LocalOptions
from modelexpress.p2p import PullOptions, allocate_like, manifest_of, pull

pytestmark = [pytest.mark.gpu, pytest.mark.nixl]


def test_gpu0_source_to_gpu1_target_through_the_server(cluster: Cluster,
                                                       tmp_path: pathlib.Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ckpt = tmp_path / "ckpt"
    generate_llama_checkpoint(ckpt, LlamaShape(layers=2, vocab=32000), seed=7)
    proc = cluster.start(["publish", str(ckpt), "--model", "gpu-test", "--device", "cuda:0",
                          "--json"], "gpu-source")
    published = proc.json_line()
    info = cluster.client.get_source(published["source_id"])
    manifest = manifest_of(info)
    assert {t.device for t in manifest.tensors} == {"cuda:0"}
    dest = allocate_like(manifest, "cuda:1")
    result = pull(ModelIdentity.from_dict(published["identity"]), dest,
                  client=cluster.client,
                  options=PullOptions(timeout_s=120, local=LocalOptions(ipc_dir="off")))
    assert result.verified
    used = set(result.transport.replace("+", ",").split(","))
    assert "cuda_ipc" in used and not used & {"tcp", "unknown"}, (
        f"VRAM went over {result.transport} ({result.transport_detail}): {result.warnings}")
    reference = load_checkpoint(ckpt)
    for name, ref in reference.items():
        assert torch.equal(dest[name].cpu().view(torch.uint8), ref.view(torch.uint8)), name


def test_a_gpu_source_and_target_on_one_host_copy_locally_without_nixl(
        cluster: Cluster, tmp_path: pathlib.Path) -> None:
    """``modelexpress publish --device cuda:0`` and a pull into cuda:1 (cuda:0 on one
    GPU): the local transport (CUDA IPC of the source's slab), no NIXL agent."""
    target = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    ckpt = tmp_path / "ckpt"
    generate_llama_checkpoint(ckpt, LlamaShape(layers=2, vocab=32000), seed=7)
    proc = cluster.start(["publish", str(ckpt), "--model", "gpu-local", "--device", "cuda:0",
                          "--json"], "gpu-source")
    published = proc.json_line()
    assert published["local_transport"], published
    manifest = manifest_of(cluster.client.get_source(published["source_id"]))
    dest = allocate_like(manifest, target)
    result = pull(ModelIdentity.from_dict(published["identity"]), dest,
                  client=cluster.client, options=PullOptions(timeout_s=120))
    assert result.verified and result.transport == "local", (result.transport,
                                                             result.warnings)
    assert result.phases["agent"] == 0.0 and result.phases["register"] == 0.0
    reference = load_checkpoint(ckpt)
    for name, ref in reference.items():
        assert torch.equal(dest[name].cpu().view(torch.uint8), ref.view(torch.uint8)), name
