"""Transport verdicts: real UCX on the CPU (CMA vs forced TCP) and the recorded GPU
outcomes (UCX cuda_ipc silently falling back to TCP for CUDA VMM memory, GPU.md)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from modelexpress import errors
from modelexpress.transfer import assess, expected_transport, parse_ucx_log
from modelexpress.transfer.transport import UcxLogFacts
from modelexpress.transfer.nixl_adapter import ERROR_MAP, nixl_error_classes, translate

# NIXL refuses UCX_TLS without a CUDA transport where GPUs are present.
TCP_ONLY = "tcp,cuda_copy" if torch.cuda.is_available() else "tcp"

# Recorded on a 2x H200 host (NIXL 1.5.1, UCX 1.23; 2026-11):
GIB2 = 2 << 30
RECORDED_GPU = {
    # one 2 GiB cudaMalloc region, NIXL READ GPU1 <- GPU0 over cuda_ipc
    "cudamalloc_cuda_ipc": {"nbytes": GIB2, "gbps": 396.0, "log": ""},
    # the same READ of CUDA VMM memory (1 or 4 cuMemCreate handles): 0.43-0.52 GB/s,
    # data correct, no NIXL error, and UCX logs the refused rkey
    "vmm_cuda_ipc_slow": {"nbytes": GIB2, "gbps": 0.43, "log": ""},
    "vmm_cuda_ipc_logged": {
        "nbytes": GIB2, "gbps": 0.52,
        "log": "[1795970000.1] [gpu:4242:0] cuda_ipc_md.c:312 UCX ERROR "
               "unsupported key handle type: 0\n"},
}


@pytest.mark.nixl
def test_every_nixl_error_class_is_mapped() -> None:
    classes = nixl_error_classes()
    assert len(classes) >= 10  # the bindings export one class per status
    unmapped = sorted(set(classes) - set(ERROR_MAP))
    assert not unmapped, f"NIXL error classes without a mapping in nixl_adapter: {unmapped}"
    for name, cls in classes.items():
        err = translate(cls("boom"), "READ", peer="src-1", nbytes=4096)
        assert isinstance(err, errors.TransferError)
        assert "src-1" in str(err) and "4096" in str(err) and name in str(err)
        reg = translate(cls("boom"), "register", registering=True)
        assert isinstance(reg, errors.RegistrationError)
    assert isinstance(translate(classes["nixlRemoteDisconnectError"]("x"), "READ"),
                      errors.PeerError)


def test_expected_transports() -> None:
    assert expected_transport("VRAM", "VRAM", same_host=True) == "cuda_ipc"
    assert expected_transport("DRAM", "DRAM", same_host=True) == "cma"
    assert expected_transport("VRAM", "VRAM", same_host=False, rdma=True) == "rdma"
    # a host without RDMA devices has TCP between hosts, not a fallback
    assert expected_transport("VRAM", "VRAM", same_host=False, rdma=False) == "tcp"
    assert expected_transport("DRAM", "DRAM", same_host=False, rdma=False) == "tcp"


def test_the_hardware_decides_between_rdma_and_tcp(tmp_path: pathlib.Path) -> None:
    from modelexpress.transfer.transport import rdma_devices
    sysfs = tmp_path / "infiniband"
    assert rdma_devices(sysfs) == ()  # no RDMA driver: no class directory at all
    sysfs.mkdir()
    assert rdma_devices(sysfs) == ()
    (sysfs / "mlx5_1").mkdir()
    (sysfs / "mlx5_0").mkdir()
    assert rdma_devices(sysfs) == ("mlx5_0", "mlx5_1")


def test_tcp_between_hosts_is_ok_without_rdma_and_a_fallback_with_it() -> None:
    tcp = UcxLogFacts(read_transports=("tcp",))
    assert assess("tcp", 1 << 30, 10.0, facts=tcp).ok
    slow = assess("rdma", 1 << 30, 10.0, facts=tcp)
    assert not slow.ok and "where rdma was expected" in slow.message
    same_host = assess("cma", 1 << 30, 1.0, facts=tcp)
    assert not same_host.ok and "where cma was expected" in same_host.message


@pytest.mark.parametrize("case", sorted(RECORDED_GPU))
def test_recorded_gpu_outcomes(case: str) -> None:
    rec = RECORDED_GPU[case]
    seconds = rec["nbytes"] / (rec["gbps"] * 1e9)
    facts = parse_ucx_log(rec["log"]) if rec["log"] else None
    verdict = assess("cuda_ipc", rec["nbytes"], seconds, facts=facts)
    if case == "cudamalloc_cuda_ipc":
        assert verdict.ok and verdict.gbps == pytest.approx(396.0)
        return
    assert not verdict.ok
    assert "MX_VMM_ARENA=0" in verdict.message and "MX_REFUSE_SLOW_TRANSPORT" in verdict.message
    if rec["log"]:
        assert facts is not None and facts.vmm_key_unsupported
        assert "unsupported key handle type" in verdict.message
        # the log line alone is enough, even before the rate can be measured
        assert not assess("cuda_ipc", 1 << 20, 1.0, facts=facts).ok
    else:
        assert "below the 20 GB/s floor" in verdict.message


def test_small_transfers_are_not_rate_judged() -> None:
    assert assess("cuda_ipc", 4096, 1.0).ok  # latency dominates small reads


def test_parse_ucx_proto_info_tables() -> None:
    text = """
[1] [vm:1:0]   | src self cfg#0                                                    |
[1] [vm:1:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1] [vm:1:0]   +--------+-------------+-------------------------------------------+
[1] [vm:1:0]   | Range  | Description |                  Config                   |
[1] [vm:1:0]   | 0..inf | zero-copy   | cma/memory                                |
[1] [vm:1:0]   | tgt cfg#1                                                          |
[1] [vm:1:0]   | active message by ucp_am_send* from host memory |
[1] [vm:1:0]   |          0 | short              | tcp/lo        |
"""
    facts = parse_ucx_log(text)
    assert facts.read_transports == ("cma",) and not facts.vmm_key_unsupported


@pytest.mark.nixl
def test_real_ucx_cma_passes_and_forced_tcp_is_reported_and_refusable(source_factory,
                                                                      target_runner,
                                                                      tmp_path) -> None:
    src = source_factory({"kinds": ["many"]})
    # The user's own UCX_PROTO_INFO=y and UCX_LOG_FILE: that file is read.
    user = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": str(tmp_path / "ucx.%p.log")}
    good = target_runner([src], "many", user)["reads"][0]
    assert good["ok"] and good["expected"] == "cma" and good["observed"] == ["cma"], good
    assert good["transport"] == "cma" and str(tmp_path) in good["transport_detail"]
    # UCX_TLS on the target only: it can reach the source's tcp endpoint, nothing else
    tcp = target_runner([src], "many", {**user, "UCX_TLS": TCP_ONLY})["reads"][0]
    assert not tcp["ok"] and tcp["observed"] == ["tcp"] and tcp["transport"] == "tcp", tcp
    assert "over tcp where cma was expected" in tcp["message"]
    assert tcp["warnings"] and "UCX_TLS" in tcp["message"]
    refused = target_runner([src], "many", {**user, "UCX_TLS": TCP_ONLY}, refuse=True)["reads"][0]
    assert refused.get("error") == "TransportError", refused
