// flashattn/cuda/attention.cu -- the course's attention kernels in plain CUDA C++.
//
// The same four kernels as the Triton lessons (flashattn/forward.py, flashattn/backward.py),
// written to be read side by side with them:
//
//     attn_fwd_kernel        O = softmax(Q K^T * scale) V and LSE, online softmax
//     attn_bwd_delta_kernel  delta = rowsum(dO * O)
//     attn_bwd_dq_kernel     dQ = dS K * scale            (a thread block owns a tile of Q rows)
//     attn_bwd_dkdv_kernel   dV = P^T dO, dK = dS^T Q * scale   (a block owns a tile of K/V rows)
//
// with P = exp(S - LSE) rebuilt tile by tile and dS = P * (dP - delta), dP = dO V^T.
//
// Everything Triton did for us is written out here: the tiles are loops over (row, column)
// with a stride of the thread block's shape, staged in shared memory; masking is an `if`;
// tl.dot is a loop over the head dimension in each thread; and which thread owns which
// element of an accumulator is our decision, not the compiler's. Inputs and outputs are
// fp32, accumulation is fp32. Teaching code: no tensor cores, no register tiling.
//
// No torch here. The launch functions at the bottom take raw views (pointer + strides) and
// sizes; flashattn/cuda_appendix.py adds the PyTorch binding.
#include <math.h>

#include "attention.h"

namespace flashattn_cuda {

// ============================================================================================
// 1. Forward: one thread block per tile of block_m query rows of one (batch, head)
// ============================================================================================
__global__ void attn_fwd_kernel(View<const float> Q, View<const float> K, View<const float> V,
                                View<float> O, View<float> LSE, Problem p, Tiling t) {
    extern __shared__ float smem[];
    Carver carver{smem, 0};
    const ForwardSmem s = forward_smem(carver, t, p.D);

    const int pid_m = blockIdx.x;                  // which tile of query rows  (tl.program_id(0))
    const int pid_bh = blockIdx.y;                 // which (batch, query head) (tl.program_id(1))
    const int b = pid_bh / p.H, h = pid_bh % p.H;
    const int h_kv = h / (p.H / p.H_kv);           // GQA: a group of query heads shares K/V
    const int BM = t.block_m, BN = t.block_n, D = p.D;
    const int row0 = pid_m * BM;                   // first query row of this tile
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nthreads = blockDim.x * blockDim.y;

    // Load the Q tile (rows past S_q read as 0: Triton's mask=row_ok, other=0.0), zero the O
    // accumulator, start the running max at -inf and the running sum at 0.
    for (int r = threadIdx.y; r < BM; r += blockDim.y)
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            const int i = row0 + r;
            s.q(r, d) = i < p.S_q ? Q.at(b, h, i, d) : 0.f;
            s.o(r, d) = 0.f;
        }
    for (int r = tid; r < BM; r += nthreads) {
        s.m[r] = -INFINITY;
        s.l[r] = 0.f;
    }
    __syncthreads();

    const int end = kv_end(p, row0, BM);
    for (int start_n = 0; start_n < end; start_n += BN) {
        // K and V tiles of this step (keys past S_k read as 0).
        for (int c = threadIdx.y; c < BN; c += blockDim.y)
            for (int d = threadIdx.x; d < D; d += blockDim.x) {
                const int j = start_n + c;
                s.k(c, d) = j < p.S_k ? K.at(b, h_kv, j, d) : 0.f;
                s.v(c, d) = j < p.S_k ? V.at(b, h_kv, j, d) : 0.f;
            }
        __syncthreads();

        // S = Q K^T * scale, -inf where the key is hidden. Each thread computes the elements
        // (r, c) = (threadIdx.y + k * blockDim.y, threadIdx.x + l * blockDim.x): tl.dot by hand.
        // Padded rows (past S_q) are computed on their zero Q row like the others, never stored.
        for (int r = threadIdx.y; r < BM; r += blockDim.y)
            for (int c = threadIdx.x; c < BN; c += blockDim.x) {
                float x = -INFINITY;
                if (sees(p, row0 + r, start_n + c)) {
                    float acc = 0.f;
                    for (int d = 0; d < D; ++d) acc += s.q(r, d) * s.k(c, d);
                    x = acc * p.scale;
                }
                s.s(r, c) = x;
            }
        __syncthreads();

        // Online softmax, one thread per query row: the new running max, the factor alpha that
        // rescales what was accumulated so far, P = exp(S - m_new) in place of S, the new sum.
        // Every row sees key 0 in the first step, so m_new is finite from then on and
        // exp(-inf - m_new) = 0 for hidden keys.
        for (int r = tid; r < BM; r += nthreads) {
            float m_new = s.m[r];
            for (int c = 0; c < BN; ++c) m_new = fmaxf(m_new, s.s(r, c));
            const float alpha = expf(s.m[r] - m_new);
            float sum = 0.f;
            for (int c = 0; c < BN; ++c) {
                const float pr = expf(s.s(r, c) - m_new);
                s.s(r, c) = pr;
                sum += pr;
            }
            s.l[r] = s.l[r] * alpha + sum;
            s.m[r] = m_new;
            s.alpha[r] = alpha;
        }
        __syncthreads();

        // O = O * alpha + P V. Element (r, d) of the accumulator belongs to one thread.
        for (int r = threadIdx.y; r < BM; r += blockDim.y)
            for (int d = threadIdx.x; d < D; d += blockDim.x) {
                float acc = 0.f;
                for (int c = 0; c < BN; ++c) acc += s.s(r, c) * s.v(c, d);
                s.o(r, d) = s.o(r, d) * s.alpha[r] + acc;
            }
        __syncthreads();   // before the next step overwrites K, V and S
    }

