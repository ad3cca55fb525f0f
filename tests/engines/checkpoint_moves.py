"""Move a checkpoint's weights out of the way while an engine starts (standard library only:
the CPU and the GPU engine harnesses, the tests and the benches all use it)."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator

__all__ = ["weights_away"]


@contextlib.contextmanager
def weights_away(ckpt: pathlib.Path) -> Iterator[None]:
    """Engines started inside find config and tokenizer but no weights on disk.

    Every ``*.safetensors`` file and the shard index move to a sibling directory (a
    rename: their pages stay cached) and back afterwards, whatever happened inside.
    """
    ckpt = pathlib.Path(ckpt)
    away = ckpt.parent / (ckpt.name + "-weights-away")
    away.mkdir(exist_ok=True)
    moved = [*ckpt.glob("*.safetensors"), *ckpt.glob("*.safetensors.index.json")]
    for file in moved:
        os.replace(file, away / file.name)
    try:
        yield
    finally:
        for file in moved:
            os.replace(away / file.name, file)
        with contextlib.suppress(OSError):
            away.rmdir()
