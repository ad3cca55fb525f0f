"""Small checkpoints for the storage tests (a module of its own: test folders each have a
``conftest`` and import helpers by unique names)."""

from __future__ import annotations

import pathlib

__all__ = ["BUCKET", "small_checkpoint"]

BUCKET = "mx-tests"


def small_checkpoint(directory: pathlib.Path, *, shard_bytes: int = 96 << 10,
                     seed: int = 5) -> pathlib.Path:
    """A sharded safetensors checkpoint of ~300 KB: tensors of several dtypes and sizes
    (a large one cut into several ranges, small ones that share a range)."""
    import torch

    from modelexpress.checkpoint import save_checkpoint

    gen = torch.Generator().manual_seed(seed)
    tensors = {"embed.weight": torch.rand(200, 128, generator=gen).to(torch.bfloat16)}
    for i in range(6):
        tensors[f"layers.{i}.norm.weight"] = torch.rand(128, generator=gen)
        tensors[f"layers.{i}.proj.weight"] = torch.rand(64, 128, generator=gen).to(torch.float16)
        tensors[f"layers.{i}.step"] = torch.tensor([i], dtype=torch.int64)
    tensors["lm_head.weight"] = torch.rand(200, 128, generator=gen).to(torch.bfloat16)
    save_checkpoint(tensors, directory, shard_bytes=shard_bytes)
    return directory
