"""Lesson 09's kernels: the forward, dQ and dK/dV kernels of lessons 02-04 with three features
that real training needs, each a constexpr switch that compiles away when it is off.

* **Windows** (``WINDOW``): key j is visible from query i when ``i - LEFT <= j <= i + RIGHT``.
  Causal attention is the window (inf, 0), so this family has no separate causal flag. Each
  program loops only over the tiles that the window can reach; boundary tiles are masked.
* **Dropout** (``DROPOUT``): ``O = (P * Z / (1 - p)) V`` with a random keep-mask Z that is never
  stored. Philox, keyed by (seed, sequence, head) and counted by (i, j // 8), gives the same Z
  in the forward and in both backward kernels, so the backward *recomputes* it, as it recomputes P
  (``flashattn.features.dropout_keep``, shared with the fast kernels).
* **Packed variable-length batches** (``VARLEN``): the sequences lie one after another in one
  tensor; ``CU_SEQLENS_Q[b]`` is where sequence b starts (``cu_seqlens`` of FlashAttention). A
  program finds its sequence's start and length and works in positions inside that sequence, so no
  query ever sees another sequence's keys.

The math of the backward changes in one place each: dropout scales dP and P^T dO by Z / (1 - p);
windows and varlen only change which (i, j) exist. delta = rowsum(dO * O) still holds, so the
delta kernel of ``flashattn.backward`` is reused as it is.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import configs, runtime
from ..backward import attention_backward_delta
from ..configs import KernelConfig
from ..features import dropout_keep, dropout_threshold, sequence_bounds, visible_in_window


# --------------------------------------------------------------------------------------
# 0. what every kernel shares: where a sequence lies, which (i, j) exist, which survive dropout
# --------------------------------------------------------------------------------------
@triton.jit
def rows_of(T, b, h, first_row, stride_b, stride_h, stride_s):
    """Pointer to row ``first_row`` of (batch entry b, head h) of tensor T, with T's own
    strides and 64-bit offsets (B * H * S * D can exceed 2**31)."""
    return T + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + first_row.to(tl.int64) * stride_s


@triton.jit
def tiles_in_reach(pid, S_own, S_other, BEFORE, AFTER, WINDOW: tl.constexpr,
                   BLOCK_OWN: tl.constexpr, BLOCK_OTHER: tl.constexpr):
    """[start, end) of the other side's positions that block ``pid`` of this side must visit:
    position p reaches p - BEFORE ... p + AFTER, so the block reaches from its first position
    - BEFORE (rounded down to a whole tile) to its last + AFTER, inside [0, S_other). A block past
    the end of its sequence visits nothing. Query blocks: (BEFORE, AFTER) = (LEFT, RIGHT); key
    blocks look the other way: (RIGHT, LEFT)."""
    start = 0
    end = tl.minimum(S_other, (pid + 1) * BLOCK_OWN + AFTER)
    if WINDOW:
        start = tl.maximum(0, pid * BLOCK_OWN - BEFORE) // BLOCK_OTHER * BLOCK_OTHER
    if pid * BLOCK_OWN >= S_own:
        end = 0
    return start, end


# --------------------------------------------------------------------------------------
# 1. forward: O and LSE
# --------------------------------------------------------------------------------------
@triton.jit
def beyond_fwd_kernel(
    Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_o_b, stride_o_h, stride_o_s, stride_o_d,
    stride_lse_b, stride_lse_h, stride_lse_s,
    H, GROUP_SIZE, S_q, S_k, HEAD_DIM, scale, LEFT, RIGHT, dropout_p, threshold, seed,
    WINDOW: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H                   # the batch entry, or the sequence of a packed batch
    h = pid_bh % H
    h_kv = h // GROUP_SIZE
    q_start, S_q = sequence_bounds(CU_SEQLENS_Q, b, S_q, VARLEN)
    k_start, S_k = sequence_bounds(CU_SEQLENS_K, b, S_k, VARLEN)
    # A packed tensor has one "batch entry" (the launcher passes batch strides of 0); its
    # sequences start at rows q_start / k_start.
    q_base = rows_of(Q, b, h, q_start, stride_q_b, stride_q_h, stride_q_s)
    k_base = rows_of(K, b, h_kv, k_start, stride_k_b, stride_k_h, stride_k_s)
    v_base = rows_of(V, b, h_kv, k_start, stride_v_b, stride_v_h, stride_v_s)
    o_base = rows_of(O, b, h, q_start, stride_o_b, stride_o_h, stride_o_s)
    lse_base = rows_of(LSE, b, h, q_start, stride_lse_b, stride_lse_h, stride_lse_s)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)     # positions inside this sequence
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < S_q
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    acc_dtype = LSE.dtype.element_ty
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=acc_dtype)
    l_i = tl.zeros([BLOCK_M], dtype=acc_dtype)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)

    # Only the key tiles this block's window reaches: the others are never loaded (the window's saving).
    kv_start, kv_end = tiles_in_reach(pid_m, S_q, S_k, LEFT, RIGHT, WINDOW, BLOCK_M, BLOCK_N)
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S_k
        k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = visible_in_window(offs_m[:, None], offs_n[None, :], S_q, S_k, LEFT, RIGHT, WINDOW)
        s = tl.where(visible, s, float("-inf"))

        # Online softmax. A window can hide every key of a tile from a row (even every key of
        # the row): a max of -inf is replaced by 0, so exp(-inf - 0) = 0, never exp(nan).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)            # the softmax sums all of P ...
        if DROPOUT:                                      # ... O sees only the kept part, rescaled
            keep = dropout_keep(seed, pid_bh, pid_m * BLOCK_M, start_n, S_k, threshold, BLOCK_M, BLOCK_N)
            p = tl.where(keep, p / (1.0 - dropout_p), 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen_any = l_i > 0                                   # a row the window leaves without keys:
    o = acc / tl.where(seen_any, l_i, 1.0)[:, None]      # O = 0, and LSE = +inf so that the
    lse = tl.where(seen_any, m_i + tl.log(tl.where(seen_any, l_i, 1.0)), float("inf"))  # P = exp(S - LSE) = 0
    tl.store(o_base + offs_m[:, None] * stride_o_s + offs_d[None, :] * stride_o_d,
             o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_base + offs_m * stride_lse_s, lse, mask=row_ok)


class Layout:
    """How a launcher sees q, k, v: 4-D ``[B, H, S, D]`` views, the grid's batch axis (batch
    entries, or sequences of a packed batch), the longest lengths, and the kernel arguments that
    describe the batch (cu_seqlens and their constexpr switch)."""

    def __init__(self, q, k, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
        self.varlen = cu_seqlens_q is not None
        if self.varlen:
            self.batches = cu_seqlens_q.numel() - 1
            self.S_q, self.S_k = int(max_seqlen_q), int(max_seqlen_k)
            self.cu_q, self.cu_k = cu_seqlens_q, cu_seqlens_k
        else:
            self.batches, self.S_q, self.S_k = q.shape[0], q.shape[2], k.shape[2]
            self.cu_q = self.cu_k = q          # never read: VARLEN=False compiles the loads away

    def strides(self, t: torch.Tensor) -> tuple:
        """A tensor's strides as the kernels take them; a packed tensor's batch stride is 0."""
        return (0, *t.stride()[1:]) if self.varlen else tuple(t.stride())

    def spec(self, shape: tuple, dtype: torch.dtype, device):
        """What ``new`` would return, as a ``fast.tuning.ArgSpec`` (warm-ups allocate nothing)."""
        from ..fast.tuning import ArgSpec

        if not self.varlen or len(shape) == 3:
            return ArgSpec(shape, dtype, device)
        B, H, T, D = shape
        return ArgSpec(shape, dtype, device, stride=(T * H * D, D, H * D, 1))

    def new(self, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """An output with the 4-D (or, for LSE, 3-D) view ``shape``. Packed: stored as the user
        gets it, ``[T, H, D]`` (LSE ``[H, T]``), and viewed as ``[1, H, T, D]``."""
        if not self.varlen:
            return runtime.new_output(shape, dtype, device)
        if len(shape) == 3:
            return runtime.new_output(shape[1:], dtype, device)[None]
        return runtime.new_output((shape[2], shape[1], shape[3]), dtype, device).permute(1, 0, 2)[None]


def window_bounds(window, causal: bool, S_q: int, S_k: int) -> tuple[bool, int, int]:
    """(WINDOW, LEFT, RIGHT) for the kernels: -1 (no limit) becomes a bound no position reaches,
    and causal narrows RIGHT to 0."""
    left, right = window if window is not None else (-1, -1)
    unlimited = S_q + S_k
    left = unlimited if left < 0 else left
    right = unlimited if right < 0 else right
    if causal:
        right = min(right, 0)
    return left < unlimited or right < unlimited, left, right


def beyond_forward(q, k, v, layout: Layout, scale: float, window_args: tuple, dropout_p: float,
                   seed: int, *, config: Optional[KernelConfig] = None):
    """O (like q) and LSE (fp32, ``[B, H, S_q]``) for 4-D views q ``[B, H, S_q, D]``, k and v
    ``[B, H_kv, S_k, D]`` (packed: B = 1, S = the total length)."""
    B, H, S_total, D = q.shape
    H_kv = k.shape[1]
    o = layout.new((B, H, S_total, D), q.dtype, q.device)
    lse = layout.new((B, H, S_total), runtime.stats_dtype(q.dtype), q.device)
    windowed, left, right = window_args

    def run(cfg: KernelConfig) -> None:
        grid = (triton.cdiv(layout.S_q, cfg.BLOCK_M), layout.batches * H)
        beyond_fwd_kernel[grid](
            q, k, v, o, lse, layout.cu_q, layout.cu_k,
            *layout.strides(q), *layout.strides(k), *layout.strides(v), *layout.strides(o), *layout.strides(lse),
            H, H // H_kv, layout.S_q, layout.S_k, D, scale, left, right,
            dropout_p, dropout_threshold(dropout_p), seed,
            WINDOW=windowed, DROPOUT=dropout_p > 0, VARLEN=layout.varlen,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=runtime.head_dim_block(D),
            DOT_PRECISION=runtime.dot_precision(q.dtype, D), **cfg.launch_options())

    configs.launch(("beyond_fwd", D, q.dtype, q.device), configs.candidates("fwd", D, q.dtype, q.device, config), run)
    return o, lse


# --------------------------------------------------------------------------------------
# 2. dQ: one program per block of query rows
# --------------------------------------------------------------------------------------
@triton.jit
def beyond_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_lse_b, stride_lse_h, stride_lse_s,
    stride_delta_b, stride_delta_h, stride_delta_s,
    stride_dq_b, stride_dq_h, stride_dq_s, stride_dq_d,
    H, GROUP_SIZE, S_q, S_k, HEAD_DIM, scale, LEFT, RIGHT, dropout_p, threshold, seed,
    WINDOW: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    h_kv = h // GROUP_SIZE
    q_start, S_q = sequence_bounds(CU_SEQLENS_Q, b, S_q, VARLEN)
    k_start, S_k = sequence_bounds(CU_SEQLENS_K, b, S_k, VARLEN)
    q_base = rows_of(Q, b, h, q_start, stride_q_b, stride_q_h, stride_q_s)
    do_base = rows_of(DO, b, h, q_start, stride_do_b, stride_do_h, stride_do_s)
    dq_base = rows_of(DQ, b, h, q_start, stride_dq_b, stride_dq_h, stride_dq_s)
    lse_base = rows_of(LSE, b, h, q_start, stride_lse_b, stride_lse_h, stride_lse_s)
    delta_base = rows_of(DELTA, b, h, q_start, stride_delta_b, stride_delta_h, stride_delta_s)
    k_base = rows_of(K, b, h_kv, k_start, stride_k_b, stride_k_h, stride_k_s)
    v_base = rows_of(V, b, h_kv, k_start, stride_v_b, stride_v_h, stride_v_s)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < S_q
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d,
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok, other=0.0)
    delta = tl.load(delta_base + offs_m * stride_delta_s, mask=row_ok, other=0.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=LSE.dtype.element_ty)
    kv_start, kv_end = tiles_in_reach(pid_m, S_q, S_k, LEFT, RIGHT, WINDOW, BLOCK_M, BLOCK_N)  # as the forward
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S_k
        k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = visible_in_window(offs_m[:, None], offs_n[None, :], S_q, S_k, LEFT, RIGHT, WINDOW)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)      # P rebuilt from LSE, as ever

        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:     # O used P * Z / (1 - p), so dP = (dO V^T) * Z / (1 - p): Z regenerated
            keep = dropout_keep(seed, pid_bh, pid_m * BLOCK_M, start_n, S_k, threshold, BLOCK_M, BLOCK_N)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)

    dq = dq * scale
    tl.store(dq_base + offs_m[:, None] * stride_dq_s + offs_d[None, :] * stride_dq_d,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------------------
# 3. dK, dV: one program per block of key rows, looping over the query rows that see them
# --------------------------------------------------------------------------------------
# Lesson 04's attn_bwd_dkdv_kernel plus the three switches, a whole copy on purpose (as the forward
# and dQ above are lessons 02's and 03's): lesson 04's kernel stays as that lesson prints it, and
# lesson 09 is read against it.
@triton.jit
def beyond_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_lse_b, stride_lse_h, stride_lse_s,
    stride_delta_b, stride_delta_h, stride_delta_s,
    stride_dk_b, stride_dk_h, stride_dk_s, stride_dk_d,
    stride_dv_b, stride_dv_h, stride_dv_s, stride_dv_d,
    H_KV, GROUP_SIZE, S_q, S_k, HEAD_DIM, scale, LEFT, RIGHT, dropout_p, threshold, seed,
    WINDOW: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV
    q_start, S_q = sequence_bounds(CU_SEQLENS_Q, b, S_q, VARLEN)
    k_start, S_k = sequence_bounds(CU_SEQLENS_K, b, S_k, VARLEN)
    k_base = rows_of(K, b, h_kv, k_start, stride_k_b, stride_k_h, stride_k_s)
    v_base = rows_of(V, b, h_kv, k_start, stride_v_b, stride_v_h, stride_v_s)
    dk_base = rows_of(DK, b, h_kv, k_start, stride_dk_b, stride_dk_h, stride_dk_s)
    dv_base = rows_of(DV, b, h_kv, k_start, stride_dv_b, stride_dv_h, stride_dv_s)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < S_k
    d_ok = offs_d < HEAD_DIM
    k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,
                mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d,
                mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=LSE.dtype.element_ty)

    # The query rows that can see these keys: key j is seen by rows j - RIGHT ... j + LEFT.
    m_start, m_end = tiles_in_reach(pid_n, S_k, S_q, RIGHT, LEFT, WINDOW, BLOCK_N, BLOCK_M)
    for g in range(0, GROUP_SIZE):                       # GQA: every query head of the group
        h = h_kv * GROUP_SIZE + g
        seq_head = b * H_KV * GROUP_SIZE + h             # the forward's pid_bh for this head
        q_base = rows_of(Q, b, h, q_start, stride_q_b, stride_q_h, stride_q_s)
        do_base = rows_of(DO, b, h, q_start, stride_do_b, stride_do_h, stride_do_s)
        lse_base = rows_of(LSE, b, h, q_start, stride_lse_b, stride_lse_h, stride_lse_s)
        delta_base = rows_of(DELTA, b, h, q_start, stride_delta_b, stride_delta_h, stride_delta_s)
        for start_m in range(m_start, m_end, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < S_q
            q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d,
                         mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            lse = tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok, other=0.0)
            delta = tl.load(delta_base + offs_m * stride_delta_s, mask=row_ok, other=0.0)

            # The transposed tile [BLOCK_N, BLOCK_M], as in lesson 04.
            sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale
            visible = visible_in_window(offs_m[None, :], offs_n[:, None], S_q, S_k, LEFT, RIGHT, WINDOW)
            pT = tl.where(visible, tl.exp(sT - lse[None, :]), 0.0)
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            pT_kept = pT
            if DROPOUT:  # the same Z as the forward (same key, same counters), transposed
                keepT = tl.trans(dropout_keep(seed, seq_head, start_m, pid_n * BLOCK_N, S_k, threshold,
                                              BLOCK_M, BLOCK_N))
                pT_kept = tl.where(keepT, pT / (1.0 - dropout_p), 0.0)
                dpT = tl.where(keepT, dpT / (1.0 - dropout_p), 0.0)
            dv += tl.dot(pT_kept.to(do.dtype), do, input_precision=DOT_PRECISION)   # dV += (P Z/(1-p))^T dO
            dsT = pT * (dpT - delta[None, :])
            dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)

    dk = dk * scale
    tl.store(dk_base + offs_n[:, None] * stride_dk_s + offs_d[None, :] * stride_dk_d,
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])
    tl.store(dv_base + offs_n[:, None] * stride_dv_s + offs_d[None, :] * stride_dv_d,
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])


def beyond_backward(q, k, v, o, do, lse, layout: Layout, scale: float, window_args: tuple,
                    dropout_p: float, seed: int, *, config: Optional[KernelConfig] = None):
    """dQ, dK, dV for the 4-D views of ``beyond_forward``; delta by lesson 03's kernel."""
    B, H, S_total_q, D = q.shape
    H_kv, S_total_k = k.shape[1], k.shape[2]
    delta = attention_backward_delta(o, do, config=config)
    dq = layout.new(tuple(q.shape), q.dtype, q.device)
    dk = layout.new(tuple(k.shape), k.dtype, k.device)
    dv = layout.new(tuple(v.shape), v.dtype, v.device)
    windowed, left, right = window_args
    common = dict(WINDOW=windowed, DROPOUT=dropout_p > 0, VARLEN=layout.varlen,
                  BLOCK_D=runtime.head_dim_block(D), DOT_PRECISION=runtime.dot_precision(q.dtype, D))
    strides = [layout.strides(t) for t in (q, k, v, do, lse, delta)]

    def run_dq(cfg: KernelConfig) -> None:
        beyond_dq_kernel[(triton.cdiv(layout.S_q, cfg.BLOCK_M), layout.batches * H)](
            q, k, v, do, lse, delta, dq, layout.cu_q, layout.cu_k, *[x for st in strides for x in st],
            *layout.strides(dq), H, H // H_kv, layout.S_q, layout.S_k, D, scale, left, right,
            dropout_p, dropout_threshold(dropout_p), seed,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, **common, **cfg.launch_options())

    def run_dkdv(cfg: KernelConfig) -> None:
        beyond_dkdv_kernel[(triton.cdiv(layout.S_k, cfg.BLOCK_N), layout.batches * H_kv)](
            q, k, v, do, lse, delta, dk, dv, layout.cu_q, layout.cu_k, *[x for st in strides for x in st],
            *layout.strides(dk), *layout.strides(dv), H_kv, H // H_kv, layout.S_q, layout.S_k, D, scale,
            left, right, dropout_p, dropout_threshold(dropout_p), seed,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, **common, **cfg.launch_options())

    configs.launch(("beyond_dq", D, q.dtype, q.device), configs.candidates("dq", D, q.dtype, q.device, config), run_dq)
    configs.launch(("beyond_dkdv", D, q.dtype, q.device), configs.candidates("dkdv", D, q.dtype, q.device, config),
                   run_dkdv)
    return dq, dk, dv


