"""The backward kernels: delta preprocess, dQ, and dK/dV, each with its launcher below it.

Given dO, and the forward's O and LSE, with P = exp(S - LSE) rebuilt tile by tile::

    delta = rowsum(dO * O)                    (preprocess: one number per query row)
    dP    = dO V^T
    dS    = P * (dP - delta)
    dQ    = dS K * scale                      (dQ kernel: a program owns a block of Q rows)
    dV    = P^T dO,   dK = dS^T Q * scale     (dK/dV kernel: a program owns a block of K/V rows)

Why two kernels? dQ for a block of query rows sums over all key blocks; dK and dV for a block
of key rows sum over all query blocks. Giving each output block to exactly one program means
every accumulation happens in that program's registers: no atomics, no races, and the result
is the same from run to run.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import configs, runtime
from .configs import KernelConfig


# --------------------------------------------------------------------------------------
# 1. delta = rowsum(dO * O)
# --------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["S_q"])     # a new sequence length compiles nothing new
def attn_bwd_delta_kernel(
    O, DO, DELTA,
    stride_o_b, stride_o_h, stride_o_s, stride_o_d,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_delta_b, stride_delta_h, stride_delta_s,
    H, S_q, HEAD_DIM,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < S_q)[:, None] & (offs_d < HEAD_DIM)[None, :]

    o_base = O + b.to(tl.int64) * stride_o_b + h.to(tl.int64) * stride_o_h
    do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h   # dO's own strides
    o = tl.load(o_base + offs_m[:, None] * stride_o_s + offs_d[None, :] * stride_o_d,
                mask=mask, other=0.0).to(DELTA.dtype.element_ty)
    do = tl.load(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d,
                 mask=mask, other=0.0).to(DELTA.dtype.element_ty)
    delta = tl.sum(o * do, axis=1)
    delta_base = DELTA + b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h
    tl.store(delta_base + offs_m * stride_delta_s, delta, mask=offs_m < S_q)


def delta_launch(o: torch.Tensor, do: torch.Tensor, cfg: KernelConfig):
    """One launch of ``attn_bwd_delta_kernel``: the delta it fills, its grid and its arguments
    (shared with the fast path, which launches the same kernel directly); ``delta_meta`` gives the
    compile-time ones."""
    B, H, S_q, D = o.shape
    delta = runtime.new_output((B, H, S_q), runtime.stats_dtype(o.dtype), o.device)
    grid = (triton.cdiv(S_q, cfg.BLOCK_M), B * H)
    return delta, grid, (o, do, delta, *o.stride(), *do.stride(), *delta.stride(), H, S_q, D)


def delta_meta(cfg: KernelConfig, head_dim: int) -> dict:
    return dict(BLOCK_M=cfg.BLOCK_M, BLOCK_D=runtime.head_dim_block(head_dim), **cfg.launch_options())


def attention_backward_delta(o: torch.Tensor, do: torch.Tensor, *,
                             config: Optional[KernelConfig] = None) -> torch.Tensor:
    """delta = rowsum(dO * O), ``[B, H, S_q]`` in fp32 (fp64 for fp64 inputs).
    dO may have any strides (even 0)."""
    runtime.validate_grad_output(do, o)
    cfg = configs.candidates("delta", o.shape[-1], o.dtype, o.device, config)[0]
    delta, grid, args = delta_launch(o, do, cfg)
    attn_bwd_delta_kernel[grid](*args, **delta_meta(cfg, o.shape[-1]))
    return delta


# --------------------------------------------------------------------------------------
# 2. dQ: one program per block of query rows, looping over the key/value blocks
# --------------------------------------------------------------------------------------
@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_lse_b, stride_lse_h, stride_lse_s,
    stride_delta_b, stride_delta_h, stride_delta_s,
    stride_dq_b, stride_dq_h, stride_dq_s, stride_dq_d,
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
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < S_q
    d_ok = offs_d < HEAD_DIM

    # This (batch, head) of every tensor, each with its own strides; 64-bit offsets.
    q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
    k_base = K + b.to(tl.int64) * stride_k_b + h_kv.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_v_h
    do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h
    lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
    delta_base = DELTA + b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h
    dq_base = DQ + b.to(tl.int64) * stride_dq_b + h.to(tl.int64) * stride_dq_h

    # Everything that depends only on this block of rows is loaded once, outside the loop.
    q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d,
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok, other=0.0)
    delta = tl.load(delta_base + offs_m * stride_delta_s, mask=row_ok, other=0.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=LSE.dtype.element_ty)   # fp32 (fp64 for fp64 inputs)
    kv_end = S_k
    if CAUSAL:                                       # keys beyond the block's last row are hidden
        kv_end = tl.minimum(S_k, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S_k
        k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)

        # Rebuild this tile of P from the forward's LSE: P = exp(S - LSE), exactly softmax(S).
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)

        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)           # dP = dO V^T
        ds = p * (dp - delta[:, None])                                         # dS = P*(dP - delta)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)        # dQ += dS K

    dq = dq * scale                                  # S = Q K^T * scale, so dQ = dS K * scale
    tl.store(dq_base + offs_m[:, None] * stride_dq_s + offs_d[None, :] * stride_dq_d,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def attention_backward_dq(q, k, v, do, lse, delta, causal: bool = False,
                          scale: Optional[float] = None, *,
                          config: Optional[KernelConfig] = None) -> torch.Tensor:
    """dQ ``[B, H, S_q, D]`` from q, k, v, dO, the forward's LSE and delta = rowsum(dO * O)."""
    runtime.validate_qkv(q, k, v)
    runtime.validate_grad_output(do, q)
    runtime.validate_row_stats(q, lse=lse, delta=delta)
    causal = runtime.validate_causal(causal)
    B, H, S_q, D = q.shape
    H_kv, S_k = k.shape[1], k.shape[2]
    scale = runtime.validate_scale(scale, D)
    dq = runtime.new_output((B, H, S_q, D), q.dtype, q.device)
    block_d = runtime.head_dim_block(D)

    def run(cfg: KernelConfig) -> None:
        grid = (triton.cdiv(S_q, cfg.BLOCK_M), B * H)
        attn_bwd_dq_kernel[grid](
            q, k, v, do, lse, delta, dq,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            *lse.stride(), *delta.stride(), *dq.stride(),
            H, H // H_kv, S_q, S_k, D, scale,
            CAUSAL=causal, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=block_d,
            DOT_PRECISION=runtime.dot_precision(q.dtype, D),
            **cfg.launch_options(),
        )

    candidates = configs.candidates("dq", D, q.dtype, q.device, config)
    configs.launch(("dq", D, q.dtype, q.device), candidates, run)
    return dq


