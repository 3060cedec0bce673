"""Lazy attention in Triton: causal attention with a learnable per-head distance bias and a
learnable per-head tau, forward and backward, gradients for q, k, v, bias and tau.

The operator (``lazy/reference.py`` has the same in plain PyTorch)::

    S[i, j] = q_i . k_j * scale + b[i, j]     b[i, j] = bias[h, i - j] if 0 <= i - j <= W, else 0
    P       = softmax(S) over j <= i          (causal, always)
    A[i, j] = ReLU(P[i, j] + tau[h] / (i + 1)) for j <= i,  0 for j > i
    O       = A V

The kernels, each with its launcher right below it:

1. ``lazy_fwd_kernel``: one program per block of query rows. A ReLU of P + tau/(i+1) needs
   the *normalised* P, which the online softmax only has at the end, so the program walks
   over the keys twice: pass 1 computes the row log-sum-exp (LSE), pass 2 rebuilds
   P = exp(S - LSE) exactly and accumulates O = A V. Saved for the backward: LSE (O(L)).
2. ``lazy_bwd_preprocess_kernel``: the shortcut delta = rowsum(dO * O) of softmax attention
   holds because O = P V; here O = A V, so delta = rowsum(P * dP) must be summed over the keys:
   one more pass, which also sums dTau (each program writes its own partial sum).
3. ``lazy_bwd_dq_kernel``: dQ for a block of query rows, and the partial sums of dBias along
   the diagonals i - j = d of each tile (each program writes its own row of partials).
4. ``lazy_bwd_dkdv_kernel``: dK, dV for a block of key rows, no atomics.

bias and tau are shared by every batch element and position, so their gradients are sums over
the whole grid. Here that is a two-stage reduction: every program writes partial sums to its
own slots of a buffer, and the launcher adds the buffer up (deterministic: no atomics, the
same bits on every run). Every tensor is indexed with its own strides (the lazy-attention log retold in the bug-hunt lab:
dO offset with Q's head stride gave heads 1..H-1 no bias or tau gradient).

Memory: no L x L matrix, in the forward or the backward. Saved for the backward: q, k, v,
bias, tau and LSE. The dBias partials hold one number per (batch, head, query block,
diagonal within the window): O(L * W / BLOCK), O(L) for a fixed window.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import configs, runtime
from ..configs import KernelConfig


# --------------------------------------------------------------------------------------
# input checks and block sizes
# --------------------------------------------------------------------------------------
_PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_lazy_inputs(q, k, v, bias, tau, *, allow_bf16_fallback: bool = False) -> int:
    """Validate the inputs of lazy attention; return the window W (= bias.shape[1] - 1)."""
    runtime.validate_qkv(q, k, v, allow_bf16_fallback=allow_bf16_fallback)
    if k.shape != q.shape:
        raise ValueError(f"lazy attention is causal self-attention: k and v must be shaped like q "
                         f"[B, H, L, D] = {tuple(q.shape)}, got {tuple(k.shape)}")
    H = q.shape[1]
    for name, t, dims, layout in (("bias", bias, 2, f"[H, W+1] = [{H}, W+1]"),
                                  ("tau", tau, 1, f"[H] = [{H}]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {layout}, got {runtime._describe(t)}")
        if t.dim() != dims or t.shape[0] != H or t.numel() == 0:
            raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
        if t.dtype not in _PARAM_DTYPES:
            raise TypeError(f"{name} must be a floating-point tensor "
                            f"({', '.join(map(str, _PARAM_DTYPES))}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    return bias.shape[1] - 1


def lazy_configs(kernel: str, head_dim: int, dtype: torch.dtype, device: torch.device,
                 config: Optional[KernelConfig] = None) -> tuple[KernelConfig, ...]:
    """Configs to try for one of the lazy kernels (``fwd``, ``pre``, ``dq``, ``dkdv``), best
    first: ``configs.candidates`` for ``lazy_<kernel>``. The dQ kernel sums dBias along the
    diagonals of square tiles, so its tiles are made square."""
    cfgs = configs.candidates(f"lazy_{kernel}", head_dim, dtype, device, config)
    if kernel == "dq":
        cfgs = tuple(dataclasses.replace(c, BLOCK_N=c.BLOCK_M) for c in cfgs)
    return cfgs


# --------------------------------------------------------------------------------------
# shared by the kernels: the distance bias of one tile
# --------------------------------------------------------------------------------------
@triton.jit
def lazy_bias_tile(i, j, visible, W, bias_base, stride_bias_w):
    """b[i, j] = bias[h, i - j] where 0 <= i - j <= W (and visible), else 0. ``i``, ``j``: the
    query and key positions, broadcast to the tile's shape (either orientation)."""
    d = i - j
    return tl.load(bias_base + d * stride_bias_w, mask=visible & (d <= W), other=0.0)


