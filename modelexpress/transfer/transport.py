"""Which UCX transport a peer pair uses, what rate it must reach, and the verdict.

Why this exists: on this project's GPU machine (NIXL 1.5.1, UCX 1.23, 2x H200) UCX
cannot open CUDA VMM (``cuMemCreate``) memory over ``cuda_ipc``; it logs
``unsupported key handle type: 0`` and silently moves the bytes over TCP at
~0.5 GB/s, ~800x below the 395 GB/s NVLink copy, with correct data and no NIXL
error (GPU.md). That must never pass silently. Three signals, any one suffices:

1. **UCX's own protocol report**: with ``UCX_PROTO_INFO=y`` UCX prints, per endpoint
   configuration, which transport serves "remote memory read" (``cma/memory``,
   ``tcp/lo``, ``cuda_ipc/cuda``, ``rc_mlx5/mlx5_0:1``). :func:`parse_ucx_log` reads
   that (and the VMM key error line) from a UCX log file.
2. **Rate floor**: a READ of at least ``min_measure_bytes`` slower than the expected
   transport's floor (:data:`FLOORS_GBPS`) is a fallback, whatever the log says.
3. **Expectation**: :func:`expected_transport` says what a memory-kind/host pair
   should use, so the message can say what to change.

:func:`assess` turns these into a :class:`TransportVerdict`; the manager attaches it
to every transfer result, logs a warning, counts it in :data:`METRICS`, and raises
:class:`~modelexpress.errors.TransportError` when the caller refuses slow transports.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import logging
import re
import threading

log = logging.getLogger(__name__)

__all__ = ["COLD_FLOOR_GBPS", "FLOORS_GBPS", "METRICS", "TransportMetrics", "TransportVerdict", "UcxLogFacts",
           "assess", "expected_transport", "parse_ucx_log", "read_ucx_log", "ucx_proto_info_env"]

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


def expected_transport(local_mem: str, remote_mem: str, same_host: bool) -> str:
    """The transport family a READ between these memory kinds should use.

    Args:
        local_mem / remote_mem: "DRAM" or "VRAM".
        same_host: both agents on one machine.

    Returns:
        ``"cuda_ipc"`` (VRAM<->VRAM on one host, NVLink/PCIe peer access), ``"rdma"``
        (any VRAM across hosts: GPUDirect RDMA), ``"cma"`` (DRAM on one host), or
        ``"rdma"`` for DRAM across hosts (TCP works there but is the slow fallback).
    """
    if same_host:
        return "cuda_ipc" if "VRAM" in (local_mem, remote_mem) else "cma"
    return "rdma"


@dataclasses.dataclass(frozen=True)
class UcxLogFacts:
    """What a UCX log says about reads.

    Attributes:
        read_transports: UCX transports UCX chose for "remote memory read" (e.g. cma, tcp).
        vmm_key_unsupported: the ``unsupported key handle type`` line was seen (VMM memory
            offered to cuda_ipc; UCX falls back to another transport, TCP here).
        evidence: the log lines behind the facts (a few, for the message).
    """

    read_transports: tuple[str, ...] = ()
    vmm_key_unsupported: bool = False
    evidence: tuple[str, ...] = ()


_ROW = re.compile(r"\|\s*[\d.]+\s*(?:\.\.\s*(?:inf|[\d.]+))?\s*\|[^|]*\|\s*([A-Za-z0-9_]+)/[^|]*\|")
_READ_TITLE = re.compile(r"remote memory read by ucp_get")
_VMM_KEY = re.compile(r"unsupported key handle type")


def parse_ucx_log(text: str) -> UcxLogFacts:
    """Extract read-transport choices and the VMM key error from a UCX log.

    Args:
        text: UCX output captured with ``UCX_PROTO_INFO=y`` (and e.g.
            ``UCX_LOG_FILE=/path/ucx.%p.log``); other lines are ignored.

    Returns:
        The facts found (empty when the log holds none).
    """
    transports: list[str] = []
    evidence: list[str] = []
    vmm = False
    in_read = False
    for line in text.splitlines():
        if _VMM_KEY.search(line):
            vmm = True
            evidence.append(line.strip())
            continue
        if "+---" in line and not in_read:
            continue
        if _READ_TITLE.search(line):
            in_read = True
            evidence.append(line.strip())
            continue
        if in_read:
            if re.search(r"\|\s*[A-Za-z].* by ucp_", line):  # next table's title
                in_read = False
                continue
            m = _ROW.search(line)
            if m:
                tl = m.group(1)
                if tl not in transports:
                    transports.append(tl)
                    evidence.append(line.strip())
    return UcxLogFacts(tuple(transports), vmm, tuple(evidence[:6]))


def ucx_proto_info_env(log_file: str) -> dict[str, str]:
    """Environment that makes UCX report its protocol choices into ``log_file``.

    UCX reads it when the first agent of a process starts, so entry points apply
    it (``os.environ.update``) before creating a manager, or pass it to a child.
    ``%p`` in the path is replaced by the pid (by UCX and by the manager).
    """
    return {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": log_file}


def read_ucx_log(path: str) -> UcxLogFacts | None:
    """Flush UCX's buffered log stream and parse ``path``; None when unreadable.

    UCX writes its log through a buffered C ``FILE*``; the protocol tables of a
    transfer that just ran sit in that buffer (seen here: 12 KiB on disk of 15 KiB
    written). ``fflush(NULL)`` flushes every C output stream of this process,
    which is harmless and the only handle we have on UCX's stream.
    """
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError) as exc:  # no libc symbol table: parse what is on disk
        log.debug("fflush(NULL) unavailable: %s", exc)
    try:
        with open(path, errors="replace") as f:
            return parse_ucx_log(f.read())
    except OSError as exc:
        log.debug("UCX log %s unreadable: %s", path, exc)
        return None


@dataclasses.dataclass(frozen=True)
class TransportVerdict:
    """Whether a transfer's transport was the expected one at a plausible rate.

    Attributes:
        ok: False means a fallback or mismatch was detected.
        expected: the transport family expected (see :func:`expected_transport`).
        observed: families UCX reported for reads (empty when not captured).
        gbps: measured rate of the data moved, or None when too little was measured.
        floor_gbps: the expected family's floor.
        message: one line; when not ok, says what to change.
    """

    ok: bool
    expected: str
    observed: tuple[str, ...]
    gbps: float | None
    floor_gbps: float
    message: str

    @property
    def transport(self) -> str:
        """The best name for the transport in use (observed if known, else expected)."""
        return "+".join(self.observed) if self.observed else self.expected


def _advice(expected: str, vmm: bool) -> str:
    if expected == "cuda_ipc" or vmm:
        return ("UCX cuda_ipc cannot open CUDA VMM (cuMemCreate) memory in UCX <= 1.23 and "
                "falls back to TCP. On NVLink peers load without the VMM arena "
                "(MX_VMM_ARENA=0) so tensors are cudaMalloc memory; use the arena's single "
                "region only on dmabuf/IB (MX_ARENA_SINGLE_MR=1); or use a UCX with "
                "openucx/ucx#11283. See docs/DEPLOYMENT.md, Multi-handle arenas. "
                "MX_REFUSE_SLOW_TRANSPORT=1 turns this into an error.")
    if expected == "rdma":
        return ("check that UCX sees the RDMA devices (ucx_info -d, UCX_NET_DEVICES) and that "
                "UCX_TLS does not exclude rc/dc; MX_REFUSE_SLOW_TRANSPORT=1 refuses such peers.")
    return ("check UCX_TLS (it must allow cma or sm for same-host DRAM) and that CMA is "
            "permitted (same user; kernel.yama.ptrace_scope <= 1).")


def assess(expected: str, nbytes: int, seconds: float, *,
           facts: UcxLogFacts | None = None, min_measure_bytes: int = 64 << 20,
           cold: bool = False) -> TransportVerdict:
    """Judge a transfer (or probe) against its expected transport.

    Args:
        expected: family from :func:`expected_transport`.
        nbytes: bytes moved in ``seconds``.
        seconds: wall time of those bytes.
        facts: what the UCX log said, when captured.
        min_measure_bytes: below this the rate is not judged (latency dominates).
        cold: the bytes include connection setup; judged against at most
            :data:`COLD_FLOOR_GBPS`.

    Returns:
        The verdict (``ok=False`` for: the VMM key error, UCX reporting TCP where
        something else was expected, or a rate below the expected floor).
    """
    floor = FLOORS_GBPS.get(expected, 0.0)
    if cold:
        floor = min(floor, COLD_FLOOR_GBPS)
    gbps = nbytes / seconds / 1e9 if seconds > 0 and nbytes >= min_measure_bytes else None
    observed = tuple(dict.fromkeys(_family(t) for t in (facts.read_transports if facts else ())))
    vmm = bool(facts and facts.vmm_key_unsupported)
    rate = f"{gbps:.2f} GB/s" if gbps is not None else "rate not measured"
    if vmm:
        msg = (f"UCX refused the CUDA VMM memory key on {expected} ('unsupported key handle "
               f"type') and fell back ({rate}). " + _advice(expected, True))
        return TransportVerdict(False, expected, observed or ("tcp",), gbps, floor, msg)
    if observed and expected not in observed and "tcp" in observed and expected != "tcp":
        msg = (f"UCX moved the READ over tcp where {expected} was expected ({rate}). "
               + _advice(expected, False))
        return TransportVerdict(False, expected, observed, gbps, floor, msg)
    if gbps is not None and gbps < floor:
        msg = (f"READ ran at {rate}, below the {floor:g} GB/s floor of {expected}: UCX most "
               "likely fell back to TCP. " + _advice(expected, False))
        return TransportVerdict(False, expected, observed, gbps, floor, msg)
    return TransportVerdict(True, expected, observed, gbps, floor,
                            f"{'+'.join(observed) or expected} at {rate}")


class TransportMetrics:
    """Process-wide counters of transport verdicts, by (expected, outcome).

    Kept dependency-free; the server's ``/metrics`` exports :meth:`snapshot`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def record(self, verdict: TransportVerdict) -> None:
        with self._lock:
            self._counts[(verdict.expected, "ok" if verdict.ok else "slow")] += 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        """``{(expected_transport, "ok"|"slow"): count}``."""
        with self._lock:
            return dict(self._counts)


METRICS = TransportMetrics()
