// wsum-i32-v1 (modelexpress/transfer/digest.py) of a batch of tensors, for the CUDA
// driver: compiled ahead to PTX by scripts/build_wsum_ptx.sh into _wsum_ptx.py, which
// modelexpress/transfer/_wsum_cuda.py loads with cuModuleLoadData (no compiler at run
// time; the driver caches its own translation of the PTX).
//
// a = sum(w[j]), b = sum((j + 1) * w[j]) over the int32 words w (sign-extended), both
// modulo 2**64, plus the 1-3 tail bytes' little-endian value v as one more word at
// position n_words. Unsigned 64-bit addition and multiplication wrap modulo 2**64, and
// each block adds its partial sums into its tensor's out row with 64-bit atomics: the
// same result in any order, equal bit for bit to the Triton and torch forms.

typedef unsigned long long u64;

#define THREADS 256
#define UNROLL 4

__device__ __forceinline__ u64 sx(int w) { return (u64)(long long)w; }

// Four consecutive words starting at word index i (0-based): positions i+1 .. i+4.
__device__ __forceinline__ void add4(u64& a, u64& b, int4 x, u64 i) {
    u64 s = sx(x.x) + sx(x.y) + sx(x.z) + sx(x.w);
    a += s;
    b += (i + 1) * s + sx(x.y) + 2 * sx(x.z) + 3 * sx(x.w);
}

// One tensor's share for block `blk` of the `nblk` blocks given to it; adds the
// block's (a, b) into out[0], out[1].
__device__ __forceinline__ void wsum_blocks(const int* __restrict__ w, u64 n_words, u64 n_vec,
                                            u64 n_tail, u64* __restrict__ out, u64 blk,
                                            u64 nblk) {
    // n_vec: int4 vectors read from w (0 unless w is 16-byte aligned); the words after
    // them are read one by one.
    u64 a = 0, b = 0;
    const u64 nthreads = nblk * THREADS;
    u64 v = blk * THREADS + threadIdx.x;
    const int4* w4 = reinterpret_cast<const int4*>(w);
    // UNROLL loads in flight per thread before any is used.
    for (; v + (UNROLL - 1) * nthreads < n_vec; v += UNROLL * nthreads) {
        int4 x[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) x[k] = __ldg(w4 + v + k * nthreads);
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) add4(a, b, x[k], 4 * (v + k * nthreads));
    }
    for (; v < n_vec; v += nthreads) add4(a, b, __ldg(w4 + v), 4 * v);
    for (u64 j = 4 * n_vec + blk * THREADS + threadIdx.x; j < n_words; j += nthreads) {
        u64 x = sx(__ldg(w + j));
        a += x;
        b += (j + 1) * x;
    }
    if (blk == 0 && threadIdx.x == 0 && n_tail) {
        const unsigned char* t = reinterpret_cast<const unsigned char*>(w + n_words);
        u64 val = 0;
        for (u64 k = 0; k < n_tail; ++k) val |= (u64)t[k] << (8 * k);
        a += val;
        b += val * (n_words + 1);
    }
    // warp, then block: one pair of atomics per block
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        a += __shfl_down_sync(0xffffffffu, a, off);
        b += __shfl_down_sync(0xffffffffu, b, off);
    }
    __shared__ u64 sa[THREADS / 32], sb[THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) { sa[warp] = a; sb[warp] = b; }
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 ta = 0, tb = 0;
        for (int k = 0; k < THREADS / 32; ++k) { ta += sa[k]; tb += sb[k]; }
        atomicAdd(out, ta);
        atomicAdd(out + 1, tb);
    }
}

// A batch of tensors in one launch. table: n rows of (address, n_words, n_vec, n_tail),
// then n + 1 block offsets (tensor t has blocks first[t] .. first[t + 1] - 1; a tensor
// of no bytes has none). out: n rows of (a, b), zeroed by the caller.
extern "C" __global__ void __launch_bounds__(THREADS)
wsum_i32_many(const u64* __restrict__ table, u64 n, u64* __restrict__ out) {
    const u64* first = table + 4 * n;
    __shared__ u64 mine;
    if (threadIdx.x == 0) {  // the last tensor whose first block is at or before this one
        u64 lo = 0, hi = n - 1;
        while (lo < hi) {
            u64 mid = (lo + hi + 1) / 2;
            if (first[mid] <= blockIdx.x) lo = mid; else hi = mid - 1;
        }
        mine = lo;
    }
    __syncthreads();
    const u64 t = mine;
    const u64* row = table + 4 * t;
    wsum_blocks(reinterpret_cast<const int*>(row[0]), row[1], row[2], row[3], out + 2 * t,
                blockIdx.x - first[t], first[t + 1] - first[t]);
}
