"""What transport a READ should use, what rate it must reach, and the verdict.

Why this exists: on a 2x H200 host (NIXL 1.5.1, UCX 1.23) UCX
cannot open CUDA VMM (``cuMemCreate``) memory over ``cuda_ipc``; it logs
``unsupported key handle type: 0`` and silently moves the bytes over TCP, with
correct data and no NIXL error (GPU.md). That must never pass silently. The signals:

1. **UCX's own protocol report** (:mod:`~modelexpress.transfer.ucx_report`, attributed
   to a peer by :mod:`~modelexpress.transfer.observer`): which transport UCX selected
   for "remote memory read" (``cma``, ``tcp``, ``cuda_ipc``, ``rc_mlx5``), and the VMM
   key error line. This is what a result names as its transport; without it the
   transport is ``unknown``, never a guess.
2. **Rate floor**: a READ of at least ``min_measure_bytes`` slower than the floor
   (:data:`FLOORS_GBPS`) of the observed transport (the expected one when nothing was
   observed) is a fallback, whatever the log says.
3. **Expectation**: :func:`expected_transport` says what a memory-kind/host pair
   should use on this hardware, so the message can say what to change. Between hosts
   that is ``rdma`` only where this host has RDMA devices (:func:`rdma_devices`); a
   host without any expects ``tcp``, so a fleet of TCP-only hosts is neither warned
   on every pull nor refused under ``MX_REFUSE_SLOW_TRANSPORT=1``. RDMA present but
   TCP used still is a fallback, and so is NIXL over TCP between peers on one host.

:func:`assess` turns these into a :class:`TransportVerdict`; the manager attaches it
to every transfer result, logs a warning, and raises
:class:`~modelexpress.errors.TransportError` when the caller refuses slow transports.

Counting: the verdicts of a worker process are not counted here (counters in a worker
are invisible to an operator). Each transfer's target reports its outcome (transport,
rate, verdict: :data:`VERDICT_OK` / :data:`VERDICT_SLOW`, or :data:`UNKNOWN`) with
``MxClient.finish_transfer(..., outcome=...)``; the server's ``/metrics`` exports them
(``mx_transfer_verdicts_total`` and friends, ``server/metrics.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

log = logging.getLogger(__name__)

__all__ = ["COLD_FLOOR_GBPS", "FLOORS_GBPS", "RDMA_SYSFS", "UNKNOWN", "VERDICT_OK",
           "VERDICT_SLOW", "TransportVerdict", "UcxLogFacts", "assess", "expected_transport",
           "rdma_devices"]

# What a result says when UCX's report did not show the transport.
UNKNOWN = "unknown"
# The rate verdict's names on the wire (a transfer's reported outcome, the server's
# metrics); UNKNOWN when the transfer ended before a verdict was reached.
VERDICT_OK = "ok"
VERDICT_SLOW = "slow"

# Lowest rate (GB/s) a READ on each transport may show before we call it a fallback.
# Far below the measured rates on purpose, so a loaded machine never trips it, yet
# far above TCP's ~0.5 GB/s for the GPU paths:
#   cuda_ipc: 395 GB/s measured over NVLink (GPU.md); 20 leaves a 20x margin.
#   rdma (rc/dc over IB/RoCE): >= 10 GB/s per 100G link; 2 is a broken setup.
#   cma / sm (same-host DRAM): ~4 GB/s on the 2-core CI machines; 0.1 catches a hang-like
#   crawl without tripping on a loaded CI box. DRAM over TCP loopback is not a
#   failure on CPU machines, so tcp has no floor of its own.
FLOORS_GBPS: dict[str, float] = {
    "cuda_ipc": 20.0,
    "cuda_copy": 5.0,
    "rdma": 2.0,
    "cma": 0.1,
    "sm": 0.1,
    "tcp": 0.0,
}

# Floor for a measurement that includes connection setup (the first chunk of a new
# peer: endpoint wire-up, CUDA IPC handles opened and mapped). Measured on the GPU
# machine: a fresh agent's first 64 MiB over cuda_ipc ran at 5.6 GB/s, the VMM-over-TCP
# fallback at 0.43-0.52 GB/s; 2 GB/s separates the two without flagging a cold start.
COLD_FLOOR_GBPS = 2.0

_RDMA = ("rc", "rc_mlx5", "rc_verbs", "dc", "dc_mlx5", "ud", "ud_mlx5", "ud_verbs", "gga")
_SM = ("posix", "sysv", "xpmem", "knem", "self")


def _family(tl: str) -> str:
    """UCX transport name (``rc_mlx5``, ``sysv``) -> our family (rdma, sm, ...)."""
    if tl in _RDMA or tl.startswith(("rc", "dc", "ud")):
        return "rdma"
    if tl in _SM:
        return "sm"
    return tl


RDMA_SYSFS = pathlib.Path("/sys/class/infiniband")
"""The kernel's list of RDMA devices (InfiniBand, RoCE, iWARP, EFA, soft-RoCE alike)."""


