"""Plain-PyTorch attention that materialises everything: the oracle.

Forward::

    S   = Q K^T * scale                 [S_q, S_k]   (causal: S_ij = -inf where j > i)
    LSE = logsumexp(S, dim=-1)          [S_q]
    P   = exp(S - LSE)                  [S_q, S_k]   (= softmax(S))
    O   = P V                           [S_q, D]

Backward, given dO::

    dV    = P^T dO
    dP    = dO V^T
    delta = rowsum(dO * O)              (= rowsum(P * dP), see notebook 01)
    dS    = P * (dP - delta)
    dQ    = dS K * scale
    dK    = dS^T Q * scale

With grouped-query attention (H query heads sharing H_kv key/value heads) K and V are
repeated to H heads, and dK, dV are summed back over each group.

Everything is computed in ``dtype`` (float64 by default), so the result is an oracle for any
kernel that runs in fp16/bf16/fp32. It costs O(S_q * S_k) memory per head: small sizes only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch


@dataclass
class AttentionReference:
    """All tensors of one attention forward (and backward, if dO was given)."""

    S: torch.Tensor
    P: torch.Tensor
    LSE: torch.Tensor
    O: torch.Tensor
    dO: Optional[torch.Tensor] = None
    dP: Optional[torch.Tensor] = None
    delta: Optional[torch.Tensor] = None
    dS: Optional[torch.Tensor] = None
    dQ: Optional[torch.Tensor] = None
    dK: Optional[torch.Tensor] = None
    dV: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        parts = [f"{f.name}={tuple(getattr(self, f.name).shape)}" for f in fields(self)
                 if getattr(self, f.name) is not None]
        return "AttentionReference(" + ", ".join(parts) + ")"


def causal_mask(S_q: int, S_k: int, device=None) -> torch.Tensor:
    """True where query i may see key j, i.e. j <= i (SDPA's ``is_causal``, top-left aligned)."""
    i = torch.arange(S_q, device=device)[:, None]
    j = torch.arange(S_k, device=device)[None, :]
    return j <= i


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H, S, D], each K/V head repeated for the query heads of its group."""
    group = n_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def sum_groups(dx: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, H_kv, S, D]: the gradient of ``repeat_kv`` (a broadcast becomes a sum)."""
    B, H, S, D = dx.shape
    return dx.reshape(B, n_kv_heads, H // n_kv_heads, S, D).sum(dim=2)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: Optional[torch.Tensor] = None,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    dtype: torch.dtype = torch.float64,
) -> AttentionReference:
    """Forward (and backward if ``do`` is given) by the explicit formulas, in ``dtype``."""
    H, H_kv, D = q.shape[1], k.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k_full, v_full = repeat_kv(k, H), repeat_kv(v, H)

    S = (q @ k_full.transpose(-1, -2)) * scale
    if causal:
        S = S.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    LSE = torch.logsumexp(S, dim=-1)
    P = torch.exp(S - LSE[..., None])
    O = P @ v_full
    ref = AttentionReference(S=S, P=P, LSE=LSE, O=O)
    if do is None:
        return ref

    do = do.to(dtype)
    dV = P.transpose(-1, -2) @ do
    dP = do @ v_full.transpose(-1, -2)
    delta = (do * O).sum(dim=-1)
    dS = P * (dP - delta[..., None])
    dQ = (dS @ k_full) * scale
    dK = (dS.transpose(-1, -2) @ q) * scale
    ref.dO, ref.dP, ref.delta, ref.dS = do, dP, delta, dS
    ref.dQ, ref.dK, ref.dV = dQ, sum_groups(dK, H_kv), sum_groups(dV, H_kv)
    return ref


def attention_autograd(q, k, v, *, causal: bool = False, scale: Optional[float] = None):
    """The same forward written for autograd to differentiate (no hand-written backward)."""
    H, D = q.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k_full, v_full = repeat_kv(k, H), repeat_kv(v, H)
    S = (q @ k_full.transpose(-1, -2)) * scale
    if causal:
        S = S.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    return torch.softmax(S, dim=-1) @ v_full
