"""Tuned backward, fp16/bf16 on a GPU: a dQ kernel and a dK/dV kernel, each with its launcher.

The same design as ``flashattn/backward.py`` (each output block owned by one program, no
atomics), with the fast forward's tricks: exp2 with log2(e) folded into the scale and into
LSE, loops split into unmasked tiles and the few masked ones on the causal diagonal, padded
query rows neutralised by loading their LSE as +inf (so P = exp2(S - inf) = 0 with no mask),
and autotuned tiles. The delta preprocess is the lesson's: a single memory-bound pass.
Lesson 09's ``WINDOW``, ``VARLEN`` and ``DROPOUT`` switches work as in the forward (each kernel
regenerates the dropout mask it needs; dV's 1 / (1 - p) is applied once, to the sum).

``FUSED_DQ`` turns the dK/dV kernel into the *fused* backward: while a program walks down the
query blocks for its key block it also forms that tile's share of dQ, dS K, and adds it into
an fp32 buffer with ``tl.atomic_add`` (many programs touch the same dQ rows). P and dS are then
computed once instead of twice, at the price of BLOCK_M x D atomic adds per tile and an order
of additions that changes from run to run (dQ is not bit-reproducible). Measured on an H100
(``python -m flashattn.bench``), two kernels win or tie everywhere, so the fused form is there
to compare with (``backward="fused"``), refused under ``torch.use_deterministic_algorithms``.

**Split head dim** (``BLOCK_D_TAIL``, the two kernels only): a head dim of 128 < D <= 192 is not
padded to 256 columns but held as two tiles, a main one of ``BLOCK_D`` = 128 columns (no mask)
and a tail of ``BLOCK_D_TAIL`` = next_power_of_2(D - 128) columns (32 for D=160, 64 for D=192,
masked past D where D - 128 is not a power of two): 160 or 192 columns of work, not 256.
``BLOCK_D_TAIL = 0`` compiles the kernels as before (``FLASHATTN_SPLIT_D=0`` forces that).

**dK and dV apart** (``DKDV_PART``: 0 both, 1 dK only, 2 dV only): at a 256-column tile the
dK/dV kernel is launched twice (``tuning.dkdv_parts``), so that each program holds one fp32
accumulator of [BLOCK_N, 256] instead of two and can run taller tiles; S is recomputed once more.
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl

from .. import configs, hopper, runtime
from ..backward import attention_backward_delta, attn_bwd_delta_kernel, delta_launch, delta_meta
from . import launch, plans, tuning
from ..features import (dropout_apply, dropout_draws, dropout_keep, dropout_survives, dropout_threshold,
                        sequence_bounds)
from .forward import load_rows, load_tile, store_tile, window_tiles
from .pieces import load3, mm, operand, split_pieces, trans
from .launch import DirectLaunch
from .tuning import LOG2E


# --------------------------------------------------------------------------------------
# dQ: one program per block of query rows
# --------------------------------------------------------------------------------------
@triton.jit
def _dq_tiles(dq, dq_t, q, q_t, do, do_t, lse2, delta, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
              start_m, offs_m, offs_d, d_ok, offs_t, t_ok, lo, hi, S_k, qk_scale, LEFT, RIGHT, seed, seq_head, threshold,
              keep_scale,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DROPOUT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_D_TAIL: tl.constexpr, PAD_T: tl.constexpr):
    """dQ += dS K over key blocks [lo, hi). Split head dim (BLOCK_D_TAIL > 0): the tail columns
    ride along as *_t tiles. A product over the head dim is a sum over its columns, so
    S = Q K^T = Q_main K_main^T + Q_tail K_tail^T (the second dot accumulates onto the first),
    dP = dO V^T likewise; dQ = dS K is [dS K_main | dS K_tail], one dot per part (dq, dq_t)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keys = offs_n < S_k
        k = load_tile(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d, keys, d_ok, MASKED, PAD_D)
        v = load_tile(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d, keys, d_ok, MASKED, PAD_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if BLOCK_D_TAIL > 0:
            k_t = load_tile(k_base + offs_n[:, None] * stride_k_s + offs_t[None, :] * stride_k_d, keys, t_ok, MASKED,
                            PAD_T)
            v_t = load_tile(v_base + offs_n[:, None] * stride_v_s + offs_t[None, :] * stride_v_d, keys, t_ok, MASKED,
                            PAD_T)
            s = tl.dot(q_t, tl.trans(k_t), acc=s, input_precision=DOT_PRECISION)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            visible = keys[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            if WINDOW:
                visible = visible & (offs_n[None, :] >= offs_m[:, None] - LEFT) & (offs_n[None, :] <= offs_m[:, None] + RIGHT)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if BLOCK_D_TAIL > 0:
            dp = tl.dot(do_t, tl.trans(v_t), acc=dp, input_precision=DOT_PRECISION)
        if DROPOUT:   # O used P * Z / (1 - p): dP = (dO V^T) * Z / (1 - p), Z regenerated
            keep = dropout_keep(seed, seq_head, start_m, start_n, S_k, threshold, BLOCK_M, BLOCK_N)
            ds = (p * (tl.where(keep, dp, 0.0) * keep_scale - delta[:, None])).to(k.dtype)   # one FFMA
        else:
            ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq += tl.dot(ds, k, input_precision=DOT_PRECISION)
        if BLOCK_D_TAIL > 0:
            dq_t += tl.dot(ds, k_t, input_precision=DOT_PRECISION)
    return dq, dq_t


@triton.jit(do_not_specialize=["S_q", "S_k", "S_BUCKET", "LEFT", "RIGHT", "threshold", "seed"])
def fast_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_lse_b, stride_lse_h, stride_delta_b, stride_delta_h,
    stride_dq_b, stride_dq_h, stride_dq_s,
    H, GROUP_SIZE, S_q, S_k, scale, S_BUCKET, LEFT, RIGHT, dropout_p, threshold, seed,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr = False, VARLEN: tl.constexpr = False, DROPOUT: tl.constexpr = False,
    BLOCK_D_TAIL: tl.constexpr = 0,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    h_kv = h // GROUP_SIZE
    q_start, S_q = sequence_bounds(CU_SEQLENS_Q, b, S_q, VARLEN)
    k_start, S_k = sequence_bounds(CU_SEQLENS_K, b, S_k, VARLEN)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < S_q

    q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
    do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h
    k_base = K + b.to(tl.int64) * stride_k_b + h_kv.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_v_h
    lse_ptrs = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h + offs_m
    delta_ptrs = DELTA + b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h + offs_m
    dq_base = DQ + b.to(tl.int64) * stride_dq_b + h.to(tl.int64) * stride_dq_h
    if VARLEN:   # batch strides are 0: move to the sequence's first rows
        q_base += q_start.to(tl.int64) * stride_q_s
        do_base += q_start.to(tl.int64) * stride_do_s
        k_base += k_start.to(tl.int64) * stride_k_s
        v_base += k_start.to(tl.int64) * stride_v_s
        lse_ptrs += q_start
        delta_ptrs += q_start
        dq_base += q_start.to(tl.int64) * stride_dq_s
    q = load_tile(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d, row_ok, d_ok, True, PAD_D)
    do = load_tile(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d, row_ok, d_ok, True, PAD_D)
    lse2 = tl.load(lse_ptrs, mask=row_ok, other=float("inf")) * LOG2E   # log2 units
    delta = tl.load(delta_ptrs, mask=row_ok, other=0.0)
    qk_scale = scale * LOG2E
    keep_scale = 1.0 / (1.0 - dropout_p)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    PAD_T: tl.constexpr = BLOCK_D + BLOCK_D_TAIL != HEAD_DIM
    if BLOCK_D_TAIL > 0:   # split head dim: columns BLOCK_D .. HEAD_DIM - 1 are a tile of their own
        offs_t = BLOCK_D + tl.arange(0, BLOCK_D_TAIL)
        t_ok = offs_t < HEAD_DIM
        q_t = load_tile(q_base + offs_m[:, None] * stride_q_s + offs_t[None, :] * stride_q_d, row_ok, t_ok, True, PAD_T)
        do_t = load_tile(do_base + offs_m[:, None] * stride_do_s + offs_t[None, :] * stride_do_d, row_ok, t_ok, True,
                         PAD_T)
        dq_t = tl.zeros([BLOCK_M, BLOCK_D_TAIL], dtype=tl.float32)
    else:                  # no tail: stand-ins that _dq_tiles never reads
        offs_t, t_ok, q_t, do_t, dq_t = offs_d, d_ok, q, do, dq
    if WINDOW:   # the forward's three ranges: masked left edge, whole tiles, masked right edge
        lo, free_lo, free_hi, hi = window_tiles(start_m, S_q, S_k, LEFT, RIGHT, BLOCK_M, BLOCK_N)
        dq, dq_t = _dq_tiles(
            dq, dq_t, q, q_t, do, do_t, lse2, delta, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
            start_m, offs_m, offs_d, d_ok, offs_t, t_ok, lo, free_lo, S_k, qk_scale, LEFT, RIGHT, seed, pid_bh, threshold,
            keep_scale, True, False, True, DROPOUT, BLOCK_M, BLOCK_N, PAD_D, DOT_PRECISION, BLOCK_D_TAIL, PAD_T)
        dq, dq_t = _dq_tiles(
            dq, dq_t, q, q_t, do, do_t, lse2, delta, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
            start_m, offs_m, offs_d, d_ok, offs_t, t_ok, free_lo, free_hi, S_k, qk_scale, LEFT, RIGHT, seed, pid_bh, threshold,
            keep_scale, False, False, True, DROPOUT, BLOCK_M, BLOCK_N, PAD_D, DOT_PRECISION, BLOCK_D_TAIL, PAD_T)
        unmasked_end = free_hi
        masked_end = hi
    else:
        # fast_fwd_kernel's key ranges, line for line; kept inline there, as lesson 06 prints that
        # kernel whole (test_fast keeps the two copies equal)
        if CAUSAL:
            free_end = tl.minimum(start_m, S_k)
            masked_end = tl.minimum(start_m + BLOCK_M, S_k)
        else:
            free_end = S_k
            masked_end = S_k
        if VARLEN:   # a block past the end of its (shorter) sequence has nothing to do
            free_end = tl.where(start_m < S_q, free_end, 0)
            masked_end = tl.where(start_m < S_q, masked_end, 0)
        unmasked_end = (free_end // BLOCK_N) * BLOCK_N
        dq, dq_t = _dq_tiles(
            dq, dq_t, q, q_t, do, do_t, lse2, delta, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
            start_m, offs_m, offs_d, d_ok, offs_t, t_ok, 0, unmasked_end, S_k, qk_scale, LEFT, RIGHT, seed, pid_bh, threshold,
            keep_scale, False, CAUSAL, False, DROPOUT, BLOCK_M, BLOCK_N, PAD_D, DOT_PRECISION, BLOCK_D_TAIL, PAD_T)
    dq, dq_t = _dq_tiles(
        dq, dq_t, q, q_t, do, do_t, lse2, delta, k_base, v_base, stride_k_s, stride_k_d, stride_v_s, stride_v_d,
        start_m, offs_m, offs_d, d_ok, offs_t, t_ok, unmasked_end, masked_end, S_k, qk_scale, LEFT, RIGHT, seed, pid_bh,
        threshold, keep_scale, True, CAUSAL, WINDOW, DROPOUT, BLOCK_M, BLOCK_N, PAD_D, DOT_PRECISION, BLOCK_D_TAIL,
        PAD_T)

    store_tile(dq_base + offs_m[:, None] * stride_dq_s + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
               row_ok, d_ok, PAD_D)
    if BLOCK_D_TAIL > 0:
        store_tile(dq_base + offs_m[:, None] * stride_dq_s + offs_t[None, :], (dq_t * scale).to(DQ.dtype.element_ty),
                   row_ok, t_ok, PAD_T)


# --------------------------------------------------------------------------------------
# dK, dV: one program per block of key/value rows (a K/V head: all its GQA query heads)
# --------------------------------------------------------------------------------------
@triton.jit
def _sees(q_pos, k_pos, LEFT, RIGHT, WINDOW: tl.constexpr):
    """True where query ``q_pos`` sees key ``k_pos`` (index tensors that broadcast to the tile, either
    way round): the window's keys q - LEFT ... q + RIGHT, or causally the keys up to q."""
    if WINDOW:
        return (k_pos >= q_pos - LEFT) & (k_pos <= q_pos + RIGHT)
    return k_pos <= q_pos


@triton.jit
def _dkdv_tiles(dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, lse_base, delta_base, dq_base,
                stride_q_s, stride_q_d, stride_do_s, stride_do_d, stride_dq_s,
                offs_n, offs_d, d_ok, offs_t, t_ok, lo, hi, S_q, qk_scale, scale,
                start_n, S_k, LEFT, RIGHT, seed, seq_head, threshold, keep_scale,
                MASKED: tl.constexpr, FUSED_DQ: tl.constexpr, BLOCK_M: tl.constexpr,
                PAD_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                WINDOW: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
                TMA_STATS: tl.constexpr, BLOCK_D_TAIL: tl.constexpr, PAD_T: tl.constexpr, PART: tl.constexpr,
                stride_piece_q, PIECES: tl.constexpr):
    """dK += dS^T Q, dV += P^T dO over query blocks [lo, hi) (PART 1: dK only, 2: dV only). Split head dim (BLOCK_D_TAIL > 0,
    never with TMA or FUSED_DQ): the tail columns ride along as *_t tiles; S^T = K Q^T and
    dP^T = V dO^T sum a main and a tail dot, dK and dV get one dot per part (dk, dk_t; dv, dv_t).
    PIECES (fp32 inputs, the fused kernel): Q and dO arrive as three bf16 planes ``stride_piece_q``
    apart, K and V as their pieces, and every product is six bf16 ones (``pieces.py``)."""
    # Under dropout, 64 x 64 tiles take the tile the other way round (queries down the rows; H100,
    # fp16, B4 H16 S4096 D128 causal: 1.61 ms against 1.78 for the best transposed tile). The other
    # tiles measured slower that way (with 32 query rows Triton falls back from wgmma to mma.sync;
    # 64 x 128 and 128 x 128 spill registers in a compile for sm_90), so they keep S^T
    QUERY_MAJOR: tl.constexpr = DROPOUT and BLOCK_M == 64 and BLOCK_N == 64
    tl.static_assert(not PIECES or not (DROPOUT or TMA or BLOCK_D_TAIL > 0), "pieces: the plain fused tile only")
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < S_q
        if PIECES:
            q = load3(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d, row_ok, d_ok,
                      stride_piece_q, PAD_D)
            do = load3(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d, row_ok, d_ok,
                       stride_piece_q, PAD_D)
        else:   # by the copy engine (TMA: q_base, do_base are tensor descriptors) or by pointers
            q = load_rows(q_base, start_m, offs_m, stride_q_s, stride_q_d, offs_d, row_ok, d_ok, True, PAD_D, TMA)
            do = load_rows(do_base, start_m, offs_m, stride_do_s, stride_do_d, offs_d, row_ok, d_ok, True, PAD_D, TMA)
        if BLOCK_D_TAIL > 0:
            q_t = load_tile(q_base + offs_m[:, None] * stride_q_s + offs_t[None, :] * stride_q_d, row_ok, t_ok, True,
                            PAD_T)
            do_t = load_tile(do_base + offs_m[:, None] * stride_do_s + offs_t[None, :] * stride_do_d, row_ok, t_ok,
                             True, PAD_T)
        if TMA_STATS:   # descriptors too; padded rows arrive as 0, and with q = dO = 0 there P = 1
            lse2 = lse_base.load([start_m]) * LOG2E      # meets only zeros: dV, dS^T add nothing
            delta = delta_base.load([start_m])
        else:           # padded rows: LSE = +inf makes their P exactly 0, no mask needed
            lse2 = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf")) * LOG2E
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        if QUERY_MAJOR:
            # queries down the rows, as in the forward: Z is drawn in the registers that hold P;
            # P Z and dS reach their dots transposed, which the tensor cores read from shared memory
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if BLOCK_D_TAIL > 0:
                s = tl.dot(q_t, tl.trans(k_t), acc=s, input_precision=DOT_PRECISION)
            p = tl.exp2(s * qk_scale - lse2[:, None])
            if MASKED:
                p = tl.where(_sees(offs_m[:, None], offs_n[None, :], LEFT, RIGHT, WINDOW), p, 0.0)
            draws = dropout_draws(seed, seq_head, start_m, start_n, S_k, BLOCK_M, BLOCK_N)
            keep = dropout_survives(draws, threshold)
            pzT = tl.trans(dropout_apply(p.to(do.dtype), draws, threshold))   # dV's 1 / (1 - p): once, at the end
        else:
            sT = mm(k, trans(q, PIECES), DOT_PRECISION, PIECES)
            if BLOCK_D_TAIL > 0:
                sT = tl.dot(k_t, tl.trans(q_t), acc=sT, input_precision=DOT_PRECISION)
            pT = tl.exp2(sT * qk_scale - lse2[None, :])
            if MASKED:
                pT = tl.where(_sees(offs_m[None, :], offs_n[:, None], LEFT, RIGHT, WINDOW), pT, 0.0)
            if FUSED_DQ:
                # Padded key rows (past S_k) hold K = 0, so S = 0 there and P = exp2(-LSE): +inf for a
                # row whose scores are all below about -88 (large logits). Their dK, dV are never
                # stored, but dQ takes dS^T K over every key row, and inf * 0 is NaN: P = 0 there.
                pT = tl.where((offs_n < S_k)[:, None], pT, 0.0)
            if DROPOUT:   # the forward's Z, transposed: its 8-bit draws cross threads through shared memory
                drawsT = tl.trans(dropout_draws(seed, seq_head, start_m, start_n, S_k, BLOCK_M, BLOCK_N))
                keepT = dropout_survives(drawsT, threshold)
                pzT = dropout_apply(operand(pT, do, PIECES), drawsT, threshold)
            else:
                pzT = operand(pT, do, PIECES)
        if PART != 1:
            dv += mm(pzT, do, DOT_PRECISION, PIECES)
            if BLOCK_D_TAIL > 0:
                dv_t += tl.dot(pzT, do_t, input_precision=DOT_PRECISION)
        if PART != 2:   # dS = P * (dP - delta), dP = dO V^T (times Z / (1 - p) under dropout: one FFMA)
            if QUERY_MAJOR:
                dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
                if BLOCK_D_TAIL > 0:
                    dp = tl.dot(do_t, tl.trans(v_t), acc=dp, input_precision=DOT_PRECISION)
                dsT = tl.trans((p * (tl.where(keep, dp, 0.0) * keep_scale - delta[:, None])).to(q.dtype))
            else:
                dpT = mm(v, trans(do, PIECES), DOT_PRECISION, PIECES)
                if BLOCK_D_TAIL > 0:
                    dpT = tl.dot(v_t, tl.trans(do_t), acc=dpT, input_precision=DOT_PRECISION)
                if DROPOUT:
                    dsT = operand(pT * (tl.where(keepT, dpT, 0.0) * keep_scale - delta[None, :]), q, PIECES)
                else:
                    dsT = operand(pT * (dpT - delta[None, :]), q, PIECES)
            dk += mm(dsT, q, DOT_PRECISION, PIECES)
            if BLOCK_D_TAIL > 0:
                dk_t += tl.dot(dsT, q_t, input_precision=DOT_PRECISION)
        if FUSED_DQ:   # this tile's share of dQ = dS K * scale, added into the fp32 buffer
            dq_part = mm(trans(dsT, PIECES), k, DOT_PRECISION, PIECES) * scale
            tl.atomic_add(dq_base + offs_m[:, None] * stride_dq_s + offs_d[None, :], dq_part,
                          mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv, dk_t, dv_t


@triton.jit(do_not_specialize=["S_q", "S_k", "S_BUCKET", "LEFT", "RIGHT", "threshold", "seed"])
def fast_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_lse_b, stride_lse_h, stride_delta_b, stride_delta_h,
    stride_dk_b, stride_dk_h, stride_dk_s,
    stride_dv_b, stride_dv_h, stride_dv_s,
    stride_dq_b, stride_dq_h, stride_dq_s,
    H_KV, GROUP_SIZE, S_q, S_k, scale, S_BUCKET, LEFT, RIGHT, dropout_p, threshold, seed,
    stride_piece_q, stride_piece_kv, CAUSAL: tl.constexpr, FUSED_DQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAD_D: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr = False, VARLEN: tl.constexpr = False, DROPOUT: tl.constexpr = False,
    TMA: tl.constexpr = False, TMA_STATS: tl.constexpr = False, BLOCK_D_TAIL: tl.constexpr = 0,
    DKDV_PART: tl.constexpr = 0, PIECES: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV
    q_start, S_q = sequence_bounds(CU_SEQLENS_Q, b, S_q, VARLEN)
    k_start, S_k = sequence_bounds(CU_SEQLENS_K, b, S_k, VARLEN)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    col_ok = offs_n < S_k
    k_base = K + b.to(tl.int64) * stride_k_b + h_kv.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h_kv.to(tl.int64) * stride_v_h
    dk_base = DK + b.to(tl.int64) * stride_dk_b + h_kv.to(tl.int64) * stride_dk_h
    dv_base = DV + b.to(tl.int64) * stride_dv_b + h_kv.to(tl.int64) * stride_dv_h
    if VARLEN:   # batch strides are 0: move to the sequence's first rows
        k_base += k_start.to(tl.int64) * stride_k_s
        v_base += k_start.to(tl.int64) * stride_v_s
        dk_base += k_start.to(tl.int64) * stride_dk_s
        dv_base += k_start.to(tl.int64) * stride_dv_s
    k_ptrs = k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d
    v_ptrs = v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d
    if PIECES:   # fp32: K and V come as three bf16 planes too (pieces.py)
        k = load3(k_ptrs, col_ok, d_ok, stride_piece_kv, PAD_D)
        v = load3(v_ptrs, col_ok, d_ok, stride_piece_kv, PAD_D)
    else:
        k = load_tile(k_ptrs, col_ok, d_ok, True, PAD_D)
        v = load_tile(v_ptrs, col_ok, d_ok, True, PAD_D)
    qk_scale = scale * LOG2E
    keep_scale = 1.0 / (1.0 - dropout_p)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    PAD_T: tl.constexpr = BLOCK_D + BLOCK_D_TAIL != HEAD_DIM
    if BLOCK_D_TAIL > 0:   # split head dim: columns BLOCK_D .. HEAD_DIM - 1 are a tile of their own
        offs_t = BLOCK_D + tl.arange(0, BLOCK_D_TAIL)
        t_ok = offs_t < HEAD_DIM
        k_t = load_tile(k_base + offs_n[:, None] * stride_k_s + offs_t[None, :] * stride_k_d, col_ok, t_ok, True, PAD_T)
        v_t = load_tile(v_base + offs_n[:, None] * stride_v_s + offs_t[None, :] * stride_v_d, col_ok, t_ok, True, PAD_T)
        dk_t = tl.zeros([BLOCK_N, BLOCK_D_TAIL], dtype=tl.float32)
        dv_t = tl.zeros([BLOCK_N, BLOCK_D_TAIL], dtype=tl.float32)
    else:                  # no tail: stand-ins that _dkdv_tiles never reads
        offs_t, t_ok, k_t, v_t, dk_t, dv_t = offs_d, d_ok, k, v, dk, dv
    q_end = S_q
    if VARLEN:   # a key block past the end of its (shorter) sequence has nothing to do
        q_end = tl.where(start_n < S_k, S_q, 0)

    for g in range(0, GROUP_SIZE):
        h = h_kv * GROUP_SIZE + g
        q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
        do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h
        lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
        delta_base = DELTA + b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h
        dq_base = DQ_ACC + b.to(tl.int64) * stride_dq_b + h.to(tl.int64) * stride_dq_h
        if VARLEN:
            q_base += q_start.to(tl.int64) * stride_q_s
            do_base += q_start.to(tl.int64) * stride_do_s
            lse_base += q_start
            delta_base += q_start
        if TMA:   # Hopper: the copy engine fetches each Q and dO tile, no address arithmetic per element
            q_base = tl.make_tensor_descriptor(q_base, shape=[S_q, HEAD_DIM], strides=[stride_q_s, 1],
                                               block_shape=[BLOCK_M, BLOCK_D])
            do_base = tl.make_tensor_descriptor(do_base, shape=[S_q, HEAD_DIM], strides=[stride_do_s, 1],
                                                block_shape=[BLOCK_M, BLOCK_D])
        if TMA_STATS:   # the LSE and delta vectors: one copy per tile, not a scalar load per element
            lse_base = tl.make_tensor_descriptor(lse_base, shape=[S_q], strides=[1], block_shape=[BLOCK_M])
            delta_base = tl.make_tensor_descriptor(delta_base, shape=[S_q], strides=[1], block_shape=[BLOCK_M])
        seq_head = b * H_KV * GROUP_SIZE + h                 # the forward's program_id(1) for this head
        if WINDOW:   # the query rows that see these keys: masked edges, whole tiles between
            lo, free_lo, free_hi, hi = window_tiles(start_n, S_k, S_q, RIGHT, LEFT, BLOCK_N, BLOCK_M)
            dk, dv, dk_t, dv_t = _dkdv_tiles(
                dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, lse_base, delta_base, dq_base,
                stride_q_s, stride_q_d, stride_do_s, stride_do_d, stride_dq_s,
                offs_n, offs_d, d_ok, offs_t, t_ok, lo, free_lo, S_q, qk_scale, scale,
                start_n, S_k, LEFT, RIGHT, seed, seq_head, threshold, keep_scale,
                True, FUSED_DQ, BLOCK_M, PAD_D, DOT_PRECISION, True, DROPOUT, BLOCK_N, TMA, TMA_STATS,
                BLOCK_D_TAIL, PAD_T, DKDV_PART, stride_piece_q, PIECES)
            dk, dv, dk_t, dv_t = _dkdv_tiles(
                dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, lse_base, delta_base, dq_base,
                stride_q_s, stride_q_d, stride_do_s, stride_do_d, stride_dq_s,
                offs_n, offs_d, d_ok, offs_t, t_ok, free_lo, free_hi, S_q, qk_scale, scale,
                start_n, S_k, LEFT, RIGHT, seed, seq_head, threshold, keep_scale,
                False, FUSED_DQ, BLOCK_M, PAD_D, DOT_PRECISION, True, DROPOUT, BLOCK_N, TMA, TMA_STATS,
                BLOCK_D_TAIL, PAD_T, DKDV_PART, stride_piece_q, PIECES)
            dk, dv, dk_t, dv_t = _dkdv_tiles(
                dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, lse_base, delta_base, dq_base,
                stride_q_s, stride_q_d, stride_do_s, stride_do_d, stride_dq_s,
                offs_n, offs_d, d_ok, offs_t, t_ok, free_hi, hi, S_q, qk_scale, scale,
                start_n, S_k, LEFT, RIGHT, seed, seq_head, threshold, keep_scale,
                True, FUSED_DQ, BLOCK_M, PAD_D, DOT_PRECISION, True, DROPOUT, BLOCK_N, TMA, TMA_STATS,
                BLOCK_D_TAIL, PAD_T, DKDV_PART, stride_piece_q, PIECES)
        else:
            if CAUSAL:
                # rows start_n .. start_n+BLOCK_N-1 straddle the diagonal (BLOCK_M divides BLOCK_N);
                # every later row sees the whole key block.
                diag_end = tl.minimum(start_n + BLOCK_N, q_end)
                dk, dv, dk_t, dv_t = _dkdv_tiles(
                    dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, lse_base, delta_base, dq_base,
                    stride_q_s, stride_q_d, stride_do_s, stride_do_d, stride_dq_s,
                    offs_n, offs_d, d_ok, offs_t, t_ok, start_n, diag_end, S_q, qk_scale, scale,
                    start_n, S_k, LEFT, RIGHT, seed, seq_head, threshold, keep_scale,
                    True, FUSED_DQ, BLOCK_M, PAD_D, DOT_PRECISION, False, DROPOUT, BLOCK_N, TMA, TMA_STATS,
                    BLOCK_D_TAIL, PAD_T, DKDV_PART, stride_piece_q, PIECES)
                first_free = start_n + BLOCK_N
            else:
                first_free = 0
            dk, dv, dk_t, dv_t = _dkdv_tiles(
                dk, dv, dk_t, dv_t, k, v, k_t, v_t, q_base, do_base, lse_base, delta_base, dq_base,
                stride_q_s, stride_q_d, stride_do_s, stride_do_d, stride_dq_s,
                offs_n, offs_d, d_ok, offs_t, t_ok, first_free, q_end, S_q, qk_scale, scale,
                start_n, S_k, LEFT, RIGHT, seed, seq_head, threshold, keep_scale,
                False, FUSED_DQ, BLOCK_M, PAD_D, DOT_PRECISION, False, DROPOUT, BLOCK_N, TMA, TMA_STATS,
                BLOCK_D_TAIL, PAD_T, DKDV_PART, stride_piece_q, PIECES)

    if DKDV_PART != 2:
        store_tile(dk_base + offs_n[:, None] * stride_dk_s + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
                   col_ok, d_ok, PAD_D)
        if BLOCK_D_TAIL > 0:
            store_tile(dk_base + offs_n[:, None] * stride_dk_s + offs_t[None, :],
                       (dk_t * scale).to(DK.dtype.element_ty), col_ok, t_ok, PAD_T)
    if DKDV_PART != 1:
        if DROPOUT:
            dv = dv * keep_scale
        store_tile(dv_base + offs_n[:, None] * stride_dv_s + offs_d[None, :], dv.to(DV.dtype.element_ty),
                   col_ok, d_ok, PAD_D)
        if BLOCK_D_TAIL > 0:
            if DROPOUT:
                dv_t = dv_t * keep_scale
            store_tile(dv_base + offs_n[:, None] * stride_dv_s + offs_t[None, :], dv_t.to(DV.dtype.element_ty),
                       col_ok, t_ok, PAD_T)


_tuned_dq = tuning.autotuned(fast_dq_kernel, "dq")
_TUNED = {name: tuning.autotuned(fast_dkdv_kernel, name, reset_to_zero=["DQ_ACC"] if name in ("fused", "pieces") else None)
          for name in ("dkdv", "fused", "dk", "dv", "pieces")}   # one autotuner per launch: DKDV_PART is not in its key


_delta_plans: dict = {}     # (head dim, dtype, device) -> (tile, DirectLaunch)


def backward_delta(o, do):
    """delta = rowsum(dO * O): the lesson's kernel (``backward.attention_backward_delta``), launched
    directly once its tile is known (``launch.DirectLaunch``: a few microseconds, not tens)."""
    if runtime.INTERPRET:
        return attention_backward_delta(o, do)
    runtime.validate_grad_output(do, o)
    key = (o.shape[-1], o.dtype, o.device)
    plan = _delta_plans.get(key)
    if plan is None:
        cfg = configs.candidates("delta", o.shape[-1], o.dtype, o.device)[0]
        plan = _delta_plans[key] = (cfg, DirectLaunch(attn_bwd_delta_kernel, delta_meta(cfg, o.shape[-1])))
    cfg, direct = plan
    delta, grid, args = delta_launch(o, do, cfg)
    plans.count_launch()
    direct(grid, args)
    return delta


def fast_attention_backward(q, k, v, o, do, lse, causal: bool, scale: float,
                            needs_dq: bool = True, needs_dkdv: bool = True, *, fused: bool | None = None,
                            config=None, warmup: bool = False,
                            layout=None, window_args=(False, 0, 0), dropout_p: float = 0.0, seed: int = 0):
    """(dq, dk, dv) by the tuned backward; None for what was not asked for. ``fused``: True for
    one dK/dV kernel that also adds dQ with atomics (see the module's docstring), False for the
    two kernels, None (the default) for ``tuning.fused_by_default``: two kernels, except fp32,
    which runs fused (on bf16 pieces, ``pieces.py``, at fp32's accuracy). ``warmup=True`` only compiles the kernels
    (see ``fast.precompile``).
    fp16/bf16/fp32, head dim a multiple of 8 up to 256, any strides (dO's own too); the two
    kernels split a head dim of 128 < D <= 192 into 128 + tail columns (``tuning.head_dim_tail``).
    ``layout``, ``window_args``, ``dropout_p``, ``seed``: lesson 09's features, as the forward's.
    A plain fp16/bf16 call of the two kernels replays the launch plan of an earlier call of the
    same signature (``plans.py``: the host's work done once). On Hopper, where ``hopper.BACKWARD_PREFERRED``
    names a Gluon variant that measured faster (D 64 causal from 4k keys), a plain call of both gradients runs it."""
    covered = plans.covers(q, config, warmup, layout, window_args, dropout_p)
    if fused is None and needs_dq and needs_dkdv and covered and do.dtype == q.dtype:   # "auto" only: no kernel asked for
        variant = hopper.preferred_backward(q, k, causal)          # a dict lookup: None for most calls
        if variant is not None and hopper.supports(q, k, v, causal, scale)[0]:
            return hopper.launch_backward(q, k, v, o, do, lse, causal, scale, variant, delta=backward_delta(o, do))
    if fused is not True and covered and plans.enabled():
        inputs = (q, k, v, o, do, lse)
        return plans.replay_or_record(plans.signature(inputs, ("bwd", causal, scale, needs_dq, needs_dkdv)), inputs,
                                      lambda: _launch_backward(q, k, v, o, do, lse, causal, scale, needs_dq,
                                                               needs_dkdv, fused=False),
                                      allocator=tuning.ensure_allocator if q.shape[-1] == 128 else None)
    return _launch_backward(q, k, v, o, do, lse, causal, scale, needs_dq, needs_dkdv, fused=fused, config=config,
                            warmup=warmup, layout=layout, window_args=window_args, dropout_p=dropout_p, seed=seed)


def _launch_backward(q, k, v, o, do, lse, causal: bool, scale: float,
                     needs_dq: bool = True, needs_dkdv: bool = True, *, fused: bool | None = None,
                     config=None, warmup: bool = False,
                     layout=None, window_args=(False, 0, 0), dropout_p: float = 0.0, seed: int = 0):
    """fast_attention_backward's plain path: tiles, arguments, launches."""
    H, D = q.shape[1], q.shape[3]
    H_kv = k.shape[1]
    if layout is None:
        B, S_q, S_k, varlen, cu_q, cu_k = q.shape[0], q.shape[2], k.shape[2], False, q, q
    else:
        B, S_q, S_k, varlen, cu_q, cu_k = layout.batches, layout.S_q, layout.S_k, layout.varlen, layout.cu_q, layout.cu_k
        fused = False                     # lesson 09's features run on the two-kernel backward
    plain = layout is None and not window_args[0] and not dropout_p     # none of lesson 09's features
    if fused is None:
        fused = tuning.fused_by_default(q, plain)
    fused = fused and needs_dq and needs_dkdv
    pieces = fused and tuning.fp32_pieces(q, plain)
    new, strides = tuning.outputs_and_strides(layout, warmup)
    delta = tuning.ArgSpec(lse.shape, lse.dtype, lse.device) if warmup else backward_delta(o, do)
    S_BUCKET = tuning.bucket(S_q, S_k)
    q_in, k_in, v_in, do_in, stride_piece_q, stride_piece_kv = q, k, v, do, 0, 0
    if pieces:   # fp32: Q, dO and K, V split once into bf16 planes, which the kernel loads (pieces.py)
        planes_q, planes_kv = split_pieces(q, do, warmup=warmup), split_pieces(k, v, warmup=warmup)
        stride_piece_q, stride_piece_kv = planes_q.stride(0), planes_kv.stride(0)
        if warmup:
            q_in = do_in = tuning.ArgSpec(q.shape, torch.bfloat16, q.device)
            k_in = v_in = tuning.ArgSpec(k.shape, torch.bfloat16, k.device)
        else:
            q_in, do_in, k_in, v_in = planes_q[0, 0], planes_q[0, 1], planes_kv[0, 0], planes_kv[0, 1]
    # what both kernels take, by name (``launch.arguments`` orders them)
    common = dict(LSE=lse, DELTA=delta, CU_SEQLENS_Q=cu_q, CU_SEQLENS_K=cu_k,
                  **launch.strides("q", strides(q_in)), **launch.strides("k", strides(k_in)),
                  **launch.strides("v", strides(v_in)), **launch.strides("do", strides(do_in)),
                  **launch.strides("lse", strides(lse)[:2]), **launch.strides("delta", strides(delta)[:2]),
                  GROUP_SIZE=H // H_kv, S_q=S_q, S_k=S_k, scale=scale, S_BUCKET=S_BUCKET,
                  LEFT=window_args[1], RIGHT=window_args[2], dropout_p=float(dropout_p),
                  threshold=dropout_threshold(dropout_p), seed=seed)
    # TMA loads where they measured faster on an H100 (notebook 06): D = 128 with a long query loop,
    # 4-9% off the backward at S >= 4k; at S = 1k causal the descriptors' setup cost 16%, at D = 64
    # nothing was gained, and the fused kernel got slower
    tma = not fused and D == 128 and S_q >= 2048 and tuning.tma_ready(q, do)
    tma_stats = tma and not varlen and tuning.tma_stats_ready(lse)
    if tma and not warmup:
        tuning.ensure_allocator()     # in this (launching) thread: descriptors need a scratch buffer
    meta = dict(tuning.constants(q, causal, backward=not pieces), WINDOW=window_args[0], VARLEN=varlen,
                DROPOUT=dropout_p > 0)
    # split head dim for the two kernels (the fused one keeps the padded tile): main 128 + tail
    tail = 0 if fused else tuning.head_dim_tail(D)
    assert not (tail and tma), "TMA loads are for D = 128 only; the split is for 128 < D <= 192"
    split = dict(BLOCK_D=128, PAD_D=False, BLOCK_D_TAIL=tail) if tail else dict(BLOCK_D_TAIL=0)
    dq = dk = dv = None
    if needs_dq and not fused:
        dq = new(tuple(q.shape), q.dtype, q.device)
        args = launch.arguments(fast_dq_kernel, Q=q, K=k, V=v, DO=do, DQ=dq, **launch.strides("dq", strides(dq)[:3]),
                                H=H, **common)
        tuning.run("dq", fast_dq_kernel, _tuned_dq, lambda m: (triton.cdiv(S_q, m["BLOCK_M"]), B * H),
                   args, dict(meta, **split), config=config, warmup=warmup)
    if needs_dkdv:
        dk = new(tuple(k.shape), k.dtype, k.device)
        dv = new(tuple(v.shape), v.dtype, v.device)
        # fused: atomics add into an fp32 buffer; otherwise the argument is a placeholder
        if fused:
            dq_acc = (tuning.ArgSpec(q.shape, torch.float32, q.device) if warmup
                      else torch.zeros(q.shape, dtype=torch.float32, device=q.device))
        else:
            dq_acc = dk
        args = launch.arguments(fast_dkdv_kernel, Q=q_in, K=k_in, V=v_in, DO=do_in, DK=dk, DV=dv, DQ_ACC=dq_acc,
                                **launch.strides("dk", strides(dk)[:3]), **launch.strides("dv", strides(dv)[:3]),
                                **launch.strides("dq", strides(dq_acc)[:3]), H_KV=H_kv,
                                stride_piece_q=stride_piece_q, stride_piece_kv=stride_piece_kv, **common)
        parts = ("pieces",) if pieces else tuning.dkdv_parts(D, fused)    # D > 192: dK and dV by a launch each
        assert not (tma and len(parts) > 1), "TMA loads are for D = 128 only; dK, dV are split at D > 192"
        for name in parts:
            tuning.run(name, fast_dkdv_kernel, _TUNED[name], lambda m: (triton.cdiv(S_k, m["BLOCK_N"]), B * H_kv),
                       args, dict(meta, **split, FUSED_DQ=fused, TMA=tma, TMA_STATS=tma_stats,
                                  DKDV_PART=tuning.DKDV_PART[name], PIECES=pieces), config=config, warmup=warmup)
        if fused and not warmup:
            dq = dq_acc.to(q.dtype)
    return dq, dk, dv
