"""`modelexpress doctor` checks of the data plane: NIXL, its plugins, UCX transports."""

from __future__ import annotations

import os
import pathlib

from modelexpress.doctor import Check, CheckResult

__all__ = ["doctor_checks", "ucx_transport_modules", "nixl_plugin_files"]

# UCX transports compiled into libuct itself (no module file): always present.
_BUILTIN_TLS = ("self", "tcp", "posix", "sysv")
# UCX module file -> the transports it provides.
_MODULE_TLS = {
    "cma": ("cma",),
    "cuda": ("cuda_copy", "cuda_ipc"),
    "gdrcopy": ("gdr_copy",),
    "ib": ("rc_verbs", "ud_verbs"),
    "ib_mlx5": ("rc_mlx5", "dc_mlx5", "ud_mlx5"),
    "knem": ("knem",),
    "xpmem": ("xpmem",),
}


def _libs_dir() -> pathlib.Path | None:
    from modelexpress.transfer.nixl_adapter import nixl_module
    mod = nixl_module()
    site = pathlib.Path(mod.__file__ or "").parent.parent
    libs = site / f"{mod.__name__}.libs"
    return libs if libs.is_dir() else None


def nixl_plugin_files() -> list[str]:
    """NIXL plugin names shipped with the wheel (or in ``NIXL_PLUGIN_DIR``)."""
    dirs = [pathlib.Path(p) for p in os.environ.get("NIXL_PLUGIN_DIR", "").split(":") if p]
    libs = _libs_dir()
    if libs is not None:
        dirs.append(libs / "nixl")
    names = {f.name.removeprefix("libplugin_").split(".so")[0]
             for d in dirs if d.is_dir() for f in d.glob("libplugin_*.so*")}
    return sorted(names)


def ucx_transport_modules() -> list[str]:
    """UCX transports available to NIXL's bundled UCX (built-in plus module files)."""
    dirs = [pathlib.Path(p) for p in os.environ.get("UCX_MODULE_DIR", "").split(":") if p]
    libs = _libs_dir()
    if libs is not None:
        dirs.append(libs / "ucx")
    tls = list(_BUILTIN_TLS)
    for d in dirs:
        for f in sorted(d.glob("libuct_*.so*")):
            module = f.name.removeprefix("libuct_").split(".so")[0]
            for tl in _MODULE_TLS.get(module, ()):
                if tl not in tls:
                    tls.append(tl)
    return tls


def _nixl() -> CheckResult:
    from modelexpress._optional import available
    if not any(available(m) for m in ("nixl", "nixl_cu13", "nixl_cu12")):
        return CheckResult("nixl", "fail", "not installed: pip install 'modelexpress[nixl]'")
    from modelexpress.transfer.nixl_adapter import nixl_module
    mod = nixl_module()
    return CheckResult("nixl", "ok", f"{mod.__name__} at {pathlib.Path(mod.__file__ or '').parent}")


def _plugins() -> CheckResult:
    from modelexpress.transfer.nixl_adapter import NixlAgent
    agent = NixlAgent()
    try:
        plugins = agent.plugins()
        mems = agent.mem_types()
    finally:
        agent.close()
    status = "ok" if "UCX" in plugins else "fail"
    return CheckResult("nixl plugins", status,
                       f"{', '.join(plugins)}; UCX serves {', '.join(mems)}")


def _ucx() -> CheckResult:
    tls = ucx_transport_modules()
    env = os.environ.get("UCX_TLS")
    note = f"; UCX_TLS={env}" if env else ""
    gpu = "cuda_ipc" in tls
    detail = f"{', '.join(tls)}{note}" + ("" if gpu else " (no cuda_ipc: GPU peers need nixl-cu13)")
    whole = os.environ.get("UCX_CUDA_COPY_REG_WHOLE_ALLOC")
    if whole:
        detail += f"; UCX_CUDA_COPY_REG_WHOLE_ALLOC={whole}"
    from modelexpress.transfer.ucx_report import configure
    report = configure()  # where results read the transport UCX used
    detail += (f"; protocol report: {report.pattern}" if report.pattern is not None
               else f"; transports not observable: {report.reason}")
    return CheckResult("ucx transports", "ok" if "tcp" in tls else "warn", detail)


def doctor_checks() -> list[Check]:
    """The data-plane checks `modelexpress doctor` runs."""
    return [Check("nixl", _nixl), Check("nixl plugins", _plugins), Check("ucx transports", _ucx)]