    // O = acc / l and LSE = m + log(l) (natural log), stored only for rows < S_q.
    for (int r = threadIdx.y; r < BM; r += blockDim.y)
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            const int i = row0 + r;
            if (i < p.S_q) O.at(b, h, i, d) = s.o(r, d) / s.l[r];
        }
    for (int r = tid; r < BM; r += nthreads) {
        const int i = row0 + r;
        if (i < p.S_q) LSE.at(b, h, i, 0) = s.m[r] + logf(s.l[r]);
    }
}

// ============================================================================================
// 2. delta = rowsum(dO * O): one thread per query row
// ============================================================================================
__global__ void attn_bwd_delta_kernel(View<const float> O, View<const float> dO,
                                      View<float> Delta, Problem p) {
    const int pid_bh = blockIdx.y;
    const int b = pid_bh / p.H, h = pid_bh % p.H;
    const int i = blockIdx.x * (blockDim.x * blockDim.y) + threadIdx.y * blockDim.x + threadIdx.x;
    if (i >= p.S_q) return;                        // no __syncthreads below: leaving early is safe
    float acc = 0.f;
    for (int d = 0; d < p.D; ++d) acc += O.at(b, h, i, d) * dO.at(b, h, i, d);
    Delta.at(b, h, i, 0) = acc;
}

// ============================================================================================
// 3. dQ: one thread block per tile of block_m query rows, looping over the key tiles
// ============================================================================================
__global__ void attn_bwd_dq_kernel(View<const float> Q, View<const float> K, View<const float> V,
                                   View<const float> dO, View<const float> LSE,
                                   View<const float> Delta, View<float> dQ, Problem p, Tiling t) {
    extern __shared__ float smem[];
    Carver carver{smem, 0};
    const DqSmem s = dq_smem(carver, t, p.D);

    const int pid_m = blockIdx.x;
    const int pid_bh = blockIdx.y;
    const int b = pid_bh / p.H, h = pid_bh % p.H;
    const int h_kv = h / (p.H / p.H_kv);
    const int BM = t.block_m, BN = t.block_n, D = p.D;
    const int row0 = pid_m * BM;
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nthreads = blockDim.x * blockDim.y;

    // Everything that depends only on this tile of rows is loaded once, before the loop.
    for (int r = threadIdx.y; r < BM; r += blockDim.y)
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            const int i = row0 + r;
            s.q(r, d) = i < p.S_q ? Q.at(b, h, i, d) : 0.f;
            s.dO(r, d) = i < p.S_q ? dO.at(b, h, i, d) : 0.f;
            s.dq(r, d) = 0.f;
        }
    for (int r = tid; r < BM; r += nthreads) {
        const int i = row0 + r;
        s.lse[r] = i < p.S_q ? LSE.at(b, h, i, 0) : 0.f;
        s.delta[r] = i < p.S_q ? Delta.at(b, h, i, 0) : 0.f;
    }
    __syncthreads();

    const int end = kv_end(p, row0, BM);           // causal: keys past the tile's last row are hidden
    for (int start_n = 0; start_n < end; start_n += BN) {
        for (int c = threadIdx.y; c < BN; c += blockDim.y)
            for (int d = threadIdx.x; d < D; d += blockDim.x) {
                const int j = start_n + c;
                s.k(c, d) = j < p.S_k ? K.at(b, h_kv, j, d) : 0.f;
                s.v(c, d) = j < p.S_k ? V.at(b, h_kv, j, d) : 0.f;
            }
        __syncthreads();

        // The dS tile, element by element: rebuild P = exp(S - LSE) from the forward's LSE
        // (0 where hidden or padded), dP = dO V^T, dS = P * (dP - delta).
        for (int r = threadIdx.y; r < BM; r += blockDim.y)
            for (int c = threadIdx.x; c < BN; c += blockDim.x) {
                float ds = 0.f;
                if (visible(p, row0 + r, start_n + c)) {
                    float qk = 0.f, dp = 0.f;
                    for (int d = 0; d < D; ++d) {
                        qk += s.q(r, d) * s.k(c, d);
                        dp += s.dO(r, d) * s.v(c, d);
                    }
                    const float pr = expf(qk * p.scale - s.lse[r]);
                    ds = pr * (dp - s.delta[r]);
                }
                s.ds(r, c) = ds;
            }
        __syncthreads();

        // dQ += dS K. Element (r, d) of the accumulator belongs to one thread.
        for (int r = threadIdx.y; r < BM; r += blockDim.y)
            for (int d = threadIdx.x; d < D; d += blockDim.x) {
                float acc = 0.f;
                for (int c = 0; c < BN; ++c) acc += s.ds(r, c) * s.k(c, d);
                s.dq(r, d) += acc;
            }
        __syncthreads();
    }

    // S = Q K^T * scale, so dQ = dS K * scale: the scale once, at the end; store rows < S_q.
    for (int r = threadIdx.y; r < BM; r += blockDim.y)
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            const int i = row0 + r;
            if (i < p.S_q) dQ.at(b, h, i, d) = s.dq(r, d) * p.scale;
        }
}