def rdma_devices(sysfs: pathlib.Path = RDMA_SYSFS) -> tuple[str, ...]:
    """The RDMA devices of this host (``mlx5_0``, ``efa_0``, ...), sorted; empty when none.

    Args:
        sysfs: where the kernel lists them (tests and containers may point elsewhere).
    """
    try:
        return tuple(sorted(p.name for p in sysfs.iterdir()))
    except OSError:  # no such class: no RDMA driver loaded, no device
        return ()


def expected_transport(local_mem: str, remote_mem: str, same_host: bool, *,
                       rdma: bool | None = None) -> str:
    """The transport family a READ between these memory kinds should use.

    Args:
        local_mem / remote_mem: "DRAM" or "VRAM".
        same_host: both agents on one machine.
        rdma: this host has RDMA devices; None: look (:func:`rdma_devices`).

    Returns:
        On one host: ``"cuda_ipc"`` (VRAM on either side: NVLink/PCIe peer access) or
        ``"cma"`` (DRAM). Across hosts: ``"rdma"`` where this host has RDMA devices
        (GPUDirect RDMA for VRAM; TCP there is the slow fallback), else ``"tcp"`` (the
        only network a host without RDMA devices has: not a fallback).
    """
    if same_host:
        return "cuda_ipc" if "VRAM" in (local_mem, remote_mem) else "cma"
    if rdma is None:
        rdma = bool(rdma_devices())
    return "rdma" if rdma else "tcp"


@dataclasses.dataclass(frozen=True)
class UcxLogFacts:
    """What UCX's report says about the reads of one peer (or of a whole log).

    Attributes:
        read_transports: UCX transports UCX selected for "remote memory read" (e.g.
            ``cma``, ``tcp``); empty when none were observed.
        vmm_key_unsupported: the ``unsupported key handle type`` line was seen (VMM memory
            offered to cuda_ipc; UCX falls back to another transport).
        evidence: the report lines behind the facts (a few, for the message).
        detail: where the transports were read, or why none were.
    """

    read_transports: tuple[str, ...] = ()
    vmm_key_unsupported: bool = False
    evidence: tuple[str, ...] = ()
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class TransportVerdict:
    """Whether a transfer's transport was the expected one at a plausible rate.

    Attributes:
        ok: False means a fallback or mismatch was detected.
        expected: the transport family expected (see :func:`expected_transport`).
        observed: families of the transports UCX reported for reads (empty when none
            were observed).
        gbps: measured rate of the data moved, or None when too little was measured.
        floor_gbps: the floor judged against: the observed family's, else the expected one's.
        message: one line; when not ok, says what to change.
        transports: the UCX transport names observed (``cma``, ``rc_mlx5``, ...).
    """

    ok: bool
    expected: str
    observed: tuple[str, ...]
    gbps: float | None
    floor_gbps: float
    message: str
    transports: tuple[str, ...] = ()

    @property
    def transport(self) -> str:
        """The UCX transport(s) observed, ``+``-joined, or :data:`UNKNOWN`."""
        return "+".join(self.transports) if self.transports else UNKNOWN

    @property
    def name(self) -> str:
        """The verdict on the wire: :data:`VERDICT_OK` or :data:`VERDICT_SLOW`."""
        return VERDICT_OK if self.ok else VERDICT_SLOW


