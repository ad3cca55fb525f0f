"""maybe_enter_vmm_arena: the engine-agnostic arena lifecycle for weight loaders.

An engine loader wraps its weight load in this context manager. ``MX_VMM_ARENA=1``
(read by the entry point into ``MxSettings.vmm_arena`` and passed here as
``enabled``) is a *request*: when the C extension is missing, CUDA is absent, or the
device has no VMM (compute capability < 7.0), the loader gets ``None``, one warning
is logged per reason and process, and the load proceeds normally.

The arena outlives the ``with`` block (the weights live in it); the caller keeps it
and closes it when the weights go. If the load inside the block raises, the arena
is closed (rolled back) and the error propagates.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

from modelexpress.errors import ArenaError, BackendError
from modelexpress.vmm._core import extension_error, load_extension
from modelexpress.vmm.arena import DEFAULT_TOTAL_BYTES, VmmArena

__all__ = ["maybe_enter_vmm_arena", "arena_unavailable_reason"]

log = logging.getLogger(__name__)

_warned: set[str] = set()
_warned_lock = threading.Lock()


def arena_unavailable_reason(device: int = 0) -> str | None:
    """Why the CUDA arena cannot be used on ``device``, or None when it can.

    Checks, in order: the C extension, torch with CUDA, cuda-python, VMM support.
    """
    if load_extension() is None:
        return f"the _alloc_ext C extension is not built ({extension_error()})"
    from modelexpress._optional import available
    if not available("torch"):
        return "torch is not installed"
    import torch
    if not torch.cuda.is_available():
        return "CUDA is not available (no GPU or a CPU build of torch)"
    from modelexpress.vmm.backend import cuda_vmm_supported
    ok, why = cuda_vmm_supported(device)
    return None if ok else why


def _warn_once(reason: str) -> None:
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    log.warning("MX_VMM_ARENA requested but the VMM arena is unavailable: %s; "
                "loading without it (per-tensor registration)", reason)


@contextlib.contextmanager
def maybe_enter_vmm_arena(enabled: bool, device: int = 0,
                          total_bytes: int = DEFAULT_TOTAL_BYTES) -> Iterator[VmmArena | None]:
    """Load inside a VMM arena when requested and possible.

    Args:
        enabled: the request (``MxSettings.vmm_arena``).
        device: CUDA device ordinal the weights load onto.
        total_bytes: virtual range to reserve (``MxSettings.vmm_arena_bytes``).

    Yields:
        The arena (open, allocations of this thread routed into it), or None when
        not enabled or unavailable (then the load runs as usual).

    Raises:
        Whatever the body raises; the arena is closed first.
    """
    if not enabled:
        yield None
        return
    reason = arena_unavailable_reason(device)
    arena: VmmArena | None = None
    if reason is None:
        from modelexpress.vmm.backend import CudaVmmBackend
        try:
            # "auto": chunks exportable as POSIX fds where the device supports it, so
            # the local transport can serve them to peers on this host.
            arena = VmmArena(total_bytes, device, CudaVmmBackend(device, handle_type="auto"),
                             use_extension=True)
        except (ArenaError, BackendError) as exc:
            reason = f"creating the arena failed: {exc}"
    if arena is None:
        _warn_once(reason or "unknown")
        yield None
        return
    from modelexpress.vmm.hook import use_arena
    try:
        with use_arena(arena, device):
            yield arena
    except BaseException:
        log.info("VMM arena load failed on device %d; closing the arena", device)
        arena.close()
        raise
    log.info("VMM arena load done on device %d: %d bytes used, %d chunks",
             device, arena.used_bytes, arena.live_allocation_count)