// ============================================================================================
// 4. dK, dV: one thread block per tile of block_n key rows of one (batch, K/V head), looping
//    over the query heads of its GQA group and, for each, over the query tiles
// ============================================================================================
__global__ void attn_bwd_dkdv_kernel(View<const float> Q, View<const float> K, View<const float> V,
                                     View<const float> dO, View<const float> LSE,
                                     View<const float> Delta, View<float> dK, View<float> dV,
                                     Problem p, Tiling t) {
    extern __shared__ float smem[];
    Carver carver{smem, 0};
    const DkdvSmem s = dkdv_smem(carver, t, p.D);

    const int pid_n = blockIdx.x;                  // which tile of key/value rows
    const int pid_bh = blockIdx.y;                 // which (batch, K/V head)
    const int b = pid_bh / p.H_kv, h_kv = pid_bh % p.H_kv;
    const int group = p.H / p.H_kv;
    const int BM = t.block_m, BN = t.block_n, D = p.D;
    const int col0 = pid_n * BN;                   // first key of this tile
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nthreads = blockDim.x * blockDim.y;

    // K and V of this tile stay for the whole kernel; the accumulators start at 0.
    for (int n = threadIdx.y; n < BN; n += blockDim.y)
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            const int j = col0 + n;
            s.k(n, d) = j < p.S_k ? K.at(b, h_kv, j, d) : 0.f;
            s.v(n, d) = j < p.S_k ? V.at(b, h_kv, j, d) : 0.f;
            s.dk(n, d) = 0.f;
            s.dv(n, d) = 0.f;
        }

    const int m_start = q_start(p, col0, BM);      // causal: rows before the tile see none of it
    for (int g = 0; g < group; ++g) {              // GQA: every query head of the group adds here
        const int h = h_kv * group + g;
        for (int start_m = m_start; start_m < p.S_q; start_m += BM) {
            __syncthreads();                       // everyone is done with the previous Q tile
            for (int r = threadIdx.y; r < BM; r += blockDim.y)
                for (int d = threadIdx.x; d < D; d += blockDim.x) {
                    const int i = start_m + r;
                    s.q(r, d) = i < p.S_q ? Q.at(b, h, i, d) : 0.f;
                    s.dO(r, d) = i < p.S_q ? dO.at(b, h, i, d) : 0.f;
                }
            for (int r = tid; r < BM; r += nthreads) {
                const int i = start_m + r;
                s.lse[r] = i < p.S_q ? LSE.at(b, h, i, 0) : 0.f;
                s.delta[r] = i < p.S_q ? Delta.at(b, h, i, 0) : 0.f;
            }
            __syncthreads();

            // The transposed tiles, indexed [key n, query r]: P^T = exp(K Q^T * scale - LSE)
            // (0 where hidden or padded: a padded query row must add nothing to dK, dV),
            // dP^T = V dO^T, dS^T = P^T * (dP^T - delta). LSE and delta index the columns.
            for (int n = threadIdx.y; n < BN; n += blockDim.y)
                for (int r = threadIdx.x; r < BM; r += blockDim.x) {
                    float pr = 0.f, ds = 0.f;
                    if (visible(p, start_m + r, col0 + n)) {
                        float qk = 0.f, dp = 0.f;
                        for (int d = 0; d < D; ++d) {
                            qk += s.k(n, d) * s.q(r, d);
                            dp += s.v(n, d) * s.dO(r, d);
                        }
                        pr = expf(qk * p.scale - s.lse[r]);
                        ds = pr * (dp - s.delta[r]);
                    }
                    s.pT(n, r) = pr;
                    s.dsT(n, r) = ds;
                }
            __syncthreads();

            // dV += P^T dO and dK += dS^T Q. Each element (n, d) of an accumulator belongs to
            // exactly one thread -- rows n = threadIdx.y + k * blockDim.y, columns
            // d = threadIdx.x + l * blockDim.x -- which adds into it tile after tile. No other
            // thread ever reads or writes it, so there is no race and no atomic.
            for (int n = threadIdx.y; n < BN; n += blockDim.y)
                for (int d = threadIdx.x; d < D; d += blockDim.x) {
                    float acc = 0.f;
                    for (int r = 0; r < BM; ++r) acc += s.pT(n, r) * s.dO(r, d);
                    s.dv(n, d) += acc;
                }
            for (int n = threadIdx.y; n < BN; n += blockDim.y)   // the rows of dK this thread owns
                for (int d = threadIdx.x; d < D; d += blockDim.x) {
                    float acc = 0.f;
                    for (int r = 0; r < BM; ++r) acc += s.dsT(n, r) * s.q(r, d);
                    s.dk(n, d) += acc;
                }
        }
    }
    __syncthreads();

    // dK = dS^T Q * scale (dV has no scale); store keys < S_k, each element once.
    for (int n = threadIdx.y; n < BN; n += blockDim.y)
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            const int j = col0 + n;
            if (j < p.S_k) {
                dK.at(b, h_kv, j, d) = s.dk(n, d) * p.scale;
                dV.at(b, h_kv, j, d) = s.dv(n, d);
            }
        }
}

