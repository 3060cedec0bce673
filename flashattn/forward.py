"""The forward kernel: O = softmax(Q K^T * scale) V, plus the row log-sum-exp (LSE).

One program computes one block of BLOCK_M query rows of one (batch, head). It walks over the
keys BLOCK_N at a time with the *online softmax*: it keeps, per row, the running maximum ``m``
and the running sum ``l`` of exp(S - m), and rescales what it has accumulated whenever the
maximum grows. At the end ``O = acc / l`` and ``LSE = m + log(l)``.

The backward needs only LSE (one fp32 number per query row) to rebuild any tile of
P = exp(S - LSE) exactly: that is what lets FlashAttention skip storing the S_q x S_k matrix P.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import configs, runtime  # runtime first: decides interpreter vs GPU before any kernel is defined
from .configs import KernelConfig


@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_o_b, stride_o_h, stride_o_s, stride_o_d,
    stride_lse_b, stride_lse_h, stride_lse_s,
    H, GROUP_SIZE, S_q, S_k, HEAD_DIM, scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)          # which block of query rows
    pid_bh = tl.program_id(1)         # which (batch, query head)
    b = pid_bh // H
    h = pid_bh % H
    h_kv = h // GROUP_SIZE            # GQA: GROUP_SIZE query heads share one K/V head

    # Base pointers of this (batch, head). Each tensor uses *its own* strides: q, k, v, o may
    # be views with any layout. 64-bit offsets, because B*H*S*D can exceed 2**31.
    q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
    k_base = K + b.to(tl.int64) * stride_k_b + h_kv.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_v_h
    o_base = O + b.to(tl.int64) * stride_o_b + h.to(tl.int64) * stride_o_h
    lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < S_q             # the last block may stick out past S_q
    d_ok = offs_d < HEAD_DIM          # BLOCK_D is HEAD_DIM padded to a power of two

    q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Statistics and accumulators in LSE's dtype: fp32, or fp64 for fp64 inputs (gradcheck).
    acc_dtype = LSE.dtype.element_ty
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=acc_dtype)   # running row max of S
    l_i = tl.zeros([BLOCK_M], dtype=acc_dtype)                  # running sum of exp(S - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)         # running (unnormalised) P V

    # Causal: row i sees keys j <= i, so this block needs no key beyond its last row.
    kv_end = S_k
    if CAUSAL:
        kv_end = tl.minimum(S_k, (pid_m + 1) * BLOCK_M)

    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S_k
        k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale   # [BLOCK_M, BLOCK_N]
        visible = col_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))

        # Online softmax. Every row sees key 0 in the first block, so m_new is finite and
        # exp(-inf - m_new) = 0 for hidden keys.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)                 # rescales what was accumulated so far
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    lse = m_i + tl.log(l_i)                         # log(sum_j exp(S_ij)), natural log
    tl.store(o_base + offs_m[:, None] * stride_o_s + offs_d[None, :] * stride_o_d,
             o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_base + offs_m * stride_lse_s, lse, mask=row_ok)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: Optional[float] = None,
    *,
    config: Optional[KernelConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Returns ``(O, LSE)``: O like q, LSE ``[B, H, S_q]`` in fp32
    (fp64 for fp64 inputs).

    q ``[B, H, S_q, D]``, k and v ``[B, H_kv, S_k, D]``, any strides.
    ``config`` forces block sizes (e.g. ``KernelConfig(16, 16)`` to see several blocks on a
    tiny input); by default one that fits the device's shared memory is chosen.
    """
    runtime.validate_qkv(q, k, v)
    causal = runtime.validate_causal(causal)
    B, H, S_q, D = q.shape
    H_kv, S_k = k.shape[1], k.shape[2]
    scale = runtime.validate_scale(scale, D)

    o = runtime.new_output((B, H, S_q, D), q.dtype, q.device)
    lse = runtime.new_output((B, H, S_q), runtime.stats_dtype(q.dtype), q.device)
    block_d = runtime.head_dim_block(D)

    def run(cfg: KernelConfig) -> None:
        grid = (triton.cdiv(S_q, cfg.BLOCK_M), B * H)
        attn_fwd_kernel[grid](
            q, k, v, o, lse,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
            H, H // H_kv, S_q, S_k, D, scale,
            CAUSAL=causal, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=block_d,
            DOT_PRECISION=runtime.dot_precision(q.dtype, D),
            **cfg.launch_options(),
        )

    candidates = configs.candidates("fwd", D, q.dtype, q.device, config)
    configs.launch(("fwd", D, q.dtype, q.device), candidates, run)
    return o, lse
