"""`modelexpress doctor`: what this machine can do, and whether anything required is broken.

Each subpackage contributes checks through a ``diagnostics`` module exposing
``doctor_checks() -> list[Check]`` (listed in :data:`_CHECK_MODULES`); this module
only runs them and prints the report, so a component owns its own checks.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import shutil
import sys
from typing import Callable, Literal

__all__ = ["Check", "CheckResult", "run_checks", "render", "base_checks"]

log = logging.getLogger(__name__)

Status = Literal["ok", "warn", "fail", "info"]


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """Outcome of one check. ``fail`` means something *required* is broken."""

    name: str
    status: Status
    detail: str


@dataclasses.dataclass(frozen=True)
class Check:
    """A named check; ``run`` returns a result and may raise (reported as fail)."""

    name: str
    run: Callable[[], CheckResult]
    required: bool = False


# Each module, when importable, provides doctor_checks(). Order = print order.
_CHECK_MODULES = (
    "modelexpress.vmm.diagnostics",
    "modelexpress.transfer.diagnostics",
    "modelexpress.shm_arena.diagnostics",
    "modelexpress.local.diagnostics",
    "modelexpress.server.diagnostics",
    "modelexpress.engines.vllm.diagnostics",
)


def _python() -> CheckResult:
    return CheckResult("python", "ok", f"{sys.version.split()[0]} at {sys.executable}")


def _package(module: str, required: bool) -> Callable[[], CheckResult]:
    def run() -> CheckResult:
        from modelexpress._optional import available
        if not available(module):
            return CheckResult(module, "fail" if required else "warn", "not installed")
        mod = importlib.import_module(module)
        version = getattr(mod, "__version__", "installed")
        return CheckResult(module, "ok", str(version))
    return run


def _dev_shm() -> CheckResult:
    if not os.path.isdir("/dev/shm"):
        return CheckResult("/dev/shm", "warn", "missing: the shm tensor arena is unavailable")
    usage = shutil.disk_usage("/dev/shm")
    gib = 1 << 30
    status: Status = "ok" if usage.total >= 1 * gib else "warn"
    return CheckResult("/dev/shm", status,
                       f"{usage.free / gib:.1f} GiB free of {usage.total / gib:.1f} GiB")


def base_checks() -> list[Check]:
    """Checks that belong to no subpackage."""
    return [
        Check("python", _python, required=True),
        Check("torch", _package("torch", required=False)),
        Check("/dev/shm", _dev_shm),
    ]


def _collect() -> list[Check]:
    checks = base_checks()
    for name in _CHECK_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                # The component exists but a dependency of it is missing: report it.
                checks.append(Check(name, _missing(name, exc)))
            continue
        checks.extend(module.doctor_checks())
    return checks


def _missing(name: str, exc: Exception) -> Callable[[], CheckResult]:
    return lambda: CheckResult(name, "warn", f"unavailable: {exc}")


def run_checks(checks: list[Check] | None = None) -> tuple[list[CheckResult], bool]:
    """Run every check. Returns the results and whether all required checks passed."""
    results: list[CheckResult] = []
    healthy = True
    for check in checks if checks is not None else _collect():
        try:
            result = check.run()
        except Exception as exc:  # noqa: BLE001 - a crashing check is a failed check
            log.debug("check %s raised", check.name, exc_info=True)
            result = CheckResult(check.name, "fail", f"{type(exc).__name__}: {exc}")
        if result.status == "fail" and not check.required:
            result = dataclasses.replace(result, status="warn")
        if result.status == "fail":
            healthy = False
        results.append(result)
    return results, healthy


def render(results: list[CheckResult]) -> str:
    """Human-readable report, one line per check."""
    marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "info": "info"}
    width = max((len(r.name) for r in results), default=0)
    return "\n".join(f"[{marks[r.status]}] {r.name:<{width}}  {r.detail}" for r in results)
