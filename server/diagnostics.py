"""Doctor checks of the control plane: dependencies, and whether MX_SERVER_URL answers."""

from __future__ import annotations

from modelexpress.doctor import Check, CheckResult
from modelexpress._optional import available

__all__ = ["doctor_checks"]


def _deps() -> CheckResult:
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if not available(m)]
    if missing:
        return CheckResult("server deps", "warn",
                           f"missing {missing}: pip install 'modelexpress[server]'")
    redis = "redis client installed" if available("redis") else "no redis client (SQLite only)"
    return CheckResult("server deps", "ok", f"fastapi, uvicorn, prometheus_client; {redis}")


def _reachable() -> CheckResult:
    from modelexpress.client import MxClient
    from modelexpress.errors import ControlPlaneError
    from modelexpress.settings import MxSettings

    settings = MxSettings.load()
    try:
        with MxClient.from_settings(settings, timeout_s=2.0, retries=0) as client:
            health = client.health()
    except ControlPlaneError as exc:
        return CheckResult("control plane", "info",
                           f"{settings.server_url} not reachable ({exc}); fine if not deployed yet")
    return CheckResult("control plane", "ok",
                       f"{settings.server_url}: {health['status']} (store {health['store']})")


def doctor_checks() -> list[Check]:
    """Server checks; none is required (a worker machine need not run a server)."""
    return [Check("server deps", _deps), Check("control plane", _reachable)]
