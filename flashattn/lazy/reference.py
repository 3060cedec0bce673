"""Lazy attention in plain PyTorch: the oracle for the Triton kernels in ``lazy.py``.

The operator (always causal; q, k, v ``[B, H, L, D]``, bias ``[H, W+1]``, tau ``[H]``)::

    S[i, j] = q_i . k_j * scale + b[i, j],   b[i, j] = bias[h, i - j] if 0 <= i - j <= W, else 0
    P       = softmax(S) over the visible keys j <= i
    A[i, j] = ReLU(P[i, j] + tau[h] / (i + 1))   for j <= i,     A[i, j] = 0 for j > i
    O       = A V

Rows. ``i`` counts from 0, so row ``i`` has exactly ``i + 1`` visible keys and ``tau/(i+1)`` is
added to each of them, never to the hidden keys ``j > i``: where the ReLU does not clip, a row of
A sums to ``1 + tau``. ``tau > 0`` spreads extra mass evenly over the row; ``tau < 0`` removes
``|tau|/(i+1)`` from every entry and the ReLU zeroes the small ones: the row becomes sparse.
Keys further than W back are still attended, with no bias.

Backward, given dO (the formulas the kernels implement; ``gate`` is the ReLU's derivative)::

    dV    = A^T dO
    dA    = dO V^T
    gate  = 1[P + tau/(i+1) > 0]  on j <= i           (0 on j > i)
    dP    = dA * gate
    delta = rowsum(P * dP)                            (NOT rowsum(dO * O): O = A V, not P V)
    dS    = P * (dP - delta)
    dQ    = dS K * scale,   dK = dS^T Q * scale
    dBias[h, d] = sum of dS[b, h, i, j] over all b and i - j = d     (d <= W)
    dTau[h]     = sum of dP[b, h, i, j] / (i + 1) over all b, i, j <= i

Everything here materialises L x L matrices: small sizes only (per batch element on a GPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch


# --------------------------------------------------------------------------------------
# the forward, written for autograd to differentiate
# --------------------------------------------------------------------------------------
def distance_bias(bias: torch.Tensor, L: int) -> torch.Tensor:
    """``[H, L, L]`` matrix b with b[h, i, j] = bias[h, i - j] for 0 <= i - j <= W, else 0.
    Differentiable in ``bias`` (an index into it, masked)."""
    # A Toeplitz matrix cut out of one padded vector with unfold: v[L-1+d] = bias[d], and row i
    # of the result is v[L-1+i-j] over j. Its backward is a strided sum. (Indexing bias with an
    # L x L matrix of distances gives the same values, but its backward scatters L^2 numbers
    # into W+1 bins, which on a GPU means atomics fighting over a handful of addresses: it made
    # the materialised baseline of lazy.bench ~50x slower than it needs to be.)
    H, n = bias.shape[0], min(bias.shape[-1], L)          # only distances 0..L-1 occur
    v = torch.cat([bias.new_zeros(H, L - 1), bias[:, :n], bias.new_zeros(H, L - n)], dim=1)
    return v.flip(1).unfold(1, L, 1).flip(1)


@dataclass
class LazyParts:
    """The intermediate matrices of one lazy-attention forward, ``[B, H, L, L]`` (O: ``[B, H, L, D]``)."""

    S: torch.Tensor
    P: torch.Tensor
    A: torch.Tensor
    O: torch.Tensor
    LSE: torch.Tensor

    def __repr__(self) -> str:
        return "LazyParts(" + ", ".join(f"{f.name}={tuple(getattr(self, f.name).shape)}"
                                        for f in fields(self)) + ")"


def random_inputs(B: int, H: int, L: int, D: int, W: int, *, dtype=torch.float32, device="cpu",
                  taus=None, q_layout: str = "contiguous", generator: Optional[torch.Generator] = None):
    """Random inputs of lazy attention: ``(q, k, v, do, bias, tau)``, q, k, v, do ``[B, H, L, D]``
    in ``dtype``; bias ``[H, W+1]`` and tau ``[H]`` in fp32, like a trained model's parameters
    (``taus`` default: evenly from -0.8 to 0.8). ``q_layout="bshd"``: q as a projection gives
    it, ``[B, L, H, D]`` viewed as ``[B, H, L, D]`` (a head stride unlike dO's)."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q = randn(B, L, H, D).transpose(1, 2) if q_layout == "bshd" else randn(B, H, L, D)
    k, v, do = randn(B, H, L, D), randn(B, H, L, D), randn(B, H, L, D)
    bias = (0.5 * torch.randn(H, W + 1, generator=generator)).to(device)
    tau = torch.linspace(-0.8, 0.8, H) if taus is None else torch.as_tensor(taus, dtype=torch.float32)
    return q, k, v, do, bias, tau.to(device)


def lazy_attention_reference(q, k, v, bias, tau, *, scale: Optional[float] = None,
                             dtype: Optional[torch.dtype] = torch.float64,
                             return_parts: bool = False):
    """Lazy attention by its formula, in ``dtype`` (float64 by default; None keeps q's dtype).

    Differentiable in q, k, v, bias and tau through ordinary autograd: the gradients of this
    function are the oracle for the kernels' backward. Returns O ``[B, H, L, D]`` (or a
    :class:`LazyParts` with S, P, A, O, LSE if ``return_parts``).
    """
    L, D = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if dtype is not None:
        q, k, v, bias, tau = (t.to(dtype) for t in (q, k, v, bias, tau))
    i = torch.arange(L, device=q.device)
    causal = i[None, :] <= i[:, None]                                   # j <= i
    S = (q @ k.transpose(-1, -2)) * scale + distance_bias(bias, L)
    S = S.masked_fill(~causal, float("-inf"))
    LSE = torch.logsumexp(S, dim=-1)
    P = torch.softmax(S, dim=-1)
    shift = tau[:, None, None] / (i + 1).to(q.dtype)[:, None]           # [H, L, 1]: tau/(i+1)
    A = torch.relu(P + shift) * causal                                  # only on j <= i
    O = A @ v
    if return_parts:
        return LazyParts(S=S, P=P, A=A, O=O, LSE=LSE)
    return O


def lazy_gradients_autograd(q, k, v, bias, tau, do, *, scale: Optional[float] = None,
                            dtype: torch.dtype = torch.float64) -> dict:
    """O, dQ, dK, dV, dBias, dTau by autograd through :func:`lazy_attention_reference`, in
    ``dtype``. dBias and dTau are summed over the batch given. For large inputs call it per
    batch element and add up dBias and dTau (see :func:`lazy_gradients_per_batch`)."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v, bias, tau)]
    out = lazy_attention_reference(*leaves, scale=scale, dtype=None)
    grads = torch.autograd.grad(out, leaves, do.to(dtype))
    return dict(zip(("O", "dQ", "dK", "dV", "dBias", "dTau"), (out.detach(),) + grads))


def lazy_gradients_per_batch(q, k, v, bias, tau, do, *, scale: Optional[float] = None,
                             dtype: torch.dtype = torch.float64) -> dict:
    """:func:`lazy_gradients_autograd` one batch element at a time (an L x L matrix per head
    instead of per batch and head), with dBias and dTau summed over the batch."""
    parts = [lazy_gradients_autograd(q[b:b + 1], k[b:b + 1], v[b:b + 1], bias, tau, do[b:b + 1],
                                     scale=scale, dtype=dtype) for b in range(q.shape[0])]
    out = {n: torch.cat([p[n] for p in parts]) for n in ("O", "dQ", "dK", "dV")}
    out["dBias"] = sum(p["dBias"] for p in parts)
    out["dTau"] = sum(p["dTau"] for p in parts)
    return out


# --------------------------------------------------------------------------------------
# the backward, written out formula by formula (what the kernels compute, tile by tile)
# --------------------------------------------------------------------------------------
def lazy_backward_formulas(q, k, v, bias, tau, do, *, scale: Optional[float] = None,
                           dtype: torch.dtype = torch.float64) -> dict:
    """Every intermediate of the backward, by the explicit formulas (no autograd), in ``dtype``:
    P, A, O, dA, gate, dP, delta, delta_wrong (= rowsum(dO * O), the shortcut that fails here),
    dS, dQ, dK, dV, dBias ``[H, W+1]``, dTau ``[H]``."""
    L, D = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q, k, v, bias, tau, do = (t.to(dtype) for t in (q, k, v, bias, tau, do))
    parts = lazy_attention_reference(q, k, v, bias, tau, scale=scale, dtype=None, return_parts=True)
    P, A, O = parts.P, parts.A, parts.O
    i = torch.arange(L, device=q.device)
    causal = i[None, :] <= i[:, None]
    inv_count = 1.0 / (i + 1).to(dtype)                                  # 1/(i+1) per row
    dV = A.transpose(-1, -2) @ do
    dA = do @ v.transpose(-1, -2)
    gate = causal & (P + tau[:, None, None] * inv_count[:, None] > 0)
    dP = dA * gate
    delta = (P * dP).sum(-1)
    dS = P * (dP - delta[..., None])
    dQ = dS @ k * scale
    dK = dS.transpose(-1, -2) @ q * scale
    W = bias.shape[-1] - 1
    dBias = diagonal_sums(dS.sum(0), W)                                  # [H, W+1]
    dTau = (dP.sum(-1) * inv_count).sum(dim=(0, 2))                      # [H]
    return dict(P=P, A=A, O=O, dA=dA, gate=gate, dP=dP, delta=delta,
                delta_wrong=(do * O).sum(-1), dS=dS, dQ=dQ, dK=dK, dV=dV, dBias=dBias, dTau=dTau)


def diagonal_sums(M: torch.Tensor, W: int) -> torch.Tensor:
    """``[..., W+1]``: entry d is the sum of M[..., i, i - d] over i (the d-th diagonal below
    the main one); 0 for diagonals that do not exist (d >= L)."""
    L = M.shape[-1]
    out = M.new_zeros(M.shape[:-2] + (W + 1,))
    for d in range(min(W, L - 1) + 1):
        out[..., d] = torch.diagonal(M, offset=-d, dim1=-2, dim2=-1).sum(-1)
    return out
