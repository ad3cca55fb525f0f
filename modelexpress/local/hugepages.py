"""Transparent huge pages for a host pull's new destination memory (``MX_LOCAL_HUGE_PAGES``).

A pull into memory nothing has touched yet (a fresh process's ``torch.empty``, a new
engine's parameters) pays a page fault and a zeroed page per 4 KiB, which costs more
than the copy. In 2 MiB pages the same bytes take 512 times fewer faults: on the
16-core GPU host a fresh process pulled 1 GiB at 1.37 of a warm page-cache load's speed
with its destination advised ``MADV_HUGEPAGE``, against 0.92 without (a probe;
docs/benchmarks.md, "Local transport on host memory"). But where a huge page is memory
the machine has to back first, it is far slower: on the 2-core CI VM the same pull took
three times as long (0.26 of the load). There the guest's free 2 MiB blocks come in two
kinds: blocks it has used before, which fault in at ~0.2 ms, and blocks it never used,
which the hypervisor backs on the first touch at ~3-5 ms each (small pages fault in at
~0.5 ms per 2 MiB). The kernel hands out the used ones first, so no test of a few pages
before the copy can tell what the rest will cost: a probe that timed the first and last
huge pages of a 1 GiB destination found them fast in 3 runs of 3, while the whole
destination then faulted in at 0.87-1.6 s against 0.25 s in small pages (per-page
times, one 1 GiB destination: 50, 511 and 415 fast pages of 511 before the slow ones).

So the choice is by machine, not by test:

* ``auto`` (the default): huge pages where the guest's memory is backed up front: on
  a machine the CPU reports no hypervisor on (bare metal), or with an NVIDIA GPU
  (``/dev/nvidia0``: a GPU passed through to a VM makes the hypervisor pin, and so
  back, all of the guest's memory for the device's DMA). Small pages on other VMs.
* ``on``: huge pages (a VM whose memory is backed otherwise: hugepage-backed or
  preallocated guests).
* ``off``: small pages.

Either way only for a chunk with :data:`MIN_BYTES` of new memory, and only where the
kernel's transparent huge pages are ``madvise``: under ``always`` every large
allocation gets them anyway, under ``never`` none can be had. No byte changes: the
advice only chooses the page size of pages not yet faulted in.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from modelexpress.local.pages import MADV_HUGEPAGE, madvise, resident

__all__ = ["MODES", "MIN_BYTES", "HugePages", "backed_up_front", "thp_mode"]

MODES = ("auto", "on", "off")
# Huge pages only for a chunk with at least this much new destination memory: a fresh
# process's pull on the 16-core host was slower with them at 70 MB (12.8 ms against
# 10.3) and faster at 1 GiB (52.0 ms against 77.4); between the two nothing was measured.
MIN_BYTES = 256 << 20
_HUGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = _THP_ENABLED) -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``;
    "" where the file is missing or unreadable)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


@functools.lru_cache(maxsize=None)
def _thp_mode_once() -> str:
    # A pull asks at every chunk; the mode is an administrator's setting, not re-read.
    return thp_mode()


@functools.lru_cache(maxsize=None)
def backed_up_front(cpuinfo: str = "/proc/cpuinfo", gpu: str = "/dev/nvidia0") -> bool:
    """Whether this machine's memory is backed before the guest touches it: no
    ``hypervisor`` CPU flag (bare metal), or an NVIDIA GPU (``gpu`` exists: passed
    through to a VM, it makes the hypervisor pin all guest memory)."""
    if os.path.exists(gpu):
        return True
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return "hypervisor" not in line.split(":", 1)[1].split()
    except OSError:
        pass
    return False


class HugePages:
    """The huge-page choice of one pull: :meth:`advise` each host chunk's copies before
    they run.

    Args:
        mode: ``auto``, ``on`` or ``off`` (see the module's docstring).
        kernel_mode: the kernel's THP mode (default: :func:`thp_mode`).

    Attributes:
        on: whether this pull advises large new destinations ``MADV_HUGEPAGE``.
        used: whether it did (a chunk had :data:`MIN_BYTES` of new memory).
    """

    def __init__(self, mode: str = "auto", kernel_mode: str | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"huge pages mode {mode!r}: use one of {', '.join(MODES)}")
        self.mode = mode
        self._kernel_mode = kernel_mode
        self.used = False

    @functools.cached_property
    def kernel(self) -> str:
        """The kernel's THP mode (:func:`thp_mode`, read once per process unless given)."""
        return _thp_mode_once() if self._kernel_mode is None else self._kernel_mode

    @functools.cached_property
    def on(self) -> bool:
        return self.kernel == "madvise" and (
            self.mode == "on" or (self.mode == "auto" and backed_up_front()))

    def faults_huge(self, copies: Sequence[tuple[int, int, int, int]]) -> bool:
        """:meth:`advise` these copies; then whether their new destination pages fault
        in as huge pages: advised here, or the kernel gives every large anonymous
        mapping huge pages (THP ``always``)."""
        return self.advise(copies) or self.kernel == "always"

    def advise(self, copies: Sequence[tuple[int, int, int, int]]) -> bool:
        """Advise the new destinations of ``(segment, offset, dst_addr, nbytes)`` runs
        ``MADV_HUGEPAGE`` where this pull uses huge pages and they hold at least
        :data:`MIN_BYTES`. Best effort: a refused advice leaves small pages.

        Returns:
            Whether this chunk's new destinations were advised (at least one range).
        """
        if self.mode == "off" or sum(c[3] for c in copies) < MIN_BYTES or not self.on:
            return False
        # Each destination's whole 2 MiB-aligned interior; the pages at its ends may be
        # shared with a neighbour already landed.
        ranges = [(lo, hi) for lo, hi in
                  (((dst + _HUGE - 1) & ~(_HUGE - 1), (dst + n) & ~(_HUGE - 1))
                   for _, _, dst, n in copies)
                  if hi - lo >= _HUGE and not resident(lo, hi - lo)]
        if sum(hi - lo for lo, hi in ranges) < MIN_BYTES:
            return False
        advised = False
        for lo, hi in ranges:
            advised |= madvise(lo, hi - lo, MADV_HUGEPAGE) == 0
        self.used |= advised
        return advised
