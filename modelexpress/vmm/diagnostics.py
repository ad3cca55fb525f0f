"""`modelexpress doctor` checks of the VMM arena."""

from __future__ import annotations

import ctypes
import os

from modelexpress.doctor import Check, CheckResult

__all__ = ["doctor_checks"]


def _extension() -> CheckResult:
    from modelexpress.vmm._core import extension_error, load_extension
    if load_extension() is None:
        return CheckResult("vmm C extension", "warn",
                           f"not built ({extension_error()}): MX_VMM_ARENA=1 falls back")
    return CheckResult("vmm C extension", "ok", "built (_alloc_ext)")


def _cuda_vmm() -> CheckResult:
    from modelexpress.vmm.runtime import arena_unavailable_reason
    reason = arena_unavailable_reason(0)
    if reason is None:
        return CheckResult("CUDA VMM arena", "ok", "device 0 supports the arena")
    return CheckResult("CUDA VMM arena", "info", f"unavailable: {reason}")


def _host_self_test() -> CheckResult:
    """Allocate across several memfd handles, punch a hole, verify bytes, close, count fds."""
    from modelexpress.vmm import HostVmmBackend, VmmArena
    fds0 = len(os.listdir("/proc/self/fd"))
    with VmmArena(1 << 30, backend=HostVmmBackend()) as arena:
        vas = [arena.malloc(size) for size in (4096, 70_000, 1 << 20, 12_288)]
        for i, va in enumerate(vas):
            ctypes.memset(va, 0x11 * (i + 1), 4096)
        arena.free(vas[1])
        for i in (0, 2, 3):
            if ctypes.string_at(vas[i], 4096) != bytes([0x11 * (i + 1)]) * 4096:
                return CheckResult("vmm host self-test", "fail", f"chunk {i} corrupted")
        chunks = arena.live_allocation_count
        core = type(arena._core).__name__
    leaked = len(os.listdir("/proc/self/fd")) - fds0
    if leaked:
        return CheckResult("vmm host self-test", "fail", f"{leaked} fds leaked by close()")
    return CheckResult("vmm host self-test", "ok",
                       f"4 memfd chunks, hole punched, {chunks} verified, nothing leaked "
                       f"({core})")


def doctor_checks() -> list[Check]:
    """The arena's checks: extension, CUDA VMM support, a host-backend self-test."""
    return [
        Check("vmm C extension", _extension),
        Check("CUDA VMM arena", _cuda_vmm),
        Check("vmm host self-test", _host_self_test, required=True),
    ]