def _advice(expected: str, vmm: bool) -> str:
    if expected == "cuda_ipc" or vmm:
        return ("UCX <= 1.23 does not use cuda_ipc for CUDA VMM (cuMemCreate) memory, nor "
                "for a peer on the same GPU, and falls back to TCP. On NVLink peers load "
                "without the VMM arena "
                "(MX_VMM_ARENA=0) so tensors are cudaMalloc memory; use the arena's single "
                "region only on dmabuf/IB (MX_VMM_ARENA_SINGLE_MR=1); or use a UCX with "
                "openucx/ucx#11283. See docs/DEPLOYMENT.md, Multi-handle arenas. "
                "MX_REFUSE_SLOW_TRANSPORT=1 turns this into an error.")
    if expected == "rdma":
        return (f"this host has RDMA devices ({', '.join(rdma_devices()) or 'none now'}): "
                "check that UCX sees them (ucx_info -d, UCX_NET_DEVICES), that UCX_TLS does "
                "not exclude rc/dc, and that the source host has RDMA too; "
                "MX_REFUSE_SLOW_TRANSPORT=1 refuses such peers.")
    if expected == "tcp":
        return ("neither host path should be this slow over TCP: check the link (ethtool, "
                "tc) and UCX_NET_DEVICES; MX_REFUSE_SLOW_TRANSPORT=1 refuses such peers.")
    return ("check UCX_TLS (it must allow cma or sm for same-host DRAM) and that CMA is "
            "permitted (same user; kernel.yama.ptrace_scope <= 1).")


def assess(expected: str, nbytes: int, seconds: float, *,
           facts: UcxLogFacts | None = None, min_measure_bytes: int = 64 << 20,
           cold: bool = False) -> TransportVerdict:
    """Judge a transfer (or probe) against its observed, else its expected, transport.

    Args:
        expected: family from :func:`expected_transport`.
        nbytes: bytes moved in ``seconds``.
        seconds: wall time of those bytes.
        facts: what UCX's report said for this peer, when it could be read.
        min_measure_bytes: below this the rate is not judged (latency dominates).
        cold: the bytes include connection setup; judged against at most
            :data:`COLD_FLOOR_GBPS`.

    Returns:
        The verdict (``ok=False`` for: the VMM key error, UCX reporting TCP where
        something else was expected, or a rate below the floor of the observed
        transport, or of the expected one when nothing was observed).
    """
    tls = facts.read_transports if facts else ()
    observed = tuple(dict.fromkeys(_family(t) for t in tls))
    floor = min(FLOORS_GBPS.get(f, 0.0) for f in (observed or (expected,)))
    if cold:
        floor = min(floor, COLD_FLOOR_GBPS)
    gbps = nbytes / seconds / 1e9 if seconds > 0 and nbytes >= min_measure_bytes else None
    vmm = bool(facts and facts.vmm_key_unsupported)
    rate = f"{gbps:.2f} GB/s" if gbps is not None else "rate not measured"
    name = "+".join(tls) if tls else f"{UNKNOWN} transport (expected {expected})"
    if vmm:
        msg = (f"UCX refused the CUDA VMM memory key on {expected} ('unsupported key handle "
               f"type') and fell back to {'+'.join(tls) or 'another transport'} ({rate}). "
               + _advice(expected, True))
        return TransportVerdict(False, expected, observed, gbps, floor, msg, tls)
    if observed and expected not in observed and "tcp" in observed and expected != "tcp":
        msg = (f"UCX moved the READ over tcp where {expected} was expected ({rate}). "
               + _advice(expected, False))
        return TransportVerdict(False, expected, observed, gbps, floor, msg, tls)
    if gbps is not None and gbps < floor:
        basis = (f"of {'+'.join(observed)}" if observed
                 else f"of {expected} (transport not observed)")
        msg = (f"READ over {name} ran at {rate}, below the {floor:g} GB/s floor {basis}: UCX "
               "most likely fell back to TCP. " + _advice(expected, False))
        return TransportVerdict(False, expected, observed, gbps, floor, msg, tls)
    return TransportVerdict(True, expected, observed, gbps, floor, f"{name} at {rate}", tls)
