// flashattn/cuda/attention.h -- what the CUDA kernels (attention.cu) and the code that calls
// them share: a strided view of a tensor, the problem's sizes, the tiling, the shared-memory
// layout of each kernel, and the four launch functions.
//
// Plain C++ plus cudaStream_t/cudaError_t: no torch here, so nvcc compiles attention.cu on its
// own, and the helpers marked FA_HD compile for the host too (the tests check them there).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#if defined(__CUDACC__)
#define FA_HD __host__ __device__
#else
#define FA_HD
#endif

namespace flashattn_cuda {

// A strided [B, H, S, D] tensor: its first element and four strides, in elements. Every tensor
// gets its own View, so a kernel can never borrow one tensor's stride for another. [B, H, S]
// tensors (LSE, delta) are Views with d = 0 and stride_d = 0. Offsets are 64-bit: B*H*S*D can
// exceed 2^31.
template <typename T>
struct View {
    T* data;
    int64_t stride_b, stride_h, stride_s, stride_d;

    FA_HD int64_t offset(int64_t b, int64_t h, int64_t s, int64_t d) const {
        return b * stride_b + h * stride_h + s * stride_s + d * stride_d;
    }
    FA_HD T& at(int64_t b, int64_t h, int64_t s, int64_t d) const { return data[offset(b, h, s, d)]; }
};

// q [B, H, S_q, D]; k, v [B, H_kv, S_k, D] with H a multiple of H_kv (grouped-query attention:
// query head h uses K/V head h / (H / H_kv)). causal as SDPA's is_causal: query i sees key j
// only if j <= i.
struct Problem {
    int B, H, H_kv, S_q, S_k, D;
    float scale;
    bool causal;
};

// How the work is cut: tiles of block_m query rows by block_n keys, thread blocks of
// 32 x threads_y threads (threadIdx.x runs along a row, threadIdx.y across rows).
struct Tiling {
    int block_m, block_n, threads_y;
};

// --------------------------------------------------------------------------------------------
// The masks and loop bounds, in one place (the tests check them on the host)
// --------------------------------------------------------------------------------------------

// Does query row i see key j? Keys past S_k (the padding of the last tile) are never seen, and
// under the causal mask query i sees only keys j <= i (Triton: col_ok & (offs_n <= offs_m)).
FA_HD inline bool sees(const Problem& p, int i, int j) {
    return j < p.S_k && (!p.causal || j <= i);
}

// The backward's mask: as `sees`, and padded query rows (i >= S_q) see nothing either, so their
// P is 0 and they add nothing to dK and dV, whatever their Q, dO, LSE and delta hold.
FA_HD inline bool visible(const Problem& p, int i, int j) {
    return i < p.S_q && sees(p, i, j);
}

// Forward and dQ: a query tile starting at row0 needs keys [0, kv_end). Causal: no key beyond
// the tile's last row (Triton: kv_end = tl.minimum(S_k, (pid_m + 1) * BLOCK_M)).
FA_HD inline int kv_end(const Problem& p, int row0, int block_m) {
    if (!p.causal) return p.S_k;
    return row0 + block_m < p.S_k ? row0 + block_m : p.S_k;
}

// dK/dV: the key tile starting at col0 is seen by query rows >= col0 only, so its loop starts at
// the query tile holding row col0 (Triton: m_start = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M).
FA_HD inline int q_start(const Problem& p, int col0, int block_m) {
    return p.causal ? (col0 / block_m) * block_m : 0;
}

FA_HD inline int cdiv(int a, int b) { return (a + b - 1) / b; }

// --------------------------------------------------------------------------------------------
// Shared memory
// --------------------------------------------------------------------------------------------

// The row pitch of a shared-memory tile: its width rounded up to an odd number. Shared memory
// has 32 banks of 4 bytes; when the 32 threads of a warp read one column of 32 different rows,
// an odd pitch puts those rows in 32 different banks (an even pitch like 64 would put them all
// in one bank, and the warp would wait 32 times).
FA_HD inline int odd_pitch(int cols) { return cols | 1; }

#if defined(FLASHATTN_EMULATION)
float& emulation_out_of_bounds(int r, int c, int rows, int cols);   // tests only: see tests/
#endif

// A [rows, cols] fp32 tile in shared memory.
struct Tile {
    float* ptr;
    int rows, cols, pitch;

    FA_HD float& operator()(int r, int c) const {
#if defined(FLASHATTN_EMULATION)
        if (r < 0 || r >= rows || c < 0 || c >= cols) return emulation_out_of_bounds(r, c, rows, cols);
#endif
        return ptr[r * pitch + c];
    }
};

// Cuts one shared-memory buffer into tiles, one after the other. On the host (base == nullptr)
// it only counts: the launcher sizes the buffer by running the kernel's own carving code.
struct Carver {
    float* base;
    int64_t used;  // floats handed out so far

