"""Tuned backward, fp16/bf16 on a GPU: a dQ kernel and a dK/dV kernel, each with its launcher.

The same design as ``flashattn/backward.py`` (each output block owned by one program, no
atomics), with the fast forward's tricks: exp2 with log2(e) folded into the scale and into
LSE, loops split into unmasked tiles and the few masked ones on the causal diagonal, padded
query rows neutralised by loading their LSE as +inf (so P = exp2(S - inf) = 0 with no mask),
and autotuned tiles. The delta preprocess is the lesson's: a single memory-bound pass.

``FUSED_DQ`` turns the dK/dV kernel into the *fused* backward: while a program walks down the
query blocks for its key block it also forms that tile's share of dQ, dS K, and adds it into
an fp32 buffer with ``tl.atomic_add`` (many programs touch the same dQ rows). P and dS are then
computed once instead of twice, at the price of BLOCK_M x D atomic adds per tile and an order
of additions that changes from run to run (dQ is not bit-reproducible). Measured on an H100
(``python -m flashattn.bench``), two kernels win or tie everywhere, so the fused form is there
to compare with (``backward="fused"``), refused under ``torch.use_deterministic_algorithms``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..backward import attention_backward_delta
from . import tuning
from .forward import load_tile, store_tile
from .tuning import LOG2E


# --------------------------------------------------------------------------------------
# dQ: one program per block of query rows
# --------------------------------------------------------------------------------------
@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
              offs_m, offs_d, d_ok, lo, hi, S_k, qk_scale,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
              PAD_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keys = offs_n < S_k
        k = load_tile(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d, keys, d_ok, MASKED, PAD_D)
        v = load_tile(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d, keys, d_ok, MASKED, PAD_D)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        if MASKED:
            visible = keys[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["S_q", "S_k", "S_BUCKET"])
def fast_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_lse_b, stride_lse_h, stride_delta_b, stride_delta_h,
    stride_dq_b, stride_dq_h, stride_dq_s,
    H, GROUP_SIZE, S_q, S_k, scale, S_BUCKET,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    h_kv = h // GROUP_SIZE
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < S_q

    q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
    do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h
    k_base = K + b.to(tl.int64) * stride_k_b + h_kv.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_v_h
    q = load_tile(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d, row_ok, d_ok, True, PAD_D)
    do = load_tile(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d, row_ok, d_ok, True, PAD_D)
    lse_ptrs = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h + offs_m
    lse2 = tl.load(lse_ptrs, mask=row_ok, other=float("inf")) * LOG2E   # log2 units
    delta_ptrs = DELTA + b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h + offs_m
    delta = tl.load(delta_ptrs, mask=row_ok, other=0.0)
    qk_scale = scale * LOG2E

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        free_end = tl.minimum(start_m, S_k)
        masked_end = tl.minimum(start_m + BLOCK_M, S_k)
    else:
        free_end = S_k
        masked_end = S_k
    unmasked_end = (free_end // BLOCK_N) * BLOCK_N
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
                   offs_m, offs_d, d_ok, 0, unmasked_end, S_k, qk_scale, False, CAUSAL, BLOCK_N,
                   PAD_D, DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
                   offs_m, offs_d, d_ok, unmasked_end, masked_end, S_k, qk_scale, True, CAUSAL, BLOCK_N,
                   PAD_D, DOT_PRECISION)

    dq_base = DQ + b.to(tl.int64) * stride_dq_b + h.to(tl.int64) * stride_dq_h
    store_tile(dq_base + offs_m[:, None] * stride_dq_s + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
               row_ok, d_ok, PAD_D)


# --------------------------------------------------------------------------------------
# dK, dV: one program per block of key/value rows (a K/V head: all its GQA query heads)
# --------------------------------------------------------------------------------------
@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                stride_q_s, stride_q_d, stride_do_s, stride_do_d, stride_dq_s,
                offs_n, offs_d, d_ok, lo, hi, S_q, qk_scale, scale,
                MASKED: tl.constexpr, FUSED_DQ: tl.constexpr, BLOCK_M: tl.constexpr,
                PAD_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < S_q
        q = load_tile(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d, row_ok, d_ok, True, PAD_D)
        do = load_tile(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d, row_ok, d_ok, True, PAD_D)
        # padded rows: LSE = +inf makes their P exactly 0, no mask needed
        lse2 = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf")) * LOG2E
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        pT = tl.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])
        if MASKED:
            pT = tl.where(offs_n[:, None] <= offs_m[None, :], pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk += tl.dot(dsT, q, input_precision=DOT_PRECISION)
        if FUSED_DQ:   # this tile's share of dQ = dS K * scale, added into the fp32 buffer
            dq_part = tl.dot(tl.trans(dsT), k, input_precision=DOT_PRECISION) * scale
            tl.atomic_add(dq_base + offs_m[:, None] * stride_dq_s + offs_d[None, :], dq_part,
                          mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["S_q", "S_k", "S_BUCKET"])
def fast_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_lse_b, stride_lse_h, stride_delta_b, stride_delta_h,
    stride_dk_b, stride_dk_h, stride_dk_s,
    stride_dv_b, stride_dv_h, stride_dv_s,
    stride_dq_b, stride_dq_h, stride_dq_s,
    H_KV, GROUP_SIZE, S_q, S_k, scale, S_BUCKET,
    CAUSAL: tl.constexpr, FUSED_DQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAD_D: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    col_ok = offs_n < S_k
    k_base = K + b.to(tl.int64) * stride_k_b + h_kv.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_v_h
    k = load_tile(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d, col_ok, d_ok, True, PAD_D)
    v = load_tile(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d, col_ok, d_ok, True, PAD_D)
    qk_scale = scale * LOG2E
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    for g in range(0, GROUP_SIZE):
        h = h_kv * GROUP_SIZE + g
        q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
        do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h
        lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
        delta_base = DELTA + b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h
        dq_base = DQ_ACC + b.to(tl.int64) * stride_dq_b + h.to(tl.int64) * stride_dq_h
        if CAUSAL:
            # rows start_n .. start_n+BLOCK_N-1 straddle the diagonal (BLOCK_M divides BLOCK_N);
            # every later row sees the whole key block.
            diag_end = tl.minimum(start_n + BLOCK_N, S_q)
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                                 stride_q_s, stride_q_d, stride_do_s, stride_do_d, stride_dq_s,
                                 offs_n, offs_d, d_ok, start_n, diag_end, S_q, qk_scale, scale,
                                 True, FUSED_DQ, BLOCK_M, PAD_D, DOT_PRECISION)
            first_free = start_n + BLOCK_N
        else:
            first_free = 0
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                             stride_q_s, stride_q_d, stride_do_s, stride_do_d, stride_dq_s,
                             offs_n, offs_d, d_ok, first_free, S_q, S_q, qk_scale, scale,
                             False, FUSED_DQ, BLOCK_M, PAD_D, DOT_PRECISION)

    dk_base = DK + b.to(tl.int64) * stride_dk_b + h_kv.to(tl.int64) * stride_dk_h
    dv_base = DV + b.to(tl.int64) * stride_dv_b + h_kv.to(tl.int64) * stride_dv_h
    store_tile(dk_base + offs_n[:, None] * stride_dk_s + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
               col_ok, d_ok, PAD_D)
    store_tile(dv_base + offs_n[:, None] * stride_dv_s + offs_d[None, :], dv.to(DV.dtype.element_ty),
               col_ok, d_ok, PAD_D)


_tuned_dq = tuning.autotuned(fast_dq_kernel, "dq")
_tuned_dkdv = tuning.autotuned(fast_dkdv_kernel, "dkdv")
_tuned_fused = tuning.autotuned(fast_dkdv_kernel, "fused", reset_to_zero=["DQ_ACC"])


def fast_attention_backward(q, k, v, o, do, lse, causal: bool, scale: float,
                            needs_dq: bool = True, needs_dkdv: bool = True, *, fused: bool = False,
                            config=None, warmup: bool = False):
    """(dq, dk, dv) by the tuned backward; None for what was not asked for. Two kernels by
    default; ``fused=True``: one dK/dV kernel that also adds dQ with atomics (see the module's
    docstring). ``warmup=True`` only compiles the kernels (see ``fast.precompile``).
    fp16/bf16/fp32, head dim a multiple of 8 up to 256, any strides (dO's own too)."""
    B, H, S_q, D = q.shape
    H_kv, S_k = k.shape[1], k.shape[2]
    delta = tuning.ArgSpec(lse.shape, lse.dtype, lse.device) if warmup else attention_backward_delta(o, do)
    S_BUCKET = tuning.bucket(S_q, S_k)
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride(),
              lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1))
    fused = fused and needs_dq and needs_dkdv
    meta = tuning.constants(q, causal)
    dq = dk = dv = None
    if needs_dq and not fused:
        dq = tuning.output((B, H, S_q, D), q.dtype, q.device, warmup)
        args = (q, k, v, do, lse, delta, dq, *common, dq.stride(0), dq.stride(1), dq.stride(2),
                H, H // H_kv, S_q, S_k, scale, S_BUCKET)
        tuning.run("dq", fast_dq_kernel, _tuned_dq, lambda m: (triton.cdiv(S_q, m["BLOCK_M"]), B * H),
                   args, meta, config=config, warmup=warmup)
    if needs_dkdv:
        dk = tuning.output((B, H_kv, S_k, D), k.dtype, k.device, warmup)
        dv = tuning.output((B, H_kv, S_k, D), v.dtype, v.device, warmup)
        # fused: atomics add into an fp32 buffer; otherwise the argument is a placeholder
        if fused:
            dq_acc = (tuning.ArgSpec((B, H, S_q, D), torch.float32, q.device) if warmup
                      else torch.zeros((B, H, S_q, D), dtype=torch.float32, device=q.device))
        else:
            dq_acc = dk
        args = (q, k, v, do, lse, delta, dk, dv, dq_acc, *common,
                dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
                dq_acc.stride(0), dq_acc.stride(1), dq_acc.stride(2),
                H_kv, H // H_kv, S_q, S_k, scale, S_BUCKET)
        tuning.run("fused" if fused else "dkdv", fast_dkdv_kernel, _tuned_fused if fused else _tuned_dkdv,
                   lambda m: (triton.cdiv(S_k, m["BLOCK_N"]), B * H_kv), args, dict(meta, FUSED_DQ=fused),
                   config=config, warmup=warmup)
        if fused and not warmup:
            dq = dq_acc.to(q.dtype)
    return dq, dk, dv
