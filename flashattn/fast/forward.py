"""Tuned forward kernel. Same math as ``flashattn/forward.py``; what changed:

* **exp2 with the scale folded in.** ``exp(x) = exp2(x * log2(e))``: multiplying the scores by
  ``scale * log2(e)`` once replaces a multiply per exponent, and exp2 is the GPU's native unit.
* **The key loop is split in two.** Blocks every query row of the tile fully sees run with no
  mask at all; only the few blocks on the causal diagonal or past the end of the keys pay for
  the element mask. Blocks above the diagonal are never visited.
* **Head-dim masks only where there is padding.** Any head dim that is a multiple of 8 up to
  256 is padded to a power of two (``BLOCK_D``); ``PAD_D`` is a compile-time switch, so the
  common power-of-two head dims compile with no head-dim mask at all. The last-dim strides are
  still arguments: Triton compiles a stride of 1 as the constant 1, so a contiguous last dim
  costs nothing and any other layout still works.
* **fp32 on the tensor cores**: ``DOT_PRECISION`` is "tf32" where torch's TF32 switch allows it,
  else "tf32x3" (three TF32 products, fp32's accuracy; see ``runtime.fast_dot_precision``).
* **Per-device default tiles**, with autotuning on request (``fast/tuning.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from . import tuning
from .tuning import LN2, LOG2E


@triton.jit
def load_tile(ptrs, rows, d_ok, ROWS_MASKED: tl.constexpr, PAD_D: tl.constexpr):
    """A ``[rows, BLOCK_D]`` tile: rows past the end masked if ``ROWS_MASKED``, the padded
    head-dim columns if ``PAD_D``; neither mask is compiled where it is not needed."""
    if ROWS_MASKED:
        if PAD_D:
            t = tl.load(ptrs, mask=rows[:, None] & d_ok[None, :], other=0.0)
        else:
            t = tl.load(ptrs, mask=rows[:, None], other=0.0)
    else:
        if PAD_D:
            t = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
        else:
            t = tl.load(ptrs)
    return t


@triton.jit
def store_tile(ptrs, value, rows, d_ok, PAD_D: tl.constexpr):
    if PAD_D:
        tl.store(ptrs, value, mask=rows[:, None] & d_ok[None, :])
    else:
        tl.store(ptrs, value, mask=rows[:, None])


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
               offs_m, offs_d, d_ok, lo, hi, S_k, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               PAD_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over key blocks [lo, hi). MASKED adds the causal and key-bound masks."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keys = offs_n < S_k
        k = load_tile(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d, keys, d_ok, MASKED, PAD_D)
        v = load_tile(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d, keys, d_ok, MASKED, PAD_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale     # scores in log2 units
        if MASKED:
            visible = keys[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["S_q", "S_k", "S_BUCKET"])
def fast_fwd_kernel(
    Q, K, V, O, LSE,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_o_b, stride_o_h, stride_o_s,
    stride_lse_b, stride_lse_h,
    H, GROUP_SIZE, S_q, S_k, scale, S_BUCKET,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # (S_BUCKET is not used in the body: it only keys the autotuner. S_q and S_k are not
    # specialised on, so a new sequence length never compiles the kernel again.)
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
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    rows = offs_m < S_q
    q = load_tile(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d, rows, d_ok, True, PAD_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
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
                               offs_m, offs_d, d_ok, 0, unmasked_end, S_k, qk_scale, False, CAUSAL, BLOCK_N,
                               PAD_D, DOT_PRECISION)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
                               offs_m, offs_d, d_ok, unmasked_end, masked_end, S_k, qk_scale, True, CAUSAL, BLOCK_N,
                               PAD_D, DOT_PRECISION)

    o = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * LN2                      # back to natural log: LSE = m + ln(l)
    o_base = O + b.to(tl.int64) * stride_o_b + h.to(tl.int64) * stride_o_h
    store_tile(o_base + offs_m[:, None] * stride_o_s + offs_d[None, :], o.to(O.dtype.element_ty), rows, d_ok, PAD_D)
    lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
    tl.store(lse_base + offs_m, lse, mask=rows)


_tuned_fwd = tuning.autotuned(fast_fwd_kernel, "fwd")


def fast_attention_forward(q, k, v, causal: bool, scale: float, *, config=None, warmup: bool = False):
    """O and LSE (natural log, fp32) by the tuned kernel. Inputs validated by the caller
    (``fast.supports``): fp16/bf16/fp32, head dim a multiple of 8 up to 256, any strides."""
    B, H, S_q, D = q.shape
    H_kv, S_k = k.shape[1], k.shape[2]
    o = tuning.output((B, H, S_q, D), q.dtype, q.device, warmup)
    lse = tuning.output((B, H, S_q), torch.float32, q.device, warmup)
    args = (q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(),
            o.stride(0), o.stride(1), o.stride(2),
            lse.stride(0), lse.stride(1),
            H, H // H_kv, S_q, S_k, scale, tuning.bucket(S_q, S_k))
    tuning.run("fwd", fast_fwd_kernel, _tuned_fwd, lambda m: (triton.cdiv(S_q, m["BLOCK_M"]), B * H),
               args, tuning.constants(q, causal), config=config, warmup=warmup)
    return o, lse
