"""Lesson 09's entry points: ``flash_attention`` with windows and dropout on ``[B, H, S, D]``
tensors, and ``flash_attention_varlen`` on packed ``[total, H, D]`` batches (FlashAttention's
``cu_seqlens`` layout, as ``torch.nn.attention.varlen.varlen_attn`` takes it). Both run the
kernels of ``kernels.py`` through one ``torch.autograd.Function``.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from .. import runtime
from ..configs import KernelConfig
from .kernels import Layout, beyond_backward, beyond_forward, window_bounds


class BeyondAttentionFunction(torch.autograd.Function):
    """O from q, k, v (4-D views); the backward regenerates P from LSE and Z from the seed."""

    @staticmethod
    def forward(ctx, q, k, v, layout, scale, window_args, dropout_p, seed, config):
        o, lse = beyond_forward(q, k, v, layout, scale, window_args, dropout_p, seed, config=config)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (layout, scale, window_args, dropout_p, seed, config)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        layout, scale, window_args, dropout_p, seed, config = ctx.args
        dq, dk, dv = beyond_backward(q, k, v, o, do, lse, layout, scale, window_args, dropout_p, seed,
                                     config=config)
        return dq, dk, dv, None, None, None, None, None, None


def validate_window(window) -> Optional[tuple[int, int]]:
    """None, or (left, right) with each an int >= 0, or -1 for "no limit" on that side."""
    if window is None:
        return None
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window must be a pair of ints (left, right), got {window!r}")
    if any(w < -1 for w in window):
        raise ValueError(f"window sides must be >= 0, or -1 for no limit, got {tuple(window)}")
    return int(window[0]), int(window[1])


def validate_dropout(dropout_p, seed, S_q: int, S_k: int) -> tuple[float, int]:
    """(dropout_p, seed): p in [0, 1); without a seed one is drawn from torch's default generator,
    so ``torch.manual_seed`` makes a run reproducible."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and S_q * S_k > 2 ** 32:
        raise ValueError(f"dropout counts elements of one head with 32 bits: S_q * S_k must be at most "
                         f"2**32, got {S_q} * {S_k}")
    if seed is None:
        seed = int(torch.randint(0, 2 ** 31 - 1, (1,)).item()) if dropout_p > 0 else 0
    elif isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2 ** 31:
        raise ValueError(f"seed must be an int in [0, 2**31), got {seed!r}")
    return float(dropout_p), int(seed)


def _in_kernel_dtype(q, k, v):
    dtype = runtime.compute_dtype(q.dtype, q.device)      # bf16 without bf16 dots: fp32, warned
    return tuple(t.to(dtype) for t in (q, k, v))


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: Optional[float] = None, window=None, dropout_p: float = 0.0,
                    seed: Optional[int] = None, config: Optional[KernelConfig] = None) -> torch.Tensor:
    """``flashattn.flash_attention`` plus a sliding window and dropout.

    q ``[B, H, S_q, D]``, k and v ``[B, H_kv, S_k, D]``, any strides. ``window=(left, right)``:
    query i sees keys i - left ... i + right (-1: no limit on that side), aligned top-left like
    ``causal``, which is the window (-1, 0) and narrows any window's right side to 0. (FlashAttention
    aligns windows bottom-right when S_q != S_k; for S_q == S_k the two agree.) A row that sees no
    key gets O = 0. ``dropout_p``: each attention weight is dropped with probability p and the rest
    scaled by 1 / (1 - p), the mask drawn from ``seed`` (default: from torch's generator).
    """
    runtime.validate_qkv(q, k, v, allow_bf16_fallback=True)
    causal = runtime.validate_causal(causal)
    scale = runtime.validate_scale(scale, q.shape[-1])
    window = validate_window(window)
    dropout_p, seed = validate_dropout(dropout_p, seed, q.shape[2], k.shape[2])
    layout = Layout(q, k)
    q_, k_, v_ = _in_kernel_dtype(q, k, v)
    o = BeyondAttentionFunction.apply(q_, k_, v_, layout, scale,
                                      window_bounds(window, causal, layout.S_q, layout.S_k), dropout_p, seed, config)
    return o.to(q.dtype)


def validate_cu_seqlens(cu, name: str, total: int, device) -> tuple[torch.Tensor, list[int]]:
    """cu_seqlens as the kernels read it (int32, contiguous) and the lengths it describes."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
        got = f"shape {tuple(cu.shape)}, dtype {cu.dtype}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise TypeError(f"{name} must be a 1-D int32 tensor [n_sequences + 1], got {got}")
    if cu.numel() < 2:
        raise ValueError(f"{name} must hold at least two offsets (one sequence), got {cu.tolist()}")
    offsets = [int(x) for x in cu.tolist()]
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]} ({name}={offsets})")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name} must not decrease (each entry is where a sequence starts), got {offsets}")
    if offsets[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {offsets[-1]}")
    return cu.to(device=device, dtype=torch.int32).contiguous(), [b - a for a, b in zip(offsets, offsets[1:])]


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                           scale: Optional[float] = None, window=None, dropout_p: float = 0.0,
                           seed: Optional[int] = None, config: Optional[KernelConfig] = None) -> torch.Tensor:
    """Attention over a packed batch: q ``[total_q, H, D]``, k and v ``[total_k, H_kv, D]``;
    sequence b holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and the matching rows of k, v,
    and attends only inside itself. ``max_seqlen_*``: the longest sequence (it sizes the grid).
    ``causal``, ``window``, ``dropout_p`` as in :func:`flash_attention`, in positions inside each
    sequence. Returns O ``[total_q, H, D]``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be packed 3-D [total, heads, D], got {got}")
    q4, k4, v4 = (t.permute(1, 0, 2)[None] for t in (q, k, v))        # [1, H, total, D] views
    runtime.validate_qkv(q4, k4, v4, allow_bf16_fallback=True)
    cu_q, lens_q = validate_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device)
    cu_k, lens_k = validate_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], q.device)
    if len(lens_q) != len(lens_k):
        raise ValueError(f"cu_seqlens_q describes {len(lens_q)} sequences and cu_seqlens_k {len(lens_k)}")
    for name, given, lens in (("max_seqlen_q", max_seqlen_q, lens_q), ("max_seqlen_k", max_seqlen_k, lens_k)):
        if not isinstance(given, numbers.Integral) or given < max(lens):
            raise ValueError(f"{name} must be an int >= the longest sequence ({max(lens)}), got {given!r}")
    causal = runtime.validate_causal(causal)
    scale = runtime.validate_scale(scale, q.shape[-1])
    window = validate_window(window)
    dropout_p, seed = validate_dropout(dropout_p, seed, max(lens_q), max(lens_k))
    q_, k_, v_ = _in_kernel_dtype(q4, k4, v4)
    layout = Layout(q_, k_, cu_q, cu_k, max(max(lens_q), 1), max(max(lens_k), 1))
    o = BeyondAttentionFunction.apply(q_, k_, v_, layout, scale,
                                      window_bounds(window, causal, layout.S_q, layout.S_k), dropout_p, seed, config)
    return o[0].permute(1, 0, 2).to(q.dtype)
