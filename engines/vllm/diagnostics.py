"""`modelexpress doctor` checks of the vLLM integration: version, shm arena installable."""

from __future__ import annotations

from modelexpress.doctor import Check, CheckResult

__all__ = ["doctor_checks"]


def _vllm_version() -> CheckResult:
    from modelexpress._optional import available
    if not available("vllm"):
        return CheckResult("vllm", "info", "not installed (only needed for the vLLM plugin)")
    from modelexpress.engines.vllm.shm import SUPPORTED_VLLM, check_supported
    from modelexpress.errors import ShmArenaError
    try:
        version = check_supported()
    except ShmArenaError as exc:
        return CheckResult("vllm", "warn", str(exc))
    return CheckResult("vllm", "ok", f"{version} (supported: {', '.join(SUPPORTED_VLLM)}x)")


def _shm_arena_installable() -> CheckResult:
    """Install into a real MessageQueue class and create one queue, then undo it."""
    from modelexpress._optional import available
    if not available("vllm"):
        return CheckResult("vllm shm arena", "info", "vllm not installed")
    from modelexpress.engines.vllm import shm
    from modelexpress.errors import ShmArenaError
    active = shm.installed_config()
    if active is not None:
        return CheckResult("vllm shm arena", "ok", f"installed: {active}")
    try:
        shm.install_shm_tensor_arena(arena_bytes=1 << 20, prefault=False)
    except ShmArenaError as exc:
        return CheckResult("vllm shm arena", "warn", f"not installable: {exc}")
    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
        queue = MessageQueue(2, 2)
        ok = type(queue.tensor_arena).__name__ == "ArenaWriter"
        del queue
    finally:
        shm.uninstall_shm_tensor_arena()
    if not ok:
        return CheckResult("vllm shm arena", "fail", "a new MessageQueue did not get the arena")
    return CheckResult("vllm shm arena", "ok", "installable (MX_SHM_TENSOR_ARENA=1 enables it)")


def doctor_checks() -> list[Check]:
    """The vLLM integration's checks (optional: vLLM is an optional dependency)."""
    return [Check("vllm", _vllm_version), Check("vllm shm arena", _shm_arena_installable)]
