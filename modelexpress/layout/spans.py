"""Box copies as byte runs: what a one-sided READ (NIXL) posts.

A :class:`~.plan.Copy` moves a box of a source tensor into a box of a target tensor.
Over mapped memory (the local transport on the host) torch copies the strided views in
one call; a NIXL READ needs byte runs, one descriptor each, and posts each separately
(about 5 us per descriptor: ``docs/benchmarks.md``). So a copy is cut into the longest
runs contiguous on *both* sides: a row-range of a row-split weight is one run; a
column slice of a row-parallel weight is one run per row.

:func:`covering_span` is the alternative for short runs: read the rows the runs lie
in as one run into a scratch buffer and gather locally; it reads more bytes (the
columns the target does not need) and posts one descriptor. Which wins is measured
(``bench/layout.py``); :func:`split_by_run` applies a threshold.

Numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from modelexpress.layout.model import Box, squeeze_dims

__all__ = ["contiguous_strides", "pair_runs", "pitched_runs", "covering_span", "coalesce_runs"]


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """Element strides of a contiguous tensor of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(shape[d + 1]), 1)
    return strides


def _offset(box: Box, strides: Sequence[int]) -> int:
    return sum(start * s for (start, _), s in zip(box, strides))


def _run_grid(src_box: Box, src_shape: Sequence[int], dst_box: Box, dst_shape: Sequence[int]
              ) -> tuple[int, int, list[int], list[int], list[int], int]:
    """``(src start, dst start, outer sizes, their src strides, their dst strides, run)``
    of a box copy, in elements: the runs are the innermost dimensions contiguous on both
    sides; the outer dimensions index them."""
    sd, dd = squeeze_dims(src_box), squeeze_dims(dst_box)
    sizes = [src_box[d][1] for d in sd]
    if sizes != [dst_box[d][1] for d in dd]:
        raise ValueError(f"boxes {src_box} and {dst_box} do not hold the same elements")
    s_all, d_all = contiguous_strides(src_shape), contiguous_strides(dst_shape)
    s_str, d_str = [s_all[d] for d in sd], [d_all[d] for d in dd]
    s0, d0 = _offset(src_box, s_all), _offset(dst_box, d_all)
    run, k = 1, len(sizes) - 1
    while k >= 0 and s_str[k] == run and d_str[k] == run:
        run *= sizes[k]
        k -= 1
    return s0, d0, sizes[:k + 1], s_str[:k + 1], d_str[:k + 1], run


def pair_runs(src_box: Box, src_shape: Sequence[int], dst_box: Box, dst_shape: Sequence[int],
              itemsize: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Byte offsets of the runs of a box copy, contiguous on both sides.

    Args:
        src_box, src_shape: the box in the source tensor (contiguous, ``src_shape``).
        dst_box, dst_shape: the box in the destination tensor.
        itemsize: bytes per element (both sides share the dtype).

    Returns:
        ``(src_offsets, dst_offsets, run_bytes)``: int64 arrays of equal length (byte
        offsets from each tensor's start, in row-major order of the box) and the bytes
        of every run.
    """
    s0, d0, outer, s_str, d_str, run = _run_grid(src_box, src_shape, dst_box, dst_shape)
    if not outer:
        return (np.array([s0 * itemsize], dtype=np.int64),
                np.array([d0 * itemsize], dtype=np.int64), run * itemsize)
    grids = np.indices(outer, dtype=np.int64).reshape(len(outer), -1)
    src = s0 + (grids * np.array(s_str, dtype=np.int64)[:, None]).sum(axis=0)
    dst = d0 + (grids * np.array(d_str, dtype=np.int64)[:, None]).sum(axis=0)
    return src * itemsize, dst * itemsize, run * itemsize


def pitched_runs(src_box: Box, src_shape: Sequence[int], dst_box: Box,
                 dst_shape: Sequence[int], itemsize: int
                 ) -> tuple[int, int, int, int, int, int] | None:
    """A box copy whose runs lie equally spaced on both sides (the rows of a column
    slice), in bytes: ``(src offset, dst offset, src pitch, dst pitch, run, rows)``;
    None for a copy of one run or of runs that are not equally spaced. What
    :func:`pair_runs` gives as arrays, without making them."""
    s0, d0, outer, s_str, d_str, run = _run_grid(src_box, src_shape, dst_box, dst_shape)
    while (len(outer) > 1 and s_str[-2] == s_str[-1] * outer[-1]
           and d_str[-2] == d_str[-1] * outer[-1]):  # nested evenly on both sides: one
        outer = outer[:-2] + [outer[-2] * outer[-1]]
        s_str, d_str = s_str[:-2] + [s_str[-1]], d_str[:-2] + [d_str[-1]]
    if len(outer) != 1:
        return None
    return (s0 * itemsize, d0 * itemsize, s_str[0] * itemsize, d_str[0] * itemsize,
            run * itemsize, outer[0])


def covering_span(src_box: Box, src_shape: Sequence[int], itemsize: int) -> tuple[int, int]:
    """``(offset, nbytes)`` of the smallest contiguous byte range of the source tensor
    that holds ``src_box``."""
    strides = contiguous_strides(src_shape)
    first = _offset(src_box, strides)
    last = sum((start + size - 1) * s for (start, size), s in zip(src_box, strides))
    if math.prod(size for _, size in src_box) == 0:
        return first * itemsize, 0
    return first * itemsize, (last - first + 1) * itemsize


def coalesce_runs(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge runs that follow each other on both sides (in the order given).

    Returns:
        ``(src, dst, lengths)`` of the merged runs.
    """
    if len(src) <= 1:
        return src, dst, lengths
    joins = (src[:-1] + lengths[:-1] == src[1:]) & (dst[:-1] + lengths[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts], dst[starts], np.add.reduceat(lengths, starts)