# --------------------------------------------------------------------------------------
# 1. forward: pass 1 -> LSE, pass 2 -> O = A V
# --------------------------------------------------------------------------------------
@triton.jit
def lazy_fwd_kernel(
    Q, K, V, BIAS, TAU, O, LSE,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_bias_h, stride_bias_w, stride_tau_h,
    stride_o_b, stride_o_h, stride_o_s, stride_o_d,
    stride_lse_b, stride_lse_h, stride_lse_s,
    H, L, HEAD_DIM, W, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)          # which block of query rows
    pid_bh = tl.program_id(1)         # which (batch, head)
    b = pid_bh // H
    h = pid_bh % H
    # Every tensor with its own strides; 64-bit offsets (B*H*L*D can exceed 2**31).
    q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
    k_base = K + b.to(tl.int64) * stride_k_b + h.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h.to(tl.int64) * stride_v_h
    o_base = O + b.to(tl.int64) * stride_o_b + h.to(tl.int64) * stride_o_h
    lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
    bias_base = BIAS + h.to(tl.int64) * stride_bias_h

    acc_dtype = LSE.dtype.element_ty  # fp32 (fp64 for fp64 inputs)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < L
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    tau = tl.load(TAU + h * stride_tau_h).to(acc_dtype)
    shift = tau / (offs_m + 1).to(acc_dtype)               # tau/(i+1), one per row
    kv_end = tl.minimum(L, start_m + BLOCK_M)              # causal: no key beyond the last row

    # ---- pass 1: the row log-sum-exp of S, by the online softmax -------------------------
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=acc_dtype)
    l_i = tl.zeros([BLOCK_M], dtype=acc_dtype)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < L
        k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(acc_dtype) * scale
        # Padded rows (>= L) keep seeing key 0, so their statistics stay finite.
        visible = col_ok[None, :] & (offs_n[None, :] <= offs_m[:, None])
        if start_m - (start_n + BLOCK_N - 1) <= W:         # the tile reaches into the window
            s += lazy_bias_tile(offs_m[:, None], offs_n[None, :], visible, W,
                                 bias_base, stride_bias_w).to(acc_dtype)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_i = m_new
    lse = m_i + tl.log(l_i)

    # ---- pass 2: P = exp(S - LSE) exactly, A = ReLU(P + tau/(i+1)), O = A V --------------
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < L
        k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(acc_dtype) * scale
        visible = col_ok[None, :] & (offs_n[None, :] <= offs_m[:, None])
        if start_m - (start_n + BLOCK_N - 1) <= W:
            s += lazy_bias_tile(offs_m[:, None], offs_n[None, :], visible, W,
                                 bias_base, stride_bias_w).to(acc_dtype)
        p = tl.exp(s - lse[:, None])
        a = tl.where(visible, tl.maximum(p + shift[:, None], 0.0), 0.0)   # tau/(i+1) on j <= i only
        acc += tl.dot(a.to(v.dtype), v, input_precision=DOT_PRECISION)

    tl.store(o_base + offs_m[:, None] * stride_o_s + offs_d[None, :] * stride_o_d,
             acc.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_base + offs_m * stride_lse_s, lse, mask=row_ok)


