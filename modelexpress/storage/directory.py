"""A checkpoint in a local directory (or on a network filesystem mounted there), read
with ``pread``: :class:`DirectoryStorage`."""

from __future__ import annotations

import os
import threading

from modelexpress.errors import StorageReadError
from modelexpress.storage.base import StorageOptions, StoredFile

__all__ = ["DirectoryStorage"]


class DirectoryStorage:
    """The ``*.safetensors`` files of a directory (or one such file).

    Each file is opened once and read with ``os.preadv`` straight into the caller's
    memory (the GIL is released while the kernel copies), from as many threads as the
    reader runs.

    Args:
        path: the checkpoint directory or file.
        options: unused beyond validation (a local read needs no timeout).

    Raises:
        ConfigError, CheckpointError: as :func:`modelexpress.checkpoint.checkpoint_files`.
    """

    def __init__(self, path: str | os.PathLike[str], options: StorageOptions | None = None
                 ) -> None:
        from modelexpress.checkpoint import checkpoint_files

        self._paths = {p.name: p for p in checkpoint_files(path)}
        self.url = os.path.abspath(os.fspath(path))
        self.bytes_read = 0
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    def files(self) -> list[StoredFile]:
        out = []
        for name, path in sorted(self._paths.items()):
            try:
                out.append(StoredFile(name, os.stat(path).st_size))
            except OSError as exc:
                raise StorageReadError(f"{path}: cannot stat it: {exc.strerror or exc}") from exc
        return out

    def _fd(self, name: str) -> int:
        with self._lock:
            if self._closed:
                raise StorageReadError(f"storage {self.url} is closed")
            fd = self._fds.get(name)
            if fd is None:
                path = self._paths.get(name)
                if path is None:
                    raise StorageReadError(f"{self.url}: no file {name!r} in the checkpoint")
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as exc:
                    raise StorageReadError(f"{path}: cannot open it: "
                                           f"{exc.strerror or exc}") from exc
                self._fds[name] = fd
            return fd

    def read(self, name: str, offset: int, out: memoryview) -> None:
        fd = self._fd(name)
        got = 0
        want = len(out)
        while got < want:
            try:
                n = os.preadv(fd, [out[got:]], offset + got)
            except OSError as exc:
                raise StorageReadError(f"{self._paths[name]}: read of {want} bytes at {offset} "
                                       f"failed: {exc.strerror or exc}") from exc
            if n == 0:
                raise StorageReadError(
                    f"{self._paths[name]}: the file ends {got} bytes into a read of {want} at "
                    f"{offset} (it was truncated or replaced while loading)")
            got += n
        with self._lock:
            self.bytes_read += got

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> "DirectoryStorage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
