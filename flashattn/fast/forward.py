"""Tuned forward kernel (fp16/bf16 on a GPU). Same math as ``flashattn/forward.py``; what changed:

* **exp2 with the scale folded in.** ``exp(x) = exp2(x * log2(e))``: multiplying the scores by
  ``scale * log2(e)`` once replaces a multiply per exponent, and exp2 is the GPU's native unit.
* **The key loop is split in two.** Blocks every query row of the tile fully sees run with no
  mask at all; only the few blocks on the causal diagonal or past the end of the keys pay for
  the element mask. Blocks above the diagonal are never visited.
* **No head-dim masks**: the fast path takes head dims that are powers of two (16..256). The
  last-dim strides are still arguments: Triton compiles a stride of 1 as the constant 1, so a
  contiguous last dim costs nothing and any other layout still works.
* **Autotuned** tile sizes, warps and pipeline stages per (S_q, S_k, D, causal, dtype), pruned
  to what fits in shared memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from . import tuning
from .tuning import LN2, LOG2E


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
               offs_m, offs_d, lo, hi, S_k, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over key blocks [lo, hi). MASKED adds the causal and key-bound masks."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d
        v_ptrs = v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d
        if MASKED:
            k = tl.load(k_ptrs, mask=(offs_n < S_k)[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=(offs_n < S_k)[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k)) * qk_scale               # scores in log2 units
        if MASKED:
            visible = (offs_n < S_k)[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def fast_fwd_kernel(
    Q, K, V, O, LSE,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_o_b, stride_o_h, stride_o_s,
    stride_lse_b, stride_lse_h,
    H, GROUP_SIZE, S_q, S_k, scale, S_BUCKET,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # (S_BUCKET is not used in the body: it only keys the autotuner)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    h_kv = h // GROUP_SIZE
    q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
    k_base = K + b.to(tl.int64) * stride_k_b + h_kv.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_v_h

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,
                mask=(offs_m < S_q)[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = scale * LOG2E                              # scale * log2(e)

    # Keys every row of this tile sees: all of them, or (causal) those before the tile's first row.
    if CAUSAL:
        free_end = tl.minimum(start_m, S_k)
        masked_end = tl.minimum(start_m + BLOCK_M, S_k)
    else:
        free_end = S_k
        masked_end = S_k
    unmasked_end = (free_end // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
                               offs_m, offs_d, 0, unmasked_end, S_k, qk_scale, False, CAUSAL, BLOCK_N)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
                               offs_m, offs_d, unmasked_end, masked_end, S_k, qk_scale, True, CAUSAL, BLOCK_N)

    o = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * LN2                      # back to natural log: LSE = m + ln(l)
    o_base = O + b.to(tl.int64) * stride_o_b + h.to(tl.int64) * stride_o_h
    tl.store(o_base + offs_m[:, None] * stride_o_s + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=(offs_m < S_q)[:, None])
    lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
    tl.store(lse_base + offs_m, lse, mask=offs_m < S_q)


_tuned_fwd = tuning.autotuned(fast_fwd_kernel, "fwd")


def fast_attention_forward(q, k, v, causal: bool, scale: float, *, config=None, warmup: bool = False):
    """O and LSE (natural log, fp32) by the tuned kernel. Inputs validated by the caller
    (``fast.supports``): fp16/bf16, head dim a power of two in 16..256, any strides."""
    B, H, S_q, D = q.shape
    H_kv, S_k = k.shape[1], k.shape[2]
    o = runtime.new_output((B, H, S_q, D), q.dtype, q.device)
    lse = runtime.new_output((B, H, S_q), torch.float32, q.device)
    args = (q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(),
            o.stride(0), o.stride(1), o.stride(2),
            lse.stride(0), lse.stride(1),
            H, H // H_kv, S_q, S_k, scale, tuning.bucket(S_q, S_k))
    kernel, meta = tuning.pick(_tuned_fwd, fast_fwd_kernel, config, "fwd")
    grid = lambda m: (triton.cdiv(S_q, m["BLOCK_M"]), B * H)  # noqa: E731
    tuning.launch(kernel, grid, args, dict(CAUSAL=causal, HEAD_DIM=D, **meta), warmup)
    return o, lse