# --------------------------------------------------------------------------------------
# 3. dK, dV: one program per block of key/value rows, looping over the query blocks
# --------------------------------------------------------------------------------------
@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_lse_b, stride_lse_h, stride_lse_s,
    stride_delta_b, stride_delta_h, stride_delta_s,
    stride_dk_b, stride_dk_h, stride_dk_s, stride_dk_d,
    stride_dv_b, stride_dv_h, stride_dv_s, stride_dv_d,
    H_KV, GROUP_SIZE, S_q, S_k, HEAD_DIM, scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)          # which block of key/value rows
    pid_bh = tl.program_id(1)         # which (batch, key/value head)
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < S_k
    d_ok = offs_d < HEAD_DIM

    k_base = K + b.to(tl.int64) * stride_k_b + h_kv.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_v_h
    k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,
                mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d,
                mask=col_ok[:, None] & d_ok[None, :], other=0.0)

    # The accumulators live in this program's registers for the whole loop: no other program
    # ever touches these rows of dK and dV, so no atomics are needed.
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)   # fp32 (fp64 for fp64 inputs)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)

    # Causal: key j is seen only by rows i >= j, so start at the query block holding row j.
    m_start = 0
    if CAUSAL:
        m_start = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M

    # GQA: every query head of the group used this K/V head, so all their gradients add up here.
    for g in range(0, GROUP_SIZE):
        h = h_kv * GROUP_SIZE + g
        q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
        do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h
        lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
        delta_base = DELTA + b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h

        for start_m in range(m_start, S_q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < S_q
            q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d,
                         mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            lse = tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok, other=0.0)
            delta = tl.load(delta_base + offs_m * stride_delta_s, mask=row_ok, other=0.0)

            # Work on the transposed tile S^T = K Q^T [BLOCK_N, BLOCK_M]: then P^T and dS^T,
            # which dV and dK need, come out directly.
            sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale
            # Padded query rows (row >= S_q) must give P = 0. Their q, dO, LSE and delta load
            # as 0, so P would be exp(0) = 1; the zero dO and delta hide that only as long as
            # those loads stay masked. P = 0 makes a padded row contribute nothing, whatever
            # it holds (notebook 04 plants both failures).
            visible = row_ok[None, :] & col_ok[:, None]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :])
            pT = tl.where(visible, tl.exp(sT - lse[None, :]), 0.0)

            dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)  # dV += P^T dO
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)      # dP^T = V dO^T
            dsT = pT * (dpT - delta[None, :])                                  # dS^T
            dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)   # dK += dS^T Q

    dk = dk * scale
    dk_base = DK + b.to(tl.int64) * stride_dk_b + h_kv.to(tl.int64) * stride_dk_h
    dv_base = DV + b.to(tl.int64) * stride_dv_b + h_kv.to(tl.int64) * stride_dv_h
    tl.store(dk_base + offs_n[:, None] * stride_dk_s + offs_d[None, :] * stride_dk_d,
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])
    tl.store(dv_base + offs_n[:, None] * stride_dv_s + offs_d[None, :] * stride_dv_d,
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])