// ============================================================================================
// 5. The launch layer: grids, thread blocks, shared memory
// ============================================================================================
namespace {

// More than 48 KB of dynamic shared memory per block must be asked for, kernel by kernel.
template <typename KernelFn>
cudaError_t allow_smem(KernelFn kernel, int64_t bytes) {
    if (bytes <= 48 * 1024) return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

}  // namespace

cudaError_t launch_forward(View<const float> q, View<const float> k, View<const float> v,
                           View<float> o, View<float> lse, Problem p, Tiling t, cudaStream_t stream) {
    const int64_t bytes = smem_bytes(Kernel::forward, t, p.D);
    const cudaError_t err = allow_smem(attn_fwd_kernel, bytes);
    if (err != cudaSuccess) return err;
    const dim3 grid(cdiv(p.S_q, t.block_m), p.B * p.H);     // a block per (query tile, b, h)
    const dim3 block(32, t.threads_y);
    attn_fwd_kernel<<<grid, block, bytes, stream>>>(q, k, v, o, lse, p, t);
    return cudaGetLastError();
}

cudaError_t launch_delta(View<const float> o, View<const float> dO, View<float> delta,
                         Problem p, Tiling t, cudaStream_t stream) {
    const dim3 block(32, t.threads_y);
    const dim3 grid(cdiv(p.S_q, 32 * t.threads_y), p.B * p.H);
    attn_bwd_delta_kernel<<<grid, block, 0, stream>>>(o, dO, delta, p);
    return cudaGetLastError();
}

cudaError_t launch_dq(View<const float> q, View<const float> k, View<const float> v,
                      View<const float> dO, View<const float> lse, View<const float> delta,
                      View<float> dq, Problem p, Tiling t, cudaStream_t stream) {
    const int64_t bytes = smem_bytes(Kernel::dq, t, p.D);
    const cudaError_t err = allow_smem(attn_bwd_dq_kernel, bytes);
    if (err != cudaSuccess) return err;
    const dim3 grid(cdiv(p.S_q, t.block_m), p.B * p.H);     // a block per (query tile, b, h)
    const dim3 block(32, t.threads_y);
    attn_bwd_dq_kernel<<<grid, block, bytes, stream>>>(q, k, v, dO, lse, delta, dq, p, t);
    return cudaGetLastError();
}

cudaError_t launch_dkdv(View<const float> q, View<const float> k, View<const float> v,
                        View<const float> dO, View<const float> lse, View<const float> delta,
                        View<float> dk, View<float> dv, Problem p, Tiling t, cudaStream_t stream) {
    const int64_t bytes = smem_bytes(Kernel::dkdv, t, p.D);
    const cudaError_t err = allow_smem(attn_bwd_dkdv_kernel, bytes);
    if (err != cudaSuccess) return err;
    const dim3 grid(cdiv(p.S_k, t.block_n), p.B * p.H_kv);  // a block per (key tile, b, h_kv)
    const dim3 block(32, t.threads_y);
    attn_bwd_dkdv_kernel<<<grid, block, bytes, stream>>>(q, k, v, dO, lse, delta, dk, dv, p, t);
    return cudaGetLastError();
}

}  // namespace flashattn_cuda
