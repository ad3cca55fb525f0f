"""Making written files durable: fsync one path, or many at once.

Used where a crash must leave either nothing or a whole result (a checkpoint's
shards, a compiled-artifact set's staged files) before anything is renamed into place.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from modelexpress._threads import MAX_THREADS, run_shared

__all__ = ["fsync_all", "fsync_path"]


def fsync_path(path: "str | os.PathLike[str]") -> None:
    """fsync the file or directory at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(paths: Sequence["str | os.PathLike[str]"]) -> None:
    """fsync every path, from up to :data:`~modelexpress._threads.MAX_THREADS` threads
    (more than the CPUs: the threads wait on the disk); raises the first OSError.

    One fsync after another, verifying and installing vLLM's 495-file compiled set at
    8B took 0.37-0.55 s inside the loader's call (one H100 host, commit 2dda64f);
    issued together, which the file system commits together, 0.16-0.20 s (498 files,
    an H100 host of the same kind in a later run, commit c9ce3f4).
    (``syncfs`` would be one call, but it also waits for every other writer's dirty
    pages on that file system: a checkpoint being downloaded beside the cache.)
    """
    run_shared(paths, fsync_path, threads=MAX_THREADS)
