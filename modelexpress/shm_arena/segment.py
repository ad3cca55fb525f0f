"""A named POSIX shared-memory segment: create, attach, pre-fault, close, unlink.

Why not :class:`multiprocessing.shared_memory.SharedMemory`: it registers every
segment with the ``resource_tracker`` (which then unlinks segments it did not
create, the bug vLLM patches around), and it cannot pass ``MAP_POPULATE`` or
release the GIL while pages are faulted in. On Linux ``shm_open`` is exactly
``open("/dev/shm/NAME")``, so this module does that directly.

Only the creator unlinks, and only in the process that created it: a forked
child inherits the creator's Python object, and its garbage collection must not
remove a segment the parent still serves.

A creator killed before it could close (SIGKILL, or vLLM's default shutdown,
which force-kills its engine core and workers without waiting) must not leave
its segment behind either: the creating process registers the name with
``multiprocessing``'s resource tracker (the creator only, never an attaching
reader), which unlinks it once every process sharing that tracker has exited;
a clean close unregisters it. This is the same crash cleanup vLLM's own ring
buffers rely on.
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing.resource_tracker as resource_tracker
import os
import secrets
import shutil
import threading
import time

from modelexpress.errors import ShmArenaError, ShmSpaceError
from modelexpress.shm_arena import atomics

__all__ = ["SHM_DIR", "ShmSegment", "check_shm_free_space", "segment_path"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_MIB = 1 << 20
# Pre-faulting works in chunks so close() can stop it between two of them.
_POPULATE_CHUNK = 64 * _MIB


def segment_path(name: str) -> str:
    """Path of segment ``name`` under ``/dev/shm``."""
    return os.path.join(SHM_DIR, name)


def check_shm_free_space(required_bytes: int, what: str, shm_dir: str = SHM_DIR) -> None:
    """Fail fast when ``shm_dir`` cannot hold ``required_bytes`` more.

    tmpfs lets ``ftruncate`` succeed beyond its capacity; the process then dies of
    SIGBUS on the first write past it, far from the cause. This turns that into
    an error at creation time.

    Raises:
        ShmSpaceError: too little free space; says how much is free and needed.
    """
    if not os.path.isdir(shm_dir):
        raise ShmSpaceError(f"{shm_dir} does not exist: the shm tensor arena needs POSIX "
                            "shared memory (mount a tmpfs there)")
    free = shutil.disk_usage(shm_dir).free
    if required_bytes > free:
        raise ShmSpaceError(
            f"{what} needs {required_bytes / _MIB:.0f} MiB in {shm_dir} but only "
            f"{free / _MIB:.0f} MiB are free. Enlarge {shm_dir} (docker: --shm-size or "
            "--ipc=host; Kubernetes: an emptyDir with medium: Memory mounted there) or "
            "lower MX_SHM_ARENA_BYTES.")


class ShmSegment:
    """One mapping of a named shared-memory segment.

    Use :meth:`create` (the writer) or :meth:`attach` (readers). ``mm`` is the
    read-write ``mmap``; ``close()`` is idempotent and unlinks when this process
    created the segment.
    """

    def __init__(self, name: str, mm: mmap.mmap, size: int, creator_pid: int | None) -> None:
        self.name = name
        self.mm = mm
        self.size = size
        self._creator_pid = creator_pid
        self._closed = False
        self._stop_populate = threading.Event()
        self._populate_thread: threading.Thread | None = None
        self._populated = threading.Event()
        self.populate_seconds: float | None = None
        self.populate_method: str | None = None

    # --- construction --------------------------------------------------------
    @classmethod
    def create(cls, size: int, prefix: str = "mx_shm_arena") -> "ShmSegment":
        """Create a new segment of ``size`` bytes (zero-filled, lazily paged).

        Raises:
            ShmSpaceError: ``/dev/shm`` lacks the space.
            ShmArenaError: the OS refused to create or map it.
        """
        check_shm_free_space(size, f"a {size / _MIB:.0f} MiB shm tensor arena")
        name = f"{prefix}_{os.getpid()}_{secrets.token_hex(6)}"
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise ShmArenaError(f"cannot create shared-memory segment {path}: {exc}") from exc
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            _unlink_quietly(path)
            raise ShmArenaError(f"cannot size/map {path} ({size} bytes): {exc}") from exc
        os.close(fd)  # the mapping keeps the segment; the fd is not needed
        _track(name)
        log.debug("created shm segment %s (%d bytes)", name, size)
        return cls(name, mm, size, creator_pid=os.getpid())

    @classmethod
    def attach(cls, name: str, min_size: int) -> "ShmSegment":
        """Map an existing segment by name.

        Raises:
            ShmArenaError: no such segment (the writer closed it, or this process
                is on another node), or it is smaller than ``min_size``.
        """
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            raise ShmArenaError(
                f"shm tensor arena segment {path} does not exist: the writer closed it, "
                "or this reader is not on the writer's node") from exc
        try:
            size = os.fstat(fd).st_size
            if size < min_size:
                raise ShmArenaError(
                    f"segment {path} has {size} bytes, the handle says at least {min_size}")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, mm, size, creator_pid=None)

    # --- pre-faulting --------------------------------------------------------
    def start_populate(self, start: int = 0) -> None:
        """Fault the pages from ``start`` to the end in, in a background thread.

        Why: the first write into a fresh tmpfs page allocates and zeroes it, which
        makes a copy into a never-used region 4-5x slower than into a warm one (the
        cold first messages of vLLM's tensor arena). Faulting the whole segment in at
        creation, off the caller's thread, makes every message a warm copy.
        """
        if self._populate_thread is not None:
            return
        thread = threading.Thread(target=self._populate, args=(start,),
                                  name=f"mx-shm-populate-{self.name}", daemon=True)
        self._populate_thread = thread
        thread.start()

    def _populate(self, start: int) -> None:
        began = time.monotonic()
        try:
            offset = start
            while offset < self.size and not self._stop_populate.is_set():
                length = min(_POPULATE_CHUNK, self.size - offset)
                self.populate_method = atomics.populate(self.mm, offset, length)
                offset += length
            self.populate_seconds = time.monotonic() - began
            log.debug("pre-faulted %s: %d bytes in %.3f s (%s)", self.name, self.size - start,
                      self.populate_seconds, self.populate_method)
        except (OSError, ValueError) as exc:
            # Not fatal: a cold page only makes its first copy slower.
            log.warning("pre-faulting shm segment %s stopped: %s", self.name, exc)
        finally:
            self._populated.set()

    def wait_populated(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for pre-faulting; True when it finished."""
        if self._populate_thread is None:
            return True
        return self._populated.wait(timeout)

    # --- teardown ------------------------------------------------------------
    @property
    def is_creator(self) -> bool:
        """True in the process that created the segment (not in forked children)."""
        return self._creator_pid == os.getpid()

    def close(self) -> None:
        """Unmap (when no view remains) and, in the creating process, unlink. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_populate.set()
        thread = self._populate_thread
        if thread is not None and thread is not threading.current_thread():
            # One chunk takes tens of ms; bounded so close never hangs.
            thread.join(timeout=10.0)
        if self.is_creator:
            _unlink_quietly(segment_path(self.name))
            _untrack(self.name)
        try:
            self.mm.close()
        except BufferError:
            # Tensors still view the mapping: leave it mapped (it goes with the
            # process). The name is already unlinked above, so nothing leaks.
            log.debug("segment %s still has live views; leaving it mapped", self.name)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed


# The resource tracker's type whose cleanup is shm_unlink(); names carry the
# leading slash, as multiprocessing.shared_memory registers them.
_TRACKER_TYPE = "shared_memory"


def _track(name: str) -> None:
    """Have the resource tracker unlink ``name`` if this process dies without closing it."""
    try:
        resource_tracker.register(f"/{name}", _TRACKER_TYPE)
    except OSError as exc:
        # Not fatal: only crash cleanup is lost; a normal close still unlinks.
        log.warning("could not register shm segment %s with the resource tracker (a "
                    "crash would leave it in %s): %s", name, SHM_DIR, exc)


def _untrack(name: str) -> None:
    try:
        resource_tracker.unregister(f"/{name}", _TRACKER_TYPE)
    except OSError as exc:
        log.debug("could not unregister shm segment %s from the resource tracker: %s",
                  name, exc)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not unlink %s: %s", path, exc)
