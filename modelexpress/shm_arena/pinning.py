"""Page-locking the arena mapping in a reader, and the completion events that gate release.

Why pin: a reader's tensor is a view of shared memory; ``tensor.cuda()`` from an
unregistered (pageable) mapping is staged through a bounce buffer at 8-10 GB/s,
from a registered one it is a DMA at ~55 GB/s (H200, ``../shared/GPU.md``).
``cudaHostRegister`` of the whole mapping is done once per reader, lazily, at the
first tensor, and only in a process that already has a CUDA context: creating
a context is not the arena's business (and costs hundreds of MB of GPU memory).

Why events: after pinning, a ``non_blocking`` H2D from the arena really is
asynchronous and may still be reading the slot after the tensor was freed, so
the reader acknowledges such a slot only once an event recorded after the copy
has completed. Unpinned, ``cudaMemcpyAsync`` from pageable memory returns only
after the source was staged, so the slot can be released at once.

A :class:`Pinner` is passed to the reader as an object: :class:`CudaPinner` on a
GPU host, :class:`NoPinner` elsewhere, a test fake in CPU tests.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

__all__ = ["CompletionEvent", "Pinner", "CudaPinner", "NoPinner", "default_pinner"]

log = logging.getLogger(__name__)


class CompletionEvent(Protocol):
    """Something that says whether the work recorded before it has finished."""

    def query(self) -> bool:
        """True when complete; never blocks."""


class Pinner(Protocol):
    """Registers host memory with the device and records completion events."""

    def can_pin(self) -> bool:
        """True when this process has a device context to pin for."""

    def register(self, address: int, nbytes: int) -> bool:
        """Page-lock ``[address, address+nbytes)``; True on success. Never raises."""

    def unregister(self, address: int) -> None:
        """Undo :meth:`register`. Never raises."""

    def record_event(self) -> CompletionEvent | None:
        """An event after all work queued so far on the current stream, or None."""


class NoPinner:
    """No device: nothing is pinned, releases are immediate."""

    def can_pin(self) -> bool:
        return False

    def register(self, address: int, nbytes: int) -> bool:
        return False

    def unregister(self, address: int) -> None:
        return None

    def record_event(self) -> CompletionEvent | None:
        return None


class CudaPinner:
    """``cudaHostRegister`` through torch's cudart binding; events on the current stream."""

    def can_pin(self) -> bool:
        import torch
        # is_initialized: only pin in a process that already made a CUDA context.
        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())

    def register(self, address: int, nbytes: int) -> bool:
        import torch
        began = time.monotonic()
        try:
            err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        except (RuntimeError, AttributeError) as exc:
            log.info("shm arena: cudaHostRegister unavailable (%s); H2D stays pageable", exc)
            return False
        ok = int(err) == 0
        log.info("shm arena: cudaHostRegister(%d MiB) %s in %.3f s", nbytes >> 20,
                 "pinned" if ok else f"failed ({err})", time.monotonic() - began)
        return ok

    def unregister(self, address: int) -> None:
        import torch
        try:
            torch.cuda.cudart().cudaHostUnregister(address)
        except (RuntimeError, AttributeError) as exc:
            # At interpreter exit the context may be gone; the pin dies with the process.
            log.debug("cudaHostUnregister failed: %s", exc)

    def record_event(self) -> CompletionEvent | None:
        import torch
        try:
            event = torch.cuda.Event()
            event.record()
        except RuntimeError as exc:
            log.debug("could not record a CUDA event: %s", exc)
            return None
        return event


def default_pinner() -> Pinner:
    """:class:`CudaPinner` when torch has CUDA, else :class:`NoPinner`."""
    import torch
    return CudaPinner() if torch.cuda.is_available() else NoPinner()
