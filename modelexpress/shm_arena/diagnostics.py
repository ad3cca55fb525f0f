"""`modelexpress doctor` checks of the shm tensor arena: atomics, /dev/shm, a live round trip."""

from __future__ import annotations

import io
import pickle

from modelexpress.doctor import Check, CheckResult

__all__ = ["doctor_checks"]

_MIB = 1 << 20


def _atomics() -> CheckResult:
    from modelexpress.shm_arena import atomics
    if atomics.ATOMICS.available:
        return CheckResult("shm arena atomics", "ok", "C extension (release/acquire)")
    return CheckResult("shm arena atomics", "warn",
                       f"pure-Python fallback (weaker ordering off x86-64): "
                       f"{atomics.ATOMICS.error}; reinstall with a C compiler to build "
                       "modelexpress.shm_arena._atomics")


def _round_trip() -> CheckResult:
    import torch

    from modelexpress.shm_arena import ArenaPickler, ArenaReader, ArenaWriter
    with ArenaWriter(1, 4 * _MIB, n_descriptors=4, prefault=False) as writer:
        with ArenaReader(writer.handle, 0) as reader:
            src = torch.arange(256 * 1024, dtype=torch.int32)
            bio = io.BytesIO()
            ArenaPickler(bio, writer, min_tensor_bytes=1).dump(src)
            out = pickle.loads(bio.getvalue())
            ok = torch.equal(out, src)
            del out
            reader.flush_releases()
            reclaimed = writer.reclaim()
    if not ok or reclaimed != 1:
        return CheckResult("shm arena round trip", "fail",
                           f"bytes equal={ok}, slots reclaimed={reclaimed} (want 1)")
    return CheckResult("shm arena round trip", "ok", "1 MiB diverted, read back, released")


def doctor_checks() -> list[Check]:
    """The arena's checks (none is required: the arena is an opt-in fast path)."""
    return [Check("shm arena atomics", _atomics), Check("shm arena round trip", _round_trip)]
