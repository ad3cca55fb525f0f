"""`modelexpress doctor` check of the local transport: the host copier's C loop."""

from __future__ import annotations

from modelexpress.doctor import Check, CheckResult

__all__ = ["doctor_checks"]


def _copy_loop() -> CheckResult:
    from modelexpress.local import hostcopy
    name = "local host copy loop"
    if not hostcopy.COPYLOOP.available:
        return CheckResult(name, "warn",
                           f"Python threads (slower on many cores): {hostcopy.COPYLOOP.error}; "
                           "reinstall with a C compiler to build modelexpress.local._copyloop")
    if not hostcopy._xxh3_address():
        return CheckResult(name, "warn",
                           "C extension, but the xxhash package exports no usable "
                           "XXH3_128bits: pulls verifying xxh3 digests copy in Python threads")
    if hostcopy._xxh3_stream_functions() is None:
        return CheckResult(name, "ok",
                           "C extension (reads and xxh3 digests without the GIL; each block "
                           "hashed whole after it lands: the xxhash package exports no "
                           "streaming XXH3, slower on many cores)")
    return CheckResult(name, "ok", "C extension (reads and xxh3 digests without the GIL, "
                                   "each block hashed in order as its pieces land)")


def doctor_checks() -> list[Check]:
    return [Check("local host copy loop", _copy_loop)]
