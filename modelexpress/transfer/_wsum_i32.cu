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
//
// A tensor is contiguous bytes, or rows: equal runs of whole words a fixed pitch apart
// (a column strip of a matrix, hashed where it lies instead of copied out first). Its
// words are taken in logical order, row after row, so both give the same digest as the
// bytes copied out one after the other.

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

// Contiguous words: this thread's share for block `blk` of the `nblk` blocks given to
// the tensor, added into (a, b).
__device__ __forceinline__ void wsum_flat(const int* __restrict__ w, u64 n_words, u64 n_vec,
                                         u64 n_tail, u64& a, u64& b, u64 blk, u64 nblk) {
    // n_vec: int4 vectors read from w (0 unless w is 16-byte aligned); the words after
    // them are read one by one.
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
}

// Item i of a row of `len` items, `step` items on: moved along the rows (step % len
// items, step / len rows) without a division per item.
struct Pos {
    unsigned r, c;
    __device__ __forceinline__ void advance(unsigned dr, unsigned dc, unsigned len) {
        c += dc;
        r += dr;
        if (c >= len) { c -= len; ++r; }
    }
};

// Rows of `row` words, `pitch` words apart (n_words = rows * row): as wsum_flat, the
// words in logical order. n_vec: n_words / 4 when the start, row and pitch allow int4
// loads (16-byte aligned start, row and pitch multiples of 4 words), else 0.
__device__ __forceinline__ void wsum_rows(const int* __restrict__ w, u64 n_words, u64 n_vec,
                                         u64 row, u64 pitch, u64& a, u64& b, u64 blk,
                                         u64 nblk) {
    const u64 nthreads = nblk * THREADS;
    const u64 first = blk * THREADS + threadIdx.x;
    if (n_vec) {
        const unsigned len = (unsigned)(row / 4);
        const u64 pv = pitch / 4;
        const int4* w4 = reinterpret_cast<const int4*>(w);
        const u64 step = UNROLL * nthreads;
        const unsigned dr = (unsigned)(step / len), dc = (unsigned)(step % len);
        Pos p[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const u64 v = first + k * nthreads;
            p[k].r = (unsigned)(v / len);
            p[k].c = (unsigned)(v % len);
        }
        u64 v = first;
        for (; v + (UNROLL - 1) * nthreads < n_vec; v += step) {
            int4 x[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; ++k) x[k] = __ldg(w4 + p[k].r * pv + p[k].c);
#pragma unroll
            for (int k = 0; k < UNROLL; ++k) {
                add4(a, b, x[k], 4 * (v + k * nthreads));
                p[k].advance(dr, dc, len);
            }
        }
        // p[0] is at v
        const unsigned dr1 = (unsigned)(nthreads / len), dc1 = (unsigned)(nthreads % len);
        for (; v < n_vec; v += nthreads) {
            add4(a, b, __ldg(w4 + p[0].r * pv + p[0].c), 4 * v);
            p[0].advance(dr1, dc1, len);
        }
        return;
    }
    const unsigned len = (unsigned)row;
    const unsigned dr = (unsigned)(nthreads / len), dc = (unsigned)(nthreads % len);
    Pos p{(unsigned)(first / len), (unsigned)(first % len)};
    for (u64 j = first; j < n_words; j += nthreads) {
        u64 x = sx(__ldg(w + p.r * pitch + p.c));
        a += x;
        b += (j + 1) * x;
        p.advance(dr, dc, len);
    }
}

// A batch of tensors in one launch. table: n rows of (address, n_words, n_vec, n_tail,
// row, pitch) (row == n_words: contiguous; else rows of `row` words `pitch` words apart,
// n_tail 0), then n + 1 block offsets (tensor t has blocks first[t] .. first[t + 1] - 1;
// a tensor of no bytes has none). out: n rows of (a, b), zeroed by the caller.
extern "C" __global__ void __launch_bounds__(THREADS)
wsum_i32_many(const u64* __restrict__ table, u64 n, u64* __restrict__ out) {
    const u64* first = table + 6 * n;
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
    const u64* row = table + 6 * t;
    const int* w = reinterpret_cast<const int*>(row[0]);
    const u64 blk = blockIdx.x - first[t], nblk = first[t + 1] - first[t];
    u64 a = 0, b = 0;
    if (row[4] == row[1])
        wsum_flat(w, row[1], row[2], row[3], a, b, blk, nblk);
    else
        wsum_rows(w, row[1], row[2], row[4], row[5], a, b, blk, nblk);
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
        atomicAdd(out + 2 * t, ta);
        atomicAdd(out + 2 * t + 1, tb);
    }
}