def lazy_attention_forward(q, k, v, bias, tau, scale: Optional[float] = None, *,
                           config: Optional[KernelConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Returns ``(O, LSE)``: O like q, LSE ``[B, H, L]`` in fp32
    (fp64 for fp64 inputs). Any strides."""
    W = check_lazy_inputs(q, k, v, bias, tau)
    B, H, L, D = q.shape
    scale = runtime.validate_scale(scale, D)
    w_eff = min(W, L - 1)                 # the kernels see distances up to L - 1 only
    o = runtime.new_output((B, H, L, D), q.dtype, q.device)
    lse = runtime.new_output((B, H, L), runtime.stats_dtype(q.dtype), q.device)

    def run(cfg: KernelConfig) -> None:
        grid = (triton.cdiv(L, cfg.BLOCK_M), B * H)
        lazy_fwd_kernel[grid](
            q, k, v, bias, tau, o, lse,
            *q.stride(), *k.stride(), *v.stride(), *bias.stride(), *tau.stride(),
            *o.stride(), *lse.stride(),
            H, L, D, w_eff, scale,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=runtime.head_dim_block(D),
            DOT_PRECISION=runtime.dot_precision(q.dtype, D), **cfg.launch_options(),
        )

    configs.launch(("lazy_fwd", D, q.dtype, q.device), lazy_configs("fwd", D, q.dtype, q.device, config), run)
    return o, lse


# --------------------------------------------------------------------------------------
# 2. backward preprocess: delta = rowsum(P * dP) and the partial sums of dTau
# --------------------------------------------------------------------------------------
@triton.jit
def lazy_bwd_preprocess_kernel(
    Q, K, V, BIAS, TAU, DO, LSE, DELTA, DTAU_PART,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_bias_h, stride_bias_w, stride_tau_h,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_lse_b, stride_lse_h, stride_lse_s,
    stride_delta_b, stride_delta_h, stride_delta_s,
    stride_dtp_b, stride_dtp_h, stride_dtp_m,
    H, L, HEAD_DIM, W, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
    k_base = K + b.to(tl.int64) * stride_k_b + h.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h.to(tl.int64) * stride_v_h
    do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h   # dO's own strides
    lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
    delta_base = DELTA + b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h
    bias_base = BIAS + h.to(tl.int64) * stride_bias_h

    acc_dtype = LSE.dtype.element_ty
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < L
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d,
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok, other=0.0)
    tau = tl.load(TAU + h * stride_tau_h).to(acc_dtype)
    shift = tau / (offs_m + 1).to(acc_dtype)

    delta = tl.zeros([BLOCK_M], dtype=acc_dtype)          # rowsum(P * dP)
    dp_sum = tl.zeros([BLOCK_M], dtype=acc_dtype)         # rowsum(dP), for dTau
    kv_end = tl.minimum(L, start_m + BLOCK_M)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < L
        k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(acc_dtype) * scale
        # Padded rows (>= L) must add nothing to delta or dTau: they are not visible.
        visible = row_ok[:, None] & col_ok[None, :] & (offs_n[None, :] <= offs_m[:, None])
        if start_m - (start_n + BLOCK_N - 1) <= W:
            s += lazy_bias_tile(offs_m[:, None], offs_n[None, :], visible, W,
                                 bias_base, stride_bias_w).to(acc_dtype)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        da = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION).to(acc_dtype)   # dA = dO V^T
        gate = visible & (p + shift[:, None] > 0)                                  # ReLU'
        dp = tl.where(gate, da, 0.0)                                               # dP = dA * gate
        delta += tl.sum(p * dp, axis=1)
        dp_sum += tl.sum(dp, axis=1)

    tl.store(delta_base + offs_m * stride_delta_s, delta, mask=row_ok)
    # dTau = sum over rows of rowsum(dP) / (i+1): this program's rows, into its own slot.
    dtau = tl.sum(tl.where(row_ok, dp_sum / (offs_m + 1).to(acc_dtype), 0.0), axis=0)
    tl.store(DTAU_PART + b.to(tl.int64) * stride_dtp_b + h.to(tl.int64) * stride_dtp_h
             + pid_m * stride_dtp_m, dtau)


def lazy_attention_backward_preprocess(q, k, v, bias, tau, do, lse, scale: Optional[float] = None, *,
                                       config: Optional[KernelConfig] = None):
    """delta = rowsum(P * dP) ``[B, H, L]`` and dTau ``[H]`` (in tau's dtype).
    dO may have any strides (even 0)."""
    W = check_lazy_inputs(q, k, v, bias, tau)
    runtime.validate_grad_output(do, q)
    B, H, L, D = q.shape
    scale = runtime.validate_scale(scale, D)
    acc_dtype = runtime.stats_dtype(q.dtype)
    w_eff = min(W, L - 1)
    delta = runtime.new_output((B, H, L), acc_dtype, q.device)
    result = {}

    def run(cfg: KernelConfig) -> None:
        n_m = triton.cdiv(L, cfg.BLOCK_M)
        dtau_part = runtime.new_output((B, H, n_m), acc_dtype, q.device)   # one slot per program
        lazy_bwd_preprocess_kernel[(n_m, B * H)](
            q, k, v, bias, tau, do, lse, delta, dtau_part,
            *q.stride(), *k.stride(), *v.stride(), *bias.stride(), *tau.stride(),
            *do.stride(), *lse.stride(), *delta.stride(), *dtau_part.stride(),
            H, L, D, w_eff, scale,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=runtime.head_dim_block(D),
            DOT_PRECISION=runtime.dot_precision(q.dtype, D), **cfg.launch_options(),
        )
        result["dtau_part"] = dtau_part

    configs.launch(("lazy_pre", D, q.dtype, q.device), lazy_configs("pre", D, q.dtype, q.device, config), run)
    # stage 2 of the reduction: add up the partial sums of every batch element and query block
    dtau = runtime.new_output((H,), tau.dtype, q.device)
    dtau.copy_(result["dtau_part"].sum(dim=(0, 2)))
    return delta, dtau


# --------------------------------------------------------------------------------------
# 3. dQ, and dBias summed along the diagonals of each tile
# --------------------------------------------------------------------------------------
@triton.jit
def lazy_bwd_dq_kernel(
    Q, K, V, BIAS, TAU, DO, LSE, DELTA, DQ, DBIAS_PART,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_bias_h, stride_bias_w, stride_tau_h,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_lse_b, stride_lse_h, stride_lse_s,
    stride_delta_b, stride_delta_h, stride_delta_s,
    stride_dq_b, stride_dq_h, stride_dq_s, stride_dq_d,
    stride_dbp_b, stride_dbp_h, stride_dbp_m, stride_dbp_d,
    H, L, HEAD_DIM, W, N_DIAG_BLOCKS, scale,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Square tiles: BLOCK query rows x BLOCK keys. Tile kk steps back from the diagonal holds
    # the distances i - j = kk*BLOCK + (r - c), r, c in [0, BLOCK): two blocks of diagonals.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
    k_base = K + b.to(tl.int64) * stride_k_b + h.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h.to(tl.int64) * stride_v_h
    do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h
    lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
    delta_base = DELTA + b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h
    dq_base = DQ + b.to(tl.int64) * stride_dq_b + h.to(tl.int64) * stride_dq_h
    bias_base = BIAS + h.to(tl.int64) * stride_bias_h
    # this program's own row of dBias partial sums: N_DIAG_BLOCKS blocks of BLOCK diagonals
    dbp_base = (DBIAS_PART + b.to(tl.int64) * stride_dbp_b + h.to(tl.int64) * stride_dbp_h
                + pid_m.to(tl.int64) * stride_dbp_m)

    acc_dtype = LSE.dtype.element_ty
    start_m = pid_m * BLOCK
    offs_r = tl.arange(0, BLOCK)
    offs_m = start_m + offs_r
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < L
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d,
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok, other=0.0)
    delta = tl.load(delta_base + offs_m * stride_delta_s, mask=row_ok, other=0.0)
    tau = tl.load(TAU + h * stride_tau_h).to(acc_dtype)
    shift = tau / (offs_m + 1).to(acc_dtype)

    # Diagonal sums of a tile by a rotation: g[r, u] = ds[r, (r - u) mod BLOCK]. Column u of g
    # then holds the entries with r - c = u (rows r >= u) and r - c = u - BLOCK (rows r < u).
    rotate = (offs_r[:, None] - offs_r[None, :] + BLOCK) % BLOCK
    lower = offs_r[:, None] >= offs_r[None, :]
    carry = tl.zeros([BLOCK], dtype=acc_dtype)     # diagonals kk*BLOCK + u, waiting for tile kk+1

    dq = tl.zeros([BLOCK, BLOCK_D], dtype=acc_dtype)
    for kk in range(0, pid_m + 1):                 # kk = 0 is the diagonal tile; then further back
        start_n = (pid_m - kk) * BLOCK
        offs_n = start_n + offs_r
        col_ok = offs_n < L
        k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(acc_dtype) * scale
        visible = row_ok[:, None] & col_ok[None, :] & (offs_n[None, :] <= offs_m[:, None])
        in_window = kk * BLOCK - (BLOCK - 1) <= W  # the smallest distance in the tile is <= W
        if in_window:
            s += lazy_bias_tile(offs_m[:, None], offs_n[None, :], visible, W,
                                 bias_base, stride_bias_w).to(acc_dtype)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        da = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION).to(acc_dtype)
        gate = visible & (p + shift[:, None] > 0)
        dp = tl.where(gate, da, 0.0)
        ds = p * (dp - delta[:, None])                                    # dS = P * (dP - delta)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)

        if in_window:
            dist = offs_m[:, None] - offs_n[None, :]
            g = tl.gather(tl.where(dist <= W, ds, 0.0), rotate, axis=1)
            lo = tl.sum(tl.where(lower, g, 0.0), axis=0)   # diagonals kk*BLOCK + u
            hi = tl.sum(tl.where(lower, 0.0, g), axis=0)   # diagonals (kk-1)*BLOCK + u
            if kk > 0:  # block kk-1 is complete now (its other half came from tile kk-1)
                tl.store(dbp_base + ((kk - 1) * BLOCK + offs_r) * stride_dbp_d, carry + hi)
            carry = lo

    dq = dq * scale
    tl.store(dq_base + offs_m[:, None] * stride_dq_s + offs_d[None, :] * stride_dq_d,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    # The last window tile's lower half has no tile beyond it; then zeros for the diagonal
    # blocks this program never reached (its rows are too close to the start of the sequence).
    k_last = tl.minimum(pid_m, (W + BLOCK - 1) // BLOCK)
    if k_last < N_DIAG_BLOCKS:
        tl.store(dbp_base + (k_last * BLOCK + offs_r) * stride_dbp_d, carry)
    for kk in range(k_last + 1, N_DIAG_BLOCKS):
        tl.store(dbp_base + (kk * BLOCK + offs_r) * stride_dbp_d, tl.zeros([BLOCK], dtype=acc_dtype))


def lazy_attention_backward_dq(q, k, v, bias, tau, do, lse, delta, scale: Optional[float] = None, *,
                               config: Optional[KernelConfig] = None):
    """dQ ``[B, H, L, D]`` and dBias ``[H, W+1]`` (in bias's dtype), from the forward's LSE and
    the preprocess's delta. The config's BLOCK_N is set to its BLOCK_M (square tiles)."""
    W = check_lazy_inputs(q, k, v, bias, tau)
    runtime.validate_grad_output(do, q)
    B, H, L, D = q.shape
    scale = runtime.validate_scale(scale, D)
    acc_dtype = runtime.stats_dtype(q.dtype)
    dq = runtime.new_output((B, H, L, D), q.dtype, q.device)
    w_eff = min(W, L - 1)                 # distances beyond L - 1 never occur
    result = {}

    def run(cfg: KernelConfig) -> None:
        block = cfg.BLOCK_M
        n_m = triton.cdiv(L, block)
        n_diag = triton.cdiv(w_eff + 1, block)
        # one row of partial sums per (batch, head, query block): written, never accumulated
        part = runtime.new_output((B, H, n_m, n_diag * block), acc_dtype, q.device)
        lazy_bwd_dq_kernel[(n_m, B * H)](
            q, k, v, bias, tau, do, lse, delta, dq, part,
            *q.stride(), *k.stride(), *v.stride(), *bias.stride(), *tau.stride(),
            *do.stride(), *lse.stride(), *delta.stride(), *dq.stride(), *part.stride(),
            H, L, D, w_eff, n_diag, scale,
            BLOCK=block, BLOCK_D=runtime.head_dim_block(D),
            DOT_PRECISION=runtime.dot_precision(q.dtype, D), **cfg.launch_options(),
        )
        result["part"] = part

    configs.launch(("lazy_dq", D, q.dtype, q.device), lazy_configs("dq", D, q.dtype, q.device, config), run)
    # stage 2: add up the partial sums over batch elements and query blocks
    dbias = runtime.new_output((H, W + 1), bias.dtype, q.device)
    dbias[:, :w_eff + 1] = result["part"].sum(dim=(0, 2))[:, :w_eff + 1]
    dbias[:, w_eff + 1:] = 0      # distances >= L never occur
    return dq, dbias


# --------------------------------------------------------------------------------------
# 4. dK, dV: one program per block of key rows, looping over the query blocks
# --------------------------------------------------------------------------------------
@triton.jit
def lazy_bwd_dkdv_kernel(
    Q, K, V, BIAS, TAU, DO, LSE, DELTA, DK, DV,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_bias_h, stride_bias_w, stride_tau_h,
    stride_do_b, stride_do_h, stride_do_s, stride_do_d,
    stride_lse_b, stride_lse_h, stride_lse_s,
    stride_delta_b, stride_delta_h, stride_delta_s,
    stride_dk_b, stride_dk_h, stride_dk_s, stride_dk_d,
    stride_dv_b, stride_dv_h, stride_dv_s, stride_dv_d,
    H, L, HEAD_DIM, W, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)          # which block of key/value rows
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q_base = Q + b.to(tl.int64) * stride_q_b + h.to(tl.int64) * stride_q_h
    k_base = K + b.to(tl.int64) * stride_k_b + h.to(tl.int64) * stride_k_h
    v_base = V + b.to(tl.int64) * stride_v_b + h.to(tl.int64) * stride_v_h
    do_base = DO + b.to(tl.int64) * stride_do_b + h.to(tl.int64) * stride_do_h
    lse_base = LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
    delta_base = DELTA + b.to(tl.int64) * stride_delta_b + h.to(tl.int64) * stride_delta_h
    bias_base = BIAS + h.to(tl.int64) * stride_bias_h

    acc_dtype = LSE.dtype.element_ty
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < L
    d_ok = offs_d < HEAD_DIM
    k = tl.load(k_base + offs_n[:, None] * stride_k_s + offs_d[None, :] * stride_k_d,
                mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_v_s + offs_d[None, :] * stride_v_d,
                mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    tau = tl.load(TAU + h * stride_tau_h).to(acc_dtype)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)
    # Causal: key j is seen by rows i >= j only: start at the query block holding row start_n.
    for start_m in range((start_n // BLOCK_M) * BLOCK_M, L, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < L
        q = tl.load(q_base + offs_m[:, None] * stride_q_s + offs_d[None, :] * stride_q_d,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_do_s + offs_d[None, :] * stride_do_d,
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(lse_base + offs_m * stride_lse_s, mask=row_ok, other=0.0)
        delta = tl.load(delta_base + offs_m * stride_delta_s, mask=row_ok, other=0.0)
        shift = tau / (offs_m + 1).to(acc_dtype)

        # The transposed tile [BLOCK_N keys, BLOCK_M queries]: P^T, A^T and dS^T come out
        # directly in the shape dV += A^T dO and dK += dS^T Q need.
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION).to(acc_dtype) * scale
        # padded query rows (>= L) must give P = 0, or they pollute every row of dK and dV
        visible = row_ok[None, :] & col_ok[:, None] & (offs_n[:, None] <= offs_m[None, :])
        if start_m - (start_n + BLOCK_N - 1) <= W:
            sT += lazy_bias_tile(offs_m[None, :], offs_n[:, None], visible, W,
                                  bias_base, stride_bias_w).to(acc_dtype)
        pT = tl.where(visible, tl.exp(sT - lse[None, :]), 0.0)
        aT = tl.where(visible, tl.maximum(pT + shift[None, :], 0.0), 0.0)
        dv += tl.dot(aT.to(do.dtype), do, input_precision=DOT_PRECISION)             # dV += A^T dO
        daT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION).to(acc_dtype)   # dA^T = V dO^T
        dpT = tl.where(visible & (pT + shift[None, :] > 0), daT, 0.0)
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)             # dK += dS^T Q

    dk = dk * scale
    dk_base = DK + b.to(tl.int64) * stride_dk_b + h.to(tl.int64) * stride_dk_h
    dv_base = DV + b.to(tl.int64) * stride_dv_b + h.to(tl.int64) * stride_dv_h
    tl.store(dk_base + offs_n[:, None] * stride_dk_s + offs_d[None, :] * stride_dk_d,
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])
    tl.store(dv_base + offs_n[:, None] * stride_dv_s + offs_d[None, :] * stride_dv_d,
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])

# Copies on purpose: the dQ and dK/dV kernels above are lessons 03's and 04's plus the bias, tau
# and ReLU gate, and the lazy kernels repeat each other's argument lists and pointer setup.
# Notebook 07 prints each one whole, to be read against the lessons': a helper would hide those lines.


def lazy_attention_backward_dkdv(q, k, v, bias, tau, do, lse, delta, scale: Optional[float] = None, *,
                                 config: Optional[KernelConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV ``[B, H, L, D]``."""
    W = check_lazy_inputs(q, k, v, bias, tau)
    runtime.validate_grad_output(do, q)
    B, H, L, D = q.shape
    scale = runtime.validate_scale(scale, D)
    w_eff = min(W, L - 1)
    dk = runtime.new_output((B, H, L, D), k.dtype, k.device)
    dv = runtime.new_output((B, H, L, D), v.dtype, v.device)

    def run(cfg: KernelConfig) -> None:
        lazy_bwd_dkdv_kernel[(triton.cdiv(L, cfg.BLOCK_N), B * H)](
            q, k, v, bias, tau, do, lse, delta, dk, dv,
            *q.stride(), *k.stride(), *v.stride(), *bias.stride(), *tau.stride(),
            *do.stride(), *lse.stride(), *delta.stride(), *dk.stride(), *dv.stride(),
            H, L, D, w_eff, scale,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=runtime.head_dim_block(D),
            DOT_PRECISION=runtime.dot_precision(q.dtype, D), **cfg.launch_options(),
        )

    configs.launch(("lazy_dkdv", D, q.dtype, q.device), lazy_configs("dkdv", D, q.dtype, q.device, config), run)
    return dk, dv


def lazy_attention_backward(q, k, v, bias, tau, do, lse, scale: Optional[float] = None, *,
                            needs_dq: bool = True, needs_dkdv: bool = True, needs_dbias: bool = True,
                            config: Optional[KernelConfig] = None):
    """The whole backward: preprocess (delta, dTau), then dQ (and dBias), then dK/dV.
    Returns ``(dq, dk, dv, dbias, dtau)``; a gradient not asked for is None (the dQ kernel
    runs if dQ or dBias is needed, the dK/dV kernel if dK or dV is)."""
    delta, dtau = lazy_attention_backward_preprocess(q, k, v, bias, tau, do, lse, scale, config=config)
    dq = dk = dv = dbias = None
    if needs_dq or needs_dbias:
        dq, dbias = lazy_attention_backward_dq(q, k, v, bias, tau, do, lse, delta, scale, config=config)
    if needs_dkdv:
        dk, dv = lazy_attention_backward_dkdv(q, k, v, bias, tau, do, lse, delta, scale, config=config)
    return (dq if needs_dq else None), dk, dv, (dbias if needs_dbias else None), dtau


# --------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------
class LazyAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, tau, scale: float):
        o, lse = lazy_attention_forward(q, k, v, bias, tau, scale)
        # O is not needed: delta comes from rowsum(P * dP), rebuilt from LSE. Nothing L x L.
        ctx.save_for_backward(q, k, v, bias, tau, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, bias, tau, lse = ctx.saved_tensors
        nq, nk, nv, nb, nt = ctx.needs_input_grad[:5]
        # dO goes in with its own strides (a view, a transpose, the stride-0 expansion of
        # out.sum()): no .contiguous() copy, and the kernels never borrow Q's strides for it.
        dq, dk, dv, dbias, dtau = lazy_attention_backward(
            q, k, v, bias, tau, do, lse, ctx.scale,
            needs_dq=nq, needs_dkdv=nk or nv, needs_dbias=nb)
        return (dq, dk if nk else None, dv if nv else None, dbias, dtau if nt else None, None)


def lazy_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                   tau: torch.Tensor, *, scale: Optional[float] = None) -> torch.Tensor:
    """Causal lazy attention: O = ReLU(softmax(Q K^T * scale + b) + tau/(i+1)) V.

    q, k, v ``[B, H, L, D]`` (any strides); bias ``[H, W+1]``: b[h, i, j] = bias[h, i - j] for
    0 <= i - j <= W, no bias further back; tau ``[H]``, added as tau[h]/(i+1) to the visible
    entries j <= i of row i (a row of A sums to 1 + tau where the ReLU does not clip).
    scale defaults to 1/sqrt(D). Gradients flow to whichever of q, k, v, bias, tau require them.

    bf16 where it cannot be multiplied (the CPU interpreter, GPUs before sm 8.0) runs in fp32
    and is cast back, with a :class:`~flashattn.runtime.BF16FallbackWarning`.
    """
    check_lazy_inputs(q, k, v, bias, tau, allow_bf16_fallback=True)
    scale = runtime.validate_scale(scale, q.shape[-1])
    kernel_dtype = runtime.compute_dtype(q.dtype, q.device)
    if kernel_dtype != q.dtype:
        out = LazyAttentionFunction.apply(q.to(kernel_dtype), k.to(kernel_dtype), v.to(kernel_dtype),
                                          bias, tau, scale)
        return out.to(q.dtype)
    return LazyAttentionFunction.apply(q, k, v, bias, tau, scale)
