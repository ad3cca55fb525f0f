"""``wsum-i32-v1`` on CUDA tensors in one pass over the data (a Triton kernel).

The torch form in :mod:`~modelexpress.transfer.digest` converts each chunk to int64
and reduces it twice (~28 bytes moved per 4-byte word) and costs several kernel
launches per tensor. This kernel reads each word once: each program walks a
grid-stride set of tiles with int64 accumulators of ``w`` and ``(i + 1) * w`` in
registers and writes one (a, b) pair; program 0 also folds in the tensor's 1-3 tail
bytes. A batch (a chunk of a pull) costs one launch per tensor, all writing into one
buffer, and a single device-to-host copy; the host adds each tensor's pairs.
Integer addition and multiplication wrap modulo 2**64 on the GPU (PTX ``add.s64`` /
``mul.lo.s64``) and in numpy's uint64, so the result is the same digest bit for bit
as the torch and CPU forms (tests compare them on the device, and under Triton's
interpreter on CI).

(A single launch over a table of tensor addresses was tried: the loads through
pointers read from memory were not vectorised and it ran at 137 GB/s against
1.7-2.0 TB/s for this kernel on an H200; bench/digest.py measures this one.)

Imported lazily by ``digest`` only for CUDA tensors where the driver refused the
shipped kernel (``_wsum_cuda``) and Triton is installed (it is wherever vLLM runs);
without it the torch form is used.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["wsum_batch"]

_BLOCK = 2048        # int32 words per tile: 8 per thread with 8 warps
_PROGRAMS_PER_SM = 4


# Lengths are not specialised: tensors of any size reuse one compiled kernel (per
# pointer alignment); ``digest.warm_up`` builds it in the background.
@triton.jit(do_not_specialize=["n_words", "n_tail"])
def _wsum_kernel(w_ptr, b_ptr, n_words, n_tail, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(n_words, BLOCK)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    acc_a = tl.zeros([BLOCK], dtype=tl.int64)
    acc_b = tl.zeros([BLOCK], dtype=tl.int64)
    for tile in range(pid, n_tiles, nprog):
        offs = tl.cast(tile, tl.int64) * BLOCK + lane
        w = tl.load(w_ptr + offs, mask=offs < n_words, other=0).to(tl.int64)
        acc_a += w
        acc_b += w * (offs + 1)
    a = tl.sum(acc_a, axis=0)
    b = tl.sum(acc_b, axis=0)
    # The tail bytes' little-endian value v counts as one more word at position
    # n_words; program 0 adds it.
    words64 = tl.cast(n_words, tl.int64)
    k = tl.arange(0, 4)
    mine = tl.where(pid == 0, n_tail, 0)
    tail = tl.load(b_ptr + words64 * 4 + k, mask=k < mine, other=0).to(tl.int64)
    v = tl.sum(tail << (k.to(tl.int64) * 8), axis=0)
    tl.store(out_ptr + 2 * pid, a + v)
    tl.store(out_ptr + 2 * pid + 1, b + v * (words64 + 1))


_sm_count: dict[int, int] = {}


def _max_programs(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 4  # the interpreter runs programs one by one
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _sm_count:
        _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_count[index] * _PROGRAMS_PER_SM


def wsum_batch(raws: list[torch.Tensor], max_programs: int | None = None
               ) -> list[tuple[int, int]]:
    """``(a, b)`` (unsigned 64-bit) of each tensor's bytes.

    Args:
        raws: contiguous uint8 tensors on one device (CUDA, or CPU under
            ``TRITON_INTERPRET=1``), each starting at a 4-byte aligned address.
        max_programs: grid size cap per tensor (default 4 per SM); tests lower it to
            cross grid-stride boundaries.

    Returns:
        One pair per tensor, in order. Synchronises with the device once.
    """
    if not raws:
        return []
    dev = raws[0].device
    cap = max_programs or _max_programs(dev)
    programs = [0 if r.numel() == 0 else max(1, min(triton.cdiv(r.numel() // 4, _BLOCK), cap))
                for r in raws]
    rows = sum(programs)
    if rows == 0:
        return [(0, 0)] * len(raws)
    out = torch.empty((rows, 2), dtype=torch.int64, device=dev)
    extra = {"num_warps": 8} if dev.type == "cuda" else {}  # CPU: the interpreter
    row = 0
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        for raw, p in zip(raws, programs):
            if p == 0:
                continue
            words, n_tail = divmod(raw.numel(), 4)
            _wsum_kernel[(p,)](raw[:4 * words].view(torch.int32), raw, words, n_tail,
                               out[row:row + p], BLOCK=_BLOCK, **extra)
            row += p
    pairs = out.cpu().numpy().view(np.uint64)  # uint64 sums wrap modulo 2**64
    result, row = [], 0
    for p in programs:
        a, b = pairs[row:row + p].sum(axis=0, dtype=np.uint64) if p else (0, 0)
        result.append((int(a), int(b)))
        row += p
    return result