def attention_backward_dkdv(q, k, v, do, lse, delta, causal: bool = False,
                            scale: Optional[float] = None, *,
                            config: Optional[KernelConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV ``[B, H_kv, S_k, D]`` (summed over each GQA group of query heads)."""
    runtime.validate_qkv(q, k, v)
    runtime.validate_grad_output(do, q)
    runtime.validate_row_stats(q, lse=lse, delta=delta)
    causal = runtime.validate_causal(causal)
    B, H, S_q, D = q.shape
    H_kv, S_k = k.shape[1], k.shape[2]
    scale = runtime.validate_scale(scale, D)
    dk = runtime.new_output((B, H_kv, S_k, D), k.dtype, k.device)
    dv = runtime.new_output((B, H_kv, S_k, D), v.dtype, v.device)
    block_d = runtime.head_dim_block(D)

    def run(cfg: KernelConfig) -> None:
        grid = (triton.cdiv(S_k, cfg.BLOCK_N), B * H_kv)
        attn_bwd_dkdv_kernel[grid](
            q, k, v, do, lse, delta, dk, dv,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            *lse.stride(), *delta.stride(), *dk.stride(), *dv.stride(),
            H_kv, H // H_kv, S_q, S_k, D, scale,
            CAUSAL=causal, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=block_d,
            DOT_PRECISION=runtime.dot_precision(q.dtype, D),
            **cfg.launch_options(),
        )

    candidates = configs.candidates("dkdv", D, q.dtype, q.device, config)
    configs.launch(("dkdv", D, q.dtype, q.device), candidates, run)
    return dk, dv


def attention_backward(q, k, v, o, do, lse, causal: bool = False, scale: Optional[float] = None,
                       *, needs_dq: bool = True, needs_dkdv: bool = True,
                       config: Optional[KernelConfig] = None):
    """The whole backward: delta, then dQ and dK/dV. Returns ``(dq, dk, dv)``; a gradient that
    was not asked for is ``None`` and its kernel is not launched."""
    delta = attention_backward_delta(o, do, config=config)
    dq = attention_backward_dq(q, k, v, do, lse, delta, causal, scale, config=config) if needs_dq else None
    dk = dv = None
    if needs_dkdv:
        dk, dv = attention_backward_dkdv(q, k, v, do, lse, delta, causal, scale, config=config)
    return dq, dk, dv
