"""Huge pages for a host pull's new destination memory (``local.hugepages``,
``MX_LOCAL_HUGE_PAGES``): what each mode advises, the machine check behind ``auto``, and
real pulls that use them or not."""

from __future__ import annotations

import mmap
import pathlib

import pytest
import torch

from modelexpress.errors import ConfigError
from modelexpress.local import hugepages, pull
from modelexpress.local.hugepages import MIN_BYTES, HugePages, backed_up_front, thp_mode
from modelexpress.local.options import LocalOptions
from modelexpress.local.reader import local_reader_factory
from modelexpress.settings import MxSettings

from .test_transport import _equal, _parts

_HUGE = 2 << 20
THP = thp_mode()
needs_madvise = pytest.mark.skipif(
    THP != "madvise", reason=f"the kernel's transparent huge pages are {THP or 'absent'!r}: "
    "MADV_HUGEPAGE is asked for only under madvise (CI's kernel has madvise)")


def _vmflags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


class _NewMemory:
    """Anonymous mappings nothing has touched (a fresh process's large allocations),
    as uint8 tensors; kept mapped while this object lives."""

    def __init__(self) -> None:
        self.maps: list[mmap.mmap] = []

    def tensor(self, nbytes: int, dtype: torch.dtype = torch.uint8,
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
        m = mmap.mmap(-1, nbytes)
        self.maps.append(m)
        t = torch.frombuffer(m, dtype=dtype, count=nbytes // dtype.itemsize)
        return t.view(shape) if shape is not None else t


def _run(t: torch.Tensor) -> tuple[int, int, int, int]:
    return (0, 0, t.data_ptr(), t.numel() * t.element_size())


def _interior(t: torch.Tensor) -> tuple[int, int]:
    a = t.data_ptr()
    return (a + _HUGE - 1) & ~(_HUGE - 1), (a + t.numel() * t.element_size()) & ~(_HUGE - 1)


@needs_madvise
def test_on_advises_the_aligned_interior_of_large_new_destinations_and_changes_no_byte() -> None:
    new = _NewMemory()
    # two tensors, each half of the threshold and a little more, not 2 MiB-aligned
    a, b = (new.tensor(MIN_BYTES // 2 + (3 << 20) + 4096) for _ in range(2))
    h = HugePages("on")
    assert h.advise([_run(a), _run(b)]) is True
    assert h.on and h.used
    for t in (a, b):
        lo, hi = _interior(t)
        assert "hg" in _vmflags(lo) and "hg" in _vmflags(hi - 1)
        if t.data_ptr() != lo:  # the partial 2 MiB page at its start is not advised
            assert "hg" not in _vmflags(t.data_ptr())
    a.fill_(7)
    b[:] = torch.arange(b.numel(), dtype=torch.int64).to(torch.uint8)
    assert int(a.min()) == int(a.max()) == 7
    assert torch.equal(b[:1024], torch.arange(1024).to(torch.uint8))


@needs_madvise
def test_off_small_chunks_and_touched_memory_are_not_advised() -> None:
    new = _NewMemory()
    big = new.tensor(MIN_BYTES + (4 << 20))
    off = HugePages("off")
    assert off.advise([_run(big)]) is False
    assert not off.on and not off.used and "hg" not in _vmflags(_interior(big)[0])

    small = new.tensor(MIN_BYTES // 4)  # a chunk of less new memory than MIN_BYTES
    h = HugePages("on")
    assert h.advise([_run(small)]) is False
    assert not h.used and "hg" not in _vmflags(_interior(small)[0])

    touched = new.tensor(MIN_BYTES + (4 << 20))
    touched.fill_(1)  # resident: its pages are small already, advice would change nothing
    assert h.advise([_run(touched)]) is False
    assert not h.used and "hg" not in _vmflags(_interior(touched)[0])


def test_auto_asks_for_huge_pages_only_where_memory_is_backed_up_front(
        tmp_path: pathlib.Path) -> None:
    vm, metal, gpu = tmp_path / "vm", tmp_path / "metal", tmp_path / "nvidia0"
    vm.write_text("processor\t: 0\nflags\t\t: fpu sse2 hypervisor avx2\n")
    metal.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    missing = str(tmp_path / "no-gpu")
    assert backed_up_front(str(vm), missing) is False
    assert backed_up_front(str(metal), missing) is True
    gpu.touch()  # a VM with a GPU passed through: its memory is pinned for the device
    assert backed_up_front(str(vm), str(gpu)) is True
    assert backed_up_front(str(tmp_path / "unreadable"), missing) is False

    assert HugePages("auto", kernel_mode="madvise").on is backed_up_front()
    assert HugePages("on", kernel_mode="madvise").on is True
    for kernel in ("always", "never", ""):  # always: the kernel does it; never: impossible
        assert HugePages("on", kernel_mode=kernel).on is False
    with pytest.raises(ValueError, match="auto, on, off"):
        HugePages("yes")


def test_the_setting_reaches_the_local_reader(make_source, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    assert LocalOptions().huge_pages == MxSettings().local_huge_pages == "auto"
    monkeypatch.setenv("MX_LOCAL_HUGE_PAGES", "off")
    options = LocalOptions.from_settings(MxSettings())
    assert options.huge_pages == "off"
    _, manifest = _parts(make_source(mib=4))
    reader = local_reader_factory(options, chunk_bytes=1 << 20, verify=True)(None, manifest)
    assert reader is not None and reader.huge_pages == "off"
    monkeypatch.setenv("MX_LOCAL_HUGE_PAGES", "always")
    with pytest.raises(ValueError, match="auto.*on.*off"):
        MxSettings()


def test_a_pull_into_new_memory_uses_huge_pages_as_asked_and_every_byte_lands(
        make_source, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugepages, "MIN_BYTES", 2 << 20)  # the source's tensors are small
    src = make_source(mib=32)
    endpoint, manifest = _parts(src)
    for mode in ("on", "off", "auto"):
        new = _NewMemory()
        dst = {t.name: new.tensor(t.nbytes, getattr(torch, t.dtype), tuple(t.shape))
               for t in manifest.tensors}
        r = pull(endpoint, manifest, dst, huge_pages=mode)
        want = THP == "madvise" and (mode == "on" or (mode == "auto" and backed_up_front()))
        assert r.huge_pages is want, mode
        assert r.verified == len(manifest.tensors) and _equal(src.seed, src.mib, dst)
        biggest = max(dst.values(), key=lambda t: t.numel() * t.element_size())
        assert ("hg" in _vmflags(_interior(biggest)[0])) is want
    with pytest.raises(ConfigError, match="huge_pages must be one of auto, on, off"):
        pull(endpoint, manifest, dst, huge_pages="yes")
