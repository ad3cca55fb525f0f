"""HostVmmBackend: real memfd pages behind the arena, read back byte for byte."""

from __future__ import annotations

import ctypes
import gc
import os
import random
import subprocess
import sys
import textwrap

import pytest

from modelexpress.errors import BackendError
from modelexpress.vmm import HostVmmBackend, VmmArena

from .conftest import map_count, memfd_mappings, open_fds

PAGE = os.sysconf("SC_PAGE_SIZE")


def _pattern(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def test_write_read_across_many_handles_and_holes(use_extension):
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")  # shown on failure, to reproduce
    rng = random.Random(seed)
    fds0, maps0 = open_fds(), memfd_mappings()
    with VmmArena(1 << 32, backend=HostVmmBackend(), use_extension=use_extension) as arena:
        sizes = [rng.choice([1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE, 70_000, 1 << 20])
                 for _ in range(48)]
        vas = [arena.malloc(s) for s in sizes]
        assert open_fds() == fds0 + 48 and memfd_mappings() == maps0 + 48
        for i, (va, size) in enumerate(zip(vas, sizes)):
            ctypes.memmove(va, _pattern(seed + i, size), size)
        base, used = arena.registered_range()
        freed = set(rng.sample(range(1, 47), 12))
        for i in sorted(freed):
            arena.free(vas[i])
        assert open_fds() == fds0 + 36
        for i, (va, size) in enumerate(zip(vas, sizes)):
            if i not in freed:
                assert ctypes.string_at(va, size) == _pattern(seed + i, size), f"chunk {i}"
        live = arena.live_allocations()
        assert [va for va, _ in live] == [vas[i] for i in range(48) if i not in freed]
        assert all(size % PAGE == 0 for _, size in live)
        assert arena.used_bytes == used == vas[-1] + -(-sizes[-1] // PAGE) * PAGE - base
    assert open_fds() == fds0 and memfd_mappings() == maps0


def test_contiguous_chunks_form_one_range(use_extension):
    """Adjacent chunks from different memfds read as one contiguous buffer."""
    with VmmArena(1 << 30, backend=HostVmmBackend(), use_extension=use_extension) as arena:
        vas = [arena.malloc(PAGE * 4) for _ in range(4)]
        data = _pattern(7, PAGE * 16)
        ctypes.memmove(vas[0], data, len(data))  # one write across 4 handles
        assert ctypes.string_at(arena.base, PAGE * 16) == data
        assert arena.live_allocations() == [(va, PAGE * 4) for va in vas]


def test_unmapped_hole_is_really_unmapped(use_extension):
    """A freed chunk is PROT_NONE again (reads fault), in a fresh process."""
    code = textwrap.dedent(f"""
        import ctypes, sys
        from modelexpress.vmm import HostVmmBackend, VmmArena
        a = VmmArena(1 << 30, backend=HostVmmBackend(), use_extension={use_extension})
        v0, v1 = a.malloc(4096), a.malloc(4096)
        ctypes.memset(v1, 1, 4096)
        a.free(v1)
        print("freed", flush=True)
        ctypes.string_at(v1, 1)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "freed" in proc.stdout
    assert proc.returncode == -11, proc.stderr  # SIGSEGV: the hole is not readable


class _FailAt:
    """The real HostVmmBackend, with one step raising on its nth call."""

    def __init__(self, step: str, nth: int = 1) -> None:
        self.inner = HostVmmBackend()
        self.kind, self.device, self.granularity = "host", 0, self.inner.granularity
        self.step, self.nth, self.n = step, nth, 0

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*args):
            if name == self.step:
                self.n += 1
                if self.n == self.nth:
                    raise BackendError(f"injected {name} failure")
            return fn(*args)
        return call


@pytest.mark.parametrize("step", ["create", "map", "set_access"])
def test_injected_failure_leaks_nothing(use_extension, step):
    fds0, memfds0, maps0 = open_fds(), memfd_mappings(), map_count()
    with VmmArena(1 << 30, backend=_FailAt(step, nth=3), use_extension=use_extension) as arena:
        a, b = arena.malloc(PAGE), arena.malloc(PAGE)
        ctypes.memset(a, 0xAB, PAGE)
        with pytest.raises(BackendError, match="injected"):
            arena.malloc(PAGE)
        assert open_fds() == fds0 + 2 and memfd_mappings() == memfds0 + 2
        assert arena.live_allocations() == [(a, PAGE), (b, PAGE)]
        assert ctypes.string_at(a, PAGE) == b"\xab" * PAGE
        assert arena.malloc(PAGE) == b + PAGE  # the failed slot was given back
    assert open_fds() == fds0 and memfd_mappings() == memfds0
    assert map_count() <= maps0 + 1  # the reservation is gone (maps may merge/split by one)


def test_real_fd_exhaustion_rolls_back(use_extension):
    """memfd_create really fails (RLIMIT_NOFILE) in a fresh process; nothing leaks."""
    code = textwrap.dedent(f"""
        import os, resource
        from modelexpress.errors import BackendError
        from modelexpress.vmm import HostVmmBackend, VmmArena
        a = VmmArena(1 << 30, backend=HostVmmBackend(), use_extension={use_extension})
        n0 = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (n0 + 4, n0 + 4))
        got = []
        try:
            while True:
                got.append(a.malloc(4096))
        except BackendError as exc:
            assert "memfd_create" in str(exc), exc
        assert a.live_allocation_count == len(got) >= 1
        assert a.used_bytes == 4096 * len(got)
        for v in got:
            a.free(v)
        a.close()
        assert len(os.listdir("/proc/self/fd")) <= n0, os.listdir("/proc/self/fd")
        print("ok", len(got))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr


def test_empty_tensor_lives_in_arena_and_is_freed_with_last_view(use_extension):
    torch = pytest.importorskip("torch")
    with VmmArena(1 << 30, backend=HostVmmBackend(), use_extension=use_extension) as arena:
        t = arena.empty((64, 33), torch.float32)
        base, used = arena.registered_range()
        assert base <= t.data_ptr() < base + used and t.is_contiguous()
        t.copy_(torch.arange(64 * 33, dtype=torch.float32).view(64, 33))
        view = t[10:20]
        del t
        gc.collect()
        assert arena.live_allocation_count == 1  # the view keeps the chunk
        assert float(view[0, 0]) == 10 * 33
        raw = ctypes.string_at(arena.base + 10 * 33 * 4, 4)
        assert raw == torch.tensor([330.0]).numpy().tobytes()
        del view
        gc.collect()
        assert arena.live_allocation_count == 0
        z = arena.empty((0, 5), torch.bfloat16)
        assert z.shape == (0, 5)


def test_another_process_reads_the_range(use_extension):
    """A child process's arena, read by us with process_vm_readv (UCX's CMA path)."""
    code = textwrap.dedent(f"""
        import ctypes, random, sys
        from modelexpress.vmm import HostVmmBackend, VmmArena
        a = VmmArena(1 << 30, backend=HostVmmBackend(), use_extension={use_extension})
        vas = [a.malloc(3 * 4096) for _ in range(4)]
        data = random.Random(5).randbytes(4 * 3 * 4096)
        ctypes.memmove(vas[0], data, len(data))
        base, used = a.registered_range()
        print(base, used, flush=True)
        sys.stdin.readline()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        base, used = map(int, line.split())
        libc = ctypes.CDLL(None, use_errno=True)

        class IoVec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

        buf = ctypes.create_string_buffer(used)
        local, remote = IoVec(ctypes.addressof(buf), used), IoVec(base, used)
        libc.process_vm_readv.restype = ctypes.c_ssize_t
        n = libc.process_vm_readv(proc.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n < 0 and ctypes.get_errno() == 1:
            pytest.skip("process_vm_readv not permitted here (ptrace policy)")
        assert n == used == 4 * 3 * 4096
        assert buf.raw == random.Random(5).randbytes(used)
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0


def test_doctor_host_self_test_passes():
    from modelexpress.vmm.diagnostics import doctor_checks
    checks = {c.name: c for c in doctor_checks()}
    result = checks["vmm host self-test"].run()
    assert checks["vmm host self-test"].required
    assert result.status == "ok", result.detail


def test_export_chunks_gives_descriptors_of_the_same_pages(use_extension):
    import mmap as _mmap
    fds0 = open_fds()
    with VmmArena(1 << 30, backend=HostVmmBackend(), use_extension=use_extension) as arena:
        vas = [arena.malloc(n) for n in (PAGE, 3 * PAGE, 70_000)]
        for i, va in enumerate(vas):
            ctypes.memmove(va, _pattern(i, PAGE), PAGE)
        exported = arena.export_chunks()
        assert [(va, size) for va, size, _ in exported] == arena.live_allocations()
        try:
            for i, (va, size, fd) in enumerate(exported):
                with _mmap.mmap(fd, size, prot=_mmap.PROT_READ) as m:
                    assert m[:PAGE] == _pattern(i, PAGE)
        finally:
            for _, _, fd in exported:
                os.close(fd)
        arena.free(vas[0])
        assert [va for va, _, fd in arena.export_chunks() if os.close(fd) is None] == vas[1:]
    assert open_fds() == fds0


def test_an_arena_collected_at_interpreter_exit_is_left_to_the_process_teardown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At exit the interpreter frees objects in no set order: an arena collected then
    must not unmap memory that tensors still to be freed point into (on a GPU, PyTorch
    aborts the exiting process: ``invalid device pointer``). Outside exit, collection
    closes it."""
    arena = VmmArena(1 << 30, backend=HostVmmBackend())
    monkeypatch.setattr(sys, "is_finalizing", lambda: True)
    arena.__del__()
    assert not arena.closed
    monkeypatch.undo()
    arena.__del__()
    assert arena.closed
