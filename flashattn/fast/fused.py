"""Fused backward: one kernel, one program per K/V block, dQ accumulated with atomics.

The two-kernel design recomputes P and dS twice (once in the dQ kernel, once in the dK/dV
kernel). The fused design computes them once: while a program walks down the query blocks for
its K/V block, it also forms that tile's contribution to dQ, ``dS K``, and adds it into an fp32
dQ buffer with ``tl.atomic_add`` (many programs touch the same dQ rows, so they must be atomic).
A final cast turns the buffer into dQ. Fewer FLOPs (4 matrix products per tile instead of 5),
but BLOCK_M x D atomic adds per tile and a run-to-run order of the additions that is not fixed
(dQ is not bit-reproducible). Measured in ``python -m flashattn.bench``: two kernels win
or tie everywhere on an H100, so this one is kept for comparison (``backward="fused"``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..backward import attention_backward_delta
from . import tuning


@triton.jit
def _fused_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                 stride_q_s, stride_q_d, stride_do_s, stride_do_d, stride_dq_s,
                 offs_n, offs_d, lo, hi, S_q, qk_scale, scale,
                 MASKED: tl.constexpr, BLOCK_M: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < S_q
        q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,
                    mask=row_ok[:, None], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d,
                     mask=row_ok[:, None], other=0.0)
        lse2 = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        pT = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        if MASKED:
            pT = tl.where(offs_n[:, None] <= offs_m[None, :], pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do))
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk += tl.dot(dsT, q)
        # this tile's share of dQ = dS K (times scale), added into the fp32 buffer
        dq_part = tl.dot(tl.trans(dsT), k) * scale
        tl.atomic_add(dq_base + offs_m[:, None] * stride_dq_s + offs_d[None, :], dq_part,
                      mask=row_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def fast_fused_bwd_kernel(
    Q, K, V, DO, LSE, DELTA, DQ_ACC, DK, DV,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_lse_b, stride_lse_h, stride_delta_b, stride_delta_h,
    stride_dq_b, stride_dq_h, stride_dq_s,
    stride_dk_b, stride_dk_h, stride_dk_s,
    stride_dv_b, stride_dv_h, stride_dv_s,
    H_KV, GROUP_SIZE, S_q, S_k, scale, S_BUCKET,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < S_k
    k_base = K + b.to(tl.int64) * stride_k_b + h_kv.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_v_h
    k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d, mask=col_ok[:, None], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d, mask=col_ok[:, None], other=0.0)
    qk_scale = scale * 1.4426950408889634
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    for g in range(0, GROUP_SIZE):
        h = h_kv * GROUP_SIZE + g
        q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
        do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h
        lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
        delta_base = DELTA + b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h
        dq_base = DQ_ACC + b.to(tl.int64) * stride_dq_b + h.to(tl.int64) * stride_dq_h
        if CAUSAL:
            diag_end = tl.minimum(start_n + BLOCK_N, S_q)
            dk, dv = _fused_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                                  stride_q_s, stride_q_d, stride_do_s, stride_do_d, stride_dq_s,
                                  offs_n, offs_d, start_n, diag_end, S_q, qk_scale, scale, True, BLOCK_M)
            first_free = start_n + BLOCK_N
        else:
            first_free = 0
        dk, dv = _fused_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                              stride_q_s, stride_q_d, stride_do_s, stride_do_d, stride_dq_s,
                              offs_n, offs_d, first_free, S_q, S_q, qk_scale, scale, False, BLOCK_M)

    dk_base = DK + b.to(tl.int64) * stride_dk_b + h_kv.to(tl.int64) * stride_dk_h
    dv_base = DV + b.to(tl.int64) * stride_dv_b + h_kv.to(tl.int64) * stride_dv_h
    tl.store(dk_base + offs_n[:, None] * stride_dk_s + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=col_ok[:, None])
    tl.store(dv_base + offs_n[:, None] * stride_dv_s + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=col_ok[:, None])


_tuned_fused = tuning.autotuned(fast_fused_bwd_kernel, "fused", reset_to_zero=["DQ_ACC"])


def fused_attention_backward(q, k, v, o, do, lse, causal: bool, scale: float, *, config=None,
                             warmup: bool = False):
    """(dq, dk, dv) by the fused kernel (dQ through an fp32 buffer and atomics)."""
    B, H, S_q, D = q.shape
    H_kv, S_k = k.shape[1], k.shape[2]
    delta = torch.empty_like(lse) if warmup else attention_backward_delta(o, do)
    dq_acc = torch.zeros((B, H, S_q, D), dtype=torch.float32, device=q.device)  # atomics add into it
    dk = runtime.new_output((B, H_kv, S_k, D), k.dtype, k.device)
    dv = runtime.new_output((B, H_kv, S_k, D), v.dtype, v.device)
    kernel, meta = tuning.pick(_tuned_fused, fast_fused_bwd_kernel, config, "fused")
    grid = lambda m: (triton.cdiv(S_k, m["BLOCK_N"]), B * H_kv)  # noqa: E731
    args = (q, k, v, do, lse, delta, dq_acc, dk, dv,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1),
            dq_acc.stride(0), dq_acc.stride(1), dq_acc.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            H_kv, H // H_kv, S_q, S_k, scale, tuning.bucket(S_q, S_k))
    tuning.launch(kernel, grid, args, dict(CAUSAL=causal, HEAD_DIM=D, **meta), warmup)
    return dq_acc.to(q.dtype), dk, dv
