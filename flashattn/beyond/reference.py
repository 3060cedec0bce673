"""The float64 oracle of lesson 09: dense attention with a window and an explicit dropout mask,
and a packed batch computed one sequence at a time. Gradients come from autograd in float64."""
from __future__ import annotations

from typing import Optional

import torch

from .kernels import dropout_mask


def window_mask(S_q: int, S_k: int, causal: bool = False, window=None, device=None) -> torch.Tensor:
    """bool ``[S_q, S_k]``: True where query i sees key j (top-left aligned, like ``causal``)."""
    i = torch.arange(S_q, device=device)[:, None]
    j = torch.arange(S_k, device=device)[None, :]
    visible = torch.ones(S_q, S_k, dtype=torch.bool, device=device)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return visible


def attention_reference(q, k, v, causal: bool = False, scale: Optional[float] = None, window=None,
                        keep: Optional[torch.Tensor] = None, dropout_p: float = 0.0):
    """(O, LSE) in float64. q ``[B, H, S_q, D]``, k, v ``[B, H_kv, S_k, D]``; ``keep``: the
    dropout mask Z, bool ``[B, H, S_q, S_k]`` (None: no dropout). A row that sees no key: O = 0,
    LSE = +inf (as the kernels)."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    visible = window_mask(q.shape[2], k.shape[2], causal, window, q.device)
    s = torch.where(visible, q @ k.transpose(-1, -2) * scale, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])   # 0 on empty rows
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    return p @ v, torch.where(torch.isfinite(lse), lse, float("inf"))


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = False, scale=None, window=None,
                     dropout_p: float = 0.0, seed: Optional[int] = None, return_lse: bool = False):
    """O ``[total_q, H, D]`` (float64) of a packed batch, sequence by sequence; with dropout, each
    sequence's mask is the one the kernels draw from ``seed``. ``return_lse``: (O, LSE
    ``[total_q, H]``)."""
    H = q.shape[1]
    outs, lses = [], []
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        q_b, k_b, v_b = (t[s].permute(1, 0, 2)[None] for t, s in ((q, qs), (k, ks), (v, ks)))
        keep = None
        if dropout_p > 0:
            keep = dropout_mask(seed, H, q_b.shape[2], k_b.shape[2], dropout_p, q.device, first_seq_head=b * H)[None]
        o, lse = attention_reference(q_b, k_b, v_b, causal, scale, window, keep, dropout_p)
        outs.append(o[0].permute(1, 0, 2))
        lses.append(lse[0].T)
    return (torch.cat(outs, dim=0), torch.cat(lses, dim=0)) if return_lse else torch.cat(outs, dim=0)


def packed_mask(cu_seqlens_q, cu_seqlens_k, causal: bool = False, window=None) -> torch.Tensor:
    """bool ``[total_q, total_k]``: which packed query row sees which packed key -- blocks on the
    diagonal, one per sequence, each with its own causal / window pattern."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    mask = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
    for b in range(len(cu_q) - 1):
        mask[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = window_mask(cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b],
                                                                     causal, window)
    return mask


def kernels_and_reference(q, k, v, do=None, *, causal: bool = False, window=None, dropout_p: float = 0.0,
                          seed: int = 7, varlen=None, impl: str = "auto", config=None) -> dict:
    """Run the kernels and the float64 oracle on the same inputs (and the same dropout mask) and
    return ``{name: (kernels', oracle's)}`` for O, dQ, dK, dV, shaped as the inputs.

    ``varlen``: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` for packed
    ``[total, H, D]`` inputs. ``do``: the gradient of O (default: random). ``impl``: which
    kernels ("teaching", "fast", "auto"; see ``flash_attention``)."""
    from .attention import flash_attention, flash_attention_varlen

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    kw = dict(causal=causal, window=window, dropout_p=dropout_p, seed=seed, impl=impl, config=config)
    o = flash_attention_varlen(q, k, v, *varlen, **kw) if varlen else flash_attention(q, k, v, **kw)
    do = torch.randn_like(o) if do is None else do
    o.backward(do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    if varlen:
        ref = varlen_reference(qd, kd, vd, varlen[0], varlen[1], causal, None, window, dropout_p, seed)
    else:
        B, H, S_q, _ = q.shape
        keep = None
        if dropout_p > 0:
            keep = dropout_mask(seed, B * H, S_q, k.shape[2], dropout_p, q.device).view(B, H, S_q, k.shape[2])
        ref, _ = attention_reference(qd, kd, vd, causal, None, window, keep, dropout_p)
    ref.backward(do.double())
    return {"O": (o, ref), "dQ": (q.grad, qd.grad), "dK": (k.grad, kd.grad), "dV": (v.grad, vd.grad)}