# --------------------------------------------------------------------------------------
# 4. the keep-mask Z itself, for tests and figures only (the kernels above never store it)
# --------------------------------------------------------------------------------------
@triton.jit
def dropout_mask_kernel(KEEP, S_q, S_k, first_seq_head, threshold, seed,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m[:, None]
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    keep = dropout_keep(seed, first_seq_head + head, pid_m * BLOCK_M, pid_n * BLOCK_N, S_k, threshold, BLOCK_M, BLOCK_N)
    tl.store(KEEP + head.to(tl.int64) * S_q * S_k + rows * S_k + cols, keep.to(tl.int8),
             mask=(rows < S_q) & (cols < S_k))


def dropout_mask(seed: int, heads: int, S_q: int, S_k: int, dropout_p: float, device,
                 first_seq_head: int = 0) -> torch.Tensor:
    """Z as the kernels draw it: bool ``[heads, S_q, S_k]`` for (sequence, head) numbers
    ``first_seq_head ...`` (``b * H + h``; for a packed batch, sequence b)."""
    keep = torch.empty((heads, S_q, S_k), dtype=torch.int8, device=device)
    grid = (triton.cdiv(S_q, 32), triton.cdiv(S_k, 32), heads)
    dropout_mask_kernel[grid](keep, S_q, S_k, first_seq_head, dropout_threshold(dropout_p), int(seed),
                              BLOCK_M=32, BLOCK_N=32)
    return keep.bool()