    FA_HD Tile tile(int rows, int cols) {
        Tile t{base ? base + used : nullptr, rows, cols, odd_pitch(cols)};
        used += int64_t(rows) * t.pitch;
        return t;
    }
    FA_HD float* vec(int n) {
        float* v = base ? base + used : nullptr;
        used += n;
        return v;
    }
};

// Forward: Q [BM, D] and the O accumulator [BM, D] stay; K, V [BN, D] stream through; S (then
// P) [BM, BN]; per query row the running max m, running sum l and this step's rescale alpha.
struct ForwardSmem {
    Tile q, o, k, v, s;
    float *m, *l, *alpha;
};
FA_HD inline ForwardSmem forward_smem(Carver& c, const Tiling& t, int D) {
    ForwardSmem s;
    s.q = c.tile(t.block_m, D);
    s.o = c.tile(t.block_m, D);
    s.k = c.tile(t.block_n, D);
    s.v = c.tile(t.block_n, D);
    s.s = c.tile(t.block_m, t.block_n);
    s.m = c.vec(t.block_m);
    s.l = c.vec(t.block_m);
    s.alpha = c.vec(t.block_m);
    return s;
}

// dQ: Q, dO [BM, D], their LSE and delta, and the dQ accumulator stay; K, V [BN, D] stream
// through; dS [BM, BN].
struct DqSmem {
    Tile q, dO, dq, k, v, ds;
    float *lse, *delta;
};
FA_HD inline DqSmem dq_smem(Carver& c, const Tiling& t, int D) {
    DqSmem s;
    s.q = c.tile(t.block_m, D);
    s.dO = c.tile(t.block_m, D);
    s.dq = c.tile(t.block_m, D);
    s.k = c.tile(t.block_n, D);
    s.v = c.tile(t.block_n, D);
    s.ds = c.tile(t.block_m, t.block_n);
    s.lse = c.vec(t.block_m);
    s.delta = c.vec(t.block_m);
    return s;
}

// dK/dV: K, V [BN, D] and the dK, dV accumulators stay; Q, dO [BM, D] and their LSE and delta
// stream through; the transposed tiles P^T and dS^T [BN, BM].
struct DkdvSmem {
    Tile k, v, dk, dv, q, dO, pT, dsT;
    float *lse, *delta;
};
FA_HD inline DkdvSmem dkdv_smem(Carver& c, const Tiling& t, int D) {
    DkdvSmem s;
    s.k = c.tile(t.block_n, D);
    s.v = c.tile(t.block_n, D);
    s.dk = c.tile(t.block_n, D);
    s.dv = c.tile(t.block_n, D);
    s.q = c.tile(t.block_m, D);
    s.dO = c.tile(t.block_m, D);
    s.pT = c.tile(t.block_n, t.block_m);
    s.dsT = c.tile(t.block_n, t.block_m);
    s.lse = c.vec(t.block_m);
    s.delta = c.vec(t.block_m);
    return s;
}

enum class Kernel : int { forward = 0, delta = 1, dq = 2, dkdv = 3 };

// Bytes of dynamic shared memory a launch of `kernel` needs (the delta kernel needs none).
inline int64_t smem_bytes(Kernel kernel, const Tiling& t, int D) {
    Carver c{nullptr, 0};
    if (kernel == Kernel::forward) forward_smem(c, t, D);
    if (kernel == Kernel::dq) dq_smem(c, t, D);
    if (kernel == Kernel::dkdv) dkdv_smem(c, t, D);
    return c.used * int64_t(sizeof(float));
}

// --------------------------------------------------------------------------------------------
// The launch functions (defined in attention.cu). Each takes raw views, asks for the shared
// memory its kernel needs, launches on `stream` and returns the launch's error. They validate
// nothing else: flashattn/cuda_appendix.py checks shapes, dtypes and devices before calling.
// --------------------------------------------------------------------------------------------
cudaError_t launch_forward(View<const float> q, View<const float> k, View<const float> v,
                           View<float> o, View<float> lse, Problem p, Tiling t, cudaStream_t stream);
cudaError_t launch_delta(View<const float> o, View<const float> dO, View<float> delta,
                         Problem p, Tiling t, cudaStream_t stream);
cudaError_t launch_dq(View<const float> q, View<const float> k, View<const float> v,
                      View<const float> dO, View<const float> lse, View<const float> delta,
                      View<float> dq, Problem p, Tiling t, cudaStream_t stream);
cudaError_t launch_dkdv(View<const float> q, View<const float> k, View<const float> v,
                        View<const float> dO, View<const float> lse, View<const float> delta,
                        View<float> dk, View<float> dv, Problem p, Tiling t, cudaStream_t stream);

}  // namespace flashattn_cuda
