"""Checkpoint load/save/generate round trips (real safetensors files)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from modelexpress.checkpoint import (LlamaShape, checkpoint_files, generate_llama_checkpoint,
                                     drop_page_cache, load_checkpoint, page_cache_residency,
                                     real_model_checkpoint, save_checkpoint, time_disk_load)
from modelexpress.errors import ConfigError


def test_save_load_round_trip_shards(tmp_path: pathlib.Path) -> None:
    tensors = {f"t{i}": torch.arange(1000 * (i + 1), dtype=torch.int32) for i in range(5)}
    files = save_checkpoint(tensors, tmp_path, shard_bytes=9000)
    assert len(files) > 1
    loaded = load_checkpoint(tmp_path)
    assert list(loaded) == list(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)
    # loaded tensors own their memory (not views of the file mapping)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size()
               for t in loaded.values())


def test_generated_llama_checkpoint_has_llama_shapes(tmp_path: pathlib.Path) -> None:
    shape = LlamaShape(hidden=256, intermediate=512, heads=8, kv_heads=2, vocab=1000, layers=2)
    generate_llama_checkpoint(tmp_path, shape, seed=3)
    loaded = load_checkpoint(tmp_path)
    assert {n: tuple(t.shape) for n, t in loaded.items()} == dict(shape.tensors())
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())
    again = tmp_path / "again"
    generate_llama_checkpoint(again, shape, seed=3)
    assert all(torch.equal(loaded[n].view(torch.int16), t.view(torch.int16))
               for n, t in load_checkpoint(again).items())
    assert time_disk_load(tmp_path, cold=True) > 0


def _fs_type(path: pathlib.Path) -> str:
    """The filesystem type of the mount that holds ``path`` (/proc/self/mounts)."""
    best, kind = "", ""
    for line in pathlib.Path("/proc/self/mounts").read_text().splitlines():
        mnt, fstype = line.split()[1:3]
        if str(path.resolve()).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
            best, kind = mnt, fstype
    return kind


def test_page_cache_residency_sees_a_read_and_a_drop_without_loading_anything(
        tmp_path: pathlib.Path) -> None:
    shape = LlamaShape(hidden=256, intermediate=512, heads=8, kv_heads=2, vocab=1000, layers=2)
    files = generate_llama_checkpoint(tmp_path, shape)
    total = sum(f.stat().st_size for f in files)
    for f in files:
        f.read_bytes()
    assert page_cache_residency(tmp_path) == (total, total)
    drop_page_cache(tmp_path)
    dropped, seen_total = page_cache_residency(tmp_path)
    assert seen_total == total
    # asking again gives the same answer: the mapping and mincore faulted nothing in
    assert page_cache_residency(tmp_path) == (dropped, total)
    if _fs_type(tmp_path) not in ("tmpfs", "ramfs"):  # there the file IS its page cache
        assert dropped < total // 2, (dropped, total)


def test_real_model_checkpoint_is_present() -> None:
    tensors = load_checkpoint(real_model_checkpoint())
    assert len(tensors) == 104
    assert tensors["embeddings.word_embeddings.weight"].shape == (30522, 384)


def test_bad_paths_are_clear_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        checkpoint_files(tmp_path / "missing")
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        checkpoint_files(tmp_path)


def test_contiguous_load_is_one_aligned_allocation(tmp_path: pathlib.Path) -> None:
    from modelexpress.checkpoint import SLAB_ALIGN, allocate_slab

    tensors = {"a": torch.arange(3, dtype=torch.int8), "b": torch.ones(5, 7),
               "c": torch.zeros(0, dtype=torch.bfloat16), "d": torch.tensor(2.5)}
    save_checkpoint(tensors, tmp_path)
    loaded = load_checkpoint(tmp_path, contiguous=True)
    assert len({t.untyped_storage().data_ptr() for t in loaded.values()}) == 1
    assert all(t.data_ptr() % SLAB_ALIGN == 0 for t in loaded.values() if t.numel())
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    slab = allocate_slab([("x", (4, 4), torch.float16), ("y", (), torch.int64)])
    assert slab["x"].shape == (4, 4) and slab["y"].shape == ()
